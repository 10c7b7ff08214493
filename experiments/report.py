"""Read-only reports over committed or produced files: result rows, probe reports, plans,
a run's norms, compiled HLO. No GPU; nothing is measured again.

  python3 -m experiments.report NAME [flags] [files]
  python3 -m experiments.report NAME --help     (that report's flags)

Each report is a module under experiments/tools/ (`experiments/tools/subcommands.py` runs
it).
"""
from experiments.tools import subcommands

COMMANDS = {
    "rows": ("experiments.tools.rows",
             "the benchmark's tables, target verdicts and plots from result rows (JSONL)"),
    "results": ("experiments.tools.results",
                "docs/RESULTS.md from the rows docs/results/manifest.json lists (--check)"),
    "plan_headroom": ("experiments.tools.plan_headroom",
                      "the GEMM time a target's plans save, projected onto its step"),
    "validation": ("experiments.tools.validation",
                   "where a plan's (paused) validation stands, its records and training runs"),
    "spikes": ("experiments.tools.spikes",
               "which module a training-loss spike started in (a run with module norms)"),
    "kernel_usage": ("experiments.tools.kernel_usage",
                     "which kernels the selection picks over one card's probe reports"),
    "loop_vs_bench": ("experiments.tools.loop_vs_bench",
                      "the training loop's steps/s beside the bench's step, per arm (rows)"),
    "probe_overhead": ("experiments.tools.overhead_run",
                       "the statistics pass against the training step, per measurement (rows)"),
    "drift_run": ("experiments.tools.drift_run",
                  "what the drift valve's refreshes cost in one training run (a row)"),
    "time_to_plan": ("experiments.tools.time_to_plan",
                     "the main job's time to a plan, cold and warm, from its logs (a row)"),
    "paired_spread": ("experiments.tools.paired_spread",
                      "how far quality verdicts' paired changes spread, by recipe and Mods"),
    "hlo_scope": ("experiments.tools.hlo_scope",
                  "what one name scope of two compiled steps runs, and how they differ"),
}


def main():
  subcommands.run("report", __doc__, COMMANDS)


if __name__ == "__main__":
  main()
