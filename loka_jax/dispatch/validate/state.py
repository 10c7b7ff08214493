"""The state the checks run on: the context's trained parameters under a plan, with its
delayed-scaling state calibrated (`state_for`, `model_and_meta`), the device copy runs
consume and get back (`working_state`), held-out evaluation and its change against
bf16+Mods (`held_out`, `held_out_change_se`), and one compiled program for any subset of a
round's sites (`switch_board`, `held_out_change_switched`)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.dispatch.validate.config import BASELINE, DELAYED_WARMUP, ValidationContext
from loka_jax.kernels import FP8_META, KernelChoice, KernelPlan
from loka_jax.kernels.flax_delayed import merge_fp8_meta
from loka_jax.train.loop import compiled_steps, evaluate, loss_fn
from loka_jax.train.metrics import paired_logloss_change
from loka_jax.train.state import one_example


def _fresh_copy(tree):
  """Device copies, so a donating train step never consumes the original (small trees:
  fp8_meta)."""
  return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _host_copy(x):
  """A copy of `x` in host memory that shares no buffer with it (so donating `x` leaves it
  intact) and leaves no cached host copy on `x` (as np.asarray would, for its lifetime)."""
  try:
    return jax.device_put(x, jax.devices("cpu")[0], may_alias=False)
  except RuntimeError:  # no CPU backend in this process
    return np.array(jax.device_get(x), copy=True)


@contextlib.contextmanager
def working_state(ctx: ValidationContext):
  """The context's own device state, for a run that donates (consumes) it; afterwards, also
  after an error, the context's state is put back on the device from a host backup (taken
  once). One copy of the state on the device instead of two: Wukong large's 36 GB of
  parameters and Adam state do not fit an 80 GB card twice beside a training step."""
  if "host_state" not in ctx._cache:
    ctx._cache["host_state"] = (jax.tree.map(_host_copy, ctx.state),
                                jax.tree.map(lambda x: x.sharding, ctx.state))
  state, ctx.state = ctx.state, None
  try:
    yield state
  finally:
    del state
    backup, shardings = ctx._cache["host_state"]
    ctx.state = jax.tree.map(lambda h, sh: jax.device_put(h, sh, may_alias=False), backup,
                             shardings)


def _loss(model, params, fp8_meta, batch):
  return loss_fn(model, params, fp8_meta, batch, jax.random.PRNGKey(0))[0]


def state_for(ctx: ValidationContext, kplan: KernelPlan):
  """(model, state): the context's trained parameters under `kplan`; a plan with delayed
  scaling gets its fp8_meta state created and calibrated on DELAYED_WARMUP batches. Only
  the model and the fp8_meta are cached: the state is the context's current one."""
  model, meta = model_and_meta(ctx, kplan)
  return model, ctx.state.replace(fp8_meta=meta)


def model_and_meta(ctx: ValidationContext, kplan: KernelPlan):
  """(model, fp8_meta) of `kplan` (cached; the first call reads the context's state)."""
  key = ("meta", kplan)
  if key not in ctx._cache:
    ctx._cache[key] = _make_model_and_meta(ctx, kplan)
  return ctx._cache[key]


def _init_rngs():
  return {"params": jax.random.PRNGKey(0), "dropout": jax.random.PRNGKey(1)}


def _planned_shapes(ctx: ValidationContext, model):
  """`model`'s variables as shapes; a ValueError when its parameters are not the
  checkpoint's (a plan may change kernels only)."""
  shapes = jax.eval_shape(lambda b: model.init(_init_rngs(), b, train=False), ctx.batch())
  have = jax.tree.map(lambda x: (x.shape, x.dtype), ctx.state.params)
  if jax.tree.map(lambda x: (x.shape, x.dtype), shapes["params"]) != have:
    raise ValueError("the planned model's parameters differ from the checkpoint's; a plan "
                     "may change kernels only (check the plan's fused-op sites)")
  return shapes


def _meta_init(model) -> Callable:
  """One example -> `model`'s initial delayed-scaling state (jitted)."""
  return jax.jit(lambda b: model.init(_init_rngs(), b, train=False)[FP8_META])


