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
    rates = batch_rates.ms_per_batch(slow_make, [0], batches=5)
    self.assertEqual(list(rates), [0])
    self.assertGreaterEqual(rates[0], 20.0)
    self.assertLess(rates[0], 1000.0)


if __name__ == "__main__":
  absltest.main()
