"""End-to-end validation of a plan: per-op errors and timings miss how errors propagate
through the tower and how kernels fuse with their neighbours, so after selection the whole
model is checked, and the worst sites are backed off until every check holds.

Quality, on the SAME trained bf16+Mods parameters (a plan changes kernels, never weights):
  1. held-out: log loss of the planned model vs bf16+Mods on the held-out batches. While the
     relative difference exceeds `max_rel_logloss`, each FP8 site's contribution (the
     relative log-loss change when only that site runs its plan, every other site xla_bf16)
     is measured and the largest in the direction of the excess (a site pulling the other
     way offsets it) is backed off to a more precise kernel: the fastest candidate of the
     probe report that is eligible under the plan's budget and more accurate (pessimistic
     SQNR, or MERE) than the current one, else xla_bf16.
  2. shadow training: `shadow_steps` steps from the same checkpoint, plan vs bf16+Mods, on the
     same batches. Both runs start equal and see the same data, so batch noise cancels and
     only the drift of the parameters remains; the runs *diverge* when the plan's loss is
     not finite, or the mean training loss over the last `shadow_window` steps or the
     held-out log loss after the run exceed bf16+Mods' by more than `shadow_max_rel_loss`
     (relative; default 0.5%, 25x the 0.02% quality bar: it catches a run that climbs or
     stalls, not healthy drift). The check is one-sided: a plan that ends *below* the
     baseline has drifted, not diverged, and backing sites off cannot make it safer (on
     Wukong `large`, 200 steps after the probe, a plan ended 1.3% below bf16+Mods on held-out
     data: the drift of a fast-moving early run, not FP8 damage; docs/BENCHMARKS.md, section
     7). Divergence that the held-out check missed comes from the backward
     passes, so the site whose plan moves the parameter gradient most (relative L2 change of
     the whole gradient on training batches when only that site runs its plan) is backed off
     and the shadow run repeated.
     With `shadow_noise_floor` the bounds also read the check's own noise. A short run from
     an early state is chaotic: backing off one site's gradient passes moved Wukong
     `large`'s held-out change in one data window from +1.27% to -0.68%, and in another
     from +1.96% to +3.82% (H200, docs/BENCHMARKS.md section 7, forty-first session). So
     bf16+Mods trains each window a second time from the checkpoint with every parameter
     times (1 + u), u ~ N(0, `NOISE_FLOOR_JITTER`^2), a bf16 rounding's worth, and each
     bound becomes max(`shadow_max_rel_loss`, 2 x the RMS over windows of that run's
     change / sqrt(windows)): what a mean over the windows moves under a perturbation
     that no kernel choice can be blamed for.
     With `shadow_warmup_steps` every run warms its learning rates up again from 0 after the
     switch (`optim.restart_schedules`). The probe's state is an early one: at Wukong
     `large` its step-50 state sits on a loss plateau that every run leaves between steps
     100 and 350, at a step set by seed, plan and warm-up, so the check's 200 steps judge
     when a run leaves it (the default selection did, the 0 dB plan did not, and both train
     from initialization as well as bf16; H200, docs/BENCHMARKS.md section 7, forty-third
     to forty-sixth sessions). There `shadow_steps=0` leaves the verdict to the check from
     initialization at the quality recipe (3 below).
     A back-off that moves neither loss says the ranking has not found the cause: at
     Wukong `large` the site that moved the gradient most went to bf16 and every window's
     held-out change stayed within 0.01 points of +6.8% (H200, docs/BENCHMARKS.md section
     7, forty-third session), with 31 sites left to try one round each. So when the site(s)
     the previous round backed off took back less than `stalled_fraction` of each loss's
     excess over its bound, the round steps down at once every site that quantizes a
     gradient pass (the held-out check passed the forwards), or every FP8 site where none
     does (`stalled_back_off`): a few rounds to a passing plan instead of one per site.
  3. training from initialization (`from_init_steps`; 0, the default, skips it): the same
     comparison, but both runs start from a fresh initialization (the config's seed, fresh
     delayed-scaling state) on the data from its start, with the probe's optimizer or,
     with `from_init_warmup_steps`, the same with a linear learning-rate warm-up. The two
     checks above start from a trained state, so they cannot see early training. At the
     `large` presets, Adam without a warm-up spikes in the first steps even in bf16, and FP8
     in the gradient passes makes the spike larger; on DLRM `large` that cost +0.004
     held-out log loss after 500 steps, with a plan that had passed both checks (H200,
     docs/BENCHMARKS.md, section 7). Its verdict and back-offs follow the shadow check's:
     the same one-sided bound, and the site whose plan moves the trained gradient most is
     stepped down first. On the H200 it caught that plan under the probe's recipe (held-out
     +2.2% after 200 steps; the worst step's loss 38 against bf16+Mods' 15), a miss the
     checks from the trained state had passed. Give it the warm-up the model is trained
     with where that differs, or it judges a recipe nobody uses. The divergence bound
     (0.5%) is far wider than the quality target's; with `from_init_quality_bound` the
     check also fails a mean held-out change above max(`max_rel_logloss`, 2 x the relative
     std of its bf16+Mods runs over the seeds), the quality target's bound read from this
     check's own runs (DCNv2 `large`: +0.24% after the quality suite's 500 steps, passed
     by the divergence bound, 11 bf16 seed deviations out by the target's).
Speed (on a GPU only: CPU timings say nothing about GPU kernels; `speed=True` forces it):
  whole jitted train (fwd + bwd + optimizer) and inference steps, plan vs bf16+Mods,
  interleaved, >= 20 repeats, bootstrap 95% CI of the speedup (loka_jax/timing.py). While a
  lower bound is below `min_speedup` (1.0: never slower), the site whose reversion to
  xla_bf16 speeds the failing step(s) up most (its in-context slowdown) is backed off to
  xla_bf16, together with every other site whose reversion alone speeds every failing step
  up with its CI above 1. Backing off only ever costs speed, never accuracy, and one round
  costs a compilation of the whole model per site: on DCNv2 `small` (H200) all 11 FP8 sites
  each slowed the step by 4-13%, and one site a round would have taken 11 rounds of two
  minutes. Only sites with an FP8 pass in a failing step are candidates; a step that runs
  none of the plan's FP8 passes (inference, when the plan puts only gradients on FP8) runs
  bf16+Mods' kernels, so its lower bound is noise: recorded (`same_kernels_as_bf16_mods`),
  not acted on (on Wukong `large` such a noise CI, 0.976, once sent gradient-only sites back).

Speed promotion (first, on a GPU only; `promote=True` forces it): selection judges each site
alone, which is pessimistic for FP8 in a whole step (the step shares quantized operands
between passes, and XLA may run bf16's passes slower in the step than alone: at 8192x2048x8
no XLA tensorwise pass cleared 1.05x alone, yet tensorwise everywhere trains 1.05x faster).
So for each kernel sort the FP8 kernel that loses least alone is put at every xla_bf16 site
where it is safe in every pass (`promotions`), each such plan is timed against the plan in one
interleaving, and the fastest whose train step is provably faster and whose inference is not
provably slower is kept. Sites validation backed off are never promoted again, and the
quality checks that follow judge promoted sites like any other.

Many FP8 sites (more than `max_measured_sites`, default 16): measuring every site's
contribution costs a compilation of the whole model per site and round, hours for a large
preset. Such a round ranks the sites from the probe report instead (the forward error for the
held-out check, every pass's error for the shadow check, GEMM time vs xla_bf16 for speed) and
backs off the worst quarter at once; the record's `report_scores` says so. A check that
measures in one compiled program (`held_out_one_program`, `gradient_one_program`, below)
has no such cost and always measures.

Every measurement is a `validation` record of the plan (`add_validation`) and every change a
`back_off` record, so the plan file tells how it came to be. A check's last record carries
`final: true`. `Progress` saves the plan at every round and stops at a deadline, and
`validate_end_to_end(..., resume_from=saved)` goes on from a saved plan: a validation that
outlasts one GPU call finishes over several. A round that measures sites one at a time is
itself longer than a call on a large preset (one compilation of the whole model per site:
Wukong `large`'s held-out rounds, each one such measurement, ran 25 s apart on an H200, and
a fresh host first trains the state again): each site's measurement is recorded as it is taken
(`quality_held_out_site`, `quality_shadow_site`, and `speed_site` for a speed round's
in-context slowdowns, each timed as the plan against the plan without the site), the plan
saved before the next, and a resumed round measures only the sites not yet recorded; a
speed round's own timed steps are kept too (`speed_steps`, per round, device and FP8 sites). The
training checks' runs are kept the same way (`quality_shadow_run`, `quality_from_init_run`:
each run's window loss, worst step and held-out log loss, under its recipe and the plan's FP8
sites), so a round paused while its sites are measured does not train its runs again: at
DCNv2 `large` with the quality recipe a round's six 500-step runs took about 140 s of a
call (H200, docs/BENCHMARKS.md section 7, thirty-first session). With
`held_out_one_program` the held-out check's per-site measurements share one compiled
program a round (`switch_board`: each candidate site behind a runtime switch, calibrated per
subset where its op keeps delayed-scaling state), so a round costs one compilation and an
evaluation per site; with `gradient_one_program` the training checks' per-site gradient
changes do the same (one compiled gradient of the switched model).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import time
from typing import (Any, Callable, Dict, Hashable, List, Mapping, Optional, Sequence,
                    Tuple)

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax import _compat, timing
from loka_jax.dispatch.plan import FALLBACK, Plan, add_validation, as_plan, back_off, promote
from loka_jax.kernels import FP8_META, FUSED_OP, PASSES, PER_PASS, KernelChoice, KernelPlan
from loka_jax.kernels import registry
from loka_jax.kernels.flax_delayed import merge_fp8_meta
from loka_jax.train.loop import compiled_steps, evaluate, loss_fn
from loka_jax.train.metrics import NEUTRAL_REL_LOGLOSS, calibration, paired_logloss_change
from loka_jax.train.optim import OptimConfig, restart_schedules
from loka_jax.train.state import one_example

BASELINE = KernelPlan.uniform(FALLBACK)
# Relative std of the shadow check's noise-floor jitter: bf16's unit roundoff, the relative
# error one rounding to bf16 may make, which bf16+Mods' own kernels make in every output
# (`shadow_noise_floor`).
NOISE_FLOOR_JITTER = 2.0 ** -8
DELAYED_WARMUP = 3  # delayed-scaling state starts at scale 1: calibrate before judging it


@dataclasses.dataclass(frozen=True)
class ValidationConfig:
  """Bounds and sizes of the end-to-end checks (see the module docstring)."""
  max_rel_logloss: float = NEUTRAL_REL_LOGLOSS  # held-out |relative log-loss change|
  shadow_steps: int = 200            # shadow training steps; 0 skips the shadow check
  shadow_window: int = 50            # last steps whose mean training loss is compared
  shadow_max_rel_loss: float = 0.005  # divergence bound of the shadow runs (relative)
  # Data windows the shadow check trains on from the checkpoint: window w is the `shadow_steps`
  # batches from w x shadow_steps after it, both runs per window (recorded as seed
  # config.seed + w, so window 0 is the one-window check's run); the verdict reads the mean
  # over windows, as the check from initialization does over seeds. One run pair is one
  # trajectory: at Wukong `large` it read held-out +1.27% with the training loss 0.05% below
  # bf16+Mods' (docs/BENCHMARKS.md section 7, thirty-ninth session).
  shadow_windows: int = 1
  # Whether the shadow check also trains bf16+Mods from a jittered checkpoint in each window
  # (`NOISE_FLOOR_JITTER`) and widens its bounds to 2 x that noise over sqrt(windows)
  # (`shadow_noise_bounds`). Off by default: it costs one more run per window.
  shadow_noise_floor: bool = False
  # A linear learning-rate warm-up over N steps after the switch, in every run of the shadow
  # check (`optim.restart_schedules`: the rates' schedules restart at 0, Adam's moments and
  # Adagrad's accumulators keep the checkpoint's); None trains on at the probe's rate. For
  # a probe state from early training; one on a loss plateau is another matter (module
  # docstring, 2).
  shadow_warmup_steps: Optional[int] = None
  # Training steps from a fresh initialization, plan vs bf16+Mods (0 skips the check; the
  # bound and window are the shadow check's).
  from_init_steps: int = 0
  # Its learning-rate warm-up: None, the probe's recipe; N, a linear warm-up over N steps, so
  # the check trains as the model will be trained (DLRM large: a plan that fails from init
  # under the probe's plain recipe is neutral with a 50-step warm-up).
  from_init_warmup_steps: Optional[int] = None
  # Its global-norm clipping of the dense gradients: None, the probe's (none by default);
  # like the warm-up, set it to the recipe the model is trained with.
  from_init_clip_norm: Optional[float] = None
  # Seeds it trains from (config.seed, seed + 1, ...), both runs per seed; the verdict reads
  # the mean over seeds of the relative differences. An early spike's height varies from
  # seed to seed (DLRM large: bf16+Mods' worst step 15.2, the plan's 38.2 in one round and
  # 2.2 in the next), so one seed is a sample of one where the recipe spikes.
  from_init_seeds: int = 1
  # Its held-out verdict: False judges divergence only (the shadow bound, 0.5%); True also
  # fails a round whose mean held-out change over seeds is above the quality target's bound,
  # max(max_rel_logloss, 2 x the relative std of bf16+Mods' held-out log loss over the
  # seeds): what the benchmark's quality target asks of a run of this recipe. DCNv2 large's
  # plan ended +0.24% from bf16+Mods after the quality suite's 500 steps, inside the
  # divergence bound, and 11 bf16 seed deviations outside the target's.
  from_init_quality_bound: bool = False
  grad_batches: int = 2              # training batches of the gradient contributions
  # A failing training round whose previous back-off took back less than this fraction of
  # each diverged loss's excess over its bound steps down at once every site that quantizes
  # a gradient pass, or every FP8 site where none does (`stalled_back_off`); 0 always backs
  # off what the ranking names.
  stalled_fraction: float = 0.1
  max_rounds: int = 64               # back-offs per check at most
  speed: Optional[bool] = None       # None: only on a GPU; True forces it (tests)
  promote: Optional[bool] = None     # the speed promotion: None only on a GPU; True forces it
  # Kernels the promotion proposes per kernel sort, those that lose least alone first. One
  # proposal is a sample of one of the alone-timing's pessimism: at DLRM `large` without Hard
  # Swish it proposed Pallas's delayed forward (0.991x in the step), while Flax's delayed op
  # everywhere, never proposed, trained 1.09x faster than the plan (docs/BENCHMARKS.md
  # section 7, thirty-ninth session). Each proposal costs one timed pair of whole steps.
  promotion_per_sort: int = 1
  speed_repeats: int = 20            # timing repeats (benchmark protocol: >= 20)
  # Each timing sample runs whole steps back to back for at least this long (one step when it
  # is longer): single short steps carry host jitter that can fail a plan on noise.
  speed_min_sample_s: float = 0.01
  min_speedup: float = 1.0           # lower CI bound of the step speedup that must hold
  eval_batch_size: Optional[int] = None  # None: the context's batch size
  # With more FP8 sites than this, a back-off round ranks the sites from the probe report
  # (error, timing) instead of measuring each one in the model, and backs off the worst
  # quarter at once: measuring costs one compilation of the whole model per site and round,
  # hours for a large preset (Wukong large: ~100 s per train-step compile). None: always
  # measure. A check measuring in one program (the two flags below) always measures.
  max_measured_sites: Optional[int] = 16
  # The held-out check measures a round's sites in one compiled program that runs both a
  # site's FP8 product and its bf16 one and picks by a runtime flag (`KernelPlan.switched`,
  # `held_out_change_switched`), instead of compiling the whole model once per site (Wukong
  # large: about 25 s a site on an H200, most of it the compile). Off by default: on the
  # H200 its values matched the per-site programs' within 0.06 standard errors at 2.5-2.7x
  # less time (Wukong small, docs/BENCHMARKS.md section 7, thirty-eighth session), but
  # XLA:CPU fuses around the pick and moves a delayed-scaling op's values by up to 1.4.
  held_out_one_program: bool = False
  # The shadow check and the check from initialization rank a round's sites by each one's
  # gradient change through one compiled program (`gradient_switched`) instead of one
  # whole-model gradient compile per site (a train-step compile is about 100 s at Wukong
  # `large`, whose shadow round has 14 sites). Off by default, as the held-out one: on the
  # H200 its changes were within 0.1% of the per-site programs' at 2.9x less time (Wukong
  # small, docs/BENCHMARKS.md section 7, fortieth session), on XLA:CPU within 2.5%.
  gradient_one_program: bool = False
  seed: int = 0

  def __post_init__(self):
    if self.max_rel_logloss < 0 or self.shadow_max_rel_loss < 0:
      raise ValueError("max_rel_logloss and shadow_max_rel_loss must be >= 0")
    if self.shadow_steps < 0 or self.from_init_steps < 0 or self.shadow_window < 1:
      raise ValueError(f"shadow_steps and from_init_steps must be >= 0 and shadow_window >= "
                       f"1, got {self.shadow_steps}, {self.from_init_steps}, "
                       f"{self.shadow_window}")
    if self.from_init_seeds < 1:
      raise ValueError(f"from_init_seeds must be >= 1, got {self.from_init_seeds}")
    if self.shadow_windows < 1:
      raise ValueError(f"shadow_windows must be >= 1, got {self.shadow_windows}")
    if self.promotion_per_sort < 1:
      raise ValueError(f"promotion_per_sort must be >= 1, got {self.promotion_per_sort}")
    if self.shadow_warmup_steps is not None and self.shadow_warmup_steps < 0:
      raise ValueError(f"shadow_warmup_steps must be >= 0 or None, got "
                       f"{self.shadow_warmup_steps}")
    if self.from_init_warmup_steps is not None and self.from_init_warmup_steps < 0:
      raise ValueError(f"from_init_warmup_steps must be >= 0 or None, got "
                       f"{self.from_init_warmup_steps}")
    if self.from_init_clip_norm is not None and not self.from_init_clip_norm > 0:
      raise ValueError(f"from_init_clip_norm must be > 0 or None, got "
                       f"{self.from_init_clip_norm}")
    if self.max_measured_sites is not None and self.max_measured_sites < 1:
      raise ValueError(f"max_measured_sites must be >= 1 or None, got "
                       f"{self.max_measured_sites}")
    if not 0 <= self.stalled_fraction < 1:
      raise ValueError(f"stalled_fraction must be in [0, 1), got {self.stalled_fraction}")
    if self.speed_min_sample_s < 0:
      raise ValueError(f"speed_min_sample_s must be >= 0, got {self.speed_min_sample_s}")
    if self.speed_repeats < 20:
      raise ValueError(f"speed_repeats={self.speed_repeats}: the benchmark protocol needs "
                       ">= 20 repeats")

  def to_dict(self) -> Dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass
class ValidationContext:
  """What the checks run on: a model builder, the data and the trained bf16+Mods state.

  Attributes:
    build: KernelPlan -> the Linen tower with that plan (everything else fixed: the Mods,
      the features, the dtype policy).
    source: the data source (same training batches and held-out set for every arm).
    state: the trained bf16+Mods TrainState (the probe run's checkpoint) both arms start
      from. Runs that train (shadow, timed steps) consume this one device copy and put it
      back from a host backup afterwards (`working_state`): its values never change.
    batch_size: training (and timing) batch.
    optim: the optimizer of the shadow runs and timed train steps.
    report: the ProbeReport the plan was selected from (back-off targets; optional).
  """
  build: Callable[[KernelPlan], Any]
  source: Any
  state: Any
  batch_size: int
  optim: OptimConfig = OptimConfig()
  report: Optional[Mapping] = None
  _cache: Dict[Any, Any] = dataclasses.field(default_factory=dict, repr=False)

  def batch(self, i: int = 0):
    """Training batch `i` after the checkpoint (its data position)."""
    if "step" not in self._cache:
      self._cache["step"] = int(jax.device_get(self.state.step))
    return self.source.train_batch(self._cache["step"] + i, self.batch_size)

  def site_names(self) -> List[str]:
    """The model's GEMM sites in call order (one abstract trace, cached)."""
    if "sites" not in self._cache:
      from loka_jax.dispatch.check import model_sites
      products, _ = model_sites(self.build(BASELINE), None, self.batch())
      self._cache["sites"] = list(products)
    return self._cache["sites"]


# ----------------------------------------------------------------------------- plans


def fp8_sites(plan: Plan, names: Sequence[str], passes: Sequence[str] = PASSES
              ) -> Dict[str, KernelChoice]:
  """{site: choice} of the sites whose plan runs one of `passes` in FP8 (`Kernel.quantizes`:
  a fused op such as `flax_fp8_delayed_fwd` names itself in every pass but quantizes only
  its forward)."""
  out = {}
  for name in names:
    choice = plan.choice_for(name)
    if choice is not None and any(registry.get(choice.for_pass(p)).quantizes(p)
                                  for p in passes):
      out[name] = choice
  return out


def only_site(site: str, choice: KernelChoice) -> KernelPlan:
  """`site` runs `choice`; every other site xla_bf16."""
  return KernelPlan(sites=((site, choice),), rules=(), default=BASELINE.default)


def without_site(plan: Plan, site: str) -> KernelPlan:
  """The plan with `site` on xla_bf16."""
  kplan = plan.kernel_plan()
  sites = tuple((n, c) for n, c in kplan.sites if n != site) + (
      (site, KernelChoice.uniform(FALLBACK)),)
  return KernelPlan(sites=tuple(sorted(sites)), rules=kplan.rules, default=kplan.default)


def _site_criteria(plan: Plan, site: str):
  """The site's budget recorded in the plan's provenance (default Criteria without one)."""
  from loka_jax.dispatch.selection import Budget
  from loka_jax.probe.eligibility import Criteria
  budget = (plan.get("provenance") or {}).get("budget")
  if not budget:
    return Criteria()
  per_site = tuple((p["pattern"], Criteria(**p["criteria"])) for p in budget.get("per_site", []))
  return Budget(Criteria(**budget["default"]), per_site).for_site(site)


def _accuracy(verdict, metric: str) -> float:
  if metric == "mere":
    return -math.inf if verdict.mere_hi is None else -float(verdict.mere_hi)
  return -math.inf if verdict.sqnr_lo is None else float(verdict.sqnr_lo)


def _site_verdicts(report: Mapping, plan: Plan, site: str):
  """({pass: {kernel: Verdict}} of the site under its budget, with the report's timings),
  the site's effective report entry, the report's kernel metadata."""
  from loka_jax.dispatch import selection
  from loka_jax.probe import eligibility
  try:
    source = selection.resolve_timing(report)
  except ValueError:
    source = selection.TimingSource("none", {"kind": "none", "reason": "no usable timings"})
  effective, _ = selection.effective_site(report, site, source)
  info = selection.kernels_info(report)
  verdicts = eligibility.assess_site({"kernels": info, "sites": {site: effective}}, site,
                                     _site_criteria(plan, site))
  return verdicts, effective, info


def more_precise_kernel(report: Optional[Mapping], plan: Plan, site: str, pass_name: str,
                        current: str) -> Tuple[str, str]:
  """(kernel, why): the fastest candidate of the report for this pass that is eligible under
  the site's budget and more accurate than `current`; else xla_bf16."""
  if report is None or site not in report.get("sites", {}):
    return FALLBACK, "no probe report entry for the site"
  from loka_jax.dispatch import selection
  criteria = _site_criteria(plan, site)
  all_verdicts, _, info = _site_verdicts(report, plan, site)
  verdicts = all_verdicts.get(pass_name, {})
  if current not in verdicts:
    return FALLBACK, f"{current} was not evaluated by the probe for this pass"
  floor = _accuracy(verdicts[current], criteria.metric)
  better = [v for k, v in verdicts.items()
            if k not in (current, FALLBACK) and v.eligible
            and info.get(k, {}).get("sort") == PER_PASS and k in registry.names()
            and _accuracy(v, criteria.metric) > floor]
  if not better:
    return FALLBACK, "no eligible candidate more accurate than " + current
  best = sorted(better, key=lambda v: selection.rank_key(v, criteria.metric))[0]
  return best.kernel, f"fastest eligible candidate more accurate than {current}"


def more_precise_fused_op(report: Optional[Mapping], plan: Plan, site: str, current: str,
                          must_improve: Sequence[str] = PASSES) -> Tuple[str, str]:
  """(kernel, why): the fastest fused op of the report that is eligible at the site, at least
  as accurate as the fused op `current` in every pass and more accurate in one of
  `must_improve`; else xla_bf16.

  The delayed-scaling ops share one forward and quantize fewer and fewer gradients
  (`flax_fp8_delayed` -> `flax_fp8_delayed_grad_lhs` -> `flax_fp8_delayed_fwd`): a site that
  training found too rough steps down one gradient at a time and keeps its FP8 forward, while
  a forward that held-out loss found too rough (must_improve=("fwd",)) goes to bf16. A pass
  two ops compute alike (`Kernel.pass_numerics`) counts as equally accurate: the probe's
  estimates of a shared forward differ by its samples, and reading them as a difference sent
  a held-out back-off to an op with the same forward."""
  if report is None or site not in report.get("sites", {}):
    return FALLBACK, "no probe report entry for the site"
  from loka_jax.probe import eligibility
  metric = _site_criteria(plan, site).metric
  verdicts, effective, info = _site_verdicts(report, plan, site)
  if any(current not in verdicts.get(p, {}) for p in PASSES):
    return FALLBACK, f"{current} was not evaluated by the probe in every pass"
  floor = {p: _accuracy(verdicts[p][current], metric) for p in PASSES}

  def accuracy(k: str, p: str) -> float:
    # A pass computed as `current` computes it is as accurate, whatever the probe's samples
    # estimated for each (`Kernel.pass_numerics`).
    same = registry.get(k).pass_numerics(p) == registry.get(current).pass_numerics(p)
    return floor[p] if same else _accuracy(verdicts[p][k], metric)

  better = {}
  for k, meta in info.items():
    if k == current or meta.get("sort") != FUSED_OP or k not in registry.names():
      continue
    v = {p: verdicts.get(p, {}).get(k) for p in PASSES}
    if any(x is None or not x.eligible for x in v.values()):
      continue
    if (all(accuracy(k, p) >= floor[p] for p in PASSES)
        and any(accuracy(k, p) > floor[p] for p in must_improve)):
      better[k] = eligibility.fused_site_speedup(effective.get("passes", {}), k) or 0.0
  if not better:
    return FALLBACK, (f"no eligible fused op as accurate as {current} in every pass and more "
                      f"accurate in {'/'.join(must_improve)}")
  best = max(sorted(better), key=lambda k: better[k])
  improved = [p for p in must_improve if accuracy(best, p) > floor[p]]
  return best, (f"{best}: as accurate as {current} in every pass, more in "
                f"{'/'.join(improved)}, site {better[best]:.2f}x over bf16")


def back_off_site(plan: Plan, ctx: ValidationContext, site: str, reason: str, step: str, *,
                  to_fallback: bool = False, must_improve: Sequence[str] = PASSES) -> Plan:
  """Every FP8 pass of `site` moved to a more precise kernel (or straight to xla_bf16 with
  `to_fallback`). A fused op moves to a more precise fused op (`more_precise_fused_op`, which
  must improve one of `must_improve`) or to xla_bf16."""
  choice = plan.choice_for(site)
  kernels = {p: choice.for_pass(p) for p in PASSES}
  if to_fallback:
    return back_off(plan, site, None, reason, to=FALLBACK, step=step)
  fused = sorted({k for k in kernels.values() if registry.get(k).sort == FUSED_OP})
  if fused:
    target, why = more_precise_fused_op(ctx.report, plan, site, fused[0], must_improve)
    return back_off(plan, site, None, f"{reason}; {why}", to=target, step=step)
  for p, current in kernels.items():
    if not registry.get(current).fp8:
      continue
    target, why = more_precise_kernel(ctx.report, plan, site, p, current)
    plan = back_off(plan, site, p, f"{reason}; {why}", to=target, step=step)
  return plan


class ValidationPaused(RuntimeError):
  """The deadline came before validation finished; the plan so far was saved (`Progress.save`)
  and calling again with it resumes where this call stopped."""


@dataclasses.dataclass
class Progress:
  """Where a long validation saves its plan and when it must stop.

  `save(plan)` is called at the start of every back-off round, before every site measured
  within a round, and after every check, so an interrupted validation loses at most the
  measurement it was in. Once `deadline` (a time.time() value) has passed no new round starts,
  and no measurement starts that would not end by it at the pace of the slowest one
  measured of its kind (a `take_in_turn` record step: site measurements pace site
  measurements, training runs training runs), in this call or recorded in the plan by an
  earlier one (a process killed by a hard time limit mid-measurement loses it): the plan is
  saved and ValidationPaused raised. A Wukong `large` shadow run took 231 s, a held-out
  site measurement 1.5 s in one program: with one pace for both, a call stopped before its
  first gradient measurement with about 190 s left (docs/BENCHMARKS.md section 7,
  thirty-ninth session).
  A measurement whose compiled program already ran in this call (`take_in_turn`'s
  `program_of`) is paced by the slowest such warm one of its kind, once one was taken: a
  Wukong `large` gradient site took 111 s with its compile and 33-37 s after it, and a call
  paced by the 111 s stopped with about 120 s, three such sites, left (fortieth session).
  Before a warm one was taken, it is paced by its own program's first run in this call
  (a rerun does not compile again): a Wukong `large` shadow run paced by another program's
  268 s stopped a call with 260 s left, after its own first run took 162 s and before a
  rerun that took 61 s (forty-first session).
  `log`, where given, receives a line per record as it is made (a round's verdict, a
  back-off, each site measurement and training run), so a long validation shows where it is.
  """
  save: Optional[Callable[[Plan], None]] = None
  deadline: Optional[float] = None
  longest_s: Dict[str, float] = dataclasses.field(default_factory=dict)  # kind -> seconds
  log: Optional[Callable[[str], None]] = None
  # kind -> seconds of its slowest measurement that reran a program compiled in this call
  longest_warm_s: Dict[str, float] = dataclasses.field(default_factory=dict)
  # (kind, program) -> seconds of its first measurement in this call (which compiled it)
  first_s: Dict[Tuple[str, Hashable], float] = dataclasses.field(default_factory=dict)

  def note(self, plan: Plan, since: int) -> Plan:
    """Logs the plan's validation records from index `since` on; returns the plan."""
    self.note_records(plan["validation"][since:])
    return plan

  def note_records(self, records: Sequence[Mapping[str, Any]]) -> None:
    if self.log is not None:
      from loka_jax.train.report import validation_line
      for record in records:
        line = validation_line(record, measurements=True)
        if line is not None:
          self.log(line.strip().lstrip("- "))

  def checkpoint(self, plan: Plan, where: str, *, measurement: Optional[str] = None,
                 program: Optional[Hashable] = None) -> None:
    """Saves `plan`; pauses when the deadline has passed or, before a `measurement` (its
    kind; `program`: the compiled program it runs, None where its own), when it would pass
    within `pace(measurement, program)`."""
    if self.save is not None:
      self.save(plan)
    ahead_s = self.pace(measurement, program) if measurement else 0.0
    if self.deadline is not None and time.time() + ahead_s > self.deadline:
      raise ValidationPaused(f"validation paused before {where}: the deadline has passed"
                             + (f" or comes within the {ahead_s:.0f} s the slowest such "
                                "measurement took" if ahead_s else "")
                             + "; the plan so far is saved, call again to resume")

  def pace(self, kind: str, program: Optional[Hashable] = None) -> float:
    """Seconds the next measurement of `kind` is expected to take at most: where its
    `program` already ran in this call, the smaller of that program's first run here and
    the slowest warm one of its kind (once one was taken); else the slowest of its kind
    known (0 where none is)."""
    if program is not None and (kind, program) in self.first_s:
      return min(self.first_s[kind, program], self.longest_warm_s.get(kind, math.inf))
    return self.longest_s.get(kind, 0.0)

  def measured(self, kind: str, seconds: float, program: Optional[Hashable] = None) -> None:
    """One measurement of `kind` taken, in `seconds` (`program`: as `checkpoint`'s)."""
    self.longest_s[kind] = max(self.longest_s.get(kind, 0.0), seconds)
    if program is not None:
      if (kind, program) in self.first_s:
        self.longest_warm_s[kind] = max(self.longest_warm_s.get(kind, 0.0), seconds)
      else:
        self.first_s[kind, program] = seconds


REOPENED = "reopened"


def is_back_off(record: Mapping[str, Any]) -> bool:
  """Whether a validation record is a back-off (`plan.back_off`: one site, from, to)."""
  return "site" in record and "to" in record


def _live_records(plan: Plan, step: str) -> List[Dict[str, Any]]:
  """The plan's `step` records since the check was last reopened (`reopen_check`): the
  ones its verdict and round numbering go by. Earlier ones stay in the plan as history."""
  records = plan["validation"]
  last = max((i for i, r in enumerate(records)
              if r.get("step") == step and r.get(REOPENED)), default=-1)
  return [r for r in records[last + 1:] if r.get("step") == step]


def finished(plan, step: str) -> bool:
  """Whether the plan records a finished `step` check (its `final` record)."""
  return any(r.get("final") for r in _live_records(as_plan(plan), step))


def _rounds_done(plan: Plan, step: str) -> int:
  """Rounds of `step` recorded before a resumed call (numbering goes on from there)."""
  return sum(1 for r in _live_records(plan, step) if "round" in r)


def _record_steps(check: str) -> Tuple[str, ...]:
  """The record steps a check writes: its verdicts and back-offs, its site measurements, its
  training runs and, for the speed check, its timed steps."""
  return (check, site_step(check), run_step(check)) + ((SPEED_STEPS,) if check == "speed"
                                                          else ())


def _reopen_one(plan: Plan, step: str, reason: str) -> Plan:
  """`plan` with the `step` check's back-offs since it was last opened undone, newest first,
  and its `reopened` record."""
  live = _live_records(plan, step)
  data = plan.to_dict()
  restored = []
  for r in reversed([r for r in live if is_back_off(r)]):
    entry = data["sites"][r["site"]]
    for pass_name, kernel in r["from"].items():
      entry[pass_name] = {"kernel": kernel,
                          "reason": f"restored: the {step} check was reopened ({reason})"}
    restored.append({"site": r["site"], "passes": sorted(r["from"]), "to": r["from"]})
  return add_validation(Plan(data), {"step": step, REOPENED: True, "reason": reason,
                                     "rounds_before": sum(1 for r in live if "round" in r),
                                     "restored": restored})


def reopen_check(plan, step: str, reason: str, later: bool = False) -> Plan:
  """The plan with the `step` check started over: every site it backed off (its back-off
  records since it was last reopened, undone newest first) runs its earlier kernels again,
  and a `reopened` record says why and what was undone. For a check whose rule changed
  after it backed sites off under the old one (the shadow check's noise floor,
  `shadow_noise_floor`; the held-out check's report ranking where one program measures).
  Nothing is deleted: the old rounds, back-offs and every measurement stay recorded, and a
  run or site measurement whose plan and recipe come back is taken from its record instead
  of measured again. A later check judged the plan as this one left it, so one with records
  since it was last opened refuses, unless `later`: then each such check is reopened too,
  the newest first, so every back-off is undone in the reverse of the order it was made.
  Never after the validation's final verdict."""
  plan = as_plan(plan)
  steps = [name for name, _ in CHECKS]
  if step not in steps:
    raise ValueError(f"reopen_check: unknown check {step!r}; checks are {steps}")
  if not reason:
    raise ValueError("reopen_check: give the reason the check starts over")
  if any(r.get("step") == "validated" for r in plan["validation"]):
    raise ValueError("reopen_check: the plan is validated; validate the selected plan again "
                     "instead")
  if not _live_records(plan, step):
    raise ValueError(f"reopen_check: the plan has no {step} records since it was last opened")
  # A later check's measurements count too: it may have timed or trained before its
  # first verdict (`speed_steps` before speed round 0's record).
  after = [check for check in steps[steps.index(step) + 1:]
           if any(r.get("step") in _record_steps(check) for r in plan["validation"])]
  open_after = [check for check in after if _live_records(plan, check)]
  if after and not later:
    raise ValueError(f"reopen_check: {', '.join(after)} already judged the plan the {step} "
                     "check left; only the last check with records can be reopened, or "
                     "reopen the later ones too (later=True)")
  for check in reversed(open_after):
    plan = _reopen_one(plan, check, f"{reason} (reopened with the {step} check)")
  return _reopen_one(plan, step, reason)


def site_step(step: str) -> str:
  """The record name of one site's measurement within a round of `step`."""
  return f"{step}_site"


def matching_records(plan: Plan, record_step: str,
                     fields: Optional[Mapping[str, Any]] = None) -> List[Dict[str, Any]]:
  """The plan's `record_step` records whose fields match `fields` (field: value; None:
  any), in order: a measurement recorded under what it measured."""
  return [r for r in plan["validation"]
          if r.get("step") == record_step
          and all(r.get(k) == v for k, v in (fields or {}).items())]


def site_records(plan: Plan, step: str, scope: Optional[Mapping[str, Any]] = None
                 ) -> List[Dict[str, Any]]:
  """The site measurement records of `step` whose fields match `scope`, in order."""
  return matching_records(plan, site_step(step), scope)


def saved_site_measurements(plan: Plan, step: str, scope: Optional[Mapping[str, Any]] = None
                            ) -> Dict[Tuple[str, KernelChoice], float]:
  """{(site, choice): value} of every site measurement recorded for `step` (a non-finite
  value is stored as null) whose record matches `scope` (`site_records`). A quality
  measurement is of the site alone against bf16+Mods on the validation's state, so it holds
  in every later round and call while the site keeps that choice; the speed check's
  in-context slowdowns hold only within their round (`measure_sites`' scope)."""
  return {(r["site"], KernelChoice.from_dict(r["choice"])):
          math.inf if r["value"] is None else float(r["value"])
          for r in site_records(plan, step, scope)}


def take_in_turn(plan: Plan, progress: Progress, record_step: str,
                 pending: Sequence[Tuple[str, Dict[str, Any], Callable[[], Dict[str, Any]]]],
                 program_of: Optional[Callable[[Dict[str, Any]], Hashable]] = None) -> Plan:
  """Takes each pending measurement (where, its identifying fields, a call returning its
  result fields) in turn and records it at once as a `record_step` record with the
  `seconds` it took, saving the plan before the next, so a call that stops midway keeps
  what it measured. None starts that would not end by the deadline at the pace of the
  slowest `record_step` record, from this call or an earlier one, or where `program_of`
  (fields -> the compiled program the measurement runs; None: its own) says its program
  already ran in this call, of the slowest warm one (`Progress.pace`)."""
  earlier = [r["seconds"] for r in plan["validation"]
             if r.get("step") == record_step and r.get("seconds") is not None]
  if earlier:
    progress.measured(record_step, max(earlier))
  for where, fields, measure in pending:
    program = program_of(fields) if program_of is not None else None
    progress.checkpoint(plan, where, measurement=record_step, program=program)
    start = time.time()
    result = measure()
    seconds = time.time() - start
    progress.measured(record_step, seconds, program)
    plan = progress.note(add_validation(plan, {"step": record_step, **fields, **result,
                                               "seconds": round(seconds, 2)}), -1)
  return plan


def measure_sites(plan: Plan, step: str, round_: int, candidates: Mapping[str, KernelChoice],
                  measure: Callable[[str, KernelChoice], Any], progress: Progress,
                  scope: Optional[Mapping[str, Any]] = None, one_program: bool = False
                  ) -> Tuple[Plan, Dict[str, float]]:
  """(plan, {site: value}) for every candidate: as the plan records it (this round, an earlier
  one or an earlier call: `saved_site_measurements`) or taken now by `measure(site, choice)`
  (`take_in_turn`: recorded at once, so a call that stops mid-round keeps what it measured;
  even a call's first site waits for the pace of the slowest recorded). `measure` returns
  the value, or (value, extras) to record the extras beside it. `scope` (field: value) is
  recorded with each new measurement, and only measurements recorded with it are reused: a
  value that holds only where it was taken (the speed check's, in one round for its failing
  steps) is not carried past it. `one_program`: every site is measured through one compiled
  program (a switch board), so after the first the rest are paced as warm."""
  def result(site: str, choice: KernelChoice) -> Dict[str, Any]:
    got = measure(site, choice)
    value, extras = (float(got[0]), dict(got[1])) if isinstance(got, tuple) else (float(got), {})
    return {"value": value if math.isfinite(value) else None, **extras}

  saved = saved_site_measurements(plan, step, scope)
  pending = [(f"{step} round {round_}, site {site}",
              {"round": round_, **(scope or {}), "site": site, "choice": choice.to_dict()},
              functools.partial(result, site, choice))
             for site, choice in sorted(candidates.items()) if (site, choice) not in saved]
  plan = take_in_turn(plan, progress, site_step(step), pending,
                      (lambda fields: (step, round_)) if one_program else None)
  measured = saved_site_measurements(plan, step, scope)
  return plan, {s: measured[(s, c)] for s, c in candidates.items()}


def _final(plan: Plan, record: Dict[str, Any]) -> Plan:
  return add_validation(plan, {**record, "final": True})


def _ranked_by_report(ctx: "ValidationContext", config: ValidationConfig,
                      candidates: Mapping[str, KernelChoice], one_program: bool) -> bool:
  """Whether this round ranks its back-off candidates from the probe report. Never when the
  round measures its sites in one compiled program (`one_program`): the cap is there for a
  whole-model compile per site, and the report's ranking can miss the site that moves the
  loss (Wukong large, H200: three held-out rounds ranked by forward error backed off 18 MLP
  sites while `head/dense_0` alone carried +0.053% of the +0.054%, docs/BENCHMARKS.md
  section 7, forty-second session)."""
  return (not one_program and config.max_measured_sites is not None
          and ctx.report is not None and len(candidates) > config.max_measured_sites)


def report_scores(report: Mapping, plan: Plan, candidates: Mapping[str, KernelChoice],
                  what: str, passes: Sequence[str] = PASSES) -> Dict[str, float]:
  """{site: score} from the probe report alone, higher = back off sooner.

  what='error': minus the lowest accuracy (pessimistic SQNR in dB, or minus MERE under
  `--metric=mere`) over the site's FP8 `passes`; -inf for a site with none of them on FP8
  (it cannot move that check). what='time': the site's GEMM time with its plan minus with
  xla_bf16, summed over `passes` (microseconds; 0 where the report has no timing), so the
  site that saves least goes first.
  """
  from loka_jax.dispatch import selection
  from loka_jax.probe import eligibility
  if what not in ("error", "time"):
    raise ValueError(f"report_scores: what must be 'error' or 'time', got {what!r}")
  try:
    source = selection.resolve_timing(report)
  except ValueError:
    source = selection.TimingSource("none", {"kind": "none", "reason": "no usable timings"})
  info = selection.kernels_info(report)
  scores = {}
  for site, choice in candidates.items():
    if site not in report.get("sites", {}):
      scores[site] = -math.inf
      continue
    effective, _ = selection.effective_site(report, site, source)
    if what == "time":
      total = 0.0
      for p in passes:
        entries = effective["passes"].get(p, {})
        b = entries.get(FALLBACK, {}).get("time_us")
        k = entries.get(choice.for_pass(p), {}).get("time_us")
        if b and k:
          total += float(k[1]) - float(b[1])
      scores[site] = total
      continue
    criteria = _site_criteria(plan, site)
    verdicts = eligibility.assess_site({"kernels": info, "sites": {site: effective}}, site,
                                       criteria)
    accuracies = [_accuracy(verdicts[p][choice.for_pass(p)], criteria.metric)
                  for p in passes
                  if registry.get(choice.for_pass(p)).quantizes(p)
                  and choice.for_pass(p) in verdicts.get(p, {})]
    scores[site] = -min(accuracies) if accuracies else -math.inf
  return scores


def worst_by_report(scores: Mapping[str, float]) -> List[str]:
  """The quarter of the sites (at least one) with the highest scores: ranking from the report
  is cheap but coarse, so a round backs off several sites rather than compile once per site.
  Sites scored -inf (nothing on FP8 that this check sees) come last, and only when no other
  site is left."""
  movable = {s: v for s, v in scores.items() if v != -math.inf} or dict(scores)
  count = max(1, math.ceil(len(movable) / 4))
  return sorted(movable, key=lambda s: (movable[s], s), reverse=True)[:count]


# ----------------------------------------------------------------------------- running


def _fresh_copy(tree):
  """Device copies, so a donating train step never consumes the original (small trees:
  fp8_meta)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _host_copy(x):
  """A copy of `x` in host memory that shares no buffer with it (so donating `x` leaves it
  intact) and leaves no cached host copy on `x` (as np.asarray would, for its lifetime)."""
  try:
    return jax.device_put(x, jax.devices("cpu")[0], may_alias=False)
  except RuntimeError:  # no CPU backend in this process
    return np.array(jax.device_get(x), copy=True)


@contextlib.contextmanager
def working_state(ctx: ValidationContext):
  """The context's own device state, for a run that donates (consumes) it; afterwards, also
  after an error, the context's state is put back on the device from a host backup (taken
  once). One copy of the state on the device instead of two: Wukong large's 36 GB of
  parameters and Adam state do not fit an 80 GB card twice beside a training step."""
  if "host_state" not in ctx._cache:
    ctx._cache["host_state"] = (jax.tree.map(_host_copy, ctx.state),
                                jax.tree.map(lambda x: x.sharding, ctx.state))
  state, ctx.state = ctx.state, None
  try:
    yield state
  finally:
    del state
    backup, shardings = ctx._cache["host_state"]
    ctx.state = jax.tree.map(lambda h, sh: jax.device_put(h, sh, may_alias=False), backup,
                             shardings)


def _loss(model, params, fp8_meta, batch):
  return loss_fn(model, params, fp8_meta, batch, jax.random.PRNGKey(0))[0]


def state_for(ctx: ValidationContext, kplan: KernelPlan):
  """(model, state): the context's trained parameters under `kplan`; a plan with delayed
  scaling gets its fp8_meta state created and calibrated on DELAYED_WARMUP batches. Only
  the model and the fp8_meta are cached: the state is the context's current one."""
  model, meta = model_and_meta(ctx, kplan)
  return model, ctx.state.replace(fp8_meta=meta)


