r"""Sharded training benchmark, resumable: step time, scaling efficiency and loss on 1 and N
GPUs, with bf16 or FP8 collectives (docs/PARALLEL.md).

  python3 -m experiments.bench_parallel --workdir=DIR [--config.run.model=wukong] \
      [--config.run.presets=small,large] [--config.parallel.devices=1,2] \
      [--config.parallel.collective_modes=bf16,fp8] [--config.parallel.model_axis=all] \
      [--config.run.mods=all] [--config.run.precision=loka --config.run.plans=small:PLAN] \
      [--config.loss.steps=100] [--config.limits.max_minutes=8] [--config.limits.only=small]

Settings come from experiments/configs/bench_parallel.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field); experiments/bench/parallel_suite.py runs the
variants: `1dev` (the training loop's single-device step, the baseline) and `<n>dev_<mode>`
(the sharded step on n devices with `mode` collectives), for one precision arm (precision,
Mods, and a plan per preset for `loka`). Rows go to WORKDIR/parallel.jsonl
(default: $OUT, else ./parallel_results): one speed row per preset (every variant's step time,
throughput ratio to 1dev and scaling efficiency with bootstrap CIs) and one loss row per
variant. A rerun skips finished rows; no new row starts after config.limits.max_minutes. The
last lines printed are a table of every row so far.
"""
import os
import sys

from absl import app, flags

from experiments import run_config
from experiments import time_limit
from experiments.bench import parallel_suite

CONFIG = run_config.define_config_flag("bench_parallel")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", None, "Directory of parallel.jsonl (default: $OUT, "
                              "else ./parallel_results); rerun to resume.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    settings = parallel_suite.Settings.from_config(CONFIG.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  workdir = WORKDIR.value or os.environ.get("OUT") or "parallel_results"
  if os.path.abspath(settings.compile_cache).startswith(os.path.abspath(workdir) + os.sep):
    sys.exit("error: --config.limits.compile_cache must lie outside --workdir "
             "(only results go there)")
  os.makedirs(workdir, exist_ok=True)
  should_stop = time_limit.stop_after(settings.max_minutes * 60)
  from loka_jax.train.experiment import PlanError  # pylint: disable=g-import-not-at-top
  try:
    parallel_suite.run(settings, workdir, should_stop=should_stop)
  except PlanError as e:
    sys.exit(f"error: {e}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
