"""The measurements behind documented findings, each a small study of one question: how far
FP8 moves held-out loss site by site or in shadow training, how a served export scores, how
the probe's delayed-scaling warm-up and the timing loops behave, what the Pallas kernels
compile to. They train, probe, time or compile; each says what it needs (CPU, GPU, triton).

  python3 -m experiments.measure NAME [flags]
  python3 -m experiments.measure NAME --help     (its flags)

Each measurement is a module under experiments/tools/ (`experiments/tools/subcommands.py`
runs it); docs/FINDINGS.md and README.md give the commands behind committed results.
"""
from experiments.tools import subcommands

COMMANDS = {
    "held_out_sites": ("experiments.tools.held_out_sites",
                       "held-out log-loss change of FP8 forwards, all sites and each alone"),
    "shadow_arms": ("experiments.tools.shadow_arms",
                    "kernel patterns or plans shadow-trained from one state beside bf16+Mods"),
    "serving_quality": ("experiments.tools.serving_quality",
                        "held-out log loss of a benchmark target's exports, paired with "
                        "bf16+Mods"),
    "delayed_warmup": ("experiments.tools.delayed_warmup",
                       "the probe's delayed-scaling errors warmed on other samples vs itself"),
    "timing_check": ("experiments.tools.timing_check",
                     "the timing loops against the profiler's kernel times (GPU)"),
    "probe_overhead": ("experiments.tools.probe_overhead",
                       "the statistics pass against the training step, part by part"),
    "batch_making": ("experiments.tools.batch_making",
                     "milliseconds to make a training batch: the prefetch thread, workers"),
    "round_trip": ("experiments.tools.round_trip",
                   "a quantize-dequantize round trip in one program vs the cast (GPU)"),
    "kernel_resources": ("experiments.tools.kernel_resources",
                         "the Pallas FP8 GEMMs compiled for sm_90: registers, MMA (triton)"),
}


def main():
  subcommands.run("measure", __doc__, COMMANDS)


if __name__ == "__main__":
  main()
