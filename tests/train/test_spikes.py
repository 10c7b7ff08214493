"""Per-module norms in the training loop, and reading a loss spike from them.

The loop's norms are checked against numpy on the run's own checkpoint and gradients, and
against the global gradient norm the loop computes on its own; the spike reading is checked
on metrics written by hand with a planted jump.
"""
import json
import os
import shutil
import tempfile

import chex
import jax
import numpy as np
from absl.testing import absltest

from cli_helpers import run_module
from loka_jax.train import (OptimConfig, TrainConfig, make_optimizer, read_metrics,
                            restore_run, train)
from loka_jax.train import module_norms as norms_lib
from loka_jax.train import spikes
from loka_jax.train.loop import loss_fn, step_rng

import train_toys


def numpy_norm(*arrays):
  return float(np.sqrt(sum(np.sum(np.square(np.asarray(a, np.float64))) for a in arrays)))


class ModuleNormsTest(chex.TestCase):

  def test_norms_group_leaves_by_their_module(self):
    rng = np.random.default_rng(4)
    tree = {"cross_0": {"kernel": rng.normal(size=(5, 3)), "bias": rng.normal(size=(3,))},
            "tower": {"dense_1": {"kernel": rng.normal(size=(3, 2))}},
            "scale": rng.normal(size=(2,))}
    got = jax.device_get(norms_lib.module_norms(tree))
    self.assertEqual(set(got), {"cross_0", "tower/dense_1", "scale"})
    np.testing.assert_allclose(got["cross_0"], numpy_norm(tree["cross_0"]["kernel"],
                                                          tree["cross_0"]["bias"]), rtol=1e-6)
    np.testing.assert_allclose(got["tower/dense_1"],
                               numpy_norm(tree["tower"]["dense_1"]["kernel"]), rtol=1e-6)
    np.testing.assert_allclose(got["scale"], numpy_norm(tree["scale"]), rtol=1e-6)


