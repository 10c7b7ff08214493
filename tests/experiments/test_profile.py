"""Step profiles: kernels attributed to GEMM sites and passes through the compiled HLO's op names
(on a real compiled Wukong step), device events read from a Perfetto trace, kernel classes."""
import gzip
import json
import os
import tempfile

import jax
from absl.testing import absltest

from cli_helpers import run_module
from experiments.bench import profile
from model_helpers import entry_arguments, wukong_train_hlo


def _write_trace(path, events):
  meta = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/device:GPU:0"}},
          {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/host:CPU"}}]
  with gzip.open(path, "wt") as f:
    json.dump({"traceEvents": meta + events}, f)


class AttributionTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    super().setUpClass()
    cls.hlo, cls.sites = wukong_train_hlo()
    cls.op_names = profile.hlo_op_names(cls.hlo)

  def test_every_site_has_forward_and_backward_instructions(self):
    seen = {}
    for op_name in self.op_names.values():
      site = profile.site_of(op_name, self.sites)
      if site is not None:
        seen.setdefault(site, set()).add(profile.pass_of(op_name))
    self.assertEqual(set(seen), set(self.sites))
    for site, passes in seen.items():
      self.assertEqual(passes, {"forward", "backward"}, site)

  def test_nested_site_names_resolve_to_the_longest(self):
    sites = ["layer_0/fmb/mlp", "layer_0/fmb/mlp/dense_0"]
    self.assertEqual(profile.site_of("jit(f)/layer_0/fmb/mlp/dense_0/dot_general", sites),
                     "layer_0/fmb/mlp/dense_0")
    self.assertIsNone(profile.site_of("jit(f)/layer_0/fmb/mlp_2/dot_general", sites[:1]))

  def _instruction_of(self, site, pass_name):
    """One HLO instruction of the compiled step attributed to `site` and `pass_name`."""
    return next(instr for instr, op_name in self.op_names.items()
                if profile.site_of(op_name, self.sites) == site
                and profile.pass_of(op_name) == pass_name)

  def _split(self, events, steps=1):
    """profile.split of a trace holding `events` on one GPU."""
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "perfetto_trace.json.gz")
      _write_trace(path, events)
      return profile.split(profile.device_events(path)[0], self.op_names, self.sites,
                           steps=steps)

  def test_split_of_a_trace(self):
    site = self.sites[0]
    fwd, bwd = self._instruction_of(site, "forward"), self._instruction_of(site, "backward")
    events = [
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_e4m3bf16_tn", "dur": 30.0,
         "args": {"hlo_op": fwd}},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_bf16bf16_nt", "dur": 50.0,
         "args": {"hlo_op": bwd}},
        {"ph": "X", "pid": 1, "name": "loop_multiply_fusion", "dur": 10.0,
         "args": {"hlo_op": "no_such_instruction"}},
        {"ph": "X", "pid": 1, "name": "loka_pallas_fp8_rowwise", "dur": 6.0, "args": {}},
        {"ph": "X", "pid": 2, "name": "host work, not a kernel", "dur": 999.0,
         "args": {"hlo_op": fwd}},
    ]
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "perfetto_trace.json.gz")
      _write_trace(path, events)
      got = profile.split(profile.device_events(path)[0], self.op_names, self.sites, steps=2)
    self.assertAlmostEqual(got["device_us_per_step"], 48.0)
    self.assertEqual(got["sites_us"], {site: {"forward": 15.0, "backward": 25.0}})
    self.assertAlmostEqual(got["outside_sites_us"], 8.0)
    self.assertEqual(got["classes_us"], {"gemm_cublas": 25.0, "gemm_fp8": 15.0, "fusion": 5.0,
                                         "pallas": 3.0})
    self.assertEqual(got["top_kernels_us"][0]["name"], "sm90_xmma_gemm_bf16bf16_nt")
    self.assertEqual((got["top_kernels_us"][0]["site"], got["top_kernels_us"][0]["hlo_op"]),
                     (site, bwd))
    table = profile.markdown({"bf16 train": got})
    self.assertIn(f"| {site} | 15 / 25 |", table)
    self.assertIn(f"| `sm90_xmma_gemm_bf16bf16_nt` | gemm_cublas | 25.0 | {site} |", table)
    self.assertIn("| `loop_multiply_fusion` | fusion | 5.0 | `no_such_instruction` (no site) |",
                  table)
    self.assertEqual(got["attribution"], {
        "kernel_events": 4, "with_hlo_op": 3, "hlo_op_in_module": 2, "with_tf_op": 0,
        "arg_keys": ["hlo_op"],
        "op_spans": 0, "unmatched_hlo_ops": ["no_such_instruction"],
        "module_instructions": sorted(self.op_names)[:5]})
    self.assertNotIn("no kernel mapped", table)
    # A trace whose kernels name no instruction of the module: the table says so and why.
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "perfetto_trace.json.gz")
      _write_trace(path, [{"ph": "X", "pid": 1, "name": "nvjet_sm90_qqtst_256x128", "dur": 8.0,
                           "args": {"correlation_id": 7}}])
      lost = profile.split(profile.device_events(path)[0], self.op_names, self.sites, steps=1)
    self.assertEqual(lost["classes_us"], {"gemm_fp8": 8.0})  # nvjet e4m3 x e4m3
    self.assertIn("no kernel mapped to a site: 0 of 1 kernel events named an HLO instruction, "
                  "0 mapped to one of the compiled module's (own arg or one of 0 op spans); "
                  "event args: correlation_id.", profile.markdown({"fp8 infer": lost}))

  def test_instructions_spelled_as_kernels_name_them(self):
    # XLA names an emitted kernel after its instruction with '_' for '.', and a trace may
    # spell its hlo_op arg that way (or with a '%'): both still find the instruction.
    site = self.sites[2]
    fwd, bwd = self._instruction_of(site, "forward"), self._instruction_of(site, "backward")
    spelled = lambda name: name.replace(".", "_").replace("-", "_")
    events = [{"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_bf16bf16_tn", "dur": 4.0,
               "args": {"hlo_op": "%" + spelled(fwd)}},
              {"ph": "X", "pid": 1, "name": spelled(bwd), "dur": 6.0, "args": {}},
              {"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_64x64", "dur": 1.0,
               "args": {"hlo_op": "gemm.999999"}}]
    got = self._split(events)
    self.assertEqual(got["sites_us"], {site: {"forward": 4.0, "backward": 6.0}})
    self.assertAlmostEqual(got["outside_sites_us"], 1.0)
    self.assertEqual(got["attribution"]["hlo_op_in_module"], 2)
    self.assertEqual(got["attribution"]["unmatched_hlo_ops"], ["gemm.999999"])

  def test_an_instruction_the_module_text_lacks_is_named_by_its_tf_op(self):
    # The profiler copies an instruction's op_name metadata into the event's tf_op arg: it
    # names the site (and the pass) even when the module's text has no such instruction.
    site = self.sites[3]
    fwd_name = self.op_names[self._instruction_of(site, "forward")]
    bwd_name = self.op_names[self._instruction_of(site, "backward")]
    events = [{"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_64x64", "dur": 3.0,
               "args": {"hlo_op": "fusion.123456", "tf_op": fwd_name}},
              {"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_64x64", "dur": 5.0,
               "args": {"hlo_op": "fusion.123457", "tf_op": bwd_name}},
              {"ph": "X", "pid": 1, "name": "loop_add_fusion", "dur": 2.0,
               "args": {"hlo_op": "fusion.123458", "tf_op": "jit(step)/optimizer/add"}}]
    got = self._split(events)
    self.assertEqual(got["sites_us"], {site: {"forward": 3.0, "backward": 5.0}})
    self.assertAlmostEqual(got["outside_sites_us"], 2.0)
    self.assertEqual((got["attribution"]["hlo_op_in_module"], got["attribution"]["with_tf_op"]),
                     (0, 3))

  def test_time_outside_the_sites_is_split_by_name_scope(self):
    # Kernels outside every site, named through their tf_op (the profiler's copy of the
    # op_name): each counts to its module path, its pass marked, the loss under one label,
    # the update the training step guards with a cond under another; a kernel naming
    # nothing has its own row; a site's kernel is not counted.
    site = self.sites[0]
    names = {"jit(train_step)/transpose(jvp(Wukong))/embedding/table_3/jit(_take)/scatter-add":
             3.0, "jit(train_step)/jvp(Wukong)/embedding/table_3/gather": 2.0,
             "jit(train_step)/cond/branch_1_fun/jit(tree_bias_correction)/mul": 4.0,
             "jit(train_step)/jvp()/log;jit(train_step)/jvp()/mul": 1.0}
    events = [{"ph": "X", "pid": 1, "name": f"loop_fusion_{i}", "dur": us,
               "args": {"hlo_op": f"fusion.{900000 + i}", "tf_op": op_name}}
              for i, (op_name, us) in enumerate(names.items())]
    events += [{"ph": "X", "pid": 1, "name": "input_reduce_fusion_77", "dur": 7.0, "args": {}},
               {"ph": "X", "pid": 1, "name": "nvjet_sm90_tst_64x64", "dur": 9.0,
                "args": {"hlo_op": self._instruction_of(site, "forward")}}]
    got = self._split(events)
    self.assertEqual(got["outside_by_scope_us"], {
        "Wukong/embedding (bwd)": 3.0, "Wukong/embedding": 2.0, "(optimizer update)": 4.0,
        "(outside the model)": 1.0, "(no op name)": 7.0})
    self.assertAlmostEqual(got["outside_sites_us"], 17.0)
    # Side by side: ranked by the largest value in any profile, absent scopes read 0.
    other = dict(got, outside_by_scope_us={"Wukong/embedding (bwd)": 8.0, "(optimizer update)":
                                           4.0})
    table = profile.markdown({"bf16 train": got, "loka train": other})
    self.assertIn("| scope | bf16 train | loka train |", table)
    rows = [line for line in table.splitlines() if line.startswith("| Wukong/embedding")]
    self.assertEqual(rows, ["| Wukong/embedding (bwd) | 3 | 8 |", "| Wukong/embedding | 2 | 0 |"])
    cut = profile._scope_table({"a": got}, ["a"], top=2)
    self.assertEqual(cut[-3:], ["| (no op name) | 7 |", "| (optimizer update) | 4 |",
                                "| 3 other scopes | 6 |"])
    # A profile written before this split (no outside_by_scope_us) gets no such table.
    old = {k: v for k, v in got.items() if k != "outside_by_scope_us"}
    self.assertNotIn("by name scope", profile.markdown({"bf16 train": old}))

  def test_a_scope_that_grew_shows_what_it_ran(self):
    # Two programs whose embedding backward differs: the scope's kernels per step and largest
    # kernels are kept per scope, and the table of differences names the scope that grew
    # (by at least 50 us) with what each program ran there; scopes that agree are left out.
    bwd = "jit(train_step)/transpose(jvp(DCNv2))/embeddings/bags/jit(_take)/scatter-add"
    loss = "jit(train_step)/jvp()/log"
    def events(scatter_us):
      out = [{"ph": "X", "pid": 1, "name": f"input_scatter_fusion_{i}", "dur": us,
              "args": {"hlo_op": f"scatter.{i}", "tf_op": bwd}}
             for i, us in enumerate(scatter_us)]
      return out + [{"ph": "X", "pid": 1, "name": "loop_log_fusion", "dur": 30.0,
                     "args": {"hlo_op": "fusion.7", "tf_op": loss}}]
    fast = self._split(events([70.0, 72.0, 66.0]), steps=2)
    slow = self._split(events([115.0, 124.0, 98.0]), steps=2)
    ran = slow["outside_scope_kernels"]["DCNv2/embeddings (bwd)"]
    self.assertAlmostEqual(ran["kernels_per_step"], 1.5)
    self.assertEqual([(k["name"], k["us"], k["hlo_op"]) for k in ran["top"]],
                     [("input_scatter_fusion_1", 62.0, "scatter.1"),
                      ("input_scatter_fusion_0", 57.5, "scatter.0"),
                      ("input_scatter_fusion_2", 49.0, "scatter.2")])
    many = self._split(events([1.0] * 8))["outside_scope_kernels"]["DCNv2/embeddings (bwd)"]
    self.assertEqual((many["kernels_per_step"], len(many["top"])), (8, 5))
    table = profile.markdown({"bf16_mods train": fast, "loka train": slow})
    self.assertIn("What ran in `DCNv2/embeddings (bwd)` (differs by 64 us / step):", table)
    self.assertIn("| loka train | 1.5 | 168 | `input_scatter_fusion_1` 62.0, "
                  "`input_scatter_fusion_0` 57.5, `input_scatter_fusion_2` 49.0 |", table)
    self.assertNotIn("What ran in `(outside the model)`", table)  # 15 us in both
    # One profile, or profiles from before this split, get no such table.
    self.assertNotIn("What ran in", profile.markdown({"loka train": slow}))
    old = {k: v for k, v in slow.items() if k != "outside_scope_kernels"}
    self.assertNotIn("What ran in", profile.markdown({"bf16_mods train": fast, "old": old}))

  def test_every_instruction_of_a_compiled_step_has_a_scope(self):
    # On the real compiled Wukong step: an instruction inside the model scopes under the
    # model's own name, its backward marked, and no scope keeps a jit/jvp frame.
    scopes = {profile.scope_of(op_name) for op_name in self.op_names.values()}
    self.assertIn("(optimizer update)", scopes)  # Adam, under the step's non-finite guard
    self.assertTrue(any(s.startswith("Wukong/") and s.endswith(" (bwd)") for s in scopes))
    self.assertTrue(any(s.startswith("Wukong/") and not s.endswith(")") for s in scopes))
    for s in scopes:
      self.assertNotRegex(s, r"jit\(|jvp\(|transpose\(|cond|branch_", s)

  def test_kernel_streams_only_and_op_spans_name_the_kernels(self):
    # A trace that names its device threads: kernels on the stream lines carry no hlo_op;
    # an op line (one span per HLO instruction) covers them in time. Only the kernels count
    # as device time; each takes its instruction from the innermost span around its start.
    site = self.sites[1]
    fwd, bwd = self._instruction_of(site, "forward"), self._instruction_of(site, "backward")
    outer = next(instr for instr, op_name in self.op_names.items()
                 if profile.site_of(op_name, self.sites) is None)
    threads = [{"ph": "M", "pid": 1, "tid": 7, "name": "thread_name",
                "args": {"name": "Stream #7(Kernel)"}},
               {"ph": "M", "pid": 1, "tid": 9, "name": "thread_name",
                "args": {"name": "XLA Ops"}}]
    events = threads + [
        {"ph": "X", "pid": 1, "tid": 9, "name": "jit_train_step", "ts": 0.0, "dur": 100.0},
        # An instruction outside every site enclosing the others (a loop, say): the
        # innermost span names the kernel.
        {"ph": "X", "pid": 1, "tid": 9, "name": outer, "ts": 5.0, "dur": 90.0},
        {"ph": "X", "pid": 1, "tid": 9, "name": fwd, "ts": 10.0, "dur": 20.0},
        {"ph": "X", "pid": 1, "tid": 9, "name": bwd, "ts": 50.0, "dur": 30.0},
        {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_sm90_tst_128x256", "ts": 12.0,
         "dur": 15.0, "args": {"correlation_id": 1}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "nvjet_sm90_qqtst_256x128", "ts": 55.0,
         "dur": 20.0, "args": {"correlation_id": 2}},
        {"ph": "X", "pid": 1, "tid": 7, "name": "loop_add_fusion", "ts": 85.0, "dur": 5.0,
         "args": {}},
    ]
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "perfetto_trace.json.gz")
      _write_trace(path, events)
      kernels, spans = profile.device_events(path)
    self.assertEqual([k["name"][:5] for k in kernels], ["nvjet", "nvjet", "loop_"])
    self.assertLen(spans, 4)
    got = profile.split(kernels, self.op_names, self.sites, steps=1, spans=spans)
    self.assertAlmostEqual(got["device_us_per_step"], 40.0)
    self.assertEqual(got["sites_us"], {site: {"forward": 15.0, "backward": 20.0}})
    self.assertAlmostEqual(got["outside_sites_us"], 5.0)
    self.assertEqual(got["attribution"]["hlo_op_in_module"], 3)  # the fusion: `outer`
    self.assertEqual(got["classes_us"], {"gemm_cublas": 15.0, "gemm_fp8": 20.0, "fusion": 5.0})

  def test_a_cpu_trace_has_no_device_kernels(self):
    with tempfile.TemporaryDirectory() as tmp:
      path = profile.profile_calls({"step": lambda: jax.numpy.ones(8).sum()}, tmp, 2)
      self.assertEqual(profile.device_events(path)[0], [])


