"""Paired quality verdicts of the quality suite's rows: each arm against bf16+Mods and bf16,
seed by seed (`loka_jax.train.verdict.paired_quality`).

A seed pairs two rows only when they share what the protocol says they share: the held-out
set (`eval_fingerprint`, every row), the data order (`train_fingerprint`: the training
batches at the run's first, second, middle and last steps) and the initial weights
(`init_fingerprint`: every parameter but biases and norm scales, the ones the Mods drop; the
Mods arms' parameters are the plain arms' less those, drawn from the same key by module
path). Rows written before a fingerprint lack it and are compared on the ones both hold; a
seed whose fingerprints differ is left out of the pairs and named in the verdict's note.
"""
from __future__ import annotations

import hashlib
import statistics
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax.train import verdict as verdict_lib

# Judged, each against both references.
ARMS = ("loka", "loka_accuracy", "fp8_naive", "fp8_naive_mods", "fp8_delayed")
REFERENCES = ("bf16_mods", "bf16")
# The arms whose kernels come from a plan, which may name none (then not applicable).
PLAN_ARMS = ("loka", "loka_accuracy")
LABELS = {"bf16": "bf16", "bf16_mods": "bf16+Mods", "fp8_naive": "naive FP8",
          "fp8_naive_mods": "naive FP8 with the Mods", "fp8_delayed": "Flax delayed everywhere",
          "loka": "LoKA", "loka_accuracy": "LoKA, error budget alone"}
FINGERPRINTS = ("eval_fingerprint", "train_fingerprint", "init_fingerprint")
# Parameters the Mods drop (no_bias, BlockNorm in place of LayerNorm), left out of the
# initial-weights fingerprint so that the arms with and without Mods share it.
NOT_FINGERPRINTED = ("bias", "scale")
SAMPLE = 1024   # leading values of each parameter the fingerprint hashes


