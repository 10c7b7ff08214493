"""GPU-only checks: run on the GPU host with `python3 -m pytest tests/gpu -m gpu -q`; CI
(`python3 -m pytest tests`) never collects them: tests/conftest.py leaves this directory out
of any run that does not select the gpu marker, and skips its CPU set-up in a run that does."""
import pathlib

import jax
import pytest

HERE = pathlib.Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)   # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
  # Every test in this directory carries the gpu marker (a `pytestmark` here would not reach
  # the modules); the others in a run such as `pytest tests -m gpu` keep theirs.
  for item in items:
    if HERE in item.path.resolve().parents:
      item.add_marker(pytest.mark.gpu)
  if jax.default_backend() != "gpu":
    raise pytest.UsageError("tests/gpu/ needs a GPU (jax.default_backend() is "
                            f"{jax.default_backend()!r}); run it on the GPU host")