# The shape of a compiled FP8 train step's text (an H200 step of the 8192x2048x8 tower, cut
# down): XLA's transposed copy of a quantized operand carries no op_name of its own.
FP8_HLO = """HloModule jit_train_step, is_scheduled=true

ENTRY %main.1 (x: bf16[64,32]) -> bf16[32,32] {
  %x = bf16[64,32]{1,0} parameter(0), metadata={op_name="x"}
  %loop_convert_fusion.8 = f8e4m3fn[64,32]{1,0} fusion(%x), kind=kLoop, calls=%fused.1, \
metadata={op_name="jit(train_step)/jvp(Tower)/mlp/dense_1/convert_element_type" \
scheduling_name="loop_convert_fusion.8"}
  %wrapped_transpose.14 = f8e4m3fn[32,64]{1,0} fusion(%loop_convert_fusion.8), kind=kInput, \
calls=%wrapped_transpose_computation.14, metadata={scheduling_name="wrapped_transpose.14"}
  %bitcast.405.0 = f8e4m3fn[32,64]{1,0} bitcast(%wrapped_transpose.14)
  %cublas-gemm.1 = (bf16[32,32]{1,0}, s8[1024]{0}) \
custom-call(%wrapped_transpose.14, %bitcast.405.0), \
custom_call_target="__cublas$lt$matmul$f8", \
metadata={op_name="jit(train_step)/transpose(jvp(Tower))/mlp/dense_1/dot_general"}
  %copy.7 = bf16[64,32]{0,1} copy(%x)
  ROOT %get-tuple-element.1 = bf16[32,32]{1,0} get-tuple-element(%cublas-gemm.1), index=0
}
"""


