"""Streaming Gaussian statistics over a feature dimension: batched Welford merge in fp32.

State (a dict of fp32 arrays, so checkpoints store it as it is):
  count  rows seen
  mean   [K]
  m2     [K, K]  sum of centred outer products           (mode 'full', K <= max_full_width)
  or, for wider features (mode 'diag_lowrank'):
  m2_diag [K]    exact sum of centred squares
  sketch  [K, s] m2 @ omega, a single-pass Nystrom sketch of m2 (omega: [K, s] orthonormal)
  top     [r]    zeros whose length is the rank kept (r <= s; the extra columns oversample)

Merging a batch of rows into the state is Chan et al.'s pairwise update; m2 is linear in the
merged terms, so the sketch `m2 @ omega` merges exactly too. The covariance of the wide form
is `L L^T + diag(d)`: the top-`rank` eigenpairs of the Nystrom approximation, plus the exact
diagonal's remainder, which keeps it positive semi-definite with the exact variances.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

FULL = "full"
DIAG_LOWRANK = "diag_lowrank"
_HI = lax.Precision.HIGHEST


@dataclasses.dataclass(frozen=True)
class GaussianMode:
  """How one operand's covariance is kept (static, from its width and the probe config)."""
  features: int
  kind: str          # FULL or DIAG_LOWRANK
  rank: int = 0      # top eigenpairs kept (DIAG_LOWRANK)
  sketch: int = 0    # sketch columns s >= rank

  @classmethod
  def choose(cls, features: int, max_full_width: int, rank: int, oversample: int
             ) -> "GaussianMode":
    if features <= max_full_width:
      return cls(features, FULL)
    r = min(rank, features)
    return cls(features, DIAG_LOWRANK, r, min(features, r + oversample))

  def describe(self) -> Dict:
    out = {"mode": self.kind, "features": self.features}
    if self.kind == DIAG_LOWRANK:
      out.update(rank=self.rank, sketch=self.sketch)
    return out


def init(mode: GaussianMode, seed: int = 0) -> Dict[str, jax.Array]:
  k = mode.features
  state = {"count": jnp.zeros((), jnp.float32), "mean": jnp.zeros((k,), jnp.float32)}
  if mode.kind == FULL:
    state["m2"] = jnp.zeros((k, k), jnp.float32)
  else:
    gauss = np.random.default_rng(seed).standard_normal((k, mode.sketch))
    omega, _ = np.linalg.qr(gauss)
    state["m2_diag"] = jnp.zeros((k,), jnp.float32)
    state["sketch"] = jnp.zeros((k, mode.sketch), jnp.float32)
    state["omega"] = jnp.asarray(omega, jnp.float32)
    state["top"] = jnp.zeros((mode.rank,), jnp.float32)
  return state


def update(state: Dict[str, jax.Array], rows: jax.Array) -> Dict[str, jax.Array]:
  """Merges a batch of rows [m, K] (any float dtype; accumulated in fp32)."""
  x = rows.astype(jnp.float32)
  n_b = jnp.float32(x.shape[0])
  mean_b = jnp.mean(x, axis=0)
  centred = x - mean_b
  n_a = state["count"]
  n = n_a + n_b
  delta = mean_b - state["mean"]
  weight = n_a * n_b / n
  out = {"count": n, "mean": state["mean"] + delta * (n_b / n)}
  if "m2" in state:
    m2_b = jnp.matmul(centred.T, centred, precision=_HI)
    out["m2"] = state["m2"] + m2_b + weight * jnp.outer(delta, delta)
  else:
    omega = state["omega"]
    out["omega"] = omega
    out["top"] = state["top"]
    out["m2_diag"] = state["m2_diag"] + jnp.sum(centred * centred, axis=0) + weight * delta ** 2
    projected = jnp.matmul(centred, omega, precision=_HI)              # [m, s]
    out["sketch"] = (state["sketch"] + jnp.matmul(centred.T, projected, precision=_HI)
                     + weight * jnp.outer(delta, delta @ omega))
  return out


def merge(a: Dict[str, jax.Array], b: Dict[str, jax.Array]) -> Dict[str, jax.Array]:
  """The state of the union of the rows behind `a` and `b` (same mode)."""
  n = a["count"] + b["count"]
  safe_n = jnp.maximum(n, 1.0)
  delta = b["mean"] - a["mean"]
  weight = a["count"] * b["count"] / safe_n
  out = {"count": n, "mean": a["mean"] + delta * (b["count"] / safe_n)}
  if "m2" in a:
    out["m2"] = a["m2"] + b["m2"] + weight * jnp.outer(delta, delta)
  else:
    out["omega"] = a["omega"]
    out["top"] = a["top"]
    out["m2_diag"] = a["m2_diag"] + b["m2_diag"] + weight * delta ** 2
    out["sketch"] = a["sketch"] + b["sketch"] + weight * jnp.outer(delta, delta @ a["omega"])
  return out


def covariance(state) -> jax.Array:
  """The population covariance [K, K] (full mode), or its diag + low-rank model."""
  if "m2" in state:
    return state["m2"] / jnp.maximum(state["count"], 1.0)
  factor, diag = lowrank_factors(state)
  return factor @ factor.T + jnp.diag(diag)


