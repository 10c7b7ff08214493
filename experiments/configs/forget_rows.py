"""Settings of `python3 -m experiments.forget_rows --workdir=DIR`: which rows and plan files of
one bench target to move aside, so the next bench call measures them again.

  python3 -m experiments.forget_rows --workdir=DIR --config.forget.target=dhen/large \
      --config.forget.variants=loka --config.forget.plan_files=plan_serve.json

--workdir is a flag of the main, not a setting: the bench's workdir.
"""
import ml_collections
from ml_collections import config_dict

SUITES = ("models", "towers", "quality")


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()

  config.forget = forget = ml_collections.ConfigDict()
  # The target: model/preset, or tower/BxWIDTHxDEPTH (required).
  forget.target = config_dict.placeholder(str)
  # Which results file: bench.jsonl (models, towers) or quality.jsonl (quality).
  forget.suite = "models"
  # The variants (or, with suite=quality, the arms) whose rows to move, comma-separated
  # (required).
  forget.variants = ""
  # The target's plan files to move too, comma-separated (e.g. plan_serve.json); with
  # probe_report.json, probe (the probe's folder) and validation_state (the probe run that
  # validation made again) the next call probes it again.
  forget.plan_files = ""
  # The target's Mods set, comma-separated as the bench's targets.mods; empty: every Mod.
  forget.mods = ""
  # The bench's plan directory; unset: WORKDIR/plans.
  forget.plans_dir = config_dict.placeholder(str)
  return config
