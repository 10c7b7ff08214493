"""Shared by the tests that run the repository's code in a child process (a CLI, a script, a
notebook kernel): the repository root, the child's environment and `python -m` from the root.

It lives at tests/ level, which is on sys.path in every test (tests/conftest.py is there), so
any test imports it as `from cli_helpers import ...` wherever the test file sits.

`run_module` runs each CLI in a process of its own (its exit status, stdout and stderr are
what a user sees), forked from a warm interpreter that has imported what every CLI imports
(JAX, Flax, Optax, Orbax, Matplotlib, absl, ml_collections, and the library's core modules,
`_PRELOAD`): the suite runs about a hundred CLIs, and those imports were most of each one's
cost on the CPU.
The child runs the CLI's module itself, under the same environment a fresh `python -m` gets.
What it shares with its siblings is the warm interpreter's hash seed (set iteration order).
A CLI whose test changed the environment (JAX reads its settings on import) runs in a fresh
interpreter, as every CLI does under LOKA_TEST_FRESH_CLI=1."""
import json
import locale
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time

# This file is tests/cli_helpers.py: the repository root is one level up.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cpu_env(**extra):
  """Environment of a CLI or notebook kernel: CPU, and conftest's compile flags and
  compilation cache (inherited)."""
  return dict(os.environ, JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
              PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]), **extra)


def load_config(name, *overrides):
  """The config of experiments/configs/<name>.py with `overrides` applied by the flag parser,
  as the entry point would parse its command line, in this process."""
  from absl import flags
  from ml_collections import config_flags
  from experiments import run_config
  argv = ["prog", *overrides]
  values = flags.FlagValues()
  holder = config_flags.DEFINE_config_file(
      "config", os.path.join(run_config.CONFIGS, f"{name}.py"), flag_values=values,
      sys_argv=argv)
  values(argv)
  return holder.value


def run_module(module: str, *args, timeout: float = 300, kill_when=None):
  """`python -m module args` from the repository root under `cpu_env`, output captured (a
  `subprocess.CompletedProcess`; `subprocess.TimeoutExpired` past `timeout`).

  `kill_when(stdout, stderr) -> bool`, if given, is asked every `POLL_S` seconds with the
  run's output so far; when it answers True the run is killed with SIGKILL (what a crash or
  the OOM killer does: no handler runs), and its returncode is -SIGKILL."""
  env = cpu_env()
  if os.environ.get("LOKA_TEST_FRESH_CLI") == "1":
    return _fresh(module, args, env, timeout, kill_when)
  with _LOCK:
    return _forked(module, args, env, timeout, kill_when)


POLL_S = 0.02   # how often `kill_when` is asked


def _fresh(module, args, env, timeout, kill_when=None):
  cmd = [sys.executable, "-m", module, *args]
  if kill_when is None:
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
  with tempfile.TemporaryDirectory(prefix="loka_cli_") as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    with open(out, "w") as fo, open(err, "w") as fe:
      proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=fo,
                              stderr=fe)
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
      if time.monotonic() > deadline:
        proc.kill()
        proc.wait()
        raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
      if kill_when(_read(out), _read(err)):
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        break
      time.sleep(POLL_S)
    return subprocess.CompletedProcess(cmd, proc.returncode, _read(out), _read(err))


# What every CLI imports, the library included. Importing them starts no thread but
# OpenBLAS's pool (which handles a fork), and JAX starts no backend on import, so a fork is
# safe. JAX reads its JAX_* settings on import and XLA_FLAGS when a backend starts: the warm
# interpreter runs under the very environment its children would get.
_PRELOAD = ("numpy", "ml_dtypes", "jax", "jax.numpy", "flax.linen", "optax", "orbax.checkpoint",
            "matplotlib.pyplot", "absl.app", "absl.flags", "absl.logging",
            "ml_collections.config_flags",
            # The library too: it defines no flag and starts no backend on import.
            "loka_jax", "loka_jax.dispatch", "loka_jax.probe.runner", "loka_jax.train.loop")

