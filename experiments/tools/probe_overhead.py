r"""What the probe's statistics pass costs against the training step, and where its time goes.

  python3 -m experiments.measure probe_overhead --model=wukong --preset=small \
      --out=overhead.json [--parts] [--probe_config=weight_every=4,pass_compile=cublas]

Builds the bf16+Mods tower of the preset, times its jitted training step and the statistics
pass (`loka_jax.probe.collector.StatisticsPass`, what the probe runs every `cadence` steps)
in steady state (compiled first, then the median of --repeats calls, each waited for), and
its extract stage (the loss's forward and backward with every site's operands and output
gradient returned); with --parts also, summed over the sites, the Gaussian, matrix-normal,
underflow-table, amax and reservoir updates, each on its own. Prints the pass's
share of training time at each of --cadences (pass / (cadence x step)) and writes a JSON row
with --out. Needs a GPU for numbers that mean anything; on a CPU it runs, slowly.
"""
import dataclasses
import datetime
import json
import sys
import time

from absl import app, flags

from experiments import common_flags as common  # the common flags, defined once

BATCH_SIZE = flags.DEFINE_integer("batch_size", 0, "Training batch; 0: the preset's.")
REPEATS = flags.DEFINE_integer("repeats", 10, "Timed calls of each function (median).")
CADENCES = flags.DEFINE_list("cadences", ["25", "50", "100", "200"],
                             "Steps between observations at which to state the share.")
PARTS = flags.DEFINE_bool("parts", False, "Also time each part of the updates on its own "
                          "(compiles five functions per distinct site: minutes on a GPU).")
OUT = flags.DEFINE_string("out", None, "Write the row here (JSON).")
CONFIG = flags.DEFINE_string("probe_config", "", "ProbeConfig fields, FIELD=VALUE,... (for "
                             "example weight_every=4).")


def _say(text: str) -> None:
  print(f"[probe_overhead] {text}", flush=True)


def _median_ms(fn, repeats: int) -> float:
  import jax
  import numpy as np
  jax.block_until_ready(fn())   # compiles (and warms) outside the timing
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return 1e3 * float(np.median(times))


def _probe_config(text: str):
  from loka_jax.probe import ProbeConfig
  fields = {f.name: f.type for f in dataclasses.fields(ProbeConfig)}
  values = {}
  for item in filter(None, text.split(",")):
    name, _, value = item.partition("=")
    if name not in fields or not value:
      raise app.UsageError(f"--probe_config: {item!r} is not FIELD=VALUE with a ProbeConfig "
                           f"field ({', '.join(fields)})")
    kind = str(fields[name])
    try:
      values[name] = (value if kind == "str" else bool(int(value)) if kind == "bool"
                      else float(value) if kind == "float" else int(value))
    except ValueError:
      raise app.UsageError(f"--probe_config: {item!r}: {name} takes a {kind}") from None
  return ProbeConfig(**values)


def _parts(sp, state, operands, keys):
  """{part: milliseconds summed over the sites} of each part of the sites' updates
  (`collector.UPDATE_PARTS`), each jitted alone, once per distinct site."""
  import functools
  import jax
  from loka_jax.probe import collector

  totals = {}
  compiled = {}
  for i, (name, site) in enumerate(sp.sites.items()):
    _say(f"parts of site {i + 1}/{len(sp.sites)} {name}")
    k = sp.names[name]
    update_key = collector._update_key(site, sp.config)
    if update_key not in compiled:
      # Observation 0: the matrix normal refits, as on one observation in weight_every.
      compiled[update_key] = {
          part: jax.jit(functools.partial(collector.update_part, part, site=site,
                                          config=sp.config),
                        compiler_options=collector.PASS_COMPILES[sp.config.pass_compile] or None)
          for part in collector.UPDATE_PARTS}
    for part, fn in compiled[update_key].items():
      st, (lhs, rhs, grad), key = state["sites"][k], operands[k], keys[i]
      ms = _median_ms(lambda: fn(st, lhs=lhs, rhs=rhs, grad=grad, key=key), REPEATS.value)
      if part == "matrix_normal":  # what one observation costs on average
        ms /= sp.config.weight_every
      totals[part] = totals.get(part, 0.0) + ms
  return totals