class InheritedOpNameTest(absltest.TestCase):
  """Instructions XLA makes without an op_name take their user's (else their operand's), so
  the FP8 GEMM's transposed operand copies count to the GEMM's site and pass."""

  def test_a_transposed_copy_belongs_to_the_gemm_that_reads_it(self):
    own = profile.hlo_op_names(FP8_HLO, inherit=False)
    self.assertNotIn("wrapped_transpose.14", own)
    names = profile.hlo_op_names(FP8_HLO)
    gemm = own["cublas-gemm.1"]
    self.assertEqual(names["wrapped_transpose.14"], gemm)  # its user, not its producer
    self.assertEqual(names["bitcast.405.0"], gemm)
    self.assertEqual(names["copy.7"], own["x"])  # no user: its operand's
    for name, op_name in own.items():  # an instruction's own op_name is never replaced
      self.assertEqual(names[name], op_name)
    events = [{"name": "wrapped_transpose_14", "dur_us": 10.0, "ts": 0.0, "pid": 1,
               "hlo_op": "wrapped_transpose.14"},
              {"name": "nvjet_sm90_qqtst_128x128", "dur_us": 30.0, "ts": 20.0, "pid": 1,
               "hlo_op": "cublas-gemm.1"}]
    got = profile.split(events, names, ["mlp/dense_1"], steps=1)
    self.assertEqual(got["sites_us"], {"mlp/dense_1": {"forward": 0.0, "backward": 40.0}})
    self.assertEqual(got["outside_sites_us"], 0.0)
    without = profile.split(events, own, ["mlp/dense_1"], steps=1)
    self.assertEqual(without["outside_sites_us"], 10.0)


