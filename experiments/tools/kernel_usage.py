r"""Which candidate kernels the selection picks, over many probe reports of one card.

  python3 -m experiments.report kernel_usage docs/results/probe_report_*_h200_*.json.gz

Per kernel: the (site, pass) entries that timed it, those where `dispatch.select` picks it
for training and for serving, those where it is the fastest timed, and its best median
speedup over bf16. Then the per-pass kernels nothing picked, and a `--probe_kernels` list
without them, for probing a new model on that card in less time (`loka_jax.dispatch.usage`).
Reports may be gzipped; they should come from one card, since timings are per card. With
--fill_from_table the passes a report left untimed take its card's committed table's timings,
as `experiments.dispatch --config.timing.fill_from_table=true` selects with them.
"""
import gzip
import json

from absl import app, flags

from loka_jax.dispatch import usage
from loka_jax.probe.report import ProbeReportError, validate_report

OUT = flags.DEFINE_string("out", None, "Also write the counts here (JSON).")
FILL = flags.DEFINE_bool(
    "fill_from_table", False, "Time the kernel passes a report left untimed from its card's "
    "committed timing table, as selection does with fill_from_table.")


def _load(path: str):
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt") as f:
      data = json.load(f)
    validate_report(data, path)
  except (OSError, EOFError, json.JSONDecodeError, UnicodeDecodeError, ProbeReportError) as e:
    raise app.UsageError(f"{path}: not a readable probe report ({e})") from e
  return data


def main(argv):
  paths = argv[1:]
  if not paths:
    raise app.UsageError("give one or more probe reports (.json or .json.gz)")
  reports = [_load(p) for p in paths]
  devices = sorted({r.get("device_kind") or r.get("device") or "?" for r in reports})
  counts = usage.kernel_usage(reports, fill_from_table=FILL.value)
  print(f"{len(reports)} reports ({', '.join(devices)}), "
        f"{sum(len(r['sites']) for r in reports)} sites"
        f"{', untimed passes filled from the card table' if FILL.value else ''}\n")
  print(usage.markdown(counts))
  print(f"\nper-pass kernels no selection picked: {', '.join(usage.droppable(counts)) or 'none'}")
  print(f"--probe_kernels={','.join(usage.kept_kernels(counts))}")
  if len(devices) > 1:
    print(f"note: the reports come from {len(devices)} devices; a kernel's speed is per card")
  if OUT.value:
    with open(OUT.value, "w") as f:
      json.dump({"reports": paths, "devices": devices, "fill_from_table": FILL.value,
                 "usage": counts,
                 "droppable": usage.droppable(counts),
                 "kept": usage.kept_kernels(counts)}, f, indent=1)

