"""Merges probe timing caches of one device kind into one, so a model's probe does not time
again the shapes another model's probe timed.

  python3 -m experiments.timing_cache merge --out=WORK/tc/NVIDIA_H200.json FIRST.json MORE.json

Each product problem (spec, shapes, dtype) keeps every entry of the first file that timed it
(`timing_caches.merge_caches`): list the target's own cache first. Prints how many problems
each file gave.
"""
from absl import app, flags

from loka_jax.probe import kernel_timing, timing_caches

OUT = flags.DEFINE_string("out", None, "The merged cache file (may be one of the inputs).")
flags.mark_flag_as_required("out")


def _read(path: str) -> kernel_timing.TimingCache:
  try:
    return timing_caches.read_cache(path)
  except kernel_timing.TimingCacheError as e:
    raise app.UsageError(str(e)) from e


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give the timing cache files to merge, the target's own first")
  caches = [_read(p) for p in argv[1:]]
  kinds = {c.device_kind for c in caches}
  if len(kinds) != 1:
    raise app.UsageError(f"the caches are of different device kinds: {sorted(map(str, kinds))}; "
                         "timings of one card say nothing about another")
  entries, taken = timing_caches.merge_caches([c.entries for c in caches])
  try:
    out = kernel_timing.TimingCache(OUT.value, caches[0].device_kind)
  except kernel_timing.TimingCacheError as e:
    raise app.UsageError(f"--out: {e}") from e
  out.entries = entries
  out.save()
  for cache, n in zip(caches, taken):
    print(f"{cache.path}: {n} product problems")
  print(f"wrote {OUT.value}: {len(entries)} entries, {sum(taken)} product problems")

