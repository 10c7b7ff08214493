"""Per-shape tile autotuning of both Pallas GEMM cores, cached on disk per device kind.

Cache: `$LOKA_PALLAS_TUNE_DIR/<device_kind>.json` (default `~/.cache/loka_jax/pallas_tune/`),
`{"schema": "loka.pallas_tune/1", "device": ..., "entries": {kernel: {shape_key: config}}}`,
a config being a `Config` dataclass as a dict (`TileConfig` for the Triton core,
`mosaic_gemm.MosaicConfig` for the Mosaic GPU one).
Kernels look configs up at trace time (`lookup`): the user's cached winner, else the winner
shipped with the package for that device kind (`kernels_pallas/tuned/<device_kind>.json`, from
the benchmark's `--tune` runs), else a default chosen by shape class. Tuning runs kernels, so
it happens eagerly (`tune`, the benchmark script, or on a cache miss when
LOKA_PALLAS_AUTOTUNE=1) and never on the CPU.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import statistics
import tempfile
import threading
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import jax

from kernels_pallas import compat
from loka_jax import _compat, timing

SCHEMA = "loka.pallas_tune/1"
ENV_DIR = "LOKA_PALLAS_TUNE_DIR"
ENV_AUTOTUNE = "LOKA_PALLAS_AUTOTUNE"
MAX_CANDIDATES = 12
TUNE_INNER = 20  # kernel calls per timed sample (one jitted loop), so dispatch is amortized

_lock = threading.Lock()
_memory: Dict[str, dict] = {}


class Config:
  """A frozen dataclass of int fields a tuning cache stores as a dict."""

  def to_dict(self):
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d):
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: int(v) for k, v in d.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class TileConfig(Config):
  """Tiles and Triton launch parameters of one GEMM launch.

  block_n is one accumulator's width; n_sub accumulators side by side cover
  block_n * n_sub output columns per program (a whole row for output quantization).
  batch_per_program: batched GEMMs run this many batch entries per program.
  """
  block_m: int = 64
  block_n: int = 128
  block_k: int = 128
  n_sub: int = 1
  num_warps: int = 4
  num_stages: int = 3
  batch_per_program: int = 1


def cache_dir() -> str:
  return os.environ.get(ENV_DIR) or os.path.join(
      os.path.expanduser("~"), ".cache", "loka_jax", "pallas_tune")


def cache_path(device_kind: Optional[str] = None) -> str:
  return os.path.join(cache_dir(), f"{device_kind or _compat.device_kind()}.json")


def _load(path: str) -> dict:
  if path in _memory:
    return _memory[path]
  data = {"schema": SCHEMA, "entries": {}}
  if os.path.exists(path):
    try:
      with open(path) as f:
        loaded = json.load(f)
      if loaded.get("schema") == SCHEMA:
        data = loaded
      else:
        logging.warning("ignoring tuning cache %s: schema %r is not %s", path,
                        loaded.get("schema"), SCHEMA)
    except (OSError, ValueError) as e:
      logging.warning("ignoring unreadable tuning cache %s: %s", path, e)
  _memory[path] = data
  return data


def _save(path: str, data: dict) -> None:
  os.makedirs(os.path.dirname(path), exist_ok=True)
  # Write-then-rename so a concurrent reader never sees half a file.
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
  with os.fdopen(fd, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
  os.replace(tmp, path)


def clear_memory() -> None:
  """Forgets loaded caches (tests, or after another process wrote the file)."""
  with _lock:
    _memory.clear()


SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tuned")


def shipped_path(device_kind: Optional[str] = None) -> str:
  """The package's tuned winners for a device kind (same format as the cache)."""
  return os.path.join(SHIPPED_DIR, f"{device_kind or _compat.device_kind()}.json")


def cached(kernel: str, key: str, shipped: bool = True, config_type=TileConfig):
  """The tuned config (a `config_type`) for this device kind: the user's cache first, then
  (`shipped`) the package's table (one file per device kind: GPU entries never reach the
  CPU); None when neither has one."""
  with _lock:
    for path in (cache_path(), shipped_path()) if shipped else (cache_path(),):
      entry = _load(path)["entries"].get(kernel, {}).get(key)
      if entry:
        return config_type.from_dict(entry["config"])
  return None