# The warm interpreter: imports _PRELOAD, then for each request (a JSON line on stdin) forks a
# child, replies with the child's pid, waits for it and replies with its exit status. The
# child leaves the loop and runs the module as `python -m` does (runpy, argv[0] the module's
# file), its stdout and stderr in files, stdin empty; whatever ends it (SystemExit, an
# uncaught exception's traceback, atexit) is what ends a fresh interpreter.
_WARM = r"""
import json, os, sys
for name in sys.argv[1:]:
  __import__(name)
sys.argv[1:] = []
import gc
gc.freeze()   # the children's collector leaves what was imported here alone (it exits faster)
# As tests/conftest.py sets for the test processes: the collector runs a seventh as often
# while a CLI traces and compiles (the main job's first run 18.2 -> 17.5 s of CPU).
gc.set_threshold(10_000, 10, 10)


def _serve():
  replies = sys.stdout
  for line in sys.stdin:
    request = json.loads(line)
    replies.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
      return request
    replies.write(json.dumps({"pid": pid}) + "\n")
    replies.flush()
    _, status = os.waitpid(pid, 0)
    replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
    replies.flush()
  sys.exit(0)


_request = _serve()
os.environ.clear()
os.environ.update(_request["env"])
os.chdir(_request["cwd"])
_null = os.open(os.devnull, os.O_RDONLY)
os.dup2(_null, 0)
os.close(_null)
for _fd, _path in ((1, _request["stdout"]), (2, _request["stderr"])):
  _out = os.open(_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
  os.dup2(_out, _fd)
  os.close(_out)
sys.stdin = open(os.devnull)
# A fresh interpreter seeds the global generators from the OS: so does each child.
import random
import numpy
random.seed()
numpy.random.seed()
import runpy
sys.argv = [_request["module"], *_request["args"]]
if sys.path[0] == "":   # `python -m` puts the working directory itself first
  sys.path[0] = os.getcwd()
runpy.run_module(_request["module"], run_name="__main__", alter_sys=True)
"""

_LOCK = threading.Lock()
_warm = None   # the running warm interpreter (_Warm), started on the first CLI


class _Gone(Exception):
  """The warm interpreter exited."""


class _Warm:

  def __init__(self, env):
    self.proc = subprocess.Popen([sys.executable, "-c", _WARM, *_PRELOAD], cwd=REPO, env=env,
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, bufsize=0)
    self.buffer = b""

  def reply(self, deadline):
    """The next JSON reply; None past `deadline` (a time.monotonic() value, or None)."""
    fd = self.proc.stdout.fileno()
    while b"\n" not in self.buffer:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not select.select([fd], [], [], left)[0]:
        return None
      chunk = os.read(fd, 65536)
      if not chunk:
        raise _Gone()
      self.buffer += chunk
    line, _, self.buffer = self.buffer.partition(b"\n")
    return json.loads(line)

# What the warm interpreter's imports read from the environment (JAX its JAX_* settings,
# Python and Matplotlib theirs; XLA_FLAGS as the suite sets it). A CLI whose environment
# differs from the suite's in these (its test patched one) runs in a fresh interpreter; any
# other variable is the child's own (it takes the CLI's whole environment).
READ_ON_IMPORT = ("JAX_", "XLA_", "PYTHON", "MPL")


def _read_on_import(env):
  return {k: v for k, v in env.items() if k.startswith(READ_ON_IMPORT)}


# The suite's, as the test modules are collected (after conftest's set-up).
_SUITE_ENV = _read_on_import(cpu_env())


def _forked(module, args, env, timeout, kill_when=None):
  global _warm
  if _read_on_import(env) != _SUITE_ENV:
    return _fresh(module, args, env, timeout, kill_when)
  cmd = [sys.executable, "-m", module, *args]
  if _warm is None or _warm.proc.poll() is not None:
    _warm = _Warm(env)
  warm, child = _warm, None
  with tempfile.TemporaryDirectory(prefix="loka_cli_") as tmp:
    out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
    try:
      try:
        warm.proc.stdin.write((json.dumps({"module": module, "args": list(args), "cwd": REPO,
                                           "env": env, "stdout": out,
                                           "stderr": err}) + "\n").encode())
        # The first request waits for the warm interpreter's imports: no child yet to time.
        child = warm.reply(None)["pid"]
      except (BrokenPipeError, _Gone):  # it could not start: a fresh interpreter instead
        _warm = None
        return _fresh(module, args, env, timeout)
      deadline = time.monotonic() + timeout
      while True:
        done = warm.reply(deadline if kill_when is None
                          else min(deadline, time.monotonic() + POLL_S))
        if done is not None:
          break
        if time.monotonic() >= deadline:
          os.kill(child, signal.SIGKILL)
          warm.reply(None)
          raise subprocess.TimeoutExpired(cmd, timeout, _read(out), _read(err))
        if kill_when(_read(out), _read(err)):
          try:
            os.kill(child, signal.SIGKILL)
          except ProcessLookupError:   # it ended meanwhile: its own exit status stands
            pass
          done = warm.reply(None)
          break
    except BaseException as e:
      # Interrupted mid-run (pytest's timeout, say): the child and the warm interpreter go,
      # so no reply of this run is read as the next one's.
      if not isinstance(e, subprocess.TimeoutExpired):
        if child is not None:
          try:
            os.kill(child, signal.SIGKILL)
          except OSError:
            pass
        warm.proc.kill()
        _warm = None
      raise
    return subprocess.CompletedProcess(cmd, done["returncode"], _read(out), _read(err))


def _read(path):
  """A child's output as `subprocess.run(text=True)` gives it."""
  if not os.path.exists(path):
    return ""
  with open(path, encoding=locale.getpreferredencoding(False)) as f:
    return f.read()
