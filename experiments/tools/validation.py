r"""Read a plan's validation: where it stands, every check's measurements, its training runs.

  python3 -m experiments.report validation --plan=PLANS/wukong_large/plan_validating.json \
      [--out=DIR]

Works on a validated plan and on one a paused validation saved (`plan_validating.json`):
the training checks record each run as it ends, so their tables show how the runs went
seed by seed before the check's verdict exists. Prints the status, the FP8 sites per pass,
each record as the validation's log shows it, one table per training check and recipe (a
plan run's held-out change is against bf16+Mods at the same seed) and the runs' loss
curves. With --out, writes `validation_<check>.png` there: one panel per seed or data
window, each arm's training loss, which shows when a run left a plateau.
"""
import os

from absl import flags

from experiments.run_config import read_plan_arg

PLAN = flags.DEFINE_string("plan", None, "The plan file (plan.json, plan_validating.json).",
                           required=True)
OUT = flags.DEFINE_string("out", None, "Folder for the loss-curve plots (none without it).")

_PANELS = {"quality_shadow": ("data window {}".format, "steps after the switch"),
           "quality_from_init": ("seed {}".format, "step")}


def main(argv):
  del argv
  from experiments.bench import plots
  from loka_jax.dispatch import run_records, validate
  from loka_jax.plan.file import kernel_counts
  from loka_jax.train.report import validation_line
  plan = read_plan_arg(PLAN.value)
  where = plan["provenance"].get("device")
  print(f"{PLAN.value}: {plan.get('model', '?')} {plan.get('preset', '?')}"
        + (f", on {where}" if where else ""))
  print(run_records.status(plan))
  counts = kernel_counts(plan)
  print("sites per kernel: " + "; ".join(
      f"{p} " + ", ".join(f"{k} {n}" for k, n in sorted(counts[p].items())) for p in counts))
  print("\nRecords:")
  for record in plan["validation"]:
    line = validation_line(record, measurements=True)
    if line is not None:
      print(line)
  runs = run_records.training_runs(plan)
  for check, records in runs.items():
    for table in run_records.runs_tables(check, records):
      print("\n" + table)
    curves = run_records.curves(records)
    if not curves:
      continue
    print(f"\nTraining loss, mean of each {validate.CURVE_EVERY} steps:\n")
    print(run_records.curves_table(curves))
    if OUT.value:
      os.makedirs(OUT.value, exist_ok=True)
      panel_title, xlabel = _PANELS[check]
      path = plots.shadow_curves_plot(
          curves, validate.CURVE_EVERY, 0, os.path.join(OUT.value, f"validation_{check}.png"),
          f"{plan.get('model', '')} {plan.get('preset', '')}: {check} runs",
          panel_title=panel_title, xlabel=xlabel)
      print(f"\n[report validation] curves: {path}")
  if not runs:
    print("\nNo training runs recorded.")

