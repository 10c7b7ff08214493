r"""What the drift valve's refreshes cost in a training run: a row for RESULTS.

  python3 -m experiments.train --workdir=DIR --config.run.precision=loka \
      --config.run.plan=PLAN --config.drift.every=25 ... > DIR.final.json
  python3 -m experiments.report drift_run --run=DIR --final=DIR.final.json \
      --out=drift_runs.jsonl

The row (kind drift_run) holds the run's cadence and overhead budget, the steps of its
refreshes and the seconds of each (the first compiles the statistics pass), the training step
(the loop's time between steps, refreshes left out), and the refreshes' share of training
time with and without the first. The card and jax are this process's, so run it on the host
that trained. `experiments/gpu_drift_call.sh` runs both.
"""
import datetime

from absl import app, flags
import jax

from experiments.tools import drift_rows
from experiments.tools.results_user_speed import percent
from loka_jax import jsonio

RUN = flags.DEFINE_string("run", None, "The experiments.train run directory.")
FINAL = flags.DEFINE_string("final", None, "The final metrics experiments.train printed "
                            "(its stdout).")
COMMAND = flags.DEFINE_string("command", "", "The command that trained it (recorded).")
COMMIT = flags.DEFINE_string("commit", "unknown", "The commit measured (recorded).")
OUT = flags.DEFINE_string("out", None, "Append the row here (JSONL).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not RUN.value or not FINAL.value:
    raise app.UsageError("--run and --final are required (the run directory and the JSON "
                         "experiments.train printed)")
  try:
    row = drift_rows.row(RUN.value, FINAL.value, jax.devices()[0].device_kind,
                         jax.__version__, datetime.date.today().isoformat(), COMMIT.value,
                         COMMAND.value)
  except drift_rows.DriftRowError as e:
    raise app.UsageError(str(e)) from None
  later = "-" if row["later_refresh_s"] is None else f"{row['later_refresh_s']:.2f} s"
  print(f"{row['model']}/{row['preset']} every {row['cadence']}, budget "
        f"{percent(row['max_overhead'])}: {len(row['refresh_s'])} refreshes at steps "
        f"{row['refresh_steps']} (first {row['refresh_s'][0] if row['refresh_s'] else 0:.1f} s, "
        f"later median {later}), step {row['step_ms']:.2f} ms; share {percent(row['share'])}, "
        f"without the first {percent(row['share_after_first'])}")
  if OUT.value:
    jsonio.append_rows(OUT.value, [row])
    print(f"[drift_run] appended a row to {OUT.value}")


if __name__ == "__main__":
  app.run(main)
