"""The speed suites (towers, models): one resumable JSONL row per (target, variant).

A row holds the variant's train-step and inference timings with the bf16 baseline timed
interleaved beside it in the same process (raw samples kept, so any two variants' ratio can be
bootstrapped later through their bf16 baselines), examples/s, memory, compile time and the
GEMM backends of the compiled step. A rerun skips finished rows; a failure is a row with an
`error` (delete the line to retry).
"""
from __future__ import annotations

import dataclasses
import functools
import gc
import os
import time
import traceback
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import jax

from experiments.bench import mods_set, pace, planning, serving, serving_gate, speed, towers
from experiments.bench.results import ResultsFile
from experiments.bench.targets import interleaved_references, speed_index
from experiments.bench.variants import (PALLAS, PLAN, VARIANTS, Variant, pallas_coverage,
                                        pallas_plan)
from loka_jax.data import FeatureSpec, make_source
from loka_jax.dispatch.validate import BASELINE as ALL_BF16_PLAN
from loka_jax.models.presets import (apply_mods, build_model, check_keep_bias, get_config,
                                    site_products, tower_flops)
from loka_jax.models.site import SiteConfig
from loka_jax.train import experiment
from loka_jax.train.loop import TrainConfig
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS

# `mods_set` is absent (None) from rows of the default Mods set (`mods_set.DEFAULT`), so rows
# written before it existed keep their keys.
KEY_FIELDS = ("suite", "model", "preset", "variant", "device", "mods_set")
TOWER = "tower"
PLAN_EVAL_EXAMPLES = 65536  # held-out examples a target's LoKA plan is validated on (at most)


