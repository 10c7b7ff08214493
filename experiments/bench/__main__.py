r"""Headline benchmark, resumable: bf16 vs the FP8 peers vs LoKA, speed and quality.

  python3 -m experiments.bench --config=experiments/configs/bench_towers.py --workdir=DIR \
      [--config.targets.only=4096x256x8] [--config.speed.variants=bf16,loka] \
      [--config.pacing.max_minutes=6.5]

Settings come from experiments/configs/bench.py (the models suite), or the file of one suite:
bench_towers.py, bench_models.py, bench_quality.py (--config=FILE); --config.GROUP.FIELD=VALUE
overrides one field (e.g. --config.suite=all). A wrong field or value ends the program with
one line naming it, before anything runs.

One process on one GPU. Speed rows (towers, models) go to WORKDIR/bench.jsonl, one per
(target, variant), each with bf16 timed interleaved beside it in the same run; quality rows
to WORKDIR/quality.jsonl, one per trained arm and seed. A rerun skips finished rows, so a
suite longer than one call finishes over several: no new row starts after
pacing.max_minutes, and with pacing.end_by_minutes (the call's hard end) a row or quality
run starts whenever the longest one recorded like it would still end by it, and not
otherwise (`experiments.bench.pace`). The LoKA arm needs each target's plan
(PLANS/<model>_<preset>/plan.json): a missing one is probed first (probe.enabled),
resumably. Every call ends by writing WORKDIR/report.md (tables and the target checks),
WORKDIR/targets.json and PNG plots under WORKDIR/plots/ (`experiments.bench.call`).

targets.mods (default: all) sets the Mods of the Mods arms and of LoKA's probe; another set
than all is its own subject, whose rows carry `mods_set` and whose plans live under
PLANS/mods_<set>/ (`experiments.bench.mods_set`).
"""
import sys

from absl import app, flags

from experiments import run_config

CONFIG = run_config.define_config_flag("bench")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", "bench_results", "Results directory: the rows, the "
                              "plans, the report; rerunning resumes every suite.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from experiments.bench import call as call_lib, settings
  try:
    bench_call = settings.from_config(CONFIG.value, WORKDIR.value)
  except ValueError as e:
    sys.exit(f"error: {e}")
  call_lib.setup(bench_call, WORKDIR.value)
  from loka_jax.models.presets import ModsError
  try:
    call_lib.check_mods_set(bench_call)
  except ModsError as e:
    sys.exit(f"error: {e}")
  call_lib.run(bench_call, WORKDIR.value)


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
