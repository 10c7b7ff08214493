"""The sharded-training benchmark of `python3 -m experiments.bench_parallel`: step time,
scaling efficiency and loss on 1 and N devices, with bf16 or FP8 collectives (docs/PARALLEL.md).

Variants of one preset: `1dev` (the training loop's own single-device step, the baseline)
and `<n>dev_<mode>` (the sharded step on an n-device mesh `data:n,model:1`: every device
takes its share of the batch, tables replicated; `model_axis='all'` makes it
`data:1,model:n`, every device holding rows/n of every table, padded to a multiple of n).
Weak scaling (the default) gives n devices n x batch_size examples per step, strong keeps the
global batch. The precision arm (`precision`, `mods`, and for `loka` the `plans` of each
preset) is one per run: run it again for another arm (rows keep them apart).
Rows go to WORKDIR/parallel.jsonl:
  kind=speed  one per preset: every variant timed in the same run (interleaved, except for
              the `sequential` presets whose states do not fit side by side), median step
              time and CI, throughput, throughput ratio to 1dev and scaling efficiency
              (throughput_n / (n * throughput_1)) with bootstrap CIs;
  kind=loss   one per (preset, variant): training loss after `loss_steps` steps on the same
              batches from the same initial state.
`run` skips finished rows and starts no row once its `should_stop` says so.
"""
import dataclasses
import os
import time
from typing import Callable, Optional, Tuple

MODEL_AXES = ("all", "1")
SCALINGS = ("weak", "strong")


@dataclasses.dataclass(frozen=True)
class Settings:
  """What one benchmark run measures (experiments/configs/bench_parallel.py, field by field)."""
  model: str = "wukong"                  # the tower
  presets: Tuple[str, ...] = ("small",)  # its presets, each a speed row and loss rows
  precision: str = "bf16"                # the precision arm of every variant
  kernel: str = "xla_fp8_tensorwise"     # the kernel of every site with fp8_all
  seed: int = 0                          # parameters and data order
  mods: str = ""                         # comma-separated Mods
  plans: Tuple[Tuple[str, str], ...] = ()  # (preset, plan file) of precision loka
  devices: Tuple[int, ...] = (1, 2)      # device counts (1: the plain step)
  collectives: Tuple[str, ...] = ("bf16", "fp8")  # collective modes of sharded variants
  model_axis: str = "1"                  # all: tables row-sharded; 1: replicated
  scaling: str = "weak"                  # weak or strong
  batch_size: int = 0                    # batch of one device; 0: the preset's
  repeats: int = 20                      # timed repeats per variant (interleaved)
  sequential: Tuple[str, ...] = ("large",)  # presets timed one variant at a time
  loss_steps: int = 100                  # training steps of every loss row
  only: Tuple[str, ...] = ()             # only these presets or variants; (): all
  max_minutes: float = 8.0               # start no new row after this (0: no limit)
  compile_cache: str = "/tmp/jc"         # persistent compilation cache

  @classmethod
  def from_config(cls, config) -> "Settings":
    """The settings of a config; raises ValueError naming a field whose value is not valid."""
    from experiments import run_config
    run, par, speed, loss, limits = (config.run, config.parallel, config.speed, config.loss,
                                     config.limits)
    try:
      devices = tuple(sorted({int(n) for n in run_config.split(par.devices)}))
    except ValueError:
      raise ValueError(f"--config.parallel.devices={par.devices}: not a list of device "
                       "counts") from None
    for field, value, allowed in (("model_axis", par.model_axis, MODEL_AXES),
                                  ("scaling", par.scaling, SCALINGS)):
      if value not in allowed:
        raise ValueError(f"--config.parallel.{field}={value}: not one of {', '.join(allowed)}")
    plans = []
    for item in run_config.split(run.plans):
      preset, sep, path = item.partition(":")
      if not sep or not path:
        raise ValueError(f"--config.run.plans={run.plans}: {item!r} is not PRESET:PLAN_FILE")
      plans.append((preset.strip(), path.strip()))
    missing = [p for p in run_config.split(run.presets) if p not in dict(plans)]
    if run.precision == "loka" and missing:
      raise ValueError(f"--config.run.precision=loka needs a plan for every preset: "
                       f"--config.run.plans has none for {', '.join(missing)}")
    collectives = run_config.split(par.collective_modes)
    wrong = [c for c in collectives if c not in run_config.COLLECTIVES]
    if wrong:
      raise ValueError(f"--config.parallel.collective_modes={par.collective_modes}: not one of "
                       f"{', '.join(run_config.COLLECTIVES)}")
    return cls(model=run.model, presets=run_config.split(run.presets), precision=run.precision,
               kernel=run.kernel, seed=run.seed, mods=run.mods, plans=tuple(plans),
               devices=devices,
               collectives=collectives, model_axis=par.model_axis, scaling=par.scaling,
               batch_size=par.batch_size, repeats=speed.repeats,
               sequential=run_config.split(speed.sequential), loss_steps=loss.steps,
               only=run_config.split(limits.only), max_minutes=limits.max_minutes,
               compile_cache=limits.compile_cache)


