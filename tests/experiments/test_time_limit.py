"""The entry points' wall-clock limit, as the hook the library asks."""
from unittest import mock

from absl.testing import absltest

from experiments import time_limit


class StopAfterTest(absltest.TestCase):

  def test_no_limit_gives_no_hook(self):
    self.assertIsNone(time_limit.stop_after(None))
    self.assertIsNone(time_limit.stop_after(0))
    self.assertIsNone(time_limit.stop_after(-5.0))

  def test_work_that_would_end_past_the_limit_is_stopped(self):
    with mock.patch.object(time_limit.time, "time", return_value=1000.0):
      stop = time_limit.stop_after(100.0)
      self.assertFalse(stop(0.0))
      self.assertFalse(stop(100.0))
      self.assertTrue(stop(100.5))
    with mock.patch.object(time_limit.time, "time", return_value=1101.0):
      self.assertTrue(stop(0.0))

  def test_the_limit_counts_from_the_given_start(self):
    with mock.patch.object(time_limit.time, "time", return_value=1000.0):
      self.assertTrue(time_limit.stop_after(100.0, start=850.0)(0.0))


if __name__ == "__main__":
  absltest.main()
