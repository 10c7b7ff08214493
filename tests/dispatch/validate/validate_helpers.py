"""Shared by the validation tests: test-only kernels (broken, flipped, slow), hand-made plans
and reports, a tiny Wukong+Mods trained in bf16 (one per process) and a seconds-long
probe -> select -> validate run."""
import dataclasses
import os
import tempfile
import time

import jax
import jax.numpy as jnp

import report_builders as hm
from cli_helpers import REPO
from loka_jax.dispatch import pipeline, validate
from loka_jax.plan.file import FALLBACK, SCHEMA, Plan, read_plan, save_plan
from loka_jax.kernels import Kernel, KernelChoice, registry, reference_einsum
from loka_jax.train import TrainConfig, experiment
from loka_jax.train.loop import train

BAD_SITE = "head/dense_0"
GOOD_SITE = "layer_0/fmb/mlp/dense_1"
OTHER_SITE = "layer_0/fmb/mlp/dense_0"
BATCH = 64
# The committed plans and probe reports the tests replay.
RESULTS = os.path.join(REPO, "docs", "results")
# A round's candidates measured through one switch board: a broken forward, a good one and a
# stateful one (delayed scaling, calibrated per subset).
SWITCHED_CANDIDATES = {BAD_SITE: "test_two_bit", GOOD_SITE: "xla_fp8_rowwise",
                       OTHER_SITE: "flax_fp8_delayed"}


@dataclasses.dataclass(frozen=True)
class TwoBitKernel(Kernel):
  """Test-only: both operands rounded to 3 levels {-amax, 0, amax} (2 bits), a kernel no
  budget should accept."""

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    def q(x):
      x = x.astype(jnp.float32)
      s = jnp.max(jnp.abs(x)) + 1e-12
      return jnp.round(x / s) * s
    return reference_einsum(spec, q(a), q(b)).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class FlippedKernel(Kernel):
  """Test-only: the exact product times -10 (a gradient pass that climbs the loss)."""

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    return (-10.0 * reference_einsum(spec, a, b)).astype(out_dtype)


@dataclasses.dataclass(frozen=True)
class SlowKernel(Kernel):
  """Test-only: the bf16 product after a host stall of `stall_s` (a kernel that loses in
  context)."""
  stall_s: float = 0.004

  def einsum(self, spec, a, b, *, pass_name, out_dtype):
    def stall(x):
      time.sleep(self.stall_s)
      return x
    out = reference_einsum(spec, a, b).astype(out_dtype)
    return jax.pure_callback(stall, jax.ShapeDtypeStruct(out.shape, out.dtype), out)


# A step of the tiny model takes 0.3-1.6 ms on an idle CPU and several times that, in bursts,
# on a host running the suite on every core; the 12 ms stall keeps a step that has it slower
# than one without it through such bursts.
TEST_KERNELS = (TwoBitKernel("test_two_bit", "xla", description="test: 2-bit operands"),
                FlippedKernel("test_flipped", "xla", description="test: -10x product"),
                SlowKernel("test_slow", "xla", description="test: 4 ms stall"),
                SlowKernel("test_stall", "xla", description="test: 12 ms stall", stall_s=0.012))


def register_test_kernels():
  """For a test module's setUpModule."""
  for kernel in TEST_KERNELS:
    registry.register(kernel, replace=True)


def unregister_test_kernels():
  """For a test module's tearDownModule: other modules in this process see only the real
  kernels."""
  for kernel in TEST_KERNELS:
    registry.unregister(kernel.name)


def plan_of(entries):
  """A loka.plan/1 plan: {site: kernel or {pass: kernel}}, every other site xla_bf16."""
  sites = {}
  for name, k in entries.items():
    per_pass = k if isinstance(k, dict) else {p: k for p in hm.PASSES}
    sites[name] = {p: {"kernel": per_pass.get(p, FALLBACK), "reason": "test"}
                   for p in hm.PASSES}
  return Plan({"schema": SCHEMA, "model": "wukong", "sites": sites, "rules": [],
               "default": {p: FALLBACK for p in hm.PASSES}})


def read_plan_roundtrip(plan):
  """The plan as a later call reads it: saved to a file (strict JSON) and read back."""
  path = os.path.join(tempfile.mkdtemp(prefix="loka_plan_roundtrip_"), "plan.json")
  save_plan(plan, path)
  return read_plan(path)


def kernels(plan, site):
  return {p: plan["sites"][site][p]["kernel"] for p in hm.PASSES}


def switched_candidates():
  """{site: KernelChoice} of SWITCHED_CANDIDATES."""
  return {s: KernelChoice.uniform(k) for s, k in SWITCHED_CANDIDATES.items()}


def deadline_hook(deadline: float, clock=time.time):
  """A caller's `should_stop` for a deadline (a `clock()` value): stop when the next piece
  of work would end after it."""
  return lambda ahead_s: clock() + ahead_s > deadline


_CONTEXT = {}