def model_and_meta(ctx: ValidationContext, kplan: KernelPlan):
  """(model, fp8_meta) of `kplan` (cached; the first call reads the context's state)."""
  key = ("meta", kplan)
  if key not in ctx._cache:
    ctx._cache[key] = _make_model_and_meta(ctx, kplan)
  return ctx._cache[key]


def _init_rngs():
  return {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}


def _planned_shapes(ctx: ValidationContext, model):
  """`model`'s variables as shapes; a ValueError when its parameters are not the
  checkpoint's (a plan may change kernels only)."""
  shapes = jax.eval_shape(lambda b: model.init(_init_rngs(), b, train=False), ctx.batch())
  have = jax.tree.map(lambda x: (x.shape, x.dtype), ctx.state.params)
  if jax.tree.map(lambda x: (x.shape, x.dtype), shapes["params"]) != have:
    raise ValueError("the planned model's parameters differ from the checkpoint's; a plan "
                     "may change kernels only (check the plan's fused-op sites)")
  return shapes


def _meta_init(model) -> Callable:
  """One example -> `model`'s initial delayed-scaling state (jitted)."""
  return jax.jit(lambda b: model.init(_init_rngs(), b, train=False)[FP8_META])


def _calibrated(ctx: ValidationContext, init_meta: Callable, grad: Callable):
  """Delayed-scaling state as validation judges a plan with it: `init_meta`'s, then
  DELAYED_WARMUP updates by `grad(meta, batch)` on the context's first training batches."""
  meta = init_meta(one_example(ctx.batch()))
  for i in range(DELAYED_WARMUP):
    meta = merge_fp8_meta(grad(meta, ctx.batch(i)))
  return meta


