"""Toy training states and the damage the checkpoint tests do to their files."""
import glob
import os

import jax

import train_toys
from loka_jax.train import OptimConfig, compiled_steps, create_train_state, make_optimizer

OPTIM = OptimConfig()


def trained_state(seed, steps=3, model=None):
  """A toy TrainState after a few real steps (non-trivial optimizer state), and its model."""
  model = model or train_toys.ToyClickModel()
  source = train_toys.ToySource(seed=seed)
  train_step, _ = compiled_steps(model, OPTIM, "stop")
  state = create_train_state(model, make_optimizer(OPTIM), source.train_batch(0, 32), seed)
  for i in range(steps):
    state, _ = train_step(state, source.train_batch(i, 32))
  return jax.device_get(state), model


def template(model, seed=99):
  """A fresh state of `model`: the structure a restore reads into."""
  source = train_toys.ToySource()
  return create_train_state(model, make_optimizer(OPTIM), source.train_batch(0, 32), seed)


def data_files(directory, step):
  """The array data files of one checkpoint's state, largest first."""
  files = [p for p in glob.glob(os.path.join(directory, str(step), "state", "**", "*"),
                                recursive=True) if os.path.isfile(p) and "/d/" in p]
  assert files, f"no data files under {directory}/{step}"
  return sorted(files, key=os.path.getsize, reverse=True)


def flip_bit(path, fraction, bit=0):
  """Flips one bit of the byte at `fraction` of the file's length."""
  with open(path, "r+b") as f:
    size = os.path.getsize(path)
    offset = min(int(size * fraction), size - 1)
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ (1 << bit)]))
