"""`experiments.report time_to_plan`'s row (experiments/tools/main_job_rows.py): the stages,
kernel-pass counts, candidates and FP8 sites come from the stamped lines of the main job's
logs, a cut cold run keeps the stage it was in as "<stage>_incomplete", and a file that is no
such log is refused naming it."""
import json
import os
import shutil
import tempfile

from absl.testing import absltest

from cli_helpers import run_module
from experiments.tools import main_job_rows
from experiments.tools.results_user_speed import load_rows
from loka_jax import jsonio

# A complete cold run, as experiments/gpu_main_job_call.sh stamps it (shortened; absl lines
# and blank ones interleaved as on a GPU). Its report's plan table has two FP8 sites: one
# whose input gradient validation moved to another FP8 kernel (" *"), one with a kernel that
# quantizes only its forward; the default row and the bf16 site do not count.
COLD = """\
    0.3 W1205 16:36:00.100000     690 cuda_timer.cc:88] Delay kernel timed out.
    1.5 == probe -> dispatch -> validate: wukong/small on synthetic -> /tmp/mj/run
    1.5 [pipeline] probing wukong/small (mods: all) in /tmp/mj/run/probe
   12.0 [probe] wukong/small: 3 sites; training to step 100 with a statistics pass every 25 steps
   40.2 I1205 16:36:41.488144     680 some_module.cc:12] unrelated
   70.5 [probe] trained to step 100 (58s into the probe)
   75.0 [probe] evaluated 1/3 bottom_mlp/dense_0 in 4.5s
  100.0 [probe] evaluation phase: 3 sites in 30s, compiled ahead on 16 threads: ...
  100.1 [probe] no committed kernel timings for NVIDIA H100 80GB HBM3 in /x: timing 2 ...
  130.3 [probe] timed bottom_mlp/dense_0 (6 kernel passes; shape 1/2) in 30.2s
  140.0 [probe] timing: 44 kernel passes measured, 3 reused from this card's committed table, \
157 not timed (no site of their shape admits them on accuracy), 25 not timed (dominated on \
this card), 29 bf16 baseline passes not timed (no kernel of their pass is)
  140.0 [probe] timing table: /x/timings/NVIDIA_H100_80GB_HBM3.json
  141.0 [probe] report: /tmp/mj/run/probe/probe_report.json (129s)
  150.0 [pipeline] selected: /tmp/mj/run/plan_selected.json
  165.5 [pipeline] plan: /tmp/mj/run/plan.json
  165.5 == bf16+Mods: 300 steps -> /tmp/mj/run/arms/bf16_mods
  230.0 # loka_jax main job: wukong/small on synthetic, seed 0
  230.0 
  230.0 Probe: 100 bf16+Mods training steps, 3 sites probed, candidates xla_bf16, \
xla_fp8_rowwise, flax_fp8_delayed_fwd. Selection budget: SQNR >= 25 dB fwd / 20 dB gradients.
  230.0 
  230.0 | site | fwd | dgrad | wgrad |
  230.0 |---|---|---|---|
  230.0 | bottom_mlp/dense_0 | xla_bf16 | xla_fp8_rowwise_precise * | xla_bf16 |
  230.0 | bottom_mlp/dense_1 | xla_bf16 | xla_bf16 | xla_bf16 |
  230.0 | head/dense_0 | flax_fp8_delayed_fwd | flax_fp8_delayed_fwd | flax_fp8_delayed_fwd |
  230.0 | (other sites) | xla_fp8_rowwise | xla_fp8_rowwise | xla_fp8_rowwise |
  230.0
  230.0 | arm | held-out NE |
  230.0 |---|---|
  230.0 | fp8_all xla_fp8_rowwise + Mods | 0.85 |
  231.4 wrote /tmp/mj/run/report.md, /tmp/mj/run/plan.png, /tmp/mj/run/arms.png
"""
# The rerun on the warm workdir: the report and the plan are found, only the arms train.
WARM = """\
    1.7 == probe -> dispatch -> validate: wukong/small on synthetic -> /tmp/mj/run
    1.7 [pipeline] probe report found: /tmp/mj/run/probe_report.json
    1.7 [pipeline] validated plan found: /tmp/mj/run/plan.json
    1.7 == bf16+Mods: 300 steps -> /tmp/mj/run/arms/bf16_mods
   13.7 # loka_jax main job: wukong/small on synthetic, seed 0
   13.9 wrote /tmp/mj/run/report.md, /tmp/mj/run/plan.png, /tmp/mj/run/arms.png
"""
# A cold run its time limit stopped while it timed kernels: no summary, no report.
CUT = """\
    2.0 == probe -> dispatch -> validate: wukong/small on synthetic -> /tmp/mj/run
   17.9 [probe] wukong/small: 35 sites; training to step 100 with a statistics pass every 25 steps
  133.9 [probe] trained to step 100 (116s into the probe)
  329.4 [probe] evaluation phase: 35 sites in 195s, compiled ahead on 16 threads: ...
  400.0 [probe] timed bottom_mlp/dense_0 (24 kernel passes; shape 1/17) in 70.6s
  489.9 [probe] timed bottom_mlp/dense_1 (9 kernel passes; shape 2/17) in 89.9s
"""
STAGES = {"start": 12.0, "probe_training": 58.5, "evaluation": 29.5, "timing": 40.0,
          "report_select_validate": 25.5, "arms": 64.5}
