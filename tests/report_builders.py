"""Hand-made ProbeReports and timing tables with known answers, for the Dispatch, plan,
validation and experiment tests (`import report_builders as hm`);
tests/dispatch/test_hand_made_reports.py checks that they are valid `loka.probe/1` reports and
`loka.timings/1` tables."""
import copy

from loka_jax.probe import timing_table
from loka_jax.probe.report import validate_report

PASSES = ("fwd", "grad_lhs", "grad_rhs")
H100 = "NVIDIA H100 80GB HBM3"
BASE_US = 100.0


def entry(sqnr=30.0, speedup=(1.3, 1.4, 1.5), underflow=0.001, mere=0.05, base_us=BASE_US,
          timing="measured", **extra):
  """A kernel entry: SQNR [lo, mid, hi] around `sqnr` (lo = sqnr), speedup [lo, mid, hi]
  (None: not timed), the worst operand underflow's upper end, MERE's upper end."""
  e = {"sqnr_db": [sqnr, sqnr + 1.0, sqnr + 2.0], "mere": [mere / 2, mere * 0.75, mere],
       "rel_fro": [0.01, 0.02, 0.03], "underflow": [0.0, underflow / 2, underflow],
       "operands": {"lhs": {"underflow": [0.0, underflow / 2, underflow]},
                    "rhs": {"underflow": [0.0, underflow / 4, underflow / 2]}},
       "samples": 16}
  if speedup is not None:
    lo, mid, hi = speedup
    e.update(speedup=[lo, mid, hi], time_us=[base_us / hi, base_us / mid, base_us / lo],
             timing=timing)
  else:
    e.update(speedup=None, time_us=None, timing="missing")
  e.update(extra)
  return e


def baseline(base_us=BASE_US):
  return {"sqnr_db": [60.0, 61.0, 62.0], "mere": [0.0, 0.001, 0.002],
          "rel_fro": [0.0, 0.001, 0.002], "underflow": None, "speedup": [1.0, 1.0, 1.0],
          "time_us": [base_us * 0.99, base_us, base_us * 1.01], "timing": "measured",
          "samples": 16}


def site(passes, kind="act_weight", spec="mk,kn->mn", lhs=(256, 64), rhs=(64, 32)):
  """A site whose `passes` is {pass: {kernel: entry}} (the baseline added to every pass)."""
  out_shape = [lhs[0], rhs[1]] if spec == "mk,kn->mn" else None
  return {"kind": kind, "spec": spec,
          "shapes": {"lhs": list(lhs), "rhs": list(rhs), "out": out_shape or []},
          "passes": {p: {"xla_bf16": baseline(), **copy.deepcopy(ks)} for p, ks in passes.items()}}


def same_passes(kernels):
  """{pass: kernels} with the same entries in every pass."""
  return {p: copy.deepcopy(kernels) for p in PASSES}


def report(sites, timing_valid=True, device=H100, model="toy", run=None, **extra):
  r = {"schema": "loka.probe/1", "model": model, "preset": "tiny", "device": device,
       "device_kind": device, "platform": "gpu" if timing_valid else "cpu", "jax": "0.11.2",
       "timing_valid": timing_valid,
       "timing_source": {"kind": "measured" if timing_valid else "none"},
       "evaluation": {"compute_dtype": "bfloat16"}, "sites": sites, "run": run or {}}
  r.update(extra)
  validate_report(r, "<hand-made report>")
  return r


def table_entry(kernel, pass_name, spec, lhs, rhs, median_us, spread=0.02):
  return {"kernel": kernel, "pass": pass_name, "spec": spec, "lhs_shape": list(lhs),
          "rhs_shape": list(rhs), "dtype": "bfloat16", "median_us": median_us,
          "ci_us": [median_us * (1 - spread), median_us * (1 + spread)], "backend": "test",
          "repeats": 20, "jax": "0.11.2", "date": "2026-11-01"}


def dense_table(device, m, k, n, times):
  """A loka.timings/1 table of the three passes of `mk,kn->mn` at (m, k, n): `times` is
  {kernel: {pass: median_us}}."""
  problems = {"fwd": ("mk,kn->mn", (m, k), (k, n)), "grad_lhs": ("mn,kn->mk", (m, n), (k, n)),
              "grad_rhs": ("mk,mn->kn", (m, k), (m, n))}
  entries = [table_entry(kernel, p, *problems[p], us)
             for kernel, per_pass in times.items() for p, us in per_pass.items()]
  return timing_table.merge_entries(timing_table.empty_table(device), entries)


def rowwise_untimed_report():
  """One site `s` (256 x 64 by 64 x 32, on the H100) where the probe timed XLA tensorwise
  (1.4x bf16) in every pass and left XLA rowwise untimed: what a card's table can fill."""
  kernels = {"xla_fp8_tensorwise": entry(sqnr=28.0, speedup=(1.3, 1.4, 1.5)),
             "xla_fp8_rowwise": entry(sqnr=28.0, speedup=None)}
  return report({"s": site(same_passes(kernels), lhs=(256, 64), rhs=(64, 32))})


def save_h100_table(directory, times):
  """The H100's committed table in `directory`: `dense_table` at `rowwise_untimed_report`'s
  site shape, bf16 at 10 us in every pass beside `times` ({kernel: {pass: median_us}})."""
  bf16 = {"xla_bf16": {"fwd": 10.0, "grad_lhs": 10.0, "grad_rhs": 10.0}}
  table = dense_table(H100, 256, 64, 32, {**bf16, **times})
  timing_table.save_table(table, timing_table.table_path(H100, directory))
  return table
