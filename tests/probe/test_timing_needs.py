"""What a GPU probe times at a site shape (`probe/timing_needs.py`) and how `attach_timings`
fills in what it does not: passes no site admits on accuracy, passes dominated on the card,
and exact entries of the card's committed table are not timed."""
import contextlib
import io
import os
import tempfile
import types

import jax
from absl.testing import absltest

from loka_jax import kernels as kernels_lib
from loka_jax.probe import assemble, kernel_timing, timing_needs
from loka_jax.probe import timing_table as tables_lib
from loka_jax.probe.eligibility import Criteria
from loka_jax.probe.kernel_timing import pass_problem
from loka_jax.probe.layout import site_layout
from loka_jax.probe.options import ProbeOptions

PASSES = ("fwd", "grad_lhs", "grad_rhs")
LAYOUT = site_layout("mk,kn->mn", "act_weight", (64, 32), (32, 16))
KERNELS = [kernels_lib.get(n) for n in ("xla_bf16", "xla_fp8_rowwise", "xla_fp8_tensorwise",
                                        "flax_fp8_delayed")]


def pass_entry(sqnr_lo: float, underflow_hi: float = 0.0):
  return {"sqnr_db": [sqnr_lo, sqnr_lo + 3, sqnr_lo + 6],
          "operands": {"lhs": {"underflow": [0.0, 0.0, underflow_hi]},
                       "rhs": {"underflow": [0.0, 0.0, 0.0]}}}


def site_entry(sqnr: dict):
  """{pass: {kernel: entry}}: `sqnr[(kernel, pass)]` (default 40 dB, safe)."""
  return {"passes": {p: {k.name: pass_entry(sqnr.get((k.name, p), 40.0)) for k in KERNELS}
                     for p in PASSES}}


def table_entry(kernel, pass_name, layout, median_us, **extra):
  spec, a, b = pass_problem(layout, pass_name)
  return {"kernel": kernel, "pass": pass_name, "spec": spec, "lhs_shape": list(a),
          "rhs_shape": list(b), "dtype": "bfloat16", "median_us": median_us,
          "ci_us": [0.99 * median_us, 1.01 * median_us], "backend": "xla",
          "jax": jax.__version__, "date": "2026-12-01",
          "revision": kernels_lib.get(kernel).revision, **extra}


def table(entries):
  return {"schema": tables_lib.SCHEMA, "device_kind": "cpu", "entries": entries}


def class_rows(ms, fp8_us):
  """bf16 at 10 us and xla_fp8_tensorwise at `fp8_us` in the forward of (m x 32) . (32 x 16)
  for each m in `ms` (all within 10x of LAYOUT's FLOPs)."""
  rows = []
  for m in ms:
    layout = site_layout("mk,kn->mn", "act_weight", (m, 32), (32, 16))
    rows += [table_entry("xla_bf16", "fwd", layout, 10.0),
             table_entry("xla_fp8_tensorwise", "fwd", layout, fp8_us)]
  return rows

