r"""Sharded training benchmark, resumable: step time, scaling efficiency and loss on 1 and N
GPUs, with bf16 or FP8 collectives.

  python -m experiments.bench_parallel --workdir=DIR --compile_cache=/tmp/jc \
      [--model=wukong] [--presets=small,large] [--devices=1,2] [--collectives=bf16,fp8] \
      [--loss_steps=100] [--max_minutes=8] [--only=small]

Variants of one preset: `1dev` (the training loop's own single-device step, the baseline)
and `<n>dev_<mode>` (the sharded step on an n-device mesh `data:n,model:1`: every device
takes its share of the batch, tables replicated; `--model_axis=all` makes it
`data:1,model:n`, every device holding rows/n of every table, which needs every table's
vocabulary divisible by n: the presets' Criteo-like vocabularies are not). `--scaling=weak` (default) gives n devices
n x --batch_size examples per step, `strong` keeps the global batch. Rows go to
DIR/parallel.jsonl:
  kind=speed  one per preset: every variant timed in the same run (interleaved, except for
              presets in --sequential whose states do not fit side by side), median step
              time and CI, throughput, throughput ratio to 1dev and scaling efficiency
              (throughput_n / (n * throughput_1)) with bootstrap CIs;
  kind=loss   one per (preset, variant): training loss after --loss_steps steps on the same
              batches from the same initial state.
A rerun skips finished rows; no new row starts after --max_minutes. The last lines printed
are a table of every row so far.
"""
import os
import time

from absl import app, flags

from experiments.tools import subcommands
from experiments import common_flags as common

PRESETS = flags.DEFINE_list("presets", ["small"], "Presets of --model to run.")
DEVICES = flags.DEFINE_list("devices", ["1", "2"], "Device counts (1 = the plain step).")
COLLECTIVES = flags.DEFINE_list("collectives", ["bf16", "fp8"],
                                "Collective modes of the sharded variants (fp32, bf16, fp8).")
MODEL_AXIS = flags.DEFINE_enum("model_axis", "1", ("all", "1"),
                               "Tables row-sharded over every device ('all': data:1,model:n) "
                               "or replicated ('1': data:n,model:1).")
BATCH = flags.DEFINE_integer("batch_size", 0, "Batch of one device; 0: the preset's.")
SCALING = flags.DEFINE_enum("scaling", "weak", ("weak", "strong"),
                            "weak: n devices train on n x --batch_size examples per step; "
                            "strong: every variant uses the same global batch.")
REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repeats per variant (interleaved).")
LOSS_STEPS = flags.DEFINE_integer("loss_steps", 100, "Training steps of every loss row.")
SEQUENTIAL = flags.DEFINE_list("sequential", ["large"],
                               "Presets timed one variant at a time (memory).")
MAX_MINUTES = flags.DEFINE_float("max_minutes", 8.0, "Start no new row after this long.")
ONLY = flags.DEFINE_list("only", [], "Only these presets or variants.")
COMPILE_CACHE = flags.DEFINE_string("compile_cache", "/tmp/jc",
                                    "Persistent compilation cache (keep it out of --workdir).")

KEY_FIELDS = ("kind", "model", "preset", "precision", "batch_size", "scaling", "variant",
              "loss_steps")


def _log(message: str) -> None:
  print(f"[bench_parallel] {message}", flush=True)


def variant_names(devices, modes):
  names = []
  for n in devices:
    names += ["1dev"] if n == 1 else [f"{n}dev_{m}" for m in modes]
  return names


def _mesh_spec(n: int) -> str:
  return f"data:1,model:{n}" if MODEL_AXIS.value == "all" else f"data:{n},model:1"


