"""Weights as a matrix normal MN(M, U, V), fitted by a flip-flop EMA over weight snapshots.

A weight in its canonical matrix view W [R, C] (rows = the weight's free indices, columns =
the contracted ones) is modelled as W = M + A Z B^T with U = A A^T (row covariance, R x R),
V = B B^T (column covariance, C x C), Z iid N(0, 1). Snapshots taken during training update:

  delta = W - M;  M <- M + a delta
  U <- (1 - a) (U + a delta V^-1 delta^T / C)       (Cholesky solves, jittered)
  V <- (1 - a) (V + a delta^T U^-1 delta / R)       (with the new U: the flip-flop)
  U <- U / t, V <- V * t with t = trace(U) / R      (U V is all the data identifies)

`a` is the EMA rate, or 1 / n (a running average) when the configured rate is 0. A factor
wider than `max_full_width` is kept diagonal (its updates keep only the diagonal). Samples
therefore spread around the current weight as the weight itself moved during training.
"""
from __future__ import annotations

import dataclasses
from typing import Dict

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from loka_jax.probe.gaussian import scaled_cholesky

_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class MatrixNormalMode:
  """Static shape and form of one weight's model."""
  rows: int
  cols: int
  full_rows: bool   # U kept full (else diagonal)
  full_cols: bool   # V kept full (else diagonal)

  @classmethod
  def choose(cls, rows: int, cols: int, max_full_width: int) -> "MatrixNormalMode":
    return cls(rows, cols, rows <= max_full_width, cols <= max_full_width)

  def describe(self) -> Dict:
    return {"mode": "matrix_normal", "rows": self.rows, "cols": self.cols,
            "row_cov": "full" if self.full_rows else "diag",
            "col_cov": "full" if self.full_cols else "diag"}


def _eye_or_ones(n: int, full: bool) -> jax.Array:
  return jnp.eye(n, dtype=jnp.float32) if full else jnp.ones((n,), jnp.float32)


def init(mode: MatrixNormalMode) -> Dict[str, jax.Array]:
  return {"count": jnp.zeros((), jnp.float32),
          "mean": jnp.zeros((mode.rows, mode.cols), jnp.float32),
          "row_cov": _eye_or_ones(mode.rows, mode.full_rows),
          "col_cov": _eye_or_ones(mode.cols, mode.full_cols)}


def _jittered(cov, jitter: float):
  """cov + jitter * diag(cov) (relative, so a row of large scale cannot swamp the rest),
  floored by a tiny multiple of the mean diagonal."""
  diag = cov if cov.ndim == 1 else jnp.diag(cov)
  floor = 1e-3 * jitter * jnp.maximum(jnp.mean(diag), 1e-30)
  add = jitter * jnp.maximum(diag, 0.0) + floor
  return cov + add if cov.ndim == 1 else cov + jnp.diag(add)


def _solve(cov, rhs, jitter: float):
  """cov^-1 rhs by a Cholesky solve (elementwise for a diagonal factor)."""
  cov = _jittered(cov, jitter)
  if cov.ndim == 1:
    return rhs / cov[:, None]
  return jax.scipy.linalg.cho_solve((jnp.linalg.cholesky(cov), True), rhs)


def _outer(a, b, full: bool):
  """a @ b (full) or its diagonal only."""
  if full:
    out = jnp.matmul(a, b, precision=_HI)
    return 0.5 * (out + out.T)
  return jnp.sum(a * b.T, axis=1)


def _trace(cov):
  return jnp.sum(cov) if cov.ndim == 1 else jnp.trace(cov)


