r"""Measure part of a benchmark target again: move its rows and plan files out of the workdir.

  python -m experiments.forget_rows --workdir=DIR --target=dhen/large --variants=loka \
      [--plan_files=plan_serve.json] [--suite=models|towers|quality] [--mods=...]

The bench skips finished rows and reads plan files it wrote before; this moves the named rows
(variants, or arms with --suite=quality, each with its run folder) of one target, and the plan
files named, to DIR/forgotten/STAMP/ with a manifest (`experiments.bench.forget`), so the next
`experiments.bench` call with the same workdir measures them again. Nothing is deleted.
E.g. a LoKA row served before the served-quality gate, timed again under it:
`--target=dhen/large --variants=loka --plan_files=plan_serve.json`.
"""
from absl import app, flags

from experiments.tools import subcommands
from experiments import common_flags  # --workdir and --mods, defined once

TARGET = flags.DEFINE_string("target", None, "model/preset, or tower/BxWIDTHxDEPTH.",
                             required=True)
SUITE = flags.DEFINE_enum("suite", "models", ("models", "towers", "quality"),
                          "Which results file: bench.jsonl (models, towers) or quality.jsonl.")
NAMES = flags.DEFINE_list("variants", None, "Variants (or quality arms) whose rows to move.",
                          required=True)
PLAN_FILES = flags.DEFINE_list("plan_files", [], "The target's plan files to move too.")
PLANS = flags.DEFINE_string("plans_dir", None, "Plan directory (default: WORKDIR/plans).")


def main(argv):
  del argv
  from experiments.bench import forget, mods_set, suite
  if not common_flags.WORKDIR.value:
    raise app.UsageError("--workdir is required: the bench's workdir")
  try:
    target = suite.parse_target(TARGET.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  try:
    done = forget.forget(common_flags.WORKDIR.value, suite=SUITE.value, model=target.model,
                         preset=target.preset, names=NAMES.value, plans_dir=PLANS.value,
                         mods=mods_set.of_flag(common_flags.MODS.value),
                         plan_files=PLAN_FILES.value)
  except (forget.ForgetError, ValueError) as e:
    raise app.UsageError(str(e)) from e
  print(f"[forget_rows] {done['target']}: moved {done['rows']} row(s) of "
        f"{', '.join(done['names'])}"
        + (f" with {len(done['run_folders'])} run folder(s)" if done["run_folders"] else "")
        + f" and {', '.join(done['plan_files']) or 'no plan files'} "
        f"to {common_flags.WORKDIR.value}/{forget.FORGOTTEN}/{done['stamp']}")


if __name__ == "__main__":
  app.run(main, flags_parser=subcommands.parse_flags)  # --help exits 0, errors in one line
