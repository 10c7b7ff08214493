r"""Start one validation check of a saved plan over: undo its back-offs, keep its records.

  python -m experiments.reopen_check --plan=PLANS/wukong_large/plan_validating.json \
      --step=quality_shadow --reason="judged again with its noise floor" [--later] [--out=PATH]

For a check whose rule changed after it backed sites off under the old one: the sites it
backed off run their earlier kernels again and a `reopened` record says why
(`loka_jax.dispatch.validate.reopen_check`). The next `experiments.bench` or
`experiments.dispatch` call that resumes the plan runs the check from its round 0, taking
every run and site measurement whose plan and recipe it recorded before from the record.
Only the last check the plan has records of can be reopened, before the final verdict;
`--later` reopens the later checks with it (they judged the plan this check left), newest
first.
"""

from absl import app, flags

PLAN = flags.DEFINE_string("plan", None, "The plan file an interrupted validation saved "
                           "(plan_validating.json).", required=True)
STEP = flags.DEFINE_string("step", None, "The check to start over, e.g. quality_shadow.",
                           required=True)
REASON = flags.DEFINE_string("reason", None, "Why it starts over (recorded in the plan).",
                             required=True)
LATER = flags.DEFINE_bool("later", False, "Reopen every later check with records too.")
OUT = flags.DEFINE_string("out", None, "Where to write the plan (default: --plan itself).")


def main(argv):
  del argv
  from loka_jax.dispatch import validate
  from loka_jax.plan.file import read_plan_arg, save_plan
  from loka_jax.train.report import validation_line
  plan = read_plan_arg(PLAN.value)
  try:
    reopened = validate.reopen_check(plan, STEP.value, REASON.value, later=LATER.value)
  except ValueError as e:   # a check that cannot be reopened
    raise app.UsageError(str(e)) from e
  out = OUT.value or PLAN.value
  save_plan(reopened, out)
  for record in reopened["validation"][len(plan["validation"]):]:
    print(validation_line(record))
  print(f"[reopen_check] wrote {out}")


if __name__ == "__main__":
  app.run(main)