def _make_model_and_meta(ctx: ValidationContext, kplan: KernelPlan):
  model = ctx.build(kplan)
  if FP8_META not in _planned_shapes(ctx, model):
    return model, {}
  grad = jax.jit(jax.grad(lambda m, p, b: _loss(model, p, m, b)))
  return model, _calibrated(ctx, _meta_init(model),
                            lambda m, b: grad(m, ctx.state.params, b))


def held_out(ctx: ValidationContext, kplan: KernelPlan, eval_batch_size: Optional[int] = None,
             state=None) -> Dict[str, Any]:
  """Held-out logloss / NE / AUC of the context's parameters (or `state`) under `kplan`, with
  every example's logit and label (`evaluate`'s scores) for paired comparisons."""
  key = ("held_out", kplan, eval_batch_size) if state is None else None
  if key is not None and key in ctx._cache:
    return ctx._cache[key]
  model, own = state_for(ctx, kplan) if state is None else (model_and_meta(ctx, kplan)[0], state)
  _, eval_step = compiled_steps(model, ctx.optim, "stop")
  size = min(eval_batch_size or ctx.batch_size, ctx.source.num_eval_examples())
  result = evaluate(eval_step, own, ctx.source, size, keep_scores=True)
  if key is not None:
    ctx._cache[key] = result
  return result


