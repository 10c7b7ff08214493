"""The quality suite: held-out NE / log loss / AUC of the arms after a fixed number of steps,
by the quality protocol: paired by seed. At each seed every arm trains from the same
initialization, data order and held-out set (>= 200k examples on synthetic teacher data), and
each row records fingerprints of all three (`quality_pairs`), so the verdicts pair only rows
that share them (`quality_pairs.judge`: `loka_jax.train.verdict.paired_quality`).

Arms: bf16, bf16+Mods, naive FP8 (`fp8_all` with `xla_fp8_tensorwise`, no Mods), Flax's
delayed scaling everywhere (`fp8_all` with `flax_fp8_delayed`, the fastest training peer on the
largest tower, whose weight gradients measure 9-11 dB there) and LoKA (Mods + the target's
plan, whose kernels its rows record as `plan_kernels`); on request (not among the default
arms), naive FP8 with the Mods (`fp8_naive_mods`), which has bf16+Mods' architecture and so
isolates FP8's own change where the naive arm also carries the Mods', and LoKA under the
error budget alone (`loka_accuracy`: its own probe and plan, selected with the speed rule off
and validated without the speed checks; the probe starts from LoKA's trained statistics and
evaluations, `planning.reuse_probe_statistics`), which judges the Probe's accuracy selection where
no FP8 kernel is faster than bf16 and LoKA's plan is bf16+Mods itself. Every arm runs at each
of `seeds`
(the bench's default: 0, 1, 2; MovieLens: 5); without `seeds`, the arms at `seed` and bf16
alone at `noise_seeds`, which pair with nothing. One row per finished run.

The recipe is Adam (embeddings: row-wise Adagrad) at constant rates from step 0. At the `large`
presets that recipe is unstable for the first steps even in bf16 (DLRM `large` spiked to a
training loss of 2.5 at step 4 on the CPU, batch 512), and FP8 at a few wide layers made the
spikes larger and their harm lasting.
`warmup_steps` (a linear warm-up of both rates) gives a second recipe; its rows carry
`warmup_steps` and are compared only with rows of the same recipe. `clip_norm` (global-norm
clipping of the dense gradients) is a recipe knob the same way: with the warm-up, DCNv2
`large`'s bf16+Mods still spiked to a training loss of 5.7 at one seed of three and LoKA to
6.9 at the same seed, whose held-out losses then carried the whole comparison (H200). Each
row records its run's worst step (`peak_loss`, `peak_step`), so a spike shows in the tables
and verdicts. `cooldown_steps` (a linear decay of both rates to 0 over the run's last steps)
is a third: a fixed-step run then ends at a settled iterate rather than one moving at the full
rate. It leaves the paired changes' spread about where it was (FINDINGS 39), which the two
arms' architectures set rather than the last iterate's motion.

A LoKA plan with xla_bf16 everywhere runs the bf16+Mods program, so its LoKA row takes the
scores of the bf16+Mods run at its seed (`bf16_mods_twin`; marked `same_run_as`) rather than
training that run again. For the same reason a Mods set other than the default
(`mods_set`) trains only its Mods arms: its arms without Mods (bf16 with its noise seeds, naive
and delayed FP8) are the default set's runs, the same program, seed, data order and recipe,
which its comparison shares (`Comparison.holds`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import shutil
import time
import traceback
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from loka_jax import xla_env
from experiments.bench import mods_set, pace, planning, quality_pairs
from experiments.bench.results import ResultsFile
from loka_jax.train import experiment, read_metrics
from loka_jax.train.loop import RunSettingsError, TrainConfig, train
from loka_jax.train.optim import OptimConfig, cooldown_at_end, make_optimizer
from loka_jax.train.state import create_train_state, state_bytes

# `warmup_steps`, `clip_norm` and `cooldown_steps` are absent (None) from rows of the plain
# recipe, and `mods_set` from rows of the default Mods set (`mods_set.DEFAULT`), so rows
# written before them keep their keys.
KEY_FIELDS = ("suite", "data", "model", "preset", "arm", "seed", "device", "warmup_steps",
              "mods_set", "clip_norm", "cooldown_steps")
MIN_EVAL = 200_000
# A quality run whose training state is at least this large writes no checkpoint (only its
# final.json), or with `keep_runs` its final state alone: Wukong `large`'s 36.6 GB state
# (parameters and Adam) saved every 125 steps and kept three deep would need up to four
# copies, 146 GB, on the H200 host's 64 GiB disk, InterFormer `large`'s 7.8 GB took 6-14 s a
# save, and DCNv2 `large`'s 3.0 GiB, saved every quarter of the run, spent 13-16 s of its
# 37-60 s runs on four saves (H200). Runs are paced to end within their call
# (`pace.may_start`), so the steps a checkpoint would save are rarely lost; smaller states
# (the small presets') keep them.
LARGE_STATE_BYTES = 1 << 30
# A quality run expected to take less than this (`expected_run_s`: the longest recorded run
# of its arm, with margin) saves no checkpoint before its end either: stopped midway, it
# starts again and loses less than this, where each save of even a small state costs a fixed
# part of a run that lasts seconds (MovieLens `tiny` on an H100: 0.4-1.8 s of saves in runs of
# 1.4-4.5 s once compiled).
SHORT_RUN_S = 60.0


def trains_with_mods(arm_name: str) -> bool:
  """Whether a quality arm's program has Mods, so that a Mods set changes it (an arm this
  version does not know counts as one: its rows are then never shared across sets)."""
  return arm_name not in ARMS or bool(ARMS[arm_name].mods)


@dataclasses.dataclass(frozen=True)
class QualityArm:
  """A training arm of the quality comparison."""
  name: str
  precision: str
  kernel: str = "xla_fp8_tensorwise"
  mods: Tuple[str, ...] = ()
  # A LoKA arm whose plan is selected by the error budget alone (the speed rule off), in a
  # plans folder of its own (`planning.loka_plans_root`).
  accuracy_only: bool = False


ARMS = {
    "bf16": QualityArm("bf16", "bf16"),
    "bf16_mods": QualityArm("bf16_mods", "bf16", mods=("all",)),
    "fp8_naive": QualityArm("fp8_naive", "fp8_all", "xla_fp8_tensorwise"),
    "fp8_naive_mods": QualityArm("fp8_naive_mods", "fp8_all", "xla_fp8_tensorwise",
                                 mods=("all",)),
    "fp8_delayed": QualityArm("fp8_delayed", "fp8_all", "flax_fp8_delayed"),
    "loka": QualityArm("loka", "loka", mods=("all",)),
    "loka_accuracy": QualityArm("loka_accuracy", "loka", mods=("all",), accuracy_only=True),
}
DEFAULT_ARMS = ("bf16", "bf16_mods", "fp8_naive", "fp8_delayed", "loka")


@dataclasses.dataclass
class QualitySettings:
  data: str = "synthetic"
  preset: str = "small"
  steps: int = 500
  batch_size: Optional[int] = None     # None: the preset's
  seed: int = 0
  noise_seeds: Tuple[int, ...] = (1, 2)  # bf16 alone at these (no pair), without `seeds`
  seeds: Tuple[int, ...] = ()          # every arm at each of these: the paired seeds
  arms: Tuple[str, ...] = DEFAULT_ARMS
  min_eval: int = MIN_EVAL             # held-out examples (synthetic; MovieLens fixes its own)
  data_cache: Optional[str] = None
  plans_dir: str = "plans"
  keep_runs: bool = False              # keep finished runs' checkpoints
  warmup_steps: int = 0                # linear warm-up of both learning rates (0: none)
  clip_norm: Optional[float] = None    # global-norm clipping of the dense gradients
  cooldown_steps: int = 0              # linear decay of both rates to 0 over the last steps
  # The Mods of the Mods arms (bf16_mods, loka) and of LoKA's probe (`mods_set`).
  mods: Tuple[str, ...] = mods_set.DEFAULT

  def __post_init__(self):
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got "
                       f"{self.warmup_steps}")
    # OptimConfig rejects a clip_norm that is not > 0, and a cooldown that does not fit the
    # run after its warm-up (`cooldown_at_end`): before any run.
    _ = self.optim
    self.mods = mods_set.parse(self.mods)

  @property
  def optim(self) -> OptimConfig:
    return OptimConfig(warmup_steps=self.warmup_steps, clip_norm=self.clip_norm,
                       **cooldown_at_end(self.steps, self.cooldown_steps, self.warmup_steps))

  @property
  def mods_label(self) -> Optional[str]:
    return mods_set.label(self.mods)

  @property
  def plans_root(self) -> str:
    """Where the LoKA arm's plans live (a folder of their own for a Mods set not the
    default)."""
    return mods_set.plans_root(self.plans_dir, self.mods)


@dataclasses.dataclass(frozen=True, order=True)
class Comparison:
  """The rows compared with one another: one data set, model, preset, training recipe
  (warm-up steps, clipping norm, cooldown steps; 0: none) and Mods set (its label; empty:
  every Mod)."""
  data: str
  model: str
  preset: str
  warmup_steps: int = 0
  mods_set: str = ""
  clip_norm: float = 0.0
  cooldown_steps: int = 0

  @property
  def preset_label(self) -> str:
    """The preset, with the recipe and the Mods set where they are not the defaults."""
    recipe = recipe_label(self.warmup_steps, self.clip_norm, self.cooldown_steps)
    return mods_set.preset_label(self.preset + (f" ({recipe})" if recipe else ""),
                                 self.mods_set or None)

  @property
  def subject(self) -> str:
    return f"{self.data}:{self.model}/{self.preset_label}"

  def holds(self, row: Mapping) -> bool:
    """Whether `row` is a scored quality row of this comparison: of its Mods set, or, for an
    arm without Mods, of the default set, whose run it shares (`run_model`)."""
    row_set = mods_set.of_row(row) or ""
    return (row.get("suite") == "quality" and row.get("data") == self.data
            and row.get("model") == self.model and row.get("preset") == self.preset
            and row_warmup(row) == self.warmup_steps and row_clip(row) == self.clip_norm
            and row_cooldown(row) == self.cooldown_steps
            and (row_set == self.mods_set
                 or (not row_set and not trains_with_mods(row.get("arm"))))
            and row.get("logloss") is not None)


def row_warmup(row: Mapping) -> int:
  return int(row.get("warmup_steps") or 0)


def row_clip(row: Mapping) -> float:
  """A row's gradient-clipping norm, 0.0 for none."""
  return float(row.get("clip_norm") or 0.0)


