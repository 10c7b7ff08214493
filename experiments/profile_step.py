r"""Profile whole train and inference steps: device time per GEMM site and pass, per kernel class.

  python -m experiments.profile_step --model=wukong --preset=large \
      --variants=bf16,flax_fp8_delayed,loka --plans_dir=DIR/plans --workdir=DIR/profile

  python -m experiments.profile_step --tower=16384x4096x4 --variants=bf16,fp8_tensorwise

  python -m experiments.profile_step --model=dlrm --preset=large --mods=no_bias,blocknorm \
      --variants=bf16_mods,flax_fp8_delayed,loka --plans_dir=DIR/plans --workdir=DIR/profile

Every variant is built as the headline benchmark builds it (`experiments.bench`: one shared
training state, LoKA from its plan under --plans_dir, inference of LoKA from its exported
model; --mods sets the Mods of the Mods arms as the bench's does, LoKA's plan then read from
that set's folder under --plans_dir), each step runs --iterations times under the JAX
profiler, and the device kernels of the trace are attributed to GEMM sites through the
compiled HLO's op names. Writes WORKDIR/profile.json, WORKDIR/profile.md, WORKDIR/profile.png
(each step's device time in parts: the GEMM sites' forward and backward, the largest scopes
outside them), the raw traces under WORKDIR/traces/ and each step's compiled HLO (what XLA
fused) under WORKDIR/hlo/ (`experiments.hlo_scope` compares one scope of two of them). Needs
a GPU for device kernels: a CPU run has none and says so.

  python -m experiments.profile_step --render=DIR/profile.json

draws a saved profile again (FILE.json -> FILE.png) and prints its tables, on any machine.
"""
import json
import os

from absl import app, flags

from experiments import common_flags  # noqa: F401  (the common flags, defined once)
from loka_jax import xla_env

TOWER = flags.DEFINE_string("tower", None, "Profile an MLP tower BxWIDTHxDEPTH instead.")
VARIANTS = flags.DEFINE_list("variants", ["bf16", "bf16_mods"],
                             "Variants as in experiments.bench (bf16 is always first).")
PLANS = flags.DEFINE_string("plans_dir", None, "Plans of the LoKA variant (as the bench's).")
BATCH = flags.DEFINE_integer("batch_size", 0, "Batch size; 0: the target's.")
ITERATIONS = flags.DEFINE_integer("iterations", 5, "Profiled steps per variant and mode.")
RENDER = flags.DEFINE_string(
    "render", None, "A saved profile.json: draw its plot (FILE.png beside it) and print its "
    "tables with this version's layout; nothing is measured.")
COMMAND_BUFFERS = flags.DEFINE_bool(
    "command_buffers", False,
    "Keep XLA's CUDA-graph command buffers. Off by default: a kernel launched from a command "
    "buffer names the buffer (`command_buffer_N`) as its HLO op, not its own instruction, so "
    "its time cannot be split by site (a tower's profile on an H200 put 92% of a bf16 "
    "train step outside the sites).")


def _render(path: str) -> None:
  from experiments.bench import plots, profile
  try:
    with open(path) as f:
      saved = json.load(f)
    profiles, title = saved["profiles"], f"{saved['target']} on {saved['device']}"
    table = profile.markdown(profiles)
  except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
    raise app.UsageError(f"{path}: not a profile.json written by this script ({e!r})") from e
  png = plots.profile_plot(profiles, os.path.splitext(path)[0] + ".png", title)
  print(f"# Step profile: {title}\n\n{table}\n\n[profile] plot: {png}")


def main(argv):
  del argv
  if RENDER.value:
    return _render(RENDER.value)
  if not COMMAND_BUFFERS.value:  # read when JAX starts its GPU backend, so before any use
    xla_env.add_xla_flags("--xla_gpu_enable_command_buffer=")
  import jax
  from loka_jax import _compat, jsonio
  from experiments.bench import mods_set, planning, plots, profile, serving, speed, suite
  from experiments.bench.variants import PLAN, parse_variants
  from loka_jax.models.presets import site_products
  from loka_jax.models.site import SiteConfig

  workdir = common_flags.WORKDIR.value or "profile_run"
  batch_size = BATCH.value or None
  target = (suite.tower_targets([TOWER.value], batch_size)[0] if TOWER.value else
            suite.model_targets([common_flags.MODEL.value], [common_flags.PRESET.value],
                                    batch_size)[0])
  try:
    mods = mods_set.of_flag(common_flags.MODS.value)
  except ValueError as e:
    raise app.UsageError(f"--mods: {e}") from e
  settings = suite.SpeedSettings(plans_dir=PLANS.value or os.path.join(workdir, "plans"),
                                 probe=False, seed=common_flags.SEED.value, mods=mods)
  subject = mods_set.subject(target.model, target.preset, mods_set.label(mods))
  batch = target.source(settings.seed).train_batch(0, target.batch())
  bench = speed.TargetBench(batch, seed=settings.seed, min_call_s=0.0)  # one step per call
  bf16 = target.build(SiteConfig.for_precision("bf16"))
  sites = list(site_products(bf16, None, batch))
  arms = {"bf16": bench.set_baseline(bf16)}
  arm_mods = {"bf16": []}
  for v in parse_variants(VARIANTS.value)[1:]:
    v = mods_set.apply(v, settings.mods)
    plan, fields, missing = suite.plan_for(target, v, batch, settings)
    if missing:
      raise SystemExit(f"variant {v.name}: {missing} (plans under {settings.plans_root})")
    model = target.build(speed.site_config(v, plan), v.mods)
    arm = bench.add(v.name, model)
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
                                    ITERATIONS.value)
      # What XLA fused: the compiled module, to read a top kernel's fusion beside the table.
      hlo_file = os.path.join(workdir, "hlo", f"{name}_{mode}.txt")
      os.makedirs(os.path.dirname(hlo_file), exist_ok=True)
      with open(hlo_file, "w") as f:
        f.write(arm.hlo[mode])
      kernels, spans = profile.device_events(trace)
      profiles[key] = profile.split(kernels, profile.hlo_op_names(arm.hlo[mode]), sites,
                                    steps=ITERATIONS.value, spans=spans)
      print(f"[profile] {key}: {profiles[key]['device_us_per_step']:,.0f} us of device "
            f"kernels per step", flush=True)
  if not _compat.on_gpu():
    print("[profile] not on a GPU: the trace holds no device kernels, so the tables are "
          "empty; run this on the GPU host", flush=True)
  device = jax.devices()[0].device_kind
  jsonio.write_json_atomic(os.path.join(workdir, "profile.json"),
                           {"target": subject, "device": device, "sites": sites,
                            "mods_set": mods_set.label(mods), "variant_mods": arm_mods,
                            "command_buffers": COMMAND_BUFFERS.value, "profiles": profiles})
  table = profile.markdown(profiles)
  with open(os.path.join(workdir, "profile.md"), "w") as f:
    f.write(f"# Step profile: {subject} on {device}\n\n{table}\n")
  print(table)
  if any(p["device_us_per_step"] for p in profiles.values()):  # a CPU run has nothing to draw
    png = plots.profile_plot(profiles, os.path.join(workdir, "profile.png"),
                             f"{subject} on {device}")
    print(f"[profile] plot: {png}")


if __name__ == "__main__":
  app.run(main)
