"""A scope's instructions read from compiled HLO text: parsing (tuple types, fusion bodies,
control flow), signatures, and the comparison of two programs, on a hand-written module and
on a real compiled step."""
import os
import re
import tempfile

from absl.testing import absltest

from cli_helpers import run_module
from experiments.bench import hlo_scope
from model_helpers import wukong_train_hlo


# A scheduled module: a scatter fusion in the model's backward, a conditional whose true
# branch holds the optimizer's add, and the fusion and region bodies they call.
MODULE = """HloModule jit_train_step, is_scheduled=true

%region_add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %add.1 = f32[] add(%a, %b)
}

%fused_scatter (p0: f32[3,8], p1: s32[16,1], p2: bf16[16,8]) -> f32[3,8] {
  %p0 = f32[3,8]{1,0} parameter(0)
  %p1 = s32[16,1]{1,0} parameter(1)
  %p2 = bf16[16,8]{1,0} parameter(2)
  %convert.1 = f32[16,8]{1,0} convert(%p2)
  ROOT %scatter.1 = f32[3,8]{1,0} scatter(%p0, %p1, %convert.1), update_window_dims={1}, \
inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, \
to_apply=%region_add
}

%branch_true (t: (f32[3,8], f32[3,8])) -> (f32[3,8]) {
  %t = (f32[3,8]{1,0}, f32[3,8]{1,0}) parameter(0)
  %g0 = f32[3,8]{1,0} get-tuple-element(%t), index=0
  %g1 = f32[3,8]{1,0} get-tuple-element(%t), index=1
  %add.2 = f32[3,8]{1,0} add(%g0, %g1), metadata={op_name="jit(train_step)/cond/branch_1_fun/add"}
  ROOT %tuple.2 = (f32[3,8]{1,0}) tuple(%add.2)
}

%branch_false (f: (f32[3,8], f32[3,8])) -> (f32[3,8]) {
  %f = (f32[3,8]{1,0}, f32[3,8]{1,0}) parameter(0)
  %g2 = f32[3,8]{1,0} get-tuple-element(%f), index=0
  ROOT %tuple.3 = (f32[3,8]{1,0}) tuple(%g2)
}

ENTRY %main (table: f32[3,8], ids: s32[16,1], grad: bf16[16,8], ok: pred[]) -> (f32[3,8]) {
  %table = f32[3,8]{1,0} parameter(0)
  %ids = s32[16,1]{1,0} parameter(1)
  %grad = bf16[16,8]{1,0} parameter(2), \
metadata={op_name="jit(train_step)/transpose(jvp(M))/top/dot_general"}
  %ok = pred[] parameter(3)
  %zeros = f32[3,8]{1,0} broadcast(f32[] constant(0)), dimensions={}, \
metadata={op_name="jit(train_step)/transpose(jvp(M))/emb/bags/broadcast_in_dim"}
  %input_scatter_fusion = f32[3,8]{1,0} fusion(%zeros, %ids, %grad), kind=kInput, \
calls=%fused_scatter, \
metadata={op_name="jit(train_step)/transpose(jvp(M))/emb/bags/jit(_take)/scatter-add"}
  %pair = (f32[3,8]{1,0}, f32[3,8]{1,0}) tuple(%table, %input_scatter_fusion)
  ROOT %cond.1 = (f32[3,8]{1,0}) conditional(%ok, %pair, %pair), \
true_computation=%branch_true, false_computation=%branch_false, \
metadata={op_name="jit(train_step)/cond"}
}
"""