def update(state, weight: jax.Array, *, ema: float = 0.1, jitter: float = 1e-6):
  """Merges one snapshot [R, C] of the weight (the first one sets M and a small V)."""
  w = weight.astype(jnp.float32)
  rows, cols = w.shape
  count = state["count"] + 1.0
  first = state["count"] == 0
  rate = (1.0 / count) if ema <= 0 else jnp.float32(ema)
  delta = w - state["mean"]
  mean = jnp.where(first, w, state["mean"] + rate * delta)
  full_rows, full_cols = state["row_cov"].ndim == 2, state["col_cov"].ndim == 2

  # U from the current V, then V from the new U.
  v_inv_dt = _solve(state["col_cov"], delta.T, jitter)                       # [C, R]
  row_cov = (1 - rate) * (state["row_cov"] + rate * _outer(delta, v_inv_dt, full_rows) / cols)
  u_inv_d = _solve(row_cov, delta, jitter)                                  # [R, C]
  col_cov = (1 - rate) * (state["col_cov"] + rate * _outer(delta.T, u_inv_d, full_cols) / rows)
  t = jnp.maximum(_trace(row_cov) / rows, 1e-30)
  row_cov, col_cov = row_cov / t, col_cov * t
  # A solve that failed in fp32 must not poison the state: keep the previous factors.
  ok = jnp.all(jnp.isfinite(row_cov)) & jnp.all(jnp.isfinite(col_cov))
  row_cov = jnp.where(ok, row_cov, state["row_cov"])
  col_cov = jnp.where(ok, col_cov, state["col_cov"])

  # Before any movement, the only scale is the weight's own: start V tiny and isotropic.
  scale0 = 1e-6 * jnp.maximum(jnp.mean(w * w), 1e-30)
  row0 = _eye_or_ones(rows, full_rows)
  col0 = _eye_or_ones(cols, full_cols) * scale0
  return {"count": count, "mean": mean, "row_cov": jnp.where(first, row0, row_cov),
          "col_cov": jnp.where(first, col0, col_cov)}


def _cholesky(cov, jitter: float):
  """A factor F with F F^T ~= cov (eigendecomposition: robust to rank deficiency)."""
  if cov.ndim == 1:
    return jnp.sqrt(jnp.maximum(_jittered(cov, jitter), 0.0))
  return scaled_cholesky(cov, jitter)


def sampler_factors(state, jitter: float = 1e-6):
  """(M, A, B): samples are M + A Z B^T (A, B vectors for diagonal factors)."""
  return state["mean"], _cholesky(state["row_cov"], jitter), _cholesky(state["col_cov"], jitter)


def sample(key, factors) -> jax.Array:
  """One fp32 draw [R, C] of MN(M, U, V)."""
  mean, a, b = factors
  z = jax.random.normal(key, mean.shape, jnp.float32)
  z = a[:, None] * z if a.ndim == 1 else jnp.matmul(a, z, precision=_HI)
  z = z * b[None, :] if b.ndim == 1 else jnp.matmul(z, b.T, precision=_HI)
  return mean + z


def _top_eigenvalues(cov: np.ndarray, top: int = 16) -> list:
  """The `top` largest eigenvalues of a covariance (2-D) or of a diagonal one (1-D)."""
  return [float(x) for x in np.sort(np.linalg.eigvalsh(cov) if cov.ndim == 2
                                    else cov)[::-1][:top]]


def summary(state, spectrum: bool = True) -> Dict:
  """JSON-ready numbers for the report (host side). `spectrum` False leaves out the row and
  column covariances' eigenvalues (empty lists): their host eigendecompositions are most of
  this function's time."""
  mean = np.asarray(state["mean"])
  u = np.asarray(state["row_cov"])
  v = np.asarray(state["col_cov"])
  u_diag = u if u.ndim == 1 else np.diag(u)
  v_diag = v if v.ndim == 1 else np.diag(v)
  # Entry variance of W - M is U_ii V_jj; its mean is tr(U) tr(V) / (R C).
  drift_var = float(np.mean(u_diag) * np.mean(v_diag))
  ms = float(np.mean(mean ** 2)) if mean.size else 0.0
  col_std = np.sqrt(np.maximum(np.mean(mean ** 2, axis=0), 0.0)) if mean.size else np.zeros(0)
  med = float(np.median(col_std)) if col_std.size else 0.0
  return {
      "snapshots": float(state["count"]),
      "rms": float(np.sqrt(ms)),
      "abs_max": float(np.max(np.abs(mean))) if mean.size else 0.0,
      "drift_rms": float(np.sqrt(max(drift_var, 0.0))),
      # Per contracted-index scale spread of the weight (outlier input channels).
      "col_rms_max_over_median": float(col_std.max() / med) if med > 0 else None,
      "row_cov_spectrum": _top_eigenvalues(u) if spectrum else [],
      "col_cov_spectrum": _top_eigenvalues(v) if spectrum else [],
  }
