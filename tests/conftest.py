"""Test-session set-up (before JAX starts): 4 fake CPU devices, cheaper XLA:CPU compiles, one
compilation cache for the whole run, and a bounded hypothesis profile; and tests/gpu left out
of every run that does not ask for the gpu marker.

The GPU checks live in tests/gpu and run on the GPU host with `python3 -m pytest tests/gpu -m gpu
-q`; `python3 -m pytest tests` (CI) never collects them. A GPU run gets none of the CPU set-up
below (no fake CPU devices, no CPU-only XLA flags, no JAX_PLATFORMS=cpu)."""
import atexit
import gc
import os
import pathlib
import re
import shlex
import shutil
import sys
import tempfile

import pytest

GPU_DIR = pathlib.Path(__file__).resolve().parent / "gpu"


def selects_gpu(markexpr) -> bool:
  """Whether a `-m` expression asks for the gpu tests: it names `gpu` other than as `not gpu`
  (`-m gpu`, `-m "gpu and not slow"`; not `-m "not network"` or `-m "not gpu"`)."""
  words = re.findall(r"[\w.]+|[()]", markexpr or "")
  return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def _targets_gpu(args) -> bool:
  """Whether pytest's command line (`args`) selects the gpu marker or names a path in tests/gpu."""
  for i, arg in enumerate(args):
    if arg == "-m" and i + 1 < len(args) and selects_gpu(args[i + 1]):
      return True
    if arg.startswith("-m") and len(arg) > 2 and selects_gpu(arg[2:].lstrip("=")):
      return True
    if not arg.startswith("-"):
      path = pathlib.Path(arg.split("::")[0]).resolve()
      if path == GPU_DIR or GPU_DIR in path.parents:
        return True
  return False


def pytest_ignore_collect(collection_path, config):
  """tests/gpu is collected only when the run selects the gpu marker (`-m gpu`)."""
  if collection_path.resolve() == GPU_DIR and not selects_gpu(config.option.markexpr):
    return True
  return None


# A GPU run is told by its command line, read here because this set-up must run before jax
# starts, before pytest hands a hook the parsed options: `-m gpu` or a path in tests/gpu in
# sys.argv (or PYTEST_ADDOPTS). xdist workers do not get pytest's argv: they inherit the
# answer through LOKA_TEST_GPU_RUN.
GPU_RUN = (os.environ.get("LOKA_TEST_GPU_RUN") == "1" or
           _targets_gpu(sys.argv[1:] + shlex.split(os.environ.get("PYTEST_ADDOPTS", ""))))
if GPU_RUN:
  os.environ["LOKA_TEST_GPU_RUN"] = "1"


# The suite is compile-bound: its models are tiny, so XLA:CPU's LLVM optimizations cost more
# than they save. They change how code is generated, not what it computes. Measured on 2
# cores with the cache below: the whole suite 16.7 min at level 0 (23.5 min before either),
# 20.0 at level 1, which compiles longer but runs a tiny model's step about 2.5x faster:
# only a few tests train long.
# XLA:CPU's older elemental fusion emitters compile the suite's steps faster than its MLIR
# fusion emitters (Wukong tiny's train step 6.0 s -> 2.8 s by JAX's compile log; the
# suite 17.3 -> 11.7 min with the one-example init). Newer jaxlibs (0.11.2) dropped that
# flag, and XLA aborts the process on an unknown flag, so the flags go to XLA only after a
# child process accepted them; there the backend option xla_cpu_disable_new_fusion_emitters
# picks the same emitters (tests/models on 2 workers under jax 0.11.2: 57.7 -> 35.6 s; under
# 0.10.2, which takes both, 38.5 s with or without it). jaxlib 0.12 has neither: 52.7 s.
# XLA:CPU splits each program's LLVM module into parts it compiles on a thread pool: on cores
# that the two xdist workers already keep busy, the threads add CPU and save no wall time.
# One part compiles the same code (tiny Wukong, DCNv2 and InterFormer init and train steps:
# 8.6 -> 7.1 s of compile CPU); tests/models, test_plans, test_loop and tests/api on 2
# workers 121.9 -> 111.7 s.
# XLA:CPU's FAST_COMPILE preset (what XLA runs its own CPU tests under as well) runs fewer
# HLO fusion passes: tiny Wukong+Mods' bf16 and FP8 train steps compile to more, smaller
# fusions and give bit-identical losses and parameters after three steps. The init programs
# compile 20-25% faster (the same three towers: 7.9 -> 7.1 s of compile CPU); tests/models,
# test_plans, test_loop and tests/api on 2 workers 110.4 -> 103.8 s.
_CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false", "--xla_cpu_parallel_codegen_split_count=1",
                  "--xla_cpu_opt_preset=FAST_COMPILE",
                  "--xla_backend_extra_options=xla_cpu_disable_new_fusion_emitters=true")


