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
# only a few tests train long (docs/BENCHMARKS.md, twelfth session).
# XLA:CPU's older elemental fusion emitters compile the suite's steps faster than its MLIR
# fusion emitters (Wukong tiny's train step 6.0 s -> 2.8 s, `experiments.compile_times`; the
# suite 17.3 -> 11.7 min with the one-example init, thirteenth session); given only to a jaxlib
# that knows the flag (XLA aborts on an unknown one).
_CHEAP_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                  "--xla_cpu_use_fusion_emitters=false")


def _flags_xla_knows(names):
  """The flag names among `names` that the installed jaxlib's libraries hold (one scan)."""
  import glob
  import importlib.util
  import mmap
  jaxlib = os.path.dirname(importlib.util.find_spec("jaxlib").origin)
  known = set()
  for path in glob.glob(os.path.join(jaxlib, "*.so")):
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
      known.update(n for n in names if n not in known and data.find(n.encode()) >= 0)
  return known


_wanted = {f.split("=")[0].lstrip("-"): f for f in _CHEAP_COMPILE
           if f.split("=")[0] not in os.environ["XLA_FLAGS"]}
for _name in sorted(_flags_xla_knows(_wanted)):
  os.environ["XLA_FLAGS"] += " " + _wanted[_name]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
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