class LoopModuleNormsTest(chex.TestCase):
  """A toy run trained with `module_norms` and one without, to the same step."""

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.tmp = tempfile.TemporaryDirectory()
    cls.model, cls.source = train_toys.ToyClickModel(), train_toys.ToySource(seed=1)
    cls.config = TrainConfig(steps=6, batch_size=64, log_every=1, progress=False,
                             module_norms=True, optim=OptimConfig(learning_rate=0.05))
    cls.with_norms = os.path.join(cls.tmp.name, "with")
    cls.without = os.path.join(cls.tmp.name, "without")
    train(cls.model, cls.source, cls.with_norms, cls.config)
    train(cls.model, cls.source, cls.without,
          TrainConfig(**{**cls.config.__dict__, "module_norms": False}))
    # The same run stopped a step earlier: the state the sixth step started from.
    cls.five = os.path.join(cls.tmp.name, "five")
    train(cls.model, cls.source, cls.five, TrainConfig(**{**cls.config.__dict__, "steps": 5}))
    cls.lines = read_metrics(os.path.join(cls.with_norms, "metrics.jsonl"))

  @classmethod
  def tearDownClass(cls):
    cls.tmp.cleanup()
    super().tearDownClass()

  def test_every_line_has_every_module(self):
    state, _ = restore_run(self.with_norms, self.model, self.source, self.config)
    modules = set(norms_lib.module_norms(state.params))
    self.assertEqual(modules, {"embeddings", "hidden", "out"})
    self.assertLen(self.lines, 6)
    for line in self.lines:
      for kind in (norms_lib.GRAD, norms_lib.PARAM, norms_lib.UPDATE):
        self.assertEqual(set(line[kind]), modules, kind)
      self.assertEqual(set(line[norms_lib.OUTPUT]), modules | {norms_lib.ROOT})

  def test_output_rms_is_the_forward_of_the_step(self):
    # The toy model's forward in numpy, from the state the last step started from.
    before, _ = restore_run(self.five, self.model, self.source, self.config)
    p = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), before.params)
    batch = self.source.train_batch(5, self.config.batch_size)
    ids, mask = np.asarray(batch["sparse_ids"]), np.asarray(batch["sparse_mask"], np.float64)
    pooled = np.concatenate(
        [(p["embeddings"][f"table_{f}"][ids[:, f]] * mask[:, f, :, None]).sum(axis=1)
         for f in range(ids.shape[1])], axis=-1)
    x = np.concatenate([np.asarray(batch["dense"], np.float64), pooled], axis=-1)
    hidden = x @ p["hidden"]["kernel"] + p["hidden"]["bias"]
    out = np.maximum(hidden, 0) @ p["out"]["kernel"] + p["out"]["bias"]
    rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
    got = self.lines[-1][norms_lib.OUTPUT]
    for module, value in (("embeddings", pooled), ("hidden", hidden), ("out", out),
                          (norms_lib.ROOT, out[:, 0])):
      np.testing.assert_allclose(got[module], rms(value), rtol=1e-4, err_msg=module)

  def test_gradient_norms_add_up_to_the_global_norm(self):
    # The loop's grad_norm is optax's norm over the whole tree, computed apart.
    for line in self.lines:
      total = np.sqrt(sum(v ** 2 for v in line[norms_lib.GRAD].values()))
      np.testing.assert_allclose(total, line["grad_norm"], rtol=1e-5)

  def test_last_lines_norms_are_the_final_state_and_its_last_step(self):
    before, _ = restore_run(self.five, self.model, self.source, self.config)
    after, _ = restore_run(self.with_norms, self.model, self.source, self.config)
    self.assertEqual((int(before.step), int(after.step)), (5, 6))
    last = self.lines[-1]
    batch = self.source.train_batch(5, self.config.batch_size)
    grads = jax.grad(lambda p: loss_fn(self.model, p, before.fp8_meta, batch,
                                       step_rng(before, before.step))[0])(before.params)
    groups = {norms_lib.module_of(p) for p, _ in
              jax.tree_util.tree_flatten_with_path(after.params)[0]}
    self.assertGreater(len(groups), 1)
    for tree, kind in ((after.params, norms_lib.PARAM), (grads, norms_lib.GRAD)):
      leaves = {m: [] for m in groups}
      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        leaves[norms_lib.module_of(path)].append(leaf)
      for module, parts in leaves.items():
        np.testing.assert_allclose(last[kind][module], numpy_norm(*parts), rtol=1e-4,
                                   err_msg=f"{kind} {module}")
    moved = {m: [] for m in groups}
    for (path, new), old in zip(jax.tree_util.tree_flatten_with_path(after.params)[0],
                                jax.tree_util.tree_leaves(before.params)):
      moved[norms_lib.module_of(path)].append(np.asarray(new) - np.asarray(old))
    for module, parts in moved.items():
      self.assertGreater(numpy_norm(*parts), 0.0)
      np.testing.assert_allclose(last[norms_lib.UPDATE][module], numpy_norm(*parts),
                                 rtol=1e-4, err_msg=module)

  def test_the_norms_do_not_change_the_run(self):
    plain = read_metrics(os.path.join(self.without, "metrics.jsonl"))
    self.assertNotIn(norms_lib.GRAD, plain[0])
    np.testing.assert_allclose([r["loss"] for r in self.lines], [r["loss"] for r in plain],
                               rtol=1e-6)
    with open(os.path.join(self.with_norms, "final.json")) as a, \
         open(os.path.join(self.without, "final.json")) as b:
      self.assertAlmostEqual(json.load(a)["logloss"], json.load(b)["logloss"], places=6)

  def test_a_run_resumes_with_the_norms_turned_off(self):
    workdir = os.path.join(self.tmp.name, "resumed")
    train(self.model, self.source, workdir, TrainConfig(**{**self.config.__dict__, "steps": 3}))
    final = train(self.model, self.source, workdir,
                  TrainConfig(**{**self.config.__dict__, "module_norms": False}))
    self.assertEqual(final["steps"], 6)
    lines = read_metrics(os.path.join(workdir, "metrics.jsonl"))
    self.assertEqual([norms_lib.GRAD in r for r in lines], [True] * 3 + [False] * 3)

  def test_the_sharded_loop_refuses_them(self):
    from loka_jax.parallel import run as parallel_run
    with self.assertRaisesRegex(ValueError, "single-device loop"):
      parallel_run.train_sharded(self.model, self.source, self.tmp.name, self.config, mesh=None)


