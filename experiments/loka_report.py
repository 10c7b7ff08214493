"""The main job's report (`experiments.loka`): report.md with the per-site plan, its
validation, NE/AUC/log loss of the arms and their speed where it can be measured, and the
plan.png and arms.png it shows."""
from __future__ import annotations

import os
import time
from typing import Dict

import jax

from experiments.bench import headroom
from loka_jax import _compat
from loka_jax.dispatch import kernel_counts, pipeline
from loka_jax.dispatch import validate as validate_lib
from loka_jax.kernels import KernelPlan
from loka_jax.train import TrainConfig, experiment, report


def speed_section(result, arms_plans: Dict[str, KernelPlan], spec: experiment.RunSpec,
                  probe_train: TrainConfig) -> str:
  """Whole-step speed of the arms on a GPU; on a CPU, why not and the plan's estimate.
  `spec` and `probe_train` are the probe run's, whose trained state the steps start from."""
  estimate = pipeline.plan_speedup_estimate(result.plan, result.report)
  # What any plan from these kernels could reach: whether the budget or the kernels limit it.
  bound = pipeline.plan_speedup_estimate(headroom.speed_only(result.report, "train"),
                                         result.report)
  est = (f"GEMM-only estimate of the plan vs bf16 over the probed sites: "
         f"{estimate['speedup']:.2f}x "
         f"({estimate['source']}{'; ' + estimate['note'] if estimate.get('note') else ''}); "
         f"of the speed-only plan (every site's fastest kernel, accuracy ignored; "
         f"`experiments.report plan_headroom`): {bound['speedup']:.2f}x.")
  if not _compat.on_gpu():
    return ("Speed: not measured (not on a GPU: CPU timings say nothing about GPU kernels). "
            + est)
  context = pipeline.context_for_run(spec, result.paths["probe_dir"], probe_train,
                                     result.report)
  got = validate_lib.measure_steps(context, arms_plans, "bf16+Mods")
  lines = [f"Speed on {jax.devices()[0].device_kind} (whole steps, interleaved, 20 repeats, "
           "speedup vs bf16+Mods with bootstrap 95% CI):", "",
           "| arm | train step (us) | train speedup | inference step (us) | inference speedup |",
           "|---|---|---|---|---|"]
  for name in arms_plans:
    t, i = got["train"][name], got["infer"][name]
    lines.append(f"| {name} | {t['median_us']:.0f} | {t['speedup']:.3f} [{t['speedup_ci'][0]:.3f}, "
                 f"{t['speedup_ci'][1]:.3f}] | {i['median_us']:.0f} | {i['speedup']:.3f} "
                 f"[{i['speedup_ci'][0]:.3f}, {i['speedup_ci'][1]:.3f}] |")
  return "\n".join(lines + ["", est])


def no_fp8_hint(plan, criteria) -> str:
  """Why an all-bf16 plan is all bf16, and how to see what accuracy alone would admit."""
  if any(k != "xla_bf16" for counts in kernel_counts(plan).values() for k in counts):
    return ""
  if criteria.min_speedup is None:
    return "No FP8 kernel met the error budget at any site.\n\n"
  return ("No FP8 kernel is both within the error budget and faster than bf16 at these "
          "sites' shapes on the timing source's device, so the plan keeps bf16 everywhere and "
          "the LoKA arm equals bf16+Mods. Rerun with --config.select.min_speedup=0 to see what "
          "the error budget alone admits (its speed then judged on a GPU).\n\n")


TERMS = """## Terms

- **NE** (normalized entropy): held-out log loss divided by the entropy of the held-out
  set's positive rate (the log loss of always predicting that rate); lower is better, 1 is
  no better than that constant. **AUC**: area under the ROC curve of the held-out predictions.
- **bf16+Mods**: the model in bf16 with the Mods (No Bias, BlockNorm where the model has
  norms, Hard Swish), which make it FP8-friendly; the reference every plan is judged against.
- **LoKA (Mods + plan)**: bf16+Mods with the plan's kernel at each GEMM site and pass.
  **fp8_all K + Mods**: naive FP8, kernel K at every site and pass.
- **fwd / dgrad / wgrad**: a site's forward GEMM, its input-gradient GEMM and its
  weight-gradient GEMM.
- **SQNR**: signal-to-quantization-noise ratio of a kernel's output against an fp32
  reference in dB (higher is more accurate), the pessimistic end of its 95% CI.
  **Underflow**: the share of an operand's nonzero values that FP8 flushes to zero.
- **Speedup**: the reference's time over the kernel's or arm's; above 1 is faster, below 1
  slower. A speed verdict needs the 95% CI's low end above the bar, not the median.
"""


def write(workdir: str, result, arms, arms_plans: Dict[str, KernelPlan],
          spec: experiment.RunSpec, probe_train: TrainConfig, steps: int,
          start: float) -> str:
  """Writes report.md, plan.png and arms.png in `workdir`, prints the report, returns its text.
  `arms` holds each arm's `report.load_arm`, `arms_plans` its kernels, both by label; `spec`
  is the probe run's (bf16+Mods), `steps` each arm's training steps, `start` the job's
  start time."""
  plan = result.plan
  _, source, _ = experiment.build_run(spec)
  plan_png = report.plot_plan(plan, os.path.join(workdir, "plan.png"))
  arms_png = report.plot_arms(arms, os.path.join(workdir, "arms.png"), source.oracle_ne)
  criteria = result.criteria
  timing = plan["provenance"].get("timing_source", {})
  oracle = (f"Teacher (oracle) NE on the held-out set: {source.oracle_ne:.4f}\n\n"
            if source.oracle_ne is not None else "")
  text = "\n".join([
      f"# loka_jax main job: {spec.model}/{spec.preset} on {spec.data}, seed {spec.seed}",
      "",
      f"Probe: {probe_train.steps} bf16+Mods training steps, {len(result.report['sites'])} "
      f"sites probed, candidates {', '.join(result.report['evaluation']['kernels'])}. "
      f"Selection budget: SQNR >= {criteria.min_sqnr_fwd_db:g} dB fwd / "
      f"{criteria.min_sqnr_grad_db:g} dB gradients, underflow <= "
      f"{100 * criteria.max_underflow:g}%, "
      + (f"speedup > {criteria.min_speedup:g}x" if criteria.min_speedup is not None else
         "accuracy only (no timings here: FP8 chosen where safe, its speed judged on a GPU)")
      + f". Timing source: {timing.get('kind')} ({timing.get('reason', '')}).",
      "",
      "## Plan (`plan.json`; * = backed off by validation)", "",
      no_fp8_hint(plan, criteria) + report.plan_table(plan), "",
      f"![plan]({os.path.basename(plan_png)})", "",
      "## Validation", "",
      report.validation_lines(plan) or "- none recorded", "",
      f"## Arms ({steps} steps each, same seed, data order and held-out set)", "",
      report.comparison_table(arms, baseline="bf16+Mods"), "",
      oracle + f"![loss and NE]({os.path.basename(arms_png)})", "",
      "## Speed", "",
      speed_section(result, arms_plans, spec, probe_train), "",
      f"Wall time of this invocation: {time.time() - start:.0f} s.", "", TERMS])
  with open(os.path.join(workdir, "report.md"), "w") as f:
    f.write(text)
  print(text)
  print(f"wrote {os.path.join(workdir, 'report.md')}, {plan_png}, {arms_png}")
  return text
