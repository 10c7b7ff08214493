"""List registered kernels, or check every kernel's error (and, on a GPU, speed) per shape.

--check ends each shape with every kernel's verdict (measured, unsupported, error) and exits
with status 1 when some kernel failed: it raised or gave a non-finite output.

  python -m experiments.kernels --list
  python -m experiments.kernels --check --m=2048 --k=256 --n=768 [--seed=0] [--json=out.json]
  python -m experiments.kernels --check --shapes=2048x256x768,4096x512x512 --time --out=DIR
"""
import json
import os
import sys

from absl import app, flags

from loka_jax import _compat, kernels
from experiments import common_flags
from loka_jax.kernels import check

LIST = flags.DEFINE_bool("list", False, "Print every registered kernel and its passes.")
CHECK = flags.DEFINE_bool("check", False, "Run every kernel, every pass (a chain kernel: its "
                          "whole chain), against fp32 HIGHEST; exit 1 if a kernel fails.")
M = flags.DEFINE_integer("m", 512, "Rows of the activation (batch).")
K = flags.DEFINE_integer("k", 384, "Contracting size.")
N = flags.DEFINE_integer("n", 256, "Output features.")
SHAPES = flags.DEFINE_list("shapes", [], "Several MxKxN shapes instead of --m/--k/--n.")
JSON = flags.DEFINE_string("json", None, "Write the loka.check/1 JSON here (one shape).")
ONLY = flags.DEFINE_list("only", [], "Restrict --check to these kernels.")
TIME = flags.DEFINE_bool("time", False, "Also time each kernel's forward vs xla_bf16 (GPU).")
OUT = flags.DEFINE_string("out", None, "Directory for check.jsonl (resumable: done shapes skipped).")


def _parse_shapes():
  if not SHAPES.value:
    return [(M.value, K.value, N.value)]
  shapes = []
  for text in SHAPES.value:
    try:
      m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
      raise app.UsageError(f"--shapes entry {text!r} must look like 2048x256x768") from None
    shapes.append((m, k, n))
  return shapes


def _done_shapes(path):
  if not path or not os.path.exists(path):
    return set()
  with open(path) as f:
    return {tuple(json.loads(line)["shape"].values()) for line in f if line.strip()}


def main(argv):
  del argv
  if LIST.value == CHECK.value:
    raise app.UsageError("pass exactly one of --list or --check")
  if LIST.value:
    for k in kernels.all_kernels():
      passes = ",".join(p for p in kernels.PASSES if p in k.passes)
      print(f"{k.name:36s} {k.backend:14s} {k.sort:9s} passes={passes} "
            f"kinds={','.join(sorted(k.kinds))}{' stateful' if k.stateful else ''}  {k.description}")
    return
  shapes = _parse_shapes()
  if any(d < 1 for s in shapes for d in s):
    raise app.UsageError(f"every dimension must be >= 1, got {shapes}")
  if TIME.value and not _compat.on_gpu():
    print("note: timings on the CPU are for smoke-testing only, never for dispatch")
  jsonl = os.path.join(OUT.value, "check.jsonl") if OUT.value else None
  if OUT.value:
    os.makedirs(OUT.value, exist_ok=True)
  done = _done_shapes(jsonl)
  names = ONLY.value or kernels.names()
  failed = set()
  for shape in shapes:
    if shape in done:
      print(f"skip {shape}: already in {jsonl}")
      continue
    problem = check.Problem(*shape, seed=common_flags.SEED.value)
    report = check.run_check(problem, names)
    failed.update(k for k, v in report["verdicts"].items() if v == check.ERROR)
    if TIME.value:
      report["timing"] = check.time_forward(problem, names)
    print(check.format_table(report))
    if TIME.value:
      print(check.format_timing(report))
    if JSON.value:
      with open(JSON.value, "w") as f:
        json.dump(report, f, indent=1)
    if jsonl:
      with open(jsonl, "a") as f:
        f.write(json.dumps(report) + "\n")
  if failed:
    sys.exit(f"kernel check: {len(failed)} kernel(s) failed: {', '.join(sorted(failed))}")


if __name__ == "__main__":
  app.run(main)
