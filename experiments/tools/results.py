r"""docs/RESULTS.md, and the README's headline table, from the committed result rows that
docs/results/manifest.json lists.

  python3 -m experiments.report results            # writes docs/RESULTS.md and the README's table
  python3 -m experiments.report results --check    # exit 1 when either is stale
  python3 -m experiments.report results --plots    # also draws the paired quality plot

The manifest names one device kind; the row files, oldest first (a later row of the same
target, variant or arm, seed, device, recipe and Mods set replaces an earlier one); the
served-quality reports; the kernel row files; the headline subjects; the commit that added
each row file whose rows carry none; and, for every missed target, one line of why. The page
holds the headline, speed per subject against bf16, bf16+Mods and the peers with 95%
confidence intervals, quality, the kernels alone, every target met or missed, and why each
miss happened. It is generated, never edited by hand.
"""
import dataclasses
import json
import os
import sys
from typing import Dict, List, Tuple

from absl import app, flags

from experiments.tools import results_other_cards as other_cards
from experiments.tools import results_sections as sections
from experiments.tools import results_user_speed as user_speed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MANIFEST = flags.DEFINE_string("manifest", os.path.join(REPO, "docs", "results", "manifest.json"),
                               "The manifest of committed rows.")
OUT = flags.DEFINE_string("out", os.path.join(REPO, "docs", "RESULTS.md"), "The page written.")
README = flags.DEFINE_string("readme", os.path.join(REPO, "README.md"),
                             "The README whose headline table is rewritten ('' to leave it).")
CHECK = flags.DEFINE_bool("check", False, "Write nothing; exit 1 when --out or the README's "
                          "table differs from what the manifest makes.")
PLOTS = flags.DEFINE_bool("plots", False, "Also write the manifest's 'quality_plot' and the "
                          "other cards' paired quality plots (PNGs, not compared by --check: "
                          "matplotlib versions draw them differently).")

COMMAND = "python3 -m experiments.report results"
REQUIRED = ("device", "rows", "served_quality")


@dataclasses.dataclass(frozen=True)
class Manifest:
  device: str
  rows: List[str]            # absolute paths, oldest first
  served: List[str]
  kernels: List[str]
  headline: List[str]        # subjects
  row_commits: Dict[str, str]
  why: Dict[str, str]        # `sections.miss_key` -> one line
  quality_plot: str = ""     # absolute path of the paired quality plot ('' for none)
  user_speed: Tuple[str, ...] = ()  # absolute paths of time-to-plan and start-up rows
  # Quality rows measured on other cards or the CPU: (absolute path, commit, command) per
  # file, and the stem of their plots.
  quality_other_cards: Tuple[Tuple[str, str, str], ...] = ()
  quality_other_cards_plot: str = ""


def _other_cards_entries(path: str, entries) -> List[Tuple[str, str, str]]:
  """(file, commit, command) of each 'quality_other_cards' entry, an object with those three
  fields (the rows record neither commit nor command)."""
  out = []
  for i, entry in enumerate(entries):
    if not isinstance(entry, dict) or not all(isinstance(entry.get(k), str) and entry[k]
                                              for k in ("file", "commit", "command")):
      raise app.UsageError(f"{path}: quality_other_cards[{i}] needs 'file', 'commit' and "
                           "'command' (the row file, the commit and the command that made it)")
    out.append((entry["file"], entry["commit"], entry["command"]))
  return out


