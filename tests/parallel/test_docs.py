"""docs/PARALLEL.md's CPU commands run as written (fewer steps, fewer held-out examples, no
checkpoint: sharded checkpoints are tests/parallel/test_parallel.py's and test_multiprocess.py's),
and its numbers are the library's."""
import json
import re
import tempfile

import jax
from absl.testing import absltest

from cli_helpers import run_module
from loka_jax.parallel import ParallelConfig, traffic
from loka_jax.train.experiment import RunSpec, build_run
from sharded_fixtures import DOC, doc_commands, with_args


class DocCommandsTest(absltest.TestCase):

  def test_first_example_trains_on_the_documented_mesh(self):
    env, module, args = doc_commands()[0][0]
    # The command's forced host devices are this test session's (tests/conftest.py).
    self.assertEqual(env["XLA_FLAGS"],
                     f"--xla_force_host_platform_device_count={jax.device_count()}")
    with tempfile.TemporaryDirectory() as workdir:
      done = run_module(module, *with_args(
          args, workdir=workdir, config__run__steps=2, config__run__num_eval=512,
          config__train__checkpoint_every=0, config__train__keep_checkpoints=0))
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      with open(f"{workdir}/final.json") as f:
        final = json.load(f)
    self.assertEqual((final["steps"], final["mesh"], final["collectives"]),
                     (2, "data:2,model:2", "fp8"))

  def test_bytes_command_prints_a_table_per_mesh(self):
    [(_, module, args)] = next(b for b in doc_commands()
                               if b and b[0][1] == "experiments.parallel_bytes")
    done = run_module(module, *args)
    self.assertEqual(done.returncode, 0, done.stderr[-3000:])
    self.assertIn("dlrm/tiny on data:1,model:2", done.stdout)
    self.assertIn("dlrm/tiny on data:2,model:1", done.stdout)
    self.assertIn("exchange/fwd", done.stdout)

  def test_wukong_small_bytes_are_the_models(self):
    with open(DOC) as f:
      text = re.sub(r"\s+", " ", f.read())
    found = re.search(r"Wukong `small` at global batch (\d+) sends (\d+) MB per device and step "
                      r"in bf16 and (\d+) MB with FP8 collectives on data:1,model:2 \((\d+) MB "
                      r"and (\d+) MB on data:2,model:1", text)
    self.assertIsNotNone(found)
    batch, *said = (int(x) for x in found.groups())
    model, source, _ = build_run(RunSpec(model="wukong", preset="small"))
    example = source.train_batch(0, 1)
    wire = [round(traffic.totals(traffic.model_collectives(
        model, example, batch, data, m, ParallelConfig(collectives=mode)))["wire"] / 1e6)
            for data, m in ((1, 2), (2, 1)) for mode in ("bf16", "fp8")]
    self.assertEqual(wire, said)


if __name__ == "__main__":
  absltest.main()
