"""The timing of `experiments.measure batch_making` (experiments/tools/batch_making.py). No
flags, so tests and other tools import it freely."""
import time
from typing import Dict, Sequence


def ms_per_batch(make, workers: Sequence[int], batches: int) -> Dict[int, float]:
  """{workers: milliseconds per batch} of `make` (a picklable batch maker) made ahead by a
  Prefetcher with that many worker processes, batches left on the host."""
  from loka_jax.train import prefetch
  out = {}
  for n in workers:
    with prefetch.Prefetcher(make, 0, batches + 1, depth=2, put=lambda b: b,
                             workers=n) as feed:
      feed.get(0)   # the workers have started
      began = time.perf_counter()
      for i in range(1, batches + 1):
        feed.get(i)
      out[n] = 1e3 * (time.perf_counter() - began) / batches
  return out
