"""A bench call's settings from its config (experiments/configs/bench*.py): the suite, the
speed targets and variants, the speed suites' `SpeedSettings`, the quality suite's runs and
the call's pacing and directories.

Every value is checked here, before JAX starts or anything is written: a wrong one is a
ValueError whose message names the field, `--config.GROUP.FIELD=VALUE: why`, which the main
prints as its one-line error. Lists are comma-separated strings (`run_config.split`).
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional, Tuple

from experiments import run_config
from experiments.bench import mods_set, quality, suite, towers
from experiments.bench.variants import VARIANTS, Variant, parse_variants
from loka_jax.models import MODEL_NAMES, PRESETS

SUITES = ("towers", "models", "quality", "all")
QUALITY_SUITES = ("quality", "all")  # the suites that run the quality runs
QUALITY_DATA = ("synthetic", "movielens")
# Fields with a least value (the options they feed refuse less).
AT_LEAST = {"speed.repeats": 1, "probe.timing_compile_workers": 1,
            "probe.min_timing_gflops": 0.0, "validation.shadow_steps": 0,
            "validation.shadow_warmup_steps": 1, "quality.warmup_steps": 0,
            "quality.cooldown_steps": 0, "quality.movielens.cooldown_steps": 0}


@dataclasses.dataclass(frozen=True)
class Call:
  """What one bench call runs, and within which time."""
  suite: str                                   # one of SUITES
  speed_targets: Tuple[suite.Target, ...]      # the towers and models suites' targets
  variants: Tuple[Variant, ...]                # timed per speed target, bf16 first
  speed: suite.SpeedSettings
  quality_runs: Tuple[Tuple[str, quality.QualitySettings], ...]  # (model, settings)
  only: Tuple[str, ...]                        # targets.only: none selects every target
  max_minutes: float                           # pacing.max_minutes
  end_by_minutes: Optional[float]              # pacing.end_by_minutes
  compile_cache: str                           # the persistent XLA compilation cache
  xla_deterministic: bool                      # quality.xla_deterministic


def get(config, path: str):
  """The field at a dotted `path` (e.g. 'quality.movielens.steps')."""
  for key in path.split("."):
    config = config[key]
  return config


def fault(config, path: str, why: str) -> ValueError:
  """The error naming the field at `path` with its value."""
  return ValueError(f"--config.{path}={get(config, path)}: {why}")


def _one_of(config, path: str, allowed) -> Tuple[str, ...]:
  """The entries of a list field, each one of `allowed`."""
  given = run_config.split(get(config, path))
  wrong = [n for n in given if n not in allowed]
  if wrong:
    raise fault(config, path, f"{', '.join(wrong)} not one of {', '.join(allowed)}")
  return given


def _seeds(config, path: str) -> Tuple[int, ...]:
  given = run_config.split(get(config, path))
  if not all(s.isdigit() for s in given) or len(set(given)) != len(given):
    raise fault(config, path, "must list distinct non-negative integers, e.g. 1,2")
  return tuple(int(s) for s in given)


def _check(config) -> None:
  """The fields whose values come from a fixed set or have a least one."""
  if config.suite not in SUITES:
    raise fault(config, "suite", f"not one of {', '.join(SUITES)}")
  if config.serving.promotion not in run_config.AUTO:
    raise fault(config, "serving.promotion", f"not one of {', '.join(run_config.AUTO)}")
  for path, least in AT_LEAST.items():
    value = get(config, path)
    if value is not None and value < least:
      raise fault(config, path, f"must be at least {least}")
  if config.quality.xla_deterministic and config.suite != "quality":
    raise fault(config, "quality.xla_deterministic", "for suite quality only: it slows the "
                "embeddings' backward, and the other suites time their steps")


def speed_settings(config, plans_dir: str) -> suite.SpeedSettings:
  """The speed suites' settings (also the quality suite's LoKA plans are made with them)."""
  probe, serving = config.probe, config.serving
  try:
    mods = mods_set.of_flag(run_config.split(config.targets.mods))
  except ValueError as e:
    raise fault(config, "targets.mods", str(e)) from None
  head_to_head = _one_of(config, "speed.head_to_head", tuple(VARIANTS))
  return suite.SpeedSettings(
      repeats=config.speed.repeats, plans_dir=plans_dir, probe=probe.enabled,
      probe_steps=probe.steps, probe_samples=probe.samples,
      probe_kernels=run_config.split(probe.kernels),
      probe_timing_cache=probe.timing_cache,
      probe_compile_workers=None if probe.compile_workers < 0 else probe.compile_workers,
      probe_timing_compile_workers=probe.timing_compile_workers,
      probe_min_timing_gflops=probe.min_timing_gflops,
      select_min_sqnr_wgrad_db=probe.min_sqnr_wgrad_db,
      # `validation_<field>` of the settings is the validation group's field.
      **{f"validation_{k}": v for k, v in config.validation.items()},
      head_to_head=head_to_head, serve_plan=serving.plan,
      serve_quality_gate=serving.quality_gate,
      **({} if serving.quality_budget is None else
         {"serve_quality_budget": serving.quality_budget}),
      serve_promotion=run_config.auto(serving.promotion),
      min_call_s=(suite.speed.MIN_CALL_S if config.speed.min_call_ms is None
                  else config.speed.min_call_ms * 1e-3),
      train_calls=config.speed.train_calls, own_states=config.speed.own_states,
      seed=config.targets.seed, probe_seed=probe.seed, mods=mods)


def speed_targets(config) -> Tuple[suite.Target, ...]:
  """The towers and models suites' targets of the call's suite, in order."""
  batch = config.targets.batch_size or None
  found = []
  if config.suite in ("towers", "all"):
    shapes = run_config.split(config.targets.towers) or towers.TOWER_SHAPES
    try:
      found += suite.tower_targets(shapes, batch)
    except ValueError as e:
      raise fault(config, "targets.towers", str(e)) from None
  if config.suite in ("models", "all"):
    models = _one_of(config, "targets.models", MODEL_NAMES) or MODEL_NAMES
    found += suite.model_targets(models, _one_of(config, "targets.presets", PRESETS), batch)
  return tuple(found)


def quality_runs(config, speed: suite.SpeedSettings
                 ) -> Tuple[Tuple[str, quality.QualitySettings], ...]:
  """(model, settings) of every quality run of the call's suite: synthetic data, then
  MovieLens."""
  if config.suite not in QUALITY_SUITES:
    return ()
  q, ml = config.quality, config.quality.movielens
  data = _one_of(config, "quality.data", QUALITY_DATA)
  arms = _one_of(config, "quality.arms", tuple(quality.ARMS))
  noise, seeds = _seeds(config, "quality.noise_seeds"), _seeds(config, "quality.seeds")
  runs = []
  try:
    if "synthetic" in data:
      models = _one_of(config, "targets.models", MODEL_NAMES) or MODEL_NAMES
      runs += [(m, quality.QualitySettings(
          data="synthetic", preset=q.preset, steps=q.steps,
          batch_size=config.targets.batch_size or None, seed=config.targets.seed,
          noise_seeds=noise, seeds=seeds, arms=arms, min_eval=q.eval,
          plans_dir=speed.plans_dir, warmup_steps=q.warmup_steps, clip_norm=q.clip_norm,
          cooldown_steps=q.cooldown_steps, mods=speed.mods)) for m in models]
    if "movielens" in data:
      models = _one_of(config, "quality.movielens.models", MODEL_NAMES)
      runs += [(m, quality.QualitySettings(
          data="movielens", preset=ml.preset, steps=ml.steps, batch_size=ml.batch_size,
          seeds=tuple(range(ml.seeds)), arms=arms, data_cache=ml.data_cache,
          cooldown_steps=ml.cooldown_steps,
          plans_dir=os.path.join(speed.plans_dir, "movielens"), mods=speed.mods))
               for m in models]
  except ValueError as e:  # QualitySettings' own checks (warm-up, clipping, cooldown)
    raise ValueError(f"--config.quality: {e}") from None
  return tuple(runs)


def from_config(config, workdir: str) -> Call:
  """The call a config describes, its directories under `workdir` unless the config names
  them; ValueError naming the first wrong field."""
  _check(config)
  try:
    variants = parse_variants(run_config.split(config.speed.variants))
  except ValueError as e:
    raise fault(config, "speed.variants", str(e)) from None
  speed = speed_settings(config, config.plans_dir or os.path.join(workdir, "plans"))
  return Call(suite=config.suite, speed_targets=speed_targets(config), variants=variants,
              speed=speed, quality_runs=quality_runs(config, speed),
              only=run_config.split(config.targets.only),
              max_minutes=config.pacing.max_minutes,
              end_by_minutes=config.pacing.end_by_minutes,
              compile_cache=config.compile_cache or os.path.join(workdir, "jax_cache"),
              xla_deterministic=config.quality.xla_deterministic)
