"""What a fresh probe would time on a card, replayed from a probe report's errors against that
card's timing table (`loka_jax.probe.timing_needs.report_needs`): the kernel passes it would
measure at each site shape, and how many it would reuse from the table or leave untimed (no
site admits them on accuracy; dominated on the card). It tells, with no GPU, whether a table
covers a model's probe before a GPU call is spent on it. No GPU.

  python3 -m experiments.timing_cache needs PROBE_REPORT.json[.gz] [--table=TABLE.json]

The table is the committed one of the report's card unless --table names another; either way
only its entries of the report's jax minor version count, as on the card.
"""
import os

from absl import app, flags

from loka_jax.probe import report as report_lib
from loka_jax.probe import timing_needs
from loka_jax.probe import timing_table as tables_lib

TABLE = flags.DEFINE_string("table", None, "A timing table to replay against (default: the "
                            "committed table of the report's card).")


def _table(report, path):
  """(where, table or None) for the report's card."""
  if path is None:
    if report.get("platform") == "cpu" or report.get("device_kind") in (None, "cpu"):
      raise app.UsageError("a CPU's report: its card is unknown; give --table=TABLE.json")
    path = tables_lib.table_path(report["device_kind"])
    if not os.path.exists(path):
      return f"no committed table for {report['device_kind']}", None
  return path, timing_needs.of_jax_minor(tables_lib.load_table(path), report["jax"])


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("give one probe report (.json or .json.gz)")
  try:
    report = report_lib.load_report(argv[1])
    where, table = _table(report, TABLE.value)
    needs = timing_needs.report_needs(report, table)
  except (report_lib.ProbeReportError, tables_lib.TimingTableError) as e:
    raise app.UsageError(str(e)) from e
  except KeyError as e:   # a candidate kernel no longer registered
    raise app.UsageError(f"{argv[1]}: {e.args[0]}") from e
  print(f"{argv[1]} ({report.get('device_kind')}, jax {report.get('jax')}) against {where}:")
  for site, pairs in needs["measure"].items():
    print(f"  {site}: " + ", ".join(f"{k}/{p}" for k, p in pairs))
  print("{measured} kernel passes to measure, {reused} reused from the table, {not_safe} not "
        "timed (no site of their shape admits them on accuracy), {dominated} not timed "
        "(dominated on this card), {baseline_unneeded} bf16 baseline passes not timed (no "
        "kernel of their pass is)".format(**needs["counts"]))


if __name__ == "__main__":
  app.run(main)
