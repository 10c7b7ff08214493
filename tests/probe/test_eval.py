"""Per-site error evaluation, CIs, source combination and eligibility."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax import kernels as kernels_lib
from loka_jax.probe import candidates, collector, eligibility, evaluate, summarize

OUTLIER_KERNELS = ("xla_fp8_tensorwise", "xla_fp8_rowwise", "pallas_fp8_blockwise")
CONFIG = collector.ProbeConfig()


def _observed_site(name, outliers: bool, observations: int = 3, seed: int = 0):
  """A dense 64x512 @ 512x64 site whose statistics come from real update passes over
  activations with (optionally) 4 of 512 input channels scaled x1e6, all in one 128-block."""
  site = collector.make_site_probe(name, "mk,kn->mn", "act_weight", (64, 512), (512, 64), CONFIG)
  state = collector.init_site_state(site, CONFIG, dtype=jnp.bfloat16)
  update = jax.jit(lambda s, x, w, g, k: collector.update_site_state(s, site, x, w, g, k, CONFIG))
  rng = np.random.default_rng(seed)
  w0 = rng.standard_normal((512, 64)) / np.sqrt(512)
  for i in range(observations):
    x = rng.standard_normal((64, 512))
    if outliers:
      x[:, 5:9] *= 1e6
    w = w0 + 1e-3 * rng.standard_normal(w0.shape) * i
    g = 1e-3 * rng.standard_normal((64, 64))
    state = update(state, *(jnp.asarray(a, jnp.bfloat16) for a in (x, w, g)),
                   jax.random.PRNGKey(i))
  return site, jax.device_get(state)


def _report(entries):
  """The parts of a ProbeReport that eligibility reads."""
  info = {k.name: {"sort": k.sort, "fp8": k.fp8} for k in map(kernels_lib.get, OUTLIER_KERNELS)}
  return {"kernels": info, "sites": {n: {"passes": p} for n, p in entries.items()}}


class OutlierChannelTest(chex.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    kernels = [kernels_lib.get(k) for k in OUTLIER_KERNELS]
    config = evaluate.EvalConfig(samples=3, reservoir_samples=3)
    cls.passes = {}
    for name, outliers in (("outlier", True), ("clean", False)):
      site, state = _observed_site(name, outliers)
      ev = evaluate.evaluate_site(site, state, kernels, "bfloat16", config)
      cls.passes[name] = summarize.site_passes(ev, list(OUTLIER_KERNELS), n_boot=200)
    cls.report = _report(cls.passes)
    cls.criteria = eligibility.Criteria(min_speedup=None)  # no timing on a CPU

  def _underflow(self, site, kernel, operand="lhs", pass_name="fwd"):
    return self.passes[site][pass_name][kernel]["operands"][operand]["underflow"]

  def test_outliers_flush_tensorwise_and_rowwise_but_far_less_blockwise(self):
    for kernel in ("xla_fp8_tensorwise", "xla_fp8_rowwise"):
      self.assertGreater(self._underflow("outlier", kernel)[0], 0.9, kernel)
    blockwise = self._underflow("outlier", "pallas_fp8_blockwise")
    self.assertLess(blockwise[-1], 0.3)   # one block of four holds the outliers
    self.assertGreater(blockwise[0], 0.2)
    for kernel in ("xla_fp8_tensorwise", "xla_fp8_rowwise", "pallas_fp8_blockwise"):
      self.assertLess(self._underflow("clean", kernel)[-1], 0.01, kernel)

  def test_outlier_site_is_ineligible_for_those_kernels_and_clean_site_eligible(self):
    bad = eligibility.assess_site(self.report, "outlier", self.criteria)
    good = eligibility.assess_site(self.report, "clean", self.criteria)
    for kernel in ("xla_fp8_tensorwise", "xla_fp8_rowwise"):
      verdict = bad["fwd"][kernel]
      self.assertFalse(verdict.eligible, kernel)
      self.assertTrue(any("lhs underflow" in r for r in verdict.reasons), verdict.reasons)
      for p in ("fwd", "grad_lhs", "grad_rhs"):
        self.assertTrue(good[p][kernel].eligible, (kernel, p, good[p][kernel].reasons))
    # The output SQNR alone would have passed the outlier site: the underflow check matters.
    self.assertGreater(bad["fwd"]["xla_fp8_tensorwise"].sqnr_lo, 0.0)
    best = eligibility.best_kernel(bad["fwd"])
    self.assertNotIn(best.kernel, ("xla_fp8_tensorwise", "xla_fp8_rowwise"))

  def test_every_pass_has_both_sources_and_wgrad_uses_the_pairs(self):
    for p in ("fwd", "grad_lhs", "grad_rhs"):
      entry = self.passes["clean"][p]["xla_fp8_rowwise"]
      self.assertEqual(set(entry["sources"]), {"gaussian", "reservoir"})
      lo, mid, hi = entry["sqnr_db"]
      self.assertLessEqual(lo, mid)
      self.assertLessEqual(mid, hi)
    self.assertEqual(self.passes["clean"]["grad_rhs"]["xla_fp8_rowwise"]["source"], "reservoir")
    # e4m3 keeps 3 mantissa bits: about 30 dB on a well-conditioned site, e5m2 grads less.
    fwd = self.passes["clean"]["fwd"]["xla_fp8_rowwise"]["sqnr_db"]
    dgrad = self.passes["clean"]["grad_lhs"]["xla_fp8_rowwise"]["sqnr_db"]
    self.assertTrue(26.0 < fwd[0] and fwd[2] < 36.0, fwd)
    self.assertLess(dgrad[1], fwd[1])


class EvaluationCompileTest(chex.TestCase):

  def test_equal_shapes_share_one_compile_per_kernel(self):
    kernels = [kernels_lib.get("xla_fp8_rowwise")]
    config = evaluate.EvalConfig(samples=2, reservoir_samples=2)
    passes = ("fwd", "grad_lhs", "grad_rhs")
    size = lambda: {k.name: evaluate.kernel_evaluator(k.name, passes, "mk,kn->mn",
                                                      "bfloat16")._cache_size()
                    for k in kernels}
    before = size()
    sizes = {}
    make = lambda i: collector.make_site_probe(f"dense_{i}", "mk,kn->mn", "act_weight",
                                               (8, 24), (24, 16), CONFIG)
    update = jax.jit(lambda s, x, w, g: collector.update_site_state(
        s, make(0), x, w, g, jax.random.PRNGKey(0), CONFIG))
    for i in range(2):
      site = make(i)
      state = update(collector.init_site_state(site, CONFIG),
                     *(jax.random.normal(jax.random.PRNGKey(i + j), shape)
                       for j, shape in enumerate(((8, 24), (24, 16), (8, 16)))))
      evaluate.evaluate_site(site, jax.device_get(state), kernels, "bfloat16", config)
      sizes[i] = size()
    # Gaussian and reservoir draws of the first site: one compile per kernel for all its
    # passes; the other sites of the same shape add none.
    self.assertEqual({k: v - before[k] for k, v in sizes[0].items()},
                     {k: 1 for k in sizes[0]})
    self.assertEqual(sizes[0], sizes[1])


class DelayedWarmupTest(chex.TestCase):
  """A delayed-scaling op is judged with its scale from other tensors, never its own."""

  def test_a_sample_warmed_on_others_saturates_where_warmed_on_itself_it_does_not(self):
    # Four samples of one distribution, the last 64x larger. Warmed on the three before it,
    # its forward's scale is 64x too small and its largest values saturate; warmed on itself
    # (what a one-sample chunk did) it reads as current scaling, as accurate as tensorwise.
    rng = np.random.default_rng(3)
    spec = "mk,kn->mn"
    lhs = rng.standard_normal((4, 32, 128)).astype(np.float32)
    lhs[3] *= 64.0
    rhs = rng.standard_normal((4, 128, 48)).astype(np.float32) / np.sqrt(128)
    grad = rng.standard_normal((4, 32, 48)).astype(np.float32)
    refs = evaluate.references(spec)(lhs, rhs, grad)
    delayed = evaluate.fused_evaluator("flax_fp8_delayed", spec, "bfloat16")
    warmed_on_others = float(delayed(lhs, rhs, grad, refs)["fwd"]["sqnr_db"][3])
    alone = [x[3:] for x in (lhs, rhs, grad)]
    warmed_on_itself = float(delayed(*alone, evaluate.references(spec)(*alone))["fwd"]
                             ["sqnr_db"][0])
    tensorwise = evaluate.kernel_evaluator("xla_fp8_tensorwise", ("fwd",), spec, "bfloat16")
    current = float(tensorwise(*alone, evaluate.references(spec)(*alone))["fwd"]["sqnr_db"][0])
    self.assertLess(warmed_on_others, warmed_on_itself - 10.0)
    self.assertAlmostEqual(warmed_on_itself, current, delta=1.5)

  def test_a_chunk_holds_enough_samples_to_warm_on_others_where_a_delayed_op_is_evaluated(self):
    # Operands far above the memory bound give one sample a chunk: fine for per-pass kernels,
    # but a delayed op needs DELAYED_WARMUP others before each sample.
    site = collector.make_site_probe("wide", "mk,kn->mn", "act_weight", (64, 96), (96, 80),
                                     CONFIG)
    # Jitted: op by op, one statistics update dispatches (and compiles) hundreds of ops.
    update = jax.jit(lambda s, x, w, g, k: collector.update_site_state(s, site, x, w, g, k,
                                                                       CONFIG))
    state = jax.device_get(update(
        collector.init_site_state(site, CONFIG),
        *(jax.random.normal(jax.random.PRNGKey(j), shape)
          for j, shape in enumerate(((64, 96), (96, 80), (64, 80)))),
        jax.random.PRNGKey(0)))
    tight = evaluate.EvalConfig(samples=6, reservoir_samples=6, chunk_elements=1024)
    plain = evaluate.evaluate_site(site, state, [kernels_lib.get("xla_fp8_rowwise")],
                                   "bfloat16", tight)
    self.assertEqual(plain.chunk, 1)
    with_delayed = evaluate.evaluate_site(
        site, state, [kernels_lib.get("xla_fp8_rowwise"), kernels_lib.get("flax_fp8_delayed")],
        "bfloat16", tight)
    self.assertEqual(with_delayed.chunk, evaluate.DELAYED_WARMUP + 1)
    self.assertTrue(evaluate.warmup_excludes_self(with_delayed.chunk))
    for source in evaluate.SOURCES:   # every sample is still evaluated, once
      self.assertLen(with_delayed.results[source]["fwd"]["flax_fp8_delayed"]["sqnr_db"], 6)
    # Fewer samples than the warm-up needs: the chunk holds them all, and says it warms on
    # the sample itself too.
    few = evaluate.evaluate_site(site, state, [kernels_lib.get("flax_fp8_delayed")], "bfloat16",
                                 evaluate.EvalConfig(samples=2, reservoir_samples=2,
                                                     chunk_elements=1024))
    self.assertEqual(few.chunk, 2)
    self.assertFalse(evaluate.warmup_excludes_self(few.chunk))


class FetchTest(absltest.TestCase):

  def test_a_kernel_whose_result_cannot_be_read_is_reported_and_the_rest_kept(self):
    # A chunk's metrics come back in one transfer; an execution error that shows only when
    # a result is read fails that kernel alone, as an error raised at its call does.
    class Unreadable:
      def copy_to_host_async(self):
        pass

      def __array__(self, *args, **kwargs):
        raise RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS")

    good = {"fwd": {"sqnr_db": jnp.arange(3.0)}}
    errors = {}
    fetched = evaluate._fetch({"good": good, "bad": {"fwd": {"sqnr_db": Unreadable()}}},
                              errors)
    self.assertEqual(list(fetched), ["good"])
    np.testing.assert_array_equal(fetched["good"]["fwd"]["sqnr_db"], [0.0, 1.0, 2.0])
    self.assertIn("CUDA_ERROR_ILLEGAL_ADDRESS", errors["bad"])
    self.assertEqual(evaluate._fetch({"good": good}, errors)["good"]["fwd"]["sqnr_db"].shape,
                     (3,))


class SummaryTest(parameterized.TestCase):

  def test_bootstrap_ci_brackets_the_mean_and_narrows_with_samples(self):
    rng = np.random.default_rng(0)
    few = summarize.bootstrap_ci(rng.normal(30, 2, 10), np.random.default_rng(1))
    many = summarize.bootstrap_ci(rng.normal(30, 2, 1000), np.random.default_rng(1))
    for lo, mid, hi in (few, many):
      self.assertLess(lo, mid)
      self.assertLess(mid, hi)
    self.assertLess(many[2] - many[0], few[2] - few[0])
    self.assertIsNone(summarize.bootstrap_ci(np.array([1.0, np.nan]), np.random.default_rng(0)))

  def test_non_finite_samples_become_null_with_an_error(self):
    n = 4
    metrics = {m: np.full(n, 10.0) for m in evaluate.METRICS}
    metrics["sqnr_db"][1] = np.nan
    metrics["finite"] = np.array([True, False, True, True])
    for f in ("underflow_a", "underflow_b", "saturation_a", "saturation_b"):
      metrics[f] = np.zeros(n)
    entry = summarize.source_entry(metrics, ("lhs", "rhs"), np.random.default_rng(0), 50)
    self.assertIsNone(entry["sqnr_db"])
    self.assertIn("1 of 4 samples gave non-finite outputs", entry["error"])

  def test_forward_takes_the_harder_source_and_wgrad_the_pairs(self):
    easy = {"sqnr_db": [40.0, 41.0, 42.0], "underflow": None, "operands": {}}
    hard = {"sqnr_db": [20.0, 22.0, 24.0], "underflow": None, "operands": {}}
    fwd = summarize.combine_sources("fwd", {"gaussian": easy, "reservoir": hard})
    self.assertEqual(fwd["source"], "reservoir")
    self.assertEqual(fwd["sqnr_db"], hard["sqnr_db"])
    wgrad = summarize.combine_sources("grad_rhs", {"gaussian": hard, "reservoir": easy})
    self.assertEqual((wgrad["source"], wgrad["pairing"]), ("reservoir", "reservoir"))
    alone = summarize.combine_sources("grad_rhs", {"gaussian": easy})
    self.assertEqual(alone["pairing"], "independent")


class EligibilityTest(parameterized.TestCase):

  def _entry(self, sqnr=(30, 31, 32), underflow=0.0, speedup=(1.2, 1.3, 1.4), mere=(.05, .06, .07)):
    return {"sqnr_db": list(sqnr), "mere": list(mere), "speedup": list(speedup),
            "operands": {"lhs": {"underflow": [underflow] * 3}, "rhs": {"underflow": [0.0] * 3}}}

  def test_thresholds_use_the_pessimistic_end(self):
    c = eligibility.Criteria()
    self.assertTrue(eligibility.assess(self._entry(), "fwd", c).eligible)
    self.assertFalse(eligibility.assess(self._entry(sqnr=(24.9, 30, 31)), "fwd", c).eligible)
    self.assertTrue(eligibility.assess(self._entry(sqnr=(24.9, 30, 31)), "grad_lhs", c).eligible)
    self.assertFalse(eligibility.assess(self._entry(speedup=(1.04, 1.2, 1.3)), "fwd", c).eligible)
    v = eligibility.assess(self._entry(underflow=0.02), "fwd", c)
    self.assertTrue(not v.safe and not v.eligible)
    self.assertIn("lhs underflow 2.0% > 1%", v.reasons)
    mere = eligibility.Criteria(metric="mere")
    self.assertTrue(eligibility.assess(self._entry(sqnr=(5, 6, 7)), "fwd", mere).eligible)
    self.assertFalse(eligibility.assess(self._entry(mere=(.1, .15, .25)), "fwd", mere).eligible)
    with self.assertRaisesRegex(ValueError, "metric"):
      eligibility.Criteria(metric="snr")

  def test_best_kernel_prefers_speed_then_falls_back_to_bf16(self):
    c = eligibility.Criteria()
    verdicts = {"xla_bf16": eligibility.assess(self._entry(speedup=(1, 1, 1)), "fwd", c, fp8=False),
                "a": eligibility.assess(self._entry(speedup=(1.1, 1.2, 1.3)), "fwd", c),
                "b": eligibility.assess(self._entry(speedup=(1.3, 1.4, 1.5)), "fwd", c),
                "c": eligibility.assess(self._entry(underflow=0.5, speedup=(2, 2, 2)), "fwd", c)}
    verdicts = {k: v.__class__(**{**v.__dict__, "kernel": k}) for k, v in verdicts.items()}
    self.assertEqual(eligibility.best_kernel(verdicts).kernel, "b")
    only_bad = {k: verdicts[k] for k in ("xla_bf16", "c")}
    self.assertEqual(eligibility.best_kernel(only_bad).kernel, "xla_bf16")

  def test_default_candidates_exclude_reference_arm_and_epilogue_kernels(self):
    chosen, excluded = candidates.candidate_kernels(None, "cpu")
    names = [k.name for k in chosen]
    self.assertEqual(names[0], "xla_bf16")
    self.assertNotIn("xla_fp32", names)
    self.assertIn("xla_fp32", excluded)
    self.assertFalse(any(n.startswith("pallas") for n in names))
    with self.assertRaisesRegex(ValueError, "unknown kernel"):
      candidates.candidate_kernels(["xla_fp9"], "cpu")
    a, b = kernels_lib.get("xla_fp8_rowwise"), kernels_lib.get("xla_fp8_rowwise_fastacc")
    # Same granularity and accumulation: one program; fast against precise: two.
    self.assertEqual(a.pass_numerics("fwd"), b.pass_numerics("fwd"))
    self.assertNotEqual(a.pass_numerics("grad_lhs"), b.pass_numerics("grad_lhs"))
    self.assertNotEqual(a.pass_numerics("fwd"),
                        kernels_lib.get("xla_fp8_tensorwise").pass_numerics("fwd"))
    # The delayed-scaling fused ops share Flax's forward and differ in which gradient passes
    # they quantize: a quantized pass is one e5m2 product, an unquantized one the plain
    # product's gradient.
    delayed = {n: kernels_lib.get(n) for n in ("flax_fp8_delayed", "flax_fp8_delayed_fwd",
                                               "flax_fp8_delayed_grad_lhs")}
    self.assertLen({k.pass_numerics("fwd") for k in delayed.values()}, 1)
    numerics = lambda n, p: delayed[n].pass_numerics(p)
    self.assertEqual(numerics("flax_fp8_delayed", "grad_lhs"),
                     numerics("flax_fp8_delayed_grad_lhs", "grad_lhs"))
    self.assertNotEqual(numerics("flax_fp8_delayed", "grad_lhs"),
                        numerics("flax_fp8_delayed_fwd", "grad_lhs"))
    self.assertEqual(numerics("flax_fp8_delayed_fwd", "grad_rhs"),
                     numerics("flax_fp8_delayed_grad_lhs", "grad_rhs"))


if __name__ == "__main__":
  absltest.main()
