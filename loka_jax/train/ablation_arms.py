"""What the Mods ablation runs: the on/off combinations of No Bias, BlockNorm and Hard Swish,
its settings (`AblationConfig`) and its arms (a combination in one precision with one seed),
each an `experiment.run`. The arms of one seed pair: the same initialization key, data order
and held-out set (the verdicts compare them seed by seed)."""
from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Dict, List, Optional, Sequence, Tuple

from loka_jax import _compat
from loka_jax.models.presets import MODS
from loka_jax.train import OptimConfig, TrainConfig, experiment

PRECISIONS = ("bf16", "fp8_all")
SHORT = {"no_bias": "NB", "blocknorm": "BN", "hard_swish": "HS"}
TIMING_MODES = ("auto", "off", "force")
# Settings a rerun may change (which arms, how they run); anything else must match.
FREE_SETTINGS = ("combinations", "precisions", "seeds", "timing", "repeats", "workers",
                 "keep_checkpoints", "data_cache")

Combination = Tuple[str, ...]


def all_combinations() -> Tuple[Combination, ...]:
  """The 8 on/off combinations: none, each mod alone, the pairs, all three."""
  return tuple(c for r in range(len(MODS) + 1) for c in itertools.combinations(MODS, r))


def combination_key(mods: Combination) -> str:
  """File-name form: 'none' or the mods joined by '+', e.g. 'no_bias+hard_swish'."""
  return "+".join(mods) if mods else "none"


def combination_label(mods: Combination) -> str:
  """Short form for tables and plots: 'baseline' or e.g. 'NB+HS'."""
  return "+".join(SHORT[m] for m in mods) if mods else "baseline"


def parse_combinations(items: Sequence[str]) -> Tuple[Combination, ...]:
  """Combinations from keys: 'none', 'all' (the three mods), or mods joined by '+'.
  An empty list means all 8."""
  if isinstance(items, str):
    items = items.split(",")
  items = [i.strip() for i in items if i and i.strip()]
  if not items:
    return all_combinations()
  out = []
  for item in items:
    if item == "none":
      mods = ()
    elif item == "all":
      mods = MODS
    else:
      names = item.split("+")
      unknown = [n for n in names if n not in MODS]
      if unknown:
        raise ValueError(f"unknown mod(s) {unknown} in combination {item!r}; use 'none', "
                         f"'all' or mods from {', '.join(MODS)} joined by '+'")
      mods = tuple(m for m in MODS if m in names)
    if mods not in out:
      out.append(mods)
  return tuple(out)


@dataclasses.dataclass(frozen=True)
class AblationConfig:
  """What to ablate and how."""
  model: str = "wukong"
  preset: str = "tiny"
  steps: int = 60
  batch_size: Optional[int] = None          # None: the preset's
  num_eval: int = 2048                      # held-out examples (same set for every arm)
  kernel: str = "xla_fp8_tensorwise"        # the FP8 arm's one kernel at every site
  data: str = "synthetic"                   # data source (timing always uses synthetic)
  data_path: Optional[str] = None
  data_cache: Optional[str] = None
  learning_rate: float = OptimConfig.learning_rate
  # A linear warm-up of the learning rates over this many steps (0: none). The `large`
  # presets' first steps spike without one, in bf16 as well.
  warmup_steps: int = 0
  combinations: Tuple[Combination, ...] = all_combinations()
  precisions: Tuple[str, ...] = PRECISIONS
  # Every arm trains at each seed (its initialization key and data order); the arms of one
  # seed pair in the verdicts, which need two seeds or more to measure a spread.
  seeds: Tuple[int, ...] = (0,)
  timing: str = "auto"                      # 'auto': on a GPU only; 'off'; 'force': also CPU
  repeats: int = 20                         # timed repeats per variant (interleaved)
  workers: int = 1                          # arms trained at once (threads; 1 on a GPU)
  keep_checkpoints: bool = False            # keep finished arms' checkpoints (disk)
  # The arms run XLA's deterministic GPU ops (`xla_env.DETERMINISTIC`, which the script sets
  # before JAX starts), so each repeats bit for bit; never with timing, which it would slow.
  xla_deterministic: bool = False

  def __post_init__(self):
    for p in self.precisions:
      if p not in PRECISIONS:
        raise ValueError(f"unknown precision {p!r} for the ablation; use {PRECISIONS}")
    if self.timing not in TIMING_MODES:
      raise ValueError(f"timing={self.timing!r}; use one of {TIMING_MODES}")
    if self.steps < 1 or self.num_eval < 1 or self.workers < 1 or self.repeats < 1:
      raise ValueError(f"ablation: steps={self.steps}, num_eval={self.num_eval}, "
                       f"workers={self.workers} and repeats={self.repeats} must all be >= 1")
    if not 0 <= self.warmup_steps <= self.steps:
      raise ValueError(f"warmup_steps must be in [0, steps={self.steps}], got "
                       f"{self.warmup_steps}")
    if (not self.seeds or len(set(self.seeds)) != len(self.seeds)
        or not all(isinstance(s, int) and s >= 0 for s in self.seeds)):
      raise ValueError(f"ablation seeds {self.seeds}: list distinct non-negative integers, "
                       "e.g. 0,1,2")
    if self.xla_deterministic and self.timing != "off":
      raise ValueError("xla_deterministic slows the steps the ablation times: use it with "
                       "timing='off'")

  @property
  def batch(self) -> int:
    return self.batch_size or experiment.preset_batch_size(self.model, self.preset)

  def shared_settings(self) -> Dict[str, Any]:
    """What every arm shares (settings.json)."""
    d = dataclasses.asdict(self)
    out = {k: v for k, v in d.items() if k not in FREE_SETTINGS}
    out["batch_size"] = self.batch
    # A workdir from before the warm-up or the deterministic ops existed keeps its settings.
    for key in ("warmup_steps", "xla_deterministic"):
      if not out[key]:
        del out[key]
    return out


@dataclasses.dataclass(frozen=True)
class Arm:
  """One training run: a mods combination in one precision with one seed."""
  mods: Combination
  precision: str
  seed: int

  @property
  def name(self) -> str:
    return f"{self.precision}__{combination_key(self.mods)}__seed{self.seed}"


def arms(config: AblationConfig) -> List[Arm]:
  """Every arm: combinations x precisions at each seed, seed by seed (the first seed's arms
  first, so a run stopped early has whole seeds)."""
  return [Arm(c, p, s) for s in config.seeds for c in config.combinations
          for p in config.precisions]


def run_spec(config: AblationConfig, arm: Arm) -> experiment.RunSpec:
  return experiment.RunSpec(model=config.model, preset=config.preset, data=config.data,
                            data_path=config.data_path, data_cache=config.data_cache,
                            precision=arm.precision, kernel=config.kernel, mods=arm.mods,
                            seed=arm.seed, num_eval=config.num_eval)


def train_config(config: AblationConfig, seed: int) -> TrainConfig:
  return TrainConfig(steps=config.steps, batch_size=config.batch, seed=seed,
                     log_every=max(1, config.steps // 4), checkpoint_every=0,
                     keep_checkpoints=1, progress=False,
                     optim=OptimConfig(learning_rate=config.learning_rate,
                                       warmup_steps=config.warmup_steps))


def timing_enabled(config: AblationConfig) -> bool:
  """Whether the combinations are timed: on a GPU, or anywhere with timing='force'."""
  return config.timing == "force" or (config.timing == "auto" and _compat.on_gpu())

