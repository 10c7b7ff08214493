"""Test-session set-up: 4 fake CPU devices (before JAX starts), a bounded hypothesis profile."""
import os

# Must run before jax initializes its backends: sharding tests need several devices.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MPLBACKEND", "Agg")

import hypothesis  # noqa: E402

hypothesis.settings.register_profile(
    "loka", deadline=None, derandomize=True, max_examples=40, print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow])
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "loka"))