def _rel(value: float, base: float) -> float:
  return (value - base) / base if base else math.inf


def held_out_change(ctx: ValidationContext, kplan: KernelPlan,
                    eval_batch_size: Optional[int] = None) -> float:
  """Relative held-out log-loss change of `kplan` against bf16+Mods on the context's
  parameters: the numerics of the plan's forwards alone move it."""
  return held_out_change_se(ctx, kplan, eval_batch_size)[0]


def held_out_change_se(ctx: ValidationContext, kplan: KernelPlan,
                       eval_batch_size: Optional[int] = None) -> Tuple[float, float]:
  """(`held_out_change`, its standard error over the eval examples): a change within about
  two standard errors of 0 is one this eval set cannot tell from none."""
  base = held_out(ctx, BASELINE, eval_batch_size)
  got = held_out(ctx, kplan, eval_batch_size)
  return paired_logloss_change(got["logits"], base["logits"], base["labels"])


def switched_plan(candidates: Mapping[str, KernelChoice]) -> KernelPlan:
  """Every candidate site on its choice behind a switch (`KernelPlan.switched`), every other
  site xla_bf16: with its switches set, the model is `only_site` of one candidate, or the
  plan of any subset of them."""
  return KernelPlan(sites=tuple(sorted(candidates.items())), rules=(),
                    default=BASELINE.default, switched=tuple(sorted(candidates)))


@dataclasses.dataclass
class SwitchBoard:
  """One compiled held-out evaluation (and, for delayed-scaling candidates, one compiled
  calibration gradient) of `switched_plan(candidates)`, for any subset of the candidates."""
  candidates: Dict[str, KernelChoice]
  apply: Callable          # (params, fp8_meta, switches, batch) -> float32 logits
  grad: Optional[Callable]  # (fp8_meta, params, switches, batch) -> fp8_meta "gradients"
  init_meta: Optional[Callable]  # one example -> the initial fp8_meta
  switch_paths: Dict[str, Tuple[str, ...]]  # site -> its flag's path in the collection
  # (params, fp8_meta, switches, batch) -> the parameter gradient of the training loss;
  # jitted, so it compiles only when a training check first ranks sites with it
  param_grad: Callable

  def covers(self, wanted: Mapping[str, KernelChoice]) -> bool:
    return all(self.candidates.get(site) == choice for site, choice in wanted.items())

  def switches(self, on) -> Dict:
    """The `site_switch` collection with exactly the sites of `on` switched on."""
    from flax import traverse_util
    return traverse_util.unflatten_dict(
        {path: jnp.asarray(site in on) for site, path in self.switch_paths.items()})


def switch_board(ctx: ValidationContext, wanted: Mapping[str, KernelChoice]) -> SwitchBoard:
  """A board whose candidates hold every (site, choice) of `wanted`: one already built for
  this context when one does (a round's sites, then the rounds after it whose sites kept
  their choices), else a new one of `wanted` (cached)."""
  boards = ctx._cache.setdefault("switch_boards", [])
  for board in boards:
    if board.covers(wanted):
      return board
  from flax import traverse_util
  from loka_jax.models.site import SITE_SWITCH
  candidates = dict(sorted(wanted.items()))
  model = ctx.build(switched_plan(candidates))
  shapes = _planned_shapes(ctx, model)
  paths = {"/".join(path[:-1]): path
           for path in traverse_util.flatten_dict(shapes.get(SITE_SWITCH, {}))}
  missing = sorted(set(candidates) - set(paths))
  if missing:
    raise ValueError(f"sites without a switch in the built model: {missing}")

  def variables(params, meta, switches):
    return {"params": params, SITE_SWITCH: switches, **({FP8_META: meta} if meta else {})}

  apply = jax.jit(lambda params, meta, switches, b: model.apply(
      variables(params, meta, switches), b, train=False).astype(jnp.float32))

  def loss(params, meta, switches, b):
    return loss_fn(model, params, meta, b, jax.random.PRNGKey(0), {SITE_SWITCH: switches})[0]

  grad = init_meta = None
  if FP8_META in shapes:
    init_meta = _meta_init(model)
    grad = jax.jit(jax.grad(lambda meta, params, switches, b: loss(params, meta, switches, b)))
  board = SwitchBoard(candidates, apply, grad, init_meta, paths, jax.jit(jax.grad(loss)))
  boards.append(board)
  return board


def held_out_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice], on,
                      eval_batch_size: Optional[int] = None) -> Dict[str, Any]:
  """`held_out` of the plan that runs the sites of `on` on their choices in `wanted` and
  every other site xla_bf16, through a switch board: no compilation once the board covering
  `wanted` exists. Delayed-scaling state is calibrated for this subset, as `state_for`
  calibrates a plan's (DELAYED_WARMUP batches)."""
  board = switch_board(ctx, wanted)
  switches = board.switches(set(on))
  meta = _switched_meta(ctx, board, switches)
  step = lambda state, batch: board.apply(state.params, meta, switches, batch)
  size = min(eval_batch_size or ctx.batch_size, ctx.source.num_eval_examples())
  return evaluate(step, ctx.state, ctx.source, size, keep_scores=True)


def _switched_meta(ctx: ValidationContext, board: SwitchBoard, switches) -> Dict:
  """The board's delayed-scaling state calibrated for the subset `switches` turns on, as
  `state_for` calibrates a plan's ({} where no candidate keeps such state)."""
  if board.init_meta is None:
    return {}
  return _calibrated(ctx, board.init_meta,
                     lambda m, b: board.grad(m, ctx.state.params, switches, b))


def held_out_change_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice],
                             site: str, eval_batch_size: Optional[int] = None) -> float:
  """`held_out_change` of `site` alone on its choice in `wanted`, measured on a switch board
  against the same board with every switch off (the bf16+Mods forward in the same program,
  so the two differ by the site's product alone)."""
  board = switch_board(ctx, wanted)
  key = ("switched_base", id(board), eval_batch_size)
  if key not in ctx._cache:
    ctx._cache[key] = held_out_switched(ctx, wanted, (), eval_batch_size)
  base = ctx._cache[key]
  got = held_out_switched(ctx, wanted, (site,), eval_batch_size)
  return paired_logloss_change(got["logits"], base["logits"], base["labels"])[0]


def _gradient(ctx: ValidationContext, kplan: KernelPlan, batches: int):
  """The parameter gradient under `kplan`, summed over the context's first `batches`
  training batches (`_summed_gradient`)."""
  model, state = state_for(ctx, kplan)
  grad = jax.jit(jax.grad(lambda p, m, b: _loss(model, p, m, b)))
  return _summed_gradient(lambda b: grad(state.params, state.fp8_meta, b), ctx, batches)


