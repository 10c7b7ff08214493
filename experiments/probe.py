r"""Probe a tower: train (or resume) with the statistics pass, evaluate and time every
candidate kernel on every GEMM site, write the ProbeReport.

  python3 -m experiments.probe --workdir=/tmp/wk_probe --config.run.preset=small \
      --config.run.steps=200

Settings come from experiments/configs/probe.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field). Writes WORKDIR/probe_report.json (loka.probe/2,
docs/FORMATS.md), WORKDIR/probe_report.md, WORKDIR/plots/ and, on a GPU, merges its timings
into loka_jax/probe/timings/<device>.json (copy: WORKDIR/timing_table/). Rerunning the same
command resumes every phase; with config.budget_s a run that runs out of time exits with
status 3: run it again to finish.

Timings depend on shapes only, so a large model's can be measured ahead (a GPU call with no
training), and the probe later given the same cache skips its timing phase:

  python3 -m experiments.probe --config.run.preset=large --config.timing.only=true \
      --config.timing.cache=DIR

What a probe will hold (sites, distinct shapes, checkpoint size), on any machine:

  python3 -m experiments.probe --config.run.preset=large --config.run.mods=all \
      --config.describe=true
"""
import sys

from absl import app, flags

from experiments import run_config, time_limit
from loka_jax.data.sources import DataFileError
from loka_jax.probe import eligibility
from loka_jax.probe.collector import ProbeConfig, ProbeStateError
from loka_jax.probe.kernel_timing import TimingCacheError
from loka_jax.probe.report import site_table
from loka_jax.probe.runner import (ProbeOptions, ProbeSetupError, describe_probe, run_probe,
                                   time_site_shapes)
from loka_jax.probe.timing_table import TimingTableError
from loka_jax.train import CheckpointError, NonFiniteError, RunSettingsError, TrainConfig
from loka_jax.train import experiment

CONFIG = run_config.define_config_flag("probe")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", None, "Run directory: checkpoints, statistics, "
                              "caches and the report; rerun to resume. Not needed with "
                              "config.timing.only or config.describe.")


def _settings(config):
  """(RunSpec, TrainConfig, ProbeConfig, ProbeOptions) of the config (ValueError on bad
  values)."""
  run, stats, evaluate, timing = config.run, config.stats, config.evaluate, config.timing
  spec = run_config.run_spec(run)
  train_config = TrainConfig(
      steps=run.steps, seed=run.seed,
      batch_size=run.batch_size or experiment.preset_batch_size(spec.model, spec.preset),
      checkpoint_every=run.checkpoint_every, progress=False)
  probe_config = ProbeConfig(
      cadence=stats.cadence, max_full_width=stats.max_full_width, rank=stats.rank,
      weight_ema=stats.weight_ema, reservoir_elements=stats.reservoir_elements,
      min_observations=stats.min_observations, seed=run.seed)
  criteria = eligibility.Criteria(metric=config.select.metric,
                                  min_speedup=config.select.min_speedup or None)
  options = ProbeOptions(
      samples=evaluate.samples,
      reservoir_samples=None if evaluate.reservoir_samples < 0 else evaluate.reservoir_samples,
      kernels=run_config.split(evaluate.kernels), sites=evaluate.sites,
      max_eval_elements=evaluate.max_eval_elements,
      compile_workers=None if evaluate.compile_workers < 0 else evaluate.compile_workers,
      compile_evaluation_while_training=evaluate.compile_while_training,
      time=run_config.auto(timing.time), repeats=timing.repeats, timing_cache=timing.cache,
      timing_table=timing.table, write_table=run_config.auto(timing.write_table),
      timing_compile_workers=timing.compile_workers, min_timing_gflops=timing.min_gflops,
      plots=config.plots.enabled, site_plots=config.plots.sites,
      should_stop=time_limit.stop_after(config.budget_s), criteria=criteria, seed=run.seed)
  return spec, train_config, probe_config, options


def _describe(spec, train_config, probe_config, options) -> None:
  d = describe_probe(spec, train_config, probe_config, options)
  gb = lambda n: f"{n / 1e9:.1f} GB"
  print(f"{spec.model}/{spec.preset}: {d['sites']} sites, {d['distinct_shapes']} distinct "
        f"GEMM shapes; training state {gb(d['state_bytes'])}, probe statistics "
        f"{gb(d['statistics_bytes'])}, checkpoint about "
        f"{gb(d['state_bytes'] + d['statistics_bytes'])}; its error evaluation compiles "
        f"{d['evaluation_functions']} functions, {d['sites_compiling']} sites bring new ones; "
        f"its statistics pass {d['statistics_functions']}"
        + (f"; {d['shapes_to_time']} shapes at or above config.timing.min_gflops to time"
           if options.min_timing_gflops else ""))


def _time_only(spec, train_config, probe_config, options) -> None:
  done = time_site_shapes(spec, train_config.batch_size, options.timing_cache, probe_config,
                          options)
  print(f"timed {done['timed']} of {done['shapes']} site shapes on {done['device_kind']}"
        + (f" ({done['skipped']} below config.timing.min_gflops, not timed)"
           if done["skipped"] else "") + f": {done['cache']}")
  if done["pending"]:
    print(f"INCOMPLETE: {done['pending']} shapes left (budget). Rerun the same command.")
    sys.exit(3)


def _print_summary(result) -> None:
  report = result.report
  print(site_table(report))
  ov = report["overhead"]
  fraction = "-" if ov.get("fraction") is None else f"{100 * ov['fraction']:.2f}%"
  print(f"\nprobe overhead: {fraction} ({ov.get('observations')} observations; "
        f"pass {ov.get('probe_ms') or 0:.1f} ms vs step {ov.get('step_ms') or 0:.1f} ms, "
        f"every {ov.get('gap') or ov.get('cadence')} steps); timing valid for dispatch: "
        f"{report['timing_valid']}")
  print(f"report: {result.paths['json']}\nsummary: {result.paths['markdown']}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  config = CONFIG.value
  if not WORKDIR.value and not (config.timing.only or config.describe):
    raise app.UsageError("--workdir is required (the run directory; rerun to resume)")
  if config.timing.only and not config.timing.cache:
    sys.exit("error: --config.timing.only needs --config.timing.cache=DIR (where the "
             "timings go)")
  try:
    settings = _settings(config)
  except ValueError as e:
    sys.exit(f"error: {e}")
  experiment.quiet_library_logs()
  try:
    if config.describe:
      return _describe(*settings)
    if config.timing.only:
      return _time_only(*settings)
    result = run_probe(settings[0], WORKDIR.value, *settings[1:])
  except (NonFiniteError, CheckpointError, RunSettingsError, experiment.PlanError,
          ProbeStateError, ProbeSetupError, TimingTableError, TimingCacheError, DataFileError,
          FileNotFoundError) as e:
    sys.exit(f"error: {e}")
  _print_summary(result)
  if not result.complete:
    print(f"INCOMPLETE: {'; '.join(result.report['pending'][:5])}. Rerun the same command "
          "to finish.")
    sys.exit(3)


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
