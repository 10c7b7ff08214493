"""Checks the timing methods on the GPU against the profiler's kernel times (bf16 GEMMs).

  python3 -m experiments.measure timing_check     (GPU; prints one JSON line a shape)

Per shape: unblocked back-to-back direct calls; the probe's timing (`kernel_timing.
_time_interleaved`: one chain less its floor for products under SHORT_FLOPS, else single
calls back to back); `timing.time_variants`; and the profiler's device time of one call and
of a chain of 16 (`timing.chain`). The H200 numbers of
docs/results/timing_loop_check_h200_2026-11-27.txt (checks 3 and 4) came from this.
"""
import collections
import json
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from absl import app

from loka_jax import timing
from experiments.bench import profile
from loka_jax.probe import kernel_timing

SHAPES = [(16384, 4096, 4096), (8192, 2048, 2048), (4096, 1024, 1024), (4096, 256, 256),
          (512, 256, 64)]


def _direct_us(f, a, b, calls=50):
  """Median per call of `calls` unblocked back-to-back calls, blocked on the last."""
  return timing.time_calls({"direct": lambda: f(a, b)}, repeats=10, warmup=1,
                           calls_per_sample=calls)["direct"].median_us


def _profiled_us(call, calls_per_dispatch, iterations=4):
  kernels, _ = profile.device_events(
      profile.profile_calls({"c": call}, tempfile.mkdtemp(), iterations=iterations))
  per = collections.defaultdict(float)
  for k in kernels:
    per[k["name"][:40]] += k["dur_us"] / (iterations * calls_per_dispatch)
  return {n: round(v, 2) for n, v in sorted(per.items(), key=lambda x: -x[1])[:4]}


def main(_):
  product = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)
  for m, k, n in SHAPES:
    a = timing.random_normal(jax.random.PRNGKey(0), (m, k), jnp.bfloat16)
    b = timing.random_normal(jax.random.PRNGKey(1), (k, n), jnp.bfloat16)
    flops = 2 * m * k * n
    probe = kernel_timing._time_interleaved(
        {"g": (product, [a, b])}, repeats=15, short=flops < kernel_timing.SHORT_FLOPS)["g"]
    one = jax.jit(product).lower(a, b).compile()
    chained = timing.chain(product, 16).lower(a, b).compile()
    row = {"shape": f"{m}x{k}x{n}", "direct_async_us": round(_direct_us(one, a, b), 1),
           "probe_us": round(float(np.median(probe["seconds"])) * 1e6, 2),
           "probe_floor_us": probe["floor_us"], "probe_inner": probe["inner"],
           "time_variants_us": round(timing.time_variants(
               {"g": (product, (a, b))}, repeats=15)["g"].median_us, 2),
           "profiler_one_call_us": _profiled_us(lambda: one(a, b), 1),
           "profiler_chain16_us_per_call": _profiled_us(lambda: chained(a, b), 16)}
    print(json.dumps(row), flush=True)

