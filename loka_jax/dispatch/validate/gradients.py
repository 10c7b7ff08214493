"""How far one site's plan moves the parameter gradient on the context's state
(`gradient_change`): what the training checks rank a failing round's sites by. Each
gradient from its own program (`only_site`) or every site's from one switch board
(`gradient_switched`); the distance in float32 on the device (`gradient_distance`)."""
from __future__ import annotations

import functools
import math
from typing import Callable, Dict, Mapping, Optional, Tuple

import jax
import jax.numpy as jnp

from loka_jax.dispatch.validate.config import BASELINE, ValidationContext, only_site
from loka_jax.dispatch.validate.state import _loss, _switched_meta, state_for, switch_board
from loka_jax.kernels import KernelChoice, KernelPlan


def _gradient(ctx: ValidationContext, kplan: KernelPlan, batches: int):
  """The parameter gradient under `kplan`, summed over the context's first `batches`
  training batches (`_summed_gradient`)."""
  model, state = state_for(ctx, kplan)
  grad = _jitted_gradient(model)
  return _summed_gradient(lambda b: grad(state.params, state.fp8_meta, b), ctx, batches)


@functools.lru_cache(maxsize=64)
def _jitted_gradient(model):
  """The jitted parameter gradient of `model`'s loss, one per model (equal models, as the
  same plan builds them, share it: measuring a site again traces and compiles nothing)."""
  return jax.jit(jax.grad(lambda p, m, b: _loss(model, p, m, b)))


def _summed_gradient(grad_of: Callable, ctx: ValidationContext, batches: int):
  """`grad_of(batch)` summed over the context's first `batches` training batches: a tree of
  float32 leaves, left on the device. A float64 host copy of every parameter made each of
  Wukong `large`'s site measurements take 35 s and its H200 host 125 GiB at peak;
  `gradient_distance` reads two on the device. The running sum is added to in place
  (donated), so summing holds two gradients on the device, not three (12 GB each at Wukong
  `large`, beside its 36.6 GB state and the bf16 reference gradient)."""
  total = None
  for i in range(batches):
    g = jax.tree.map(lambda x: x.astype(jnp.float32), grad_of(ctx.batch(i)))
    total = g if total is None else _add_into(total, g)
  return total


_add_into = jax.jit(lambda total, g: jax.tree.map(jnp.add, total, g), donate_argnums=0)


def _scaled_norm(x: jax.Array) -> Tuple[jax.Array, jax.Array]:
  """(max |x|, ||x / max |x|||): x's 2-norm is their product. Scaling first keeps the
  float32 sum of squares from underflowing (a gradient leaf near 1e-20) or overflowing."""
  top = jnp.max(jnp.abs(x))
  return top, jnp.sqrt(jnp.sum(jnp.square(x / jnp.where(top > 0, top, 1.0))))


@jax.jit
def _distance_parts(g, ref):
  """Each leaf's scaled norm of g - ref and of ref, and whether every entry of g is finite:
  one program, so the difference is never stored."""
  diffs = [_scaled_norm(a - b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(ref))]
  refs = [_scaled_norm(b) for b in jax.tree.leaves(ref)]
  finite = jnp.all(jnp.stack([jnp.all(jnp.isfinite(a)) for a in jax.tree.leaves(g)]))
  return diffs, refs, finite


def _norm_of(parts) -> float:
  """The 2-norm of a tree from its leaves' scaled norms, combined in float64."""
  return math.sqrt(sum((float(top) * float(rest)) ** 2 for top, rest in parts))


def gradient_distance(g, ref, largest_leaves: int = 0):
  """||g - ref|| / ||ref|| over two gradient trees of the same structure (a zero `ref`
  counts as norm 1); inf where g is not finite.

  With `largest_leaves` = k > 0: (that value, {"largest_leaf_changes": the k leaves whose
  own relative change ||g_l - ref_l|| / ||ref_l|| is largest, as [path, change] pairs}). The
  whole gradient's change is dominated by its largest leaves, so a site that moves a small
  leaf completely (an embedding table's rows, a norm's scale) can read small there: at
  Wukong `large` the shadow check's ranking did not find what stopped training, so each
  site's record shows these leaves beside it. A leaf whose reference is zero reads its
  change's norm itself."""
  if jax.tree.structure(g) != jax.tree.structure(ref):
    raise ValueError("gradient_distance: the two gradients' parameter trees differ: "
                     f"{jax.tree.structure(g)} vs {jax.tree.structure(ref)}")
  diffs, refs, finite = jax.device_get(_distance_parts(g, ref))
  value = _norm_of(diffs) / (_norm_of(refs) or 1.0) if finite else math.inf
  if largest_leaves <= 0:
    return value
  leaves = []
  if finite:
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
    for path, d, r in zip(paths, diffs, refs):
      leaves.append((path, _norm_of([d]) / (_norm_of([r]) or 1.0)))
    leaves.sort(key=lambda pc: (-pc[1], pc[0]))
  return value, {"largest_leaf_changes": [[p, c] for p, c in leaves[:largest_leaves]]}


def gradient_switched(ctx: ValidationContext, wanted: Mapping[str, KernelChoice], on,
                      batches: int):
  """`_gradient` of the plan that runs the sites of `on` on their choices in `wanted` and
  every other site xla_bf16, through a switch board: one compiled gradient serves every
  subset. A switched-off site's FP8 product still runs; the pick sends it a zero cotangent,
  so its backward adds nothing."""
  board = switch_board(ctx, wanted)
  switches = board.switches(set(on))
  meta = _switched_meta(ctx, board, switches)
  return _summed_gradient(lambda b: board.param_grad(ctx.state.params, meta, switches, b),
                          ctx, batches)


def gradient_change(ctx: ValidationContext, site: str, choice: KernelChoice, batches: int,
                    wanted: Optional[Mapping[str, KernelChoice]] = None,
                    reference: Optional[Dict] = None, largest_leaves: int = 0):
  """How far `site` alone on `choice` moves the parameter gradient on the context's state:
  ||g(site) - g(bf16)|| / ||g(bf16)||, summed over `batches` training batches (inf where the
  gradient is not finite). With `wanted` (the round's candidates) both gradients come from
  one switch board, its bf16 one with every switch off; else each from its own program.
  `reference`: where the bf16 gradient is kept between calls (the caller's, so it lives no
  longer than the caller needs it: a float32 copy of every parameter on the device, 12 GB
  at Wukong `large`); None computes it each call. `largest_leaves`: as in
  `gradient_distance` (then a (value, extras) pair)."""
  reference = {} if reference is None else reference
  if wanted is None:
    key = ("gradient", BASELINE, batches)
    base = lambda: _gradient(ctx, BASELINE, batches)
    got = lambda: _gradient(ctx, only_site(site, choice), batches)
  else:
    key = ("gradient", id(switch_board(ctx, wanted)), batches)
    base = lambda: gradient_switched(ctx, wanted, (), batches)
    got = lambda: gradient_switched(ctx, wanted, (site,), batches)
  if key not in reference:
    reference[key] = base()
  return gradient_distance(got(), reference[key], largest_leaves)
