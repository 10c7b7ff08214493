r"""How much the probe's delayed-scaling errors change when each sample's scale is warmed on
other samples rather than on the sample itself.

  python3 -m experiments.measure delayed_warmup --model=dcnv2 --preset=tiny --steps=300 \
      --workdir=DIR

The probe evaluates a delayed-scaling op on each sample after warming its amax history on
the DELAYED_WARMUP samples before it in the same vmapped chunk, so the evaluator keeps
DELAYED_WARMUP + 1 samples a chunk where such an op is evaluated
(`evaluate.fused_chunk_floor`). A chunk of one sample would warm the history on the sample
itself: the op would read as current scaling and never saturate. This runs one probe
(trained once) and evaluates it both ways, "itself" (one sample a chunk, --chunk_elements
small enough that the memory bound allows no more) and "others" (the evaluator's floor),
and prints each delayed op's pessimistic SQNR and largest elementwise error both ways, and
the selections that differ. Writes WORKDIR/delayed_warmup.json (docs/FINDINGS.md entry 5).
"""
import os
import shutil

from absl import app, flags

from experiments import common_flags as common  # the common flags, defined once

BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Training batch size.")
SAMPLES = flags.DEFINE_integer("samples", 32, "Draws per site and source.")
CHUNK_ELEMENTS = flags.DEFINE_integer("chunk_elements", 1024, "Operand elements vmapped at "
                                      "once: small, so that the memory bound gives one sample "
                                      "a chunk.")
KERNELS = flags.DEFINE_list("kernels", ["xla_bf16", "xla_fp8_tensorwise", "flax_fp8_delayed",
                                        "flax_fp8_delayed_grad_lhs"], "Probe candidates.")
SITES = flags.DEFINE_string("sites", None, "Regex (re.search): probe only these sites; "
                            "default every site.")
DELAYED = ("flax_fp8_delayed", "pallas_fp8_delayed")


def main(argv):
  del argv
  from loka_jax import jsonio
  from loka_jax.kernels import registry
  from loka_jax.probe import ProbeConfig, ProbeOptions, evaluate, runner
  from loka_jax.probe.eligibility import Criteria
  from loka_jax.train import TrainConfig, experiment

  unknown = [k for k in KERNELS.value if k not in registry.names()]
  if unknown:
    raise app.UsageError(f"--kernels: unknown {unknown}; known: {', '.join(registry.names())}")
  if not any(k in DELAYED for k in KERNELS.value):
    raise app.UsageError(f"--kernels: none of {', '.join(DELAYED)}, so nothing warms a "
                         "delayed-scaling state to compare")
  workdir = common.WORKDIR.value
  if not workdir:
    raise app.UsageError("--workdir is required: the probe's run and delayed_warmup.json")
  spec = experiment.RunSpec(model=common.MODEL.value, preset=common.PRESET.value,
                            mods=("all",), num_eval=512)
  options = ProbeOptions(samples=SAMPLES.value, kernels=tuple(KERNELS.value),
                         chunk_elements=CHUNK_ELEMENTS.value, sites=SITES.value,
                         plots=False, site_plots=False,
                         bootstrap=200, criteria=Criteria(min_speedup=None))
  config = TrainConfig(steps=common.STEPS.value, batch_size=BATCH_SIZE.value, progress=False,
                       log_every=0)
  reports, floor = {}, evaluate.fused_chunk_floor
  try:
    for way, chunk_floor in (("itself", lambda samples: 1), ("others", floor)):
      evaluate.fused_chunk_floor = chunk_floor   # "itself": one sample a chunk
      folder = os.path.join(workdir, way)
      if way == "others":  # the same trained statistics, evaluated again (cache dropped)
        shutil.copytree(os.path.join(workdir, "itself"), folder, dirs_exist_ok=True)
        os.remove(os.path.join(folder, runner.EVAL_CACHE))
      reports[way] = runner.run_probe(spec, folder, config, ProbeConfig(cadence=25),
                                      options).report
  finally:
    evaluate.fused_chunk_floor = floor
  rows = []
  for site, entry in reports["itself"]["sites"].items():
    for p, entries in entry["passes"].items():
      for kernel in DELAYED:
        a, b = entries.get(kernel), reports["others"]["sites"][site]["passes"][p].get(kernel)
        if a and b and a.get("sqnr_db") and b.get("sqnr_db"):
          rows.append({"site": site, "pass": p, "kernel": kernel,
                       "sqnr_db_lo": [a["sqnr_db"][0], b["sqnr_db"][0]],
                       "mere_hi": [a["mere"][2], b["mere"][2]]})
  picks = {way: {s: {p: e["best"][p]["kernel"] for p in e["best"]}
                 for s, e in r["sites"].items()} for way, r in reports.items()}
  changed = {s: {"itself": picks["itself"][s], "others": picks["others"][s]}
             for s in picks["itself"] if picks["itself"][s] != picks["others"][s]}
  chunks = {way: sorted({e["evaluation"]["chunk_samples"] for e in r["sites"].values()})
            for way, r in reports.items()}
  jsonio.write_json_atomic(os.path.join(workdir, "delayed_warmup.json"),
                           {"spec": spec.run_info(), "chunks": chunks, "rows": rows,
                            "selection_changes": changed})
  print(f"samples a chunk: {chunks}")
  print("| site | pass | kernel | SQNR lo dB: itself -> others | largest rel. error: itself "
        "-> others |\n|---|---|---|---|---|")
  for r in sorted(rows, key=lambda r: r["sqnr_db_lo"][1] - r["sqnr_db_lo"][0]):
    print(f"| {r['site']} | {r['pass']} | {r['kernel']} | {r['sqnr_db_lo'][0]:.1f} -> "
          f"{r['sqnr_db_lo'][1]:.1f} | {r['mere_hi'][0]:.3f} -> {r['mere_hi'][1]:.3f} |")
  print(f"selections that differ: {changed or 'none'}")

