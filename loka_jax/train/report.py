"""Side-by-side report of training arms (same seed, data order and eval set): markdown + PNG."""
from __future__ import annotations

import json
import os
import textwrap
from typing import Any, Dict, Mapping, Optional

from loka_jax import figures
from loka_jax.train.loop import read_metrics
from loka_jax.plan.file import as_plan, kernel_counts


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
  fig, (ax_loss, ax_ne) = figures.subplots(1, 2, figsize=(10, 3.8))
  for name, arm in arms.items():
    rows = [r for r in arm["metrics"] if r.get("loss") is not None]
    ax_loss.plot([r["step"] for r in rows], [r["loss"] for r in rows], label=name)
  ax_loss.set_xlabel("step")
  ax_loss.set_ylabel("training log loss")
  ax_loss.legend()
  names = list(arms)
  values = [arms[n]["final"]["ne"] for n in names]
  # Horizontal bars: arm names are long, and the NE values differ in the third decimal, so
  # each bar carries its value.
  positions = list(range(len(names)))[::-1]
  ax_ne.barh(positions, values, color="tab:blue")
  ax_ne.set_yticks(positions, [textwrap.fill(n, 22) for n in names], fontsize=8)
  for y, v in zip(positions, values):
    ax_ne.annotate(f"{v:.4f}", (v, y), xytext=(3, 0), textcoords="offset points",
                   va="center", fontsize=8)
  if oracle_ne is not None:
    ax_ne.axvline(oracle_ne, color="k", ls="--", lw=1, label=f"teacher NE {oracle_ne:.3f}")
    ax_ne.legend(fontsize=8, loc="lower right")
  ax_ne.set_xlabel("held-out NE (lower is better)")
  low, high = min(values + [oracle_ne or min(values)]), max(values)
  ax_ne.set_xlim(low - 0.02 * low, high + 0.02 * high)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path


# ----------------------------------------------------------------------------- plans

PASS_COLUMNS = (("fwd", "fwd"), ("grad_lhs", "dgrad"), ("grad_rhs", "wgrad"))


def plan_table(plan) -> str:
  """Markdown: one row per site, the kernel of each pass; '*' marks a validation back-off."""
  plan = as_plan(plan)
  lines = ["| site | fwd | dgrad | wgrad |", "|---|---|---|---|"]
  for name, entry in plan["sites"].items():
    cells = [entry[p]["kernel"] + (" *" if entry[p].get("backed_off_from") else "")
             for p, _ in PASS_COLUMNS]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
  if plan["default"] is not None:
    lines.append("| (other sites) | " + " | ".join(plan["default"][p] for p, _ in PASS_COLUMNS)
                 + " |")
  return "\n".join(lines)


# What the report calls each validation check (the records' `step`).
CHECK_NAMES = {"speed_promotion": "speed promotion", "quality_held_out": "held-out",
               "quality_shadow": "shadow training",
               "quality_from_init": "training from initialization", "speed": "speed"}


def validation_lines(plan) -> str:
  """Markdown bullets: each validation measurement and back-off of the plan, in order."""
  lines = (validation_line(r) for r in as_plan(plan)["validation"])
  return "\n".join(line for line in lines if line is not None)


