"""loka_jax: FP8 for recommendation models in JAX/Flax (Probe, Mods, Dispatch)."""
import importlib

__version__ = "0.1.0"

# One-call Dispatch at the top level (`loka_jax.apply(config_or_module, plan)`), imported on
# first use so that `import loka_jax` stays light.
_LAZY = {"apply": "loka_jax.dispatch", "wrap": "loka_jax.dispatch",
         "select": "loka_jax.dispatch", "load_plan": "loka_jax.dispatch"}


def __getattr__(name):
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'loka_jax' has no attribute {name!r}")
  return getattr(importlib.import_module(module), name)