class ShapeNeedsTest(absltest.TestCase):

  def test_a_pass_no_site_admits_is_not_timed(self):
    # rowwise fails grad_rhs at both sites of the shape; tensorwise only at one of them.
    entries = [site_entry({("xla_fp8_rowwise", "grad_rhs"): 10.0,
                           ("xla_fp8_tensorwise", "fwd"): 5.0}),
               site_entry({("xla_fp8_rowwise", "grad_rhs"): 12.0})]
    needs = timing_needs.shape_needs(LAYOUT, entries, KERNELS, "bfloat16", {}, Criteria())
    self.assertIn(("xla_fp8_rowwise", "grad_rhs"), needs.skipped)
    self.assertIn("accuracy", needs.skipped[("xla_fp8_rowwise", "grad_rhs")])
    self.assertIn(("xla_fp8_rowwise", "fwd"), needs.measure)
    self.assertIn(("xla_fp8_tensorwise", "fwd"), needs.measure)  # the second site admits it
    self.assertTrue({("xla_bf16", p) for p in PASSES} <= needs.measure)

  def test_underflow_makes_a_pass_unsafe(self):
    entry = site_entry({})
    entry["passes"]["fwd"]["xla_fp8_rowwise"] = pass_entry(40.0, underflow_hi=0.2)
    needs = timing_needs.shape_needs(LAYOUT, [entry], KERNELS, "bfloat16", {}, Criteria())
    self.assertIn(("xla_fp8_rowwise", "fwd"), needs.skipped)

  def test_a_fused_op_unsafe_in_one_pass_is_not_timed_in_any(self):
    entries = [site_entry({("flax_fp8_delayed", "grad_lhs"): 3.0})]
    needs = timing_needs.shape_needs(LAYOUT, entries, KERNELS, "bfloat16", {}, Criteria())
    for p in PASSES:
      self.assertIn(("flax_fp8_delayed", p), needs.skipped)

  def test_time_all_times_every_supported_pass(self):
    entries = [site_entry({("xla_fp8_rowwise", "fwd"): 1.0})]
    unsupported = {"grad_rhs": {"xla_fp8_tensorwise": "no"}}
    needs = timing_needs.shape_needs(LAYOUT, entries, KERNELS, "bfloat16", unsupported,
                                     Criteria(), time_all=True)
    self.assertEqual(len(needs.measure), 4 * 3 - 1)
    self.assertEqual(needs.skipped, {})

  def test_exact_entries_of_the_cards_table_are_reused_and_near_ones_are_not(self):
    other = site_layout("mk,kn->mn", "act_weight", (128, 32), (32, 16))
    rows = [table_entry(k, p, LAYOUT, us) for p in PASSES
            for k, us in (("xla_bf16", 10.0), ("xla_fp8_rowwise", 8.0))]
    rows += [table_entry(k, "fwd", other, us) for k, us in (("xla_bf16", 20.0),
                                                             ("xla_fp8_tensorwise", 9.0))]
    # An entry of another revision of its kernel timed other code: not reused.
    rows.append(table_entry("xla_fp8_tensorwise", "grad_lhs", LAYOUT, 5.0))
    rows[-1]["revision"] += 1
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                     Criteria(), table=table(rows))
    self.assertEqual({("xla_fp8_rowwise", p) for p in PASSES},
                     {kp for kp in needs.reused if kp[0] == "xla_fp8_rowwise"})
    # Tensorwise is only near (another M): measured, with the baseline beside it.
    self.assertIn(("xla_fp8_tensorwise", "fwd"), needs.measure)
    self.assertIn(("xla_fp8_tensorwise", "grad_lhs"), needs.measure)
    self.assertIn(("xla_bf16", "fwd"), needs.measure)

  def test_a_pass_with_nothing_to_time_does_not_time_the_baseline(self):
    rows = [table_entry(k, p, LAYOUT, us) for p in PASSES
            for k, us in (("xla_bf16", 10.0), ("xla_fp8_rowwise", 8.0),
                          ("xla_fp8_tensorwise", 7.0))]
    kernels = KERNELS[:3]
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], kernels, "bfloat16", {},
                                     Criteria(), table=table(rows))
    self.assertEqual(needs.measure, set())
    self.assertEqual(len(needs.reused), 9)  # the baseline's passes come from the table too

  def test_runs_that_timed_different_kernels_of_a_shape_leave_nothing_to_time(self):
    # One run timed rowwise beside bf16, a later one tensorwise beside a slower bf16 (it had
    # rowwise from the table); both are committed in turn. The next probe reuses all of
    # them, each divided by its own run's bf16, and times nothing.
    kernels = KERNELS[:3]
    first = [table_entry(k, p, LAYOUT, us) for p in PASSES
             for k, us in (("xla_bf16", 10.0), ("xla_fp8_rowwise", 8.0))]
    second = [table_entry(k, p, LAYOUT, us) for p in PASSES
              for k, us in (("xla_bf16", 16.0), ("xla_fp8_tensorwise", 8.0))]
    committed = tables_lib.merge_entries(tables_lib.merge_entries(table([]), first), second)
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], kernels, "bfloat16", {},
                                     Criteria(), table=committed)
    self.assertEqual(needs.measure, set())
    self.assertEqual(len(needs.reused), 9)
    speedups = {k: tables_lib.lookup(committed, k, "fwd", *pass_problem(LAYOUT, "fwd"))["speedup"]
                for k in ("xla_fp8_rowwise", "xla_fp8_tensorwise")}
    self.assertEqual(speedups, {"xla_fp8_rowwise": 1.25, "xla_fp8_tensorwise": 2.0})

  def test_a_kernel_slow_at_every_shape_of_its_class_is_dominated(self):
    rows = []
    for m in (48, 64, 96, 256):  # within 10x of LAYOUT's FLOPs
      layout = site_layout("mk,kn->mn", "act_weight", (m, 32), (32, 16))
      rows += [table_entry("xla_bf16", "fwd", layout, 10.0),
               table_entry("xla_fp8_tensorwise", "fwd", layout, 20.0)]
    far = site_layout("mk,kn->mn", "act_weight", (64 * 1000, 32), (32, 16))
    rows += [table_entry("xla_bf16", "fwd", far, 100.0),
             table_entry("xla_fp8_tensorwise", "fwd", far, 10.0)]  # fast, but another class
    t = table([r for r in rows if r["lhs_shape"][0] != 64])  # LAYOUT itself not measured
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                     Criteria(), table=t)
    self.assertIn("dominated", needs.skipped[("xla_fp8_tensorwise", "fwd")])
    # Accuracy-only selection wants every safe kernel's time: nothing is dominated.
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                     Criteria(min_speedup=None), table=t)
    self.assertIn(("xla_fp8_tensorwise", "fwd"), needs.measure)

  def test_two_slow_shapes_or_one_fast_one_do_not_dominate(self):
    def rows_for(ms, fast_m=None):
      out = []
      for m in ms:
        layout = site_layout("mk,kn->mn", "act_weight", (m, 32), (32, 16))
        out += [table_entry("xla_bf16", "fwd", layout, 10.0),
                table_entry("xla_fp8_tensorwise", "fwd", layout, 5.0 if m == fast_m else 20.0)]
      return out
    for rows in (rows_for((48, 96)), rows_for((48, 96, 128), fast_m=128)):
      needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                       Criteria(), table=table(rows))
      self.assertIn(("xla_fp8_tensorwise", "fwd"), needs.measure)

  def test_three_slow_shapes_this_card_timed_dominate_without_a_committed_table(self):
    rows = class_rows((48, 96, 128), fp8_us=20.0)
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                     Criteria(), measured=table(rows))
    self.assertIn("dominated", needs.skipped[("xla_fp8_tensorwise", "fwd")])
    self.assertIn(("xla_fp8_rowwise", "fwd"), needs.measure)  # never timed: not dominated
    self.assertEqual(needs.reused, set())  # the cache's entries are never "reused"

  def test_a_pass_the_cache_holds_for_this_shape_is_read_not_skipped(self):
    rows = class_rows((48, 64, 96, 128), fp8_us=20.0)   # 64: LAYOUT itself
    needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                     Criteria(), measured=table(rows))
    self.assertIn(("xla_fp8_tensorwise", "fwd"), needs.measure)

  def test_the_caches_newer_time_replaces_the_committed_one(self):
    fast, slow = class_rows((48, 96, 128), fp8_us=5.0), class_rows((48, 96, 128), fp8_us=20.0)
    for committed, cached, dominated in ((fast, slow, True), (slow, fast, False)):
      needs = timing_needs.shape_needs(LAYOUT, [site_entry({})], KERNELS, "bfloat16", {},
                                       Criteria(), table=table(committed),
                                       measured=table(cached))
      self.assertEqual(("xla_fp8_tensorwise", "fwd") in needs.skipped, dominated)


