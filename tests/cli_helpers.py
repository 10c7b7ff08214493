"""Shared by the tests that run the repository's code in a child process (a CLI, a script, a
notebook kernel): the repository root, the child's environment and `python -m` from the root.

It lives at tests/ level, which is on sys.path in every test (tests/conftest.py is there), so
any test imports it as `from cli_helpers import ...` wherever the test file sits."""
import os
import subprocess
import sys

# This file is tests/cli_helpers.py: the repository root is one level up.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cpu_env(**extra):
  """Environment of a CLI or notebook kernel: CPU, and conftest's compile flags and
  compilation cache (inherited)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
              PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra)


def run_module(module: str, *args, timeout: float = 300):
  """`python -m module args` from the repository root under `cpu_env`, output captured."""
  return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=cpu_env(),
                        capture_output=True, text=True, timeout=timeout)
