"""Models loka_jax did not build, their batches and losses, for the public-API tests.

Plain Flax Linen only: the tests check what `loka_jax.probe`, `select`, `wrap` and `validate`
do with models written without loka_jax in mind. Every expected site name and shape in the
tests is written by hand from these definitions.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

BATCH = 32
IN = 16
PASSES = ("fwd", "grad_lhs", "grad_rhs")
FP8_KERNELS = ("xla_fp8_tensorwise", "xla_fp8_rowwise")


class Block(nn.Module):
  """A residual block: two Dense layers under one scope ('block/up', 'block/down')."""
  width: int

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(self.width, name="down")(nn.relu(nn.Dense(2 * self.width,
                                                                  name="up")(x)))


class DenseMLP(nn.Module):
  """Auto-named Dense layers around a named block: sites Dense_0, block/up, block/down,
  Dense_1."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(32)(x))
    h = Block(32, name="block")(h)
    return nn.Dense(1)(h)[:, 0]


class GeneralEinsum(nn.Module):
  """nn.DenseGeneral with a multi-feature output, nn.Einsum contracting two axes, and a
  DenseGeneral contracting two axes."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.DenseGeneral((4, 8), name="proj")(x))              # [B, 4, 8]
    h = nn.Einsum((4, 8, 16), "bhd,hde->be", name="mix")(h)           # [B, 16]
    h = nn.relu(h).reshape(h.shape[0], 4, 4)
    return nn.DenseGeneral(1, axis=(-2, -1), name="fold")(h)[:, 0]    # [B]


class TwoHeads(nn.Module):
  """A shared trunk, a classification head and a regression head (a dict of outputs)."""
  classes: int = 5

  @nn.compact
  def __call__(self, x):
    t = nn.relu(nn.Dense(32, name="trunk")(x))
    return {"logits": nn.Dense(self.classes, name="cls")(t),
            "value": nn.Dense(1, name="reg")(t)[:, 0]}


class MyDense(nn.Dense):
  """A Dense subclass: it may compute something else, so wrap leaves it alone."""


class Inner(nn.Module):
  @nn.compact
  def __call__(self, h):
    w = self.param("w", nn.initializers.lecun_normal(), (h.shape[-1], 16))
    return jnp.dot(h, w)


class WithUnrouted(nn.Module):
  """Two Dense sites ('in', 'head') and three products outside them: a `@` with a parameter
  at the top level, a jnp.dot in the submodule 'inner', and a Dense subclass 'sub'."""

  @nn.compact
  def __call__(self, x):
    h = nn.relu(nn.Dense(16, name="in")(x))
    h = h @ self.param("top_w", nn.initializers.lecun_normal(), (16, 16))
    h = Inner(name="inner")(h)
    h = MyDense(16, name="sub")(h)
    return nn.Dense(1, name="head")(h)[:, 0]


class NoProduct(nn.Module):
  """Element-wise only: nothing for the probe to reach."""

  @nn.compact
  def __call__(self, x):
    return jnp.sum(x * self.param("scale", nn.initializers.ones, (x.shape[-1],)), axis=-1)


class EncDec(nn.Module):
  """Two Dense sites, 'enc' and 'dec' (the validate tests)."""

  @nn.compact
  def __call__(self, x):
    return nn.Dense(1, name="dec")(nn.relu(nn.Dense(32, name="enc")(x)))[:, 0]


# ----------------------------------------------------------------------------- data and losses


def regression_batches(n: int, seed: int = 0, batch: int = BATCH, features: int = IN):
  rng = np.random.default_rng(seed)
  return [{"x": rng.standard_normal((batch, features)).astype(np.float32),
           "y": rng.standard_normal(batch).astype(np.float32)} for _ in range(n)]


def regression_setup(model, n: int, seed: int):
  """(n regression batches, `model`'s variables initialized on the first), both from `seed`."""
  batches = regression_batches(n, seed=seed)
  return batches, jax.jit(model.init)(jax.random.PRNGKey(seed), batches[0]["x"])


def labelled_batches(n: int, seed: int = 0, classes: int = 5):
  rng = np.random.default_rng(seed)
  return [{"x": rng.standard_normal((BATCH, IN)).astype(np.float32),
           "y": rng.standard_normal(BATCH).astype(np.float32),
           "label": rng.integers(0, classes, BATCH).astype(np.int32)} for _ in range(n)]


def mse(out, batch):
  return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)


def two_head_loss(out, batch):
  """0.7 x softmax cross-entropy + 0.3 x squared error."""
  ce = optax.softmax_cross_entropy_with_integer_labels(out["logits"].astype(jnp.float32),
                                                       batch["label"])
  return 0.7 * jnp.mean(ce) + 0.3 * jnp.mean((out["value"].astype(jnp.float32)
                                              - batch["y"]) ** 2)


def x_of(model):
  """apply_fn(variables, batch) -> model(batch['x'])."""
  return lambda variables, batch: model.apply(variables, batch["x"])


# ----------------------------------------------------------------------------- helpers


def rel_err(a, b) -> float:
  """Relative Frobenius error of `a` against `b` over every leaf of two trees."""
  la = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(a)]
  lb = [np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(b)]
  da = np.concatenate(la) - np.concatenate(lb)
  return float(np.linalg.norm(da) / np.linalg.norm(np.concatenate(lb)))


def fp8_dots(module_text: str, fmt: str = "f8E4M3FN") -> int:
  """dot_generals whose operands are FP8 in lowered StableHLO."""
  return sum(1 for line in module_text.splitlines() if "dot_general" in line and fmt in line)


def host_copy(tree):
  """A numpy copy of every leaf (to check that nothing was mutated)."""
  return jax.tree.map(lambda x: np.array(x, copy=True), tree)


def uniform_plan(sites, kernel: str):
  """A loka.plan/1 dict, written by hand, that runs `kernel` in every pass of `sites`."""
  return {"schema": "loka.plan/1", "sites": {s: {p: kernel for p in PASSES} for s in sites},
          "default": {p: "xla_bf16" for p in PASSES}}
