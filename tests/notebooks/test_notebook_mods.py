"""notebooks/02_mods_ablation.ipynb runs top to bottom (2 of the 8 combinations) and shows the
table, the plot and the reading it promises."""
import json
import os
import tempfile

import chex
import nbclient
import nbformat
from absl.testing import absltest

from cli_helpers import REPO, cpu_env
from notebook_helpers import ensure_python3_kernel, outputs

NOTEBOOK = os.path.join(REPO, "notebooks", "02_mods_ablation.ipynb")


class ModsNotebookTest(chex.TestCase):

  def test_runs_the_tiny_ablation(self):
    ensure_python3_kernel()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    workdir = tempfile.mkdtemp(prefix="loka_mods_notebook_")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": REPO}})
    client.execute(env=cpu_env(LOKA_NOTEBOOK_TINY="1", LOKA_ABLATION_DIR=workdir))
    self.assertEqual(outputs(nb, "error"), [])
    text = "".join(o.get("text", "") for o in outputs(nb, "stream"))
    self.assertIn(f"8 arms in {workdir}", text)   # 2 combinations x 2 precisions x 2 seeds
    displays = [o["data"] for o in outputs(nb, "display_data")]
    tables = [d["text/markdown"] for d in displays if "text/markdown" in d]
    self.assertLen(tables, 1)
    self.assertIn("| baseline |", tables[0])
    self.assertIn("| NB+BN+HS |", tables[0])
    self.assertIn("Timing: skipped (not on a GPU)", tables[0])
    self.assertLen([d for d in displays if "image/png" in d], 1)
    self.assertIn("FP8 vs bf16 with the same Mods (2 combination(s))", text)   # the reading
    self.assertIn("Latency: skipped (not on a GPU).", text)
    with open(os.path.join(workdir, "ablation.json")) as f:
      result = json.load(f)
    self.assertTrue(result["complete"])
    self.assertEqual(result["settings"]["steps"], 20)
    self.assertEqual(result["settings"]["seeds"], [0, 1])
    self.assertEqual(result["rows"][1]["fp8_mods_vs_baseline"]["seeds"], [0, 1])   # paired


if __name__ == "__main__":
  absltest.main()
