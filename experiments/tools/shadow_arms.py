r"""Shadow-train hand-written kernel plans from one trained state, side by side with bf16.

  python3 -m experiments.measure shadow_arms --model=wukong --preset=small --mods=all --steps=50 \
      --batch_size=1024 --shadow_steps=150 --windows=2 --num_eval=16384 --workdir=DIR \
      --arm="grad_lhs_mlp=layer_\d+/fmb/mlp/dense_\d+:flax_fp8_delayed_grad_lhs" \
      --arm="fwd_mlp=layer_\d+/fmb/mlp/dense_\d+:flax_fp8_delayed_fwd"

Trains bf16 (with --mods) for --steps, or reuses a finished run in --workdir, then trains
each arm --shadow_steps more from that state in each data window, as validation's shadow
check does (`validate.shadow_run`), and reports each run's last-50-step training loss,
held-out log loss and AUC with its change from bf16+Mods' run in the same window, then each
run's loss curve (the mean of every 25 steps: when it left a plateau, if it did), also
plotted to WORKDIR/shadow_arms.png. An arm is
NAME=REGEX:KERNEL[,REGEX:KERNEL...]: each site takes the kernel (all passes) of the first
regex that fully matches its name, every other site xla_bf16; --plan_arm=NAME=PLAN.json
takes a plan file's kernels per site and pass (it must fit the model). It asks which kernel pattern
stalls training without a probe report or a plan file (Wukong `large`'s restored plan did
on an H200). Rows go to WORKDIR/shadow_arms.jsonl as
each run ends; a rerun skips the arm and window pairs it holds for the same recipe. With
--warmup_after_switch=N every run warms its learning rates up again over N steps after
leaving the trained state (validation's --validation_shadow_warmup_steps).
"""
import json
import math
import os
import re
import time

from absl import app, flags

from experiments import common_flags as common  # noqa: F401  (the common flags, defined once)

ARMS = flags.DEFINE_multi_string("arm", [], "NAME=REGEX:KERNEL[,REGEX:KERNEL...] (repeat).")
PLAN_ARMS = flags.DEFINE_multi_string(
    "plan_arm", [], "NAME=PLAN.json (repeat): a plan file's kernels, per site and pass, as an "
    "arm; it must fit the model (`dispatch.check_plan`).")
SHADOW_STEPS = flags.DEFINE_integer("shadow_steps", 200, "Steps each arm trains.")
WINDOWS = flags.DEFINE_integer("windows", 1, "Data windows (window w: the shadow_steps "
                               "batches from w x shadow_steps after the trained state).")
NUM_EVAL = flags.DEFINE_integer("num_eval", 65536, "Held-out examples.")
BATCH_SIZE = flags.DEFINE_integer("batch_size", 256, "Training batch size.")
EVAL_BATCH = flags.DEFINE_integer("eval_batch_size", 4096, "Held-out evaluation batch size.")
WARMUP_AFTER_SWITCH = flags.DEFINE_integer(
    "warmup_after_switch", 0, "Every run (bf16+Mods' too) warms both learning rates up "
    "again from 0 over N steps after leaving the trained state, as validation's "
    "--validation_shadow_warmup_steps does; 0: the trained run's rate on.", lower_bound=0)

BASELINE_ARM = "bf16_mods"


def parse_arm(text: str, sites, kernel_names):
  """(name, KernelPlan) of one --arm; a ValueError naming what is wrong."""
  from loka_jax.dispatch import validate
  from loka_jax.kernels import KernelChoice, KernelPlan
  name, sep, body = text.partition("=")
  if not sep or not name or not body:
    raise ValueError(f"--arm={text!r}: write NAME=REGEX:KERNEL[,REGEX:KERNEL...]")
  if name == BASELINE_ARM:
    raise ValueError(f"--arm={text!r}: {BASELINE_ARM} is the baseline every arm is read against")
  rules = []
  for part in body.split(","):
    pattern, sep, kernel = part.rpartition(":")
    if not sep or not pattern:
      raise ValueError(f"--arm={text!r}: {part!r} is not REGEX:KERNEL")
    if kernel not in kernel_names:
      raise ValueError(f"--arm={text!r}: unknown kernel {kernel!r}; registered: "
                       f"{sorted(kernel_names)}")
    if not any(re.fullmatch(pattern, s) for s in sites):
      raise ValueError(f"--arm={text!r}: {pattern!r} matches none of the model's sites")
    rules.append((pattern, KernelChoice.uniform(kernel)))
  return name, KernelPlan(rules=tuple(rules), default=validate.BASELINE.default)


def parse_plan_arm(text: str, model, batch):
  """(name, KernelPlan) of one --plan_arm; a ValueError naming what is wrong (a plan file
  that is unreadable or does not fit the model included)."""
  from loka_jax import dispatch
  name, sep, path = text.partition("=")
  if not sep or not name or not path:
    raise ValueError(f"--plan_arm={text!r}: write NAME=PLAN.json")
  if name == BASELINE_ARM:
    raise ValueError(f"--plan_arm={text!r}: {BASELINE_ARM} is the baseline every arm is read "
                     "against")
  plan = dispatch.read_plan(path)
  dispatch.check_plan(plan, model, batch=batch, where=path)
  return name, dispatch.to_kernel_plan(plan)


