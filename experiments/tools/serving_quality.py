r"""How far serving a benchmark target from its exports moves held-out log loss.

  python3 -m experiments.measure serving_quality --target=dhen/large --plans_dir=WORKDIR/plans \
      [--mods=no_bias,blocknorm] [--probe_steps=100] [--out=FILE.json]

For a target the bench planned (`experiments.bench`, its plans under WORKDIR/plans), scores on
the probe's trained parameters, paired example by example with bf16+Mods: bf16+Mods served
from its all-bf16 export, LoKA's training plan served from its export, and its serving plan
(plan_serve.json, with --serve_plan) where it exists. Validation judges the plans' forwards as
training runs them; the export serves them with e4m3 weights stored once and static
activation scales, and a serving plan adds FP8 forwards judged on accuracy alone, so this is
the served model's own quality check. The probe's checkpoint is used where it is; elsewhere
its training run is made again (as validation does). Writes the measurements as JSON (default:
the target's plan folder, serving_quality_report.json; the bench's own gate writes
serve_quality.json there) and prints a table.
"""
import os

from absl import app, flags

from experiments import common_flags  # the common flags (--mods, --seed), defined once

TARGET = flags.DEFINE_string("target", None, "model/preset, or tower/BxWIDTHxDEPTH.",
                             required=True)
PLANS = flags.DEFINE_string("plans_dir", None, "The bench's plan folder (WORKDIR/plans).",
                            required=True)
PROBE_STEPS = flags.DEFINE_integer("probe_steps", 100, "The bench's config.probe.steps.")
BATCH = flags.DEFINE_integer("batch_size", 0,
                             "The bench's config.targets.batch_size (0: the preset's).")
OUT = flags.DEFINE_string("out", None,
                          "JSON file (default: PLAN_FOLDER/serving_quality_report.json).")


def main(argv):
  del argv
  from loka_jax import jsonio
  from experiments.bench import mods_set, planning, suite
  from loka_jax.dispatch import read_plan, serve_quality
  from loka_jax.train import experiment

  experiment.quiet_library_logs()
  try:
    target = suite.parse_target(TARGET.value, BATCH.value or None)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  settings = suite.SpeedSettings(plans_dir=PLANS.value, probe_steps=PROBE_STEPS.value,
                                 seed=common_flags.SEED.value,
                                 mods=mods_set.of_flag(common_flags.MODS.value))
  folder = planning.plan_dir(settings.plans_root, target.model, target.preset)
  plans = {name: os.path.join(folder, file) for name, file in
           ((serve_quality.TRAINING_PLAN, planning.PLAN_FILE),
            (serve_quality.SERVING_PLAN, planning.SERVING_PLAN_FILE))
           if os.path.exists(os.path.join(folder, file))}
  if serve_quality.TRAINING_PLAN not in plans:
    raise app.UsageError(f"no plan at {os.path.join(folder, planning.PLAN_FILE)}: plan the "
                         "target with experiments.bench first")
  report = planning.load_report(settings.plans_root, target.model, target.preset)
  ctx = suite.probe_context(target, settings)()
  print(f"[serving_quality] {target.name}: scoring {', '.join(plans)} and served bf16+Mods "
        f"on {ctx.source.num_eval_examples()} held-out examples", flush=True)
  measured = serve_quality.served_quality(
      ctx, {name: read_plan(path) for name, path in plans.items()}, report)
  out = OUT.value or os.path.join(folder, "serving_quality_report.json")
  jsonio.write_json_atomic(out, {"target": target.name, "mods_set": mods_set.label(settings.mods),
                                 "plans": plans, "served": measured})
  print(serve_quality.table(measured))
  print(f"[serving_quality] wrote {out}")