KEY_FIELDS = ("kind", "model", "preset", "precision", "mods", "model_axis", "batch_size",
              "scaling", "variant", "loss_steps")


def _log(message: str) -> None:
  print(f"[bench_parallel] {message}", flush=True)


def variant_names(devices, modes):
  names = []
  for n in devices:
    names += ["1dev"] if n == 1 else [f"{n}dev_{m}" for m in modes]
  return names


def mesh_spec(n: int, model_axis: str) -> str:
  """The mesh of an n-device variant: tables row-sharded over every device, or replicated."""
  return f"data:1,model:{n}" if model_axis == "all" else f"data:{n},model:1"


class Variant:
  """One way to run the train step: builds its state and its jitted step lazily."""

  def __init__(self, name, model, tx, source, base_batch, seed, optim, s):
    self.name, self.s = name, s
    self.model, self.tx, self.seed, self.optim = model, tx, seed, optim
    self.devices = int(name.split("dev")[0])
    self.mode = name.split("_", 1)[1] if "_" in name else None
    self.batch_size = base_batch * (self.devices if s.scaling == "weak" else 1)
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
    mesh = parallel.build_mesh(mesh_spec(self.devices, self.s.model_axis),
                               jax.devices()[:self.devices])
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


def speed_row(variants, preset, sequential, device, precision, settings):
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
    timings.update(timing.time_calls(calls, repeats=settings.repeats, warmup=3))
    del calls, holders
    jax.clear_caches()
  base = timings.get("1dev")
  rng = np.random.default_rng(0)
  results = {}
  for v in variants:
    t = timings[v.name]
    lo, hi = t.ci_us(rng)
    entry = {"devices": v.devices, "collectives": v.mode, "batch_size": v.batch_size,
             "mesh": None if v.devices == 1 else mesh_spec(v.devices, settings.model_axis),
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
  return {"kind": "speed", "preset": preset, "variant": "all", "loss_steps": None, "device": device,
          "precision": precision,
          "interleaved": not sequential, "repeats": settings.repeats, "variants": results}


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


def arm_label(row) -> str:
  """precision[+mods][/tables sharded] of a row: which arm and layout it measured."""
  label = row["precision"] + (f"+{row['mods']}" if row.get("mods") else "")
  return label + ("/sharded" if row.get("model_axis") == "all" else "")


def print_table(rows, log):
  log("model/preset   arm                   variant       batch   step ms (95% CI)          "
      "ex/s   thr.ratio  efficiency  loss@N")
  arm = lambda r: (r["model"], r["preset"], r["precision"], r.get("mods"),  # noqa: E731
                   r.get("model_axis"), r["batch_size"], r["scaling"])
  losses = {arm(r) + (r["variant"],): r for r in rows if r["kind"] == "loss"}
  for r in sorted((r for r in rows if r["kind"] == "speed"),
                  key=lambda r: tuple(str(x) for x in arm(r))):
    for name, e in r["variants"].items():
      loss = losses.get(arm(r) + (name,))
      ci = e["ci_ms"]
      log(f"{r['model']}/{r['preset']:<7} {arm_label(r):<21} {name:<12} {e['batch_size']:6d} "
          f"{e['median_ms']:8.2f} [{ci[0]:.2f}, {ci[1]:.2f}]  {e['examples_per_s']:10.0f}  "
          f"{e.get('throughput_ratio', float('nan')):7.3f}  "
          f"{e.get('efficiency', float('nan')):9.3f}  "
          + (f"{loss['mean_last10']:.5f}" if loss else "-"))


def run(s: Settings, workdir: str, log: Callable[[str], None] = _log,
        should_stop: Optional[Callable[[float], bool]] = None) -> bool:
  """Measures every row of `s` not yet in WORKDIR/parallel.jsonl, appending each, until
  `should_stop(0)` says no new row starts; prints the table of every row; returns whether
  every row is done."""
  import jax
  jax.config.update("jax_compilation_cache_dir", os.path.abspath(s.compile_cache))
  from experiments.bench.results import ResultsFile
  from experiments import run_config
  from loka_jax import _compat
  from loka_jax.train import OptimConfig, experiment, make_optimizer

  experiment.quiet_library_logs()
  start = time.time()
  device = jax.devices()[0].device_kind
  if not _compat.on_gpu():
    log("warning: not on a GPU; these timings are smoke tests, not results")
  rows = ResultsFile(os.path.join(workdir, "parallel.jsonl"), KEY_FIELDS)
  usable = [n for n in s.devices if n <= jax.device_count()]
  if usable != list(s.devices):
    log(f"only {jax.device_count()} devices: skipping device counts "
        f"{sorted(set(s.devices) - set(usable))}")
  names = [n for n in variant_names(usable, s.collectives)
           if not s.only or n in s.only or any(p in s.only for p in s.presets)]
  optim = OptimConfig()
  finished = True
  for preset in s.presets:
    if s.only and preset not in s.only and not any(n in s.only for n in names):
      continue
    spec = experiment.RunSpec(model=s.model, preset=preset, precision=s.precision,
                              kernel=s.kernel, seed=s.seed, mods=run_config.mods(s.mods),
                              plan=dict(s.plans).get(preset))
    model, source, config = experiment.build_run(spec)
    batch_size = s.batch_size or int(config.batch_size)
    tx = make_optimizer(optim)
    variants = [Variant(n, model, tx, source, batch_size, s.seed, optim, s) for n in names]
    # Rows of the defaults (no Mods, replicated tables) keep the keys they had without these.
    common_key = dict(model=spec.model, preset=preset, precision=s.precision,
                      mods=s.mods or None,
                      model_axis=None if s.model_axis == "1" else s.model_axis,
                      batch_size=batch_size, scaling=s.scaling)
    key = dict(kind="speed", variant="all", loss_steps=None, **common_key)
    if not rows.done(rows.key(key)):
      if should_stop and should_stop(0):
        finished = False
        break
      log(f"timing {spec.model}/{preset} batch {batch_size}: {', '.join(names)}")
      row = speed_row(variants, preset, preset in s.sequential, device, s.precision, s)
      rows.append({**row, **common_key})
    for v in variants:
      key = dict(kind="loss", variant=v.name, loss_steps=s.loss_steps, **common_key)
      if rows.done(rows.key(key)):
        continue
      if should_stop and should_stop(0):
        finished = False
        break
      log(f"loss after {s.loss_steps} steps: {spec.model}/{preset} {v.name}")
      rows.append({**loss_row(v, source, preset, s.loss_steps, device, s.precision),
                   **common_key})
  log(f"{'finished' if finished else 'stopped at limits.max_minutes; rerun to continue'} "
      f"after {(time.time() - start) / 60:.1f} min; rows in {rows.path}")
  print_table(list(rows.rows()), log)
  return finished
