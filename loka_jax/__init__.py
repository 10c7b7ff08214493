"""loka_jax: FP8 for recommendation models in JAX/Flax (Probe, Mods, Dispatch).

The public API, on any Flax Linen model whose matrix products are nn.Dense,
nn.DenseGeneral, nn.Einsum or loka_jax sites:

  report = loka_jax.probe(model, variables, batches, loss_fn)   # ProbeReport (loka.probe/2)
  plan = loka_jax.select(report)                               # Plan (loka.plan/1)
  fp8_model = loka_jax.wrap(model, plan)                       # same variables
  plan = loka_jax.validate(fp8_model, plan, variables, held_out, loss_fn)

`loka_jax.Probe(model, loss_fn)` is the streaming form for the user's own training loop
(`observe(variables, batch)` every N steps, then `report()`); `apply` bakes a plan into a
loka_jax tower; `load_plan` reads a plan file.

`loka_jax.probe` is the probe subpackage, callable as the function above.
"""
__version__ = "0.1.0"

from loka_jax.plan import apply, load_plan, read_plan, save_plan, wrap  # noqa: E402
from loka_jax.dispatch.loss_check import validate  # noqa: E402
from loka_jax.dispatch.selection import select  # noqa: E402
from loka_jax import probe  # noqa: E402  (callable: streaming.probe)
from loka_jax.probe.streaming import Probe  # noqa: E402

__all__ = ["Probe", "apply", "load_plan", "probe", "read_plan", "save_plan", "select",
           "validate", "wrap"]