def lowrank_factors(state) -> Tuple[jax.Array, jax.Array]:
  """(L [K, r], d [K]) with covariance ~= L L^T + diag(d) (diag_lowrank mode).

  Nystrom from the sketch Y = C omega: C ~= Y (omega^T Y)^+ Y^T, computed stably with a
  small shift (Tropp et al., 2017), then its top eigenpairs; d makes the diagonal exact.
  """
  count = jnp.maximum(state["count"], 1.0)
  y = state["sketch"] / count
  omega = state["omega"]
  rank = state["top"].shape[0]
  shift = 1e-6 * jnp.linalg.norm(y) + 1e-30
  y_shift = y + shift * omega
  core = omega.T @ y_shift
  chol = jnp.linalg.cholesky(0.5 * (core + core.T))
  f = jax.scipy.linalg.solve_triangular(chol, y_shift.T, lower=True).T   # Y_v C^-T
  u, s, _ = jnp.linalg.svd(f, full_matrices=False)
  eig = jnp.maximum(s ** 2 - shift, 0.0)
  factor = u[:, :rank] * jnp.sqrt(eig[:rank])
  # A failed factorization (no rows yet, rounding) leaves the exact diagonal alone.
  factor = jnp.where(jnp.all(jnp.isfinite(factor)), factor, 0.0)
  diag = jnp.maximum(state["m2_diag"] / count - jnp.sum(factor ** 2, axis=1), 0.0)
  return factor, diag


def eigenvalues(state, top: int = 64) -> jax.Array:
  """The largest covariance eigenvalues, descending (approximate in the wide mode)."""
  if "m2" in state:
    vals = jnp.linalg.eigvalsh(covariance(state))[::-1]
  else:
    factor, _ = lowrank_factors(state)
    vals = jnp.linalg.svd(factor, compute_uv=False) ** 2
  return jnp.maximum(vals[:top], 0.0)


def sampler_factors(state, jitter: float = 1e-6):
  """(mean, factor, diag_std): rows = mean + z @ factor.T + z' * diag_std."""
  mean = state["mean"]
  if "m2" in state:
    return mean, scaled_cholesky(covariance(state), jitter), jnp.zeros_like(mean)
  factor, diag = lowrank_factors(state)
  return mean, factor, jnp.sqrt(diag)


def scaled_cholesky(cov: jax.Array, jitter: float = 1e-6) -> jax.Array:
  """A factor F with F F^T ~= cov, robust to features of wildly different scales (the
  correlation matrix is factored, then the scales go back on: an outlier channel of variance
  1e12 cannot swamp the others' variance of 1) and to rank deficiency (fewer rows seen than
  features): a symmetric eigendecomposition with the negative rounding noise clipped."""
  std = jnp.sqrt(jnp.maximum(jnp.diag(cov), 1e-30))
  corr = cov / std[:, None] / std[None, :]
  k = cov.shape[0]
  vals, vecs = jnp.linalg.eigh(corr + jitter * jnp.eye(k, dtype=cov.dtype))
  return std[:, None] * (vecs * jnp.sqrt(jnp.maximum(vals, 0.0)))


def sample_rows(key, factors, num_rows: int) -> jax.Array:
  """`num_rows` fp32 rows of N(mean, covariance) from `sampler_factors`."""
  mean, factor, diag_std = factors
  k1, k2 = jax.random.split(key)
  z = jax.random.normal(k1, (num_rows, factor.shape[1]), jnp.float32)
  rows = mean + jnp.matmul(z, factor.T, precision=_HI)
  return rows + jax.random.normal(k2, (num_rows, mean.shape[0]), jnp.float32) * diag_std


def summary(state, top: int = 32, spectrum: bool = True) -> Dict:
  """JSON-ready numbers for the report (host side). `spectrum` False leaves out the
  eigenvalues (an eigendecomposition of the covariance: most of this function's time) and
  what depends on them ("spectrum" empty, "top_eigen_fraction" None)."""
  count = float(state["count"])
  cov_diag = (np.diag(np.asarray(covariance(state))) if "m2" in state
              else np.asarray(state["m2_diag"]) / max(count, 1.0))
  std = np.sqrt(np.maximum(cov_diag, 0.0))
  mean = np.asarray(state["mean"])
  med = float(np.median(std)) if std.size else 0.0
  spectrum = (np.asarray(eigenvalues(state, top)) if count > 0 and spectrum
              else np.zeros(0))
  total = float(np.sum(np.maximum(cov_diag, 0.0)))
  return {
      "rows_seen": count,
      "mean_abs": float(np.mean(np.abs(mean))) if mean.size else 0.0,
      "std": {"min": float(std.min()) if std.size else 0.0, "median": med,
              "max": float(std.max()) if std.size else 0.0},
      # Spread of per-feature scales: outlier channels along the contraction show up here.
      "std_max_over_median": float(std.max() / med) if med > 0 else None,
      "spectrum": [float(v) for v in spectrum],
      "top_eigen_fraction": float(spectrum[0] / total) if total > 0 and spectrum.size else None,
  }
