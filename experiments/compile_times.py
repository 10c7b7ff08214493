"""XLA compile seconds of one short training run, per compiled program (the test suite's cost).

  XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true" \
    python3 -m experiments.compile_times --model=wukong --steps=30

Runs `experiment.run` on a fresh workdir without a compilation cache and prints, from JAX's
"Finished XLA compilation" log lines, the three costliest programs, the compile total and the
run's wall time. Compare XLA_FLAGS settings in fresh processes: the thirteenth session's
numbers for `--xla_cpu_use_fusion_emitters=false` (docs/BENCHMARKS.md) came from this.
"""
import logging
import re
import tempfile
import time

import jax
from absl import app, flags

from loka_jax.models.presets import MODEL_NAMES, PRESETS
from loka_jax.train import TrainConfig, experiment

MODEL = flags.DEFINE_enum("model", "wukong", MODEL_NAMES, "tower")
PRESET = flags.DEFINE_enum("preset", "tiny", PRESETS, "size preset")
STEPS = flags.DEFINE_integer("steps", 30, "training steps")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "training batch")
NUM_EVAL = flags.DEFINE_integer("num_eval", 512, "held-out examples")

_FINISHED = re.compile(r"Finished XLA compilation of (.+) in ([0-9.]+) sec")


class _CompileSeconds(logging.Handler):
  """Sums compile seconds per program name from JAX's compile log."""

  def __init__(self):
    super().__init__()
    self.seconds = {}

  def emit(self, record):
    match = _FINISHED.search(record.getMessage())
    if match:
      name = match.group(1)
      self.seconds[name] = self.seconds.get(name, 0.0) + float(match.group(2))


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  jax.config.update("jax_compilation_cache_dir", None)
  jax.config.update("jax_log_compiles", True)
  counter = _CompileSeconds()
  logging.getLogger("jax._src.dispatch").addHandler(counter)
  spec = experiment.RunSpec(model=MODEL.value, preset=PRESET.value, num_eval=NUM_EVAL.value)
  start = time.perf_counter()
  experiment.run(spec, tempfile.mkdtemp(prefix="loka_compile_times_"), TrainConfig(
      steps=STEPS.value, batch_size=BATCH_SIZE.value, log_every=STEPS.value,
      checkpoint_every=0, progress=False))
  wall = time.perf_counter() - start
  top = sorted(counter.seconds.items(), key=lambda kv: -kv[1])[:3]
  print(f"{MODEL.value}/{PRESET.value}, {STEPS.value} steps: wall {wall:.1f} s, compile "
        f"{sum(counter.seconds.values()):.1f} s; costliest: "
        + ", ".join(f"{name} {s:.1f} s" for name, s in top))


if __name__ == "__main__":
  app.run(main)