def _summed_gradient(grad_of: Callable, ctx: ValidationContext, batches: int):
  """`grad_of(batch)` summed over the context's first `batches` training batches: a tree of
  float32 leaves, left on the device. A float64 host copy of every parameter made each of
  Wukong `large`'s site measurements take 35 s and its host 125 GiB at peak
  (docs/BENCHMARKS.md section 7, fortieth session); `gradient_distance` reads two on the
  device. The running sum is added to in place (donated), so summing holds two gradients on
  the device, not three (12 GB each at Wukong `large`, beside its 36.6 GB state and the
  bf16 reference gradient)."""
  total = None
  for i in range(batches):
    g = jax.tree.map(lambda x: x.astype(jnp.float32), grad_of(ctx.batch(i)))
    total = g if total is None else _add_into(total, g)
  return total


_add_into = jax.jit(lambda total, g: jax.tree.map(jnp.add, total, g), donate_argnums=0)


def _scaled_norm(x: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """(max |x|, ||x / max |x|||): x's 2-norm is their product. Scaling first keeps the
  float32 sum of squares from underflowing (a gradient leaf near 1e-20) or overflowing."""
  top = jnp.max(jnp.abs(x))
  return top, jnp.sqrt(jnp.sum(jnp.square(x / jnp.where(top > 0, top, 1.0))))


@jax.jit
def _distance_parts(g, ref):
  """Each leaf's scaled norm of g - ref and of ref, and whether every entry of g is finite:
  one program, so the difference is never stored."""
  diffs = [_scaled_norm(a - b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref))]
  refs = [_scaled_norm(b) for b in jax.tree.leaves(ref)]
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(g)]))
  return diffs, refs, finite


def _norm_of(parts) -> float:
  """The 2-norm of a tree from its leaves' scaled norms, combined in float64."""
  return math.sqrt(sum((float(top) * float(rest)) ** 2 for top, rest in parts))


def gradient_distance(g, ref, largest_leaves: int = 0):
  """||g - ref|| / ||ref|| over two gradient trees of the same structure (a zero `ref`
  counts as norm 1); inf where g is not finite.

  With `largest_leaves` = k > 0: (that value, {"largest_leaf_changes": the k leaves whose
  own relative change ||g_l - ref_l|| / ||ref_l|| is largest, as [path, change] pairs}). The
  whole gradient's change is dominated by its largest leaves, so a site that moves a small
  leaf completely (an embedding table's rows, a norm's scale) can read small there: at
  Wukong `large` the shadow check's ranking did not find what stopped training
  (docs/BENCHMARKS.md section 7, forty-third session), and this is what each site's record
  now shows beside it. A leaf whose reference is zero reads its change's norm itself."""
  if jax.tree.structure(g) != jax.tree.structure(ref):
    raise ValueError("gradient_distance: the two gradients' parameter trees differ: "
                     f"{jax.tree.structure(g)} vs {jax.tree.structure(ref)}")
  diffs, refs, finite = jax.device_get(_distance_parts(g, ref))
  value = _norm_of(diffs) / (_norm_of(refs) or 1.0) if finite else math.inf
  if largest_leaves <= 0:
    return value
  leaves = []
  if finite:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
    for path, d, r in zip(paths, diffs, refs):
      leaves.append((path, _norm_of([d]) / (_norm_of([r]) or 1.0)))
    leaves.sort(key=lambda pc: (-pc[1], pc[0]))
  return value, {"largest_leaf_changes": [[p, c] for p, c in leaves[:largest_leaves]]}


def gradient_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice], on,
                      batches: int):
  """`_gradient` of the plan that runs the sites of `on` on their choices in `wanted` and
  every other site xla_bf16, through a switch board: one compiled gradient serves every
  subset. A switched-off site's FP8 product still runs; the pick sends it a zero cotangent,
  so its backward adds nothing."""
  board = switch_board(ctx, wanted)
  switches = board.switches(set(on))
  meta = _switched_meta(ctx, board, switches)
  return _summed_gradient(lambda b: board.param_grad(ctx.state.params, meta, switches, b),
                          ctx, batches)


def gradient_change(ctx: ValidationContext, site: str, choice: KernelChoice, batches: int,
                    wanted: Optional[Mapping[str, KernelChoice]] = None,
                    reference: Optional[Dict] = None, largest_leaves: int = 0):
  """How far `site` alone on `choice` moves the parameter gradient on the context's state:
  ||g(site) - g(bf16)|| / ||g(bf16)||, summed over `batches` training batches (inf where the
  gradient is not finite). With `wanted` (the round's candidates) both gradients come from
  one switch board, its bf16 one with every switch off; else each from its own program.
  `reference`: where the bf16 gradient is kept between calls (the caller's, so it lives no
  longer than the caller needs it: a float32 copy of every parameter on the device, 12 GB
  at Wukong `large`); None computes it each call. `largest_leaves`: as in
  `gradient_distance` (then a (value, extras) pair)."""
  reference = {} if reference is None else reference
  if wanted is None:
    key = ("gradient", BASELINE, batches)
    base = lambda: _gradient(ctx, BASELINE, batches)
    got = lambda: _gradient(ctx, only_site(site, choice), batches)
  else:
    key = ("gradient", id(switch_board(ctx, wanted)), batches)
    base = lambda: gradient_switched(ctx, wanted, (), batches)
    got = lambda: gradient_switched(ctx, wanted, (site,), batches)
  if key not in reference:
    reference[key] = base()
  return gradient_distance(got(), reference[key], largest_leaves)


# ----------------------------------------------------------------------------- quality


def check_held_out(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                   progress: Optional[Progress] = None) -> Plan:
  """Backs off the site with the largest held-out contribution until the planned model's
  relative log-loss change is within `max_rel_logloss`."""
  plan = as_plan(plan)
  progress = progress or Progress()
  size = config.eval_batch_size
  base = held_out(ctx, BASELINE, size)
  first = _rounds_done(plan, "quality_held_out")
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"held-out round {round_}")
    got = held_out(ctx, plan.kernel_plan(), size)   # cached: the change below reads it too
    rel, se = held_out_change_se(ctx, plan.kernel_plan(), size)
    passed = abs(rel) <= config.max_rel_logloss
    candidates = fp8_sites(plan, ctx.site_names())
    record = {"step": "quality_held_out", "round": round_, "logloss": got["logloss"],
              "logloss_bf16": base["logloss"], "ne": got["ne"], "ne_bf16": base["ne"],
              "auc": got["auc"], "auc_bf16": base["auc"], "rel_logloss_change": rel,
              "rel_logloss_change_se": se, "budget": config.max_rel_logloss, "passed": passed,
              "num_eval_examples": got["num_examples"]}
    if passed or not candidates or round_ == config.max_rounds:
      if not passed:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    excess = (f"held-out log loss {100 * rel:+.4f}% vs bf16+Mods exceeds "
              f"{100 * config.max_rel_logloss:g}%")
    if _ranked_by_report(ctx, config, candidates, config.held_out_one_program):
      # Only the forward pass moves a held-out evaluation.
      scores = report_scores(ctx.report, plan, candidates, "error", passes=("fwd",))
      worst = worst_by_report(scores)
      record["report_scores"] = scores
      reasons = {s: f"{excess}; ranked by the probe report's forward error" for s in worst}
    else:
      if config.held_out_one_program:
        measure = lambda site, choice: held_out_change_switched(ctx, candidates, site, size)
      else:
        measure = lambda site, choice: held_out_change(ctx, only_site(site, choice), size)
      plan, current = measure_sites(plan, "quality_held_out", round_, candidates, measure,
                                    progress, one_program=config.held_out_one_program)
      record["contributions"] = current
      # The site that pushes hardest in the direction of the excess: one that moves the loss
      # the other way is offsetting, and backing it off would widen the gap.
      sign = 1.0 if rel > 0 else -1.0
      site = max(current, key=lambda s: (sign * current[s], s))
      worst = [site]
      reasons = {site: f"{excess}; this site alone: {100 * current[site]:+.4f}%"}
    since = len(plan["validation"])
    plan = add_validation(plan, record)
    for site in worst:
      # Held-out loss is the planned forward's: only a more accurate forward can help.
      plan = back_off_site(plan, ctx, site, reasons[site], step="quality_held_out",
                           must_improve=("fwd",))
    plan = progress.note(plan, since)
  return plan


CHECKPOINT, INIT = "checkpoint", "init"


@functools.partial(jax.jit, donate_argnums=0)
def _jitter(tree, key, rel):
  leaves, treedef = jax.tree.flatten(tree)
  keys = jax.random.split(key, len(leaves))
  return jax.tree.unflatten(treedef, [
      (x * (1 + rel * jax.random.normal(k, x.shape, jnp.float32))).astype(x.dtype)
      for x, k in zip(leaves, keys)])


def jittered(params, rel: float, seed: int):
  """`params` with each value times (1 + u), u ~ N(0, rel^2) drawn from `seed` (a key per
  leaf), in each leaf's dtype. The input's buffers are donated: the caller's copy is gone.
  One compiled program serves every window and jitter."""
  return _jitter(params, jax.random.PRNGKey(seed), jnp.float32(rel))


def shadow_run(ctx: ValidationContext, kplan: KernelPlan, steps: int, eval_batch_size=None,
               start: str = CHECKPOINT, seed: int = 0,
               optim: Optional[OptimConfig] = None, window: int = 0,
               jitter: float = 0.0, warmup_after_switch: int = 0) -> Dict[str, Any]:
  """`steps` training steps under `kplan`: losses, finiteness and the held-out metrics at the
  end (cached per plan). `start`: CHECKPOINT, the context's trained state and the batches
  from `window` x `steps` after it; INIT, a fresh initialization from `seed`
  (`initial_state`) and the data from its start. `optim`: the optimizer (None: the
  context's, the probe's recipe). `jitter` > 0 (from the checkpoint only): the parameters
  start `jittered` by that relative std, drawn from `seed` (the shadow check's noise floor).
  `warmup_after_switch` > 0 (from the checkpoint only): both learning rates warm up linearly
  from 0 over that many steps after the switch (`restart_schedules`; the shadow check's
  `shadow_warmup_steps`)."""
  if start not in (CHECKPOINT, INIT):
    raise ValueError(f"start={start!r}; use {CHECKPOINT!r} or {INIT!r}")
  if warmup_after_switch < 0 or (warmup_after_switch and start == INIT):
    raise ValueError(f"warmup_after_switch={warmup_after_switch}: a warm-up (>= 0) after "
                     "switching the checkpoint's state to the plan; from initialization the "
                     "optimizer's own warm-up applies")
  if window < 0 or (window and start == INIT):
    raise ValueError(f"window={window}: a data window (>= 0) is a run from the checkpoint's")
  if jitter < 0 or (jitter and start == INIT):
    raise ValueError(f"jitter={jitter}: a jitter (>= 0) perturbs the checkpoint's parameters")
  optim = optim or ctx.optim
  if warmup_after_switch:
    optim = dataclasses.replace(optim, warmup_steps=warmup_after_switch)
  key = ("shadow", kplan, steps, eval_batch_size, start, seed, optim, window, jitter,
         warmup_after_switch)
  if key in ctx._cache:
    return ctx._cache[key]
  model, meta = model_and_meta(ctx, kplan)  # also before the state leaves the device
  bf16_meta = model_and_meta(ctx, BASELINE)[1]   # for the plan's bf16+Mods reading below
  train_step, _ = compiled_steps(model, optim, "stop")
  if start == INIT:
    batch = lambda i: ctx.source.train_batch(i, ctx.batch_size)
  else:
    batch, meta = (lambda i: ctx.batch(window * steps + i)), _fresh_copy(meta)
  with working_state(ctx) as state:
    if start == INIT:
      _free(state)  # the trained state's device copy: the backup puts it back afterwards
      state = initial_state(ctx, kplan, seed, optim)
    else:
      state = state.replace(fp8_meta=meta)
      if warmup_after_switch:
        state = state.replace(opt_state=restart_schedules(state.opt_state))
      if jitter:
        state = state.replace(params=jittered(state.params, jitter, seed))
    losses, oks = [], []
    for i in range(steps):
      state, m = train_step(state, batch(i))
      losses.append(m["loss"])
      oks.append(m["ok"])
    losses = np.asarray(jax.device_get(losses), np.float64)
    finite = bool(np.all(jax.device_get(oks))) and bool(np.all(np.isfinite(losses)))
    final = held_out(ctx, kplan, eval_batch_size, state=state) if finite else None
    out = {"losses": losses, "finite": finite, "held_out": final}
    if finite and kplan != BASELINE:
      # The same trained parameters through bf16+Mods' forwards: whether the plan's held-out
      # change comes from how it trained or from its FP8 forwards at the end (Wukong
      # `large`'s round 0: held-out +1.2% with the training loss 0.07% below bf16+Mods',
      # docs/BENCHMARKS.md section 7, fortieth session).
      out["held_out_bf16_forward"] = held_out(ctx, BASELINE, eval_batch_size,
                                              state=state.replace(fp8_meta=bf16_meta))
    del state
  ctx._cache[key] = out
  return out


BASELINE_ARM, PLAN_ARM, NOISE_ARM = "bf16_mods", "plan", "bf16_mods_jittered"


def run_step(step: str) -> str:
  """The record name of one training run within a check of `step`."""
  return f"{step}_run"


# Steps per point of a training run's recorded loss curve (`loss_curve`).
CURVE_EVERY = 25


def loss_curve(losses, every: int = CURVE_EVERY) -> List[Optional[float]]:
  """Mean training loss over each block of `every` consecutive steps (the last block may be
  shorter), rounded to 6 digits; None for a block with a non-finite step (JSON has no NaN)."""
  if every < 1:
    raise ValueError(f"every={every}: a block is at least one step")
  losses = np.asarray(losses, np.float64)
  blocks = (losses[i:i + every] for i in range(0, losses.size, every))
  return [round(float(b.mean()), 6) if np.all(np.isfinite(b)) else None for b in blocks]


