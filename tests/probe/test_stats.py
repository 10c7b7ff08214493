"""Probe statistics: Welford merge, wide-feature sketch, matrix-normal fit, sampling,
underflow counting, the paired reservoir and operand layouts."""
import chex
import jax
import jax.numpy as jnp
import numpy as np
from absl.testing import absltest, parameterized

from loka_jax.precision import E4M3, E5M2, GRANULARITIES, flush_fractions, quantize
from loka_jax.probe import flush, gaussian, matrix_normal, reservoir
from loka_jax.probe.layout import site_layout


def _spd(rng, n, spread=10.0):
  """A random SPD matrix with eigenvalues spread over `spread`x."""
  q, _ = np.linalg.qr(rng.standard_normal((n, n)))
  return (q * np.geomspace(1.0, spread, n)) @ q.T


class WelfordTest(parameterized.TestCase):

  @parameterized.parameters(1, 3, 7)
  def test_batched_merge_equals_whole_batch_mean_and_covariance(self, batches):
    rng = np.random.default_rng(batches)
    k = 12
    mix = rng.standard_normal((k, k))
    data = rng.standard_normal((300, k)) @ mix + 5.0 * rng.standard_normal(k)
    mode = gaussian.GaussianMode.choose(k, max_full_width=64, rank=4, oversample=4)
    state = gaussian.init(mode)
    update = jax.jit(gaussian.update)
    for chunk in np.array_split(data, batches):
      state = update(state, jnp.asarray(chunk, jnp.float32))
    self.assertEqual(float(state["count"]), 300.0)
    np.testing.assert_allclose(state["mean"], data.mean(0), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(gaussian.covariance(state), np.cov(data.T, ddof=0),
                               rtol=2e-4, atol=2e-4)

  def test_merge_of_two_states_equals_one_stream(self):
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((40, 6)) + 3.0, 2.0 * rng.standard_normal((90, 6)) - 1.0
    mode = gaussian.GaussianMode.choose(6, 64, 2, 2)
    sa = gaussian.update(gaussian.init(mode), jnp.asarray(a, jnp.float32))
    sb = gaussian.update(gaussian.init(mode), jnp.asarray(b, jnp.float32))
    merged = gaussian.merge(sa, sb)
    both = np.concatenate([a, b])
    np.testing.assert_allclose(merged["mean"], both.mean(0), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gaussian.covariance(merged), np.cov(both.T, ddof=0),
                               rtol=1e-4, atol=1e-4)

  def test_wide_features_keep_exact_diagonal_and_top_directions(self):
    rng = np.random.default_rng(1)
    k, r = 96, 4
    # Low-rank structure plus noise: the sketch must find the 4 strong directions.
    basis, _ = np.linalg.qr(rng.standard_normal((k, r)))
    data = (rng.standard_normal((2000, r)) * [30.0, 20.0, 12.0, 8.0]) @ basis.T
    data += 0.5 * rng.standard_normal((2000, k))
    mode = gaussian.GaussianMode.choose(k, max_full_width=32, rank=r, oversample=8)
    self.assertEqual(mode.kind, gaussian.DIAG_LOWRANK)
    state = gaussian.init(mode, seed=3)
    for chunk in np.array_split(data, 5):
      state = gaussian.update(state, jnp.asarray(chunk, jnp.float32))
    true = np.cov(data.T, ddof=0)
    model = np.asarray(gaussian.covariance(state))
    np.testing.assert_allclose(np.diag(model), np.diag(true), rtol=1e-3)
    top_true = np.linalg.eigvalsh(true)[::-1][:r]
    # Single-pass Nystrom: the leading eigenvalues within a few percent, the weakest kept one
    # within 10% (its sketch shares the noise floor of the 92 others).
    np.testing.assert_allclose(np.asarray(gaussian.eigenvalues(state, r)), top_true, rtol=0.1)
    np.testing.assert_allclose(np.asarray(gaussian.eigenvalues(state, r))[:2], top_true[:2],
                               rtol=0.02)
    rel = np.linalg.norm(model - true) / np.linalg.norm(true)
    self.assertLess(rel, 0.05)

  @parameterized.parameters(("full", 64), ("diag_lowrank", 16))
  def test_sampling_reproduces_the_learned_moments(self, kind, max_full_width):
    rng = np.random.default_rng(2)
    k = 24
    cov = _spd(rng, k, 50.0)
    mean = rng.standard_normal(k) * 3
    data = rng.multivariate_normal(mean, cov, size=4000)
    mode = gaussian.GaussianMode.choose(k, max_full_width, rank=24, oversample=0)
    self.assertEqual(mode.kind, kind)
    state = gaussian.update(gaussian.init(mode), jnp.asarray(data, jnp.float32))
    factors = gaussian.sampler_factors(state)
    rows = np.asarray(gaussian.sample_rows(jax.random.PRNGKey(5), factors, 40000))
    learned = np.asarray(gaussian.covariance(state))
    np.testing.assert_allclose(rows.mean(0), np.asarray(state["mean"]),
                               atol=0.05 * np.sqrt(np.diag(learned)).max())
    np.testing.assert_allclose(np.cov(rows.T, ddof=0), learned, atol=0.04 * np.abs(learned).max())

  def test_fewer_rows_than_features_still_samples_finite_rows(self):
    rng = np.random.default_rng(4)
    data = rng.standard_normal((10, 64)) * np.geomspace(1e-3, 1e3, 64)
    mode = gaussian.GaussianMode.choose(64, 128, 4, 4)
    state = gaussian.update(gaussian.init(mode), jnp.asarray(data, jnp.float32))
    factors = gaussian.sampler_factors(state)
    rows = np.asarray(gaussian.sample_rows(jax.random.PRNGKey(0), factors, 5000))
    self.assertTrue(np.isfinite(rows).all())
    learned = np.asarray(gaussian.covariance(state))
    np.testing.assert_allclose(rows.std(0), np.sqrt(np.diag(learned)), rtol=0.08)

  def test_outlier_channels_do_not_swamp_the_others_in_samples(self):
    rng = np.random.default_rng(3)
    data = rng.standard_normal((3000, 16))
    data[:, :2] *= 1e6
    mode = gaussian.GaussianMode.choose(16, 64, 4, 4)
    state = gaussian.update(gaussian.init(mode), jnp.asarray(data, jnp.float32))
    rows = np.asarray(gaussian.sample_rows(jax.random.PRNGKey(0),
                                           gaussian.sampler_factors(state), 20000))
    std = rows.std(0)
    np.testing.assert_allclose(std[2:], 1.0, rtol=0.05)
    np.testing.assert_allclose(std[:2], 1e6, rtol=0.05)


class MatrixNormalTest(parameterized.TestCase):

  def test_flip_flop_recovers_known_row_and_column_covariances(self):
    rng = np.random.default_rng(0)
    rows, cols = 5, 4
    u, v = _spd(rng, rows, 8.0), _spd(rng, cols, 5.0)
    u *= rows / np.trace(u)  # the identifiable normalization: tr(U) = rows
    m0 = rng.standard_normal((rows, cols))
    a, b = np.linalg.cholesky(u), np.linalg.cholesky(v)
    mode = matrix_normal.MatrixNormalMode.choose(rows, cols, max_full_width=64)
    state = matrix_normal.init(mode)
    update = jax.jit(lambda s, w: matrix_normal.update(s, w, ema=0.0))
    for _ in range(3000):
      w = m0 + a @ rng.standard_normal((rows, cols)) @ b.T
      state = update(state, jnp.asarray(w, jnp.float32))
    got_u, got_v = np.asarray(state["row_cov"]), np.asarray(state["col_cov"])
    self.assertAlmostEqual(np.trace(got_u), rows, places=3)
    self.assertLess(np.linalg.norm(got_u - u) / np.linalg.norm(u), 0.15)
    self.assertLess(np.linalg.norm(got_v - v) / np.linalg.norm(v), 0.15)
    np.testing.assert_allclose(state["mean"], m0, atol=0.15)

  def test_samples_have_the_model_covariances(self):
    rng = np.random.default_rng(1)
    rows, cols = 4, 3
    u, v = _spd(rng, rows, 4.0), _spd(rng, cols, 6.0)
    state = {"count": jnp.float32(10), "mean": jnp.asarray(rng.standard_normal((rows, cols)),
                                                           jnp.float32),
             "row_cov": jnp.asarray(u, jnp.float32), "col_cov": jnp.asarray(v, jnp.float32)}
    factors = matrix_normal.sampler_factors(state, jitter=0.0)
    draws = np.asarray(jax.vmap(lambda k: matrix_normal.sample(k, factors))(
        jax.random.split(jax.random.PRNGKey(0), 20000)))
    centred = draws - np.asarray(state["mean"])
    # E[(W - M)(W - M)^T] = U tr(V); E[(W - M)^T (W - M)] = V tr(U).
    emp_u = np.einsum("nij,nkj->ik", centred, centred) / len(draws)
    emp_v = np.einsum("nji,njk->ik", centred, centred) / len(draws)
    np.testing.assert_allclose(emp_u, u * np.trace(v), rtol=0.08, atol=0.05 * np.trace(v))
    np.testing.assert_allclose(emp_v, v * np.trace(u), rtol=0.08, atol=0.05 * np.trace(u))

  def test_wide_factors_are_kept_diagonal(self):
    mode = matrix_normal.MatrixNormalMode.choose(8, 40, max_full_width=16)
    state = matrix_normal.init(mode)
    chex.assert_shape(state["row_cov"], (8, 8))
    chex.assert_shape(state["col_cov"], (40,))
    rng = np.random.default_rng(2)
    for _ in range(5):
      state = matrix_normal.update(state, jnp.asarray(rng.standard_normal((8, 40)), jnp.float32))
    self.assertTrue(np.isfinite(np.asarray(state["col_cov"])).all())
    draw = matrix_normal.sample(jax.random.PRNGKey(0), matrix_normal.sampler_factors(state))
    chex.assert_shape(draw, (8, 40))


class FlushTest(parameterized.TestCase):

  @parameterized.parameters(1, 2)
  def test_counting_matches_real_quantization(self, axis):
    key = jax.random.PRNGKey(7 + axis)
    # Log-uniform magnitudes over 12 decades: plenty of values near the flush threshold.
    x = jnp.exp(jax.random.uniform(key, (1, 160, 300), minval=-14.0, maxval=14.0))
    x = x * jnp.sign(jax.random.normal(jax.random.PRNGKey(8), x.shape))

    @jax.jit
    def real(x):
      return jnp.stack([jnp.stack([flush_fractions(x[0], quantize(x[0], f, g, (axis - 1,)))[0]
                                   for g in flush.GRANULARITIES]) for f in (E4M3, E5M2)])

    expected = np.asarray(real(x))
    counted = np.asarray(jax.jit(lambda x: flush.table(x, axis))(x))
    self.assertTrue((expected > 0.01).all(), expected)
    np.testing.assert_allclose(counted, expected, rtol=0, atol=1e-6)
    self.assertEqual(flush.as_dict(counted)["e5m2"][GRANULARITIES[2]], float(counted[1, 2]))

  def test_outlier_channels_flush_tensorwise_and_rowwise_not_blockwise(self):
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 64, 512))
    x = x.at[..., 5:9].multiply(1e6)
    table = np.asarray(flush.table(x, 2))  # [format, granularity]
    e4m3 = dict(zip(flush.GRANULARITIES, table[0]))
    self.assertGreater(e4m3["tensorwise"], 0.9)
    self.assertGreater(e4m3["rowwise"], 0.9)
    self.assertLess(e4m3["block_1x128"], 0.3)  # only the outliers' block (127/512)
    self.assertGreater(e4m3["block_1x128"], 0.2)


