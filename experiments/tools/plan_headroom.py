r"""How far a target's plans are from what its probed kernels could give a step (CPU).

  python3 -m experiments.report plan_headroom --report=PROBE_REPORT.json[.gz] \
      --plans=loka=PLAN.json[,selected=PLAN_SELECTED.json] \
      [--kernels=flax_fp8_delayed,...] [--rows=BENCH.jsonl,... --baseline=bf16_mods] \
      [--train_step_ms=163 --infer_step_ms=49] [--train_target=1.25 --infer_target=1.5] \
      [--top=10] [--out=DIR]

Sums the report's kernel timings per plan (`experiments/bench/headroom.py`): the GEMM time each
plan saves over xla_bf16, in training (every pass) and inference (forwards), beside each
kernel everywhere and the speed-only plan (the accuracy budget off: what no plan from these
kernels exceeds). With a measured step (the baseline variant's row in --rows, or the
*_step_ms flags) each saving becomes a projected speedup, and the rows' own measured
speedups stand beside it. Then the sites where the first plan forgoes most against the
speed-only plan, with its reasons. Writes headroom.md, headroom.json and headroom.png under
--out when given.
"""
import os

from absl import app, flags

REPORT = flags.DEFINE_string("report", None, "The probe report (plain or gzipped JSON).",
                             required=True)
PLANS = flags.DEFINE_list("plans", [], "name=PLAN.json pairs; the first is the one whose "
                          "forgone sites are listed. Name a plan as its bench variant "
                          "(e.g. loka) to set its measured speedup beside it.")
KERNELS = flags.DEFINE_list("kernels", None, "Kernels to time everywhere (default: the FP8 "
                            "kernels the report probed).")
ROWS = flags.DEFINE_list("rows", [], "Bench rows (JSONL) of the report's target: the "
                         "baseline's step and each variant's measured speedup.")
BASELINE = flags.DEFINE_string("baseline", "bf16_mods", "The variant the speedups are over.")
INFER_BASELINE = flags.DEFINE_string(
    "infer_baseline", None, "The variant inference's speedups are over (default: --baseline; "
    "bf16_mods_served where LoKA's row infers from its export).")
SUBJECT = flags.DEFINE_string("subject", None, "The rows' subject (default: the report's "
                              "model/preset).")
DEVICE = flags.DEFINE_string("device", None, "Only rows of this device kind (default: the "
                             "report's).")
TRAIN_STEP = flags.DEFINE_float("train_step_ms", None, "The baseline's training step, if "
                                "not from --rows.")
INFER_STEP = flags.DEFINE_float("infer_step_ms", None, "The baseline's inference step, if "
                                "not from --rows.")
TRAIN_TARGET = flags.DEFINE_float("train_target", None, "A training speedup target to mark.")
INFER_TARGET = flags.DEFINE_float("infer_target", None, "An inference speedup target.")
TOP = flags.DEFINE_integer("top", 10, "How many forgone sites to list per mode.")
OUT = flags.DEFINE_string("out", None, "Folder for headroom.md, .json and .png.")


def _named_plans():
  from loka_jax.dispatch import read_plan
  plans = {}
  for item in PLANS.value:
    name, sep, path = item.partition("=")
    if not sep or not name or not path:
      raise app.UsageError(f"--plans item {item!r}: give name=PLAN.json")
    if name in plans:
      raise app.UsageError(f"--plans names {name!r} twice")
    plans[name] = read_plan(path)
  return plans


def main(argv):
  del argv
  from loka_jax import jsonio
  from experiments.bench import collect, headroom
  from loka_jax.probe.report import load_report

  try:
    report = load_report(REPORT.value)
    plans = _named_plans()
    kernels = (KERNELS.value if KERNELS.value is not None
               else headroom.probed_fp8_kernels(report))
    steps = {"train": TRAIN_STEP.value, "infer": INFER_STEP.value}
    baselines = {"train": BASELINE.value, "infer": INFER_BASELINE.value or BASELINE.value}
    measured = {}
    if ROWS.value:
      subject = SUBJECT.value or f"{report['model']}/{report['preset']}"
      rows = collect.read_rows(ROWS.value, DEVICE.value or report.get("device_kind"))
      got = headroom.measured_speedups(rows, subject, baselines)
      steps = {m: steps[m] or got[m]["step_ms"] for m in steps}
      measured = {m: got[m]["speedups"] for m in got}
    targets = {m: t for m, t in (("train", TRAIN_TARGET.value),
                                 ("infer", INFER_TARGET.value)) if t}
    all_lines, forgone = [], {}
    for mode in headroom.MODES:
      best = headroom.speed_only(report, mode)
      all_lines += headroom.lines(report, plans, mode, kernels, steps[mode], measured.get(mode),
                                  best)
      if plans:
        forgone[mode] = headroom.forgone(report, next(iter(plans.values())), mode, TOP.value,
                                         best)
  except ValueError as e:  # a corrupt report or plan, unknown kernel, rows that do not fit
    raise app.UsageError(str(e)) from e
  text = headroom.markdown(all_lines, forgone, targets, baselines)
  print(text)
  if OUT.value:
    os.makedirs(OUT.value, exist_ok=True)
    with open(os.path.join(OUT.value, "headroom.md"), "w") as f:
      f.write(text)
    jsonio.write_json_atomic(os.path.join(OUT.value, "headroom.json"), {
        "report": REPORT.value, "plans": PLANS.value, "baselines": baselines,
        "targets": targets, "lines": [l.to_dict() for l in all_lines], "forgone": forgone})
    if any(l.projected for l in all_lines):
      headroom.plot(all_lines, os.path.join(OUT.value, "headroom.png"), targets, baselines,
                    f"{report['model']}/{report['preset']} on {report.get('device_kind')}: "
                    f"GEMM headroom over {' / '.join(sorted(set(baselines.values())))}")
    print(f"[report plan_headroom] wrote {OUT.value}/headroom.md, .json"
          + (", .png" if any(l.projected for l in all_lines) else ""))