def _calibrated(ctx: ValidationContext, init_meta: Callable, grad: Callable):
  """Delayed-scaling state as validation judges a plan with it: `init_meta`'s, then
  DELAYED_WARMUP updates by `grad(meta, batch)` on the context's first training batches."""
  meta = init_meta(one_example(ctx.batch()))
  for i in range(DELAYED_WARMUP):
    meta = merge_fp8_meta(grad(meta, ctx.batch(i)))
  return meta


def _make_model_and_meta(ctx: ValidationContext, kplan: KernelPlan):
  model = ctx.build(kplan)
  if FP8_META not in _planned_shapes(ctx, model):
    return model, {}
  grad = jax.jit(jax.grad(lambda m, p, b: _loss(model, p, m, b)))
  return model, _calibrated(ctx, _meta_init(model),
                            lambda m, b: grad(m, ctx.state.params, b))


def held_out(ctx: ValidationContext, kplan: KernelPlan, eval_batch_size: Optional[int] = None,
             state=None) -> Dict[str, Any]:
  """Held-out logloss / NE / AUC of the context's parameters (or `state`) under `kplan`, with
  every example's logit and label (`evaluate`'s scores) for paired comparisons."""
  key = ("held_out", kplan, eval_batch_size) if state is None else None
  if key is not None and key in ctx._cache:
    return ctx._cache[key]
  model, own = state_for(ctx, kplan) if state is None else (model_and_meta(ctx, kplan)[0], state)
  _, eval_step = compiled_steps(model, ctx.optim, "stop")
  size = min(eval_batch_size or ctx.batch_size, ctx.source.num_eval_examples())
  result = evaluate(eval_step, own, ctx.source, size, keep_scores=True)
  if key is not None:
    ctx._cache[key] = result
  return result


def held_out_change(ctx: ValidationContext, kplan: KernelPlan,
                    eval_batch_size: Optional[int] = None) -> float:
  """Relative held-out log-loss change of `kplan` against bf16+Mods on the context's
  parameters: the numerics of the plan's forwards alone move it."""
  return held_out_change_se(ctx, kplan, eval_batch_size)[0]


def held_out_change_se(ctx: ValidationContext, kplan: KernelPlan,
                       eval_batch_size: Optional[int] = None) -> Tuple[float, float]:
  """(`held_out_change`, its standard error over the eval examples): a change within about
  two standard errors of 0 is one this eval set cannot tell from none."""
  base = held_out(ctx, BASELINE, eval_batch_size)
  got = held_out(ctx, kplan, eval_batch_size)
  return paired_logloss_change(got["logits"], base["logits"], base["labels"])


def switched_plan(candidates: Mapping[str, KernelChoice]) -> KernelPlan:
  """Every candidate site on its choice behind a switch (`KernelPlan.switched`), every other
  site xla_bf16: with its switches set, the model is `only_site` of one candidate, or the
  plan of any subset of them."""
  return KernelPlan(sites=tuple(sorted(candidates.items())), rules=(),
                    default=BASELINE.default, switched=tuple(sorted(candidates)))


@dataclasses.dataclass
class SwitchBoard:
  """One compiled held-out evaluation (and, for delayed-scaling candidates, one compiled
  calibration gradient) of `switched_plan(candidates)`, for any subset of the candidates."""
  candidates: Dict[str, KernelChoice]
  apply: Callable          # (params, fp8_meta, switches, batch) -> float32 logits
  grad: Optional[Callable]  # (fp8_meta, params, switches, batch) -> fp8_meta "gradients"
  init_meta: Optional[Callable]  # one example -> the initial fp8_meta
  switch_paths: Dict[str, Tuple[str, ...]]  # site -> its flag's path in the collection
  # (params, fp8_meta, switches, batch) -> the parameter gradient of the training loss;
  # jitted, so it compiles only when a training check first ranks sites with it
  param_grad: Callable

  def covers(self, wanted: Mapping[str, KernelChoice]) -> bool:
    return all(self.candidates.get(site) == choice for site, choice in wanted.items())

  def switches(self, on) -> Dict:
    """The `site_switch` collection with exactly the sites of `on` switched on."""
    from flax import traverse_util
    return traverse_util.unflatten_dict(
        {path: jnp.asarray(site in on) for site, path in self.switch_paths.items()})