def main(argv):
  del argv
  from experiments.bench import plots
  from experiments.bench.results import ResultsFile
  from loka_jax.dispatch import pipeline, run_records, validate
  from loka_jax.kernels import registry
  from loka_jax.models.presets import site_products
  from loka_jax.train import experiment
  from loka_jax.train.loop import train

  if SHADOW_STEPS.value < 1 or WINDOWS.value < 1:
    raise SystemExit("--shadow_steps and --windows must be >= 1")
  workdir = common.WORKDIR.value or "shadow_arms_run"
  spec, config = common.reference_run(NUM_EVAL.value, BATCH_SIZE.value)
  model, source, _ = experiment.build_run(spec)
  example = source.train_batch(0, 8)
  sites = list(site_products(model, None, example))
  try:   # before any training
    arms = dict([(BASELINE_ARM, validate.BASELINE)]
                + [parse_arm(a, sites, registry.names()) for a in ARMS.value]
                + [parse_plan_arm(a, model, example) for a in PLAN_ARMS.value])
  except ValueError as e:   # PlanFileError and PlanMismatchError among them
    raise SystemExit(str(e)) from e
  if len(arms) != len(ARMS.value) + len(PLAN_ARMS.value) + 1:
    raise SystemExit("--arm/--plan_arm: two arms share a name")
  train(model, source, os.path.join(workdir, "run"), config, run_info=spec.run_info())
  ctx = pipeline.context_for_run(spec, os.path.join(workdir, "run"), config)

  recipe = {"spec": spec.run_info(), "from_step": config.steps, "batch_size": BATCH_SIZE.value,
            "shadow_steps": SHADOW_STEPS.value, "num_eval": NUM_EVAL.value,
            # only a re-warmed recipe names it, so rows from before the flag still match
            **({"warmup_after_switch": WARMUP_AFTER_SWITCH.value}
               if WARMUP_AFTER_SWITCH.value else {})}
  # A row is reused only for the same arm, window, rules and recipe.
  results = ResultsFile(os.path.join(workdir, "shadow_arms.jsonl"), ("arm", "window", "setup"))
  setup = {name: json.dumps({"recipe": recipe, **_choices(kplan)}, sort_keys=True)
           for name, kplan in arms.items()}
  window_of_loss = min(50, SHADOW_STEPS.value)
  rows = {}
  for window in range(WINDOWS.value):
    for name, kplan in arms.items():
      rows[name, window] = results.get((name, window, setup[name]))
      if rows[name, window] is not None:
        continue
      began = time.time()
      run = validate.shadow_run(ctx, kplan, SHADOW_STEPS.value, EVAL_BATCH.value,
                                window=window,
                                warmup_after_switch=WARMUP_AFTER_SWITCH.value)
      row = {"arm": name, "window": window, "setup": setup[name],
             **validate.run_summary(run, window_of_loss),
             "first_loss": _finite_or_none(float(run["losses"][0])),
             "seconds": round(time.time() - began, 1)}
      results.append(row)
      rows[name, window] = row
      print(f"[shadow_arms] window {window} {name}: train {row['window_loss']} held-out "
            f"{row['logloss']} AUC {row.get('auc')} ({row['seconds']} s)", flush=True)

  warming = (f" warming up over {WARMUP_AFTER_SWITCH.value}" if WARMUP_AFTER_SWITCH.value
             else "")
  print(f"\nFrom step {config.steps} of bf16 ({spec.model} {spec.preset}), "
        f"{SHADOW_STEPS.value} steps per run{warming}; changes against {BASELINE_ARM} in the "
        "same window:\n")
  print(f"| arm | window | train (last {window_of_loss}) | held-out log loss | AUC |")
  print("|---|---|---|---|---|")
  for window in range(WINDOWS.value):
    base = rows[BASELINE_ARM, window]
    for name in arms:
      print(f"| {name} | {window} | {_with_change(rows[name, window], base, 'window_loss')} | "
            f"{_with_change(rows[name, window], base, 'logloss')} | "
            f"{rows[name, window].get('auc', float('nan')):.4f} |")
  # When each run left a plateau, if it did: its last steps alone cannot say.
  curves = {key: row["loss_curve"] for key, row in rows.items() if "loss_curve" in row}
  if curves:
    print(f"\nTraining loss, mean of each {validate.CURVE_EVERY} steps:\n")
    print(run_records.curves_table(curves, "window"))
    path = plots.shadow_curves_plot(
        curves, validate.CURVE_EVERY, config.steps, os.path.join(workdir, "shadow_arms.png"),
        f"{spec.model} {spec.preset} from step {config.steps} of bf16"
        + (f",{warming}" if warming else ""))
    print(f"\n[shadow_arms] curves: {path}")


def _choices(kplan):
  """An arm's kernels as its rows record them: its rules (pattern and kernel), and a plan
  arm's per-site choices and default (absent for a rules-only arm, so rows from before plan
  arms still match)."""
  out = {"rules": [[pattern, choice.fwd] for pattern, choice in kplan.rules]}
  if kplan.sites:
    out.update(sites={name: choice.to_dict() for name, choice in kplan.sites},
               default=kplan.default.to_dict())
  return out


def _finite_or_none(x):
  return x if math.isfinite(x) else None   # JSON has no NaN


def _with_change(row, base, key):
  if row[key] is None:
    return "not finite"
  if base[key] is None:   # bf16+Mods itself diverged: nothing to read a change against
    return f"{row[key]:.5f}"
  return f"{row[key]:.5f} ({100 * (row[key] / base[key] - 1):+.2f}%)"

