"""A `python3` for the shell scripts under test (`from warm_python import WarmPython`).

The GPU call scripts run `python3 -m experiments.bench ...` (a fresh interpreter, about 2 s of
imports on the CPU before any work) several times a test. `WarmPython` starts one interpreter
that has imported what every CLI imports (`cli_helpers._PRELOAD`) and serves on a Unix
socket; its `env()` puts a `python3` first on the script's PATH that hands each
`python3 -m MODULE ...` to it. The server forks a child that takes the caller's standard
streams (their file descriptors, passed over the socket), environment, working directory and
arguments and runs the module as `python -m` does; the child's exit status is the command's,
and a caller that is killed (by `timeout`) takes the child with it. Any other `python3`
command, and a module call whose environment differs from the server's where an import
reads it (JAX_*, XLA_*, PYTHON*, MPL*), runs the real interpreter.

The server runs unbuffered, as the scripts ask (`export PYTHONUNBUFFERED=1`)."""
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from cli_helpers import _PRELOAD, READ_ON_IMPORT, REPO


_SERVER = r"""
import json, os, select, signal, socket, sys
path, names = sys.argv[1], sys.argv[2].split(",")
for name in names:
  __import__(name)
sys.argv[1:] = []
import gc
gc.freeze()
gc.set_threshold(10_000, 10, 10)   # as tests/conftest.py and cli_helpers set
READ_ON_IMPORT = %r
own = {k: v for k, v in os.environ.items() if k.startswith(READ_ON_IMPORT)}
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(4)
sys.stdout.write("ready\n")
sys.stdout.flush()


def _serve():
  while True:
    conn, _ = server.accept()
    data, fds, _, _ = socket.recv_fds(conn, 65536, 3)
    while not data.endswith(b"\n"):
      chunk = conn.recv(65536)
      if not chunk:
        break
      data += chunk
    request = json.loads(data)
    theirs = {k: v for k, v in request["env"].items() if k.startswith(READ_ON_IMPORT)}
    if len(fds) != 3 or theirs != own:
      for fd in fds:
        os.close(fd)
      conn.sendall(b"fresh\n")
      conn.close()
      continue
    pid = os.fork()
    if pid == 0:
      server.close()
      conn.close()
      return request, fds
    for fd in fds:
      os.close(fd)
    while True:
      caller_gone = select.select([conn], [], [], 0.05)[0] and not conn.recv(1)
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if caller_gone:
        os.kill(pid, signal.SIGKILL)
        _, status = os.waitpid(pid, 0)
        break
    try:
      conn.sendall(b"%%d\n" %% os.waitstatus_to_exitcode(status))
    except OSError:
      pass
    conn.close()


request, fds = _serve()
for target, fd in zip((0, 1, 2), fds):
  os.dup2(fd, target)
  os.close(fd)
os.environ.clear()
os.environ.update(request["env"])
os.chdir(request["cwd"])
# A fresh interpreter seeds the global generators from the OS: so does each child.
import random
import numpy
random.seed()
numpy.random.seed()
import runpy
sys.argv = [request["module"], *request["args"]]
sys.path[0] = os.getcwd()   # `python -m` puts the working directory first
runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
""" % (READ_ON_IMPORT,)

_CLIENT = r"""
import json, os, signal, socket, sys
real = %r
try:
  conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  conn.connect(os.environ["LOKA_WARM_PYTHON"])
  request = {"module": sys.argv[2], "args": sys.argv[3:], "env": dict(os.environ),
             "cwd": os.getcwd()}
  socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], [0, 1, 2])
  reply = b""
  while not reply.endswith(b"\n"):
    chunk = conn.recv(64)
    if not chunk:
      break
    reply += chunk
except OSError:
  reply = b"fresh\n"
if reply.strip() in (b"fresh", b""):
  os.execv(real, [real, *sys.argv[1:]])
code = int(reply)
if code < 0:   # ended by a signal: so does the command
  signal.signal(-code, signal.SIG_DFL)
  os.kill(os.getpid(), -code)
sys.exit(code)
"""

_SHIM = """#!/bin/sh
if [ "$1" = -m ] && [ -n "${LOKA_WARM_PYTHON:-}" ]; then
  exec "%(real)s" -S "%(client)s" "$@"
fi
exec "%(real)s" "$@"
"""


class WarmPython:
  """The warm interpreter and the `python3` that reaches it; `close()` ends the server."""

  def __init__(self):
    self.dir = tempfile.mkdtemp(prefix="loka_warm_python_")
    self.socket = os.path.join(self.dir, "socket")
    bin_dir = os.path.join(self.dir, "bin")
    os.makedirs(bin_dir)
    client = os.path.join(self.dir, "client.py")
    with open(client, "w") as f:
      f.write(_CLIENT % (sys.executable,))
    shim = os.path.join(bin_dir, "python3")
    with open(shim, "w") as f:
      f.write(_SHIM % {"real": sys.executable, "client": client})
    os.chmod(shim, 0o755)
    self.path = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
    self.base_env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER, self.socket, ",".join(_PRELOAD)], cwd=REPO,
        env=self.base_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL)
    if self.proc.stdout.readline() != b"ready\n":   # it could not start: fresh interpreters
      self.close()

  def env(self, **extra):
    """A script's environment (the test's, JAX on the CPU, `extra`) with the warm python3."""
    if self.proc is None:
      return dict(self.base_env, **extra)
    return dict(self.base_env, PATH=self.path, LOKA_WARM_PYTHON=self.socket, **extra)

  def close(self):
    if self.proc is not None:
      self.proc.send_signal(signal.SIGKILL)
      self.proc.wait()
      self.proc = None
    shutil.rmtree(self.dir, ignore_errors=True)