class CliTest(absltest.TestCase):

  def test_profiles_and_writes_its_files(self):
    with tempfile.TemporaryDirectory() as tmp:
      run = run_module("experiments.profile_step", "--config.target.model=dlrm",
                       "--config.target.preset=tiny", "--config.variants.names=bf16,bf16_mods",
                       "--config.profile.iterations=1", "--config.variants.own_states=true",
                       f"--workdir={tmp}", timeout=600)
      self.assertEqual(run.returncode, 0, run.stderr[-3000:])
      self.assertIn("not on a GPU", run.stdout)
      with open(os.path.join(tmp, "profile.json")) as f:
        data = json.load(f)
      self.assertEqual(set(data["profiles"]), {"bf16 train", "bf16 infer", "bf16_mods train",
                                               "bf16_mods infer"})
      self.assertLen(data["sites"], 6)
      self.assertEqual((data["target"], data["mods_set"]), ("dlrm/tiny", None))
      self.assertEqual(data["variant_mods"], {"bf16": [], "bf16_mods": ["all"]})
      self.assertTrue(os.path.exists(os.path.join(tmp, "profile.md")))
      self.assertFalse(data["command_buffers"])
      hlo = {}
      for name in ("bf16", "bf16_mods"):
        with open(os.path.join(tmp, "hlo", f"{name}_train.txt")) as f:
          hlo[name] = f.read()
      self.assertIn("HloModule", hlo["bf16_mods"])
      # Each variant on its own model's state: bf16+Mods' step takes fewer arguments than
      # bf16's (no biases, nor their Adam moments); on bf16's shared state it takes as many.
      self.assertTrue(data["own_states"])
      self.assertLess(entry_arguments(hlo["bf16_mods"]), entry_arguments(hlo["bf16"]))
      # A CPU trace holds no device time: nothing to draw.
      self.assertFalse(os.path.exists(os.path.join(tmp, "profile.png")))

  def test_renders_a_saved_profile(self):
    # A profile.json from the GPU drawn again on any machine: its plot beside it, its tables
    # printed; a file that is not one is refused by name.
    step = {"steps": 5, "device_us_per_step": 100.0, "outside_sites_us": 40.0,
            "sites_us": {"mlp/dense_0": {"forward": 25.0, "backward": 35.0}},
            "outside_by_scope_us": {"M/embeddings (bwd)": 30.0, "(optimizer update)": 10.0},
            "classes_us": {"gemm_cublas": 60.0, "fusion": 40.0}, "top_kernels_us": []}
    with tempfile.TemporaryDirectory() as tmp:
      path = os.path.join(tmp, "saved.json")
      with open(path, "w") as f:
        json.dump({"target": "m/large", "device": "NVIDIA H200", "sites": ["mlp/dense_0"],
                   "profiles": {"bf16 train": step, "loka train": step}}, f)
      run = lambda flag: run_module("experiments.profile_step", flag, timeout=300)
      done = run(f"--config.render={path}")
      self.assertEqual(done.returncode, 0, done.stderr[-3000:])
      self.assertIn("| M/embeddings (bwd) | 30 | 30 |", done.stdout)
      with open(os.path.join(tmp, "saved.png"), "rb") as f:
        self.assertEqual(f.read(8), b"\x89PNG\r\n\x1a\n")
      refused = run(f"--config.render={os.path.join(tmp, 'missing.json')}")
      self.assertNotEqual(refused.returncode, 0)
      self.assertIn("missing.json: not a profile.json", refused.stderr)
      bad_mods = run("--config.variants.mods=no_bias,swish")
      self.assertNotEqual(bad_mods.returncode, 0)
      self.assertIn("--config.variants.mods: unknown Mod(s) ['swish']", bad_mods.stderr)


