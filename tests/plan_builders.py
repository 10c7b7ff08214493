"""A hand-made Dispatch plan for a tiny DLRM and the probe statistics its export reads, for
the export, serving-quality and bench tests (`from plan_builders import make_plan, ...`)."""
import jax

from loka_jax import dispatch
from loka_jax.probe import collector as collector_lib
from loka_jax.probe import stats_report, training

BATCH = 64                        # the examples of each of the probe's batches
BF16_SITE = "top_mlp/dense_2"     # make_plan keeps the output layer in bf16


def make_plan(sites):
  """Rowwise FP8 forward on the MLPs, tensorwise elsewhere, bf16 on the last layer."""
  fwd = lambda name: ("xla_bf16" if name == BF16_SITE else
                      "xla_fp8_rowwise" if "mlp" in name else "xla_fp8_tensorwise")
  return dispatch.Plan({
      "schema": dispatch.SCHEMA, "model": "dlrm",
      "sites": {n: {"fwd": {"kernel": fwd(n), "reason": "test"},
                    "grad_lhs": {"kernel": "xla_bf16", "reason": "test"},
                    "grad_rhs": {"kernel": "xla_bf16", "reason": "test"}} for n in sites},
      "rules": [], "default": None})


def probe_stats(model, variables, source):
  """The report's per-site statistics from the probe's statistics pass over 2 batches."""
  batch = source.train_batch(0, BATCH)
  abstract = jax.eval_shape(lambda: variables)
  config = collector_lib.ProbeConfig(min_observations=1)
  sites = training.probe_sites(model, abstract, batch, config)
  probe = training.ProbeCollector(model, source, BATCH, sites, config,
                                       example_variables=abstract)
  for step in range(2):
    probe.observe(variables, jax.random.PRNGKey(2), step)
  state = jax.device_get(probe.state)
  return {"sites": {n: {"stats": stats_report.site_stats(
      s, collector_lib.site_state(state, sites, n), probe.observations)}
      for n, s in sites.items()}}
