"""One process of the two-process test (test_multiprocess.py): joins jax.distributed over
localhost on the CPU with 2 devices of its own, trains the tiny odd-vocabulary DLRM on a
data:2,model:2 mesh spanning both processes for STEPS[0] steps (checkpointing), then resumes
from that checkpoint to STEPS[1] steps.

  python3 tests/parallel/multiprocess_worker.py WORKDIR COORDINATOR NUM_PROCESSES PROCESS_ID

Run with XLA_FLAGS=--xla_force_host_platform_device_count=2 and JAX_PLATFORMS=cpu. With
NUM_PROCESSES=1 it runs the same training in one process (4 devices) as the reference."""
import json
import os
import sys

STEPS = (2, 3)


def main(workdir, coordinator, num_processes, process_id):
  import jax
  if num_processes > 1:
    from loka_jax import parallel
    parallel.initialize_distributed(coordinator, num_processes, process_id)
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from sharded_fixtures import BATCH, mesh, odd_dlrm  # pylint: disable=g-import-not-at-top
  from loka_jax import parallel  # pylint: disable=g-import-not-at-top,reimported
  from loka_jax.parallel import run as parallel_run  # pylint: disable=g-import-not-at-top
  from loka_jax.train import TrainConfig  # pylint: disable=g-import-not-at-top
  model, source = odd_dlrm()
  the_mesh = parallel.build_mesh("data:2,model:2")
  assert the_mesh.devices.size == 4 and jax.process_count() == num_processes, jax.devices()
  finals = []
  for steps in STEPS:
    config = TrainConfig(steps=steps, batch_size=BATCH, seed=1, log_every=1, progress=False)
    finals.append(parallel_run.train_sharded(
        model, source, workdir, config, the_mesh,
        parallel.ParallelConfig(collectives="fp32")))
  print(json.dumps({"process": jax.process_index(), "finals": finals}), flush=True)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
