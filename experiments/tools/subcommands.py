"""The dispatcher of a grouping main: `python3 -m experiments.GROUP NAME [flags] [args]`.

Only the named tool's module is imported, so its flags are the only ones defined (two tools
may define a flag of the same name, e.g. --out). `--help` before a name lists the group's
subcommands; after one it prints that tool's docstring and flags; both exit 0 (absl's own
help flags exit 1). A wrong flag prints one line, `error: ...`, and exits 1.
"""
from __future__ import annotations

import importlib
import sys
from typing import Mapping, Optional, Sequence, Tuple

from absl import app, flags

HELP = ("-h", "-?", "-help", "--help", "-helpshort", "--helpshort")


def run(group: str, doc: str, commands: Mapping[str, Tuple[str, str]],
        argv: Optional[Sequence[str]] = None):
  """Runs the subcommand `argv[1]` of `commands` ({name: (module, one line)}) with the rest
  of `argv` (default sys.argv)."""
  argv = list(sys.argv if argv is None else argv)
  prog = f"python3 -m experiments.{group}"
  if len(argv) < 2 or argv[1] in HELP:
    listing = "\n".join(f"  {name:<17} {line}" for name, (_, line) in commands.items())
    text = f"{doc.strip()}\n\nsubcommands:\n{listing}\n\n{prog} NAME --help: its flags."
    if len(argv) < 2:
      sys.exit(f"{text}\n\nerror: give a subcommand")
    print(text)
    sys.exit(0)
  name, rest = argv[1], argv[2:]
  if name not in commands:
    sys.exit(f"error: {prog}: no subcommand {name!r}; the subcommands are "
             f"{', '.join(commands)}")
  module = importlib.import_module(commands[name][0])
  flag_args = rest[:rest.index("--")] if "--" in rest else rest
  if any(a in HELP for a in flag_args):
    print(f"{prog} {name}: {module.__doc__.strip()}\n\nflags:\n{tool_flags_help()}")
    sys.exit(0)
  # absl prints __main__'s docstring with a UsageError's message: the tool's, not the group's.
  sys.modules["__main__"].__doc__ = f"{prog} {name}: {module.__doc__}"
  app.run(module.main, argv=[f"{prog} {name}", *rest], flags_parser=parse_flags)


def tool_flags_help() -> str:
  """The help of every flag the experiments' modules define (the tool's, and the common
  flags where it imports them); the library defines none."""
  by_module = flags.FLAGS.flags_by_module_dict()
  return "\n".join(flags.FLAGS.module_help(m) for m in sorted(by_module)
                   if m.startswith("experiments.")) or "  (none)"


def parse_flags(argv: Sequence[str]):
  """`app.run`'s flags parser: --helpfull and --helpxml exit 0; a wrong flag or value
  prints one line naming it and exits 1."""
  try:
    rest = flags.FLAGS(list(argv))
  except SystemExit as e:  # absl's help flags print their text and exit 1: no error here
    sys.exit(0 if e.code == 1 else e.code)
  except flags.Error as e:
    sys.exit(f"error: {e}")
  from experiments import run_config
  run_config.use_compilation_cache()  # the measurements train, probe and time
  return rest
