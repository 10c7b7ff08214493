"""Checkpoint integrity: a flipped bit in an array or a changed layout never restores as a
different state, the newest earned checkpoint survives rotation, a full disk leaves the
previous checkpoints intact, and a non-finite step right after a resume names the checkpoint
it resumed from."""
import errno
import json
import os
import tempfile
from unittest import mock

import chex
import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from absl.testing import absltest, parameterized

import train_toys
from checkpoint_helpers import data_files, flip_bit, template, trained_state
from loka_jax.train import (Checkpointer, CheckpointError, NonFiniteError, OptimConfig,
                            TrainConfig, train)
from loka_jax.train import checkpoint as checkpoint_lib

# A failed orbax restore leaves a reader thread that later calls back into its closed event
# loop; harmless, and reported during whichever test runs at that moment.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def same_tree(a, b) -> bool:
  la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
  return len(la) == len(lb) and all(
      np.asarray(x).dtype == np.asarray(y).dtype and
      np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True) for x, y in zip(la, lb))


class IntegrityTest(parameterized.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.state_a, cls.model = trained_state(seed=1, steps=2)
    cls.state_b, _ = trained_state(seed=2, steps=4)

  def saved_pair(self):
    directory = tempfile.mkdtemp(prefix="loka_integrity_")
    with Checkpointer(directory) as ckpt:
      ckpt.save(self.state_a)
      ckpt.save(self.state_b)
    return directory

  @parameterized.parameters(0.1, 0.5, 0.95)
  def test_a_flipped_bit_restores_the_clean_state_or_falls_back(self, fraction):
    # One bit of the largest data file of the newest checkpoint: the restore either reads
    # exactly the state that was saved (the bit lay where no value does) or moves the
    # checkpoint aside and restores the previous one; never a third state.
    for bit in (0, 5):
      directory = self.saved_pair()
      flip_bit(data_files(directory, 4)[0], fraction, bit)
      restored, _ = Checkpointer(directory).restore(template(self.model))
      if same_tree(restored.to_state_dict(), self.state_b.to_state_dict()):
        self.assertEqual(Checkpointer(directory).steps(), [2, 4])
      else:
        chex.assert_trees_all_equal(restored, self.state_a)
        self.assertTrue(os.path.isdir(os.path.join(directory, "corrupt-4")))

  def test_a_changed_value_with_a_valid_encoding_fails_the_digest(self):
    # Rewrite one array of the newest checkpoint through orbax itself, so every file is well
    # formed and only the values differ: the digest in layout.json is what catches it.
    directory = self.saved_pair()
    step_dir = os.path.join(directory, "4")
    with open(os.path.join(step_dir, checkpoint_lib.LAYOUT_JSON)) as f:
      layout = json.load(f)
    path, part, key = layout["state"][0]
    part_dir = os.path.join(step_dir, "state", f"{int(part):04d}")
    with ocp.Checkpointer(ocp.StandardCheckpointHandler()) as io:
      tree = io.restore(part_dir)
      tree[key] = np.asarray(tree[key]).copy()
      tree[key].reshape(-1)[0] += 1
      io.save(part_dir, args=ocp.args.StandardSave(tree), force=True)
    with mock.patch("sys.stderr") as stderr:
      restored, _ = Checkpointer(directory).restore(template(self.model))
    chex.assert_trees_all_equal(restored, self.state_a)
    said = "".join(c.args[0] for c in stderr.write.call_args_list)
    self.assertIn(f"{directory}/4 is unreadable or damaged", said)
    self.assertIn(f"array {'/'.join(map(str, path))} fails its integrity check", said)

  def test_a_changed_layout_fails_its_own_digest(self):
    directory = self.saved_pair()
    layout_path = os.path.join(directory, "4", checkpoint_lib.LAYOUT_JSON)
    with open(layout_path) as f:
      layout = json.load(f)
    layout["extras_json"]["loop"] = {"skipped_steps": 7}   # parses, and says something else
    with open(layout_path, "w") as f:
      json.dump(layout, f)
    restored, _ = Checkpointer(directory).restore(template(self.model))
    chex.assert_trees_all_equal(restored, self.state_a)

  def test_a_full_disk_keeps_the_previous_checkpoints_and_says_so(self):
    directory = tempfile.mkdtemp(prefix="loka_integrity_")
    with Checkpointer(directory) as ckpt:
      ckpt.save(self.state_a)
      full = OSError(errno.ENOSPC, "No space left on device")
      with mock.patch.object(ocp.Checkpointer, "save", side_effect=full):
        with self.assertRaisesRegex(CheckpointError,
                                    r"cannot write checkpoint .*/4 .*No space left on device.*"
                                    r"the previous checkpoints \(2\) are intact"):
          ckpt.save(self.state_b)
      self.assertEqual(ckpt.steps(), [2])
      self.assertEqual([n for n in os.listdir(directory) if checkpoint_lib.TMP_MARK in n], [])
      restored, _ = ckpt.restore(template(self.model))
    chex.assert_trees_all_equal(restored, self.state_a)


class EarnedRotationTest(absltest.TestCase):

  def test_the_newest_earned_checkpoint_outlives_newer_unearned_ones(self):
    base, model = trained_state(seed=1, steps=1)
    at = lambda step: base.replace(step=np.asarray(step, np.asarray(base.step).dtype))
    directory = tempfile.mkdtemp(prefix="loka_earned_")
    ckpt = Checkpointer(directory, keep=1)
    ckpt.save(at(2))
    ckpt.save(at(4), previous_earned=True)     # training from 2 reached 4 finitely
    self.assertEqual((ckpt.steps(), ckpt.earned_step()), ([2, 4], 2))
    ckpt.save(at(6), previous_earned=False)    # steps after 4 were skipped: 4 did not earn
    self.assertEqual((ckpt.steps(), ckpt.earned_step()), ([2, 6], 2))
    ckpt.save(at(8), previous_earned=False)
    self.assertEqual((ckpt.steps(), ckpt.earned_step()), ([2, 8], 2))
    ckpt.save(at(10), previous_earned=True)    # 8 earned: 2 may go now
    self.assertEqual((ckpt.steps(), ckpt.earned_step()), ([8, 10], 8))
    del model


class NonFiniteAfterResumeTest(absltest.TestCase):

  def test_names_the_checkpoint_it_resumed_from_as_the_likely_cause(self):
    model, source = train_toys.ToyClickModel(), train_toys.ToySource(seed=3)
    workdir = tempfile.mkdtemp(prefix="loka_resume_nan_")
    config = TrainConfig(steps=2, batch_size=32, log_every=1, checkpoint_every=2,
                         progress=False, optim=OptimConfig())
    train(model, source, workdir, config)
    # A checkpoint that passes every check yet holds a state that blows up at once: finite
    # parameters scaled far beyond anything training reaches.
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"))
    state, extras = ckpt.restore(template(model))
    blown = state.replace(step=state.step + 1,
                          params=jax.tree.map(lambda p: p * 1e30, state.params))
    ckpt.save(blown, extras)
    with self.assertRaises(NonFiniteError) as caught:
      train(model, source, workdir, TrainConfig(steps=6, batch_size=32, log_every=1,
                                                checkpoint_every=2, progress=False,
                                                optim=OptimConfig()))
    said = str(caught.exception)
    self.assertIn(f"1 step(s) after resuming from {workdir}/checkpoints/3", said)
    self.assertIn("That checkpoint is the likely cause", said)
    self.assertNotIn("nan_policy=skip", said)


if __name__ == "__main__":
  absltest.main()