def _xla_accepts(flags):
  """Whether a CPU backend starts with `flags` added to XLA_FLAGS (one child process, ~1 s)."""
  import subprocess
  env = {**os.environ, "XLA_FLAGS": " ".join([os.environ["XLA_FLAGS"], *flags]),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _flags_xla_accepts(flags):
  """The flags XLA accepts: all at once, or else each on its own."""
  if not flags or _xla_accepts(flags):
    return list(flags)
  return [f for f in flags if _xla_accepts([f])]


def _cpu_set_up():
  """The CPU run's environment, set before jax starts (xdist workers and subprocesses inherit
  it)."""
  # Must run before jax initializes its backends: sharding tests need several devices.
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=4").strip()
  # xdist workers and subprocesses inherit the result (XLA_FLAGS, and the mark that the check
  # ran, so flags XLA refused are not tried again in every worker).
  if "LOKA_TEST_XLA_FLAGS_CHECKED" not in os.environ:
    wanted = [f for f in _CHEAP_COMPILE if f.split("=")[0] not in os.environ["XLA_FLAGS"]]
    for flag in _flags_xla_accepts(wanted):
      os.environ["XLA_FLAGS"] += " " + flag
    os.environ["LOKA_TEST_XLA_FLAGS_CHECKED"] = "1"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Tests make their directories with tempfile and leave them (one checkpoint test writes 768
  # MB): all of them go under one root per run, which the xdist workers and subprocesses inherit
  # through TMPDIR and which the process that made it removes.
  if "LOKA_TEST_TMP_ROOT" not in os.environ:
    os.environ["LOKA_TEST_TMP_ROOT"] = os.environ["TMPDIR"] = tempfile.mkdtemp(
        prefix="loka_jax_test_tmp_")
    atexit.register(shutil.rmtree, os.environ["LOKA_TEST_TMP_ROOT"], ignore_errors=True)
  tempfile.tempdir = None   # gettempdir() reads TMPDIR again
  # Many tests compile the same tiny steps (a model's train step in several tests, a CLI run and
  # its resumption): one persistent cache per run, which the xdist workers and every CLI or
  # notebook subprocess inherit through the environment. Removed by the process that made it.
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="loka_jax_test_jax_cache_")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
  # Every compile goes in, eager single ops (~40 ms each on a CPU) too: the CLIs honour it
  # (experiments/run_config.py), so a CLI child, a run killed and resumed, or a second run of
  # a test's settings loads its short compiles as well as its steps. Measured on 2 cores:
  # against 0.2 s, 0.05 s took the bench tests 67 -> 61 s and test_kill_resume.py 48 -> 44 s;
  # against 0.05 s, 0 took the main-job, probe, kill-resume and shadow-arm CLI tests
  # 71.1 -> 69.0 s and test_bench, tests/api and tests/models 101.7 -> 100.4 s.
  os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  os.environ.setdefault("MPLBACKEND", "Agg")


# The CPU set-up would hide the GPU (JAX_PLATFORMS=cpu, fake CPU devices) and give the GPU's
# compiles CPU-only XLA flags: a run that targets tests/gpu (`-m gpu`, or a tests/gpu path, in
# sys.argv) skips it.
if not GPU_RUN:
  _cpu_set_up()

# Tracing and lowering make millions of short-lived objects, and at the default threshold
# (700) the cyclic collector ran every few hundred of them (5,440 collections, 6.0 s of a
# 105 s run of test_plans, test_models_learn and test_training); at 10,000 it runs a
# seventh as often (1.75 s). Objects no cycle holds are freed at once either way.
# tests/dispatch/validate, test_plans and tests/models on 2 workers: 140.3 -> 135.9 s.
# cli_helpers' and warm_python's warm interpreters set the same for their children.
GC_THRESHOLD = (10_000, 10, 10)
gc.set_threshold(*GC_THRESHOLD)


# XLA:CPU links each compiled program's machine code into memory mappings of its own (three
# per LLVM module), and jax's caches keep every program a process compiled. jax 0.12's XLA:CPU,
# which has no legacy elemental emitters (above), makes an LLVM module of each fusion: a toy
# function of 20 layers holds 75 mappings compiled there, 7 on jax 0.10 under these flags. An
# xdist worker running half the suite on jax 0.12 then reaches Linux's limit of mappings per
# process (vm.max_map_count, 65,530 by default; 64,653 measured), where the next link fails
# ("LLVM compilation error: Cannot allocate memory") and the worker dies; on jax 0.10 a worker
# peaks near 37,000. Between two test files, a process holding more than 70% of the limit drops
# jax's caches (its later compiles load from the persistent cache above). The margin above
# that line covers the largest file's growth; below it, jax 0.10's workers never drop their
# caches, whose recompiles would cost suite time.
def _max_map_count() -> int:
  try:
    with open("/proc/sys/vm/max_map_count") as f:
      return int(f.read())
  except (OSError, ValueError):
    return 0   # no such limit to read (not Linux)


MAX_MAP_COUNT = _max_map_count()
MAP_COUNT_SHARE = 0.7


def map_count() -> int:
  """Memory mappings this process holds (0 where /proc cannot tell)."""
  try:
    with open("/proc/self/maps", "rb") as f:
      return sum(1 for _ in f)
  except OSError:
    return 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
  """After a test file's last test and its module fixtures' teardown: jax's caches dropped
  when the process holds more than MAP_COUNT_SHARE of vm.max_map_count mappings."""
  yield
  if not MAX_MAP_COUNT or "jax" not in sys.modules:
    return
  if nextitem is not None and nextitem.path == item.path:
    return
  if map_count() > MAP_COUNT_SHARE * MAX_MAP_COUNT:
    sys.modules["jax"].clear_caches()
    gc.collect()

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "loka", deadline=None, derandomize=True, max_examples=40, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "loka"))
