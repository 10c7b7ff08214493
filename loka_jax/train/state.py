"""The training state: one pytree holding everything a resumed run needs."""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping

import flax
import jax
import jax.numpy as jnp
import optax
from flax import serialization

from loka_jax.kernels import FP8_META, KernelPlan
from loka_jax.kernels.flax_delayed import merge_fp8_meta

PARAMS = "params"


@flax.struct.dataclass
class TrainState:
  """step = steps done = position in the data (batches are a pure function of seed and step);
  fp8_meta = delayed-scaling state (overwritten, never optimized); rng = raw uint32 key."""
  step: jax.Array
  params: Any
  opt_state: Any
  fp8_meta: Any
  rng: jax.Array

  def variables(self) -> Dict[str, Any]:
    """The Flax variables to `apply` the model with."""
    variables = {PARAMS: self.params}
    if self.fp8_meta:
      variables[FP8_META] = self.fp8_meta
    return variables

  def apply_gradients(self, tx: optax.GradientTransformation, grads, fp8_grads) -> "TrainState":
    """One optimizer step on params; fp8_meta becomes its gradient (overwrite-with-gradient)."""
    updates, opt_state = tx.update(grads, self.opt_state, self.params)
    return self.replace(step=self.step + 1, params=optax.apply_updates(self.params, updates),
                        opt_state=opt_state, fp8_meta=merge_fp8_meta(fp8_grads))

  def to_state_dict(self) -> Dict[str, Any]:
    """Nested dicts of arrays (optax's named tuples flattened) for checkpoints."""
    return serialization.to_state_dict(self)

  def from_state_dict(self, state_dict: Mapping[str, Any]) -> "TrainState":
    """`self` (a template of the right structure) filled from `state_dict`."""
    return serialization.from_state_dict(self, state_dict)


def split_variables(variables: Mapping[str, Any]):
  """(params, fp8_meta) of a model's variables; any other collection is an error."""
  variables = dict(variables)
  params = variables.pop(PARAMS, None)
  if params is None:
    raise ValueError("the model created no parameters (no 'params' collection)")
  fp8_meta = variables.pop(FP8_META, {})
  if variables:
    raise ValueError(
        f"the model created variable collection(s) {sorted(variables)} that training does "
        f"not know how to update; only 'params' and '{FP8_META}' (fp8_meta) are supported")
  return params, fp8_meta


_INIT_CACHE: Dict[Any, Any] = {}


def one_example(batch):
  """The first example of `batch`, to initialize a model from. Parameter and fp8-state shapes
  never depend on the batch size, so an init program on one example compiles once per model
  (XLA:CPU spends seconds on a tower's init: every parameter's random draw), whatever batch
  size a run trains at."""
  return jax.tree.map(lambda x: x[:1], batch)


def _jitted_init(model, collections: str = "all"):
  """model.init under jit, compiled once per (hashable) model within a process: every
  collection ("all"), the parameters only ("params") or every other collection ("state").
  Whatever a program does not return XLA drops, so "state" compiles no parameter draw."""
  def init(rngs, batch):
    variables = model.init(rngs, batch, train=False)
    if collections == "all":
      return variables
    return {k: v for k, v in variables.items() if (k == PARAMS) == (collections == PARAMS)}
  key = (model, collections)
  try:
    return _INIT_CACHE[key]
  except KeyError:
    fn = _INIT_CACHE[key] = jax.jit(init)
    return fn
  except TypeError:  # an unhashable model config
    return jax.jit(init)


def baseline_twin(model):
  """`model` with every site on the xla_bf16 plan, or None when it is that already or has no
  tower options (`opts.site`). A kernel plan changes no parameter (name, shape, initializer
  or random stream: a fused op's own variables are delayed-scaling state, in their own
  collection), so the twin's initial parameters are the model's, and every arm of one Mods
  set shares one parameter-init program: compiled once in a process, and found in the
  persistent compilation cache by a later one. (On an H200, InterFormer `large`'s quality
  runs spend 65-86 s in set-up, and a second run of the same arm in the process 0.4 s: the
  set-up is compiling, mostly the init, whose draws of 194 parameters XLA:CPU compiles in
  about 15 s.)"""
  opts = getattr(model, "opts", None)
  site = getattr(opts, "site", None)
  if site is None:
    return None
  base = dataclasses.replace(site, plan=KernelPlan.uniform("xla_bf16"))
  if base == site:
    return None
  return model.clone(opts=dataclasses.replace(opts, site=base))


def initial_state(model, tx: optax.GradientTransformation, example_batch, seed: int
                  ) -> TrainState:
  """The initial state's computation (traceable: jit it with shardings, or eval_shape it)."""
  init_key, rng = jax.random.split(jax.random.PRNGKey(seed))
  params_key, dropout_key = jax.random.split(init_key)
  rngs = {"params": params_key, "dropout": dropout_key}
  example = one_example(example_batch)
  twin = baseline_twin(model)
  if twin is None:
    variables = _jitted_init(model)(rngs, example)
  else:
    variables = {**_jitted_init(model, "state")(rngs, example),
                 PARAMS: _jitted_init(twin, PARAMS)(rngs, example)[PARAMS]}
  params, fp8_meta = split_variables(variables)
  fp8_meta = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), fp8_meta)
  return TrainState(step=jnp.asarray(0, jnp.int32), params=params, opt_state=tx.init(params),
                    fp8_meta=fp8_meta, rng=rng)


def create_train_state(model, tx: optax.GradientTransformation, example_batch, seed: int
                       ) -> TrainState:
  """Initializes parameters (and fp8 state) from `seed` on an example batch."""
  state = initial_state(model, tx, example_batch, seed)
  # Commit every array to its device, as restored checkpoints are: jit caches on
  # committedness, so a fresh and a resumed run then share one compiled step.
  return jax.tree.map(lambda x: jax.device_put(x, x.sharding), state)


def abstract_train_state(model, tx: optax.GradientTransformation, example_batch, seed: int
                         ) -> TrainState:
  """The state `create_train_state` makes, as shapes and dtypes on the default device: a
  template to restore a checkpoint into without materializing a second copy."""
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                      jax.eval_shape(lambda b: initial_state(model, tx, b, seed),
                                     example_batch))


def tree_bytes(tree) -> int:
  """Bytes of a tree's arrays, or of the arrays its shapes describe (`jax.ShapeDtypeStruct`)."""
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def state_bytes(model, tx: optax.GradientTransformation, example_batch, seed: int) -> int:
  """Bytes of the training state `create_train_state` would make (parameters, optimizer
  state, FP8 metadata), from abstract shapes: nothing is allocated or compiled."""
  return tree_bytes(abstract_train_state(model, tx, example_batch, seed))


@jax.jit
def _every_leaf_finite(leaves):
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def all_finite(tree) -> bool:
  """Whether every floating leaf of `tree` is finite, reduced where the leaves live.

  Not through numpy: `np.asarray` of a GPU array keeps its host copy cached on the array, so
  checking a restored Wukong-large state that way pinned ~50 GiB of host memory for as long
  as the state lived.
  """
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return True if not leaves else bool(_every_leaf_finite(leaves))