class StepPartsTest(absltest.TestCase):

  def test_parts_sum_to_each_step_and_share_their_labels(self):
    # Each step's time in parts that add up to it: the sites' two passes, the largest scopes
    # outside them by their largest value in any profile, the rest; a profile from before the
    # split by scope has all its outside time in the rest.
    def step(fwd, bwd, outside, scopes=None):
      out = {"device_us_per_step": fwd + bwd + outside, "outside_sites_us": outside,
             "sites_us": {"a": {"forward": fwd / 2, "backward": bwd / 2},
                          "b": {"forward": fwd / 2, "backward": bwd / 2}}}
      if scopes is not None:
        out["outside_by_scope_us"] = scopes
      return out
    profiles = {"x": step(10.0, 20.0, 70.0, {"emb (bwd)": 40.0, "opt": 25.0, "loss": 5.0}),
                "y": step(8.0, 12.0, 90.0, {"emb (bwd)": 20.0, "opt": 25.0, "copy": 45.0}),
                "old": step(1.0, 2.0, 3.0)}
    labels, parts = profile.step_parts(profiles, scopes=2)
    self.assertEqual(labels, [profile.SITES_FWD, profile.SITES_BWD, "copy", "emb (bwd)",
                              profile.OTHER_OUTSIDE])
    self.assertEqual(parts, {"x": [10.0, 20.0, 0.0, 40.0, 30.0],
                             "y": [8.0, 12.0, 45.0, 20.0, 25.0],
                             "old": [1.0, 2.0, 0.0, 0.0, 3.0]})
    for name, p in profiles.items():
      self.assertAlmostEqual(sum(parts[name]), p["device_us_per_step"])


if __name__ == "__main__":
  absltest.main()