class ReservoirTest(parameterized.TestCase):

  def test_pairs_stay_aligned(self):
    state = reservoir.init(16, {"lhs": (3,), "grad": (2,)}, jnp.float32)
    update = jax.jit(reservoir.update)
    offered = 0
    for step, m in enumerate((5, 40, 7, 64)):
      ids = np.arange(offered, offered + m, dtype=np.float32)
      items = {"lhs": jnp.asarray(np.repeat(ids[:, None], 3, 1)),
               "grad": jnp.asarray(np.repeat(-ids[:, None], 2, 1))}
      state = update(state, items, jax.random.PRNGKey(step))
      offered += m
    lhs, grad = np.asarray(state["lhs"]), np.asarray(state["grad"])
    self.assertEqual(int(state["seen"]), offered)
    np.testing.assert_array_equal(lhs[:, 0], -grad[:, 0])      # same item in both buffers
    np.testing.assert_array_equal(lhs, np.repeat(lhs[:, :1], 3, 1))
    self.assertEqual(len(set(lhs[:, 0])), 16)                  # distinct items
    self.assertTrue(set(lhs[:, 0]) <= set(np.arange(offered, dtype=np.float32)))

  def test_every_item_is_kept_with_equal_probability(self):
    cap, n, trials = 8, 40, 600
    update = jax.jit(reservoir.update)
    counts = np.zeros(n)
    for t in range(trials):
      state = reservoir.init(cap, {"x": ()}, jnp.float32)
      for start in range(0, n, 10):  # offered in 4 batches
        items = {"x": jnp.arange(start, start + 10, dtype=jnp.float32)}
        state = update(state, items, jax.random.PRNGKey(t * 10 + start))
      counts[np.asarray(state["x"], int)] += 1
    expected = trials * cap / n
    # Algorithm R keeps each item with probability cap / n: early and late items alike.
    self.assertLess(abs(counts[:10].mean() - expected) / expected, 0.12)
    self.assertLess(abs(counts[-10:].mean() - expected) / expected, 0.12)
    chi2 = ((counts - expected) ** 2 / expected).sum()
    self.assertLess(chi2, 80.0)  # 39 dof: p ~ 1e-4 at 80


class LayoutTest(parameterized.TestCase):

  @parameterized.parameters(("bnd,nk->bdk", "act_weight", (3, 5, 7), (5, 2)),
                            ("bqhd,bkhd->bhqk", "act_act", (2, 4, 3, 5), (2, 6, 3, 5)),
                            ("mk,kn->mn", "act_weight", (6, 8), (8, 3)))
  def test_rows_round_trip_and_features_are_contracted(self, spec, kind, lhs_shape, rhs_shape):
    layout = site_layout(spec, kind, lhs_shape, rhs_shape)
    for name in ("lhs", "rhs", "grad"):
      op = layout.operand(name)
      x = jax.random.normal(jax.random.PRNGKey(1), op.shape)
      rows = op.to_rows(x)
      chex.assert_shape(rows, (op.num_rows, op.num_features))
      chex.assert_trees_all_close(op.from_rows(rows), x)
    spec_p = layout.spec
    self.assertEqual(layout.lhs.features, "".join(i for i in spec_p.lhs if i in spec_p.contracting))
    self.assertIsNotNone(layout.slice_label)
    sub = layout.subsampled(1)
    self.assertEqual(sub.lhs.shape[layout.slice_axis("lhs")], 1)


if __name__ == "__main__":
  absltest.main()
