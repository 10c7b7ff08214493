"""The main pipeline reuses a GPU probe report only under the criteria its timings were chosen
for: a GPU probe times only what can change the plan (`probe/timing_needs.py`), so a
selection under other criteria probes again (resuming from the probe's caches)."""
import os
import tempfile
from unittest import mock

from absl.testing import absltest

import report_builders as hm
from loka_jax.dispatch import pipeline
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.report import save_report
from loka_jax.train import TrainConfig, experiment


class ProbeAgain(Exception):
  pass


class Selecting(Exception):
  pass


class TimedForTest(absltest.TestCase):

  def run_pipeline(self, timed_for, criteria):
    spec = experiment.RunSpec(model="toy", preset="tiny")
    report = hm.report({"dense": hm.site(hm.same_passes({"xla_fp8_rowwise": hm.entry()}))})
    report["timing_source"] = {"kind": "measured", "device_kind": hm.H100,
                               "timed_for": timed_for}
    with tempfile.TemporaryDirectory() as workdir:
      save_report(report, os.path.join(workdir, pipeline.REPORT_JSON))
      with mock.patch("loka_jax.probe.runner.run_probe", side_effect=ProbeAgain), \
          mock.patch.object(pipeline, "select", side_effect=Selecting):
        pipeline.probe_and_plan(spec, workdir, train_config=TrainConfig(steps=1),
                                criteria=criteria, validation=None)

  def test_the_same_criteria_reuse_the_report(self):
    with self.assertRaises(Selecting):  # straight to selection, the probe not called
      self.run_pipeline(Criteria().to_dict(), Criteria())

  def test_other_criteria_probe_again(self):
    with self.assertRaises(ProbeAgain):
      self.run_pipeline(Criteria().to_dict(), Criteria(min_speedup=None))
    with self.assertRaises(ProbeAgain):
      self.run_pipeline(Criteria().to_dict(), Criteria(min_sqnr_wgrad_db=0.0))


if __name__ == "__main__":
  absltest.main()
