r"""How long the main job takes a new user to reach a plan, cold and warm: a row for RESULTS.

  RUNS=cold LIMIT=570 bash experiments/gpu_main_job_call.sh     (a GPU call: $OUT/cold.log)
  RUNS=warm bash experiments/gpu_main_job_call.sh               (same host: $OUT/warm.log)
  python3 -m experiments.report time_to_plan --cold=cold.log --warm=warm.log \
      --device="NVIDIA H100 80GB HBM3" --jax=0.11.2 --date=2026-12-05 --commit=COMMIT \
      --command="RUNS=cold ... bash experiments/gpu_main_job_call.sh" --out=rows.jsonl

The row (kind time_to_plan, which experiments/tools/results_user_speed.py tabulates) holds the
cold run's seconds (its last stamp, or --cold_s: the wall time the call printed) and the warm
rerun's, whether the cold run reached its report, the seconds of each stage (start, probe
training, evaluation, kernel timing, report + selection + validation, arms; a cut run's last
stage as "<stage>_incomplete"), the timing's counts of kernel passes, the candidate kernels
and the plan's FP8 sites. The logs are read here, not on the host that ran them, so the card,
jax version and date are flags.
"""
import json

from absl import app, flags

from experiments.tools import main_job_rows
from loka_jax import jsonio

COLD = flags.DEFINE_string("cold", None, "The cold run's stamped log ($OUT/cold.log).")
WARM = flags.DEFINE_string("warm", None, "The warm rerun's stamped log ($OUT/warm.log).")
PLAN = flags.DEFINE_string("plan", None, "The run's plan.json, for its FP8 sites (default: "
                           "the plan table of the cold log's report).")
DEVICE = flags.DEFINE_string("device", None, "The card that ran the logs, e.g. \"NVIDIA H100 "
                             "80GB HBM3\" (the call's \"card:\" line).")
JAX = flags.DEFINE_string("jax", None, "The jax version that ran them (the call's \"card:\" "
                          "line).")
DATE = flags.DEFINE_string("date", None, "The date they ran, YYYY-MM-DD.")
COMMIT = flags.DEFINE_string("commit", "unknown", "The commit measured (recorded).")
COMMAND = flags.DEFINE_string("command", "", "The command that ran them (recorded).")
COLD_S = flags.DEFINE_float("cold_s", None, "The cold run's wall time in seconds (the call's "
                            "\"cold: rc=.. wall=..\" line; default: its log's last stamp).")
WARM_S = flags.DEFINE_float("warm_s", None, "The warm rerun's wall time in seconds (default: "
                            "its log's last stamp).")
CANDIDATES = flags.DEFINE_string("candidates", None, "The candidate kernels, where the cold "
                                 "log's report does not list them (a cut run).")
NOTE = flags.DEFINE_string("note", None, "A note for RESULTS (recorded).")
OUT = flags.DEFINE_string("out", None, "Append the row here (JSONL).")


def _s(value) -> str:
  return "-" if value is None else f"{value:.1f} s"


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  missing = [f"--{f.name}" for f in (COLD, DEVICE, JAX, DATE) if not f.value]
  if missing:
    raise app.UsageError(f"{', '.join(missing)} required: the cold run's log, and the card, "
                         "jax version and date of the host that ran it")
  try:
    row = main_job_rows.row(COLD.value, WARM.value, DEVICE.value, JAX.value, DATE.value,
                            COMMIT.value, COMMAND.value, plan_path=PLAN.value,
                            cold_s=COLD_S.value, warm_s=WARM_S.value,
                            candidates=CANDIDATES.value, note=NOTE.value)
  except main_job_rows.MainJobRowError as e:
    raise app.UsageError(str(e)) from None
  stages = ", ".join(f"{k} {_s(v)}" for k, v in row["stages_s"].items())
  fp8 = "-" if row["fp8_sites"] is None else row["fp8_sites"]
  print(f"{row['model']}/{row['preset']}: cold {_s(row['cold_s'])}"
        f"{'' if row['complete'] else ' (cut)'}, warm {_s(row['warm_s'])}; {stages}; "
        f"FP8 sites {fp8}")
  print(json.dumps(row))
  if OUT.value:
    jsonio.append_rows(OUT.value, [row])
    print(f"[time_to_plan] appended a row to {OUT.value}")


if __name__ == "__main__":
  app.run(main)
