r"""Measure part of a benchmark target again: move its rows and plan files out of the workdir.

  python3 -m experiments.forget_rows --workdir=DIR --config.forget.target=dhen/large \
      --config.forget.variants=loka [--config.forget.plan_files=plan_serve.json] \
      [--config.forget.suite=models|towers|quality] [--config.forget.mods=...]

The bench skips finished rows and reads plan files it wrote before; this moves the named rows
(variants, or arms with suite=quality, each with its run folder) of one target, and the plan
files named, to DIR/forgotten/STAMP/ with a manifest (`experiments.bench.forget`), so the next
`experiments.bench` call with the same workdir measures them again. Nothing is deleted.
E.g. a LoKA row served before the served-quality gate, timed again under it:
`--config.forget.target=dhen/large --config.forget.variants=loka
--config.forget.plan_files=plan_serve.json`. Naming the probe's report and folder too
(`--config.forget.plan_files=plan_selected.json,plan.json,probe_report.json,probe`, and
`validation_state` where validation made the probe run again) makes the next call probe the
target again, e.g. after a change to what the probe times.

Settings come from experiments/configs/forget_rows.py (--config=FILE for another file;
--config.GROUP.FIELD=VALUE overrides one field).
"""
import sys

from absl import app, flags

from experiments import run_config
from experiments.configs.forget_rows import SUITES

CONFIG = run_config.define_config_flag("forget_rows")
flags.adopt_module_key_flags(run_config)  # --help lists --config
WORKDIR = flags.DEFINE_string("workdir", None, "The bench's workdir, whose rows and plan "
                              "files are moved aside.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  from experiments.bench import forget, mods_set, suite
  if not WORKDIR.value:
    raise app.UsageError("--workdir is required: the bench's workdir")
  settings = CONFIG.value.forget
  if settings.suite not in SUITES:
    sys.exit(f"error: --config.forget.suite={settings.suite}: not one of {', '.join(SUITES)}")
  names = run_config.split(settings.variants)
  if not settings.target or not names:
    sys.exit("error: --config.forget.target and --config.forget.variants are required")
  try:
    target = suite.parse_target(settings.target)
  except ValueError:
    sys.exit(f"error: --config.forget.target={settings.target}: expected model/preset or "
             "tower/BxWIDTHxDEPTH")
  try:
    done = forget.forget(WORKDIR.value, suite=settings.suite, model=target.model,
                         preset=target.preset, names=names, plans_dir=settings.plans_dir,
                         mods=mods_set.of_flag(run_config.split(settings.mods)),
                         plan_files=run_config.split(settings.plan_files))
  except (forget.ForgetError, ValueError) as e:
    sys.exit(f"error: {e}")
  print(f"[forget_rows] {done['target']}: moved {done['rows']} row(s) of "
        f"{', '.join(done['names'])}"
        + (f" with {len(done['run_folders'])} run folder(s)" if done["run_folders"] else "")
        + f" and {', '.join(done['plan_files']) or 'no plan files'} "
        f"to {WORKDIR.value}/{forget.FORGOTTEN}/{done['stamp']}")


if __name__ == "__main__":
  app.run(main, flags_parser=run_config.parse_flags)