def load_manifest(path: str) -> Manifest:
  """The manifest at `path`; a missing or malformed manifest, or a file it names that does not
  exist, is a one-line UsageError."""
  try:
    with open(path) as f:
      data = json.load(f)
    missing_keys = [k for k in REQUIRED if k not in data]
  except (OSError, ValueError) as e:
    raise app.UsageError(f"{path}: cannot read the manifest ({e})") from e
  except TypeError as e:
    raise app.UsageError(f"{path}: not a JSON object") from e
  if missing_keys:
    raise app.UsageError(f"{path}: needs 'device', 'rows' and 'served_quality' (missing: "
                         f"{', '.join(missing_keys)})")
  folder = os.path.dirname(os.path.abspath(path))
  names = {k: list(data.get(k) or []) for k in ("rows", "served_quality", "kernels",
                                                  "user_speed")}
  others = _other_cards_entries(path, data.get("quality_other_cards") or [])
  names["quality_other_cards"] = [name for name, _, _ in others]
  missing = [n for k in names for n in names[k] if not os.path.exists(os.path.join(folder, n))]
  if missing:
    raise app.UsageError(f"{path}: names {len(missing)} missing file(s): "
                         + ", ".join(missing[:5]))
  full = {k: [os.path.join(folder, n) for n in v] for k, v in names.items()}
  return Manifest(device=data["device"], rows=full["rows"], served=full["served_quality"],
                  kernels=full["kernels"], headline=list(data.get("headline") or []),
                  row_commits=dict(data.get("row_commits") or {}),
                  why=dict(data.get("why") or {}),
                  quality_plot=(os.path.join(folder, data["quality_plot"])
                                if data.get("quality_plot") else ""),
                  user_speed=tuple(full["user_speed"]),
                  quality_other_cards=tuple((os.path.join(folder, name), commit, command)
                                            for name, commit, command in others),
                  quality_other_cards_plot=(
                      os.path.join(folder, data["quality_other_cards_plot"])
                      if data.get("quality_other_cards_plot") else ""))


def _evaluate(manifest: Manifest):
  from experiments.bench import collect, served_check, targets
  rows = collect.read_rows(manifest.rows, manifest.device)
  verdicts = targets.check_all(rows, served_check.load_reports(manifest.served))
  return rows, verdicts


def headline_table(manifest: Manifest, rows=None, verdicts=None) -> str:
  """The headline table of the page, which the README carries between its markers."""
  if rows is None:
    rows, verdicts = _evaluate(manifest)
  return sections.headline(rows, verdicts,
                           sections.row_sources(manifest.rows, manifest.device),
                           manifest.headline, manifest.row_commits)


def page(manifest_path: str) -> str:
  """The whole RESULTS.md text."""
  from experiments.bench import tables
  manifest = load_manifest(manifest_path)
  rows, verdicts = _evaluate(manifest)
  jax_versions = sorted({str(r["jax"]) for r in rows if r.get("jax")})
  dates = sorted({r["date"] for r in rows if r.get("date")} | {
      name.rsplit("_", 1)[-1].split(".")[0] for name in map(os.path.basename, manifest.rows)})
  dates = [d for d in dates if d[:2] == "20"]
  met = sum(v["met"] is True for v in verdicts)
  missed = sum(v["met"] is False for v in verdicts)
  unresolved, not_applicable = (sum(v.get("judged", False) and v.get("verdict") == word
                                    for v in verdicts) for word in ("unresolved",
                                                                    "not applicable"))
  header = [
      "<!-- Generated by `" + COMMAND + "` from docs/results/manifest.json; do not edit. -->",
      "",
      f"Every number below is a committed row under `docs/results/`, measured on one "
      f"{manifest.device} where its table names no other card",
      f"(jax {', '.join(jax_versions) or '-'}; rows dated {dates[0] if dates else '-'} to "
      f"{dates[-1] if dates else '-'}) by the protocol of `docs/BENCHMARKS.md`: variants",
      "interleaved in one process, the baseline from the same run, bootstrap 95% confidence",
      f"intervals. {met} targets met, {missed} missed, {unresolved} unresolved and "
      f"{not_applicable} not applicable (quality: the paired rule of \"Quality\"); \"Missed "
      "targets\" says why each was missed.",
      f"Row files, oldest first: {', '.join(os.path.basename(p) for p in manifest.rows)}.",
      "",
      "## Headline",
      "",
      headline_table(manifest, rows, verdicts),
      "",
  ]
  body = tables.report(rows, verdicts).replace("# Benchmark results", "# Results", 1)
  extra = []
  if manifest.quality_other_cards:
    extra += ["## Quality on other devices", "",
              other_cards.section(manifest.quality_other_cards, manifest.device,
                                  manifest.quality_other_cards_plot), ""]
  if manifest.kernels:
    extra += ["## Kernels alone", "", sections.kernels_table(manifest.kernels), ""]
  if manifest.user_speed:
    extra += ["## Speed where the user sees it", "", user_speed.section(manifest.user_speed),
              ""]
  extra += ["## Missed targets", "", sections.misses(verdicts, manifest.why), "", ""]
  body = body.replace("## Targets at a glance", "\n".join(extra) + "## Targets at a glance", 1)
  if manifest.quality_plot:
    name = os.path.basename(manifest.quality_plot)
    body = body.replace("### Arms by seed", f"![Paired quality: each seed's change and the 95% "
                        f"CI of their mean, +0.02% margin](results/{name})\n\n`{name}` "
                        f"(`{COMMAND} --plots`).\n\n### Arms by seed", 1)
  # Notes name the files they read: by their place in the repository, not on this machine.
  folder = os.path.dirname(os.path.abspath(manifest_path))
  body = body.replace(folder + os.sep, "docs/results/")
  lines = body.split("\n")
  return "\n".join(lines[:1] + [""] + header + lines[2:]).rstrip() + "\n"


