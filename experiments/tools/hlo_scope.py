r"""What one name scope of two compiled steps runs, and how it differs between them.

  python3 -m experiments.report hlo_scope --scope="DCNv2/embeddings (bwd)" \
      --names=bf16_mods,loka DIR/hlo/bf16_mods_train.txt DIR/hlo/loka_train.txt

Reads the compiled HLO `experiments.profile_step` writes (plain or .gz). For the scope a
profile's "outside the sites, by name scope" table names, it prints how many instructions
each program runs there, the signatures (opcode, fused operations, operand and result types
with layouts) only one of them runs, and each program's instructions in schedule order
(`experiments.bench.hlo_scope`). Runs on any machine.
"""
import gzip

from absl import app, flags

from experiments.bench import hlo_scope

SCOPE = flags.DEFINE_string("scope", None, "The name scope, as the profile's table spells "
                            "it, e.g. 'DCNv2/embeddings (bwd)'.", required=True)
NAMES = flags.DEFINE_list("names", ["first", "second"], "Labels of the two programs.")
LISTED = flags.DEFINE_integer("listed", 40, "Instructions listed per program.")


def _read(path: str) -> str:
  try:
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
      return f.read()
  except (OSError, EOFError, UnicodeDecodeError) as e:
    raise app.UsageError(f"{path}: not a readable HLO text ({e})") from e


def main(argv):
  if len(argv) != 3 or len(NAMES.value) != 2:
    raise app.UsageError("give two compiled HLO texts and two --names")
  try:
    found = [hlo_scope.in_scope(_read(p), SCOPE.value) for p in argv[1:]]
  except ValueError as e:
    raise app.UsageError(str(e)) from e
  if not any(found):
    raise app.UsageError(f"neither program has an instruction in scope {SCOPE.value!r}; "
                         "spell it as the profile's scope table does")
  print(hlo_scope.markdown(SCOPE.value, NAMES.value, *found, listed=LISTED.value))