def write_metrics(path, loss, grads, updates=None, outputs=None, extra_lines=()):
  """A metrics.jsonl with one line per step (1-based) from per-step series."""
  outputs = {norms_lib.ROOT: [1.0] * len(loss)} if outputs is None else outputs
  with open(path, "w") as f:
    for i, value in enumerate(loss):
      record = {"step": i + 1, "loss": value, "max_loss": value, "grad_norm": 1.0,
                norms_lib.GRAD: {m: s[i] for m, s in grads.items()},
                norms_lib.PARAM: {m: 1.0 for m in grads},
                norms_lib.UPDATE: {m: (updates or grads)[m][i] for m in grads},
                **({norms_lib.OUTPUT: {m: s[i] for m, s in outputs.items()}} if outputs else {})}
      f.write(json.dumps(record) + "\n")
    for line in extra_lines:
      f.write(line + "\n")


class SpikeReadingTest(chex.TestCase):

  def setUp(self):
    super().setUp()
    self.tmp = tempfile.mkdtemp()
    self.addCleanup(shutil.rmtree, self.tmp, True)
    rng = np.random.default_rng(7)
    steps = 60
    self.loss = list(0.5 + 0.02 * rng.random(steps))
    self.grads = {m: list(0.1 * (1 + 0.2 * rng.random(steps))) for m in ("tower/a", "cross_0",
                                                                       "embeddings")}
    # From initialization the first steps' gradients move fast, either way; with fewer than
    # MIN_HISTORY steps before them they are not read as jumps.
    self.grads["tower/a"][:3] = [5.0, 3.0, 2.0]
    self.grads["embeddings"][:3] = [0.001, 0.002, 0.1]
    # cross_0 leaves its range at step 31, tower/a at 33, the loss at 34.
    self.grads["cross_0"][30:] = [3.0] * 30
    self.grads["tower/a"][32:] = [4.0] * 28
    self.loss[33:] = [5.0] * 27
    # The outputs of a parameter-free block grow 4x at step 29, before any gradient.
    self.outputs = {"cross_1": [1.0 + 0.1 * rng.random() for _ in range(steps)],
                    norms_lib.ROOT: [0.5] * steps}
    self.outputs["cross_1"][28:] = [4.0] * 32
    self.path = os.path.join(self.tmp, "metrics.jsonl")
    write_metrics(self.path, self.loss, self.grads, outputs=self.outputs)

  def test_first_jump_finds_the_planted_step(self):
    values = np.array(self.grads["cross_0"])
    step, value, baseline = spikes.first_jump(values, np.arange(1, 61), 10.0)
    self.assertEqual(step, 31)
    self.assertEqual(value, 3.0)
    self.assertAlmostEqual(baseline, float(np.median(values[10:30])))
    self.assertIsNone(spikes.first_jump(values[:30], np.arange(1, 31), 10.0))
    with self.assertRaisesRegex(ValueError, "factor"):
      spikes.first_jump(values, np.arange(1, 61), 1.0)

  def test_the_summary_orders_the_modules_and_measures_the_lead(self):
    summary = spikes.summarize(spikes.read_trace(self.tmp))
    self.assertEqual([j["series"] for j in summary["grad_jumps"]], ["cross_0", "tower/a"])
    self.assertEqual([j["step"] for j in summary["grad_jumps"]], [31, 33])
    self.assertEqual(summary["loss_jump"]["step"], 34)
    self.assertEqual(summary["first_module"], "cross_0")
    self.assertEqual(summary["lead_steps"], 3)
    self.assertEqual(summary["peak"], {"step": 34, "loss": 5.0})
    self.assertTrue(summary["every_step"])
    text = spikes.markdown(summary)
    self.assertIn("`cross_0` at step 31, 3 steps before the loss's", text)
    # tower/a jumps two steps later: not together with cross_0.
    self.assertEqual(summary["jumped_together"], ["cross_0"])
    self.assertNotIn("jumped within", text)
    self.assertIn("| tower/a | 33 |", text)
    self.assertNotIn("embeddings", text)
    self.assertEqual([(j["series"], j["step"]) for j in summary["output_jumps"]],
                     [("cross_1", 29)])
    self.assertIn("| cross_1 | 29 |", text)
    json.dumps(summary, allow_nan=False)

  def test_modules_that_jump_within_a_step_of_the_first_are_named_together(self):
    grads = {**self.grads, "tower/a": list(self.grads["tower/a"])}
    grads["tower/a"][31:] = [4.0] * 29   # now one step after cross_0
    write_metrics(self.path, self.loss, grads, outputs=self.outputs)
    summary = spikes.summarize(spikes.read_trace(self.path))
    self.assertEqual(summary["first_module"], "cross_0")
    self.assertEqual(summary["jumped_together"], ["cross_0", "tower/a"])
    self.assertIn("2 of 3 modules' gradients jumped within 1 step of it (`cross_0`, "
                  "`tower/a`), so its lead over them is slight.", spikes.markdown(summary))

  def test_a_run_without_a_spike_says_so(self):
    # (A log from before the outputs were recorded reads too.)
    write_metrics(self.path, [0.5] * 40, {"a": [0.1] * 40}, outputs={})
    summary = spikes.summarize(spikes.read_trace(self.path))
    text = spikes.markdown(summary)
    self.assertIn("no spike by this rule", text)
    self.assertIn("No module's gradient norm exceeds", text)
    self.assertEqual(summary["output_jumps"], [])
    spikes.spike_plot(spikes.read_trace(self.path), summary, os.path.join(self.tmp, "p.png"))

  def test_event_lines_and_a_cut_last_line_are_skipped(self):
    write_metrics(self.path, self.loss, self.grads, outputs=self.outputs,
                  extra_lines=[json.dumps({"step": 61, "error": "non-finite"}), '{"step": 6'])
    self.assertLen(spikes.read_trace(self.path).steps, 60)

  def test_bad_metrics_fail_by_name(self):
    with open(self.path, "w") as f:
      f.write(json.dumps({"step": 1, "loss": 0.5, "grad_norm": 0.1}) + "\n")
    with self.assertRaisesRegex(spikes.NormTraceError, "train.module_norms=True"):
      spikes.read_trace(self.path)
    with open(self.path, "w") as f:
      f.write('{"step": 1, "loss"\n' + json.dumps({"step": 2, "loss": 0.5}) + "\n")
    with self.assertRaisesRegex(spikes.NormTraceError, "line 1 is not JSON"):
      spikes.read_trace(self.path)
    with self.assertRaisesRegex(spikes.NormTraceError, "no metrics file"):
      spikes.read_trace(os.path.join(self.tmp, "missing"))

  def test_the_script_writes_the_report_and_plot(self):
    done = run_module("experiments.report", "spikes", f"--workdir={self.tmp}")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    out = done.stdout
    self.assertIn("First gradient jump: `cross_0` at step 31", out)
    for name in ("spike.json", "spike.md", "spike.png"):
      self.assertGreater(os.path.getsize(os.path.join(self.tmp, name)), 100, name)
    with open(os.path.join(self.tmp, "spike.json")) as f:
      self.assertEqual(json.load(f)["first_module"], "cross_0")
    failed = run_module("experiments.report", "spikes",
                        f"--workdir={os.path.join(self.tmp, 'none')}")
    self.assertNotEqual(failed.returncode, 0)
    self.assertIn("no metrics file", failed.stderr)


if __name__ == "__main__":
  absltest.main()