def write_quality_plot(manifest: Manifest) -> str:
  """The paired quality plot of the manifest's rows, at its 'quality_plot'."""
  from experiments.bench import plots, targets
  if not manifest.quality_plot:
    raise app.UsageError("the manifest names no 'quality_plot'")
  rows, _ = _evaluate(manifest)
  path = plots.paired_quality_plot(targets.check_quality(rows), manifest.quality_plot)
  print(f"wrote {path}")
  return path


def _read(path: str):
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    return None


def main(argv):
  del argv
  try:
    text = page(MANIFEST.value)
    readme = _read(README.value) if README.value else None
    if README.value and readme is None:
      raise app.UsageError(f"{README.value}: cannot read the README")
    new_readme = (sections.readme_with_headline(
        readme, headline_table(load_manifest(MANIFEST.value))) if readme is not None else None)
  except sections.ManifestError as e:
    raise app.UsageError(f"{MANIFEST.value}: {e}") from e
  except user_speed.UserSpeedError as e:
    raise app.UsageError(str(e)) from e
  if CHECK.value:
    stale = [p for p, want in ((OUT.value, text), (README.value, new_readme))
             if want is not None and _read(p) != want]
    manifest = load_manifest(MANIFEST.value)
    plots = [manifest.quality_plot] if manifest.quality_plot else []
    if manifest.quality_other_cards_plot:
      plots += other_cards.missing_plots([p for p, _, _ in manifest.quality_other_cards],
                                         manifest.device,
                                         manifest.quality_other_cards_plot)
    stale += [f"{p} (missing: run `{COMMAND} --plots`)" for p in plots if not os.path.exists(p)]
    if stale:
      sys.exit(f"error: {', '.join(stale)} is not what {MANIFEST.value} makes; run `{COMMAND}`")
    print(f"{OUT.value} is up to date" + (f", and {README.value}'s headline" if new_readme
                                           else ""))
    return
  with open(OUT.value, "w") as f:
    f.write(text)
  if PLOTS.value:
    manifest = load_manifest(MANIFEST.value)
    write_quality_plot(manifest)
    if manifest.quality_other_cards_plot:
      for path in other_cards.write_plots([p for p, _, _ in manifest.quality_other_cards],
                                          manifest.device,
                                          manifest.quality_other_cards_plot):
        print(f"wrote {path}")
  if new_readme is not None:
    with open(README.value, "w") as f:
      f.write(new_readme)
  print(f"wrote {OUT.value} ({len(text)} bytes)"
        + (f" and the headline table of {README.value}" if new_readme is not None else ""))