def validation_line(r: Mapping[str, Any], measurements: bool = False) -> Optional[str]:
  """One validation record as a markdown bullet (None: a record the list leaves out). With
  `measurements`, also a round's single measurements (a site's value, a training run's
  losses), which a validation's progress log shows as they are taken."""
  step = r.get("step", "")
  if "to" in r and "site" in r:  # a back_off record (its step names the check)
    passes = ", ".join(r.get("passes", [])) or "-"
    return f"  - back-off {r['site']} [{passes}] -> {r['to']}: {r.get('reason')}"
  if "to" in r and "sites" in r:  # a promote record
    return f"  - promoted {len(r['sites'])} sites -> {r['to']}: {r.get('reason')}"
  if r.get("skipped"):
    return f"- {CHECK_NAMES.get(step, step)}: skipped ({r.get('reason', '')})"
  if r.get("reopened"):   # `validate.reopen_check`
    undone = ", ".join(x["site"] for x in r.get("restored", ())) or "none"
    return (f"- {step}: reopened after {r.get('rounds_before')} round(s), back-offs undone: "
            f"{undone} ({r.get('reason', '')})")
  if step == "speed_promotion":
    tried = "; ".join(
        f"{k} at {v['sites']} sites: train {v['train']['speedup']:.3f}x "
        f"[{v['train']['speedup_ci'][0]:.3f}, {v['train']['speedup_ci'][1]:.3f}], inference "
        f"{v['infer']['speedup']:.3f}x" for k, v in r["proposals"].items())
    return (f"- speed promotion ({r['device']}; vs the plan): {tried}: "
            + (f"promoted {r['promoted']}" if r["promoted"] else "none pays"))
  if step == "quality_held_out":
    se = r.get("rel_logloss_change_se")   # records before it was measured have none
    se_text = "" if se is None else f" +- {100 * se:.4f}% (one standard error)"
    return (f"- held-out (round {r['round']}): log loss {r['logloss']:.5f} vs bf16+Mods "
            f"{r['logloss_bf16']:.5f}, {100 * r['rel_logloss_change']:+.4f}%{se_text}; rule: "
            f"at most +{100 * r['budget']:g}% (a lower loss passes): "
            f"{'pass' if r['passed'] else 'FAIL'}")
  if step in ("quality_shadow", "quality_from_init"):
    detail = ("non-finite loss" if not r.get("finite") else
              f"train loss {100 * r['rel_train_loss']:+.3f}%, held-out "
              f"{100 * r['rel_logloss_change']:+.3f}%")
    if r.get("finite") and "rel_logloss_change_bf16_forward" in r:
      detail += (f" ({100 * r['rel_logloss_change_bf16_forward']:+.3f}% with bf16+Mods' "
                 "forwards)")
    if step == "quality_from_init" and r.get("finite"):
      detail += f"; worst step's loss {r['peak_loss']:.3g} vs {r['peak_loss_bf16']:.3g}"
    # From the checkpoint each seed is a data window (`ValidationConfig.shadow_windows`).
    unit = "data window" if step == "quality_shadow" else "seed"
    if r.get("per_seed"):
      # The mean can hide a seed: one arm's early spike moves it (on an H200, DCNv2 `large`'s
      # bf16+Mods arm spikes early at seed 1).
      detail += f"; held-out by {unit} " + ", ".join(
          f"{100 * p['rel_logloss_change']:+.3f}%" for p in r["per_seed"])
    what = "shadow training" if step == "quality_shadow" else "training from initialization"
    recipe = ([f"warm-up {r['warmup_steps']}"] if r.get("warmup_steps") else []) + (
        [f"warm-up {r['warmup_after_switch']} after the switch"]
        if r.get("warmup_after_switch") else []) + (
        [f"clip {r['clip_norm']:g}"] if r.get("clip_norm") else []) + (
        [f"mean of {len(r['seeds'])} {unit}s"] if len(r.get("seeds", ())) > 1 else [])
    if recipe:
      what += f" ({', '.join(recipe)})"
    bounds = f"rule: each change at most +{100 * r['bound']:g}%, a lower loss passes"
    if "held_out_quality" in r:   # `ValidationConfig.from_init_quality_bound`
      bounds += "; quality rule: " + held_out_gate_text(r["held_out_quality"])
    elif "held_out_bound" in r:
      # A gate record without the verdict: its mean change was judged against this bound,
      # max(max_rel_logloss, 2 x the bf16+Mods seeds' relative std).
      noise = r.get("held_out_noise")
      bounds += f", held-out bound {100 * r['held_out_bound']:.3f}%" + (
          "" if noise is None else
          f" (bf16+Mods seeds' relative std {100 * noise:.3f}%)")
    if "noise_floor" in r:   # `ValidationConfig.shadow_noise_floor`
      n = r["noise_floor"]
      bounds += (f"; noise floor by {unit}: held-out " + ", ".join(
          f"{100 * v:+.3f}%" for v in n["rel_logloss_change"])
          + f", bounds train {100 * n['train_bound']:.3f}%, held-out "
          f"{100 * n['held_out_bound']:.3f}%")
    return (f"- {what} {r['steps']} steps (round {r['round']}): {detail} "
            f"({bounds}): {'pass' if r['passed'] else 'FAIL'}")
  if step == "speed":
    rule = (f"; rule: each step's CI low end >= {r['min_speedup']:g}x bf16+Mods"
            if r.get("min_speedup") is not None else "")
    return (f"- speed (round {r['round']}, {r['device']}): train "
            f"{r['train']['speedup']:.3f}x [{r['train']['speedup_ci'][0]:.3f}, "
            f"{r['train']['speedup_ci'][1]:.3f}], inference {r['infer']['speedup']:.3f}x "
            f"[{r['infer']['speedup_ci'][0]:.3f}, {r['infer']['speedup_ci'][1]:.3f}]{rule}: "
            f"{'pass' if r['passed'] else 'FAIL'}")
  if step == "validated":
    return (f"- validated: FP8 sites {r['fp8_sites_before']} -> {r['fp8_sites_after']}"
            + (f" (backed off: {', '.join(r['backed_off'])})" if r["backed_off"] else "")
            + (f" (promoted: {', '.join(r['promoted'])})" if r.get("promoted") else ""))
  if step == "not_validated":
    return f"- not validated: {r.get('reason', '')}"
  if measurements and step.endswith("_site"):
    value = "non-finite" if r.get("value") is None else f"{r['value']:.4g}"
    return (f"  - {step[:-len('_site')]} round {r.get('round')}, site {r['site']}: "
            f"{value} ({r.get('seconds')} s)")
  if measurements and step == "speed_steps":   # `validate.speed._round_steps`
    steps = r["steps"]
    return (f"  - speed round {r.get('round')}, timed steps: train "
            f"{steps['train']['plan']['speedup']:.3f}x, inference "
            f"{steps['infer']['plan']['speedup']:.3f}x ({r.get('seconds')} s)")
  if measurements and step.endswith("_run"):
    losses = ("non-finite loss" if not r.get("finite") else
              f"train loss {r['window_loss']:.5f}, held-out log loss {r['logloss']:.5f}"
              + (f" ({r['logloss_bf16_forward']:.5f} with bf16+Mods' forwards)"
                 if "logloss_bf16_forward" in r else "")
              + (f", AUC {r['auc']:.4f}, calibration {r['calibration']:.4f}"
                 if "auc" in r else "")
              + f", worst step's loss {r['peak_loss']:.3g}")
    return (f"  - {step[:-len('_run')]} run, {r['arm']} seed {r['seed']}: {losses} "
            f"({r.get('seconds')} s)")
  return None


