"""What one name scope of a compiled step runs, and how two programs' runs of it differ.

A step profile splits the time outside the GEMM sites by name scope (`profile.scope_of`) and
keeps each scope's largest kernels. When a scope is slower in one program (DCNv2 `large`'s
embedding backward: 3.0 ms in both FP8 programs against 1.84 ms in bf16+Mods), the next
question is whether the program runs other instructions there, the same ones with other
operand shapes or layouts, or the same ones in another order (DLRM `large`: identical
scatter-add fusions, scheduled apart, contending differently). This module reads the
compiled HLO text that `experiments.profile_step` writes and answers it.

It lists, in schedule order, every instruction of the scheduled computations (the entry and
the computations control flow calls, not fusion bodies) whose op_name falls in the scope.
For each one it gives a signature: opcode, the operations fused into it, and operand and
result types with layouts. It then compares two programs' multisets of signatures.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Dict, List, Mapping, Sequence, Tuple

from experiments.bench.profile import INSTRUCTION_LINE, REFERENCE, hlo_op_names, scope_of

_COMPUTATION = re.compile(r"^(ENTRY\s+)?%([\w.\-]+)\s*\(.*\)\s*->\s*.*\{\s*$")
_CALLED = re.compile(r"\b(calls|to_apply)=%([\w.\-]+)")
# Bookkeeping inside a fusion body, not an operation worth naming in a signature.
_PLUMBING = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}


@dataclasses.dataclass(frozen=True)
class Instruction:
  name: str
  computation: str
  position: int          # its index in its computation: the schedule order of a scheduled module
  opcode: str
  shape: str             # result type with layout, e.g. f32[3,256]{1,0}
  operands: Tuple[str, ...]
  called: Tuple[str, ...]  # the fusion bodies or regions it calls


def _balanced(text: str, start: int) -> int:
  """The index just past the parenthesis group opening at text[start]."""
  depth = 0
  for i in range(start, len(text)):
    depth += {"(": 1, ")": -1}.get(text[i], 0)
    if depth == 0:
      return i + 1
  raise ValueError(f"unbalanced parentheses in HLO text: {text[start:start + 80]!r}")


def _split_definition(rest: str) -> Tuple[str, str, str, str]:
  """(result type, opcode, operand text, attributes) of an instruction's right-hand side."""
  rest = rest.strip()
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  match = re.match(r"([\w\-]+)\(", rest)
  if not match:
    raise ValueError(f"cannot read an opcode in HLO text: {rest[:80]!r}")
  end = _balanced(rest, match.end() - 1)
  return shape, match.group(1), rest[match.end():end - 1], rest[end:]


def parse(hlo_text: str) -> Dict[str, List[Instruction]]:
  """{computation name: its instructions in order} of a compiled module's text."""
  computations: Dict[str, List[Instruction]] = {}
  current = None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      current = header.group(2)
      computations[current] = []
      continue
    if line.startswith("}"):
      current = None
      continue
    definition = INSTRUCTION_LINE.match(line) if current is not None else None
    if not definition:
      continue
    shape, opcode, operands, attributes = _split_definition(definition.group(2))
    computations[current].append(Instruction(
        name=definition.group(1), computation=current, position=len(computations[current]),
        opcode=opcode, shape=shape, operands=tuple(REFERENCE.findall(operands)),
        called=tuple(m.group(2) for m in _CALLED.finditer(attributes.split("metadata=")[0]))))
  return computations


def scheduled(computations: Mapping[str, Sequence[Instruction]]) -> List[Instruction]:
  """The instructions of the computations that run as a schedule: every computation no
  fusion or reduction calls as its body (the entry, a conditional's branches, loop bodies)."""
  bodies = {c for instrs in computations.values() for i in instrs for c in i.called}
  return [i for name, instrs in computations.items() if name not in bodies for i in instrs]


def signature(instruction: Instruction, computations: Mapping[str, Sequence[Instruction]],
              shapes: Mapping[str, str]) -> str:
  """`opcode[fused ops] (operand types) -> result type`: equal for the same work on the same
  data layout, whatever the instructions are named or numbered."""
  fused = sorted({i.opcode for c in instruction.called for i in computations.get(c, ())
                  if i.opcode not in _PLUMBING})
  ops = ", ".join(shapes.get(o, "?") for o in instruction.operands)
  return (f"{instruction.opcode}{'[' + ','.join(fused) + ']' if fused else ''} ({ops}) -> "
          f"{instruction.shape}")


def in_scope(hlo_text: str, scope: str) -> List[Dict]:
  """[{name, computation, position, signature}] of the scheduled instructions whose op_name
  (own, or inherited as `profile.hlo_op_names` does) falls in `scope` (`profile.scope_of`),
  in schedule order; parameters, constants, tuples and bitcasts run no kernel and are left
  out."""
  computations = parse(hlo_text)
  op_names = hlo_op_names(hlo_text)
  shapes = {i.name: i.shape for instrs in computations.values() for i in instrs}
  return [{"name": i.name, "computation": i.computation, "position": i.position,
           "signature": signature(i, computations, shapes)}
          for i in scheduled(computations)
          if i.opcode not in _PLUMBING and i.name in op_names
          and scope_of(op_names[i.name]) == scope]


def compare(first: Sequence[Mapping], second: Sequence[Mapping]) -> Dict:
  """Two programs' instructions of one scope (`in_scope`): the signatures both run (with
  multiplicity), those only one runs, and where in its schedule each runs them."""
  a = collections.Counter(i["signature"] for i in first)
  b = collections.Counter(i["signature"] for i in second)
  span = lambda instrs: ([min(i["position"] for i in instrs), max(i["position"] for i in instrs)]
                         if instrs else None)
  return {"count": [len(first), len(second)], "same": sum((a & b).values()),
          "only_first": sorted((a - b).elements()), "only_second": sorted((b - a).elements()),
          "positions": [span(first), span(second)]}


def markdown(scope: str, names: Sequence[str], first: Sequence[Mapping],
             second: Sequence[Mapping], listed: int = 40) -> str:
  """The comparison as text: counts, the signatures only one program runs, and each
  program's instructions of the scope in schedule order (the first `listed`)."""
  c = compare(first, second)
  lines = [f"## `{scope}`: {names[0]} runs {c['count'][0]} instructions, {names[1]} "
           f"{c['count'][1]}; {c['same']} the same in both (opcode, fused ops, operand and "
           f"result layouts)", ""]
  for label, only in ((names[0], c["only_first"]), (names[1], c["only_second"])):
    lines.append(f"Only in {label}:" + ("" if only else " none"))
    lines += [f"- `{s}`" for s in only]
  for label, instrs, span in zip(names, (first, second), c["positions"]):
    lines += ["", f"{label}, in schedule order"
              + (f" (positions {span[0]}-{span[1]}):" if span else ":"), "",
              "| position | computation | instruction | signature |", "|---|---|---|---|"]
    lines += [f"| {i['position']} | {i['computation']} | `{i['name']}` | `{i['signature']}` |"
              for i in instrs[:listed]]
    if len(instrs) > listed:
      lines.append(f"| ... | | {len(instrs) - listed} more | |")
  return "\n".join(lines)
