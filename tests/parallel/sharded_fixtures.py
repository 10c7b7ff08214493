"""Tiny towers, meshes and single-device references shared by the tests/parallel modules
(`from sharded_fixtures import ...`); every fixture is built once per test session."""
import functools
import os
import re
import shlex

import jax
import jax.numpy as jnp
import numpy as np

from loka_jax import parallel
from loka_jax.data.make import make_source
from loka_jax.data.spec import FeatureSpec
from loka_jax.models import SiteConfig, build_model, get_config
from loka_jax.train import create_train_state, make_optimizer
from loka_jax.train.optim import OptimConfig

BATCH = 64          # 16 examples per device on 4 devices
OPTIM = OptimConfig()
# Vocabularies that divide by neither 2, 3 nor 4 (except 24: a table that needs no padding
# sits beside the padded ones); tables are capped at MAX_VOCAB rows, so three tables hash
# their ids modulo 995 rows.
ODD_VOCABS = (997, 583, 1000, 13, 305, 7, 999, 24)
MAX_VOCAB = 995


def host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


@functools.lru_cache(maxsize=None)
def mesh(spec: str):
  """A mesh over the first devices it needs (specs of fewer than 4 devices leave the rest)."""
  sizes = dict(parallel.parse_mesh_spec(spec))
  count = sizes["data"] * sizes["model"]
  return parallel.build_mesh(spec, devices=jax.devices()[:count])


@functools.lru_cache(maxsize=None)
def odd_dlrm():
  """(model, source) of a tiny fp32 DLRM whose tables have the ODD_VOCABS rows."""
  config = get_config("dlrm", "tiny")
  config.features.vocab_sizes = ODD_VOCABS
  config.max_vocab = MAX_VOCAB
  features = FeatureSpec.from_dict(dict(config.features))
  source = make_source("synthetic", features=features, seed=3, num_eval=128)
  return build_model(config, source.features, SiteConfig.for_precision("fp32")), source


@functools.lru_cache(maxsize=None)
def odd_state():
  """(batch, single-device initial state) of `odd_dlrm`."""
  model, source = odd_dlrm()
  batch = source.train_batch(0, BATCH)
  return batch, create_train_state(model, make_optimizer(OPTIM), batch, seed=1)


@functools.lru_cache(maxsize=None)
def odd_step(collectives: str):
  """(sharded state, sharded batch, jitted train step) of `odd_dlrm` on data:2,model:2 with
  `collectives` payloads, from `odd_state`: compiled once per mode in a test session, by
  whichever test lowers or calls it first. The step donates its state: pass it a `copy`."""
  model, _ = odd_dlrm()
  batch, state = odd_state()
  the_mesh = mesh("data:2,model:2")
  sharded = parallel.shard_state(state, the_mesh)
  sharded_batch = parallel.shard_batch(batch, the_mesh)
  step = parallel.make_train_step(model, make_optimizer(OPTIM), the_mesh, sharded, sharded_batch,
                                  parallel.ParallelConfig(collectives=collectives))
  return sharded, sharded_batch, step


def copy(tree):
  """A copy that owns its buffers (steps donate their state)."""
  return jax.tree.map(jnp.copy, tree)


# ----------------------------------------------------------------------------- docs/PARALLEL.md

DOC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "docs", "PARALLEL.md")


def doc_commands():
  """The shell blocks of docs/PARALLEL.md, each a list of commands; a command is
  (environment assignments {NAME: value}, python module, [arguments]). An `export` line's
  assignments apply to the commands after it in its block."""
  with open(DOC) as f:
    text = f.read()
  blocks = re.findall(r"```\n(.*?)```", text, flags=re.S)
  out = []
  for block in blocks:
    commands, exported = [], {}
    for line in re.sub(r"\\\n\s*", " ", block).splitlines():
      words = shlex.split(line.rstrip("&").strip())
      if not words:
        continue
      if words[0] == "export":
        exported.update(w.split("=", 1) for w in words[1:])
        continue
      env = dict(exported)
      while words and re.match(r"^[A-Z_]+=", words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
      if words[:2] == ["python3", "-m"]:
        commands.append((env, words[2], words[3:]))
    out.append(commands)
  return out


def with_args(args, **values):
  """`args` with `--NAME=...` replaced (or added) for each NAME=value (dots as '__')."""
  out = list(args)
  for name, value in values.items():
    flag = "--" + name.replace("__", ".")
    out = [a for a in out if not a.startswith(flag + "=")] + [f"{flag}={value}"]
  return out
