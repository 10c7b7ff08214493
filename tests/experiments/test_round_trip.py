"""`experiments.measure round_trip` (experiments/tools/round_trip.py) on the CPU, which keeps
every round trip through e4m3 in a compiled program: each result matches the float64 product
of the cast's values and misses the unquantized one, and the underflow read in one program is
the cast's share of zero codes."""
from absl.testing import absltest

from experiments.tools import round_trip


class RoundTripTest(absltest.TestCase):

  def test_every_result_is_the_quantized_product_on_the_cpu(self):
    errors, (read, cast) = round_trip.compare(64, 128, 96, seed=3, cores=("triton",))
    self.assertEqual(sorted(errors), sorted([
        "fused_dense triton", "reference, one program", "reference, op by op",
        "bare cast, one program"]))
    for name, (quantized, unquantized) in errors.items():
      self.assertLess(quantized, 1e-5, name)
      self.assertGreater(unquantized, 1e-3, name)   # e4m3 keeps 3 mantissa bits
    self.assertEqual(cast, 8 / 128)                 # the 8 columns scaled by 1e-6
    self.assertAlmostEqual(read, cast, places=6)


if __name__ == "__main__":
  absltest.main()