PASSES = {"measured": 44, "reused": 3, "not_safe": 157, "dominated": 25}
CANDIDATES = "xla_bf16, xla_fp8_rowwise, flax_fp8_delayed_fwd"
RECORDED = ("NVIDIA H100 80GB HBM3", "0.11.2", "2026-12-05", "abc1234", "bash call.sh")


class MainJobRowTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="loka_main_job_rows_")
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def write(self, name, text):
    path = os.path.join(self.dir, name)
    with open(path, "w") as f:
      f.write(text)
    return path

  def test_a_complete_cold_run_and_its_warm_rerun(self):
    row = main_job_rows.row(self.write("cold.log", COLD), self.write("warm.log", WARM),
                            *RECORDED)
    self.assertEqual(row["kind"], "time_to_plan")
    self.assertEqual((row["model"], row["preset"]), ("wukong", "small"))
    self.assertEqual((row["device"], row["jax"], row["date"], row["commit"], row["command"]),
                     RECORDED)
    self.assertTrue(row["complete"])
    self.assertEqual((row["cold_s"], row["warm_s"]), (231.4, 13.9))   # the last stamps
    self.assertEqual(row["stages_s"], STAGES)
    self.assertEqual(row["kernel_passes"], PASSES)
    self.assertEqual(row["candidates"], CANDIDATES)
    self.assertEqual(row["fp8_sites"], 2)
    self.assertNotIn("note", row)
    # The wall times the call printed replace the last stamps; no warm log, no warm time.
    given = main_job_rows.row(self.write("cold.log", COLD), None, *RECORDED, cold_s=233.04,
                              note="n")
    self.assertEqual((given["cold_s"], given["warm_s"], given["note"]), (233.0, None, "n"))

  def test_the_fp8_sites_of_a_plan_file(self):
    entry = lambda k: {p: {"kernel": k} for p in ("fwd", "grad_lhs", "grad_rhs")}
    plan = jsonio.with_digest({"sites": {"a": entry("xla_fp8_tensorwise"),
                                         "b": entry("xla_bf16"), "c": entry("xla_bf16")},
                               "default": None})
    path = self.write("plan.json", json.dumps(plan))
    row = main_job_rows.row(self.write("cold.log", COLD), None, *RECORDED, plan_path=path)
    self.assertEqual(row["fp8_sites"], 1)   # the plan's count, not the log table's 2
    self.write("plan.json", json.dumps({**plan, "default": "changed"}))
    with self.assertRaisesRegex(main_job_rows.MainJobRowError,
                                "plan.json: the plan does not match its sha256"):
      main_job_rows.row(self.write("cold.log", COLD), None, *RECORDED, plan_path=path)

  def test_a_cut_cold_run(self):
    row = main_job_rows.row(self.write("cold.log", CUT), None, *RECORDED)
    self.assertFalse(row["complete"])
    self.assertEqual(row["stages_s"], {"start": 17.9, "probe_training": 116.0,
                                       "evaluation": 195.5, "timing_incomplete": 160.5})
    self.assertEqual((row["cold_s"], row["warm_s"]), (489.9, None))
    self.assertEqual((row["fp8_sites"], row["kernel_passes"], row["candidates"]),
                     (None, None, None))
    given = main_job_rows.row(self.write("cold.log", CUT), None, *RECORDED, cold_s=501.3,
                              candidates="probe default (16 kernels)")
    self.assertEqual((given["cold_s"], given["candidates"]),
                     (501.3, "probe default (16 kernels)"))
    # Cut while the probe trained: the stage it was in runs to the last stamp.
    early = main_job_rows.row(self.write("early.log", "\n".join(CUT.splitlines()[:2])
                                         + "\n   90.0 W1205 noise\n"), None, *RECORDED)
    self.assertEqual(early["stages_s"], {"start": 17.9, "probe_training_incomplete": 72.1})
    # A blank last line whose stamp's trailing space an editor stripped still counts.
    blank = main_job_rows.row(self.write("cold.log", CUT + "  495.0\n"), None, *RECORDED)
    self.assertEqual((blank["cold_s"], blank["stages_s"]["timing_incomplete"]), (495.0, 165.6))

  def test_a_file_that_is_no_main_job_log_is_refused_naming_it(self):
    for name, text in (("train.log", "    1.0 [drift] step 25: site kept\n"),
                       ("empty.log", "")):
      with self.assertRaisesRegex(main_job_rows.MainJobRowError,
                                  f"{name}: not a log of the main job"):
        main_job_rows.row(self.write(name, text), None, *RECORDED)
    with self.assertRaisesRegex(main_job_rows.MainJobRowError, "missing.log: cannot read"):
      main_job_rows.row(os.path.join(self.dir, "missing.log"), None, *RECORDED)
    with self.assertRaisesRegex(main_job_rows.MainJobRowError,
                                "warm.log: a run of dlrm/large, not a rerun"):
      main_job_rows.row(self.write("cold.log", COLD),
                        self.write("warm.log", WARM.replace("wukong/small", "dlrm/large")),
                        *RECORDED)

  def test_the_cli_appends_a_row_the_results_read(self):
    cold, warm = self.write("cold.log", COLD), self.write("warm.log", WARM)
    out = os.path.join(self.dir, "rows.jsonl")
    flags = [f"--cold={cold}", "--device=NVIDIA H100 80GB HBM3", "--jax=0.11.2",
             "--date=2026-12-05", "--commit=abc1234", "--command=bash call.sh"]
    done = run_module("experiments.report", "time_to_plan", *flags, f"--warm={warm}",
                      f"--out={out}", timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("wukong/small: cold 231.4 s, warm 13.9 s; start 12.0 s", done.stdout)
    [row] = load_rows([out])
    self.assertEqual((row["cold_s"], row["warm_s"], row["stages_s"], row["kernel_passes"],
                      row["fp8_sites"], row["device"]),
                     (231.4, 13.9, STAGES, PASSES, 2, "NVIDIA H100 80GB HBM3"))
    no_device = run_module("experiments.report", "time_to_plan",
                           *[f for f in flags if not f.startswith("--device")], timeout=120)
    self.assertNotEqual(no_device.returncode, 0)
    self.assertIn("--device required", no_device.stderr)
    self.assertNotIn("Traceback", no_device.stderr)
    bad = self.write("notes.txt", "no stamps here\n")
    refused = run_module("experiments.report", "time_to_plan", *flags[1:], f"--cold={bad}",
                         timeout=120)
    self.assertNotEqual(refused.returncode, 0)
    self.assertIn(f"{bad}: not a log of the main job", refused.stderr)
    self.assertNotIn("Traceback", refused.stderr)


if __name__ == "__main__":
  absltest.main()