def held_out_gate_text(q: Mapping[str, Any]) -> str:
  """The check from initialization's held-out gate (a round's `held_out_quality`, the quality
  rule's verdict by seed) in words, e.g. "held-out change +0.310% [+0.120%, +0.500%] missed
  the +0.02% bound over 3 paired seeds"."""
  bound = f"+{100 * q['bound']:g}% bound"
  mean = "not finite" if q.get("mean") is None else f"{100 * q['mean']:+.3f}%"
  if q["verdict"] == "not applicable":
    return f"held-out change {mean}: no FP8 site, the rule does not apply"
  if q.get("ci") is None:
    if q.get("n", 0) > 1:   # a seed's change is not finite
      return f"held-out change not finite at a seed: {q['verdict']} the {bound}"
    where = "within" if q["passed"] else "above"
    return (f"held-out change {mean} at one seed is {where} the {bound} (one seed "
            "measures no interval)")
  lo, hi = q["ci"]
  said = f"held-out change {mean} [{100 * lo:+.3f}%, {100 * hi:+.3f}%]"
  seeds = f"over {q['n']} paired seeds"
  if q["verdict"] != "unresolved":
    return f"{said} {q['verdict']} the {bound} {seeds}"
  need = q.get("pairs_to_resolve")
  need = (f"{need} paired seeds would resolve it" if need else
          "no seed count resolves it, the mean sits on the bound")
  return f"{said} is unresolved against the {bound} {seeds} ({need}; unresolved passes)"


