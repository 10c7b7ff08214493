"""The probe's timing caches (`loka.timing_cache`, one file a device kind): two timings of
the same kernel passes compared entry by entry, or several caches of one card merged so a
probe skips the shapes another model's probe timed. No GPU.

  python3 -m experiments.timing_cache compare FIRST.json SECOND.json [--out=ROWS.json]
  python3 -m experiments.timing_cache merge --out=MERGED.json OWN.json OTHER.json ...
  python3 -m experiments.timing_cache NAME --help     (its flags)

Each subcommand is a module under experiments/tools/ (`experiments/tools/subcommands.py`
runs it).
"""
from experiments.tools import subcommands

COMMANDS = {
    "compare": ("experiments.tools.compare_timing_caches",
                "two caches of the same kernel passes, measured apart, entry by entry"),
    "merge": ("experiments.tools.merge_timing_caches",
              "one card's caches merged into one, the target's own first"),
}


def main():
  subcommands.run("timing_cache", __doc__, COMMANDS)


if __name__ == "__main__":
  main()
