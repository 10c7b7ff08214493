"""Probe a tower: train (or resume) with the statistics pass, evaluate and time every
candidate kernel on every GEMM site, write the ProbeReport.

  python -m experiments.probe --model=wukong --preset=small --steps=200 --workdir=/tmp/wk_probe

Writes WORKDIR/probe_report.json (loka.probe/1, docs/FORMATS.md), WORKDIR/probe_report.md,
WORKDIR/plots/ and, on a GPU, merges its timings into loka_jax/probe/timings/<device>.json
(copy: WORKDIR/timing_table/). Rerunning the same command resumes every phase; with
--budget_s a run that runs out of time exits with status 3: run it again to finish.

Timings depend on shapes only, so a large model's can be measured ahead (a GPU call with no
training), and the probe later given the same cache skips its timing phase:

  python -m experiments.probe --model=wukong --preset=large --time_only --timing_cache=DIR

What a probe will hold (sites, distinct shapes, checkpoint size), on any machine:

  python -m experiments.probe --model=wukong --preset=large --mods=all --describe
"""
import os
import sys

import jax
from absl import app, flags

from experiments import time_limit
from experiments import common_flags as common
from loka_jax.probe import eligibility
from loka_jax.probe.timing_table import TimingTableError
from loka_jax.probe.collector import ProbeConfig, ProbeStateError
from loka_jax.probe.kernel_timing import TimingCacheError
from loka_jax.probe.runner import (ProbeOptions, ProbeSetupError, describe_probe, run_probe,
                                   time_site_shapes)
from loka_jax.probe.report import site_table
from loka_jax.train import CheckpointError, NonFiniteError, RunSettingsError, TrainConfig
from loka_jax.train import experiment

AUTO = ("auto", "on", "off")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
NUM_EVAL = flags.DEFINE_integer("num_eval", 0, "Held-out examples; 0: the data source's default.")
CHECKPOINT_EVERY = flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")
SAMPLES = flags.DEFINE_integer("samples", 100, "Draws per site from the learned distributions.")
RESERVOIR_SAMPLES = flags.DEFINE_integer("reservoir_samples", -1,
                                         "Draws per site from the reservoir; -1: --samples.")
KERNELS = flags.DEFINE_list("kernels", [], "Candidate kernels; empty: the default list "
                            "(on a CPU without Pallas).")
SITES = flags.DEFINE_string("sites", None, "Regex: evaluate only matching sites.")
CADENCE = flags.DEFINE_integer("cadence", 25, "Statistics pass every N training steps.")
MIN_OBSERVATIONS = flags.DEFINE_integer("min_observations", 2,
                                        "Observations made after training if fewer exist.")
MAX_FULL_WIDTH = flags.DEFINE_integer("max_full_width", 2048,
                                      "Full covariance up to this width; above: diag + low rank.")
RANK = flags.DEFINE_integer("rank", 32, "Low-rank eigenpairs kept above --max_full_width.")
WEIGHT_EMA = flags.DEFINE_float("weight_ema", 0.1, "Matrix-normal EMA rate; 0: running mean.")
RESERVOIR_ELEMENTS = flags.DEFINE_integer("reservoir_elements", 1 << 20,
                                          "Elements per operand of a site's reservoir.")
MAX_EVAL_ELEMENTS = flags.DEFINE_integer("max_eval_elements", 1 << 22,
                                         "Per operand and sample; larger ones are "
                                         "row-subsampled (recorded).")
TIME = flags.DEFINE_enum("time", "auto", AUTO, "Time kernels here (auto: only on a GPU).")
REPEATS = flags.DEFINE_integer("repeats", 20, "Timing repeats per kernel and pass.")
TIMING_CACHE = flags.DEFINE_string("timing_cache", None,
                                   "Timing cache directory (default WORKDIR/timing_cache).")