def plot_plan(plan, path: str) -> str:
  """The plan as a figure: the kernel of every site and pass (left), sites per kernel and
  pass (right)."""
  import numpy as np
  plan = as_plan(plan)
  names = list(plan["sites"])
  kernels = sorted({plan["sites"][n][p]["kernel"] for n in names for p, _ in PASS_COLUMNS})
  index = {k: i for i, k in enumerate(kernels)}
  grid = np.array([[index[plan["sites"][n][p]["kernel"]] for p, _ in PASS_COLUMNS]
                   for n in names]).reshape(len(names), len(PASS_COLUMNS))
  from matplotlib import colormaps
  from matplotlib.colors import ListedColormap
  cmap = ListedColormap([colormaps["tab10"](i % 10) for i in range(max(len(kernels), 1))])
  height = max(3.5, 0.28 * len(names) + 1.8)
  fig, (ax_grid, ax_bar) = figures.subplots(1, 2, figsize=(12, height),
                                            gridspec_kw={"width_ratios": [1.2, 1]})
  ax_grid.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(kernels) - 0.5, aspect="auto")
  ax_grid.set_xticks(range(len(PASS_COLUMNS)), [label for _, label in PASS_COLUMNS])
  ax_grid.set_yticks(range(len(names)), names, fontsize=7)
  for i, n in enumerate(names):
    for j, (p, _) in enumerate(PASS_COLUMNS):
      if plan["sites"][n][p].get("backed_off_from"):
        ax_grid.text(j, i, "backed off", ha="center", va="center", fontsize=6)
  # White lines between cells, and a legend naming each colour's kernel.
  ax_grid.set_xticks(np.arange(len(PASS_COLUMNS) + 1) - 0.5, minor=True)
  ax_grid.set_yticks(np.arange(len(names) + 1) - 0.5, minor=True)
  ax_grid.grid(which="minor", color="white", linewidth=1)
  ax_grid.tick_params(which="minor", length=0)
  from matplotlib.patches import Patch
  ax_grid.legend(handles=[Patch(color=cmap(index[k]), label=k) for k in kernels], fontsize=7,
                 loc="upper center", bbox_to_anchor=(0.5, -0.04 - 0.3 / height),
                 ncol=min(len(kernels), 3), frameon=False)
  ax_grid.set_title("kernel per site and pass")
  if kernels == ["xla_bf16"]:
    fig.suptitle("No FP8 kernel chosen: every site and pass stays in bf16 (xla_bf16)",
                 fontsize=10)
  counts = kernel_counts(plan)
  width = 0.8 / max(len(kernels), 1)
  for k in kernels:
    values = [counts[p].get(k, 0) for p, _ in PASS_COLUMNS]
    ax_bar.bar(np.arange(len(PASS_COLUMNS)) + index[k] * width, values, width, label=k,
               color=cmap(index[k]))
  ax_bar.set_xticks(np.arange(len(PASS_COLUMNS)) + 0.4 - width / 2,
                    [label for _, label in PASS_COLUMNS])
  ax_bar.set_ylabel("sites")
  ax_bar.set_title(f"sites per kernel ({len(names)} sites)")
  ax_bar.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  return path
