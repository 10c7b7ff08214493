"""A training subprocess that SIGKILLs itself at a chosen point (the crash-resume test's entry).

  python tests/crash_run.py WORKDIR --plan=PLAN.json --steps=8 --checkpoint_every=2 \
      [--kill=WHERE] [--dump=STATE.npz]

Trains the tiny DLRM on synthetic data with `--precision=loka` and the given plan, exactly as
`experiments.train` does (`experiment.build_run` + `train`), resuming from WORKDIR. `--kill`
picks where the process dies by SIGKILL, which no Python handler can intercept:
  step:N        after training step N completed (its metrics line is written; its
                checkpoint, if N is a checkpoint step, is not yet);
  checkpoint:N  inside the checkpoint write of step N, after orbax wrote every file into its
                temporary directory and before the rename that commits it;
  metrics:N     halfway through writing step N's metrics line (a torn last line);
  final         halfway through writing final.json's temporary file.
Prints `first step N` when its first training step N completes (where it resumed).
`--dump` writes the newest checkpoint's TrainState (params, optimizer state, fp8_meta, step,
rng) as flat arrays, for comparison with another run.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

import numpy as np

# Run as a script from any directory: the repository root holds the loka_jax package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def die() -> None:
  """SIGKILL: no finally blocks, no atexit, no flushing; what a crash or the OOM killer does."""
  sys.stdout.flush()
  sys.stderr.flush()
  os.kill(os.getpid(), signal.SIGKILL)


def kill_inside_checkpoint(step: int) -> None:
  """Patches the checkpoint commit (the rename of the temporary directory) to die before
  step `step`'s checkpoint is committed, once all of its files are written."""
  from loka_jax.train import checkpoint
  commit = checkpoint.commit

  def dying_commit(tmp, final):
    if os.path.basename(final) == str(step):
      die()
    commit(tmp, final)

  checkpoint.commit = dying_commit


def kill_inside_metrics_line(step: int) -> None:
  """Patches the metrics writer to write half of step `step`'s line, flush it and die."""
  import json
  from loka_jax.train import loop
  write = loop.MetricsWriter.write

  def torn_write(self, record):
    if record.get("step") == step:
      line = json.dumps(dict(record), sort_keys=True)
      self._file.write(line[:len(line) // 2])
      self._file.flush()
      die()
    write(self, record)

  loop.MetricsWriter.write = torn_write


def kill_inside_final_json() -> None:
  """Patches the atomic JSON writer to leave half of final.json's temporary file and die."""
  import json
  from loka_jax import jsonio
  write = jsonio.write_json_atomic

  def torn_write(path, data, **kwargs):
    if os.path.basename(path) == "final.json":
      text = json.dumps(data)
      with open(f"{path}.tmp", "w") as f:
        f.write(text[:len(text) // 2])
      die()
    write(path, data, **kwargs)

  jsonio.write_json_atomic = torn_write


def dump_state(workdir: str, model, source, config, path: str) -> None:
  """The newest checkpoint's TrainState as {'/'-joined path: array} in an .npz file."""
  import flax
  from loka_jax.train import restore_run
  restored = restore_run(workdir, model, source, config)
  if restored is None:
    raise SystemExit(f"{workdir} holds no checkpoint to dump")
  flat = flax.traverse_util.flatten_dict(restored[0].to_state_dict(), sep="/")
  np.savez(path, **{k: np.asarray(v) for k, v in flat.items()})


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("workdir")
  parser.add_argument("--plan", required=True, help="loka.plan/1 file for the tiny DLRM")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--checkpoint_every", type=int, default=2)
  parser.add_argument("--batch_size", type=int, default=32)
  parser.add_argument("--num_eval", type=int, default=64)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--kill", default=None, help="step:N | checkpoint:N | metrics:N | final")
  parser.add_argument("--dump", default=None, help="write the final TrainState to this .npz")
  args = parser.parse_args(argv)

  from loka_jax.train import TrainConfig, train
  from loka_jax.train import experiment

  kill_step = None
  where, _, at = (args.kill or "").partition(":")
  if where == "step":
    kill_step = int(at)
  elif where == "checkpoint":
    kill_inside_checkpoint(int(at))
  elif where == "metrics":
    kill_inside_metrics_line(int(at))
  elif where == "final":
    kill_inside_final_json()
  elif where:
    parser.error(f"--kill={args.kill!r}: use step:N, checkpoint:N, metrics:N or final")

  spec = experiment.RunSpec(model="dlrm", preset="tiny", data="synthetic", precision="loka",
                            plan=args.plan, seed=args.seed, num_eval=args.num_eval)
  config = TrainConfig(steps=args.steps, batch_size=args.batch_size, seed=args.seed,
                       log_every=1, checkpoint_every=args.checkpoint_every, progress=False)
  model, source, _ = experiment.build_run(spec)
  first = []

  def callback(done, state, metrics):
    del state, metrics
    if not first:  # where this process resumed: the parent checks it against the checkpoints
      first.append(done)
      print(f"first step {done}", flush=True)
    if done == kill_step:
      die()

  train(model, source, args.workdir, config, run_info=spec.run_info(), step_callback=callback)
  if args.dump:
    dump_state(args.workdir, model, source, config, args.dump)


if __name__ == "__main__":
  main()