def row_cooldown(row: Mapping) -> int:
  return int(row.get("cooldown_steps") or 0)


def recipe_label(warmup_steps: int, clip_norm: float, cooldown_steps: int = 0) -> str:
  """The recipe beyond the plain one, as labels show it: 'warmup 50, clip 1, cooldown 200'
  ('' if none)."""
  return ", ".join(([f"warmup {warmup_steps}"] if warmup_steps else [])
                   + ([f"clip {clip_norm:g}"] if clip_norm else [])
                   + ([f"cooldown {cooldown_steps}"] if cooldown_steps else []))


def comparisons(rows: Sequence[Mapping], scored_only: bool = True) -> List[Comparison]:
  """Every comparison the quality rows hold (`scored_only`: rows with a log loss), sorted."""
  return sorted({Comparison(r["data"], r["model"], r["preset"], row_warmup(r),
                            mods_set.of_row(r) or "", row_clip(r), row_cooldown(r))
                 for r in rows
                 if r.get("suite") == "quality"
                 and (r.get("logloss") is not None or not scored_only)})


def num_eval_for(min_eval: int, eval_batch: int) -> int:
  """The smallest multiple of the eval batch >= min_eval (the loop scores full batches only)."""
  return int(math.ceil(min_eval / eval_batch) * eval_batch)


