r"""Profile whole train and inference steps: device time per GEMM site and pass, per kernel class.

  python3 -m experiments.profile_step --workdir=DIR/profile --config.target.preset=large \
      --config.variants.names=bf16,flax_fp8_delayed,loka --config.variants.plans_dir=DIR/plans

  python3 -m experiments.profile_step --config.target.tower=16384x4096x4 \
      --config.variants.names=bf16,fp8_tensorwise

  python3 -m experiments.profile_step --workdir=DIR/profile --config.target.model=dlrm \
      --config.target.preset=large --config.variants.mods=no_bias,blocknorm \
      --config.variants.names=bf16_mods,flax_fp8_delayed,loka --config.variants.plans_dir=DIR/plans

Settings come from experiments/configs/profile_step.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Every variant is built as the headline
benchmark builds it (`experiments.bench`: one shared training state, or one each with
variants.own_states as the training loop runs them, LoKA from its plan under
variants.plans_dir, inference of LoKA from its exported model; variants.mods sets the Mods of
the Mods arms as the bench's targets.mods does, LoKA's plan then read from that set's folder),
each step runs profile.iterations times under the JAX profiler, and the device kernels of the
trace are attributed to GEMM sites through the compiled HLO's op names. Writes
WORKDIR/profile.json, WORKDIR/profile.md, WORKDIR/profile.png (each step's device time in
parts: the GEMM sites' forward and backward, the largest scopes outside them), the raw traces
under WORKDIR/traces/ and each step's compiled HLO (what XLA fused) under WORKDIR/hlo/
(`experiments.report hlo_scope` compares one scope of two of them). Needs a GPU for device
kernels: a CPU run has none and says so.

  python3 -m experiments.profile_step --config.render=DIR/profile.json

draws a saved profile again (FILE.json -> FILE.png) and prints its tables, on any machine.
"""
import json
import os
import sys

from absl import app, flags

from experiments import run_config
from loka_jax import xla_env

CONFIG = run_config.define_config_flag("profile_step")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", "profile_run", "Where the profile, its traces and "
                              "each step's compiled HLO are written.")


def _render(path: str) -> None:
  from experiments.bench import plots, profile
  try:
    with open(path) as f:
      saved = json.load(f)
    profiles, title = saved["profiles"], f"{saved['target']} on {saved['device']}"
    table = profile.markdown(profiles)
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    sys.exit(f"error: {path}: not a profile.json written by this script ({e!r})")
  png = plots.profile_plot(profiles, os.path.splitext(path)[0] + ".png", title)
  print(f"# Step profile: {title}\n\n{table}\n\n[profile] plot: {png}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = CONFIG.value
  if config.render:
    return _render(config.render)
  if not config.profile.command_buffers:  # read when JAX starts its GPU backend: before any use
    xla_env.add_xla_flags("--xla_gpu_enable_command_buffer=")
  import jax
  from loka_jax import _compat, jsonio
  from experiments.bench import mods_set, planning, plots, profile, serving, speed, suite
  from experiments.bench.variants import PLAN, parse_variants
  from loka_jax.models.presets import site_products
  from loka_jax.models.site import SiteConfig

  workdir, target_config, variants = WORKDIR.value, config.target, config.variants
  iterations = config.profile.iterations
  batch_size = target_config.batch_size or None
  target = (suite.tower_targets([target_config.tower], batch_size)[0] if target_config.tower
            else suite.model_targets([target_config.model], [target_config.preset],
                                     batch_size)[0])
  try:
    mods = mods_set.of_flag(list(run_config.split(variants.mods)))
  except ValueError as e:
    sys.exit(f"error: --config.variants.mods: {e}")
  try:
    chosen = parse_variants(list(run_config.split(variants.names)))
  except ValueError as e:
    sys.exit(f"error: --config.variants.names: {e}")
  settings = suite.SpeedSettings(plans_dir=variants.plans_dir or os.path.join(workdir, "plans"),
                                 probe=False, seed=target_config.seed, mods=mods)
  subject = mods_set.subject(target.model, target.preset, mods_set.label(mods))
  batch = target.source(settings.seed).train_batch(0, target.batch())
  bench = speed.TargetBench(batch, seed=settings.seed, min_call_s=0.0,  # one step per call
                            own_states=variants.own_states)
  bf16 = target.build(SiteConfig.for_precision("bf16"))
  sites = list(site_products(bf16, None, batch))
  arms = {"bf16": bench.set_baseline(bf16)}
  arm_mods = {"bf16": []}
  for v in chosen[1:]:
    v = mods_set.apply(v, settings.mods)
    plan, fields, missing = suite.plan_for(target, v, batch, settings)
    if missing:
      sys.exit(f"error: variant {v.name}: {missing} (plans under {settings.plans_root})")
    model = target.build(speed.site_config(v, plan), v.mods)
    try:
      arm = bench.add(v.name, model)
    except speed.StateMemoryError as e:
      sys.exit(f"error: {e}")
    if v.kernels_from == PLAN:
      report = planning.load_report(settings.plans_root, target.model, target.preset)
      arm, _ = serving.serve_exported(bench, arm, model, fields["plan"], report)
    arms[v.name], arm_mods[v.name] = arm, list(v.mods)

  profiles = {}
  for name, arm in arms.items():
    for mode in ("train", "infer"):
      key = f"{name} {mode}"
      trace = profile.profile_calls({key: getattr(arm, mode)},
                                    os.path.join(workdir, "traces", f"{name}_{mode}"),
                                    iterations)
      # What XLA fused: the compiled module, to read a top kernel's fusion beside the table.
      hlo_file = os.path.join(workdir, "hlo", f"{name}_{mode}.txt")
      os.makedirs(os.path.dirname(hlo_file), exist_ok=True)
      with open(hlo_file, "w") as f:
        f.write(arm.hlo[mode])
      kernels, spans = profile.device_events(trace)
      profiles[key] = profile.split(kernels, profile.hlo_op_names(arm.hlo[mode]), sites,
                                    steps=iterations, spans=spans)
      print(f"[profile] {key}: {profiles[key]['device_us_per_step']:,.0f} us of device "
            f"kernels per step", flush=True)
  if not _compat.on_gpu():
    print("[profile] not on a GPU: the trace holds no device kernels, so the tables are "
          "empty; run this on the GPU host", flush=True)
  device = jax.devices()[0].device_kind
  jsonio.write_json_atomic(os.path.join(workdir, "profile.json"),
                           {"target": subject, "device": device, "sites": sites,
                            "mods_set": mods_set.label(mods), "variant_mods": arm_mods,
                            "command_buffers": config.profile.command_buffers,
                            "own_states": variants.own_states,
                            "profiles": profiles})
  table = profile.markdown(profiles)
  with open(os.path.join(workdir, "profile.md"), "w") as f:
    f.write(f"# Step profile: {subject} on {device}\n\n{table}\n")
  print(table)
  if any(p["device_us_per_step"] for p in profiles.values()):  # a CPU run has nothing to draw
    png = plots.profile_plot(profiles, os.path.join(workdir, "profile.png"),
                             f"{subject} on {device}")
    print(f"[profile] plot: {png}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
