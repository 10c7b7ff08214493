"""Test-session set-up (before JAX starts): 4 fake CPU devices, cheaper XLA:CPU compiles, one
compilation cache for the whole run, and a bounded hypothesis profile."""
import atexit
import os
import shutil
import tempfile

# Must run before jax initializes its backends: sharding tests need several devices.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
# The suite is compile-bound: its models are tiny, so XLA:CPU's LLVM optimizations cost more
# than they save. They change how code is generated, not what it computes. Measured on 2
# cores with the cache below: the whole suite 16.7 min at level 0 (23.5 min before either),
# 20.0 at level 1, which compiles longer but runs a tiny model's step about 2.5x faster:
# only a few tests train long.
# XLA:CPU's older elemental fusion emitters compile the suite's steps faster than its MLIR
# fusion emitters (Wukong tiny's train step 6.0 s -> 2.8 s, `experiments.compile_times`; the
# suite 17.3 -> 11.7 min with the one-example init). Newer jaxlibs (0.11.2)
# dropped that flag while its name stays in their libraries, and XLA aborts the process on an
# unknown flag; so the flags go to XLA only after a child process accepted them.
_CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags):
  """Whether a CPU backend starts with `flags` added to XLA_FLAGS (one child process, ~1 s)."""
  import subprocess
  import sys
  env = {**os.environ, "XLA_FLAGS": " ".join([os.environ["XLA_FLAGS"], *flags]),
         "JAX_PLATFORMS": "cpu"}
  return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0


def _flags_xla_accepts(flags):
  """The flags XLA accepts: all at once, or else each on its own."""
  if not flags or _xla_accepts(flags):
    return list(flags)
  return [f for f in flags if _xla_accepts([f])]


# xdist workers and subprocesses inherit the result (XLA_FLAGS, and the mark that the check
# ran, so flags XLA refused are not tried again in every worker).
if "LOKA_TEST_XLA_FLAGS_CHECKED" not in os.environ:
  _wanted = [f for f in _CHEAP_COMPILE if f.split("=")[0] not in os.environ["XLA_FLAGS"]]
  for _flag in _flags_xla_accepts(_wanted):
    os.environ["XLA_FLAGS"] += " " + _flag
  os.environ["LOKA_TEST_XLA_FLAGS_CHECKED"] = "1"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests make their directories with tempfile and leave them (one checkpoint test writes 1.5
# GB): all of them go under one root per run, which the xdist workers and subprocesses inherit
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
# Eager single-op compiles (~40 ms on a CPU) stay out; steps and passes (seconds) go in.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("MPLBACKEND", "Agg")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "loka", deadline=None, derandomize=True, max_examples=40, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "loka"))
