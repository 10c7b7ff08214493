"""`experiments.measure batch_making`'s timing (experiments/tools/batch_rates.py): the
milliseconds a batch takes to make, measured through the prefetcher as the loop makes them."""
import time

import numpy as np
from absl.testing import absltest

from experiments.tools import batch_rates


def slow_make(i):
  time.sleep(0.02)
  return {"x": np.full(3, i, np.float32)}


class BatchMakingTest(absltest.TestCase):

  def test_a_batch_that_takes_20_ms_reads_at_least_20_ms(self):
    rates = batch_rates.ms_per_batch(slow_make, [0], batches=10)
    self.assertEqual(list(rates), [0])
    # The clock starts when batch 0 is handed over, and the maker began batch 1 the moment
    # batch 0 was done, so a loaded machine's hand-over delay shortens the reading by a few
    # milliseconds over the ten batches; a reading of queued batches would be near zero.
    self.assertGreaterEqual(rates[0], 18.0)
    self.assertLess(rates[0], 1000.0)


if __name__ == "__main__":
  absltest.main()