@dataclasses.dataclass(frozen=True)
class Target:
  """What one group of rows measures: a tower shape or a model preset."""
  suite: str                    # 'towers' | 'models'
  model: str                    # 'tower' or a model name
  preset: str                   # tower shape name (BxWxD) or preset name
  batch_size: Optional[int] = None

  @property
  def name(self) -> str:
    return f"{self.model}/{self.preset}"

  @property
  def shape(self) -> towers.TowerShape:
    return towers.TowerShape.parse(self.preset)

  def batch(self) -> int:
    if self.model == TOWER:
      return self.batch_size or self.shape.batch
    return self.batch_size or int(get_config(self.model, self.preset).batch_size)

  def config(self, mods: Sequence[str] = ()):
    config = get_config(self.model, self.preset)
    return apply_mods(config, mods) if mods else config

  def source(self, seed: int = 0, num_eval: Optional[int] = None):
    if self.model == TOWER:
      return towers.TowerSource(self.shape.width, seed=seed,
                                num_eval=num_eval or self.batch())
    features = FeatureSpec.from_dict(dict(self.config().features))
    return make_source("synthetic", features=features, seed=seed,
                       num_eval=num_eval or self.batch())

  def build(self, site: SiteConfig, mods: Sequence[str] = ()):
    if self.model == TOWER:
      return towers.build_tower(self.shape, site, mods)
    config = self.config(mods)
    model = build_model(config, FeatureSpec.from_dict(dict(config.features)), site)
    check_keep_bias(model, config, lambda: self.source().train_batch(0, 2))
    return model

  def flops_per_example(self) -> int:
    if self.model == TOWER:
      return self.shape.flops_per_example()
    config = self.config()
    return int(tower_flops(config, FeatureSpec.from_dict(dict(config.features))))

  def plan_eval_examples(self) -> int:
    """Held-out examples of the LoKA plan's probe run and validation: up to PLAN_EVAL_EXAMPLES
    (whole batches, at most 16 of them). A paired comparison on one batch would leave the
    0.02% log-loss budget to the luck of 4096 examples."""
    batch = self.batch()
    return batch * max(1, min(16, PLAN_EVAL_EXAMPLES // batch))

  def run_spec(self, mods: Sequence[str] = ("all",)) -> experiment.RunSpec:
    return experiment.RunSpec(model=self.model, preset=self.preset, precision="bf16",
                              mods=tuple(mods), num_eval=self.plan_eval_examples())

  def probe_build(self) -> Optional[Callable]:
    """What the probe builds instead of a preset (towers only)."""
    if self.model != TOWER:
      return None
    return lambda spec: (self.build(SiteConfig.for_precision("bf16"), spec.mods),
                         self.source(spec.seed, num_eval=spec.num_eval), None)


def tower_targets(shapes: Sequence[str], batch_size: Optional[int] = None) -> List[Target]:
  return [Target("towers", TOWER, towers.TowerShape.parse(s).name, batch_size) for s in shapes]


def model_targets(models: Sequence[str], presets: Sequence[str],
                  batch_size: Optional[int] = None) -> List[Target]:
  return [Target("models", m, p, batch_size) for p in presets for m in models]


def parse_target(text: str, batch_size: Optional[int] = None) -> Target:
  """The target 'model/preset' or 'tower/BxWIDTHxDEPTH' names; ValueError saying the form
  otherwise."""
  model, _, preset = (text or "").partition("/")
  if not model or not preset:
    raise ValueError(f"--target={text}: expected model/preset or tower/BxWxD")
  return Target("towers" if model == TOWER else "models", model, preset, batch_size)


def selected(targets: Iterable[Target], only: Sequence[str]) -> List[Target]:
  """Targets whose 'model/preset' (or model, or preset) is in `only` (all when empty)."""
  if not only:
    return list(targets)
  return [t for t in targets if t.name in only or t.model in only or t.preset in only]


# A probe starts only with this much time before the deadline (it resumes on a later run).
MIN_PROBE_BUDGET_S = 30


@dataclasses.dataclass
class SpeedSettings:
  repeats: int = 20
  plans_dir: str = "plans"
  probe: bool = True            # probe a target whose LoKA plan does not exist yet
  probe_steps: int = 100
  probe_samples: int = 32       # draws per site of each probe's error evaluation
  probe_kernels: Tuple[str, ...] = ()  # each probe's candidates (empty: the default list)
  probe_timing_cache: Optional[str] = None  # timings measured ahead (`probe`, timing.only)
  probe_compile_workers: Optional[int] = None  # `ProbeOptions.compile_workers`
  probe_timing_compile_workers: int = 1  # `ProbeOptions.timing_compile_workers`
  probe_min_timing_gflops: float = 0.0  # `ProbeOptions.min_timing_gflops`
  # Validation's training from initialization (`ValidationConfig.from_init_steps`; 0: skip),
  # its warm-up and gradient clipping (None: the probe's recipe) and its seeds.
  validation_from_init_steps: int = 0
  validation_from_init_warmup_steps: Optional[int] = None
  validation_from_init_clip_norm: Optional[float] = None
  validation_from_init_seeds: int = 1
  # Steps of its shadow check from the probe's state (`ValidationConfig.shadow_steps`; 0 skips
  # it, for a probe's state on a plateau that runs leave at their own times).
  validation_shadow_steps: int = 200
  # Data windows of its shadow check from the probe's state (`ValidationConfig.shadow_windows`).
  validation_shadow_windows: int = 1
  # Whether its bounds also read the check's own noise (`ValidationConfig.shadow_noise_floor`).
  validation_shadow_noise_floor: bool = False
  # Its learning-rate warm-up after switching the probe's state to the plan, in every shadow
  # run (`ValidationConfig.shadow_warmup_steps`; None: none).
  validation_shadow_warmup_steps: Optional[int] = None
  # The selection's bar for FP8 weight gradients (`Criteria.min_sqnr_wgrad_db`; None: the
  # input gradient's, 20 dB). A plan selected under another bar is selected again.
  select_min_sqnr_wgrad_db: Optional[float] = None
  # Whether it also judges held-out log loss by the quality targets' rule, by seed
  # (`ValidationConfig.from_init_quality_bound`).
  validation_from_init_quality_bound: bool = False
  # Validation's held-out check measures a round's sites in one compiled program
  # (`ValidationConfig.held_out_one_program`).
  validation_held_out_one_program: bool = False
  # Its training checks rank a round's sites by gradient change in one compiled program
  # (`ValidationConfig.gradient_one_program`).
  validation_gradient_one_program: bool = False
  # Kernels its speed promotion proposes per kernel sort (`ValidationConfig.promotion_per_sort`).
  validation_promotion_per_sort: int = 1
  # When a training check's back-off moved no loss, it steps every FP8 gradient down at once
  # (`ValidationConfig.stalled_fraction`; 0: one site a round, always).
  validation_stalled_fraction: float = 0.1
  min_call_s: float = speed.MIN_CALL_S  # steps shorter than this run N to a timed call
  train_calls: int = speed.TRAIN_CALLS  # train calls back to back in a timed sample
  own_states: bool = False   # every variant on its own model's state (speed.TargetBench)
  seed: int = 0
  # Seed of the probe run that makes a missing plan: apart from `seed`, so quality runs at
  # every seed (one invocation each) find and resume the same probe and share its plan.
  probe_seed: int = 0
  # Variants timed, after their bf16 pair, against the variants their targets compare them
  # with, in one interleaving each (`TargetBench.head_to_head`); they run last in a target.
  head_to_head: Tuple[str, ...] = ("loka",)
  # LoKA's inference serves the export of its serving plan (forwards chosen on the forward
  # alone, `planning.serving_plan`) rather than of its training plan.
  serve_plan: bool = False
  # When the serving plan is first selected, time the export of its serving proposal against
  # it and keep the proposal when provably faster (`serving.decide_serving`). None: on a GPU only.
  serve_promotion: Optional[bool] = None
  # With `serve_plan`: score the serving candidates' served quality on the probe's trained
  # parameters first and serve only one within the held-out budget (`serving_gate`).
  serve_quality_gate: bool = True
  # The gate's held-out budget: relative log-loss change against served bf16+Mods.
  serve_quality_budget: float = NEUTRAL_REL_LOGLOSS
  # The Mods of the Mods arms (bf16_mods, bf16_mods_served, loka) and of the probe that plans
  # LoKA: every Mod by default; another set is its own subject (`mods_set`).
  mods: Tuple[str, ...] = mods_set.DEFAULT

  def __post_init__(self):
    self.mods = mods_set.parse(self.mods)

  @property
  def plans_root(self) -> str:
    """Where this run's plans live (a folder of their own for a Mods set not the default)."""
    return mods_set.plans_root(self.plans_dir, self.mods)

  def validation(self):
    """The `ValidationConfig` of the plans this run makes: its defaults but for this run's
    `validation_*` settings, each the config's field of the same name."""
    from loka_jax.dispatch.validate import ValidationConfig  # heavy: only when planning
    prefix = "validation_"
    return ValidationConfig(**{f.name[len(prefix):]: getattr(self, f.name)
                               for f in dataclasses.fields(self) if f.name.startswith(prefix)})

  def plan_options(self) -> dict:
    """`planning.make_plan`'s probe and validation options, the same for the speed suite's
    plans and the quality suite's (candidates, timing cache, compile threads, timing floor,
    the budget's weight-gradient bar, validation)."""
    return dict(samples=self.probe_samples, kernels=self.probe_kernels,
                timing_cache=self.probe_timing_cache,
                compile_workers=self.probe_compile_workers,
                timing_compile_workers=self.probe_timing_compile_workers,
                min_timing_gflops=self.probe_min_timing_gflops,
                criteria_changes=({"min_sqnr_wgrad_db": self.select_min_sqnr_wgrad_db}
                                  if self.select_min_sqnr_wgrad_db is not None else None),
                validation=self.validation())


def plan_for(target: Target, variant: Variant, batch, settings: SpeedSettings) -> tuple:
  """(KernelPlan or None, row fields, reason it is missing)."""
  if variant.kernels_from == PALLAS:
    model = target.build(SiteConfig.for_precision("bf16"), variant.mods)
    products = site_products(model, None, batch)  # abstract trace: no compilation
    plan, chosen = pallas_plan(products, variant.preference, variant.fallback)
    kernels = sorted(set(chosen.values()))
    return plan, {"pallas_coverage": pallas_coverage(chosen, variant.preference),
                  "kernels": kernels}, None
  if variant.kernels_from == PLAN:
    plan = planning.load(settings.plans_root, target.model, target.preset)
    if plan is None:
      return None, {}, "the LoKA plan is not ready (the probe resumes on the next run)"
    fields = {"plan": planning.plan_path(settings.plans_root, target.model, target.preset),
              "kernels": plan.kernel_names()}
    return plan, fields, None
  return None, {}, None


def probe_run(target: Target, settings: SpeedSettings
              ) -> Tuple[experiment.RunSpec, TrainConfig]:
  """(spec, training config) of the probe run that plans the target's LoKA arm (the run's
  Mods set): its trained state is what validation, and any later check of the plan, runs
  on."""
  spec = dataclasses.replace(target.run_spec(settings.mods), seed=settings.probe_seed)
  return spec, TrainConfig(steps=settings.probe_steps, batch_size=target.batch(),
                           progress=False, seed=settings.probe_seed)


def _probe_for_plan(target: Target, settings: SpeedSettings, deadline: float, log) -> bool:
  """Probes the target for its LoKA plan when the plan is missing (resumable); whether it
  probed."""
  if planning.load(settings.plans_root, target.model, target.preset) is not None:
    return False
  budget = deadline - time.time()
  if budget < MIN_PROBE_BUDGET_S:
    return False
  log(f"probing {target.name} for its LoKA plan (budget {budget:.0f}s)")
  spec, config = probe_run(target, settings)
  planning.make_plan(spec, settings.plans_root, config, budget_s=budget,
                     build=target.probe_build(), deadline=deadline, **settings.plan_options())
  gc.collect()  # the probe's training state must be gone before the baseline's is built
  return True


def quality_plan_maker(qs, settings: SpeedSettings, deadline: float
                       ) -> Callable[[str], Optional[str]]:
  """The quality suite's maker of a missing LoKA plan (`quality.run_model`'s `plan_maker`)
  for the runs of `qs` (a `quality.QualitySettings`): it probes the model at their preset,
  data, batch and Mods set, with the speed suite's probe options (`plan_options`), at
  `settings.probe_seed`. Not at the quality seed: the plan is one file that every seed's
  LoKA run reads, and each seed may be its own invocation, which must resume the same probe
  rather than start one with other settings. Returns the plan's path, or None while the
  probe or validation has not finished (too little time left, or a budget reached).
  `accuracy_only` (the `loka_accuracy` arm): the plan in that arm's folder, selected by the
  error budget alone and validated without the speed promotion and speed check, which would
  hand slow FP8 sites back to bf16."""
  def make(model: str, accuracy_only: bool = False) -> Optional[str]:
    budget = deadline - time.time()
    if budget < MIN_PROBE_BUDGET_S:
      return None
    options = settings.plan_options()
    if accuracy_only:
      copied = planning.reuse_probe_statistics(
          planning.plan_dir(qs.plans_root, model, qs.preset),
          planning.plan_dir(planning.loka_plans_root(qs.plans_root, True), model, qs.preset))
      if copied:
        print(f"[bench] {model}/{qs.preset} under the error budget alone: its probe starts "
              f"from LoKA's trained statistics and evaluations ({', '.join(copied)})",
              flush=True)
      options.update(criteria_changes={**(options["criteria_changes"] or {}),
                                       "min_speedup": None},
                     validation=dataclasses.replace(options["validation"], speed=False,
                                                    promote=False))
    spec = experiment.RunSpec(model=model, preset=qs.preset, data=qs.data,
                              data_cache=qs.data_cache, precision="bf16", mods=qs.mods,
                              seed=settings.probe_seed)
    batch = qs.batch_size or experiment.preset_batch_size(model, qs.preset)
    config = TrainConfig(steps=settings.probe_steps, batch_size=batch, progress=False,
                         seed=settings.probe_seed)
    return planning.make_plan(spec, planning.loka_plans_root(qs.plans_root, accuracy_only),
                              config, budget_s=budget, deadline=deadline, **options)
  return make


def _score_serving(target: Target, settings: SpeedSettings, deadline: float, log) -> bool:
  """Scores the target's serving candidates on the probe's trained parameters before its
  serving plan is first written (`serving_gate`); False when the deadline has passed first.
  Runs before the baseline is built: the probe's state and the bench's are never both
  alive."""
  root = settings.plans_root
  if (os.path.exists(planning.serving_plan_path(root, target.model, target.preset))
      or serving_gate.load(root, target.model, target.preset) is not None):
    return True
  if time.time() > deadline:
    log(f"  deadline: {target.name}'s served models left to score in the next run")
    return False
  serving_gate.score(root, target.model, target.preset, probe_context(target, settings), log,
                     budget=settings.serve_quality_budget)
  return True


def probe_context(target: Target, settings: SpeedSettings) -> Callable:
  """() -> the ValidationContext of the probe run that planned the target's LoKA arm: its
  checkpoint, or where that is absent the run trained again (as validation does)."""
  from loka_jax.dispatch import pipeline
  folder = planning.plan_dir(settings.plans_root, target.model, target.preset)
  spec, config = probe_run(target, settings)
  report = planning.load_report(settings.plans_root, target.model, target.preset)
  return lambda: pipeline.context_for_run(
      spec, os.path.join(folder, pipeline.PROBE_DIR), config, report, target.probe_build(),
      rebuild_dir=os.path.join(folder, pipeline.STATE_DIR))


def _build_arm(bench: speed.TargetBench, target: Target, v: Variant, batch,
               settings: SpeedSettings) -> Tuple[Optional[speed.Arm], Dict, Optional[str]]:
  """(the variant's arm, its row fields, why it cannot be built yet: None when it can)."""
  if v.name == "bf16":
    return bench.baseline, {}, None
  plan, fields, missing = plan_for(target, v, batch, settings)
  if missing:
    return None, {}, missing
  row = dict(fields)
  if v.kernels_from not in (PALLAS, PLAN):
    row["kernel"] = v.kernel if v.precision == "fp8_all" else f"xla_{v.precision}"
  model = target.build(speed.site_config(v, plan), v.mods)
  arm = bench.add(v.name, model)
  if v.kernels_from == PLAN:
    report = planning.load_report(settings.plans_root, target.model, target.preset)
    served, chosen = row["plan"], {}
    if settings.serve_plan:
      decide = functools.partial(serving.decide_serving, bench, arm, model, report, settings,
                                 chosen, target)
      served = planning.serving_plan(settings.plans_root, target.model, target.preset, decide)
      row["serve_plan"] = planning.serving_plan_path(settings.plans_root, target.model,
                                                     target.preset)
      row["serve_kernels"] = sorted({served["sites"][n]["fwd"]["kernel"]
                                     for n in served["sites"]})
      row["serve_promotion"] = serving.serving_summary(served)
    arm, export_fields = (chosen["arm"], chosen["fields"]) if chosen else (
        serving.serve_exported(bench, arm, model, served, report))
    row.update(export_fields)
  elif v.served:  # no FP8 site: every weight is exported in bf16, no report needed
    arm, export_fields = serving.serve_exported(bench, arm, model, ALL_BF16_PLAN, None)
    row.update(export_fields)
  return arm, row, None


def _head_to_head(bench: speed.TargetBench, arm: speed.Arm, alive: Dict[str, speed.Arm],
                  rows: Dict[str, Dict], build: Callable[[str], speed.Arm],
                  deadline: float, settings: SpeedSettings, log, build_s: float = 0.0) -> Dict:
  """Row fields: `arm` timed against each variant its targets compare it with, in one
  interleaving per pair (`head_to_head`), or why that failed; the row is kept either way.
  A variant whose row an earlier run timed is built again here, when the build would end by
  the deadline at `build_s`, the longest build of this run: the row is written only after
  its pairs, so a rebuild the call's hard limit cuts short loses the row itself (DHEN large:
  about 80 s a build, up to four references)."""
  others = {}
  for name in interleaved_references(arm.name, rows):
    if name not in alive:
      if time.time() + build_s > deadline:
        log(f"  {arm.name} vs {name}: not built again, since a build ({build_s:.0f} s at "
            "most so far) would end past the deadline (the ratio of rows stands)")
        continue
      log(f"  {arm.name} vs {name}: building {name} again for the pair")
      started = time.time()
      try:
        alive[name] = build(name)
        build_s = max(build_s, time.time() - started)
      except Exception as e:  # that pair falls back to the ratio of rows; the others stand
        log(f"  {arm.name} vs {name}: {name} failed to build: {type(e).__name__}: "
            f"{str(e)[:300]}")
        continue
    others[name] = alive[name]
  try:
    pairs = bench.head_to_head(arm, others, settings.repeats, seed=settings.seed)
  except Exception as e:  # e.g. out of memory with the other arms alive: keep the bf16 pair
    log(f"  {arm.name}: head-to-head timing failed: {type(e).__name__}: {str(e)[:300]}")
    return {"head_to_head_error": f"{type(e).__name__}: {e}"[:2000]}
  for n, pair in pairs.items():
    log(f"  {arm.name} vs {n}, one interleaving: train {pair['train']['ratio']:.3f}x, "
        f"infer {pair['infer']['ratio']:.3f}x")
  return {"head_to_head": pairs} if pairs else {}


def expected_row_s(results: ResultsFile, key: Tuple, variant: str) -> Optional[float]:
  """How long the target's next `variant` row may take (`pace.expected_s`): from the rows of
  that variant at the target (`key`: its `speed_index` key, device and Mods set included),
  else of any variant there, each from its build to its append (`row_s`, the head-to-head
  rebuilds included); None before the first row that records it."""
  return pace.expected_s(((r.get("variant"), r.get("row_s")) for r in results.rows()
                         if (r.get("suite"), r.get("model"), r.get("preset"), r.get("device"),
                             mods_set.of_row(r)) == tuple(key)), variant)


def run_target(target: Target, variants: Sequence[Variant], results: ResultsFile, *,
               settings: SpeedSettings, deadline: float, device: str,
               log: Callable[[str], None] = print, end_by: Optional[float] = None) -> bool:
  """Measures the target's unfinished variants; False when some are left (deadline, plan).
  With `end_by` (the call's hard end) a row starts by its expected length
  (`expected_row_s`, `pace.may_start`), except that a head-to-head row starts only before
  `deadline`, where its rebuilds stop."""
  set_label = mods_set.label(settings.mods)
  key = (target.suite, target.model, target.preset, device, set_label)  # its speed_index key
  variants = [mods_set.apply(v, settings.mods) for v in variants]
  pending = [v for v in variants if not results.done((*key[:3], v.name, device, set_label))]
  if not pending:
    return True
  # Head-to-head subjects last: the arms they are compared with are timed (and alive) first.
  pending.sort(key=lambda v: v.name in settings.head_to_head)
  log(f"{target.name}: {', '.join(v.name for v in pending)}")
  probed = False
  if settings.probe:
    # Probe before the baseline's state exists: a large preset (Wukong large: 50 GiB of
    # parameters and Adam state) cannot hold the probe's training state beside it.
    if any(v.kernels_from == PLAN for v in pending):
      probed = _probe_for_plan(target, settings, deadline, log)
  waiting = [v for v in pending if v.kernels_from == PLAN
             and planning.load(settings.plans_root, target.model, target.preset) is None]
  if waiting and probed:
    # Planning (the probe, then the plan's validation) had this run's time (its budget is
    # the time to the deadline) and stopped short of a plan because its next step would not
    # fit: what is left cannot build the baseline and time a row (DHEN large on the H200: a
    # 77 s compile thrown away). The other variants wait too: the head-to-head rebuilds them
    # beside LoKA's row anyway.
    log(f"  planning (probe or validation) ran to its budget and the LoKA plan is not "
        f"ready: {target.name} left for the next run, its baseline not built")
    return False
  if (settings.serve_plan and settings.serve_quality_gate and not waiting
      and any(v.kernels_from == PLAN for v in pending)):
    if not _score_serving(target, settings, deadline, log):
      return False
  if waiting and len(waiting) == len(pending):
    # Nothing to time until the plan exists: building the baseline (Wukong large: a 50 GiB
    # state and a minute of compilation) would only be thrown away.
    log(f"  {', '.join(v.name for v in waiting)}: the LoKA plan is not ready (the probe "
        "resumes on the next run)")
    return False
  first_row_s = expected_row_s(results, key, pending[0].name)
  if not pace.may_start(time.time(), deadline, end_by,
                        None if first_row_s is None else 2 * first_row_s)[0]:
    # A probe that ran to the deadline: the baseline's compile (InterFormer small: 40-84 s on
    # the H200) would only be thrown away before the first row. Past pacing.max_minutes, the
    # baseline is built when it and the first row fit by the hard end (a build is about a
    # row's length).
    log(f"  deadline: {target.name} left for the next run, its baseline not built")
    return False
  base = {"suite": target.suite, "model": target.model, "preset": target.preset,
          "device": device, "jax": jax.__version__, "batch_size": target.batch(),
          "flops_per_example": target.flops_per_example()}
  if set_label is not None:
    base["mods_set"] = set_label
  batch = target.source(settings.seed).train_batch(0, target.batch())
  bench = speed.TargetBench(batch, seed=settings.seed, min_call_s=settings.min_call_s,
                            train_calls=settings.train_calls, own_states=settings.own_states)
  t0 = time.time()
  try:
    bench.set_baseline(target.build(SiteConfig.for_precision("bf16")))
  except Exception as e:  # e.g. out of memory: record it once for the whole target
    results.append({**base, "variant": "bf16", "error": f"{type(e).__name__}: {e}"[:2000]})
    log(f"  bf16 failed: {type(e).__name__}: {str(e)[:300]}")
    return True
  baseline_build_s = time.time() - t0
  longest_build_s = baseline_build_s   # a reference rebuilt for LoKA's pairs takes as long
  log(f"  bf16 compiled in {longest_build_s:.0f}s (steps per timed call: {bench.inner}; "
      f"calls per timed sample: {bench.calls_per_sample})")
  complete = True
  alive: Dict[str, speed.Arm] = {}  # arms built here, kept for the pairs
  # An arm on a state of its own is kept for the pairs only when every arm has one
  # (own_states, whose memory the user chose) and some pair is asked for; otherwise it is
  # dropped after its row to free its state.
  keep_own = settings.own_states and bool(settings.head_to_head)

  def build_again(name: str) -> speed.Arm:
    arm, _, missing = _build_arm(bench, target, mods_set.apply(VARIANTS[name], settings.mods),
                                 batch, settings)
    if missing:
      raise RuntimeError(f"{name}: {missing}")
    return arm

  for v in pending:
    now = time.time()
    start, why = pace.may_start(now, deadline, end_by, expected_row_s(results, key, v.name))
    if start and v.name in settings.head_to_head and now > deadline:
      start, why = False, "past pacing.max_minutes, where its head-to-head rebuilds stop"
    if not start:
      log(f"  deadline: {target.name}/{v.name} left for the next run ({why})")
      return False
    row = {**base, "variant": v.name, "precision": v.precision, "mods": list(v.mods)}
    try:
      arm, fields, missing = _build_arm(bench, target, v, batch, settings)
      if missing:
        log(f"  {v.name}: skipped, {missing}")
        complete = False
        continue
      row.update(fields)
      longest_build_s = max(longest_build_s, float(arm.info.get("compile_s") or 0.0))
      measured = bench.time_pair(arm, settings.repeats, seed=settings.seed)
      for mode, s in measured.items():
        s["examples_per_s"] = target.batch() / (s["median_us"] * 1e-6)
      row.update(arm.info, **measured)
      log(f"  {v.name}: train {measured['train']['speedup']:.2f}x, "
          f"infer {measured['infer']['speedup']:.2f}x vs bf16 (compile {arm.info['compile_s']}s)")
      if v.name in settings.head_to_head:
        finished = speed_index(results.rows()).get(key, {})  # this run's rows and earlier ones
        row.update(_head_to_head(bench, arm, alive, finished, build_again, deadline, settings,
                                 log, longest_build_s))
      # The bf16 row's arm is the baseline built above: its cost is that build too. Without
      # it the row read 5 s of a 75 s cost at Wukong `large`, and the next variant, paced by
      # it before a row of its own, started 27 s of work with 6 s expected (H200), and the
      # bench overran its hard end.
      row["row_s"] = round(time.time() - now + (baseline_build_s if v.name == "bf16" else 0.0),
                           3)
      results.append(row)
      if (arm.info["shared_state"] or keep_own) and v.name != "bf16":
        alive[v.name] = arm
    except Exception as e:  # record and go on with the next variant
      results.append({**row, "error": f"{type(e).__name__}: {e}"[:2000],
                      "traceback": traceback.format_exc()[-3000:]})
      log(f"  {v.name} failed: {type(e).__name__}: {str(e)[:300]}")
    finally:
      if v.name not in alive:
        bench.drop(v.name)
  return complete
