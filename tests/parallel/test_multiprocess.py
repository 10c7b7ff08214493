"""Two processes joined by jax.distributed over localhost (CPU, gloo collectives, 2 devices
each) train one data:2,model:2 mesh, checkpoint and resume: the same losses, held-out metrics
and final parameters as one process training the same global batches on 4 devices."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import chex
import numpy as np
from absl.testing import absltest

import multiprocess_worker as worker
from loka_jax.train import Checkpointer, create_train_state, make_optimizer, read_metrics
from sharded_fixtures import BATCH, OPTIM, host, odd_dlrm

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiprocess_worker.py")
TIMEOUT_S = 300


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def two_processes(workdir):
  """Runs the worker as processes 0 and 1; returns their stdout's last JSON lines."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if "xla_force_host_platform_device_count" not in f]
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "XLA_FLAGS": " ".join(flags + ["--xla_force_host_platform_device_count=2"])}
  address = f"localhost:{free_port()}"
  procs = [subprocess.Popen([sys.executable, WORKER, workdir, address, "2", str(i)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for i in range(2)]
  outputs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=TIMEOUT_S)
      if p.returncode:
        raise AssertionError(f"process exited {p.returncode}:\n{err[-3000:]}")
      outputs.append(json.loads(out.strip().splitlines()[-1]))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  return outputs


def final_state(workdir):
  model, source = odd_dlrm()
  template = create_train_state(model, make_optimizer(OPTIM), source.train_batch(0, BATCH), 1)
  with Checkpointer(os.path.join(workdir, "checkpoints")) as checkpointer:
    return host(checkpointer.restore(template)[0])


class MultiProcessTest(absltest.TestCase):

  def test_two_processes_train_like_one(self):
    with tempfile.TemporaryDirectory() as two, tempfile.TemporaryDirectory() as one:
      outputs = two_processes(two)
      worker.main(one, None, 1, 0)   # this process: 4 devices, one controller
      self.assertEqual(sorted(o["process"] for o in outputs), [0, 1])
      lines, ref_lines = read_metrics(f"{two}/metrics.jsonl"), read_metrics(f"{one}/metrics.jsonl")
      self.assertEqual([line["step"] for line in lines], [1, 2, 3])   # written once, resumed at 2
      np.testing.assert_allclose([line["loss"] for line in lines],
                                 [line["loss"] for line in ref_lines],
                                 rtol=1e-6)
      with open(f"{two}/final.json") as f, open(f"{one}/final.json") as g:
        final, ref_final = json.load(f), json.load(g)
      self.assertEqual(final["steps"], 3)
      for key in ("ne", "auc", "logloss"):
        np.testing.assert_allclose(final[key], ref_final[key], rtol=1e-6)
        # Both processes computed the same held-out metrics, before and after the resume.
        self.assertEqual(outputs[0]["finals"][1][key], outputs[1]["finals"][1][key])
      state, ref_state = final_state(two), final_state(one)
      self.assertEqual(int(state.step), 3)
      chex.assert_trees_all_close(state, ref_state, rtol=1e-6, atol=1e-7)


if __name__ == "__main__":
  absltest.main()