class AttachTimingsTest(absltest.TestCase):
  """On the CPU with `time=True`: what is measured is timed, the rest is said."""

  def test_measured_reused_and_skipped_passes_in_the_report(self):
    with tempfile.TemporaryDirectory() as tmp:
      table_dir = os.path.join(tmp, "tables")
      os.makedirs(table_dir)
      rows = [table_entry(k, p, LAYOUT, us) for p in PASSES
              for k, us in (("xla_bf16", 10.0), ("xla_fp8_tensorwise", 4.0))]
      tables_lib.save_table(table(rows) | {"device_kind": jax.devices()[0].device_kind},
                            tables_lib.table_path(jax.devices()[0].device_kind, table_dir))
      kernels = KERNELS[:3]
      entries = {"a": site_entry({("xla_fp8_rowwise", "grad_rhs"): 1.0}),
                 "b": site_entry({("xla_fp8_rowwise", "grad_rhs"): 1.0})}
      sites = {n: types.SimpleNamespace(layout=LAYOUT) for n in entries}
      options = ProbeOptions(time=True, repeats=3, table_dir=table_dir, write_table=False,
                             timing_cache=os.path.join(tmp, "cache"))
      timing = assemble.attach_timings(entries, sites, kernels, "bfloat16", options, tmp)
      counts = timing.source["kernel_passes"]
      self.assertEqual(counts, {"measured": 4, "reused": 4, "not_safe": 1, "dominated": 0,
                                "baseline_unneeded": 0})
      self.assertEqual(timing.source["timed_for"], options.criteria.to_dict())
      for name in entries:
        passes = entries[name]["passes"]
        self.assertEqual(passes["fwd"]["xla_fp8_rowwise"]["timing"], "measured")
        self.assertGreater(passes["fwd"]["xla_fp8_rowwise"]["time_us"][1], 0)
        reused = passes["grad_lhs"]["xla_fp8_tensorwise"]
        self.assertEqual(reused["timing"], "table")
        self.assertAlmostEqual(reused["speedup"][1], 2.5)
        skipped = passes["grad_rhs"]["xla_fp8_rowwise"]
        self.assertEqual((skipped["timing"], skipped["speedup"]), ("skipped", None))
      self.assertEqual(timing.pending, [])


  def test_a_delayed_op_gets_its_underflow_from_the_statistics_before_the_timing(self):
    # Flax's delayed-scaling op exposes no quantized operands: its passes' underflow comes
    # from the site's statistics. Read only with the report, the op had no underflow when the
    # timing chose what can win, so no site admitted it on accuracy and it was never timed.
    delayed = kernels_lib.get("flax_fp8_delayed")
    entries = {"a": site_entry({})}
    for p in PASSES:
      entries["a"]["passes"][p][delayed.name].pop("operands")
    flush = {p: {"mean": {f: {"tensorwise": 0.0} for f in ("e4m3", "e5m2")},
                 "max": {f: {"tensorwise": 1e-3} for f in ("e4m3", "e5m2")}} for p in PASSES}
    entries["a"]["stats"] = {operand: {"flush": flush} for operand in ("lhs", "rhs", "grad")}
    with tempfile.TemporaryDirectory() as tmp:
      options = ProbeOptions(time=True, repeats=3, table_dir=os.path.join(tmp, "none"),
                             write_table=False, timing_cache=os.path.join(tmp, "cache"))
      with contextlib.redirect_stdout(io.StringIO()):
        assemble.attach_timings(entries, {"a": types.SimpleNamespace(layout=LAYOUT)},
                                [KERNELS[0], delayed], "bfloat16", options, tmp)
    for p in PASSES:
      entry = entries["a"]["passes"][p][delayed.name]
      self.assertEqual(entry["underflow"], [0.0, 0.0, 1e-3], p)
      self.assertEqual(entry["timing"], "measured", (p, entry.get("timing_note")))

  def test_what_the_timing_cache_holds_of_this_card_dominates_without_a_table(self):
    with tempfile.TemporaryDirectory() as tmp:
      # No committed table; the workdir's timing cache holds three shapes of LAYOUT's class
      # at which tensorwise lost to bf16 (20 us against 10).
      kind = kernel_timing.device_kind()
      cache = kernel_timing.TimingCache(
          kernel_timing.default_cache_path(os.path.join(tmp, "cache"), kind), kind)
      for row in class_rows((48, 96, 128), fp8_us=20.0):
        key = kernel_timing.cache_key(row["kernel"], row["pass"], row["spec"],
                                      row["lhs_shape"], row["rhs_shape"], row["dtype"])
        cache.put(key, {**row, "seconds": [1e-6 * row["median_us"]] * 3, "repeats": 3,
                        "inner": 1, "unroll": 1})
      os.makedirs(os.path.dirname(cache.path))
      cache.save()
      entries = {"a": site_entry({})}
      options = ProbeOptions(time=True, repeats=3, table_dir=os.path.join(tmp, "none"),
                             write_table=False, timing_cache=os.path.join(tmp, "cache"))
      log = io.StringIO()
      with contextlib.redirect_stdout(log):
        timing = assemble.attach_timings(entries, {"a": types.SimpleNamespace(layout=LAYOUT)},
                                         KERNELS[:3], "bfloat16", options, tmp)
      # The user is told why timing takes long here, and how far it got.
      self.assertIn(f"no committed kernel timings for {jax.devices()[0].device_kind} in "
                    f"{options.table_dir}: timing 1 site shape here", log.getvalue())
      self.assertIn("kernel passes; shape 1/1) in", log.getvalue())
      self.assertEqual(timing.source["kernel_passes"]["dominated"], 1)
      skipped = entries["a"]["passes"]["fwd"]["xla_fp8_tensorwise"]
      self.assertEqual(skipped["timing"], "skipped")
      self.assertIn("dominated on this card: at 3 timed shapes", skipped["timing_note"])
      # Its other passes were never timed at this class: measured here.
      self.assertEqual(entries["a"]["passes"]["grad_lhs"]["xla_fp8_tensorwise"]["timing"],
                       "measured")


if __name__ == "__main__":
  absltest.main()
