r"""The headline benchmark's tables, target verdicts and plots from result rows already measured.

  python3 -m experiments.report rows --rows=OLDEST.jsonl,...,NEWEST.jsonl --out=DIR \
      [--device="NVIDIA H200"] [--served_quality=REPORT.json,...] [--quality_runs=DIR,...]

Merges speed and quality rows from the files in order (a later row of the same target,
variant or arm, seed, device, recipe and Mods set replaces an earlier one:
`experiments.bench.collect`) and
writes what `experiments.bench` writes at the end of a call: DIR/report.md (tables and the
targets met or missed), DIR/targets.json and PNG plots under DIR/plots/. No GPU needed: this
is how the benchmark summary is made from the rows committed under docs/results/.
Plots put one bar per target and variant, so rows of two device kinds need --device.
--served_quality takes `experiments.measure serving_quality` reports: an inference verdict
measured on a served model outside the quality budget is missed
(`experiments.bench.served_check`).
"""
import os

from absl import app, flags

ROWS = flags.DEFINE_list("rows", None, "Result JSONL files (bench.jsonl, quality.jsonl), "
                         "oldest first.", required=True)
OUT = flags.DEFINE_string("out", None, "Output directory.", required=True)
DEVICE = flags.DEFINE_string("device", None, "Only rows measured on this device kind.")
QUALITY_RUNS = flags.DEFINE_list(
    "quality_runs", [], "Quality suites' run folders (a bench workdir's `quality/`): each "
    "comparison's training curves are drawn from the runs found there "
    "(plots/curves_<subject>.png) and tabled in the report (each run's first and last "
    "window's loss and the step it got down to a loss shared by the comparison's runs, a "
    "quarter of their mean descent left).")
SERVED = flags.DEFINE_list(
    "served_quality", [], "Reports of `experiments.measure serving_quality` (JSON), oldest "
    "first: the held-out quality of the models LoKA rows served before the bench's "
    "served-quality gate; a row whose served model is outside the budget has its inference "
    "verdicts missed.")


def main(argv):
  del argv
  from loka_jax import jsonio
  from experiments.bench import collect, plots, served_check, tables, targets

  rows = collect.read_rows(ROWS.value, DEVICE.value)
  kinds = collect.devices(rows)
  if not rows:
    raise app.UsageError(f"no rows{'' if DEVICE.value is None else f' on {DEVICE.value!r}'} "
                         f"in {', '.join(ROWS.value)}")
  if len(kinds) > 1:
    raise app.UsageError(f"rows of {len(kinds)} device kinds ({', '.join(kinds)}): pick one "
                         "with --device (a ratio means something only on one card)")
  os.makedirs(OUT.value, exist_ok=True)
  try:
    reports = served_check.load_reports(SERVED.value)
  except served_check.ServedQualityError as e:
    raise app.UsageError(str(e)) from e
  verdicts = targets.check_all(rows, reports)
  jsonio.write_json_atomic(os.path.join(OUT.value, "targets.json"), verdicts)
  report = tables.report(rows, verdicts, QUALITY_RUNS.value)
  with open(os.path.join(OUT.value, "report.md"), "w") as f:
    f.write(report + "\n")
  written = plots.write_plots(rows, os.path.join(OUT.value, "plots"),
                              quality_runs=QUALITY_RUNS.value)
  print(report)
  counts = {"met": sum(v["met"] is True for v in verdicts),
            "missed": sum(v["met"] is False for v in verdicts),
            "unresolved": sum(bool(v.get("judged")) and v.get("verdict") == "unresolved"
                              for v in verdicts),
            "not applicable": sum(bool(v.get("judged")) and v.get("verdict") == "not applicable"
                                  for v in verdicts),
            "reported without a bar": sum(v["met"] is None and v["value"] is not None
                                          and not v.get("judged") for v in verdicts),
            "not measured yet": sum(v["value"] is None for v in verdicts)}
  print(f"[report rows] {len(rows)} rows from {len(ROWS.value)} files; targets: "
        + ", ".join(f"{n} {w}" for w, n in counts.items())
        + f"; plots: {', '.join(written) or 'none'}")

