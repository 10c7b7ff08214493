"""docs/FORMATS.md's table of versions names every schema loka_jax and its tools write, at the
version they write, and every version the readers accept."""
import os
import re

from absl.testing import absltest

from cli_helpers import REPO

# `NAME = "loka.kind/N"` at the top level of a module.
WRITTEN = re.compile(r'^[A-Z_]*(?:SCHEMA|FORMAT)\s*=\s*"(loka\.[a-z_]+)/(\d+)"', re.M)


def written_schemas():
  """{kind: version} of every schema constant under loka_jax/ and experiments/."""
  found = {}
  for top in ("loka_jax", "experiments"):
    for folder, _, files in os.walk(os.path.join(REPO, top)):
      for name in files:
        if name.endswith(".py"):
          with open(os.path.join(folder, name)) as f:
            for kind, version in WRITTEN.findall(f.read()):
              found[kind] = version
  return found


def documented_versions():
  """{kind: (written, read)} from the table under '## Versions'."""
  with open(os.path.join(REPO, "docs", "FORMATS.md")) as f:
    text = f.read()
  table = text[text.index("## Versions"):text.index("Changes:")]
  rows = re.findall(r"^\| `(loka\.[a-z_]+)` \| (\d+) \| ([\d, ]+) \|", table, re.M)
  return {kind: (written, tuple(v.strip() for v in read.split(","))) for kind, written, read
          in rows}


class FormatsDocTest(absltest.TestCase):

  def test_every_written_schema_is_in_the_table_at_its_version(self):
    written, documented = written_schemas(), documented_versions()
    self.assertGreaterEqual(len(written), 8)
    self.assertEqual({k: v for k, v in written.items()},
                     {k: documented[k][0] for k in written if k in documented})
    self.assertEqual(set(written) - {"loka.your_model"}, set(documented) - {"loka.your_model"})

  def test_the_probe_reader_accepts_the_versions_the_table_says(self):
    from loka_jax.probe import report
    self.assertEqual(tuple(s.rsplit("/", 1)[1] for s in report.READABLE_SCHEMAS),
                     documented_versions()["loka.probe"][1])


if __name__ == "__main__":
  absltest.main()