def runs(settings: QualitySettings) -> List[Tuple[QualityArm, int]]:
  """(arm, seed) of every run: the arms at each seed, then the bf16 noise seeds."""
  unknown = [a for a in settings.arms if a not in ARMS]
  if unknown:
    raise ValueError(f"unknown quality arm(s) {unknown}; valid: {', '.join(ARMS)}")
  seeds = settings.seeds or (settings.seed,)
  out = [(mods_set.apply(ARMS[a], settings.mods), s) for s in seeds for a in settings.arms]
  if not settings.seeds:
    out += [(ARMS["bf16"], s) for s in settings.noise_seeds if s != settings.seed]
  return out


def eval_fingerprint(source, batch_size: int) -> str:
  """sha256 of the held-out batches a run is scored on (every field, in order)."""
  h = hashlib.sha256()
  for batch in source.eval_batches(batch_size):
    for key in sorted(batch):
      h.update(key.encode())
      h.update(np.ascontiguousarray(batch[key]).tobytes())
  return h.hexdigest()[:16]


def run_spec(model: str, arm: QualityArm, seed: int, settings: QualitySettings,
             num_eval: Optional[int], plan: Optional[str]) -> experiment.RunSpec:
  return experiment.RunSpec(model=model, preset=settings.preset, data=settings.data,
                            data_cache=settings.data_cache, precision=arm.precision,
                            kernel=arm.kernel, plan=plan, mods=arm.mods, seed=seed,
                            num_eval=num_eval)