class Variant:
  """One way to run the train step: builds its state and its jitted step lazily."""

  def __init__(self, name, model, tx, source, base_batch, seed, optim):
    self.name = name
    self.model, self.tx, self.seed, self.optim = model, tx, seed, optim
    self.devices = int(name.split("dev")[0])
    self.mode = name.split("_", 1)[1] if "_" in name else None
    self.batch_size = base_batch * (self.devices if SCALING.value == "weak" else 1)
    self.host_batch = source.train_batch(0, self.batch_size)

  def build(self):
    """(state, step, device batch) of this variant, freshly initialized from the seed."""
    import jax
    from loka_jax import parallel
    from loka_jax.train import compiled_steps, create_train_state
    if self.devices == 1:
      step, _ = compiled_steps(self.model, self.optim, "stop")
      state = create_train_state(self.model, self.tx, self.host_batch, self.seed)
      return state, step, jax.device_put(self.host_batch, jax.devices()[0]), None
    mesh = parallel.build_mesh(_mesh_spec(self.devices), jax.devices()[:self.devices])
    state = parallel.init_sharded_state(self.model, self.tx, self.host_batch, self.seed, mesh)
    batch = parallel.shard_batch(self.host_batch, mesh)
    step = parallel.make_train_step(self.model, self.tx, mesh, state, batch,
                                    parallel.ParallelConfig(collectives=self.mode))
    return state, step, batch, mesh


def _timed_call(step, state, batch):
  holder = {"state": state}

  def call():
    holder["state"], out = step(holder["state"], batch)
    return out["loss"]
  return call, holder


def speed_row(variants, preset, sequential, device, precision):
  import jax
  import numpy as np
  from loka_jax import timing
  timings, meshes = {}, {}
  groups = [[v] for v in variants] if sequential else [variants]
  for group in groups:
    calls, holders = {}, []
    for v in group:
      state, step, batch, mesh = v.build()
      calls[v.name], holder = _timed_call(step, state, batch)
      holders.append(holder)
      meshes[v.name] = mesh
    timings.update(timing.time_calls(calls, repeats=REPEATS.value, warmup=3))
    del calls, holders
    jax.clear_caches()
  base = timings.get("1dev")
  rng = np.random.default_rng(0)
  results = {}
  for v in variants:
    t = timings[v.name]
    lo, hi = t.ci_us(rng)
    entry = {"devices": v.devices, "collectives": v.mode, "batch_size": v.batch_size,
             "mesh": None if v.devices == 1 else _mesh_spec(v.devices),
             "median_ms": t.median_us / 1e3, "ci_ms": [lo / 1e3, hi / 1e3],
             "examples_per_s": v.batch_size / (t.median_us * 1e-6)}
    if base is not None:
      # Throughput ratio = batch ratio x time ratio; efficiency = ratio / devices.
      s, slo, shi = timing.speedup_ci(base, t)
      grow = v.batch_size / next(x.batch_size for x in variants if x.name == "1dev")
      entry.update(throughput_ratio=s * grow, throughput_ratio_ci=[slo * grow, shi * grow],
                   efficiency=s * grow / v.devices,
                   efficiency_ci=[slo * grow / v.devices, shi * grow / v.devices])
    results[v.name] = entry
  return {"kind": "speed", "preset": preset, "variant": "all", "loss_steps": None, "device": device, "precision": precision,
          "interleaved": not sequential, "repeats": REPEATS.value, "variants": results}


def loss_row(v, source, preset, steps, device, precision):
  import jax
  import numpy as np
  from loka_jax import parallel
  state, step, _, mesh = v.build()
  losses, oks = [], []
  start = time.time()
  for i in range(steps):
    host = source.train_batch(i, v.batch_size)
    batch = (jax.device_put(host, jax.devices()[0]) if mesh is None
             else parallel.shard_batch(host, mesh))
    state, out = step(state, batch)
    losses.append(out["loss"])
    oks.append(out["ok"])
  losses = np.asarray(jax.device_get(losses), np.float64)
  skipped = int(np.sum(~np.asarray(jax.device_get(oks), bool)))
  seconds = time.time() - start
  jax.clear_caches()
  return {"kind": "loss", "preset": preset, "variant": v.name, "global_batch": v.batch_size,
          "loss_steps": steps, "device": device, "precision": precision,
          "devices": v.devices, "collectives": v.mode,
          "final_loss": float(losses[-1]), "mean_last10": float(losses[-10:].mean()),
          "finite": bool(np.isfinite(losses).all()), "skipped_steps": skipped,
          "wall_s": seconds}


