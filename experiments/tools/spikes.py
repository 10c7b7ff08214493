"""Which module a training-loss spike started in, from a run trained with --module_norms.

  python -m experiments.train --config.run.model=dcnv2 --config.run.preset=large \
      --config.run.mods=no_bias,hard_swish --config.run.steps=200 \
      --config.optim.warmup_steps=50 --config.run.seed=2 --config.run.batch_size=4096 \
      --config.train.xla_deterministic=true --config.train.module_norms=true \
      --config.train.log_every=1 --workdir=/tmp/spike
  python3 -m experiments.report spikes --workdir=/tmp/spike

Prints the loss's worst step and first jump, each module whose gradient norm jumped (first
above --grad_factor x its median over the --window logged steps before), earliest first, and
each module whose output RMS jumped (--output_factor); writes spike.json, spike.md and
spike.png into --out (default: the run directory).
"""
import os
import sys

from absl import app, flags

from loka_jax import jsonio
from loka_jax.train import spikes

WORKDIR = flags.DEFINE_string("workdir", None, "The run directory (or its metrics.jsonl).")
OUT = flags.DEFINE_string("out", None, "Where to write spike.json/.md/.png; default: the run "
                          "directory.")
GRAD_FACTOR = flags.DEFINE_float("grad_factor", spikes.GRAD_FACTOR,
                                 "A module's gradient (or update) norm jumps above this many "
                                 "times its recent median.")
LOSS_FACTOR = flags.DEFINE_float("loss_factor", spikes.LOSS_FACTOR,
                                 "The loss spikes above this many times its recent median.")
OUTPUT_FACTOR = flags.DEFINE_float("output_factor", spikes.OUTPUT_FACTOR,
                                   "A module's output RMS jumps above this many times its "
                                   "recent median.")
WINDOW = flags.DEFINE_integer("window", spikes.WINDOW,
                              "Logged steps the recent median is taken over.")
MIN_HISTORY = flags.DEFINE_integer("min_history", spikes.MIN_HISTORY,
                                   "Logged steps a series needs before it can jump.")
TOP = flags.DEFINE_integer("top", 12, "Modules listed in the table (the plot shows 6).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not WORKDIR.value:
    raise app.UsageError("--workdir is required (a run trained with --module_norms)")
  try:
    trace = spikes.read_trace(WORKDIR.value)
    summary = spikes.summarize(trace, grad_factor=GRAD_FACTOR.value,
                               loss_factor=LOSS_FACTOR.value,
                               output_factor=OUTPUT_FACTOR.value, window=WINDOW.value,
                               min_history=MIN_HISTORY.value)
  except (spikes.NormTraceError, ValueError) as e:
    sys.exit(f"error: {e}")
  out = OUT.value or os.path.dirname(os.path.abspath(trace.path))
  text = spikes.markdown(summary, top=TOP.value)
  jsonio.write_json_atomic(os.path.join(out, "spike.json"), summary)
  jsonio.write_text_atomic(os.path.join(out, "spike.md"), text)
  plot = spikes.spike_plot(trace, summary, os.path.join(out, "spike.png"))
  print(text)
  print(f"wrote {os.path.join(out, 'spike.json')}, {os.path.join(out, 'spike.md')}, {plot}")