def run_summary(run: Mapping[str, Any], window: int) -> Dict[str, Any]:
  """What the training checks judge of a `shadow_run`: whether it stayed finite, its mean
  loss over the last `window` steps, its worst step's loss and its held-out log loss (None
  where not finite: JSON has no NaN), with its held-out AUC and calibration where the scores
  were kept; a plan's run also its parameters' held-out log loss through bf16+Mods' forwards.
  AUC and calibration tell a worse ranking from a shifted mean prediction, which an early,
  barely learning state's log loss mostly is (Wukong `large`: AUC 0.519 at the probe's
  state, docs/BENCHMARKS.md section 7, thirty-ninth session). Its `loss_curve` tells when a
  run left a plateau: Wukong `large`'s runs sit near 0.564 from about step 100 and leave it
  between steps 100 and 350 by seed, plan and warm-up, so a run judged on its last steps
  while still on it reads as stalled (forty-sixth session)."""
  finite = bool(run["finite"])
  losses = run["losses"]
  out = {"finite": finite,
         "window_loss": float(np.mean(losses[-window:])) if finite else None,
         "peak_loss": float(np.max(losses)) if finite else None,
         "logloss": float(run["held_out"]["logloss"]) if finite else None,
         "loss_curve": loss_curve(losses)}
  if finite and "logits" in run["held_out"]:
    out.update(auc=float(run["held_out"]["auc"]),
               calibration=calibration(run["held_out"]["logits"], run["held_out"]["labels"]))
  if finite and run.get("held_out_bf16_forward") is not None:
    out["logloss_bf16_forward"] = float(run["held_out_bf16_forward"]["logloss"])
  return out


def _training_runs(plan: Plan, ctx: ValidationContext, progress: Progress, step: str, arm: str,
                   kplan: KernelPlan, seeds: Sequence[int], recipe: Mapping[str, Any],
                   eval_batch_size, optim: Optional[OptimConfig]
                   ) -> Tuple[Plan, List[Dict[str, Any]]]:
  """(plan, one `run_summary` per seed) of `arm`'s training runs under `recipe` (steps, start,
  window, warm-up, and for the plan's arm its FP8 sites' kernels), each read from a `step`
  run record the plan holds or run now and recorded at once (`take_in_turn`). A check's runs
  are its cost (six 500-step runs a round at DCNv2 `large` with three seeds), so a call that
  stops mid-round, or while the round's sites are measured, keeps them: the next call takes
  the round's verdict from the records instead of training again."""
  fields = {"arm": arm, **recipe}
  def saved(p: Plan) -> Dict[int, Dict[str, Any]]:
    return {r["seed"]: r for r in matching_records(p, run_step(step), fields)}
  def measure(seed: int) -> Dict[str, Any]:
    # From the checkpoint each seed is a data window (`shadow_windows`), the first window 0.
    window = seeds.index(seed) if recipe["start"] == CHECKPOINT else 0
    return run_summary(shadow_run(ctx, kplan, recipe["steps"], eval_batch_size,
                                  recipe["start"], seed, optim, window,
                                  recipe.get("jitter", 0.0),
                                  warmup_after_switch=recipe.get("warmup_after_switch", 0)),
                       recipe["window"])
  have = saved(plan)
  pending = [(f"the {step} check's {arm} run, seed {seed}", {**fields, "seed": seed},
              functools.partial(measure, seed)) for seed in seeds if seed not in have]
  # A run's program is its arm and recipe: its other seeds (data windows) rerun it warm.
  plan = take_in_turn(plan, progress, run_step(step), pending,
                      lambda f: json.dumps({k: v for k, v in f.items() if k != "seed"},
                                           sort_keys=True))
  have = saved(plan)
  return plan, [have[seed] for seed in seeds]


def _free(tree) -> None:
  """Deletes the device buffers of `tree` (a state `working_state` holds a backup of)."""
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
      leaf.delete()


def initial_state(ctx: ValidationContext, kplan: KernelPlan, seed: int,
                  optim: Optional[OptimConfig] = None):
  """A fresh TrainState of `kplan`'s model, as training from scratch starts: parameters and
  optimizer state (of `optim`, default the context's) from `seed`, delayed-scaling state at
  its initial values. Every plan's
  parameters must equal bf16+Mods' (a plan changes kernels, never weights): once bf16+Mods'
  state was made (the checks make it first), a sum of each parameter checks it."""
  from loka_jax.train.optim import make_optimizer
  from loka_jax.train.state import create_train_state
  model = model_and_meta(ctx, kplan)[0]
  state = create_train_state(model, make_optimizer(optim or ctx.optim),
                             ctx.source.train_batch(0, 1), seed)
  sums = jax.device_get(jax.tree.map(lambda x: jnp.sum(x.astype(jnp.float32)), state.params))
  key = ("init_param_sums", seed)
  if kplan == BASELINE:
    ctx._cache[key] = sums
  elif key in ctx._cache and not jax.tree.all(jax.tree.map(
      lambda a, b: bool(np.array_equal(a, b)), sums, ctx._cache[key])):
    raise ValueError("the planned model initializes other parameters than bf16+Mods from the "
                     "same seed; a plan may change kernels only")
  return state


def shadow_diverged(rel_train: float, rel_eval: float, bound: float,
                    eval_bound: Optional[float] = None) -> bool:
  """One-sided: the plan's training-loss window is above bf16+Mods' by more than `bound`, or
  its held-out log loss by more than `eval_bound` (default `bound`; both relative). Ending
  below the baseline is drift, not divergence."""
  return rel_train > bound or rel_eval > (bound if eval_bound is None else eval_bound)


def stalled_back_off(previous: Mapping[str, Any], current: Mapping[str, Any],
                     bounds: Mapping[str, float], fraction: float,
                     backed_off: Sequence[str]) -> Optional[str]:
  """Why the previous training round's back-off left the run where it was, or None.

  `previous` and `current`: two consecutive rounds' verdicts (finite, with
  `rel_train_loss` and `rel_logloss_change`); `bounds`: each of those keys' bound;
  `backed_off`: the sites the previous round backed off. Stalled: `current` fails too, and
  for every loss the previous round had above its bound, the back-off took back less than
  `fraction` of that excess (a loss that grew took back nothing). `fraction` 0: never."""
  if fraction <= 0 or current.get("passed", True) or not backed_off:
    return None
  keys = ("rel_train_loss", "rel_logloss_change")
  if not all(k in previous and k in current for k in keys):
    return None   # a non-finite round reads no losses
  over = {k: previous[k] - bounds[k] for k in keys if previous[k] > bounds[k]}
  if not over or any(previous[k] - current[k] >= fraction * excess
                     for k, excess in over.items()):
    return None
  names = {"rel_train_loss": "training loss", "rel_logloss_change": "held-out"}
  moved = ", ".join(f"{names[k]} {100 * previous[k]:+.3f}% -> {100 * current[k]:+.3f}% "
                    f"({100 * excess:.3f} points over its bound)" for k, excess in over.items())
  sites = ", ".join(backed_off)
  return (f"the last back-off ({sites}) moved no loss by {100 * fraction:g}% of its excess "
          f"({moved}): the ranking has not found the cause, so every site with an FP8 "
          "gradient pass (or, with none left, every FP8 site) steps down one")


def shadow_noise_bounds(config: ValidationConfig, noise_runs: Sequence[Mapping[str, Any]],
                        bases: Sequence[Mapping[str, Any]]) -> Dict[str, Any]:
  """The shadow check's bounds read from its noise-floor runs (`shadow_noise_floor`): per
  data window, the jittered bf16+Mods run's relative change from bf16+Mods' in training
  loss and held-out log loss; each bound is max(`shadow_max_rel_loss`, 2 x their RMS /
  sqrt(windows)), two standard errors of a mean over the windows of changes that size."""
  if len(noise_runs) != len(bases) or not bases:
    raise ValueError(f"{len(noise_runs)} noise-floor runs for {len(bases)} data windows")
  trains = [_rel(n["window_loss"], b["window_loss"]) for n, b in zip(noise_runs, bases)]
  evals = [_rel(n["logloss"], b["logloss"]) for n, b in zip(noise_runs, bases)]
  def bound(changes):
    rms = float(np.sqrt(np.mean(np.square(changes))))
    return max(config.shadow_max_rel_loss, 2 * rms / math.sqrt(len(changes)))
  return {"jitter": NOISE_FLOOR_JITTER, "rel_train_loss": trains, "rel_logloss_change": evals,
          "train_bound": bound(trains), "held_out_bound": bound(evals)}


def held_out_quality_bound(config: ValidationConfig,
                           baseline_loglosses: Sequence[float]) -> Dict[str, Any]:
  """The check from initialization's held-out bound (`from_init_quality_bound`):
  {"bound": max(max_rel_logloss, 2 x noise), "noise": the relative std (ddof 1) of
  bf16+Mods' held-out log loss over the seeds, None with one seed}. The quality target's
  noise floor, read from this check's own bf16+Mods runs."""
  losses = np.asarray(baseline_loglosses, float)
  noise = (float(np.std(losses, ddof=1) / abs(np.mean(losses))) if losses.size > 1
           else None)
  return {"bound": max(config.max_rel_logloss, 2 * noise if noise is not None else 0.0),
          "noise": noise}


def check_shadow(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                 progress: Optional[Progress] = None) -> Plan:
  """Shadow training, plan vs bf16+Mods from the same checkpoint; backs off the site that
  moves the gradient most while the runs diverge (bound: `shadow_max_rel_loss`)."""
  return _check_training(plan, ctx, config, progress, "quality_shadow", CHECKPOINT,
                         config.shadow_steps)


def check_from_init(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                    progress: Optional[Progress] = None) -> Plan:
  """Training from a fresh initialization, plan vs bf16+Mods (`from_init_steps`); backs off
  as the shadow check does while the runs diverge (bound: `shadow_max_rel_loss`)."""
  recipe = {k: v for k, v in (("warmup_steps", config.from_init_warmup_steps),
                              ("clip_norm", config.from_init_clip_norm)) if v is not None}
  optim = dataclasses.replace(ctx.optim, **recipe) if recipe else None
  return _check_training(plan, ctx, config, progress, "quality_from_init", INIT,
                         config.from_init_steps, optim)


_TRAINING = {CHECKPOINT: "shadow training", INIT: "training from initialization"}


def _previous_round(plan: Plan, step: str, round_: int
                    ) -> Tuple[Optional[Dict[str, Any]], List[str]]:
  """(the `step` check's live verdict of round `round_` - 1 or None, the sites backed off
  after it)."""
  live = _live_records(plan, step)
  at = [i for i, r in enumerate(live) if r.get("round") == round_ - 1]
  if not at:
    return None, []
  later = live[at[-1] + 1:]
  until = next((i for i, r in enumerate(later) if "round" in r), len(later))
  return live[at[-1]], [r["site"] for r in later[:until] if is_back_off(r)]


