"""The Mods ablation: every on/off combination of No Bias, BlockNorm and Hard Swish, each
trained in bf16 and in FP8 (one kernel at every site) with the same seed, data order and
held-out set, plus (on a GPU) train-step and inference time.

Work directory (resumable: finished arms and timing rows are never redone):
  DIR/settings.json      what every arm shares; a rerun with other settings is refused
  DIR/runs/<arm>/        one `experiment.run` directory per arm (final.json when finished,
                         error.json when it failed; delete the directory to retry)
  DIR/timing.jsonl       one row per mods combination: bf16 baseline, bf16 and FP8 with the
                         mods, timed interleaved in one process (GPU only, or --timing=force)
  DIR/ablation.json      schema loka.ablation/1 (see `summarize`)
  DIR/ablation.md        the markdown table
  DIR/ablation.png       NE per combination (bf16 vs FP8) and latency where measured

Quality verdicts follow DESIGN.md: a loss change is neutral when |delta log loss| <=
max(0.02% relative, 2 x the bf16 seed-to-seed std), the std from `noise_seeds` (extra bf16
baseline arms with other seeds; without them only the relative bound applies).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import json
import math
import os
import shutil
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from loka_jax import _compat, jsonio, timing
from loka_jax.models.presets import MODS, get_config
from loka_jax.train import NonFiniteError, OptimConfig, TrainConfig, experiment
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

SCHEMA = "loka.ablation/1"
PRECISIONS = ("bf16", "fp8_all")
SHORT = {"no_bias": "NB", "blocknorm": "BN", "hard_swish": "HS"}
TIMING_MODES = ("auto", "off", "force")
# Settings a rerun may change (which arms, how they run); anything else must match.
FREE_SETTINGS = ("combinations", "precisions", "noise_seeds", "timing", "repeats", "workers",
                 "keep_checkpoints", "max_minutes", "data_cache")

Combination = Tuple[str, ...]


def all_combinations() -> Tuple[Combination, ...]:
  """The 8 on/off combinations: none, each mod alone, the pairs, all three."""
  return tuple(c for r in range(len(MODS) + 1) for c in itertools.combinations(MODS, r))


def combination_key(mods: Combination) -> str:
  """File-name form: 'none' or the mods joined by '+', e.g. 'no_bias+hard_swish'."""
  return "+".join(mods) if mods else "none"


def combination_label(mods: Combination) -> str:
  """Short form for tables and plots: 'baseline' or e.g. 'NB+HS'."""
  return "+".join(SHORT[m] for m in mods) if mods else "baseline"


def parse_combinations(items: Sequence[str]) -> Tuple[Combination, ...]:
  """Combinations from keys: 'none', 'all' (the three mods), or mods joined by '+'.
  An empty list means all 8."""
  if isinstance(items, str):
    items = items.split(",")
  items = [i.strip() for i in items if i and i.strip()]
  if not items:
    return all_combinations()
  out = []
  for item in items:
    if item == "none":
      mods = ()
    elif item == "all":
      mods = MODS
    else:
      names = item.split("+")
      unknown = [n for n in names if n not in MODS]
      if unknown:
        raise ValueError(f"unknown mod(s) {unknown} in combination {item!r}; use 'none', "
                         f"'all' or mods from {', '.join(MODS)} joined by '+'")
      mods = tuple(m for m in MODS if m in names)
    if mods not in out:
      out.append(mods)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class AblationConfig:
  """What to ablate and how (the CLI's flags)."""
  model: str = "wukong"
  preset: str = "tiny"
  steps: int = 60
  batch_size: Optional[int] = None          # None: the preset's
  num_eval: int = 2048                      # held-out examples (same set for every arm)
  seed: int = 0                             # parameters and training data order of every arm
  kernel: str = "xla_fp8_tensorwise"        # the FP8 arm's one kernel at every site
  data: str = "synthetic"                   # data source (timing always uses synthetic)
  data_path: Optional[str] = None
  data_cache: Optional[str] = None
  learning_rate: float = OptimConfig.learning_rate
  # A linear warm-up of the learning rates over this many steps (0: none). The `large`
  # presets' first steps spike without one, in bf16 as well (docs/BENCHMARKS.md, section 7).
  warmup_steps: int = 0
  combinations: Tuple[Combination, ...] = all_combinations()
  precisions: Tuple[str, ...] = PRECISIONS
  noise_seeds: Tuple[int, ...] = ()         # extra bf16 baseline seeds for the noise floor
  timing: str = "auto"                      # 'auto': on a GPU only; 'off'; 'force': also CPU
  repeats: int = 20                         # timed repeats per variant (interleaved)
  workers: int = 1                          # arms trained at once (threads; 1 on a GPU)
  keep_checkpoints: bool = False            # keep finished arms' checkpoints (disk)
  max_minutes: Optional[float] = None       # start no new arm or timing row after this
  # The arms run XLA's deterministic GPU ops (`xla_env.DETERMINISTIC`, which the script sets
  # before JAX starts), so each repeats bit for bit; never with timing, which it would slow.
  xla_deterministic: bool = False

  def __post_init__(self):
    for p in self.precisions:
      if p not in PRECISIONS:
        raise ValueError(f"unknown precision {p!r} for the ablation; use {PRECISIONS}")
    if self.timing not in TIMING_MODES:
      raise ValueError(f"timing={self.timing!r}; use one of {TIMING_MODES}")
    if self.steps < 1 or self.num_eval < 1 or self.workers < 1 or self.repeats < 1:
      raise ValueError(f"ablation: steps={self.steps}, num_eval={self.num_eval}, "
                       f"workers={self.workers} and repeats={self.repeats} must all be >= 1")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got "
                       f"{self.warmup_steps}")
    if self.seed in self.noise_seeds:
      raise ValueError(f"noise_seeds {self.noise_seeds} must differ from seed {self.seed}")
    if self.xla_deterministic and self.timing != "off":
      raise ValueError("xla_deterministic slows the steps the ablation times: use it with "
                       "timing='off'")

  @property
  def batch(self) -> int:
    return self.batch_size or experiment.preset_batch_size(self.model, self.preset)

  def shared_settings(self) -> Dict[str, Any]:
    """What every arm shares (settings.json)."""
    d = dataclasses.asdict(self)
    out = {k: v for k, v in d.items() if k not in FREE_SETTINGS}
    out["batch_size"] = self.batch
    # A workdir from before the warm-up or the deterministic ops existed keeps its settings.
    for key in ("warmup_steps", "xla_deterministic"):
      if not out[key]:
        del out[key]
    return out


