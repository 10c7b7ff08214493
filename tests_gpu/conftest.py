"""GPU-only checks: run on the GPU host with `python -m pytest tests_gpu -q`; CI never collects them."""
import jax
import pytest


def pytest_collection_modifyitems(config, items):
  if jax.default_backend() != "gpu":
    raise pytest.UsageError("tests_gpu/ needs a GPU (jax.default_backend() is "
                            f"{jax.default_backend()!r}); run it on the GPU host")
