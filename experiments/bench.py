"""GPU benchmarks, resumable: `python -m experiments.bench --suite=models --workdir=DIR`.

Rows go to DIR/bench.jsonl as they finish; a rerun skips finished rows (--only narrows the set).
"""
import os
import time

import jax
from absl import app, flags

from loka_jax import _compat
from loka_jax.bench import models as bench_models
from loka_jax.bench.results import ResultsFile
from loka_jax.models.presets import MODEL_NAMES

SUITE = flags.DEFINE_enum("suite", "models", ("models",), "Which benchmark suite.")
WORKDIR = flags.DEFINE_string("bench_dir", None, "Results directory (bench.jsonl, table.md).")
MODELS_FLAG = flags.DEFINE_list("models", list(MODEL_NAMES), "Models to measure.")
PRESETS = flags.DEFINE_list("presets", ["small", "large"], "Presets to measure.")
VARIANTS = flags.DEFINE_list("variants", ["bf16", "fp8_tensorwise"],
                             f"Variants from {sorted(bench_models.VARIANTS)}; bf16 always runs.")
REPEATS = flags.DEFINE_integer("repeats", 20, "Timed repeats per variant (interleaved).")
MAX_MINUTES = flags.DEFINE_float("max_minutes", 7.0, "Stop starting new rows after this long.")
ONLY = flags.DEFINE_list("only", [], "Run only rows whose 'model/preset' is listed.")
COMPILE_CACHE = flags.DEFINE_string("compile_cache", None,
                                    "Persistent compilation cache (default: BENCH_DIR/jax_cache).")
BATCH = flags.DEFINE_integer("batch_size", 0, "Batch size; 0: each preset's.")


def _table(rows) -> str:
  lines = ["| model | preset | variant | batch | train ex/s | train speedup [95% CI] | "
           "infer ex/s | infer speedup [95% CI] | train mem GiB | device |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    t, i = r["train"], r["infer"]
    mem = r.get("train_memory_bytes")
    lines.append(
        f"| {r['model']} | {r['preset']} | {r['variant']} | {r['batch_size']} | "
        f"{t['examples_per_s']:,.0f} | {t['speedup']:.2f} [{t['speedup_ci'][0]:.2f}, "
        f"{t['speedup_ci'][1]:.2f}] | {i['examples_per_s']:,.0f} | {i['speedup']:.2f} "
        f"[{i['speedup_ci'][0]:.2f}, {i['speedup_ci'][1]:.2f}] | "
        f"{'-' if mem is None else f'{mem / 2**30:.2f}'} | {r['device']} |")
  return "\n".join(lines)


def main(argv):
  del argv
  workdir = WORKDIR.value or os.environ.get("OUT") or "bench_results"
  jax.config.update("jax_compilation_cache_dir",
                    COMPILE_CACHE.value or os.path.join(workdir, "jax_cache"))
  if not _compat.on_gpu():
    print("warning: not on a GPU; these timings are smoke tests, not results")
  results = ResultsFile(os.path.join(workdir, "bench.jsonl"),
                        ("suite", "model", "preset", "variant", "device"))
  device = jax.devices()[0].device_kind
  names = ["bf16"] + [v for v in VARIANTS.value if v != "bf16"]
  variants = [bench_models.VARIANTS[v] for v in names]
  start = time.time()
  for preset in PRESETS.value:
    for model in MODELS_FLAG.value:
      if ONLY.value and f"{model}/{preset}" not in ONLY.value:
        continue
      keys = [("models", model, preset, v.name, device) for v in variants]
      if all(results.done(k) for k in keys):
        continue
      if (time.time() - start) / 60 > MAX_MINUTES.value:
        print(f"stopping at --max_minutes={MAX_MINUTES.value}; rerun to continue")
        break
      print(f"measuring {model}/{preset}: {', '.join(names)}", flush=True)
      try:
        measured = bench_models.measure(model, preset, variants, repeats=REPEATS.value,
                                        batch_size=BATCH.value or None)
      except Exception as e:  # record the failure and go on (e.g. out of memory)
        results.append({"suite": "models", "model": model, "preset": preset,
                        "variant": "bf16", "device": device, "error": f"{type(e).__name__}: {e}"})
        print(f"  failed: {type(e).__name__}: {str(e)[:300]}")
        continue
      for v in variants:
        results.append({"suite": "models", "model": model, "preset": preset, "variant": v.name,
                        "device": device, "jax": jax.__version__, **measured[v.name]})
  rows = [r for r in results.rows() if "error" not in r]
  table = _table(rows)
  with open(os.path.join(workdir, "table.md"), "w") as f:
    f.write(table + "\n")
  print(table)
  for r in results.rows():
    if "error" in r:
      print(f"error {r['model']}/{r['preset']}: {r['error'][:200]}")


if __name__ == "__main__":
  app.run(main)