def _command_line(argv) -> str:
  """The command that measured, for the row RESULTS reads: this subcommand's arguments, as
  given, without --out (where the JSON went) and its value."""
  rest = argv[argv.index("probe_overhead") + 1:] if "probe_overhead" in argv else argv[1:]
  kept, skip_value = [], False
  for arg in rest:
    if skip_value or arg.startswith("--out="):
      skip_value = False
      continue
    skip_value = arg == "--out"
    if not skip_value:
      kept.append(arg)
  return " ".join(["python3 -m experiments.measure probe_overhead", *kept])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  import jax
  from loka_jax.probe.training import STATS_KEY, ProbeCollector, probe_sites
  from loka_jax.train import OptimConfig, experiment
  from loka_jax.train.state import create_train_state
  from loka_jax.train.optim import make_optimizer
  from loka_jax.train.steps import compiled_steps

  cadences = [int(c) for c in CADENCES.value]
  probe_config = _probe_config(CONFIG.value)
  spec = experiment.RunSpec(model=common.MODEL.value, preset=common.PRESET.value,
                            mods=("all",))
  batch_size = BATCH_SIZE.value or experiment.preset_batch_size(spec.model, spec.preset)
  model, source, _ = experiment.build_run(spec)
  batch = jax.device_put(source.train_batch(0, batch_size))
  optim = OptimConfig()
  train_step, _ = compiled_steps(model, optim, "stop")
  state = create_train_state(model, make_optimizer(optim), batch, seed=0)

  holder = {"state": state}

  def step():
    holder["state"], metrics = train_step(holder["state"], batch)
    return metrics

  step_ms = _median_ms(step, REPEATS.value)
  _say(f"train step {step_ms:.1f} ms")
  state = holder["state"]
  sites = probe_sites(model, None, batch, probe_config)
  collector = ProbeCollector(model, source, batch_size, sites, probe_config)
  sp = collector.probe.statistics_pass
  variables, rng, key = state.variables(), state.rng, jax.random.PRNGKey(1)
  parts = {"extract": _median_ms(lambda: sp.extract(variables, batch, rng), REPEATS.value)}
  _say(f"extract stage {parts['extract']:.1f} ms")
  if PARTS.value:
    operands = sp.extract(variables, batch, rng)
    parts.update(_parts(sp, collector.state, operands,
                        jax.random.split(key, len(sp.sites))))
    del operands
  # Successive observations (so that weight_every's skipped refits count), holding one state.
  observed = {"stats": collector.extras.pop(STATS_KEY)}

  def observe():
    observed["stats"] = sp(observed["stats"], variables, batch, rng, key)
    return observed["stats"]

  began = time.perf_counter()
  jax.block_until_ready(observe())   # the first observation compiles the pass
  compile_s = time.perf_counter() - began
  _say(f"statistics pass compiled and run once in {compile_s:.1f} s")
  pass_ms = _median_ms(observe, REPEATS.value)
  row = {"device": jax.devices()[0].device_kind, "jax": jax.__version__,
         "date": datetime.date.today().isoformat(), "command": _command_line(sys.argv),
         "model": spec.model, "preset": spec.preset, "batch_size": batch_size,
         "sites": len(sites), "probe_config": probe_config.to_dict(),
         "step_ms": round(step_ms, 2), "pass_ms": round(pass_ms, 2),
         "pass_first_call_s": round(compile_s, 1),
         "fraction": {c: round(pass_ms / (c * step_ms), 4) for c in cadences},
         "parts_ms": {k: round(v, 2) for k, v in parts.items()}}
  print(f"{spec.model}/{spec.preset} batch {batch_size} on {row['device']}: train step "
        f"{step_ms:.1f} ms, statistics pass {pass_ms:.1f} ms over {len(sites)} sites (first "
        f"call, compiling it: {compile_s:.1f} s)")
  for part, ms in row["parts_ms"].items():
    print(f"  {part:14s} {ms:8.1f} ms")
  for c in cadences:
    print(f"  every {c:4d} steps: {100 * row['fraction'][c]:6.2f}% of training time")
  if OUT.value:
    with open(OUT.value, "w") as f:
      json.dump(row, f, indent=1)
    print(f"[probe_overhead] wrote {OUT.value}")


if __name__ == "__main__":
  app.run(main)
