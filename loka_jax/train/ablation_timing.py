"""The Mods ablation's timing: a combination's train step (fwd + bwd + optimizer) and
inference in bf16 and FP8 against the bf16 baseline without Mods, interleaved in one process
by the protocol of `loka_jax.timing` (on a GPU; on a CPU only as a smoke test)."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import jax

from loka_jax import _compat, timing
from loka_jax.data import FeatureSpec, make_source
from loka_jax.models.presets import (apply_mods, build_model, check_keep_bias, get_config,
                                    tower_flops)
from loka_jax.models.site import SiteConfig
from loka_jax.train.ablation_arms import AblationConfig, Combination, combination_key
from loka_jax.train import loop
from loka_jax.train.optim import OptimConfig, make_optimizer
from loka_jax.train.state import create_train_state


def step_calls(model_name: str, preset: str, precision: str, kernel: str,
               mods: Sequence[str] = (), batch_size: Optional[int] = None, seed: int = 0
               ) -> Tuple[Callable[[], Any], Callable[[], Any], Dict[str, Any]]:
  """(train_call, infer_call, info): argument-less calls running one train step and one
  inference step of the preset, in `precision` with `kernel` and the `mods` on, on fixed
  synthetic data; info holds the batch, FLOPs per example and each step's memory."""
  config = get_config(model_name, preset)
  if mods:
    config = apply_mods(config, mods)
  batch_size = batch_size or int(config.batch_size)
  features = FeatureSpec.from_dict(dict(config.features))
  source = make_source("synthetic", features=features, seed=seed, num_eval=batch_size)
  model = build_model(config, source.features, SiteConfig.for_precision(precision, kernel=kernel))
  check_keep_bias(model, config, lambda: source.train_batch(0, 2))
  batch = jax.device_put(source.train_batch(0, batch_size))  # real data, never zeros
  optim = OptimConfig()
  train_step, eval_step = loop.compiled_steps(model, optim, "stop")
  state = create_train_state(model, make_optimizer(optim), batch, seed)
  # Call the compiled executables directly: one compile each, also read for memory use.
  compiled_train = train_step.lower(state, batch).compile()
  compiled_eval = eval_step.lower(state, batch).compile()
  info = {"batch_size": batch_size, "flops_per_example": int(tower_flops(config, features)),
          "train_memory_bytes": timing.memory_bytes(compiled_train),
          "infer_memory_bytes": timing.memory_bytes(compiled_eval)}
  holder = {"state": state}

  def train_call():
    holder["state"], metrics = compiled_train(holder["state"], batch)
    return metrics["loss"]

  def infer_call():
    return compiled_eval(holder["state"], batch)

  return train_call, infer_call, info


def timing_variants(config: AblationConfig, mods: Combination
                    ) -> List[Tuple[str, str, Combination]]:
  """(name, precision, mods) of one timing row's variants: the bf16 baseline (no mods) and
  both precisions of `mods`, so every speedup has its baseline in the same interleaved run."""
  pairs = [("bf16", ())] + [(p, mods) for p in config.precisions if (p, mods) != ("bf16", ())]
  return [(f"{p}__{combination_key(m)}", p, m) for p, m in pairs]


def time_combination(config: AblationConfig, mods: Combination) -> Dict[str, Any]:
  """One timing row: train-step and inference time of `timing_variants`, interleaved."""
  variants = timing_variants(config, mods)
  prepared = {name: step_calls(config.model, config.preset, precision, config.kernel, m,
                               config.batch, seed=config.seeds[0])
              for name, precision, m in variants}
  baseline = variants[0][0]
  row = {"combination": combination_key(mods), "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "batch_size": config.batch, "repeats": config.repeats,
         "gpu": _compat.on_gpu(), "fp8_vs_bf16": {},
         "variants": {name: {"info": p[2]} for name, p in prepared.items()}}
  for mode, index in (("train", 0), ("infer", 1)):
    # Short steps run back to back, as many a sample as fill MIN_CALL_S on the baseline (one
    # count for every variant), so host dispatch jitter is spread over them.
    per_sample = timing.calls_for(prepared[baseline][index], timing.MIN_CALL_S)
    timings = timing.time_calls({n: p[index] for n, p in prepared.items()},
                                repeats=config.repeats, calls_per_sample=per_sample)
    for name, summary in timing.summarize(timings, baseline).items():
      row["variants"][name][mode] = summary
    bf16, fp8 = f"bf16__{combination_key(mods)}", f"fp8_all__{combination_key(mods)}"
    if bf16 in timings and fp8 in timings:
      row["fp8_vs_bf16"][mode] = list(timing.speedup_ci(timings[bf16], timings[fp8]))
  return row