TIMING_TABLE = flags.DEFINE_string("timing_table", None,
                                   "Untimed runs: committed table to fall back on (device kind "
                                   "or path); default: an H100 table if committed.")
WRITE_TABLE = flags.DEFINE_enum("write_table", "auto", AUTO,
                                "Merge timings into loka_jax/probe/timings (auto: on a GPU).")
METRIC = flags.DEFINE_enum("metric", "sqnr", eligibility.METRICS,
                           "Eligibility by SQNR (default) or MERE < 0.2 (paper parity).")
MIN_SPEEDUP = flags.DEFINE_float("min_speedup", 1.05,
                                 "Pessimistic speedup a kernel needs; 0: accuracy only.")
TIME_ONLY = flags.DEFINE_bool("time_only", False,
                              "Only time every candidate on every distinct site shape into "
                              "--timing_cache (no training, no statistics, no report): a later "
                              "probe given the same --timing_cache skips its timing phase.")
DESCRIBE = flags.DEFINE_bool("describe", False,
                             "Only print what the probe will hold (sites, distinct GEMM shapes, "
                             "training state and statistics bytes: its checkpoint), from "
                             "abstract shapes: no training, no GPU needed.")
PLOTS = flags.DEFINE_bool("plots", True, "Write PNG plots.")
SITE_PLOTS = flags.DEFINE_bool("site_plots", True, "Write one distribution plot per site.")
BUDGET_S = flags.DEFINE_float("budget_s", 0, "Wall-clock budget; 0: none. Out of time: "
                              "exit 3, rerun to finish.")
compile_workers = common.define_compile_workers()
TIMING_COMPILE_WORKERS = common.define_timing_compile_workers()
MIN_TIMING_GFLOPS = common.define_min_timing_gflops()
COMPILATION_CACHE = flags.DEFINE_string(
    "compilation_cache", os.path.join(os.path.expanduser("~"), ".cache", "loka_jax", "jax_cache"),
    "Persistent XLA compilation cache ('' disables).")


def _auto(value):
  return None if value == "auto" else value == "on"


def _settings():
  """(ProbeConfig, Criteria) from the flags (ValueError on bad values)."""
  probe_config = ProbeConfig(
      cadence=CADENCE.value, max_full_width=MAX_FULL_WIDTH.value, rank=RANK.value,
      weight_ema=WEIGHT_EMA.value, reservoir_elements=RESERVOIR_ELEMENTS.value,
      min_observations=MIN_OBSERVATIONS.value, seed=common.SEED.value)
  criteria = eligibility.Criteria(metric=METRIC.value, min_speedup=MIN_SPEEDUP.value or None)
  return probe_config, criteria


def _run_spec() -> experiment.RunSpec:
  return experiment.RunSpec(
      model=common.MODEL.value, preset=common.PRESET.value, data=common.DATA.value,
      data_spec=common.DATA_SPEC.value, data_path=common.DATA_PATH.value,
      data_cache=common.DATA_CACHE.value, precision=common.PRECISION.value,
      kernel=common.KERNEL.value, plan=common.PLAN.value,
      mods=experiment.parse_mods(common.MODS.value), seed=common.SEED.value,
      num_eval=NUM_EVAL.value or None)


def _train_config(spec: experiment.RunSpec) -> TrainConfig:
  return TrainConfig(
      steps=common.STEPS.value, seed=common.SEED.value,
      batch_size=BATCH_SIZE.value or experiment.preset_batch_size(spec.model, spec.preset),
      checkpoint_every=CHECKPOINT_EVERY.value, progress=False)


