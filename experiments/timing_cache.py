"""The probe's timing caches (`loka.timing_cache`, one file a device kind): two timings of
the same kernel passes compared entry by entry, several caches of one card merged so a
probe skips the shapes another model's probe timed, a card's cache committed into its
timing table so every probe on that card reads it, or what a fresh probe would time against
that table, replayed from a probe report. No GPU.

  python3 -m experiments.timing_cache compare FIRST.json SECOND.json [--out=ROWS.json]
  python3 -m experiments.timing_cache merge --out=MERGED.json OWN.json OTHER.json ...
  python3 -m experiments.timing_cache table CACHE.json
  python3 -m experiments.timing_cache needs PROBE_REPORT.json [--table=TABLE.json]
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
    "table": ("experiments.tools.timing_cache_table",
              "a GPU card's cache written into its committed timing table"),
    "needs": ("experiments.tools.timing_needs",
              "what a fresh probe would time against a card's table, from a report"),
}


def main():
  subcommands.run("timing_cache", __doc__, COMMANDS)


if __name__ == "__main__":
  main()
