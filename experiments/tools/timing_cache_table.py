"""A card's probe timing cache written into that card's committed timing table
(`loka_jax/probe/timings/<device kind>.json`), so every later probe on the card reads the
shapes it timed instead of timing them again. No GPU.

  python3 -m experiments.timing_cache table WORKDIR/timing_cache/NVIDIA_H100_80GB_HBM3.json

A GPU call that times a model's shapes (`experiments.probe --config.timing.only=true`, or the
probe of the main job or the bench) brings its cache back; this commits it. The table is made
when the card has none. The cache's entries replace the table's of the same kernel and
problem (pass, spec, shapes, dtype); an older entry of a kernel the cache did not time there
stays, with its own run's baseline beside it, since a speedup divides two times of one run
(`timing_table.merge_entries`); entries that recorded an error are left out. A CPU's cache
is refused: CPU times are never committed.
"""
import os

from absl import app, flags

from loka_jax.probe import kernel_timing, timing_caches
from loka_jax.probe import timing_table as tables_lib

TABLE_DIR = flags.DEFINE_string("table_dir", tables_lib.TIMINGS_DIR,
                                "The folder of the committed timing tables.")


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("give one timing cache file (WORKDIR/timing_cache/<device kind>.json)")
  path = argv[1]
  try:
    cache = timing_caches.read_cache(path)
  except kernel_timing.TimingCacheError as e:
    raise app.UsageError(str(e)) from e
  if cache.device_kind == "cpu":
    raise app.UsageError(f"{path}: a CPU's timings; only a GPU card's are committed")
  entries = kernel_timing.table_entries(list(cache.entries.values()))
  if not entries:
    raise app.UsageError(f"{path}: no timing without an error in it; nothing to commit")
  table_path = tables_lib.table_path(cache.device_kind, TABLE_DIR.value)
  try:
    before = (len(tables_lib.load_table(table_path)["entries"])
              if os.path.exists(table_path) else 0)
    table = tables_lib.update_file(table_path, cache.device_kind, entries)
  except tables_lib.TimingTableError as e:
    raise app.UsageError(str(e)) from e
  print(f"{table_path}: {len(table['entries'])} entries ({before} before, {len(entries)} "
        f"from {path}; {cache.device_kind})")
