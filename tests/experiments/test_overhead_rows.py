"""`experiments.report probe_overhead`'s rows (experiments/tools/overhead_rows.py): the numbers
come from the measurement's JSON, RESULTS' table reads them, and a file that is not a
measurement is refused naming it; end to end, `experiments.measure probe_overhead` writes the
JSON (its card, date and command line) the report turns into a row."""
import json
import os
import shutil
import tempfile

from absl.testing import absltest

from cli_helpers import run_module
from experiments.tools import overhead_rows, results_user_speed
from loka_jax import jsonio

# A measurement as experiments.measure probe_overhead writes it, with round numbers.
MEASURED = {"device": "NVIDIA H200", "jax": "0.11.2", "date": "2026-12-05",
            "command": "python3 -m experiments.measure probe_overhead --model=wukong "
                       "--preset=large --probe_config=weight_every=4,group_sites=1",
            "model": "wukong", "preset": "large", "batch_size": 4096, "sites": 63,
            "probe_config": {"cadence": 25, "weight_every": 4, "one_program": True,
                             "group_sites": True, "pass_compile": "cublas"},
            "step_ms": 150.0, "pass_ms": 300.0, "pass_first_call_s": 90.0,
            "fraction": {"25": 0.08}, "parts_ms": {"extract": 95.0}}


class OverheadRowTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    self.dir = tempfile.mkdtemp(prefix="loka_overhead_rows_")
    self.addCleanup(shutil.rmtree, self.dir, ignore_errors=True)

  def write(self, name, obj):
    path = os.path.join(self.dir, name)
    with open(path, "w") as f:
      f.write(obj if isinstance(obj, str) else json.dumps(obj))
    return path

  def test_the_row_holds_the_measurement_and_the_table_reads_it(self):
    row = overhead_rows.row(self.write("m.json", MEASURED), "abc1234")
    self.assertEqual((row["kind"], row["commit"], row["date"], row["command"]),
                     ("probe_overhead", "abc1234", "2026-12-05", MEASURED["command"]))
    self.assertEqual((row["weight_every"], row["one_program"], row["group_sites"],
                      row["pass_compile"], row["first_call_s"], row["extract_ms"]),
                     (4, True, True, "cublas", 90.0, 95.0))
    rows_path = os.path.join(self.dir, "rows.jsonl")
    with open(rows_path, "w") as f:
      f.write(json.dumps(jsonio.with_digest(row)) + "\n")
    (loaded,) = results_user_speed.load_rows([rows_path])
    # 300 / (25 x 150) = 8.0%, / (100 x 150) = 2.0%, / (200 x 150) = 1.0%; a 2% budget
    # spaces observations 300 / (0.02 x 150) = 100 steps apart.
    self.assertIn("| wukong/large | H200 | 4096 | experiments.measure probe_overhead | 4 | one "
                  "program, sites grouped, cublas | 90 s | 300 ms | 95.0 ms | 150.0 ms | 8.0% | "
                  "2.0% | 1.0% | 100 steps |", results_user_speed.overhead_table([loaded]))

  def test_a_pass_taken_apart_keeps_its_parts_and_results_lists_them_largest_first(self):
    parted = {**MEASURED, "parts_ms": {"extract": 95.0, "gaussian": 20.0, "matrix_normal": 60.0,
                                       "flush": 15.0, "amax": 5.0, "reservoir": 5.0}}
    rows_path = os.path.join(self.dir, "rows.jsonl")
    with open(rows_path, "w") as f:
      for measured in (MEASURED, parted):
        row = overhead_rows.row(self.write("m.json", measured), "abc1234")
        f.write(json.dumps(jsonio.with_digest(row)) + "\n")
    whole, apart = results_user_speed.load_rows([rows_path])
    self.assertNotIn("parts_ms", whole)
    self.assertEqual(apart["parts_ms"], parted["parts_ms"])
    # Shares of the parts' 200 ms: 95 -> 48% (47.5 rounds to even), 60 -> 30%, 20 -> 10%,
    # 15 -> 8% (7.5), 5 -> 2% (2.5).
    self.assertIn("| wukong/large | H200 | 4 | one program, sites grouped, cublas | 300 ms | "
                  "extract 95.0 ms (48%), matrix_normal 60.0 ms (30%), gaussian 20.0 ms (10%), "
                  "flush 15.0 ms (8%), amax 5.0 ms (2%), reservoir 5.0 ms (2%) |",
                  results_user_speed.overhead_parts_table([apart]))
    # RESULTS lists the parts table only where a row was taken apart, below the rows' table.
    section = results_user_speed.section([rows_path])
    self.assertEqual(section.count("| wukong/large | H200 | 4 | one program"), 1)
    self.assertLess(section.index("| 100 steps |"), section.index("The same pass taken apart"))
    with open(rows_path, "w") as f:
      f.write(json.dumps(jsonio.with_digest(overhead_rows.row(
          self.write("m.json", MEASURED), "abc1234"))) + "\n")
    self.assertNotIn("taken apart", results_user_speed.section([rows_path]))

  def test_what_is_not_a_measurement_is_refused_naming_the_file(self):
    for name, content, says in (
        ("torn.json", '{"device": ', "not valid JSON"),
        ("list.json", [1, 2], "not a probe-overhead measurement"),
        ("short.json", {k: v for k, v in MEASURED.items() if k != "pass_ms"}, "no pass_ms"),
        ("undated.json", {k: v for k, v in MEASURED.items() if k != "date"}, "no date"),
        ("config.json", {**MEASURED, "probe_config": {"cadence": 25}},
         "probe_config lacks weight_every, one_program, pass_compile")):
      path = self.write(name, content)
      with self.assertRaisesRegex(overhead_rows.OverheadRowError, f"{path}.*{says}"):
        overhead_rows.row(path, "abc1234")
    # A date and command given make a row of a measurement that recorded neither.
    bare = {k: v for k, v in MEASURED.items() if k not in ("date", "command")}
    row = overhead_rows.row(self.write("bare.json", bare), "x", command="c", date="2026-12-01")
    self.assertEqual((row["date"], row["command"]), ("2026-12-01", "c"))

  def test_measured_then_reported_on_the_cpu(self):
    measured, rows = os.path.join(self.dir, "m.json"), os.path.join(self.dir, "rows.jsonl")
    # A flag's value may follow it as its own argument; --out and its value are left out.
    args = ("--model=dlrm", "--preset=tiny", "--batch_size=64", "--repeats", "1",
            "--probe_config=weight_every=4,group_sites=1")
    done = run_module("experiments.measure", "probe_overhead", *args[:3], "--out", measured,
                      *args[3:])
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    with open(measured) as f:
      self.assertEqual(json.load(f)["command"],
                       "python3 -m experiments.measure probe_overhead " + " ".join(args))
    done = run_module("experiments.report", "probe_overhead", f"--measured={measured}",
                      "--commit=abc1234", f"--out={rows}")
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    (row,) = results_user_speed.load_rows([rows])
    self.assertEqual((row["model"], row["preset"], row["batch_size"], row["group_sites"],
                      row["device"]), ("dlrm", "tiny", 64, True, "cpu"))
    self.assertGreater(row["pass_ms"], 0.0)
    # A row file (one JSON object a line) is not a measurement: refused in one line.
    done = run_module("experiments.report", "probe_overhead", f"--measured={rows}")
    self.assertNotEqual(done.returncode, 0)
    self.assertIn(f"{rows}: not a probe-overhead measurement: no probe_config", done.stderr)
    self.assertNotIn("Traceback", done.stderr)


if __name__ == "__main__":
  absltest.main()