def _check_training(plan, ctx: ValidationContext, config: ValidationConfig,
                    progress: Optional[Progress], step: str, start: str, steps: int,
                    optim: Optional[OptimConfig] = None) -> Plan:
  """The shadow check and the check from initialization: `steps` training steps from
  `start`, plan vs bf16+Mods, backing off while the plan's loss climbs above the baseline's."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config(step, config)
  if why is not None:
    return _final(plan, {"step": step, "skipped": True, "reason": why})
  size = config.eval_batch_size
  window = min(config.shadow_window, steps)
  # From initialization each seed is a start; from the checkpoint each is a data window.
  seeds = [config.seed + i for i in range(config.from_init_seeds if start == INIT
                                          else config.shadow_windows)]
  trains_with = optim or ctx.optim
  recipe = {"steps": steps, "start": start, "window": window,
            "warmup_steps": trains_with.warmup_steps,
            # Only a clipped recipe names its norm, so records from before the knob still
            # match the runs they describe.
            **({"clip_norm": trains_with.clip_norm} if trains_with.clip_norm is not None
               else {}),
            # Likewise only a re-warmed shadow check names its warm-up after the switch.
            **({"warmup_after_switch": config.shadow_warmup_steps}
               if start == CHECKPOINT and config.shadow_warmup_steps else {})}
  plan, bases = _training_runs(plan, ctx, progress, step, BASELINE_ARM, BASELINE, seeds,
                               recipe, size, optim)
  if not all(b["finite"] for b in bases):
    raise FloatingPointError(
        f"the bf16+Mods run of the {step} check itself produced a non-finite loss: "
        + ("the checkpoint or " if start == CHECKPOINT else "") + "the learning rate is at "
        "fault, not the plan")
  base_windows = [b["window_loss"] for b in bases]
  held_bound = (held_out_quality_bound(config, [b["logloss"] for b in bases])
                if start == INIT and config.from_init_quality_bound else None)
  noise = None
  if start == CHECKPOINT and config.shadow_noise_floor:
    plan, noise_runs = _training_runs(plan, ctx, progress, step, NOISE_ARM, BASELINE, seeds,
                                      {**recipe, "jitter": NOISE_FLOOR_JITTER}, size, optim)
    if not all(n["finite"] for n in noise_runs):
      raise FloatingPointError(
          f"the jittered bf16+Mods run of the {step} check (its noise floor) produced a "
          "non-finite loss: the checkpoint or the learning rate is at fault, not the plan")
    noise = shadow_noise_bounds(config, noise_runs, bases)
  train_bound = noise["train_bound"] if noise else config.shadow_max_rel_loss
  eval_bound = noise["held_out_bound"] if noise else config.shadow_max_rel_loss
  first = _rounds_done(plan, step)
  # What each loss is judged against (the check from initialization's quality bound is the
  # tighter held-out one where it is set): a stall is read against these.
  bounds = {"rel_train_loss": train_bound,
            "rel_logloss_change": (min(eval_bound, held_bound["bound"]) if held_bound
                                   else eval_bound)}
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"{step} round {round_}")
    previous, backed_off = _previous_round(plan, step, round_)
    candidates = fp8_sites(plan, ctx.site_names())
    plan, runs = _training_runs(
        plan, ctx, progress, step, PLAN_ARM, plan.kernel_plan(), seeds,
        {**recipe, "sites": {s: c.to_dict() for s, c in sorted(candidates.items())}}, size,
        optim)
    finite = all(r["finite"] for r in runs)
    record: Dict[str, Any] = {"step": step, "round": round_, "start": start,
                              "steps": steps, "window": window,
                              **{k: recipe[k] for k in ("warmup_steps", "clip_norm",
                                                        "warmup_after_switch")
                                 if k in recipe},
                              "bound": config.shadow_max_rel_loss, "finite": finite,
                              "train_loss_bf16": float(np.mean(base_windows)),
                              # The worst step of each run: an early spike shows here.
                              "peak_loss_bf16": max(b["peak_loss"] for b in bases)}
    if len(seeds) > 1:
      record["seeds"] = seeds
    if held_bound is not None:
      record.update(held_out_bound=held_bound["bound"], held_out_noise=held_bound["noise"])
    if noise is not None:
      record["noise_floor"] = noise
    if finite:
      windows = [r["window_loss"] for r in runs]
      rel_trains = [_rel(w, bw) for w, bw in zip(windows, base_windows)]
      rel_evals = [_rel(r["logloss"], b["logloss"]) for r, b in zip(runs, bases)]
      # The mean over seeds of each seed's relative difference (one seed: that difference).
      rel_train, rel_eval = float(np.mean(rel_trains)), float(np.mean(rel_evals))
      climbed = shadow_diverged(rel_train, rel_eval, train_bound, eval_bound)
      diverged = climbed or (held_bound is not None and rel_eval > held_bound["bound"])
      record.update(train_loss=float(np.mean(windows)), rel_train_loss=rel_train,
                    peak_loss=max(r["peak_loss"] for r in runs),
                    logloss=float(np.mean([r["logloss"] for r in runs])),
                    logloss_bf16=float(np.mean([b["logloss"] for b in bases])),
                    rel_logloss_change=rel_eval)
      # Reported, not judged: runs recorded before it was measured have none.
      rel_bf16_forwards = ([_rel(r["logloss_bf16_forward"], b["logloss"])
                            for r, b in zip(runs, bases)]
                           if all("logloss_bf16_forward" in r for r in runs) else None)
      if rel_bf16_forwards is not None:
        record["rel_logloss_change_bf16_forward"] = float(np.mean(rel_bf16_forwards))
      if len(seeds) > 1:
        record["per_seed"] = [{"seed": seed, "rel_train_loss": t, "rel_logloss_change": e}
                              for seed, t, e in zip(seeds, rel_trains, rel_evals)]
        for entry, rel in zip(record["per_seed"], rel_bf16_forwards or ()):
          entry["rel_logloss_change_bf16_forward"] = rel
    else:
      diverged = True
    record["passed"] = not diverged
    if not diverged or not candidates or round_ == config.max_rounds:
      if diverged:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    # The verdict shows before the sites are measured (minutes at a large preset); the
    # record itself is added after, with their values.
    progress.note_records([record])
    if not finite:
      what = "non-finite loss"
    elif climbed and noise is not None:
      what = (f"losses diverge beyond their noise-floor bounds (train "
              f"{100 * record['rel_train_loss']:+.3f}% against {100 * train_bound:.3f}%, "
              f"held-out {100 * record['rel_logloss_change']:+.3f}% against "
              f"{100 * eval_bound:.3f}%)")
    elif climbed:
      what = (f"losses diverge beyond {100 * config.shadow_max_rel_loss:g}% (train "
              f"{100 * record['rel_train_loss']:+.3f}%, held-out "
              f"{100 * record['rel_logloss_change']:+.3f}%)")
    else:   # within the divergence bound, above the quality bound
      what = (f"held-out {100 * record['rel_logloss_change']:+.3f}% is above the quality "
              f"bound {100 * held_bound['bound']:.3f}%")
    stalled = (stalled_back_off(previous, record, bounds, config.stalled_fraction,
                                backed_off) if previous is not None else None)
    if stalled is not None:
      record["stalled"] = stalled
      # The held-out check passed these forwards, so the gradient passes step down first.
      worst = sorted(fp8_sites(plan, sorted(candidates), ("grad_lhs", "grad_rhs"))
                     or candidates)
      reasons = {s: f"{_TRAINING[start]}: {what}; {stalled}" for s in worst}
    elif _ranked_by_report(ctx, config, candidates, config.gradient_one_program):
      scores = report_scores(ctx.report, plan, candidates, "error")
      worst = worst_by_report(scores)
      record["report_scores"] = scores
      reasons = {s: f"{_TRAINING[start]}: {what}; ranked by the probe report's error (all "
                    "passes)" for s in worst}
    else:
      wanted = candidates if config.gradient_one_program else None
      # The bf16 gradient, once a site is left to measure: a tree on the device (12 GB at
      # Wukong `large`), so it lives for this round's measurements only (cleared below),
      # not beside the next round's training runs. A later round measures on another
      # board anyway.
      reference = {}
      # Each site's record also names the parameters it moves most, relatively
      # (`gradient_distance`): what the whole-gradient ranking can read small.
      measure = lambda site, choice: gradient_change(ctx, site, choice, config.grad_batches,
                                                     wanted, reference, largest_leaves=3)
      # Recorded under the shadow check's name in either check: the value (this site's
      # gradient change on the trained state) is the same, so neither measures it twice.
      try:
        plan, current = measure_sites(plan, "quality_shadow", round_, candidates, measure,
                                      progress, one_program=config.gradient_one_program)
      finally:
        reference.clear()
      # JSON has no infinity: a site whose gradient is not finite reads null.
      record["gradient_contributions"] = {s: (v if math.isfinite(v) else None)
                                          for s, v in current.items()}
      site = max(current, key=lambda s: (current[s], s))
      worst = [site]
      reasons = {site: f"{_TRAINING[start]}: {what}; this site moves the gradient most "
                       f"({current[site]:.3g} relative)"}
    since = len(plan["validation"]) + 1   # the round's verdict was noted above
    plan = add_validation(plan, record)
    for site in worst:
      plan = back_off_site(plan, ctx, site, reasons[site], step=step)
    plan = progress.note(plan, since)
  return plan


# ----------------------------------------------------------------------------- speed


# The passes each timed step runs: a plan's gradient-only FP8 sites cannot change inference.
STEP_PASSES = {"train": PASSES, "infer": ("fwd",)}


def on_gpu_unless(forced: Optional[bool], field: str, what: str) -> Tuple[bool, str]:
  """(run a timed check, why or why not): `forced` (the config's `field`) when set, else
  only on a GPU (CPU timings say nothing about GPU kernels)."""
  if forced is not None:
    return forced, ("forced on" if forced else f"switched off ({field}=False)")
  if _compat.on_gpu():
    return True, f"on {jax.devices()[0].device_kind}"
  return False, (f"not on a GPU ({jax.default_backend()}): CPU timings say nothing about GPU "
                 f"kernels; run the pipeline on the target GPU to {what}")


def speed_enabled(config: ValidationConfig) -> Tuple[bool, str]:
  """(run the speed check, why or why not)."""
  return on_gpu_unless(config.speed, "speed", "validate speed")


def _step_calls(ctx: ValidationContext, kplan: KernelPlan, shared: Dict[str, Any]):
  """(train_call, infer_call): argument-less whole steps on a fixed real batch. Every plan's
  train call threads the same parameters and optimizer state (`shared`: the context's own
  copy, consumed; a plan changes kernels only) and its own fp8_meta, so timing any number of
  plans costs no extra copy of the state however large the model."""
  model, meta0 = model_and_meta(ctx, kplan)  # cached by measure_steps before the state moved
  train_step, eval_step = compiled_steps(model, ctx.optim, "stop")
  batch = jax.device_put(ctx.batch())
  meta = {"value": _fresh_copy(meta0)}

  def train_call():
    new, m = train_step(shared["state"].replace(fp8_meta=meta["value"]), batch)
    meta["value"] = new.fp8_meta
    shared["state"] = new.replace(fp8_meta={})
    return m["loss"]

  def infer_call():
    return eval_step(shared["state"].replace(fp8_meta=meta["value"]), batch)

  return train_call, infer_call


def measure_steps(ctx: ValidationContext, plans: Mapping[str, KernelPlan], baseline: str,
                  repeats: int = 20, seed: int = 0, min_sample_s: float = 0.01
                  ) -> Dict[str, Dict[str, dict]]:
  """{mode: timing.summarize(...)} of whole train and inference steps of `plans`,
  interleaved, with speedups vs `baseline` (baseline time / variant time). A sample runs as
  many steps back to back as make `min_sample_s` on the baseline (the same count for every
  plan; `inner` in the summaries)."""
  for kplan in plans.values():
    model_and_meta(ctx, kplan)  # first: making fp8_meta reads the context's state
  out = {}
  with working_state(ctx) as state:
    shared = {"state": state.replace(fp8_meta={})}
    del state
    calls = {name: _step_calls(ctx, kplan, shared) for name, kplan in plans.items()}
    for mode, index in (("train", 0), ("infer", 1)):
      per_sample = (timing.calls_for(calls[baseline][index], min_sample_s)
                    if min_sample_s > 0 else 1)
      timings = timing.time_calls({n: c[index] for n, c in calls.items()}, repeats=repeats,
                                  calls_per_sample=per_sample)
      out[mode] = timing.summarize(timings, baseline, seed=seed)
    del calls, shared
  return out


def clearly_slow_sites(ci_lows: Mapping[str, float], slowdowns: Mapping[str, float]
                       ) -> List[str]:
  """The sites a speed round backs off, slowest first: the one with the largest in-context
  slowdown, and every other whose reversion alone makes each failing step faster with the
  speedup's CI lower bound above 1 (`ci_lows`: per site, the lowest over the failing steps
  of that bound, "without SITE" against the plan)."""
  worst = max(slowdowns, key=lambda s: (slowdowns[s], s))
  clear = [s for s in slowdowns if s != worst and ci_lows[s] > 1.0]
  return [worst] + sorted(clear, key=lambda s: (-slowdowns[s], s))


def in_context_slowdown(ctx: ValidationContext, plan: Plan, site: str, failing: Sequence[str],
                        config: ValidationConfig) -> Tuple[float, Dict[str, Any]]:
  """(the time `site` costs the failing steps in context, extras): the plan and the plan
  without the site timed in one interleaving; the slowdown is the product over `failing` of
  the speedup of "without SITE" against the plan, and `ci_low` the lowest CI lower bound of
  those speedups. One pair per site, so a round over many sites of a large preset (DHEN
  large: about 80 s to compile a plan's steps) is saved site by site (`measure_sites`)."""
  got = measure_steps(ctx, {"plan": plan.kernel_plan(), "without": without_site(plan, site)},
                      "plan", config.speed_repeats, config.seed, config.speed_min_sample_s)
  return (float(np.prod([got[m]["without"]["speedup"] for m in failing])),
          {"ci_low": float(min(got[m]["without"]["speedup_ci"][0] for m in failing))})


SPEED_STEPS = "speed_steps"


def _round_steps(plan: Plan, ctx: ValidationContext, config: ValidationConfig,
                 progress: Progress, round_: int, device: str
                 ) -> Tuple[Plan, Dict[str, Dict[str, dict]]]:
  """(plan, `measure_steps`' {mode: {"bf16", "plan": summary}}) of a speed round: its
  whole train and inference steps, plan against bf16+Mods, as a `speed_steps` record of
  this round, device and FP8 sites holds them, or timed now and recorded at once
  (`take_in_turn`: paced by the slowest recorded). A round compiles both models' train and
  inference steps (minutes at Wukong `large`); a call that stops while the round's sites
  are measured must not time them again, nor let a new reading of which step fails set
  aside the sites measured for the old one."""
  fields = {"round": round_, "device": device,
            "sites": {s: c.to_dict() for s, c in sorted(fp8_sites(plan, ctx.site_names()).items())}}
  if not matching_records(plan, SPEED_STEPS, fields):
    timed = lambda: {"steps": measure_steps(
        ctx, {"bf16": BASELINE, "plan": plan.kernel_plan()}, "bf16", config.speed_repeats,
        config.seed, config.speed_min_sample_s)}
    plan = take_in_turn(plan, progress, SPEED_STEPS,
                        [(f"speed round {round_}'s timed steps", fields, timed)])
  return plan, matching_records(plan, SPEED_STEPS, fields)[-1]["steps"]


def check_speed(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                progress: Optional[Progress] = None) -> Plan:
  """Backs off the site with the largest in-context slowdown, and every site clearly slow in
  context (`clearly_slow_sites`), while the plan's train or inference step is not provably at
  least `min_speedup` x bf16+Mods (CI lower bound)."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config("speed", config)
  if why is not None:
    return _final(plan, {"step": "speed", "skipped": True, "reason": why})
  device = jax.devices()[0].device_kind
  first = _rounds_done(plan, "speed")
  for round_ in range(first, config.max_rounds + 1):
    progress.checkpoint(plan, f"speed round {round_}")
    plan, got = _round_steps(plan, ctx, config, progress, round_, device)
    below = [m for m in STEP_PASSES if got[m]["plan"]["speedup_ci"][0] < config.min_speedup]
    # A step that runs no FP8 pass of the plan runs bf16+Mods' kernels: its CI is noise, and
    # backing sites off cannot move it (an inference step of a plan with FP8 gradients only).
    same_kernels = [m for m in below if not fp8_sites(plan, ctx.site_names(), STEP_PASSES[m])]
    failing = [m for m in below if m not in same_kernels]
    passes = tuple(p for p in PASSES if any(p in STEP_PASSES[m] for m in failing))
    candidates = fp8_sites(plan, ctx.site_names(), passes or PASSES)
    record: Dict[str, Any] = {
        "step": "speed", "round": round_, "device": device, "why": why,
        "repeats": config.speed_repeats, "min_speedup": config.min_speedup,
        "passed": not failing}
    for m in STEP_PASSES:
      p = got[m]["plan"]
      record[m] = {"speedup": p["speedup"], "speedup_ci": p["speedup_ci"],
                   "plan_median_us": p["median_us"],
                   "bf16_median_us": got[m]["bf16"]["median_us"]}
    if same_kernels:
      record["same_kernels_as_bf16_mods"] = same_kernels
    if not failing or not candidates or round_ == config.max_rounds:
      if failing:
        record["note"] = ("no FP8 site left to back off" if not candidates
                          else f"stopped after {config.max_rounds} back-offs")
      return progress.note(_final(plan, record), -1)
    lower = min(got[m]["plan"]["speedup_ci"][0] for m in failing)
    excess = (f"{'/'.join(failing)} step speedup CI lower bound {lower:.3f} < "
              f"{config.min_speedup:g}")
    record["failing"] = failing
    if _ranked_by_report(ctx, config, candidates, one_program=False):
      scores = report_scores(ctx.report, plan, candidates, "time", passes)
      worst = worst_by_report(scores)
      record["report_scores"] = scores
      reasons = {s: f"{excess}; ranked by the probe report's GEMM time vs xla_bf16 "
                    f"({scores[s]:+.1f} us)" for s in worst}
    else:
      # Each site's cost in context depends on the rest of the plan, on which steps fail and
      # on the card, so a saved value is reused only in this round, for these steps, there.
      scope = {"round": round_, "device": device, "failing": failing}
      round_plan = plan
      plan, slowdowns = measure_sites(
          plan, "speed", round_, candidates,
          lambda site, choice: in_context_slowdown(ctx, round_plan, site, failing, config),
          progress, scope)
      ci_lows = {r["site"]: r["ci_low"] for r in site_records(plan, "speed", scope)}
      record["in_context_slowdown"] = slowdowns
      record["in_context_ci_low"] = {s: ci_lows[s] for s in candidates}
      worst = clearly_slow_sites(ci_lows, slowdowns)
      reasons = {s: f"{excess}; this site's in-context slowdown {slowdowns[s]:.3f}x"
                    + ("" if s == worst[0] else " (its reversion alone speeds the step up, CI "
                       "above 1)") for s in worst}
    since = len(plan["validation"])
    plan = add_validation(plan, record)
    for site in worst:
      plan = back_off_site(plan, ctx, site, reasons[site], step="speed", to_fallback=True)
    plan = progress.note(plan, since)
  return plan


# ----------------------------------------------------------------------------- promotion

PROMOTION = "speed_promotion"


def promotion_enabled(config: ValidationConfig) -> Tuple[bool, str]:
  """(run the promotion, why or why not): on a GPU unless `promote` says otherwise; forcing
  `speed` does not force it (a CPU step says nothing of which plan is faster on a GPU)."""
  return on_gpu_unless(config.promote, "promote", "promote sites")


def promotable_sites(plan: Plan, names: Sequence[str]) -> List[str]:
  """The sites promotion may change: xla_bf16 in every pass, and never backed off by
  validation (a site sent back for quality or speed stays where validation put it)."""
  backed_off = {r["site"] for r in plan["validation"] if is_back_off(r)}
  out = []
  for name in names:
    choice = plan.choice_for(name)
    if (name not in backed_off and choice is not None
        and all(choice.for_pass(p) == FALLBACK for p in PASSES)):
      out.append(name)
  return out


@dataclasses.dataclass(frozen=True)
class Promotion:
  """One kernel put at every promotable site where it is safe in every pass."""
  kernel: str
  sites: Tuple[str, ...]
  alone: float  # pessimistic speedup over xla_bf16 of those sites timed alone (the probe's)


def promotions(report: Mapping, plan: Plan, names: Sequence[str],
               per_sort: int = 1) -> List[Promotion]:
  """Per kernel sort (per-pass kernels, fused ops), the `per_sort` FP8 kernels whose promotion
  loses least alone: the highest pessimistic speedup over the sites where each is safe in
  every pass under the site's budget (accuracy only: selection has already found none of
  them fast enough), more sites first at a tie.

  A site timed alone is a pessimistic witness for per-pass kernels: each pass quantizes its
  own operands, where a whole step shares them (the gradient quantized once for both gradient
  passes, the forward's FP8 activation reused), and bf16's passes alone can be faster than the
  same passes in the step (docs/BENCHMARKS.md, section 7, nineteenth session: XLA tensorwise
  at 8192x2048x8 is 0.78x bf16 per site alone and about 1.13x in the step). Only the whole
  step can tell, so this only proposes; `check_promotion` measures."""
  from loka_jax.probe import eligibility
  per_kernel: Dict[str, List[Tuple[str, float, float]]] = {}
  sort_of: Dict[str, str] = {}
  for site in promotable_sites(plan, names):
    if site not in report.get("sites", {}):
      continue
    verdicts, effective, info = _site_verdicts(report, plan, site)
    for kernel, meta in info.items():
      if not meta.get("fp8", kernel != FALLBACK) or kernel not in registry.names():
        continue
      v = [verdicts.get(p, {}).get(kernel) for p in PASSES]
      times = eligibility.site_times(effective.get("passes", {}), kernel)
      if times is None or not all(x is not None and x.safe for x in v):
        continue
      per_kernel.setdefault(kernel, []).append((site, *times))
      sort_of[kernel] = meta.get("sort")
  by_sort: Dict[str, List[Promotion]] = {}
  for kernel, rows in sorted(per_kernel.items()):
    alone = sum(r[1] for r in rows) / sum(r[2] for r in rows)
    by_sort.setdefault(sort_of[kernel], []).append(
        Promotion(kernel, tuple(r[0] for r in rows), alone))
  return [p for sort in sorted(by_sort)
          for p in sorted(by_sort[sort], key=lambda p: (-p.alone, -len(p.sites), p.kernel))
          [:per_sort]]


def promotion_pays(summaries: Mapping[str, Mapping[str, dict]], name: str) -> bool:
  """Whether variant `name` beats the plan it was timed against: its train step provably
  faster (speedup CI lower bound above 1) and its inference step not provably slower (CI
  upper bound at least 1)."""
  return (summaries["train"][name]["speedup_ci"][0] > 1.0
          and summaries["infer"][name]["speedup_ci"][1] >= 1.0)


PROPOSAL = "speed_promotion_proposal"


def _timed_proposals(plan: Plan, ctx: ValidationContext, config: ValidationConfig,
                     proposals: Sequence[Promotion], promoted: Mapping[str, Plan],
                     progress: Progress) -> Tuple[Plan, Dict[str, Dict[str, Any]]]:
  """(plan, {kernel: its PROPOSAL record: pays, train, infer}): each proposal (`promoted`:
  {kernel: the plan with it}) timed against the plan in an interleaving of its own and
  recorded at once (`take_in_turn`), so a promotion that outlasts a call resumes with the
  proposals it lacks: each pair compiles two whole models (InterFormer `small`: 40-84 s a
  compile on an H200), and several proposals of a large preset outlast one call. Its pace
  is its own, not the site measurements'."""
  def timed(kernel: str) -> Dict[str, Any]:
    name = f"promote {kernel}"
    got = measure_steps(ctx, {"plan": plan.kernel_plan(), name: promoted[kernel].kernel_plan()},
                        "plan", config.speed_repeats, config.seed, config.speed_min_sample_s)
    return {"pays": promotion_pays(got, name),
            **{m: {"speedup": got[m][name]["speedup"], "speedup_ci": got[m][name]["speedup_ci"]}
               for m in STEP_PASSES}}

  done = {r["kernel"] for r in plan["validation"] if r.get("step") == PROPOSAL}
  pending = [(f"the speed promotion, proposal {p.kernel}", {"kernel": p.kernel},
              functools.partial(timed, p.kernel)) for p in proposals if p.kernel not in done]
  plan = take_in_turn(plan, Progress(save=progress.save, deadline=progress.deadline),
                      PROPOSAL, pending)
  return plan, {r["kernel"]: r for r in plan["validation"] if r.get("step") == PROPOSAL}


def check_promotion(plan, ctx: ValidationContext, config: ValidationConfig = ValidationConfig(),
                    progress: Optional[Progress] = None) -> Plan:
  """Promotes xla_bf16 sites to FP8 where the whole step says so: each proposal of
  `promotions` is timed against the plan in an interleaving of its own (train and inference
  steps; `_timed_proposals`, resumable proposal by proposal), and the one with the fastest
  train step among those that pay (`promotion_pays`) is kept. The
  quality checks that follow judge the promoted sites like any other, and back them off if
  they must."""
  plan = as_plan(plan)
  progress = progress or Progress()
  why = ruled_out_by_config(PROMOTION, config)
  if why is not None:
    return _final(plan, {"step": PROMOTION, "skipped": True, "reason": why})
  if ctx.report is None:
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": "no probe report to propose kernels from"})
  later = {step for step, _ in CHECKS if step != PROMOTION}
  begun = sorted({r["step"] for r in plan["validation"] if r.get("step") in later})
  if begun:  # a validation resumed from before promotion existed: its rounds stand
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": f"{', '.join(begun)} already judged this plan; promotion "
                                   "comes first or not at all"})
  proposals = promotions(ctx.report, plan, ctx.site_names(), config.promotion_per_sort)
  if not proposals:
    return _final(plan, {"step": PROMOTION, "skipped": True,
                         "reason": "no xla_bf16 site has an FP8 kernel safe in every pass"})
  progress.checkpoint(plan, "the speed promotion")
  def promoted(base: Plan, p: Promotion) -> Plan:
    return promote(base, p.sites, p.kernel, f"{p.kernel} is safe in every pass here and "
                   f"{p.alone:.2f}x bf16 over its {len(p.sites)} sites timed alone; promoted "
                   "if the whole step pays")
  plan, timed = _timed_proposals(plan, ctx, config, proposals,
                                 {p.kernel: promoted(plan, p) for p in proposals}, progress)
  record: Dict[str, Any] = {"step": PROMOTION, "device": jax.devices()[0].device_kind,
                            "why": why, "repeats": config.speed_repeats, "proposals": {}}
  for p in proposals:
    record["proposals"][p.kernel] = {"sites": len(p.sites), "alone": p.alone,
                                     **{k: timed[p.kernel][k] for k in ("pays", *STEP_PASSES)}}
  paying = [p for p in proposals if record["proposals"][p.kernel]["pays"]]
  if not paying:
    record["promoted"] = None
    return _final(plan, record)
  chosen = max(paying, key=lambda p: (record["proposals"][p.kernel]["train"]["speedup"],
                                      p.kernel))
  record["promoted"] = chosen.kernel
  record["sites"] = list(chosen.sites)
  return _final(promoted(plan, chosen), record)   # the plan, its proposals' records kept