def train_fingerprint(source, batch_size: int, steps: int) -> str:
  """sha256 of the training batches at steps 0, 1, steps // 2 and steps - 1 (every field,
  in order): the data order of a run."""
  h = hashlib.sha256()
  for step in sorted({0, min(1, steps - 1), steps // 2, max(steps - 1, 0)}):
    batch = source.train_batch(step, batch_size)
    for key in sorted(batch):
      h.update(key.encode())
      h.update(np.ascontiguousarray(batch[key]).tobytes())
  return h.hexdigest()[:16]


def init_fingerprint(params) -> str:
  """sha256 of the leading SAMPLE values of every initial parameter but biases and norm
  scales, with its path and shape (one small device program, whatever the model's size)."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  chosen = [(jax.tree_util.keystr(path), x) for path, x in flat
            if not (path and str(getattr(path[-1], "key", path[-1])) in NOT_FINGERPRINTED)]
  heads = jax.jit(lambda xs: [jnp.ravel(x)[:SAMPLE].astype(jnp.float32) for x in xs])(
      [x for _, x in chosen])
  h = hashlib.sha256()
  for (name, x), head in zip(chosen, jax.device_get(heads)):
    h.update(f"{name}{tuple(x.shape)}".encode())
    h.update(np.ascontiguousarray(head).tobytes())
  return h.hexdigest()[:16]


def rows_by_seed(rows: Sequence[Mapping], comparison, arm: str) -> Dict[int, Mapping]:
  """{seed: row} of `arm`'s scored rows in `comparison` (`quality.Comparison.holds`)."""
  return {r["seed"]: r for r in rows if comparison.holds(r) and r.get("arm") == arm}


def unpaired_why(a: Mapping, b: Mapping) -> Optional[str]:
  """Why rows `a` and `b` of one seed are not a pair (a fingerprint both record differs),
  else None."""
  differ = [f.split("_")[0] for f in FINGERPRINTS
            if a.get(f) is not None and b.get(f) is not None and a[f] != b[f]]
  return None if not differ else f"{' and '.join(differ)} fingerprints differ"


def fp8_plan(rows: Sequence[Mapping], comparison, arm: str) -> Optional[bool]:
  """Whether `arm` runs an FP8 kernel in `comparison`: the naive and delayed arms do; a plan
  arm (LoKA, LoKA under the error budget alone) where its rows' plan (`plan_kernels`) names
  one. A row that took bf16+Mods' run (`same_run_as`) has none; LoKA rows without
  `plan_kernels` fall back on the LoKA speed row of the same model, preset and Mods set (its
  `kernels`), then on bf16+Mods' scores (identical at every seed: its program); None where
  none says."""
  if arm not in PLAN_ARMS:
    return True
  from experiments.bench import mods_set
  from loka_jax.kernels import registry
  arm_rows = list(rows_by_seed(rows, comparison, arm).values())
  if arm_rows and all(r.get("same_run_as") for r in arm_rows):
    return False
  named = [r["plan_kernels"] for r in arm_rows if r.get("plan_kernels") is not None]
  if not named and arm == "loka":
    named = [r["kernels"] for r in rows
             if r.get("suite") == "models" and r.get("variant") == "loka" and r.get("kernels")
             and r.get("model") == comparison.model and r.get("preset") == comparison.preset
             and (mods_set.of_row(r) or "") == comparison.mods_set]
  if not named:
    # Bit-identical scores at every seed with bf16+Mods' runs: the same program (a plan
    # with no FP8 kernel, on a deterministic backend such as the CPU).
    twins = rows_by_seed(rows, comparison, "bf16_mods")
    if arm_rows and all(r["seed"] in twins and twins[r["seed"]]["logloss"] == r["logloss"]
                        for r in arm_rows):
      return False
    return None

  def fp8(name: str) -> bool:
    try:
      return registry.get(name).fp8
    except (KeyError, ValueError):  # a kernel this version does not know: judged, not waived
      return True
  return any(fp8(k) for kernels in named for k in kernels)


def _seed_seconds(mine: Mapping, theirs: Mapping, seeds) -> Optional[float]:
  """What one more paired seed costs: the median training time (`train_s`) of the arm's runs
  plus that of the reference's, over the paired seeds (None where a run lacks it)."""
  times = [[rs[s].get("train_s") for s in seeds] for rs in (mine, theirs)]
  if not seeds or any(t is None for ts in times for t in ts):
    return None
  return sum(statistics.median(ts) for ts in times)


def judge(rows: Sequence[Mapping], comparison, arm: str, reference: str) -> Optional[Dict]:
  """The paired verdict of `arm` against `reference` in `comparison` (None when no seed has
  a scored row of both: nothing pairs, e.g. a Mods set whose bf16+Mods ran at other seeds than
  the FP8 peers): `verdict_lib.paired_quality` plus `unpaired` ({seed: why}), `twin_seeds`
  (seeds whose LoKA row is bf16+Mods' run) and `fp8` (`fp8_plan`)."""
  mine, theirs = (rows_by_seed(rows, comparison, a) for a in (arm, reference))
  shared = set(mine) & set(theirs)
  if not shared:
    return None
  unpaired = {s: why for s in sorted(shared)
              if (why := unpaired_why(mine[s], theirs[s])) is not None}
  paired = shared - set(unpaired)
  fp8 = fp8_plan(rows, comparison, arm)
  out = verdict_lib.paired_quality({s: mine[s]["logloss"] for s in paired},
                                   {s: theirs[s]["logloss"] for s in paired},
                                   applicable=fp8 is not False)
  out.update(unpaired=unpaired, fp8=fp8, seed_s=_seed_seconds(mine, theirs, paired),
             twin_seeds=sorted(s for s in paired if mine[s].get("same_run_as")),
             arm=arm, reference=reference,
             peaks={a: [rs[s].get("peak_loss") for s in out["seeds"]]
                    for a, rs in ((arm, mine), (reference, theirs))})
  return out


def judge_all(rows: Sequence[Mapping]) -> List[Tuple[object, Dict]]:
  """(comparison, verdict) of every judged arm against each reference it shares a seed with,
  comparisons sorted, LoKA first. Two arms without Mods (naive FP8 against bf16, say) are
  judged in the default Mods set's comparison only: their rows carry no set, so another set's
  comparison holds the same rows and would repeat the verdict under its name."""
  from experiments.bench import quality as quality_lib
  out = []
  for c in quality_lib.comparisons(rows):
    for arm in ARMS:
      for reference in REFERENCES:
        if c.mods_set and not (quality_lib.trains_with_mods(arm)
                               or quality_lib.trains_with_mods(reference)):
          continue
        v = judge(rows, c, arm, reference)
        if v is not None:
          out.append((c, v))
  return out


def pairing_summary(rows: Sequence[Mapping]) -> str:
  """How the rows show their pairing: comparisons whose rows share one held-out set, rows
  that record the data-order and initial-weights fingerprints, seeds left unpaired."""
  from experiments.bench import quality as quality_lib
  comparisons = quality_lib.comparisons(rows)
  held = [r for r in rows if r.get("suite") == "quality" and r.get("logloss") is not None
          and any(c.holds(r) for c in comparisons)]
  one_eval = sum(len({r.get("eval_fingerprint") for r in held if c.holds(r)}) == 1
                 for c in comparisons)
  both = sum(all(r.get(f) for f in FINGERPRINTS[1:]) for r in held)
  unpaired = sum(len(v["unpaired"]) for _, v in judge_all(rows))
  return (f"Pairing, as the rows show it: in {one_eval} of {len(comparisons)} comparisons every "
          f"row was scored on one held-out set (`eval_fingerprint`); {both} of {len(held)} rows "
          "also record the data order (`train_fingerprint`: the batches at the first, second, "
          "middle and last steps) and the initial weights (`init_fingerprint`: every "
          "parameter but the biases and norm scales the Mods drop), and a seed whose "
          f"recorded fingerprints differ is left out of the pairs ({unpaired} seeds here). "
          "Rows without them rely on the code: a synthetic source's batch is a function of "
          "(task seed, seed, step) and a MovieLens source's order of its seed, and every "
          "arm draws its parameters from the seed's key by module path; "
          "`tests/experiments/test_quality_pairs.py` checks that bf16+Mods' and delayed "
          "FP8's three fingerprints equal bf16's at a seed and differ at another (DLRM "
          "`tiny`), and `tests/train/test_loop.py` that no kernel plan of any of the five "
          "models changes a parameter.")
