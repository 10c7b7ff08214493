r"""The probe's statistics pass against the training step: rows for RESULTS.

  python3 -m experiments.measure probe_overhead --model=wukong --preset=large \
      --probe_config=weight_every=4,one_program=1 --out=overhead.json
  python3 -m experiments.report probe_overhead --measured=overhead.json \
      --commit=abc1234 --out=rows.jsonl

Each measurement (the JSON `experiments.measure probe_overhead --out` writes, which records
its card, jax, date and command line) becomes one `probe_overhead` row: the training step,
the pass and its extract stage, the first call's compile, and the probe settings that change
its cost (weight refits, one program, grouped sites, pass compile). RESULTS states each
row's share of training time at 25, 100 and 200 steps and the gap a 2% budget sets.
`experiments/gpu_probe_overhead_call.sh` measures and writes the rows.
"""

from absl import app, flags

from experiments.tools import overhead_rows
from loka_jax import jsonio

MEASURED = flags.DEFINE_list("measured", [], "JSON files experiments.measure probe_overhead "
                             "wrote (--out).")
COMMIT = flags.DEFINE_string("commit", "unknown", "The commit measured (recorded).")
COMMAND = flags.DEFINE_string("command", "", "The command that measured them (recorded; "
                              "empty: each measurement's own command line).")
DATE = flags.DEFINE_string("date", "", "The date measured (empty: each measurement's own).")
OUT = flags.DEFINE_string("out", None, "Append the rows here (JSONL).")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not MEASURED.value:
    raise app.UsageError("--measured is required (the JSON files experiments.measure "
                         "probe_overhead wrote)")
  try:
    rows = [overhead_rows.row(path, COMMIT.value, COMMAND.value or None, DATE.value or None)
            for path in MEASURED.value]
  except overhead_rows.OverheadRowError as e:
    raise app.UsageError(str(e)) from None
  for r in rows:
    grouped = ", sites grouped" if r["group_sites"] else ""
    print(f"{r['model']}/{r['preset']} on {r['device']}: step {r['step_ms']:.1f} ms, pass "
          f"{r['pass_ms']:.1f} ms (weight refit every {r['weight_every']}, "
          f"{'one program' if r['one_program'] else 'per site'}{grouped}, {r['pass_compile']}): "
          f"{100 * r['pass_ms'] / (r['cadence'] * r['step_ms']):.1f}% of training time every "
          f"{r['cadence']} steps")
  if OUT.value:
    jsonio.append_rows(OUT.value, rows)
    print(f"[probe_overhead] appended {len(rows)} row(s) to {OUT.value}")


if __name__ == "__main__":
  app.run(main)