# ----------------------------------------------------------------------------- all

CHECKS = ((PROMOTION, check_promotion), ("quality_held_out", check_held_out),
          ("quality_shadow", check_shadow), ("quality_from_init", check_from_init),
          ("speed", check_speed))
_STEPS_FIELD = {"quality_shadow": "shadow_steps", "quality_from_init": "from_init_steps"}


def ruled_out_by_config(step: str, config: ValidationConfig) -> Optional[str]:
  """Why the config alone rules the `step` check out (no steps to train, or a timed check
  off or not on a GPU), or None. Such a check has nothing to measure, so a validation at
  its deadline records it instead of pausing before it."""
  if step == PROMOTION:
    enabled, why = promotion_enabled(config)
  elif step == "speed":
    enabled, why = speed_enabled(config)
  else:
    field = _STEPS_FIELD.get(step)
    enabled, why = field is None or getattr(config, field) > 0, f"{field}=0"
  return None if enabled else why


def validate_end_to_end(plan, ctx: ValidationContext,
                        config: ValidationConfig = ValidationConfig(), *,
                        progress: Optional[Progress] = None, resume_from=None) -> Plan:
  """Speed promotion, held-out quality, shadow training, then speed; returns the plan with
  every step, promotion and back-off recorded and a final 'validated' record summing them up.

  `plan` is the selected plan; `resume_from`, the plan an interrupted call saved through
  `progress` (its finished checks are skipped, an unfinished one goes on from its last
  round). `progress` saves the plan as it goes and stops at its deadline (ValidationPaused).
  """
  plan = as_plan(plan)
  progress = progress or Progress()
  before = fp8_sites(plan, ctx.site_names())
  if resume_from is not None:
    plan = as_plan(resume_from)
  for step, check in CHECKS:
    if finished(plan, step):
      continue
    if step != PROMOTION and not fp8_sites(plan, ctx.site_names()):  # e.g. all backed off
      plan = _final(plan, {"step": step, "skipped": True,
                           "reason": "no FP8 site in the plan: it runs bf16+Mods, which is "
                                     "what it would be compared with"})
      continue
    why = ruled_out_by_config(step, config)
    if why is not None:  # recorded even past the deadline: a resumed call would only do this
      plan = _final(plan, {"step": step, "skipped": True, "reason": why})
      continue
    progress.checkpoint(plan, f"the {step} check")
    plan = check(plan, ctx, config, progress)
  after = fp8_sites(plan, ctx.site_names())
  last = {}
  for r in plan["validation"]:
    if (r.get("step") in dict(CHECKS) and r["step"] != PROMOTION   # promotion cannot fail
        and not r.get(REOPENED)):
      last[r["step"]] = r
  return add_validation(plan, {
      "step": "validated", "config": config.to_dict(),
      "fp8_sites_before": len(before), "fp8_sites_after": len(after),
      "backed_off": sorted(s for s in before if before[s] != after.get(s)),
      "promoted": sorted(s for s in after if s not in before),
      "passed": {k: (None if v.get("skipped") else v.get("passed")) for k, v in last.items()}})


def held_out_backed_off(plan) -> Dict[str, str]:
  """{site: reason} of the sites whose forward the held-out check moved off its selected
  kernel. That check scores the plan's forwards alone on fixed parameters, so what it took
  back counts against serving the site's forward in FP8 too (`bench.planning`). Back-offs a
  reopened check undid (`reopen_check`) do not count."""
  return {r["site"]: r.get("reason", "") for r in _live_records(as_plan(plan),
                                                                "quality_held_out")
          if is_back_off(r) and "fwd" in (r.get("passes") or PASSES)}


def validation_records(plan, step: Optional[str] = None) -> List[Dict[str, Any]]:
  """The plan's validation records (of one step)."""
  return [r for r in as_plan(plan)["validation"] if step is None or r.get("step") == step]
