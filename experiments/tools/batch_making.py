r"""How fast training batches are made on the host, by the prefetch thread alone and by worker
processes (`TrainConfig.batch_workers`).

  python3 -m experiments.measure batch_making --model=dlrm --preset=large \
      --workers=0,2,4 [--batches=60]

For each entry of --workers a `Prefetcher` makes --batches batches of the preset's synthetic
stream (left on the host, so only making them is timed), after a first batch that waits for
the workers to start; prints the milliseconds per batch. A step shorter than that leaves the
device waiting in `experiments.train`. The numbers are the host's: a busy machine makes them
slower, and workers only pay where cores are free.
"""
from absl import app, flags

from experiments import common_flags as common  # the common flags, defined once
from experiments.tools.batch_rates import ms_per_batch

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
BATCHES = flags.DEFINE_integer("batches", 60, "Batches timed per setting.")
WORKERS = flags.DEFINE_list("workers", ["0", "2"], "Worker processes to time (0: the thread).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  try:
    workers = [int(w) for w in WORKERS.value]
  except ValueError:
    raise app.UsageError(f"--workers={','.join(WORKERS.value)}: give whole numbers") from None
  if any(w < 0 for w in workers) or BATCHES.value < 1:
    raise app.UsageError("--workers must be >= 0 and --batches >= 1")
  from loka_jax.train import experiment, prefetch
  spec = experiment.RunSpec(model=common.MODEL.value, preset=common.PRESET.value,
                            data=common.DATA.value)
  _, source, _ = experiment.build_run(spec)
  batch_size = BATCH_SIZE.value or experiment.preset_batch_size(spec.model, spec.preset)
  rates = ms_per_batch(prefetch.BatchMaker(source, batch_size), workers, BATCHES.value)
  for n, ms in rates.items():
    print(f"[batch_making] {spec.model}/{spec.preset} batch {batch_size}: "
          f"{'the thread' if n == 0 else f'{n} worker processes'}: {ms:.1f} ms a batch")


if __name__ == "__main__":
  app.run(main)
