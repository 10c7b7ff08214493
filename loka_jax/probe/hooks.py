"""Where sites hand their operands to the probe. Off unless the probe's collections are in
play for the current apply, so training and inference pay nothing for it."""
from __future__ import annotations

PROBE_COLLECTION = "probe"             # sown forward operands, per site
PROBE_GRAD_COLLECTION = "probe_grads"  # zero perturbations whose gradient is d loss / d out


def observe_operands(module, spec, kind, lhs, rhs) -> None:
  """Sows a site's forward operands when the probe collection is mutable."""
  del spec, kind
  if module.is_initializing() or not module.is_mutable_collection(PROBE_COLLECTION):
    return
  module.sow(PROBE_COLLECTION, "lhs", lhs)
  module.sow(PROBE_COLLECTION, "rhs", rhs)


def observe_output_grad(module, out):
  """Adds Flax's zero `perturb` variable to the site output when the probe asks for it
  (collection mutable or passed in); its gradient is the output gradient of the site."""
  if module.is_initializing():
    return out
  return module.perturb("out", out, collection=PROBE_GRAD_COLLECTION)