class ParseTest(absltest.TestCase):

  def test_a_hand_written_module(self):
    computations = hlo_scope.parse(MODULE)
    self.assertEqual(list(computations), ["region_add", "fused_scatter", "branch_true",
                                          "branch_false", "main"])
    fusion = computations["main"][5]
    self.assertEqual((fusion.name, fusion.opcode, fusion.shape, fusion.operands, fusion.called),
                     ("input_scatter_fusion", "fusion", "f32[3,8]{1,0}",
                      ("zeros", "ids", "grad"), ("fused_scatter",)))
    self.assertEqual(computations["branch_true"][0].shape, "(f32[3,8]{1,0}, f32[3,8]{1,0})")
    # The fusion and reduction bodies do not run as a schedule; the branches do.
    self.assertEqual({i.computation for i in hlo_scope.scheduled(computations)},
                     {"branch_true", "branch_false", "main"})
    # The scope's instructions in schedule order, each with a signature naming the fused
    # operations and every operand's type and layout.
    found = hlo_scope.in_scope(MODULE, "M/emb (bwd)")
    self.assertEqual([(i["name"], i["position"]) for i in found],
                     [("zeros", 4), ("input_scatter_fusion", 5)])
    self.assertEqual(found[1]["signature"],
                     "fusion[convert,scatter] (f32[3,8]{1,0}, s32[16,1]{1,0}, bf16[16,8]{1,0}) "
                     "-> f32[3,8]{1,0}")
    self.assertEqual([i["name"] for i in hlo_scope.in_scope(MODULE, "(optimizer update)")],
                     ["add.2"])
    with self.assertRaisesRegex(ValueError, "unbalanced parentheses"):
      hlo_scope.parse("ENTRY %m () -> f32[] {\n  %x = f32[] add(%a, %b\n}\n")


class CompareTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.hlo = wukong_train_hlo()[0]

  def test_the_same_program_differs_in_nothing(self):
    found = hlo_scope.in_scope(self.hlo, "(optimizer update)")
    self.assertNotEmpty(found)
    got = hlo_scope.compare(found, found)
    self.assertEqual((got["same"], got["only_first"], got["only_second"]),
                     (len(found), [], []))

  def test_an_operand_in_another_layout_is_told_apart(self):
    # Give one operand of an in-scope instruction a transposed layout: that instruction's
    # signature moves to "only" on both sides, and every other one still matches.
    found = hlo_scope.in_scope(self.hlo, "(optimizer update)")
    computations = hlo_scope.parse(self.hlo)
    by_name = {i.name: i for instrs in computations.values() for i in instrs}
    target, operand = next((f, o) for f in found for o in by_name[f["name"]].operands
                           if re.search(r"\{1,0\}$", by_name[o].shape))
    line = re.compile(rf"^(\s*(?:ROOT\s+)?%{re.escape(operand)}\s*=\s*\S+)\{{1,0\}}", re.M)
    changed_text, n = line.subn(r"\1{0,1}", self.hlo)
    self.assertEqual(n, 1)
    changed = hlo_scope.in_scope(changed_text, "(optimizer update)")
    got = hlo_scope.compare(found, changed)
    moved = [f["signature"] for f in found if operand in by_name[f["name"]].operands]
    self.assertEqual(got["only_first"], sorted(moved))
    self.assertLen(got["only_second"], len(moved))
    self.assertTrue(all("{0,1}" in s for s in got["only_second"]))
    self.assertEqual(got["same"], len(found) - len(moved))
    self.assertIn(target["signature"], got["only_first"])
    text = hlo_scope.markdown("(optimizer update)", ["a", "b"], found, changed)
    self.assertIn(f"Only in a:\n- `{got['only_first'][0]}`", text)

  def test_the_command_reads_two_programs(self):
    tmp = tempfile.mkdtemp(prefix="loka_hlo_scope_")
    path = os.path.join(tmp, "module.txt")
    with open(path, "w") as f:
      f.write(MODULE)
    run = lambda *args: run_module("experiments.report", "hlo_scope", *args, timeout=120)
    done = run("--scope=M/emb (bwd)", "--names=x,y", path, path)
    self.assertEqual(done.returncode, 0, done.stderr)
    self.assertIn("x runs 2 instructions, y 2; 2 the same in both", done.stdout)
    refused = run("--scope=M/nowhere", path, path)
    self.assertNotEqual(refused.returncode, 0)
    self.assertIn("neither program has an instruction in scope 'M/nowhere'", refused.stderr)


if __name__ == "__main__":
  absltest.main()