def _options(criteria: eligibility.Criteria) -> ProbeOptions:
  return ProbeOptions(
      samples=SAMPLES.value,
      reservoir_samples=None if RESERVOIR_SAMPLES.value < 0 else RESERVOIR_SAMPLES.value,
      kernels=tuple(KERNELS.value), sites=SITES.value, time=_auto(TIME.value),
      repeats=REPEATS.value, timing_cache=TIMING_CACHE.value, timing_table=TIMING_TABLE.value,
      write_table=_auto(WRITE_TABLE.value), max_eval_elements=MAX_EVAL_ELEMENTS.value,
      plots=PLOTS.value, site_plots=SITE_PLOTS.value,
      should_stop=time_limit.stop_after(BUDGET_S.value),
      compile_workers=compile_workers(),
      timing_compile_workers=TIMING_COMPILE_WORKERS.value,
      min_timing_gflops=MIN_TIMING_GFLOPS.value, criteria=criteria, seed=common.SEED.value)


def _print_summary(result) -> None:
  report = result.report
  print(site_table(report))
  ov = report["overhead"]
  fraction = "-" if ov.get("fraction") is None else f"{100 * ov['fraction']:.2f}%"
  print(f"\nprobe overhead: {fraction} ({ov.get('observations')} observations; "
        f"pass {ov.get('probe_ms') or 0:.1f} ms vs step {ov.get('step_ms') or 0:.1f} ms, "
        f"every {ov.get('cadence')} steps); timing valid for dispatch: {report['timing_valid']}")
  print(f"report: {result.paths['json']}\nsummary: {result.paths['markdown']}")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not common.WORKDIR.value and not (TIME_ONLY.value or DESCRIBE.value):
    raise app.UsageError("--workdir is required (the run directory; rerun to resume)")
  try:
    probe_config, criteria = _settings()
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if COMPILATION_CACHE.value:
    jax.config.update("jax_compilation_cache_dir", COMPILATION_CACHE.value)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  experiment.quiet_library_logs()
  spec = _run_spec()
  if DESCRIBE.value:
    d = describe_probe(spec, _train_config(spec), probe_config, _options(criteria))
    gb = lambda n: f"{n / 1e9:.1f} GB"
    print(f"{spec.model}/{spec.preset}: {d['sites']} sites, {d['distinct_shapes']} distinct "
          f"GEMM shapes; training state {gb(d['state_bytes'])}, probe statistics "
          f"{gb(d['statistics_bytes'])}, checkpoint about "
          f"{gb(d['state_bytes'] + d['statistics_bytes'])}; its error evaluation compiles "
          f"{d['evaluation_functions']} functions, {d['sites_compiling']} sites bring new ones; "
          f"its statistics pass {d['statistics_functions']}"
          + (f"; {d['shapes_to_time']} shapes at or above --min_timing_gflops to time"
             if MIN_TIMING_GFLOPS.value else ""))
    return
  if TIME_ONLY.value:
    if not TIMING_CACHE.value:
      raise app.UsageError("--time_only needs --timing_cache=DIR (where the timings go)")
    try:
      done = time_site_shapes(spec, _train_config(spec).batch_size, TIMING_CACHE.value,
                              probe_config, _options(criteria))
    except (ProbeSetupError, TimingCacheError) as e:
      sys.exit(f"error: {e}")
    print(f"timed {done['timed']} of {done['shapes']} site shapes on {done['device_kind']}"
          + (f" ({done['skipped']} below --min_timing_gflops, not timed)" if done["skipped"]
             else "") + f": {done['cache']}")
    if done["pending"]:
      print(f"INCOMPLETE: {done['pending']} shapes left (budget). Rerun the same command.")
      sys.exit(3)
    return
  try:
    result = run_probe(spec, common.WORKDIR.value, _train_config(spec), probe_config,
                       _options(criteria))
  except (NonFiniteError, CheckpointError, RunSettingsError, experiment.PlanError,
          ProbeStateError, ProbeSetupError, TimingTableError, TimingCacheError) as e:
    sys.exit(f"error: {e}")
  _print_summary(result)
  if not result.complete:
    print(f"INCOMPLETE: {'; '.join(result.report['pending'][:5])}. Rerun the same command "
          "to finish.")
    sys.exit(3)


if __name__ == "__main__":
  app.run(main)
