"""The subcommands of the grouping mains under experiments/: one module per tool, each with
its absl flags and a `main(argv)`, run as `python3 -m experiments.GROUP NAME [flags]`.

- `experiments.report`: read-only reports over committed or produced files (no GPU).
- `experiments.timing_cache`: the probe's timing caches compared and merged (no GPU).
- `experiments.measure`: the measurements behind documented findings (training, probing or
  compiling; some need a GPU).

`subcommands.py` is the dispatcher the three share.
"""
