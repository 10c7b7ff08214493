"""A two-tower rating model loka_jax did not build, and the measurement of the public API on it
(`python3 -m experiments.your_model`): plain `nn.Embed` / `nn.Dense` layers with a
mean-squared-error loss, trained in the user's own optax loop with `loka_jax.Probe` observing
it, then select -> validate -> wrap -> train, against the same model in bf16 from the same
initialization and data order.
"""
import datetime
import os
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import loka_jax
from loka_jax import timing
from loka_jax.plan.file import kernel_counts
from loka_jax.kernels import FP8_META, KernelPlan
from loka_jax.kernels.flax_delayed import merge_fp8_meta
from loka_jax.train.verdict import noninferiority

VOCAB, DIM, DENSE = 100_000, 256, 16


class Tower(nn.Module):
  width: int

  @nn.compact
  def __call__(self, ids, dense):
    x = jnp.concatenate([nn.Embed(VOCAB, DIM, name="embed")(ids), dense], -1)
    for i in range(2):
      x = nn.relu(nn.Dense(self.width, dtype=jnp.bfloat16, name=f"dense_{i}")(x))
    return nn.Dense(DIM, dtype=jnp.bfloat16, name="out")(x)


class TwoTower(nn.Module):
  width: int

  @nn.compact
  def __call__(self, batch):
    user = Tower(self.width, name="user")(batch["user"], batch["user_dense"])
    item = Tower(self.width, name="item")(batch["item"], batch["item_dense"])
    return jnp.sum(user.astype(jnp.float32) * item.astype(jnp.float32), -1) / DIM


def make_batches(count: int, size: int, seed: int):
  """Zipf-distributed ids and dense features; ratings from a hidden low-rank teacher."""
  rng = np.random.default_rng(seed)
  teacher = np.random.default_rng(0).standard_normal((2, VOCAB, 8)).astype(np.float32)
  out = []
  for _ in range(count):
    u, i = (np.minimum(rng.zipf(1.2, size), VOCAB) - 1 for _ in range(2))
    ud, idn = (rng.standard_normal((size, DENSE)).astype(np.float32) for _ in range(2))
    rating = np.sum(teacher[0, u] * teacher[1, i], -1) / 8 + 0.5 * ud[:, 0] * idn[:, 0]
    out.append({"user": u.astype(np.int32), "item": i.astype(np.int32), "user_dense": ud,
                "item_dense": idn, "rating": rating.astype(np.float32)})
  return out


def mse(pred, batch):
  return jnp.mean((pred - batch["rating"]) ** 2)


def train_step_fn(model, optimizer):
  """One step of the user's loop; delayed-scaling state (fp8_meta) takes its gradient's
  value (Flax's overwrite-with-gradient rule), parameters the optimizer's update."""
  def step(state, batch):
    variables, opt = state
    loss, grads = jax.value_and_grad(lambda v: mse(model.apply(v, batch), batch))(variables)
    updates, opt = optimizer.update(grads["params"], opt, variables["params"])
    new = {**variables, "params": optax.apply_updates(variables["params"], updates)}
    if FP8_META in variables:
      new[FP8_META] = merge_fp8_meta(grads[FP8_META])
    return (new, opt), loss
  return jax.jit(step, donate_argnums=0)


def train(model, variables, batches, probe=None, observe_every=25):
  optimizer = optax.adam(1e-3)
  step = train_step_fn(model, optimizer)
  state = (jax.tree.map(jnp.array, variables), optimizer.init(variables["params"]))
  for i, batch in enumerate(batches):
    if probe is not None and i % observe_every == 0 and i < len(batches) // 2:
      probe.observe(state[0], batch)
    state, _ = step(state, batch)
  return state, step


def measure(workdir: str, *, steps: int, batch_size: int, width: int, kernels, command: str):
  """Probes the bf16 run's first half, selects and validates a plan, trains the FP8 arm under
  it and times both arms' steps; writes the probe report and the plans to `workdir`. Returns
  (the `loka.your_model/1` row, the validated plan)."""
  os.makedirs(workdir, exist_ok=True)
  base = TwoTower(width)
  train_batches = make_batches(steps, batch_size, seed=1)
  held_out = make_batches(8, batch_size, seed=2)
  init = jax.jit(base.init)(jax.random.PRNGKey(0), train_batches[0])
  bf16 = loka_jax.wrap(base, KernelPlan.uniform("xla_bf16"))

  t0 = time.time()
  probe = loka_jax.Probe(base, mse, kernels=list(kernels), samples=16)
  bf16_state, bf16_step = train(bf16, init, train_batches, probe)
  t_observed = time.time()
  report = probe.report(os.path.join(workdir, "probe"))
  plan = loka_jax.select(report)
  time_to_plan = time.time() - t0
  loka_jax.save_plan(plan, os.path.join(workdir, "plan.json"))

  # The plan's held-out check on the probed model's variables, then training under the
  # validated plan from the same initialization and data order as the bf16 run.
  checked = loka_jax.validate(loka_jax.wrap(base, plan), plan, bf16_state[0], held_out[:4],
                              mse, report=report)
  loka_jax.save_plan(checked, os.path.join(workdir, "plan_validated.json"))
  plan = checked
  fp8 = loka_jax.wrap(base, plan)
  fp8_init = fp8.init_state(init, train_batches[0])
  fp8_state, fp8_step = train(fp8, fp8_init, train_batches)

  eval_loss = lambda m: jax.jit(lambda v, b: mse(m.apply(v, b), b))
  bf16_losses = [float(eval_loss(bf16)(bf16_state[0], b)) for b in held_out]
  fp8_losses = [float(eval_loss(fp8)(fp8_state[0], b)) for b in held_out]
  counts = kernel_counts(plan)
  if all(k == "xla_bf16" for per_pass in counts.values() for k in per_pass):
    verdict = {"verdict": "not applicable", "note": "the plan runs no FP8 product"}
  else:
    verdict = noninferiority(
        (np.asarray(fp8_losses) - bf16_losses) / np.asarray(bf16_losses), 2e-4)
  times = timing.summarize(timing.time_variants(
      {"bf16": (bf16_step, (bf16_state, train_batches[0])),
       "loka": (fp8_step, (fp8_state, train_batches[0]))},
      repeats=20), "bf16")
  row = {"schema": "loka.your_model/1", "device": jax.devices()[0].device_kind,
         "jax": jax.__version__, "date": datetime.date.today().isoformat(),
         "command": command, "batch_size": batch_size, "width": width, "steps": steps,
         "sites": len(report["sites"]), "unrouted_products": report["unrouted_products"],
         "kernel_counts": counts, "observe_s": t_observed - t0, "time_to_plan_s": time_to_plan,
         "probe_overhead": report["overhead"], "train_step": times,
         "held_out_mse": {"bf16": float(np.mean(bf16_losses)), "loka": float(np.mean(fp8_losses))},
         "trained_verdict": verdict, "validation": checked["validation"][-1]}
  return row, checked