@dataclasses.dataclass(frozen=True)
class Arm:
  """One training run: a mods combination in one precision with one seed."""
  mods: Combination
  precision: str
  seed: int

  @property
  def name(self) -> str:
    return f"{self.precision}__{combination_key(self.mods)}__seed{self.seed}"


def arms(config: AblationConfig) -> List[Arm]:
  """Every arm: combinations x precisions with the config's seed, then the noise arms."""
  out = [Arm(c, p, config.seed) for c in config.combinations for p in config.precisions]
  out += [Arm((), "bf16", s) for s in config.noise_seeds]
  return out


def run_spec(config: AblationConfig, arm: Arm) -> experiment.RunSpec:
  return experiment.RunSpec(model=config.model, preset=config.preset, data=config.data,
                            data_path=config.data_path, data_cache=config.data_cache,
                            precision=arm.precision, kernel=config.kernel, mods=arm.mods,
                            seed=arm.seed, num_eval=config.num_eval)


def train_config(config: AblationConfig, seed: int) -> TrainConfig:
  return TrainConfig(steps=config.steps, batch_size=config.batch, seed=seed,
                     log_every=max(1, config.steps // 4), checkpoint_every=0,
                     keep_checkpoints=1, progress=False,
                     optim=OptimConfig(learning_rate=config.learning_rate,
                                       warmup_steps=config.warmup_steps))


# ----------------------------------------------------------------------------- the runs


def _read_json(path: str):
  with open(path) as f:
    return json.load(f)


def _write_json(path: str, value) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    json.dump(value, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def arm_result(workdir: str, arm: Arm, steps: int) -> Optional[Dict[str, Any]]:
  """The finished arm's final.json (or its error record), None if it still has to run."""
  run_dir = os.path.join(workdir, "runs", arm.name)
  error = os.path.join(run_dir, "error.json")
  if os.path.exists(error):
    return _read_json(error)
  final = os.path.join(run_dir, "final.json")
  if os.path.exists(final):
    result = _read_json(final)
    if result.get("steps") == steps:
      return result
  return None


def train_arm(config: AblationConfig, arm: Arm, workdir: str) -> Dict[str, Any]:
  """Trains one arm (resuming its run directory) and returns its final.json dict; a
  divergence is recorded in error.json and returned as {"error": ...}."""
  run_dir = os.path.join(workdir, "runs", arm.name)
  try:
    final = experiment.run(run_spec(config, arm), run_dir, train_config(config, arm.seed))
  except NonFiniteError as e:
    # A diverged arm is a result of the ablation (e.g. FP8 without Mods); anything else is a
    # fault of the setup and propagates.
    os.makedirs(run_dir, exist_ok=True)
    record = {"error": f"{type(e).__name__}: {e}", "arm": arm.name}
    _write_json(os.path.join(run_dir, "error.json"), record)
    return record
  if not config.keep_checkpoints:
    shutil.rmtree(os.path.join(run_dir, "checkpoints"), ignore_errors=True)
  return final


def timing_enabled(config: AblationConfig) -> bool:
  return config.timing == "force" or (config.timing == "auto" and _compat.on_gpu())


def timing_variants(config: AblationConfig, mods: Combination):
  """The variants of one timing row: the bf16 baseline (no mods) and both precisions of
  `mods`, so every speedup has its baseline in the same interleaved run."""
  from experiments.bench.variants import Variant  # the bench package builds on the train package
  names = [("bf16", ())] + [(p, mods) for p in config.precisions if (p, mods) != ("bf16", ())]
  return [Variant(f"{p}__{combination_key(m)}", p, config.kernel, m) for p, m in names]


def time_combination(config: AblationConfig, mods: Combination) -> Dict[str, Any]:
  """Train-step and inference time of `timing_variants`, interleaved (loka_jax.timing)."""
  from experiments.bench import models as bench_models
  from experiments.bench.speed import MIN_CALL_S
  variants = timing_variants(config, mods)
  prepared = {v.name: bench_models.prepare(config.model, config.preset, v, config.batch,
                                           seed=config.seed) for v in variants}
  baseline = variants[0].name
  row = {"combination": combination_key(mods), "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "batch_size": config.batch, "repeats": config.repeats,
         "gpu": _compat.on_gpu(), "fp8_vs_bf16": {},
         "variants": {name: {"info": p[2]} for name, p in prepared.items()}}
  for mode, index in (("train", 0), ("infer", 1)):
    # Short steps run back to back, as many a sample as fill MIN_CALL_S on the baseline (one
    # count for every variant), so host dispatch jitter is spread over them.
    per_sample = timing.calls_for(prepared[baseline][index], MIN_CALL_S)
    timings = timing.time_calls({n: p[index] for n, p in prepared.items()},
                                repeats=config.repeats, calls_per_sample=per_sample)
    for name, summary in timing.summarize(timings, baseline).items():
      row["variants"][name][mode] = summary
    bf16, fp8 = f"bf16__{combination_key(mods)}", f"fp8_all__{combination_key(mods)}"
    if bf16 in timings and fp8 in timings:
      row["fp8_vs_bf16"][mode] = list(timing.speedup_ci(timings[bf16], timings[fp8]))
  return row


def _timing_rows(workdir: str) -> Dict[Tuple[str, str], Dict[str, Any]]:
  path = os.path.join(workdir, "timing.jsonl")
  rows = {}
  if os.path.exists(path):
    for _, row, error in jsonio.jsonl_rows(path):
      if error is None:  # a line cut by a killed run is measured again
        rows[(row["combination"], row["device"])] = row
  return rows


def _append_row(workdir: str, row: Mapping[str, Any]) -> None:
  with open(os.path.join(workdir, "timing.jsonl"), "a") as f:
    f.write(json.dumps(row) + "\n")
    f.flush()
    os.fsync(f.fileno())


class SettingsError(ValueError):
  """A work directory holding an ablation with other shared settings."""


def check_settings(config: AblationConfig, workdir: str) -> None:
  """Writes settings.json, or refuses a workdir holding an ablation with other settings."""
  path = os.path.join(workdir, "settings.json")
  settings = json.loads(json.dumps(config.shared_settings()))
  if os.path.exists(path):
    old = _read_json(path)
    diffs = [f"{k}: {old.get(k)!r} -> {settings.get(k)!r}"
             for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    if diffs:
      raise SettingsError(f"{workdir} holds an ablation with other settings ({'; '.join(diffs)}); "
                       "rerun with the same settings or use a new --workdir")
  _write_json(path, settings)


def use_compile_cache(path: str) -> None:
  """Persistent compilation cache (arms and timing rows reuse each other's executables, and
  reruns skip compiles); a cache set up earlier (e.g. JAX_COMPILATION_CACHE_DIR) is kept."""
  if not jax.config.jax_compilation_cache_dir:
    jax.config.update("jax_compilation_cache_dir", path)


def run(config: AblationConfig, workdir: str,
        log: Callable[[str], None] = print) -> Dict[str, Any]:
  """Trains every arm not yet finished, times every combination not yet timed (see
  `timing_enabled`), and writes ablation.json / .md / .png from all results so far.

  Returns the ablation.json dict; its "complete" is False when `max_minutes` stopped it
  (rerun with the same arguments to continue).
  """
  os.makedirs(workdir, exist_ok=True)
  check_settings(config, workdir)
  start = time.monotonic()
  out_of_time = lambda: (config.max_minutes is not None
                         and (time.monotonic() - start) / 60 > config.max_minutes)
  results = {a.name: arm_result(workdir, a, config.steps) for a in arms(config)}
  todo = [a for a in arms(config) if results[a.name] is None]

  def train_one(arm: Arm):
    if out_of_time():
      return arm, None
    t0 = time.monotonic()
    final = train_arm(config, arm, workdir)
    summary = final.get("error") or f"ne {final['ne']:.5f} logloss {final['logloss']:.5f}"
    log(f"{arm.name}: {summary} ({time.monotonic() - t0:.0f} s)")
    return arm, final

  workers = min(config.workers, max(1, len(todo)))
  if workers == 1:
    done = map(train_one, todo)
  else:
    pool = concurrent.futures.ThreadPoolExecutor(workers)
    done = pool.map(train_one, todo)
  try:
    for arm, final in done:
      results[arm.name] = final
  finally:
    if workers > 1:
      pool.shutdown()

  rows = _timing_rows(workdir)
  device = jax.devices()[0].device_kind
  if timing_enabled(config):
    for mods in config.combinations:
      key = (combination_key(mods), device)
      if key in rows:
        continue
      if out_of_time():
        break
      t0 = time.monotonic()
      row = time_combination(config, mods)
      _append_row(workdir, row)
      rows[key] = row
      log(f"timed {combination_label(mods)} ({time.monotonic() - t0:.0f} s)")
  result = summarize(config, results, [r for (c, d), r in rows.items() if d == device], device)
  write_outputs(result, workdir)
  if not result["complete"]:
    log(f"stopped at max_minutes={config.max_minutes}: {len(result['pending'])} unit(s) left; "
        "rerun the same command to continue")
  return result


# ----------------------------------------------------------------------------- the report


def _finite(value) -> Optional[float]:
  return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _delta(new: Optional[float], ref: Optional[float], tolerance: Optional[float]):
  """{"abs", "rel", "verdict"} of new - ref in log loss (lower is better)."""
  if new is None or ref is None:
    return None
  delta = new - ref
  verdict = ("neutral" if abs(delta) <= tolerance else "worse" if delta > 0 else "better")
  return {"abs": delta, "rel": delta / ref if ref else None, "verdict": verdict}


def summarize(config: AblationConfig, finals: Mapping[str, Optional[Mapping[str, Any]]],
              timing_rows: Sequence[Mapping[str, Any]], device: str) -> Dict[str, Any]:
  """The loka.ablation/1 dict from per-arm final.json dicts (None: not run yet) and timing rows.

  Keys: settings, device, timing ("measured" | "smoke (not on a GPU)" | "skipped (...)"),
  noise (bf16 baseline seeds: logloss values, std, tolerance), rows (one per combination:
  per precision ne/logloss/auc and, where timed, train/infer median_ms and speedup vs the
  bf16 baseline with its CI; deltas fp8_vs_bf16, mods_vs_baseline, fp8_mods_vs_baseline),
  complete, pending.
  """
  def arm(mods, precision, seed=config.seed):
    return finals.get(Arm(mods, precision, seed).name)

  base = arm((), "bf16")
  base_ll = _finite((base or {}).get("logloss"))
  seeds = [config.seed] + list(config.noise_seeds)
  seed_ll = [_finite((arm((), "bf16", s) or {}).get("logloss")) for s in seeds]
  seed_ll = [v for v in seed_ll if v is not None]
  std = float(np.std(seed_ll, ddof=1)) if len(seed_ll) >= 2 else None
  tolerance = None
  if base_ll is not None:
    tolerance = max(NEUTRAL_REL_LOGLOSS * abs(base_ll), 2 * std if std is not None else 0.0)

  timed = {r["combination"]: r for r in timing_rows}
  if timed and not all(r.get("gpu") for r in timed.values()):
    timing_note = "smoke (not on a GPU: these timings are not results)"
  elif timed:
    timing_note = "measured"
  elif timing_enabled(config):
    timing_note = "pending"
  else:
    timing_note = ("skipped (not on a GPU)" if config.timing == "auto"
                   else "skipped (--timing=off)")

  rows = []
  for mods in config.combinations:
    row = {"mods": list(mods), "key": combination_key(mods), "label": combination_label(mods)}
    t = timed.get(combination_key(mods))
    for precision in config.precisions:
      final = arm(mods, precision)
      if final is None:
        status = "pending"
      elif _finite(final.get("logloss")) is None:
        status = "error"
      else:
        status = "done"
      entry = {"status": status}
      if final is not None:
        # peak_loss: the run's worst training step (absent from runs older than it).
        entry.update({k: _finite(final.get(k)) for k in ("ne", "logloss", "auc", "peak_loss")})
        if final.get("error"):
          entry["error"] = final["error"]
      if t is not None:
        for mode in ("train", "infer"):
          s = t["variants"].get(f"{precision}__{combination_key(mods)}", {}).get(mode)
          if s:
            entry[f"{mode}_ms"] = s["median_us"] / 1e3
            entry[f"{mode}_speedup"] = s["speedup"]
            entry[f"{mode}_speedup_ci"] = s["speedup_ci"]
      row[precision] = entry
    bf16_ll = (row.get("bf16") or {}).get("logloss")
    fp8_ll = (row.get("fp8_all") or {}).get("logloss")
    row["fp8_vs_bf16"] = _delta(fp8_ll, bf16_ll, tolerance)
    row["mods_vs_baseline"] = _delta(bf16_ll, base_ll, tolerance) if mods else None
    row["fp8_mods_vs_baseline"] = _delta(fp8_ll, base_ll, tolerance) if mods else None
    if t is not None and t.get("fp8_vs_bf16"):
      row["fp8_vs_bf16_speedup"] = t["fp8_vs_bf16"]
    rows.append(row)

  pending = [a.name for a in arms(config) if finals.get(a.name) is None]
  if timing_enabled(config):
    pending += [f"timing {combination_key(m)}" for m in config.combinations
                if combination_key(m) not in timed]
  block = int(get_config(config.model, config.preset).mods.block_size)
  return {
      "schema": SCHEMA, "settings": dict(config.shared_settings(), block_size=block,
                                         precisions=list(config.precisions)),
      "device": device, "jax": jax.__version__, "timing": timing_note,
      "noise": {"seeds": seeds, "logloss": seed_ll, "std": std, "tolerance": tolerance,
                "rule": "neutral: |delta log loss| <= max(0.02% relative, 2 x bf16 seed std)"},
      "rows": rows, "complete": not pending, "pending": pending,
  }


def _fmt(value, spec=".5f", missing="-"):
  return missing if value is None else format(value, spec)


def _fmt_delta(d) -> str:
  if d is None:
    return "-"
  rel = "" if d["rel"] is None else f" ({100 * d['rel']:+.3f}%)"
  return f"{d['abs']:+.5f}{rel} {d['verdict']}"


def _fmt_time(entry) -> str:
  if "train_ms" not in entry:
    return "-"
  return (f"{entry['train_ms']:.2f} ({entry['train_speedup']:.2f}x) / "
          f"{entry['infer_ms']:.2f} ({entry['infer_speedup']:.2f}x)")


def markdown_table(result: Mapping[str, Any]) -> str:
  """The ablation as a markdown table with a header line of its settings."""
  s = result["settings"]
  noise = result["noise"]
  floor = (f"bf16 seed-to-seed std of log loss {noise['std']:.5f} over seeds "
           f"{noise['seeds']}" if noise["std"] is not None else
           "no seed-to-seed noise floor (add noise seeds): only the 0.02% bound applies")
  lines = [
      f"Mods ablation: {s['model']}/{s['preset']}, {s['steps']} steps x batch {s['batch_size']}"
      + (f" (learning-rate warm-up {s['warmup_steps']} steps)" if s.get("warmup_steps") else "")
      + (" with deterministic XLA ops" if s.get("xla_deterministic") else "")
      + ", "
      f"{s['num_eval']} held-out examples, seed {s['seed']}; FP8 = fp8_all with {s['kernel']}; "
      f"BlockNorm block {s['block_size']}; device {result['device']}, jax {result['jax']}.",
      f"Neutral: |delta log loss| <= {_fmt(noise['tolerance'])} ({floor}).",
      f"Timing: {result['timing']}; cells are train / inference step ms (speedup vs the bf16 "
      "baseline timed in the same run).",
      "",
      "| mods | bf16 NE | FP8 NE | bf16 log loss | FP8 log loss | FP8 vs bf16 (log loss) | "
      "mods vs baseline (bf16) | FP8+mods vs bf16 baseline | bf16 train / infer ms | "
      "FP8 train / infer ms | worst step's loss (bf16 / FP8) |",
      "|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  for row in result["rows"]:
    b, f = row.get("bf16") or {}, row.get("fp8_all") or {}
    lines.append(
        f"| {row['label']} | {_fmt(b.get('ne'))} | {_fmt(f.get('ne'))} | "
        f"{_fmt(b.get('logloss'))} | {_fmt(f.get('logloss'))} | "
        f"{_fmt_delta(row['fp8_vs_bf16'])} | {_fmt_delta(row['mods_vs_baseline'])} | "
        f"{_fmt_delta(row['fp8_mods_vs_baseline'])} | {_fmt_time(b)} | {_fmt_time(f)} | "
        f"{_fmt(b.get('peak_loss'), '.3g')} / {_fmt(f.get('peak_loss'), '.3g')} |")
  errors = [(row["label"], p, row[p]["error"]) for row in result["rows"]
            for p in ("bf16", "fp8_all") if (row.get(p) or {}).get("error")]
  for label, precision, error in errors:
    lines.append(f"\nerror {label} {precision}: {error}")
  if not result["complete"]:
    lines.append(f"\nIncomplete: {len(result['pending'])} unit(s) pending; rerun to continue.")
  return "\n".join(lines)


def plot(result: Mapping[str, Any], path: str) -> str:
  """NE per combination (bf16 vs FP8, with the bf16 noise band) and, where measured, the
  train / inference speedup vs the bf16 baseline; saved as a PNG at `path`."""
  import matplotlib
  matplotlib.use("Agg", force=False)
  import matplotlib.pyplot as plt

  rows = result["rows"]
  labels = [r["label"] for r in rows]
  x = np.arange(len(rows))
  colors = {"bf16": "tab:blue", "fp8_all": "tab:orange"}
  # Without timing rows the latency panel would be an empty frame: the figure is the quality
  # panel alone, and its title says why there is no latency.
  measured = any("train_ms" in (r.get(p) or {}) for r in rows for p in colors)
  fig, axes = plt.subplots(1, 2 if measured else 1, squeeze=False,
                           figsize=(12, 4.2) if measured else (7, 4.4))
  ax_ne = axes[0, 0]
  names = {"bf16": "bf16", "fp8_all": f"FP8 ({result['settings']['kernel']})"}
  for offset, precision in ((-0.12, "bf16"), (0.12, "fp8_all")):
    ne = [np.nan if (r.get(precision) or {}).get("ne") is None else r[precision]["ne"]
          for r in rows]
    if not np.all(np.isnan(ne)) and precision in result["settings"]["precisions"]:
      ax_ne.plot(x + offset, ne, "o", color=colors[precision], label=names[precision])
  base = (rows[0].get("bf16") or {}) if rows and not rows[0]["mods"] else {}
  noise = result["noise"]
  if base.get("ne") is not None and noise["std"] is not None and base.get("logloss"):
    band = 2 * noise["std"] * base["ne"] / base["logloss"]  # log loss std in NE units
    ax_ne.axhspan(base["ne"] - band, base["ne"] + band, color="tab:blue", alpha=0.12,
                  label="bf16 baseline +- 2 seed std")
  ax_ne.set_xticks(x, labels, rotation=30, ha="right")
  ax_ne.set_ylabel("held-out NE (lower is better)")
  ax_ne.set_title("Quality per Mods combination")
  ax_ne.grid(axis="y", alpha=0.3)
  ax_ne.legend(fontsize=8)

  if measured:
    ax_t = axes[0, 1]
    smoke = " - smoke, not results" if result["timing"].startswith("smoke") else ""
    for offset, precision in ((-0.18, "bf16"), (0.06, "fp8_all")):
      for mode, marker, shift in (("train", "o", 0.0), ("infer", "s", 0.12)):
        pts = [(i, r[precision][f"{mode}_speedup"], r[precision][f"{mode}_speedup_ci"])
               for i, r in enumerate(rows) if f"{mode}_speedup" in (r.get(precision) or {})]
        if not pts:
          continue
        xi = np.array([p[0] for p in pts]) + offset + shift
        yi = np.array([p[1] for p in pts])
        err = np.array([[p[1] - p[2][0], p[2][1] - p[1]] for p in pts]).T
        ax_t.errorbar(xi, yi, yerr=err, fmt=marker, color=colors[precision], capsize=2,
                      label=f"{names[precision]} {mode}")
    ax_t.axhline(1.0, color="gray", lw=0.8)
    ax_t.set_ylabel("speedup vs bf16 baseline (95% CI)")
    ax_t.legend(fontsize=8)
    ax_t.set_xticks(x, labels, rotation=30, ha="right")
    ax_t.set_title(f"Latency ({result['device']}{smoke})")
    ax_t.grid(axis="y", alpha=0.3)
  s = result["settings"]
  fig.suptitle(f"Mods ablation: {s['model']}/{s['preset']}, {s['steps']} steps x "
               f"{s['batch_size']}"
               + ("" if measured else f"\nno latency: timing {result['timing']}"))
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def _labels(rows, key: str, verdict: str) -> List[str]:
  return [r["label"] for r in rows if (r.get(key) or {}).get("verdict") == verdict]


def _sentence(title: str, rows, key: str) -> Optional[str]:
  judged = [r for r in rows if r.get(key)]
  if not judged:
    return None
  parts = [f"{verdict} for {', '.join(labels)}" for verdict in ("neutral", "better", "worse")
           if (labels := _labels(judged, key, verdict))]
  return f"{title} ({len(judged)} combination(s)): " + "; ".join(parts) + "."


def reading(result: Mapping[str, Any]) -> str:
  """A few sentences reading the ablation: loss verdicts, then latency where measured."""
  rows = result["rows"]
  noise = result["noise"]
  lines = [f"Neutral band: |delta log loss| <= {_fmt(noise['tolerance'])}"
           + (f" (2 x bf16 seed std {noise['std']:.5f} over {len(noise['logloss'])} seeds)."
              if noise["std"] is not None else " (0.02% relative; no seed noise floor).")]
  for title, key in (("FP8 vs bf16 with the same Mods", "fp8_vs_bf16"),
                     ("Mods alone (bf16) vs the bf16 baseline", "mods_vs_baseline"),
                     ("FP8 with Mods vs the bf16 baseline", "fp8_mods_vs_baseline")):
    sentence = _sentence(title, rows, key)
    if sentence:
      lines.append(sentence)
  pairs = [(r["label"], r["fp8_vs_bf16_speedup"]["train"]) for r in rows
           if "train" in (r.get("fp8_vs_bf16_speedup") or {})]
  if pairs:
    lines.append("FP8 vs bf16 train-step speedup with the same Mods: " + "; ".join(
        f"{label} {s[0]:.2f}x [{s[1]:.2f}, {s[2]:.2f}]" for label, s in pairs) + ".")
  timed = [(r["label"], p, r[p]["train_speedup"]) for r in rows for p in ("bf16", "fp8_all")
           if "train_speedup" in (r.get(p) or {})]
  if timed:
    label, precision, speedup = max(timed, key=lambda t: t[2])
    lines.append(f"Fastest train step: {label} in {precision}, {speedup:.2f}x the bf16 "
                 f"baseline ({result['timing']}).")
  else:
    lines.append(f"Latency: {result['timing']}.")
  return "\n".join(lines)


def write_outputs(result: Mapping[str, Any], workdir: str) -> Dict[str, str]:
  """ablation.json, ablation.md and ablation.png in `workdir`; returns their paths."""
  paths = {"json": os.path.join(workdir, "ablation.json"),
           "table": os.path.join(workdir, "ablation.md"),
           "plot": os.path.join(workdir, "ablation.png")}
  _write_json(paths["json"], result)
  with open(paths["table"], "w") as f:
    f.write(markdown_table(result) + "\n")
  plot(result, paths["plot"])
  return paths
