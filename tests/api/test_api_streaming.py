"""The streaming form: `loka_jax.Probe.observe` inside the user's own training loop, with the
variables of the step it is called at, then `report()`."""
import chex
import jax
import numpy as np
import optax
from absl.testing import absltest
from absl.testing import parameterized

import api_models as am
import loka_jax

STEPS = 6
EVERY = 2    # observe at steps 0, 2, 4
OBSERVED = len(range(0, STEPS, EVERY))


class StreamingTest(chex.TestCase):

  @parameterized.named_parameters(
      ("sgd_momentum", lambda learning_rate: optax.sgd(learning_rate, momentum=0.9), 0.1),
      ("adam", optax.adam, 0.05))
  def test_observe_in_a_training_loop(self, optimizer, learning_rate):
    model = am.EncDec()
    batches = am.regression_batches(STEPS, seed=5)
    params = jax.jit(model.init)(jax.random.PRNGKey(5), batches[0]["x"])["params"]
    initial = am.host_copy(params)
    tx = optimizer(learning_rate)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, batch):
      loss, grads = jax.value_and_grad(
          lambda p: am.mse(model.apply({"params": p}, batch["x"]), batch))(params)
      updates, opt_state = tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    traces = []   # the user's apply_fn runs (in Python) only when JAX traces it

    def apply_fn(variables, batch):
      traces.append(1)
      return model.apply(variables, batch["x"])

    probe = loka_jax.Probe(model, am.mse, apply_fn=apply_fn, samples=4)
    traced_by_first = None
    observed_params = []
    for step, batch in enumerate(batches):
      if step % EVERY == 0:
        probe.observe({"params": params}, batch)
        observed_params.append(am.host_copy(params))
        if traced_by_first is None:
          traced_by_first = len(traces)
      params, opt_state, _ = train_step(params, opt_state, batch)

    # one compile: later observations with new variables (same shapes) trace nothing
    self.assertEqual(len(traces), traced_by_first)
    self.assertEqual(probe._pass.extract._cache_size(), 1)
    for update in probe._pass.updates.values():
      self.assertEqual(update._cache_size(), 1)
    overhead = probe.overhead()
    self.assertEqual(set(overhead), {"observations", "probe_ms", "compile_s"})
    self.assertEqual(overhead["observations"], OBSERVED)
    self.assertLess(overhead["probe_ms"], 1e3 * overhead["compile_s"])
    self.assertEqual(probe.observations, OBSERVED)

    report = probe.report()
    self.assertEqual(list(report["sites"]), ["enc", "dec"])
    self.assertEqual(report["run"]["observed_batches"], OBSERVED)
    self.assertEqual(report["overhead"]["observations"], OBSERVED)
    for name in ("enc", "dec"):
      with self.subTest(site=name):
        stats = report["sites"][name]["stats"]
        self.assertEqual(stats["observations"], OBSERVED)
        self.assertEqual(stats["lhs"]["rows_seen"], OBSERVED * am.BATCH)
        self.assertEqual(stats["rhs"]["snapshots"], OBSERVED)
        chex.assert_tree_all_finite(report["sites"][name]["passes"]["fwd"]["xla_bf16"]["sqnr_db"])
    # the weight statistics follow the training: the largest |weight| of 'dec' is the one of
    # the last observed step's variables (as the site saw it, in bf16), not the initial one
    last = np.abs(observed_params[-1]["dec"]["kernel"]).max()
    first = np.abs(initial["dec"]["kernel"]).max()
    self.assertGreater(abs(last - first) / first, 0.05)   # training moved it
    np.testing.assert_allclose(report["sites"]["dec"]["stats"]["rhs"]["amax"]["last"], last,
                               rtol=4e-3)   # bf16 rounding: at most 2^-9


if __name__ == "__main__":
  absltest.main()
