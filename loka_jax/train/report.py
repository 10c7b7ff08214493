"""Side-by-side report of training arms (same seed, data order and eval set): markdown + PNG."""
from __future__ import annotations

import json
import os
from typing import Dict, Mapping, Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from loka_jax.train.loop import read_metrics  # noqa: E402


def load_arm(workdir: str) -> Dict:
  with open(os.path.join(workdir, "final.json")) as f:
    final = json.load(f)
  return {"final": final, "metrics": read_metrics(os.path.join(workdir, "metrics.jsonl"))}


def comparison_table(arms: Mapping[str, Dict], baseline: str) -> str:
  """Held-out NE / AUC / log loss per arm, with the relative log-loss change vs `baseline`."""
  base = arms[baseline]["final"]
  lines = ["| arm | held-out NE | AUC | log loss | rel. log-loss change vs " + baseline + " |",
           "|---|---|---|---|---|"]
  for name, arm in arms.items():
    f = arm["final"]
    rel = (f["logloss"] - base["logloss"]) / base["logloss"] if f.get("logloss") else None
    lines.append(f"| {name} | {f['ne']:.4f} | {f['auc']:.4f} | {f['logloss']:.5f} | "
                 f"{'-' if name == baseline or rel is None else f'{100 * rel:+.3f}%'} |")
  return "\n".join(lines)


def plot_arms(arms: Mapping[str, Dict], path: str, oracle_ne: Optional[float] = None) -> str:
  """Training loss per arm (left) and held-out NE per arm (right)."""
  fig, (ax_loss, ax_ne) = plt.subplots(1, 2, figsize=(10, 3.8))
  for name, arm in arms.items():
    rows = [r for r in arm["metrics"] if r.get("loss") is not None]
    ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel("training log loss")
  ax_loss.legend()
  names = list(arms)
  ax_ne.bar(names, [arms[n]["final"]["ne"] for n in names], color="tab:blue")
  if oracle_ne is not None:
    ax_ne.axhline(oracle_ne, color="k", ls="--", lw=1, label=f"teacher NE {oracle_ne:.3f}")
    ax_ne.legend()
  ax_ne.set_ylabel("held-out NE (lower is better)")
  low = min(arms[n]["final"]["ne"] for n in names)
  ax_ne.set_ylim(min(low, oracle_ne or low) * 0.95, None)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path