def run_arm(model: str, arm: QualityArm, seed: int, settings: QualitySettings, workdir: str,
            plan: Optional[str] = None, expected_s: Optional[float] = None) -> Dict:
  """Trains one arm (resuming from `workdir`) and returns its result row fields.
  `expected_s`: how long the run may take (`expected_run_s`; None: not known yet), which
  decides its checkpoints (`checkpoint_plan`)."""
  batch = settings.batch_size or experiment.preset_batch_size(model, settings.preset)
  num_eval = (num_eval_for(settings.min_eval, batch) if settings.data == "synthetic" else None)
  spec = run_spec(model, arm, seed, settings, num_eval, plan)
  built_model, source, _ = experiment.build_run(spec)
  tx, first = make_optimizer(settings.optim), source.train_batch(0, batch)
  nbytes = state_bytes(built_model, tx, first, seed)
  # What pairs this run with the other arms' at its seed (`quality_pairs`): the data order
  # and the initial weights, drawn by the program the run's own start then reuses.
  paired = {"train_fingerprint": quality_pairs.train_fingerprint(source, batch, settings.steps),
            "init_fingerprint": initial_weights_fingerprint(built_model, tx, first, seed)}
  checkpoint_every, keep = checkpoint_plan(nbytes, settings.steps, settings.keep_runs,
                                           expected_s)
  config = TrainConfig(steps=settings.steps, batch_size=batch, seed=seed, eval_batch_size=batch,
                       log_every=max(settings.steps // 10, 1),
                       checkpoint_every=checkpoint_every, keep_checkpoints=keep,
                       progress=False, optim=settings.optim)
  t0 = time.time()
  final = train(built_model, source, workdir, config, run_info=spec.run_info())
  return {"ne": final.get("ne"), "logloss": final.get("logloss"), "auc": final.get("auc"),
          "num_eval_examples": final.get("num_eval_examples"), "steps": final.get("steps"),
          "peak_loss": final.get("peak_loss"), "peak_step": final.get("peak_step"),
          "batch_size": batch, "train_s": round(time.time() - t0, 1),
          "time_split": {k: round(v, 1) for k, v in (final.get("time_split") or {}).items()},
          "eval_fingerprint": eval_fingerprint(source, batch), "oracle_ne": final.get("oracle_ne"),
          **paired}


def initial_weights_fingerprint(model, tx, example_batch, seed: int) -> str:
  """`quality_pairs.init_fingerprint` of the state a run at `seed` starts from (made and
  dropped here: the run makes its own with the same compiled init)."""
  return quality_pairs.init_fingerprint(create_train_state(model, tx, example_batch,
                                                           seed).params)


def checkpoint_plan(state_nbytes: int, steps: int, keep_runs: bool = False,
                    expected_s: Optional[float] = None) -> Tuple[int, int]:
  """(checkpoint_every, keep_checkpoints) of a quality run: every quarter of the run, three
  kept; for a state of LARGE_STATE_BYTES or more, or a run expected (`expected_s`) to take
  less than SHORT_RUN_S, none at all (0, 0), since a finished run's checkpoints are deleted
  once it is scored (Wukong large's one save would write 36.6 GB, InterFormer large's took
  7-14 s on the H200), or only the final state (0, 1) when runs are kept. Such a run,
  stopped midway, starts again: quality runs start only when they end within the call
  (`pace.may_start`)."""
  short = expected_s is not None and expected_s < SHORT_RUN_S
  if state_nbytes < LARGE_STATE_BYTES and not short:
    return max(steps // 4, 1), 3
  return (0, 1) if keep_runs else (0, 0)


def expected_run_s(results: ResultsFile, model: str, settings: QualitySettings,
                   arm: Optional[str] = None, device: Optional[str] = None
                   ) -> Optional[float]:
  """How long `model`'s next quality run of `arm` may take (`pace.expected_s`): from the
  recorded runs of that arm at this data set and preset (any seed or recipe), else of any
  arm there; only those of `device` once it has one. Arms differ: DHEN `large`'s runs took
  83-227 s each on an H200, the compile included, a bf16 run at most 163 s. Cards differ
  too: DLRM `large`'s LoKA, bf16 and bf16+Mods runs take 14-25 s on an H100 and up to 67 s on
  an H200, so an H100 call paced by the H200's runs would sit idle for its last minute."""
  mine = [r for r in results.rows()
          if r.get("suite") == "quality" and r.get("model") == model
          and r.get("preset") == settings.preset and r.get("data") == settings.data]
  on_device = [r for r in mine if r.get("device") == device]
  return pace.expected_s(((r.get("arm"), r.get("train_s")) for r in on_device or mine), arm)


def run_model(model: str, settings: QualitySettings, results: ResultsFile, root: str, *,
              deadline: float, device: str, plan_maker: Optional[Callable] = None,
              log: Callable[[str], None] = print, end_by: Optional[float] = None) -> bool:
  """Every unfinished run of `model`; False when one is left for a later run: the deadline
  stopped it (`pace.may_start`: `end_by`, the call's hard end, lets runs start past
  `deadline` when they fit), or the LoKA arm's plan is not made yet (its probe or
  validation resumes then), or its run folder holds a run with other settings (left
  unrecorded: not a result of the arm), so a caller never reads a skipped arm as done."""
  complete = True
  for arm, seed in runs(settings):
    # An arm without Mods is the same run in every Mods set: keyed, and shared, as the
    # default set's.
    set_label = settings.mods_label if arm.mods else None
    key = ("quality", settings.data, model, settings.preset, arm.name, seed, device,
           settings.warmup_steps or None, set_label, settings.clip_norm,
           settings.cooldown_steps or None)
    if results.done(key):
      continue
    expected = expected_run_s(results, model, settings, arm.name, device)
    start, why = pace.may_start(time.time(), deadline, end_by, expected)
    if not start:
      log(f"  deadline: quality {model}/{arm.name}/seed{seed} left for the next run ({why})")
      return False
    row = {f: v for f, v in zip(KEY_FIELDS, key) if v is not None}
    row.update(jax=jax.__version__, precision=arm.precision, mods=list(arm.mods))
    # Whether XLA's deterministic GPU ops ran it (`xla_env.DETERMINISTIC`, set by the script
    # before JAX starts): recorded, not a recipe; the numbers' distribution is the same, only
    # their repeatability differs.
    if xla_env.in_effect(xla_env.DETERMINISTIC):
      row["xla_deterministic"] = True
    plan = None
    if arm.precision == "loka":
      plans_root = planning.loka_plans_root(settings.plans_root, arm.accuracy_only)
      plan = planning.plan_path(plans_root, model, settings.preset)
      if not os.path.exists(plan) and plan_maker is not None:
        plan = plan_maker(model, accuracy_only=arm.accuracy_only) or plan
      if not os.path.exists(plan):
        log(f"  quality {model}/{arm.name} seed {seed}: left for a later run, no plan at "
            f"{plan} yet")
        complete = False
        continue
      row["plan"] = plan
      kernels = plan_kernels(plan)
      if kernels is not None:
        row["plan_kernels"] = kernels
      twin = bf16_mods_twin(results, key, plan)
      if twin is not None:
        row.pop("xla_deterministic", None)  # the twin's run says how it ran, not this process
        row.update({f: twin[f] for f in TWIN_FIELDS if f in twin},
                   same_run_as="bf16_mods", note=TWIN_NOTE)
        log(f"  quality {settings.data} {model}/{settings.preset} {arm.name} seed {seed}: "
            f"{TWIN_NOTE}")
        results.append(row)
        continue
    workdir = run_dir(root, row)
    label = recipe_label(settings.warmup_steps, settings.clip_norm or 0.0,
                         settings.cooldown_steps)
    log(f"  quality {settings.data} {model}/{settings.preset} {arm.name} seed {seed}"
        + (f" {label}" if label else "")
        + (f" Mods {set_label}" if set_label else ""))
    try:
      row.update(run_arm(model, arm, seed, settings, workdir, plan, expected))
    except RunSettingsError as e:
      # Another run's folder (a row forgotten by hand, its folder left behind), not a result
      # of this arm: recorded, the row would read as done and never run.
      log(f"    not run: {e}; move that folder aside (experiments.forget_rows moves a "
          "forgotten row's run folder with it) or use another workdir")
      complete = False
      continue
    except Exception as e:  # a diverged or failing arm is a result too
      row.update(error=f"{type(e).__name__}: {e}"[:2000], traceback=traceback.format_exc()[-3000:])
      log(f"    failed: {type(e).__name__}: {str(e)[:300]}")
    else:
      log(run_line(row))
    results.append(row)
    if not settings.keep_runs:
      shutil.rmtree(os.path.join(workdir, "checkpoints"), ignore_errors=True)
  return complete


# What a LoKA row takes from the bf16+Mods run it is (`bf16_mods_twin`): the run's scores and
# worst step, not its wall time, which would read as a second run's.
TWIN_FIELDS = ("ne", "logloss", "auc", "oracle_ne", "num_eval_examples", "steps", "peak_loss",
               "peak_step", "batch_size", "eval_fingerprint", "train_fingerprint",
               "init_fingerprint", "xla_deterministic")
TWIN_NOTE = ("the plan runs xla_bf16 in every pass of every site (no FP8 kernel), so the LoKA "
             "arm trains the bf16+Mods program: its scores are that arm's run at this seed, "
             "not a second run")


def plan_kernels(plan_path: str) -> Optional[List[str]]:
  """The kernels the plan at `plan_path` runs, sorted (None where it cannot be read: the run
  then fails on it by name and its row records why)."""
  from loka_jax.dispatch import PlanFileError, read_plan
  try:
    return sorted(read_plan(plan_path).kernel_names())
  except (PlanFileError, OSError, ValueError):
    return None


def runs_bf16_mods_kernels(plan_path: str) -> bool:
  """Whether the plan at `plan_path` runs only the bf16+Mods arm's kernels in its sites,
  rules and default (`SiteConfig.for_precision('bf16')`): no FP8 kernel, and no other
  non-FP8 one such as xla_fp32 either, which would make another program."""
  from loka_jax import dispatch  # dispatch imports the trainer this module uses
  from loka_jax.models.site import SiteConfig
  return (dispatch.read_plan(plan_path).kernel_names()
          == SiteConfig.for_precision("bf16").plan.kernel_names())


def bf16_mods_twin(results: ResultsFile, key: tuple, plan_path: str) -> Optional[Dict]:
  """The scored bf16+Mods row whose run the LoKA row `key` would repeat, or None.

  A plan with xla_bf16 everywhere (InterFormer `large` on the H200: no site reached 1.05x;
  `runs_bf16_mods_kernels`) is the
  program of the bf16+Mods arm (`SiteConfig.for_precision`); same seed, data
  order and Mods, so the same run. Training it again would spend a compile and the steps to
  measure only the GPU's run-to-run noise. Only a finished, scored twin of the same seed,
  recipe, Mods set and device counts; without one the LoKA arm trains."""
  from loka_jax.dispatch import PlanFileError
  arm = KEY_FIELDS.index("arm")
  twin = results.get(key[:arm] + ("bf16_mods",) + key[arm + 1:])
  if twin is None or twin.get("logloss") is None or "error" in twin:
    return None
  try:
    return twin if runs_bf16_mods_kernels(plan_path) else None
  except PlanFileError:  # the LoKA run fails on it by name and its row records why
    return None


RUNS_FOLDER = "quality"  # a bench workdir's folder of quality runs (`run_dir`'s root)


def run_dir(root: str, row: Mapping) -> str:
  """Where the run of a quality row trains under `root` (the suite's `quality` folder): one
  folder per data set and target, one per arm, seed, recipe and Mods set."""
  clip = row_clip(row)
  recipe = ((f"_warmup{row['warmup_steps']}" if row.get("warmup_steps") else "")
            + (f"_clip{clip:g}" if clip else "")
            + (f"_cooldown{row['cooldown_steps']}" if row.get("cooldown_steps") else "")
            + (f"_mods_{mods_set.folder_label(row['mods_set'])}" if row.get("mods_set")
               else ""))
  return os.path.join(root, row["data"], f"{row['model']}_{row['preset']}",
                      f"{row['arm']}_seed{row['seed']}{recipe}")


def read_curve(run_dir: str) -> Optional[Dict[str, List[float]]]:
  """A run's logged training curve from its `metrics.jsonl`: step, mean loss of each logged
  window and, where logged, its worst step (`max_loss`); None without the file."""
  path = os.path.join(run_dir, "metrics.jsonl")
  if not os.path.exists(path):
    return None
  lines = [r for r in read_metrics(path) if isinstance(r.get("loss"), (int, float))]
  return {"step": [r["step"] for r in lines], "loss": [r["loss"] for r in lines],
          "max_loss": [r.get("max_loss") for r in lines]}


def run_curves(rows: Sequence[Mapping], runs_roots: Sequence[str],
               comparison: Comparison) -> Dict[int, Dict[str, Dict]]:
  """{seed: {arm: curve}} of `comparison`'s runs, each read (`read_curve`) from the first of
  `runs_roots` (quality suites' run folders) that holds a logged curve of it."""
  curves: Dict[int, Dict[str, Dict]] = {}
  for r in rows:
    if not comparison.holds(r):
      continue
    for root in runs_roots:
      curve = read_curve(run_dir(root, r))
      if curve and curve["step"]:
        curves.setdefault(r["seed"], {})[r["arm"]] = curve
        break
  return curves


def descent_step(steps: Sequence[float], losses: Sequence[float],
                 mark: float) -> Optional[float]:
  """The step at which a logged training curve first got down to `mark`, interpolated
  between the logged windows (its first window's step where that is at or below it); None
  where it never did or a window before it is not finite."""
  for i, loss in enumerate(losses):
    if not math.isfinite(loss):
      return None
    if loss <= mark:
      if i == 0:
        return float(steps[0])
      fraction = (losses[i - 1] - mark) / (losses[i - 1] - loss)
      return float(steps[i - 1] + (steps[i] - steps[i - 1]) * fraction)
  return None


# How much of the descent is left at `descent_mark`: a quarter sits below a plateau the runs
# share (Wukong `large`: first windows 0.63-0.65, a plateau at 0.564, last windows near
# 0.48, so the mark is about 0.52), where the half-way mark sat on it.
DESCENT_LEFT = 0.25


def descent_mark(curves: Sequence[Mapping[str, Sequence[float]]],
                 left: float = DESCENT_LEFT) -> Optional[float]:
  """One loss for a comparison's runs to be timed against (`descent_step`): `left` of the
  way from their mean last window's loss back up to their mean first window's; None
  without a finite curve that went down. Shared, so runs whose first windows differ are
  timed to the same loss (each run's own half-way mark moved with its first window)."""
  ends = [(c["loss"][0], c["loss"][-1]) for c in curves
          if len(c["loss"]) >= 2 and all(math.isfinite(x) for x in (c["loss"][0], c["loss"][-1]))]
  if not ends:
    return None
  first, last = (float(np.mean(x)) for x in zip(*ends))
  return last + left * (first - last) if last < first else None


def half_descent_step(steps: Sequence[float], losses: Sequence[float]) -> Optional[float]:
  """The step at which a logged training curve first got half-way from its first window's
  mean loss down to its last one's (`descent_step` at its own mark); None when it has
  fewer than two windows or did not go down. Where runs' first windows differ their marks
  differ, so the report times every run of a comparison to one `descent_mark` instead."""
  if len(losses) < 2 or not losses[-1] < losses[0]:
    return None
  return descent_step(steps, losses, (losses[0] + losses[-1]) / 2)


def run_line(row: Mapping) -> str:
  """The log line of a finished run: its held-out log loss and its worst training step, so a
  spike shows as the runs go, not only in the final tables."""
  loss = row.get("logloss")
  return (f"    held-out log loss {'n/a' if loss is None else format(loss, '.5f')} after "
          f"{row.get('train_s', 0):.0f} s" + (
              f"; worst step {row['peak_step']}: training loss {row['peak_loss']:.3g}"
              if row.get("peak_loss") is not None else ""))


def by_seed(rows: Sequence[Mapping], comparison: Comparison, arm: str,
            seeds: Sequence[int], field: str) -> List[Optional[float]]:
  """`field` of `arm`'s row at each of `seeds` (None where the row lacks it)."""
  found = {r["seed"]: r.get(field) for r in rows
           if comparison.holds(r) and r.get("arm") == arm}
  return [found.get(s) for s in seeds]


def arm_means(rows: Sequence[Mapping], comparison: Comparison,
              seeds: Optional[Sequence[int]] = None) -> Dict[str, Dict]:
  """Per arm: mean log loss / NE / AUC over its seeds (`seeds`: only those)."""
  per: Dict[str, List[Mapping]] = {}
  for r in rows:
    if comparison.holds(r) and (seeds is None or r.get("seed") in seeds):
      per.setdefault(r["arm"], []).append(r)
  out = {}
  for arm, rs in per.items():
    out[arm] = {m: float(np.mean([r[m] for r in rs if r.get(m) is not None]))
                for m in ("logloss", "ne", "auc") if any(r.get(m) is not None for r in rs)}
    out[arm]["seeds"] = sorted(r["seed"] for r in rs)
    peaks = [r for r in rs if r.get("peak_loss") is not None]
    if peaks:  # the worst training step over the seeds (rows from before it was kept lack it)
      worst = max(peaks, key=lambda r: r["peak_loss"])
      out[arm].update(peak_loss=worst["peak_loss"], peak_seed=worst["seed"])
    out[arm]["eval_fingerprints"] = sorted({r.get("eval_fingerprint") for r in rs} - {None})
    # Seeds whose row is another arm's run (`bf16_mods_twin`), so a reader sees why it ties.
    out[arm]["twin_seeds"] = sorted(r["seed"] for r in rs if r.get("same_run_as"))
  return out
