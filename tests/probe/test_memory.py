"""The probe's standing-memory check (`probe/memory.py`): a probe whose training state and
statistics cannot fit what JAX may take of the card stops before anything trains, one that
fills most of it is warned, and the CPU (whose backend gives no limit) is not checked."""
import os
import tempfile
from unittest import mock

import jax
from absl.testing import absltest

from loka_jax.probe import memory, runner
from loka_jax.probe.collector import ProbeConfig
from loka_jax.probe.options import ProbeSetupError
from loka_jax.train import TrainConfig, experiment

H100 = ("NVIDIA H100 80GB HBM3", 63_000_000_000)
GB = 1_000_000_000


class StandingMemoryNoteTest(absltest.TestCase):

  def test_wukong_larges_sizes_on_an_h100_are_warned(self):
    # Wukong large at batch 4096 (`--config.describe=true`): 36.6 + 18.7 = 55.3 GB, 87.8%.
    note = memory.standing_memory_note(36_600_000_000, 18_700_000_000, H100)
    self.assertEqual(note.split(";")[0],
                     "memory: training state 36.6 GB + statistics 18.7 GB = 55.3 GB of the "
                     "63.0 GB JAX may take of NVIDIA H100 80GB HBM3 (88%)")
    self.assertIn("XLA_PYTHON_CLIENT_MEM_FRACTION", note)

  def test_what_fits_comfortably_or_where_no_limit_is_known_says_nothing(self):
    self.assertIsNone(memory.standing_memory_note(30 * GB, 20 * GB, H100))   # 79%
    self.assertIsNone(memory.standing_memory_note(300 * GB, 200 * GB, None))

  def test_what_cannot_fit_stops_naming_the_sizes_and_the_remedy(self):
    with self.assertRaisesRegex(ProbeSetupError, r"cannot fit: training state 50\.0 GB \+ "
                                r"statistics 20\.0 GB = 70\.0 GB of the 63\.0 GB .* \(111%\); "
                                r"raise XLA_PYTHON_CLIENT_MEM_FRACTION"):
      memory.standing_memory_note(50 * GB, 20 * GB, H100)

  def test_the_cpu_gives_no_limit(self):
    self.assertEqual(jax.default_backend(), "cpu")   # the suite's CPU runs (conftest)
    self.assertIsNone(memory.device_limit())


class ProbeStopsBeforeTrainingTest(absltest.TestCase):

  def test_a_probe_that_cannot_fit_trains_nothing(self):
    workdir = tempfile.mkdtemp(prefix="loka_memory_probe_")
    spec = experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=256)
    config = TrainConfig(steps=4, batch_size=64, progress=False, log_every=0)
    options = runner.ProbeOptions(samples=2, kernels=("xla_bf16",), bootstrap=20, plots=False)
    # A card whose allocator may take 1 MB: tiny Wukong's state alone is larger.
    with mock.patch.object(memory, "device_limit", return_value=("a 1 MB card", 1_000_000)):
      with self.assertRaisesRegex(ProbeSetupError, "the probe cannot fit: .* of the 0.0 GB "
                                  "JAX may take of a 1 MB card"):
        runner.run_probe(spec, workdir, config, ProbeConfig(cadence=2), options)
    self.assertFalse(os.path.exists(os.path.join(workdir, "checkpoints")))


if __name__ == "__main__":
  absltest.main()