def record(kernel: str, key: str, config: Config, time_us: float,
           timings: Optional[dict] = None) -> None:
  path = cache_path()
  with _lock:
    data = _load(path)
    data["device"] = jax.devices()[0].device_kind
    data.setdefault("entries", {}).setdefault(kernel, {})[key] = {
        "config": config.to_dict(), "time_us": time_us, "timings_us": timings or {},
        "jax": jax.__version__}
    _save(path, data)


def autotune_enabled() -> bool:
  return os.environ.get(ENV_AUTOTUNE, "0") not in ("", "0", "false", "False")


def time_call(fn: Callable, args: Sequence, repeats: int = 10, inner: int = 1) -> float:
  """Median wall time in microseconds of one `fn(*args)`, measured as `inner` chained calls
  (`timing.ChainSampler`: up to 16 in one program, dispatched back to back) less their
  floor, so host dispatch (20-40 us on H200) stays out of kernels that take about as long."""
  sampler = timing.ChainSampler(fn, args, min(inner, max(1, timing.loop_unroll())), warmup=1)
  sampler.set_calls(inner)
  return statistics.median(sampler.sample() * 1e6 for _ in range(repeats))


def tune(kernel: str, key: str, candidates: Sequence[Config],
         run: Callable[[Config], Tuple[Callable, Sequence]], repeats: int = 10,
         inner: int = TUNE_INNER) -> Config:
  """Times each candidate (at most MAX_CANDIDATES) and caches the fastest.

  `run(config)` returns `(fn, args)`: a jittable kernel call and its concrete inputs.
  A candidate that fails to compile (too much shared memory, registers) is skipped.
  """
  if jax.default_backend() == "cpu":
    raise RuntimeError("Pallas autotuning needs a GPU; on the CPU kernels run interpreted "
                       "with their default tiles")
  candidates = list(dict.fromkeys(candidates))[:MAX_CANDIDATES]
  timings, errors, best, best_t = {}, {}, None, float("inf")
  for config in candidates:
    name = json.dumps(config.to_dict(), sort_keys=True)
    try:
      # Callers tune on eager (concrete) calls only. Not under ensure_compile_time_eval:
      # that evaluates a pallas_call's body primitive by primitive, which fails on
      # program_id (measured on H200, jax 0.11.2).
      fn, args = run(config)
      t = time_call(fn, args, repeats, inner)
    except Exception as e:  # A config Triton cannot compile is not an error of the kernel.
      logging.info("tuning %s %s: config %s failed: %s", kernel, key, name, e)
      timings[name] = None
      errors[name] = f"{type(e).__name__}: {str(e)[:500]}"
      continue
    timings[name] = t
    if t < best_t:
      best, best_t = config, t
  if best is None:
    raise RuntimeError(f"tuning {kernel} {key}: every candidate failed: {errors}")
  record(kernel, key, best, best_t, timings)
  return best


def choose(kernel: str, key: str, default: Config, candidates: Iterable[Config],
           run: Optional[Callable[[Config], Tuple[Callable, Sequence]]] = None) -> Config:
  """Cached config, else (on a GPU with LOKA_PALLAS_AUTOTUNE=1 and a runner) tune, else default.

  The shipped table is not consulted while autotuning (tuning is what was asked) nor under
  FP8 fast accumulation (its winners were measured with precise accumulation).
  """
  tuning_now = run is not None and autotune_enabled() and jax.default_backend() != "cpu"
  hit = cached(kernel, key, shipped=not tuning_now and compat.fp8_imprecise_acc() == 0,
               config_type=type(default))
  if hit is not None:
    return hit
  if tuning_now:
    return tune(kernel, key, list(candidates), run)
  return default


def filter_candidates(candidates: Iterable[Config],
                      valid: Callable[[Config], bool]) -> List[Config]:
  out = [c for c in dict.fromkeys(candidates) if valid(c)]
  return out[:MAX_CANDIDATES]
