r"""List registered kernels, or check every kernel's error (and, on a GPU, speed) per shape.

The check ends each shape with every kernel's verdict (measured, unsupported, error) and exits
with status 1 when some kernel failed: it raised or gave a non-finite output.

  python3 -m experiments.kernels --config.list=true
  python3 -m experiments.kernels --config.check.m=2048 --config.check.k=256 \
      --config.check.n=768 [--config.check.seed=0] [--config.check.json=out.json]
  python3 -m experiments.kernels --config.check.shapes=2048x256x768,4096x512x512 \
      --config.check.time=true --config.check.out=DIR

Settings come from experiments/configs/kernels.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field).
"""
import json
import os
import sys

from absl import app, flags

from experiments import run_config
from loka_jax import _compat, kernels
from loka_jax.kernels import check as check_lib

CONFIG = run_config.define_config_flag("kernels")
flags.adopt_module_key_flags(run_config)  # --help lists --config


def _parse_shapes(check):
  if not check.shapes:
    return [(check.m, check.k, check.n)]
  shapes = []
  for text in run_config.split(check.shapes):
    try:
      m, k, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
      sys.exit(f"error: --config.check.shapes: {text!r} must look like 2048x256x768")
    shapes.append((m, k, n))
  return shapes


def _done_shapes(path):
  if not path or not os.path.exists(path):
    return set()
  with open(path) as f:
    return {tuple(json.loads(line)["shape"].values()) for line in f if line.strip()}


def _list() -> None:
  for k in kernels.all_kernels():
    passes = ",".join(p for p in kernels.PASSES if p in k.passes)
    print(f"{k.name:36s} {k.backend:14s} {k.sort:9s} passes={passes} "
          f"kinds={','.join(sorted(k.kinds))}{' stateful' if k.stateful else ''}  {k.description}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = CONFIG.value
  if config.list:
    return _list()
  check = config.check
  shapes = _parse_shapes(check)
  if any(d < 1 for s in shapes for d in s):
    sys.exit(f"error: every dimension of a shape must be >= 1, got {shapes}")
  if check.time and not _compat.on_gpu():
    print("note: timings on the CPU are for smoke-testing only, never for dispatch")
  jsonl = os.path.join(check.out, "check.jsonl") if check.out else None
  if check.out:
    os.makedirs(check.out, exist_ok=True)
  done = _done_shapes(jsonl)
  names = run_config.split(check.only) or kernels.names()
  failed = set()
  for shape in shapes:
    if shape in done:
      print(f"skip {shape}: already in {jsonl}")
      continue
    problem = check_lib.Problem(*shape, seed=check.seed)
    report = check_lib.run_check(problem, names)
    failed.update(k for k, v in report["verdicts"].items() if v == check_lib.ERROR)
    if check.time:
      report["timing"] = check_lib.time_forward(problem, names)
    print(check_lib.format_table(report))
    if check.time:
      print(check_lib.format_timing(report))
    if check.json:
      with open(check.json, "w") as f:
        json.dump(report, f, indent=1)
    if jsonl:
      with open(jsonl, "a") as f:
        f.write(json.dumps(report) + "\n")
  if failed:
    sys.exit(f"kernel check: {len(failed)} kernel(s) failed: {', '.join(sorted(failed))}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