def print_table(rows, log):
  log("model/preset   variant       batch   step ms (95% CI)          ex/s   thr.ratio "
      " efficiency  loss@N")
  losses = {(r["model"], r["preset"], r["variant"]): r for r in rows if r["kind"] == "loss"}
  for r in sorted((r for r in rows if r["kind"] == "speed"),
                  key=lambda r: (r["model"], r["preset"])):
    for name, e in r["variants"].items():
      loss = losses.get((r["model"], r["preset"], name))
      ci = e["ci_ms"]
      log(f"{r['model']}/{r['preset']:<7} {name:<12} {e['batch_size']:6d} "
          f"{e['median_ms']:8.2f} [{ci[0]:.2f}, {ci[1]:.2f}]  {e['examples_per_s']:10.0f}  "
          f"{e.get('throughput_ratio', float('nan')):7.3f}  "
          f"{e.get('efficiency', float('nan')):9.3f}  "
          + (f"{loss['mean_last10']:.5f}" if loss else "-"))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  workdir = common.WORKDIR.value or os.environ.get("OUT") or "parallel_results"
  os.makedirs(workdir, exist_ok=True)
  cache = os.path.abspath(COMPILE_CACHE.value)
  if cache.startswith(os.path.abspath(workdir) + os.sep):
    raise app.UsageError("--compile_cache must lie outside --workdir (results only there)")
  import jax
  jax.config.update("jax_compilation_cache_dir", cache)
  from loka_jax import _compat
  from experiments.bench.results import ResultsFile
  from loka_jax.train import OptimConfig, experiment, make_optimizer

  experiment.quiet_library_logs()
  start = time.time()
  deadline = start + MAX_MINUTES.value * 60
  device = jax.devices()[0].device_kind
  if not _compat.on_gpu():
    _log("warning: not on a GPU; these timings are smoke tests, not results")
  rows = ResultsFile(os.path.join(workdir, "parallel.jsonl"), KEY_FIELDS)
  counts = sorted({int(n) for n in DEVICES.value})
  usable = [n for n in counts if n <= jax.device_count()]
  if usable != counts:
    _log(f"only {jax.device_count()} devices: skipping device counts "
         f"{sorted(set(counts) - set(usable))}")
  names = [n for n in variant_names(usable, COLLECTIVES.value)
           if not ONLY.value or n in ONLY.value or any(p in ONLY.value for p in PRESETS.value)]
  precision = common.PRECISION.value
  optim = OptimConfig()
  finished = True
  for preset in PRESETS.value:
    if ONLY.value and preset not in ONLY.value and not any(n in ONLY.value for n in names):
      continue
    spec = experiment.RunSpec(model=common.MODEL.value, preset=preset, precision=precision,
                              kernel=common.KERNEL.value, seed=common.SEED.value,
                              mods=experiment.parse_mods(common.MODS.value))
    model, source, config = experiment.build_run(spec)
    batch_size = BATCH.value or int(config.batch_size)
    tx = make_optimizer(optim)
    variants = [Variant(n, model, tx, source, batch_size, common.SEED.value, optim)
                for n in names]
    common_key = dict(model=spec.model, preset=preset, precision=precision,
                      batch_size=batch_size, scaling=SCALING.value)
    key = dict(kind="speed", variant="all", loss_steps=None, **common_key)
    if not rows.done(rows.key(key)):
      if time.time() > deadline:
        finished = False
        break
      _log(f"timing {spec.model}/{preset} batch {batch_size}: {', '.join(names)}")
      row = speed_row(variants, preset, preset in SEQUENTIAL.value, device, precision)
      rows.append({**row, **common_key})
    for v in variants:
      key = dict(kind="loss", variant=v.name, loss_steps=LOSS_STEPS.value, **common_key)
      if rows.done(rows.key(key)):
        continue
      if time.time() > deadline:
        finished = False
        break
      _log(f"loss after {LOSS_STEPS.value} steps: {spec.model}/{preset} {v.name}")
      rows.append({**loss_row(v, source, preset, LOSS_STEPS.value, device, precision),
                   **common_key})
  _log(f"{'finished' if finished else 'stopped at --max_minutes; rerun to continue'} "
       f"after {(time.time() - start) / 60:.1f} min; rows in {rows.path}")
  print_table(list(rows.rows()), _log)


if __name__ == "__main__":
  app.run(main, flags_parser=subcommands.parse_flags)  # --help exits 0, errors in one line
