"""RESULTS' "Speed where the user sees it" from committed rows (experiments/tools/
results_user_speed.py): the tables show the rows' numbers, and a changed, malformed or
unknown row is refused naming its file and line."""
import json
import os
import tempfile

from absl.testing import absltest

from experiments.tools import results_user_speed as user_speed
from loka_jax import jsonio

BASE = {"model": "wukong", "preset": "large", "device": "NVIDIA H200", "jax": "0.11.2",
        "date": "2026-12-04", "commit": "abc1234", "command": "bash call.sh"}


def write(rows, digest=True):
  fd, path = tempfile.mkstemp(suffix=".jsonl")
  with os.fdopen(fd, "w") as f:
    for r in rows:
      f.write(json.dumps(jsonio.with_digest(r) if digest else r) + "\n")
  return path


class UserSpeedTest(absltest.TestCase):

  def test_the_tables_show_the_rows(self):
    path = write([
        {**BASE, "kind": "startup", "arm": "LoKA", "cache": "cold", "prefetch": 2,
         "start_to_first_step_s": 124.0, "setup_s": 7.8, "first_step_s": 111.8,
         "window_steps_per_s": [8.1, 8.3, 8.2]},
        {**BASE, "kind": "startup", "arm": "LoKA", "cache": "cold", "prefetch": 2,
         "xla_flags": "--xla_gpu_enable_triton_gemm=false", "start_to_first_step_s": 55.2,
         "setup_s": 33.9, "first_step_s": 18.0, "window_steps_per_s": [7.86],
         "note": "one window"},
        {**BASE, "kind": "time_to_plan", "preset": "small", "candidates": "five", "complete": True,
         "cold_s": 295.7, "warm_s": 23.9, "fp8_sites": 3,
         "stages_s": {"probe_training": 65.9, "evaluation": 105.7, "timing": 2.7, "arms": 93.9}},
        {**BASE, "kind": "probe_overhead", "preset": "small", "cadence": 25, "pass_ms": 170.2,
         "step_ms": 27.3, "fraction": 0.249},
        {**BASE, "kind": "probe_overhead", "cadence": 25, "pass_ms": 377.0, "step_ms": 154.5,
         "batch_size": 4096, "weight_every": 4, "extract_ms": 95.2, "one_program": True,
         "pass_compile": "cublas", "first_call_s": 107.8,
         "measured_in": "experiments.measure probe_overhead"},
        {**BASE, "kind": "probe_overhead", "cadence": 25, "pass_ms": 300.0, "step_ms": 150.0,
         "weight_every": 4, "one_program": True, "group_sites": True, "pass_compile": "cublas"},
        {**BASE, "kind": "loop_vs_bench", "arm": "LoKA", "bench_steps_per_s": 8.3,
         "window_steps_per_s": [8.0, 8.2], "loop_steps_per_s": 8.1, "loop_over_bench": 0.976,
         "speedup_bench": 1.33, "speedup_loop": 1.31},
        {**BASE, "kind": "loop_vs_bench", "model": "dlrm", "arm": "bf16+Mods",
         "bench_steps_per_s": 140.0, "window_steps_per_s": [80.0, 128.0, 130.0],
         "loop_steps_per_s": 128.0, "loop_over_bench": 0.914, "batch_workers": 8,
         "batch_workers_from_step": 14},
        {**BASE, "kind": "loop_vs_bench", "model": "dhen", "arm": "bf16+Mods",
         "bench_steps_per_s": 13.5, "window_steps_per_s": [13.8, 13.9],
         "loop_steps_per_s": 13.85, "loop_over_bench": 1.026, "bench_shared_state": False}])
    self.addCleanup(os.remove, path)
    text = user_speed.section([path])
    self.assertIn("| wukong/large | H200 | LoKA | - | cold | 2 | 124 s | 7.8 s | 112 s | "
                  "8.20 (8.10-8.30) |", text)
    self.assertIn("| wukong/large | H200 | LoKA | `--xla_gpu_enable_triton_gemm=false` | cold | "
                  "2 | 55 s | 34 s | 18 s | 7.86 (7.86-7.86) |", text)
    self.assertIn("- wukong/large LoKA with --xla_gpu_enable_triton_gemm=false: one window", text)
    self.assertIn("| 1 | wukong/small | H200 | abc1234 | five | 296 s | 24 s | 66 s | 106 s | "
                  "2.7 s | 94 s | 3 |", text)
    # Shares at 25, 100 and 200 steps: 170.2 / (25 x 27.3) = 24.9%, then 6.2% and 3.1%.
    self.assertIn("| wukong/small | H200 | - | - | 1 | per site, autotuned | - | 170 ms | - | "
                  "27.3 ms | 24.9% | 6.2% | 3.1% | 312 steps |", text)
    self.assertIn("| wukong/large | H200 | 4096 | experiments.measure probe_overhead | 4 | "
                  "one program, cublas | 108 s | 377 ms | 95.2 ms | 154.5 ms | 9.8% | 2.4% | "
                  "1.2% | 123 steps |", text)
    # 300 / (25 x 150) = 8.0%; 300 / (0.02 x 150) = 100 observations apart.
    self.assertIn("| wukong/large | H200 | - | - | 4 | one program, sites grouped, cublas | - | "
                  "300 ms | - | 150.0 ms | 8.0% | 2.0% | 1.0% | 100 steps |", text)
    # A row without batch_workers had none; one whose loop started them says when.
    self.assertIn("| wukong/large | H200 | LoKA | 0 | 8.30 steps/s | 8.10 (8.00-8.20) | 0.976 | "
                  "1.330x, 1.310x |", text)
    self.assertIn("| dlrm/large | H200 | bf16+Mods | 8 (from step 14) | 140.00 steps/s | 128.00 "
                  "(80.00-130.00) | 0.914 | - |", text)
    # A bench step timed on the arm's own state says so; one on bf16's shared state does not.
    self.assertIn("| dhen/large | H200 | bf16+Mods | 0 | 13.50 steps/s (own state) | 13.85 "
                  "(13.80-13.90) | 1.026 | - |", text)
    self.assertIn("NVIDIA H200, jax 0.11.2, 2026-12-04, commit abc1234, `bash call.sh`", text)

  def test_the_overhead_table_names_each_rows_card(self):
    rows = [{**BASE, "kind": "probe_overhead", "cadence": 25, "pass_ms": 74.0, "step_ms": 7.4,
             "device": device} for device in ("NVIDIA H100 80GB HBM3", "NVIDIA H200", "cpu")]
    table = user_speed.overhead_table(rows)
    for card in ("| wukong/large | H100 80GB HBM3 | ", "| wukong/large | H200 | ",
                 "| wukong/large | cpu | "):
      self.assertIn(card, table)

  def test_the_startup_and_loop_tables_name_each_rows_card(self):
    devices = ("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    startup = user_speed.startup_table([
        {**BASE, "kind": "startup", "arm": "LoKA", "cache": "warm", "prefetch": 2,
         "start_to_first_step_s": 15.0, "setup_s": 7.0, "first_step_s": 4.9,
         "window_steps_per_s": [8.2], "device": device} for device in devices])
    loop = user_speed.loop_table([
        {**BASE, "kind": "loop_vs_bench", "arm": "LoKA", "bench_steps_per_s": 7.5,
         "window_steps_per_s": [8.1], "loop_steps_per_s": 8.1, "loop_over_bench": 1.08,
         "device": device} for device in devices])
    for table in (startup, loop):
      self.assertIn("| wukong/large | H100 80GB HBM3 | LoKA | ", table)
      self.assertIn("| wukong/large | H200 | LoKA | ", table)

  def test_the_time_to_plan_table_names_each_rows_card_and_its_kernel_passes(self):
    rows = [{**BASE, "kind": "time_to_plan", "preset": "small", "candidates": "five",
             "complete": complete, "cold_s": cold, "warm_s": warm, "fp8_sites": sites,
             "device": device, "stages_s": stages, **extra}
            for device, complete, cold, warm, sites, stages, extra in (
                ("NVIDIA H200", False, 501.3, None, None, {"timing_incomplete": 160.5},
                 {"note": "stopped at its limit"}),
                ("NVIDIA H100 80GB HBM3", True, 410.5, 14.5, 0, {"timing": 137.2},
                 {"kernel_passes": {"measured": 44, "reused": 0, "not_safe": 157,
                                    "dominated": 25}}),
                ("NVIDIA H200", True, 295.7, 23.9, 0, {"timing": 2.7},
                 {"kernel_passes": {"measured": 0, "reused": 75, "not_safe": 156,
                                    "dominated": 24}}),
                # Cut in its arms, after a complete timing stage: the arms are marked cut.
                ("NVIDIA H100 PCIe", False, 401.1, 25.4, None,
                 {"probe_training": 146.6, "evaluation": 118.9, "timing": 0.1,
                  "arms_incomplete": 52.0}, {}))]
    table = user_speed.time_to_plan_table(rows)
    self.assertIn("| 1 | wukong/small | H200 | abc1234 | five | > 501 s (stopped) | - | - | - | "
                  "160 s (cut) |", table)
    self.assertIn("| 2 | wukong/small | H100 80GB HBM3 | abc1234 | five | 410 s | 14 s | - | - | "
                  "137 s | - | 0 |", table)
    self.assertIn("| 4 | wukong/small | H100 PCIe | abc1234 | five | > 401 s (stopped) | 25 s | "
                  "147 s | 119 s | 0.1 s | 52 s (cut) | - |", table)
    self.assertIn("- Run 1: stopped at its limit.", table)
    self.assertIn("- Run 2: Kernel passes: 44 timed, 0 reused "
                  "from the card's committed table, 157 not timed", table)
    self.assertIn("- Run 3: Kernel passes: 0 timed, 75 reused", table)

  def test_the_drift_table_shows_where_refreshes_fell_and_their_share(self):
    path = write([
        {**BASE, "kind": "drift_run", "plan": "plan.json", "cadence": 25, "max_overhead": 0.02,
         "steps": 600, "refresh_steps": [25, 50, 172, 300], "refresh_s": [104.2, 0.41, 0.39, 0.4],
         "later_refresh_s": 0.4, "step_ms": 122.4, "share": 0.59, "share_after_first": 0.0165},
        {**BASE, "kind": "drift_run", "preset": "small", "cadence": 25, "max_overhead": 0.0,
         "steps": 30, "refresh_steps": [25], "refresh_s": [50.0], "later_refresh_s": None,
         "step_ms": 7.0, "share": 0.99, "share_after_first": None}])
    self.addCleanup(os.remove, path)
    text = user_speed.section([path])
    self.assertIn("| wukong/large | plan.json | 25 | 2.00% | 600 | 25, 50, 172, 300 | 104.2 s | "
                  "400 ms | 122.4 ms | 59.00% | 1.65% |", text)
    self.assertIn("| wukong/small | - | 25 | none | 30 | 25 | 50.0 s | - | 7.0 ms | 99.00% | - |",
                  text)

  def test_a_changed_malformed_or_unknown_row_names_its_file_and_line(self):
    good = {**BASE, "kind": "probe_overhead", "cadence": 25, "pass_ms": 1.0, "step_ms": 2.0,
            "fraction": 0.02}
    changed = jsonio.with_digest(good)
    changed["pass_ms"] = 0.5
    cases = {"does not match its sha256": [json.dumps(jsonio.with_digest(good)),
                                            json.dumps(changed)],
             "not valid JSON": [json.dumps(good)[:-3]],
             "needs a kind": [json.dumps({**good, "kind": "lunch"})],
             "missing: \\['commit'\\]": [json.dumps({k: v for k, v in good.items()
                                                     if k != "commit"})],
             "missing: \\['pass_ms'\\]": [json.dumps({k: v for k, v in good.items()
                                                      if k != "pass_ms"})]}
    for message, lines in cases.items():
      fd, path = tempfile.mkstemp(suffix=".jsonl")
      with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
      self.addCleanup(os.remove, path)
      with self.assertRaisesRegex(user_speed.UserSpeedError,
                                  f"{path}:{len(lines)}: .*{message}"):
        user_speed.load_rows([path])


if __name__ == "__main__":
  absltest.main()