def switch_board(ctx: ValidationContext, wanted: Mapping[str, KernelChoice]) -> SwitchBoard:
  """A board whose candidates hold every (site, choice) of `wanted`: one already built for
  this context when one does (a round's sites, then the rounds after it whose sites kept
  their choices), else a new one of `wanted` (cached)."""
  boards = ctx._cache.setdefault("switch_boards", [])
  for board in boards:
    if board.covers(wanted):
      return board
  from flax import traverse_util
  from loka_jax.models.site import SITE_SWITCH
  candidates = dict(sorted(wanted.items()))
  model = ctx.build(switched_plan(candidates))
  shapes = _planned_shapes(ctx, model)
  paths = {"/".join(path[:-1]): path
           for path in traverse_util.flatten_dict(shapes.get(SITE_SWITCH, {}))}
  missing = sorted(set(candidates) - set(paths))
  if missing:
    raise ValueError(f"sites without a switch in the built model: {missing}")

  def variables(params, meta, switches):
    return {"params": params, SITE_SWITCH: switches, **({FP8_META: meta} if meta else {})}

  apply = jax.jit(lambda params, meta, switches, b: model.apply(
      variables(params, meta, switches), b, train=False).astype(jnp.float32))

  def loss(params, meta, switches, b):
    return loss_fn(model, params, meta, b, jax.random.PRNGKey(0), {SITE_SWITCH: switches})[0]

  grad = init_meta = None
  if FP8_META in shapes:
    init_meta = _meta_init(model)
    grad = jax.jit(jax.grad(lambda meta, params, switches, b: loss(params, meta, switches, b)))
  board = SwitchBoard(candidates, apply, grad, init_meta, paths, jax.jit(jax.grad(loss)))
  boards.append(board)
  return board


def held_out_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice], on,
                      eval_batch_size: Optional[int] = None) -> Dict[str, Any]:
  """`held_out` of the plan that runs the sites of `on` on their choices in `wanted` and
  every other site xla_bf16, through a switch board: no compilation once the board covering
  `wanted` exists. Delayed-scaling state is calibrated for this subset, as `state_for`
  calibrates a plan's (DELAYED_WARMUP batches)."""
  board = switch_board(ctx, wanted)
  switches = board.switches(set(on))
  meta = _switched_meta(ctx, board, switches)
  step = lambda state, batch: board.apply(state.params, meta, switches, batch)
  size = min(eval_batch_size or ctx.batch_size, ctx.source.num_eval_examples())
  return evaluate(step, ctx.state, ctx.source, size, keep_scores=True)


def _switched_meta(ctx: ValidationContext, board: SwitchBoard, switches) -> Dict:
  """The board's delayed-scaling state calibrated for the subset `switches` turns on, as
  `state_for` calibrates a plan's ({} where no candidate keeps such state)."""
  if board.init_meta is None:
    return {}
  return _calibrated(ctx, board.init_meta,
                     lambda m, b: board.grad(m, ctx.state.params, switches, b))


def held_out_change_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice],
                             site: str, eval_batch_size: Optional[int] = None) -> float:
  """`held_out_change` of `site` alone on its choice in `wanted`, measured on a switch board
  against the same board with every switch off (the bf16+Mods forward in the same program,
  so the two differ by the site's product alone)."""
  board = switch_board(ctx, wanted)
  key = ("switched_base", id(board), eval_batch_size)
  if key not in ctx._cache:
    ctx._cache[key] = held_out_switched(ctx, wanted, (), eval_batch_size)
  base = ctx._cache[key]
  got = held_out_switched(ctx, wanted, (site,), eval_batch_size)
  return paired_logloss_change(got["logits"], base["logits"], base["labels"])[0]