def small_pipeline():
  """(spec, probe_and_plan kwargs) of a seconds-long probe -> select -> validate run."""
  from loka_jax.probe import ProbeConfig, ProbeOptions
  from loka_jax.probe.eligibility import Criteria
  spec = experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=256)
  return spec, dict(
      train_config=TrainConfig(steps=6, batch_size=BATCH, progress=False, log_every=0),
      probe_config=ProbeConfig(cadence=3),
      probe_options=ProbeOptions(samples=2, kernels=("xla_bf16", "xla_fp8_rowwise"),
                                 sites=GOOD_SITE, bootstrap=20, plots=False),
      criteria=Criteria(min_speedup=None),
      validation=validate.ValidationConfig(shadow_steps=0))


def context() -> validate.ValidationContext:
  """A tiny Wukong+Mods trained 40 steps in bf16 (once per process)."""
  if not _CONTEXT:
    workdir = tempfile.mkdtemp(prefix="loka_validate_")
    spec = experiment.RunSpec(model="wukong", preset="tiny", mods=("all",), num_eval=512)
    config = TrainConfig(steps=40, batch_size=BATCH, log_every=0, progress=False)
    model, source, _ = experiment.build_run(spec)
    train(model, source, workdir, config, run_info=spec.run_info())
    _CONTEXT["ctx"] = pipeline.context_for_run(spec, workdir, config)
  return _CONTEXT["ctx"]


def ranking_report(sqnr):
  """A hand-made probe report for the tiny Wukong: {site: SQNR (dB) of its kernels}."""
  sites = {name: hm.site(hm.same_passes({"test_two_bit": hm.entry(sqnr=db),
                                         "xla_fp8_rowwise": hm.entry(sqnr=db)}))
           for name, db in sqnr.items()}
  return hm.report(sites, model="wukong")


def promotion_report():
  """The tiny Wukong's three sites as a hand-made report: FP8 kernels that are accurate but
  slower than bf16 alone (what selection never picks), and one that is inaccurate."""
  delayed = {"time_scope": "grad_lhs+grad_rhs", "base_us": 200.0}

  def kernels(delayed_grad_sqnr):
    return {
        "fwd": {"xla_fp8_tensorwise": hm.entry(sqnr=40.0, speedup=(0.80, 0.85, 0.90)),
                "xla_fp8_rowwise": hm.entry(sqnr=45.0, speedup=(0.60, 0.65, 0.70)),
                "test_two_bit": hm.entry(sqnr=3.0, speedup=(2.0, 2.1, 2.2)),
                "flax_fp8_delayed": hm.entry(sqnr=40.0, speedup=(0.95, 1.0, 1.05))},
        **{p: {"xla_fp8_tensorwise": hm.entry(sqnr=30.0, speedup=(0.70, 0.75, 0.80)),
               "xla_fp8_rowwise": hm.entry(sqnr=35.0, speedup=(0.50, 0.55, 0.60)),
               "test_two_bit": hm.entry(sqnr=3.0, speedup=(2.0, 2.1, 2.2)),
               "flax_fp8_delayed": hm.entry(sqnr=delayed_grad_sqnr, speedup=(0.90, 0.95, 1.0),
                                            **delayed)}
           for p in ("grad_lhs", "grad_rhs")}}

  return hm.report({GOOD_SITE: hm.site(kernels(30.0)), OTHER_SITE: hm.site(kernels(12.0)),
                    BAD_SITE: hm.site(kernels(30.0))}, model="wukong")


def paused_after_one_site(test, check, step, plan, config, only_site_of):
  """Runs `check` until its first site measurement is saved, then has its caller stop
  before the next (far from its deadline, but the next site would end after it); returns
  the plan of a second call that resumes from the saved one, the sites each call measured
  and the first call's site record. `only_site_of`: the module whose `only_site` the
  check's per-site measurements call (counted through it)."""
  from unittest import mock
  ctx = context()
  measured = {"first": [], "resumed": []}
  phase = ["first"]
  real = only_site_of.only_site

  def counting(site, choice):
    measured[phase[0]].append(site)
    return real(site, choice)
  saved = []
  progress = validate.Progress()

  def save(plan):
    saved.append(plan)
    if validate.validation_records(plan, validate.site_step(step)):
      progress.should_stop = deadline_hook(time.time() + 3600.0)   # far off, but ...
      progress.longest_s[validate.site_step(step)] = 7200.0  # ... the next site ends after it
  progress.save = save
  with mock.patch.object(only_site_of, "only_site", counting):
    with test.assertRaisesRegex(validate.ValidationPaused, "slowest such measurement"):
      check(plan, ctx, config, progress)
    partial = saved[-1]
    (site_record,) = validate.validation_records(partial, validate.site_step(step))
    test.assertEqual(measured["first"], [site_record["site"]])
    phase[0] = "resumed"
    out = check(partial, ctx, config, validate.Progress())
  return out, measured, site_record
