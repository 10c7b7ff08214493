r"""How far FP8 forwards move held-out log loss on fixed parameters, all sites and each alone.

  python3 -m experiments.measure held_out_sites --model=wukong --preset=tiny --mods=all \
      --steps=200 --num_eval=65536 --workdir=DIR

Trains bf16 (with --mods) for --steps, or reuses a finished run in --workdir, then for each
kernel of --kernels measures the relative held-out log-loss change against that model with the
kernel in every pass of all --sites together, and of each site alone (with --one_program,
each site alone again through one program of switched sites, compared; with --gradients also
each site's gradient change, validation's shadow ranking, per site and through one program:
`validate.gradient_change`, `gradient_one_program`). It is the measurement
validation's held-out check makes per site (`validate.held_out_change`): the parameters are
the same, so only the kernel's numerics move it, and the check's budget (0.02%) can be read
against it. Each change comes with its standard error over the eval examples
(`validate.held_out_change_se`): a change within about two of them is one this eval set
cannot tell from none. Writes WORKDIR/held_out_sites.json and prints a table.
"""
import os
import re
import time

from absl import app, flags

from experiments import common_flags as common  # noqa: F401  (the common flags, defined once)

KERNELS = flags.DEFINE_list("kernels", ["flax_fp8_delayed_fwd", "xla_fp8_tensorwise"],
                            "Kernels to put at the sites, one at a time.")
SITES = flags.DEFINE_string("sites", ".*", "Regex (fullmatch) of the sites to measure.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 65536, "Held-out examples.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Training batch size.")
EVAL_BATCH = flags.DEFINE_integer("eval_batch_size", 4096, "Held-out evaluation batch size.")
ONE_PROGRAM = flags.DEFINE_bool(
    "one_program", False, "Also measure each site alone through one compiled program of all "
    "the sites behind runtime switches (`validate.held_out_change_switched`, validation's "
    "`held_out_one_program`), and report how far its values are from the per-site programs' "
    "and the seconds each way.")
GRADIENTS = flags.DEFINE_bool(
    "gradients", False, "With --one_program: also each site's gradient change on the trained "
    "parameters (the training checks' ranking, `validate.gradient_change`) from its own "
    "program and from one program of switched sites (`gradient_one_program`), compared.")
GRAD_BATCHES = flags.DEFINE_integer("grad_batches", 2, "Training batches each gradient sums.")


def main(argv):
  del argv
  from loka_jax import jsonio
  from loka_jax.dispatch import pipeline, validate
  from loka_jax.kernels import KernelChoice, KernelPlan, registry
  from loka_jax.models.presets import site_products
  from loka_jax.train import experiment
  from loka_jax.train.loop import train

  if GRADIENTS.value and not ONE_PROGRAM.value:
    raise SystemExit("--gradients compares the two ways of measuring: add --one_program")
  unknown = [k for k in KERNELS.value if k not in registry.names()]
  if unknown:
    raise SystemExit(f"--kernels: unknown {unknown}; registered: {sorted(registry.names())}")
  workdir = common.WORKDIR.value or "held_out_sites_run"
  spec, config = common.reference_run(NUM_EVAL.value, BATCH_SIZE.value)
  model, source, _ = experiment.build_run(spec)
  names = list(site_products(model, None, source.train_batch(0, 8)))
  sites = [s for s in names if re.fullmatch(SITES.value, s)]
  if not sites:  # before any training
    raise SystemExit(f"--sites={SITES.value!r} matches none of the model's sites: {names}")
  train(model, source, os.path.join(workdir, "run"), config, run_info=spec.run_info())
  ctx = pipeline.context_for_run(spec, os.path.join(workdir, "run"), config)

  base = validate.held_out(ctx, validate.BASELINE, EVAL_BATCH.value)
  out = {"spec": spec.run_info(), "steps": config.steps, "num_eval": base["num_examples"],
         "logloss": base["logloss"], "changes": {}, "standard_errors": {}}
  for kernel in KERNELS.value:
    choice = KernelChoice.uniform(kernel)
    every = KernelPlan(sites=tuple((s, choice) for s in sites), rules=(),
                       default=validate.BASELINE.default)
    rel, se = validate.held_out_change_se(ctx, every, EVAL_BATCH.value)
    changes, errors = {"all": rel}, {"all": se}
    began = time.time()
    for i, site in enumerate(sites):
      changes[site], errors[site] = validate.held_out_change_se(
          ctx, validate.only_site(site, choice), EVAL_BATCH.value)
      print(f"[held_out_sites] {kernel} {i + 1}/{len(sites)} {site}: "
            f"{100 * changes[site]:+.4f}% +- {100 * errors[site]:.4f}%", flush=True)
    out["changes"][kernel] = changes
    out["standard_errors"][kernel] = errors
    if ONE_PROGRAM.value:
      per_site_s, began = time.time() - began, time.time()
      wanted = {s: choice for s in sites}
      switched = {s: validate.held_out_change_switched(ctx, wanted, s, EVAL_BATCH.value)
                  for s in sites}
      gaps = {s: switched[s] - changes[s] for s in sites}
      out.setdefault("one_program", {})[kernel] = {
          "changes": switched, "minus_per_site": gaps, "seconds": time.time() - began,
          "per_site_seconds": per_site_s,
          "max_gap_in_standard_errors": max(abs(g) / errors[s] if errors[s] else 0.0
                                            for s, g in gaps.items())}
      print(f"[held_out_sites] {kernel}: one program {time.time() - began:.1f}s, per-site "
            f"programs {per_site_s:.1f}s; largest gap "
            f"{out['one_program'][kernel]['max_gap_in_standard_errors']:.3f} standard errors",
            flush=True)
    if GRADIENTS.value:
      out.setdefault("gradients", {})[kernel] = compare_gradients(ctx, wanted)
  jsonio.write_json_atomic(os.path.join(workdir, "held_out_sites.json"), out)

  print(f"\nHeld-out log loss of the bf16 model: {base['logloss']:.5f} on "
        f"{base['num_examples']:,} examples; relative change with each kernel, +- one "
        "standard error over the eval examples:\n")
  print("| site | " + " | ".join(KERNELS.value) + " |")
  print("|---|" + "---|" * len(KERNELS.value))
  for site in ["all"] + sites:
    print(f"| {site} | " + " | ".join(
        f"{100 * out['changes'][k][site]:+.4f}% +- {100 * out['standard_errors'][k][site]:.4f}%"
        for k in KERNELS.value) + " |")


def compare_gradients(ctx, wanted):
  """Each site's gradient change from its own program and from one switched program, the
  largest gap relative to the site's own change, and the seconds each way."""
  from loka_jax.dispatch import validate
  out = {}
  for way, board in (("per_site", None), ("one_program", wanted)):
    began = time.time()
    reference = {}
    out[way] = {s: validate.gradient_change(ctx, s, c, GRAD_BATCHES.value, board, reference)
                for s, c in wanted.items()}
    out[f"{way}_seconds"] = time.time() - began
  out["max_relative_gap"] = max(abs(out["one_program"][s] - v) / v if v else 0.0
                                for s, v in out["per_site"].items())
  print(f"[held_out_sites] gradient changes: one program {out['one_program_seconds']:.1f}s, "
        f"per-site programs {out['per_site_seconds']:.1f}s; largest relative gap "
        f"{out['max_relative_gap']:.4f}", flush=True)
  return out

