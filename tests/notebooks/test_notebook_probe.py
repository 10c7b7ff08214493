"""notebooks/01_probe.ipynb runs top to bottom at tiny size and shows what it promises."""
import os

import chex
import nbclient
import nbformat
from absl.testing import absltest

from cli_helpers import REPO

NOTEBOOK = os.path.join(REPO, "notebooks", "01_probe.ipynb")


def _outputs(cell, kind):
  return [o for o in cell.get("outputs", []) if o.get("output_type") == kind]


class ProbeNotebookTest(chex.TestCase):

  def test_runs_at_tiny_size(self):
    nb = nbformat.read(NOTEBOOK, as_version=4)
    env = dict(os.environ, LOKA_NOTEBOOK_TINY="1", JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute(env=env)
    code = [c for c in nb.cells if c.cell_type == "code"]
    text = "".join(o.get("text", "") for c in code for o in _outputs(c, "stream"))
    self.assertIn("layer_0/fmb/mlp/dense_0", text)          # the per-site table
    self.assertIn("overhead of the statistics pass", text)
    self.assertIn("xla_fp8_rowwise", text)
    self.assertRegex(text, r"(safe|UNSAFE)")                 # the safety table
    self.assertRegex(text, r"safe on \d of 2 sites")
    images = [o for c in code for o in _outputs(c, "display_data") if "image/png" in o["data"]]
    self.assertGreaterEqual(len(images), 3)                  # heatmap + two site plots


if __name__ == "__main__":
  absltest.main()
