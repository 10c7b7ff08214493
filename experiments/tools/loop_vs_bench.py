r"""The training loop's speed beside the bench's step, per arm: rows for RESULTS.

  python3 -m experiments.report loop_vs_bench --bench=DIR/bench/bench.jsonl \
      --loops=DIR/loop_bf16_mods,DIR/loop_loka --out=loop_vs_bench.jsonl

The bench times a device-resident training step (`experiments.bench`, its row's
`train.median_us`); `experiments.train` runs the user's loop (batches made, moved, metrics
read). Per arm (bf16+Mods from the loop directory named loop_bf16_mods, LoKA from loop_loka)
this writes one `loop_vs_bench` row: the bench's step as steps/s, the loop's 25-step metrics
windows after the first and their median, the loop over the bench, and in LoKA's row its
speedup over bf16+Mods in both, and the batch workers that fed the loop (its setting, or
those it started and the step it did). `experiments/gpu_loop_bench_call.sh` runs both and
this.
"""
import datetime
import os

from absl import app, flags

from experiments.tools import loop_rows
from loka_jax import jsonio

BENCH = flags.DEFINE_string("bench", None, "The bench's rows (bench.jsonl).")
LOOPS = flags.DEFINE_list("loops", [], "experiments.train run directories, named "
                          "loop_<variant> (loop_bf16_mods, loop_loka); missing ones are left out.")
PLAN = flags.DEFINE_string("plan", "", "The LoKA arm's plan file (recorded in its row).")
COMMAND = flags.DEFINE_string("command", "", "The command that measured them (recorded).")
COMMIT = flags.DEFINE_string("commit", "unknown", "The commit measured (recorded).")
OUT = flags.DEFINE_string("out", None, "Append the rows here (JSONL).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not BENCH.value or not os.path.exists(BENCH.value):
    raise app.UsageError(f"--bench: {BENCH.value!r} does not exist (the bench's bench.jsonl)")
  try:
    made = loop_rows.rows(BENCH.value, LOOPS.value, PLAN.value, COMMAND.value, COMMIT.value,
                          datetime.date.today().isoformat())
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  for r in made:
    extra = (f"; LoKA over bf16+Mods {r['speedup_bench']:.3f}x in the bench, "
             f"{r['speedup_loop']:.3f}x in the loop" if "speedup_loop" in r else "")
    started = (f" from step {r['batch_workers_from_step']}"
               if r["batch_workers_from_step"] is not None else "")
    print(f"{r['model']}/{r['preset']} {r['arm']:9s} bench {r['bench_steps_per_s']:7.2f} "
          f"steps/s, loop {r['loop_steps_per_s']:7.2f} ({r['batch_workers']} batch workers"
          f"{started}; windows "
          f"{' '.join(f'{w:.2f}' for w in r['window_steps_per_s'])}): loop/bench "
          f"{r['loop_over_bench']:.3f}{extra}")
  if OUT.value and made:
    jsonio.append_rows(OUT.value, made)
    print(f"[loop_vs_bench] appended {len(made)} rows to {OUT.value}")


if __name__ == "__main__":
  app.run(main)
