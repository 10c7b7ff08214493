"""The multi-host recipe of docs/PARALLEL.md, run: two processes joined by jax.distributed
over localhost (CPU, gloo collectives, 2 devices each) train one data:2,model:2 mesh with the
documented commands, checkpoint, and are started again to resume. Their losses, held-out
metrics and final parameters are those of one process training the same global batches on 4
devices without a break."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import chex
import numpy as np
from absl.testing import absltest

from cli_helpers import REPO, run_module
from loka_jax.train import Checkpointer, create_train_state, make_optimizer, read_metrics
from loka_jax.train.experiment import RunSpec, build_run
from sharded_fixtures import OPTIM, doc_commands, host, with_args

TIMEOUT_S = 300
MULTI_HOST = 2      # the block of docs/PARALLEL.md with the two-process commands


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def launch(commands, workdir, steps):
  """Runs the documented commands together (one process each), in `workdir`, to `steps`."""
  address = f"localhost:{free_port()}"
  procs = []
  for env, module, args in commands:
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if "xla_force_host_platform_device_count" not in f]
    full = {**os.environ, **env, "JAX_COORDINATOR_ADDRESS": address,
            "XLA_FLAGS": " ".join(flags + env["XLA_FLAGS"].split())}
    args = with_args(args, workdir=workdir, config__run__steps=steps,
                     config__train__log_every=1)
    procs.append(subprocess.Popen([sys.executable, "-m", module, *args], cwd=REPO, env=full,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
  try:
    for p in procs:
      _, err = p.communicate(timeout=TIMEOUT_S)
      if p.returncode:
        raise AssertionError(f"process exited {p.returncode}:\n{err[-3000:]}")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()


def final_params(workdir):
  model, source, _ = build_run(RunSpec(model="dlrm", preset="tiny", precision="bf16"))
  template = create_train_state(model, make_optimizer(OPTIM), source.train_batch(0, 8), 0)
  with Checkpointer(os.path.join(workdir, "checkpoints")) as checkpointer:
    return host(checkpointer.restore(template)[0])


class MultiProcessTest(absltest.TestCase):

  def test_documented_two_process_run_trains_and_resumes_like_one_process(self):
    commands = doc_commands()[MULTI_HOST]
    self.assertEqual([env["JAX_PROCESS_ID"] for env, _, _ in commands], ["0", "1"])
    self.assertEqual({env["JAX_NUM_PROCESSES"] for env, _, _ in commands}, {"2"})
    with tempfile.TemporaryDirectory() as two, tempfile.TemporaryDirectory() as one:
      launch(commands, two, 3)
      launch(commands, two, 4)          # started again: resumes from step 3
      _, module, args = commands[0]
      done = run_module(module, *with_args(args, workdir=one, config__run__steps=4,
                                           config__train__log_every=1))
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      lines, ref = read_metrics(f"{two}/metrics.jsonl"), read_metrics(f"{one}/metrics.jsonl")
      self.assertEqual([line["step"] for line in lines], [1, 2, 3, 4])
      np.testing.assert_allclose([line["loss"] for line in lines],
                                 [line["loss"] for line in ref], rtol=1e-5)
      with open(f"{two}/final.json") as f, open(f"{one}/final.json") as g:
        final, ref_final = json.load(f), json.load(g)
      self.assertEqual((final["steps"], final["mesh"]), (4, "data:2,model:2"))
      for key in ("ne", "auc", "logloss"):
        np.testing.assert_allclose(final[key], ref_final[key], rtol=1e-5)
      state, ref_state = final_params(two), final_params(one)
      self.assertEqual(int(state.step), 4)
      chex.assert_trees_all_close(state, ref_state, rtol=1e-5, atol=1e-6)


if __name__ == "__main__":
  absltest.main()
