"""The GPU call scripts (`experiments/gpu_suite_call.sh`, `experiments/gpu_loka_call.sh`) run
on the CPU: a call's rows travel to a fresh host through the carry folder, and the call's hard
end reaches the bench, so a row starts past pacing.max_minutes when the rows recorded before it
say it ends in time (`experiments/bench/pace.py`). The scripts' `python3 -m` calls fork from
one warm interpreter (tests/warm_python.py)."""
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import zipfile

from absl.testing import absltest
import pip

from cli_helpers import REPO
from warm_python import WarmPython

TOWER = "32x16x2"
TOWERS_CONFIG = "--config=experiments/configs/bench_towers.py"
# The suite's compilation cache (tests/conftest.py) instead of the calls' /tmp/jc, which would
# outlive the run: a later override of the field wins.
COMPILE_CACHE = f"--config.compile_cache={os.environ['JAX_COMPILATION_CACHE_DIR']}"


_warm = None


def setUpModule():
  global _warm
  _warm = WarmPython()


def tearDownModule():
  _warm.close()


def _call(script, env, *args):
  """The script's output, which ends with the bench's last lines of this call."""
  if script != "gpu_queue.sh":   # a queue's stages carry their own arguments
    args = (*args, COMPILE_CACHE)
  # An OUT the test does not name is the script's default under WORK, never one inherited
  # from the environment (a device call sets OUT to the folder it brings back).
  done = subprocess.run(["bash", os.path.join("experiments", script), *args], cwd=REPO,
                        env=_warm.env(**{"OUT": "", **env}), capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  return done.stdout


def _rows(archive):
  with tarfile.open(archive) as tar:
    return [json.loads(line) for line in tar.extractfile("./bench.jsonl").read().splitlines()]


def _scratch(test, prefix):
  """A new folder that `test` removes when it ends."""
  folder = tempfile.mkdtemp(prefix=prefix)
  test.addCleanup(shutil.rmtree, folder, ignore_errors=True)
  return folder


SUITE_FLAGS = (TOWERS_CONFIG, f"--config.targets.towers={TOWER}", "--config.speed.repeats=3",
               "--config.probe.enabled=false")


def _env(root, host, **extra):
  work = os.path.join(root, host)
  return {"CARRY": os.path.join(root, "carry"), "WORK": work,
          "OUT": os.path.join(work, "out"), "LIMIT": "300", **extra}


class SuiteCallTest(absltest.TestCase):

  @classmethod
  def setUpClass(cls):
    # One suite call of the tower's bf16_mods row, whose rows the later calls carry.
    super().setUpClass()
    cls.shared = tempfile.mkdtemp(prefix="loka_calls_")
    cls.addClassCleanup(shutil.rmtree, cls.shared, ignore_errors=True)
    cls.first = _env(cls.shared, "host1")
    cls.first_out = _call("gpu_suite_call.sh", cls.first, *SUITE_FLAGS,
                          "--config.speed.variants=bf16_mods")

  def setUp(self):
    super().setUp()
    self.dir = _scratch(self, "loka_calls_")

  def env(self, host, **extra):
    return _env(self.dir, host, **extra)

  def carry_first(self, carry):
    """The first call's work.tar.gz, copied into the folder `carry`."""
    os.makedirs(carry, exist_ok=True)
    shutil.copy(os.path.join(self.first["OUT"], "work.tar.gz"), carry)
    return os.path.join(carry, "work.tar.gz")

  def test_rows_travel_and_a_row_starts_past_max_minutes_when_it_fits(self):
    self.assertIn("all selected rows are done", self.first_out.splitlines()[-2])
    rows = _rows(self.carry_first(os.path.join(self.dir, "carry")))
    self.assertEqual(sorted(r["variant"] for r in rows), ["bf16", "bf16_mods"])
    self.assertTrue(all(r["row_s"] > 0 for r in rows))
    # A fresh host, pacing.max_minutes already past: the carried rows' lengths let the next row
    # start, since the call's hard end is minutes away.
    second = self.env("host2", MAXMIN="0")
    out = _call("gpu_suite_call.sh", second, *SUITE_FLAGS,
                "--config.speed.variants=bf16_mods,fp8_tensorwise")
    self.assertIn("all selected rows are done", out.splitlines()[-2])
    rows = _rows(os.path.join(second["OUT"], "work.tar.gz"))
    self.assertEqual(sorted(r["variant"] for r in rows), ["bf16", "bf16_mods", "fp8_tensorwise"])

  def test_a_carry_edited_by_hand_replaces_a_warm_hosts_workdir_when_told(self):
    # A warm host keeps its own (newer) files over the carried ones; with CARRY_WINS=1 the
    # carried workdir replaces its own, so a row forgotten in the carry is measured again.
    env = self.env("host1", CARRY_WINS="1")
    os.makedirs(env["WORK"])
    with open(os.path.join(env["WORK"], "host_only.txt"), "w") as f:
      f.write("the host's")
    staged = os.path.join(self.dir, "staged")
    os.makedirs(staged)
    with open(os.path.join(staged, "carried.txt"), "w") as f:
      f.write("the carry's")
    os.makedirs(env["CARRY"])
    with tarfile.open(os.path.join(env["CARRY"], "work.tar.gz"), "w:gz") as tar:
      tar.add(staged, arcname=".")
    out = _call("gpu_suite_call.sh", env, f"--config.targets.towers={TOWER}",
                "--config.speed.repeats=3", "--config.probe.enabled=false", TOWERS_CONFIG,
                "--config.speed.variants=bf16")  # --config=FILE anywhere: the call puts it first
    self.assertIn("all selected rows are done", out.splitlines()[-2])
    self.assertFalse(os.path.exists(os.path.join(env["WORK"], "host_only.txt")))
    with tarfile.open(os.path.join(env["OUT"], "work.tar.gz")) as tar:
      names = tar.getnames()
    self.assertIn("./carried.txt", names)
    self.assertIn("./bench.jsonl", names)

  def test_the_loka_call_passes_the_hard_end_too(self):
    # The loka call takes the carried rows (bench.jsonl) of the tower's bf16_mods row; past
    # pacing.max_minutes their lengths let its new row start.
    call = self.env("host1", TARGET=f"tower/{TOWER}", VARIANTS="bf16_mods,fp8_tensorwise",
                    MAXMIN="0")
    with tarfile.open(self.carry_first(self.dir)) as tar:
      tar.extract("./bench.jsonl", call["CARRY"])
    _call("gpu_loka_call.sh", call, "--config.speed.repeats=3",
          "--config.probe.enabled=false")
    log = open(os.path.join(call["WORK"], "log.txt")).read().splitlines()
    self.assertIn("all selected rows are done", log[-2])
    rows = [json.loads(line) for line in open(os.path.join(call["WORK"], "bench.jsonl"))]
    self.assertEqual(sorted(r["variant"] for r in rows), ["bf16", "bf16_mods", "fp8_tensorwise"])


class TimeLimitTest(absltest.TestCase):

  def test_max_minutes_never_passes_the_hard_end(self):
    # (LIMIT s, MAXMIN min) -> (pacing.max_minutes, pacing.end_by_minutes): a short LIMIT, as
    # a queue's later stage gets, shortens pacing.max_minutes too, which sizes a probe's
    # budget; a long one leaves MAXMIN, and the hard end 20 s before the timeout.
    def minutes(limit, maxmin):
      got = subprocess.run(
          ["bash", "-c", "source experiments/gpu_common.sh; echo $(max_minutes) "
           "$(end_by_minutes)"], cwd=REPO, capture_output=True, text=True, check=True,
          env={**os.environ, "LIMIT": str(limit), "MAXMIN": str(maxmin)}).stdout.split()
      return tuple(float(x) for x in got)
    self.assertEqual(minutes(575, 5.5), (5.5, 9.25))
    self.assertEqual(minutes(221, 5.5), (3.35, 3.35))
    self.assertEqual(minutes(575, 0), (0.0, 9.25))
    self.assertEqual(minutes(25, 7.5), (0.5, 0.5))


class QueueTest(absltest.TestCase):

  def test_stages_run_in_order_resume_and_wait_for_time(self):
    tmp = _scratch(self, "loka_queue_")
    queue = os.path.basename(tmp)  # markers of this test only
    self.addCleanup(lambda: [os.remove(os.path.join("/tmp", f))
                             for f in os.listdir("/tmp") if f.startswith(f"loka_queue_{queue}_")])
    flags = (f"{TOWERS_CONFIG} --config.targets.towers={TOWER} --config.speed.repeats=3 "
             f"--config.probe.enabled=false --config.speed.variants=bf16_mods {COMPILE_CACHE}")
    first = f"a {tmp}/wa {tmp}/ca 10 {flags}"
    never = f"b {tmp}/wb {tmp}/cb 100000 {flags}"  # asks for more time than any call has
    env = {"QUEUE": queue, "OUT": os.path.join(tmp, "out"), "BUDGET": "400"}
    out = _call("gpu_queue.sh", env, first, never)
    self.assertIn("== a (", out)
    self.assertIn("== b: not started", out)
    rows = _rows(os.path.join(tmp, "out", "ca.tar.gz"))  # named by the carry folder
    self.assertEqual(sorted(r["variant"] for r in rows), ["bf16", "bf16_mods"])
    self.assertFalse(os.path.exists(os.path.join(tmp, "out", "a")))
    # The next call on the same host skips the finished stage and still waits for time.
    out = _call("gpu_queue.sh", env, first, never)
    self.assertIn("== a: done on this host", out)
    self.assertIn("== b: not started", out)
    bad = subprocess.run(["bash", "experiments/gpu_queue.sh", "a /tmp/x"], cwd=REPO,
                         env={**os.environ, **env}, capture_output=True, text=True)
    self.assertEqual(bad.returncode, 2)
    self.assertIn("give NAME WORK CARRY MIN_LEFT", bad.stderr)


class QualityCallTest(absltest.TestCase):

  def test_the_named_arms_run_in_their_order_under_the_cooldown(self):
    work = _scratch(self, "loka_qcall_")
    env = {"WORK": work, "CARRY": os.path.join(work, "carry"), "MODELS": "dlrm",
           "PRESET": "tiny", "STEPS": "4", "WARMUP": "0", "EVAL": "100", "SEEDS": "0",
           "ARMS": "fp8_naive_mods,bf16", "COOLDOWN": "2", "LIMIT": "300"}
    out = _call("gpu_quality_call.sh", env)
    self.assertIn("dlrm rc=0", out)
    with open(os.path.join(work, "out", "quality.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual([(r["arm"], r["seed"], r["steps"], r["cooldown_steps"]) for r in rows],
                     [("fp8_naive_mods", 0, 4, 2), ("bf16", 0, 4, 2)])

  def test_a_mods_sets_loka_arm_runs_the_plan_given_for_that_set(self):
    # The bench looks for a Mods set's plans in a folder of their own; a plan copied to the
    # default set's folder would leave the LoKA arm "left for a later run".
    work = _scratch(self, "loka_qcall_mods_")
    plan = os.path.join(REPO, "docs", "results", "plan_dlrm_tiny_movielens_h100_2026-12-05.json")
    env = {"WORK": work, "CARRY": os.path.join(work, "carry"), "MODELS": "dlrm",
           "PRESET": "tiny", "STEPS": "2", "WARMUP": "0", "EVAL": "100", "SEEDS": "0",
           "ARMS": "loka", "MODS": "no_bias,blocknorm", "PLAN_DLRM": plan, "LIMIT": "300"}
    out = _call("gpu_quality_call.sh", env)
    self.assertIn("dlrm rc=0", out)
    with open(os.path.join(work, "out", "quality.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual([(r["arm"], r["mods"], r["mods_set"]) for r in rows],
                     [("loka", ["no_bias", "blocknorm"], "no_bias+blocknorm")])
    self.assertEqual(rows[0]["plan"], os.path.join(work, "plans", "mods_no_bias+blocknorm",
                                                   "dlrm_tiny", "plan.json"))


class MovieLensCallTest(absltest.TestCase):

  def test_without_the_carried_data_cache_it_says_how_to_fetch_it(self):
    work = _scratch(self, "loka_mlcall_")
    done = subprocess.run(["bash", "experiments/gpu_movielens_call.sh"], cwd=REPO,
                          env={**os.environ, "WORK": work, "DATA": os.path.join(work, "none")},
                          capture_output=True, text=True, timeout=60)
    self.assertEqual(done.returncode, 1)
    self.assertEqual(done.stdout.strip(),
                     f"error: {work}/none holds no recbole wheel; fetch the data cache first "
                     "(see the head of experiments/gpu_movielens_call.sh)")
    self.assertFalse(os.path.exists(os.path.join(work, "quality.jsonl")))


class LoopBenchCallTest(absltest.TestCase):
  """`python3 -m experiments.bench`, `-m experiments.train` and `-m experiments.report` are
  stand-ins here (`bench_does`: what the bench's stand-in runs, in bash, with its arguments as
  "$@"); the train and report stand-ins record their calls, as does the bench's unless told
  otherwise; every other python3 call is the real interpreter's."""

  def setUp(self):
    super().setUp()
    self.work = _scratch(self, "loka_loopcall_")
    self.calls = os.path.join(self.work, "calls.txt")

  def run_call(self, env, bench_does=None):
    shims = os.path.join(self.work, "bin")
    os.makedirs(shims, exist_ok=True)
    with open(os.path.join(shims, "python3"), "w") as f:
      f.write(f"""#!/bin/bash
case "$1 $2" in
  "-m experiments.bench")
    {bench_does or f'echo "$2 $*" >> {self.calls}'}; exit 0 ;;
  "-m experiments.train"|"-m experiments.report")
    echo "$2 $*" >> {self.calls}; exit 0 ;;
esac
exec {shutil.which("python3")} "$@"
""")
    os.chmod(os.path.join(shims, "python3"), 0o755)
    return subprocess.run(
        ["bash", "experiments/gpu_loop_bench_call.sh"], cwd=REPO, capture_output=True,
        text=True, timeout=120,
        env={**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "WORK": self.work,
             "OUT": os.path.join(self.work, "out"), **env})

  def calls_made(self):
    with open(self.calls) as f:
      return [line.split() for line in f]

  def test_models_by_commas_and_a_bench_that_timed_nothing_leaves_the_loop_out(self):
    # A bench stopped by its pacing before it timed a step writes no bench.jsonl; the loop
    # arms beside it would compare with nothing, so the call names MAXMIN and goes on to the
    # next model.
    done = self.run_call({"MODELS": "dhen,interformer", "MAXMIN": "1.5"})
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    for model in ("dhen", "interformer"):
      self.assertIn(f"{model}: the bench timed no step within MAXMIN=1.5 minutes (its log: "
                    f"{model}_bench.log): loop arms left out; raise MAXMIN", done.stdout)
    calls = self.calls_made()
    self.assertEqual([call[0] for call in calls], ["experiments.bench", "experiments.bench"])
    # By default the bench times each arm on bf16's shared state; OWN_STATES=1 asks for a
    # state of the arm's own.
    self.assertIn("--config.speed.own_states=false", calls[0])
    done = self.run_call({"MODELS": "dhen", "MAXMIN": "1.5", "OWN_STATES": "1"})
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("--config.speed.own_states=true", self.calls_made()[-1])
    # Any other value is refused before anything runs.
    done = self.run_call({"MODELS": "dhen", "OWN_STATES": "true"})
    self.assertEqual(done.returncode, 2)
    self.assertIn("error: OWN_STATES=true: use 1 (each arm on its own state) or 0", done.stdout)

  def test_an_arm_whose_bench_row_is_an_error_gets_no_loop(self):
    # The stand-in bench times bf16 and bf16+Mods and records LoKA's row as an error (as the
    # bench does for an own state that cannot fit the card): only bf16+Mods' loop runs.
    rows = os.path.join(self.work, "rows.jsonl")
    with open(rows, "w") as f:
      for row in ({"variant": "bf16", "train": {"median_us": 1e5}},
                  {"variant": "bf16_mods", "train": {"median_us": 9e4}},
                  {"variant": "loka", "error": "StateMemoryError: loka: a training state"}):
        f.write(json.dumps(row) + "\n")
    write_rows = ('for a in "$@"; do case $a in --workdir=*) w=${a#--workdir=} ;; esac; done; '
                  f'mkdir -p "$w" && cp {rows} "$w/bench.jsonl"')
    done = self.run_call({"MODELS": "wukong", "OWN_STATES": "1", "ARM_LIMIT": "5"},
                         bench_does=write_rows)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    self.assertIn("wukong loop loka: left out, the bench timed no step of it (see "
                  "wukong_bench.log)", done.stdout)
    trains = [call for call in self.calls_made() if call[0] == "experiments.train"]
    self.assertLen(trains, 1)
    self.assertIn("--config.run.precision=bf16", trains[0])


class MainJobCallTest(absltest.TestCase):

  def test_a_cut_cold_run_is_finished_before_the_warm_rerun_is_timed(self):
    # `python3 -m experiments.loka` is a stand-in here: its first run on a workdir outlasts
    # any limit, its second finishes the job, and a later one is a warm rerun.
    work = _scratch(self, "loka_mainjob_")
    shims = os.path.join(work, "bin")
    os.makedirs(shims)
    with open(os.path.join(shims, "python3"), "w") as f:
      f.write(f"""#!/bin/bash
if [ "$1 $2" = "-m experiments.loka" ]; then
  w=${{3#--workdir=}}
  if [ -e "$w/done" ]; then echo "warm rerun"; exit 0; fi
  if [ -e "$w/started" ]; then touch "$w/done"; echo "finished the job"; exit 0; fi
  mkdir -p "$w"; touch "$w/started"; exec sleep 60
fi
exec {shutil.which("python3")} "$@"
""")
    os.chmod(os.path.join(shims, "python3"), 0o755)

    def call(name, runs):
      env = {**os.environ, "PATH": f"{shims}:{os.environ['PATH']}", "LIMIT": "2",
             "RUNS": runs, "WORK": os.path.join(work, name),
             "OUT": os.path.join(work, name, "out")}
      done = subprocess.run(["bash", "experiments/gpu_main_job_call.sh"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=120)
      self.assertEqual(done.returncode, 0, done.stderr[-2000:])
      runs = [line.split(":")[0] for line in done.stdout.splitlines() if ": rc=" in line]
      logs = {}
      for run in runs:
        with open(os.path.join(work, name, "out", f"{run}.log")) as f:
          logs[run] = f.read()
      return done.stdout, runs, logs

    out, runs, _ = call("cold_only", "cold")   # a cold run alone is left for the next call
    self.assertEqual(runs, ["cold"])
    self.assertIn("cold: rc=124", out)
    out, runs, logs = call("cold_warm", "cold warm")
    self.assertEqual(runs, ["cold", "resume", "warm"])
    self.assertIn("cold: rc=124", out)
    self.assertIn("finished the job", logs["resume"])
    self.assertIn("warm rerun", logs["warm"])


class MosaicCallTest(absltest.TestCase):

  def test_rows_of_the_mosaic_variants_come_back_and_resume(self):
    # The kernel benchmark's tiny shapes run on the CPU (interpret mode): the Mosaic GPU
    # variant's row comes back with its baseline's; a call carrying them times nothing again.
    work = _scratch(self, "loka_mosaic_")
    env = {"WORK": os.path.join(work, "a"), "TESTS_LIMIT": "0", "SMOKE": "1",
           "ONLY": "pallas_mosaic_fp8_rowwise_precise"}
    out = _call("gpu_mosaic_call.sh", env)
    self.assertIn("bench_kernels rc 0", out)
    with open(os.path.join(work, "a", "out", "kernels", "results.jsonl")) as f:
      rows = [json.loads(line) for line in f]
    self.assertEqual({(r["shape"], r["variant"]) for r in rows},
                     {("gemm_m64_k200_n96", "xla_bf16"),
                      ("gemm_m64_k200_n96", "pallas_mosaic_fp8_rowwise_precise")})
    self.assertTrue(all("median_us" in r and "error" not in r for r in rows), rows)
    again = _call("gpu_mosaic_call.sh", {**env, "WORK": os.path.join(work, "b"),
                                         "CARRY": os.path.join(work, "a", "out", "kernels")})
    self.assertIn("bench_kernels rc 0", again)
    with open(os.path.join(work, "b", "out", "kernels", "results.jsonl")) as f:
      self.assertLen(f.readlines(), 2)


class WheelsTest(absltest.TestCase):

  def test_scripts_started_together_install_the_wheel_once_and_each_imports_it(self):
    # An interpreter without ml_collections, as the GPU host's is (a venv holding only pip),
    # and a carried wheel of that name with 200 files, so that pip's move into the site takes
    # long enough for unlocked installs to collide. Six scripts start at once; each
    # must import the one copy.
    work = _scratch(self, "loka_wheels_")
    venv = os.path.join(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True)
    pure = sysconfig.get_path("purelib", vars={"base": venv, "platbase": venv})
    os.symlink(os.path.dirname(pip.__file__), os.path.join(pure, "pip"))
    wheels, site = os.path.join(work, "wheels"), os.path.join(work, "site")
    os.makedirs(wheels)
    info = "ml_collections-0.0.dist-info/"
    with zipfile.ZipFile(os.path.join(wheels, "ml_collections-0.0-py3-none-any.whl"), "w") as z:
      z.writestr("ml_collections/__init__.py", "CARRIED = True\n")
      for i in range(200):
        z.writestr(f"ml_collections/part_{i}.py", "x = 1\n" * 100)
      z.writestr(info + "METADATA", "Metadata-Version: 2.1\nName: ml_collections\nVersion: 0.0\n")
      z.writestr(info + "WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                 "Tag: py3-none-any\n")
      z.writestr(info + "RECORD", "")
    env = {**os.environ, "PATH": os.path.join(venv, "bin") + os.pathsep + os.environ["PATH"],
           "WHEELS": wheels, "WHEEL_SITE": site, "PYTHONPATH": ""}
    script = ("source experiments/gpu_common.sh && ensure_wheels && python3 -c "
              "'import ml_collections; print(ml_collections.CARRIED, ml_collections.__file__)'")
    calls = [subprocess.Popen(["bash", "-c", script], cwd=REPO, env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(6)]
    outs = [c.communicate(timeout=120)[0] for c in calls]
    for call, out in zip(calls, outs):
      self.assertEqual(call.returncode, 0, out[-2000:])
      self.assertEqual(out.strip(),
                       f"True {os.path.join(site, 'ml_collections', '__init__.py')}")


class JaxNextCallTest(absltest.TestCase):

  def test_parts_packed_here_are_checked_and_unpacked_first_on_the_path(self):
    # A wheel of 300 KB of random bytes packs into several 100 KB parts; a call with some of
    # them (or a damaged one) names what to carry next; with all of them it unpacks the
    # wheel's files into the site it puts first on PYTHONPATH.
    work = _scratch(self, "loka_jax_next_")
    wheels, dest = os.path.join(work, "wheels"), os.path.join(work, "dest")
    os.makedirs(wheels)
    payload = os.urandom(300_000)
    with zipfile.ZipFile(os.path.join(wheels, "tinypkg-1.0-py3-none-any.whl"), "w") as z:
      z.writestr("tinypkg/__init__.py", "VALUE = 7\n")
      z.writestr("tinypkg/blob.bin", payload)
      z.writestr("tinypkg-1.0.data/purelib/tinyextra.py", "EXTRA = 1\n")
      z.writestr("tinypkg-1.0.dist-info/METADATA", "Name: tinypkg\nVersion: 1.0\n")
    packed = _call("gpu_jax_next_pack.sh", {"WHEELS": wheels, "DEST": dest,
                                            "PART_BYTES": "100000"})
    parts = sorted(p for p in os.listdir(dest) if p.startswith("part-"))
    self.assertGreaterEqual(len(parts), 3)
    self.assertIn(f"packed 1 wheels into {len(parts)} part(s)", packed)
    self.assertEqual(packed.count("bash experiments/gpu_jax_next_call.sh"), len(parts))
    with open(os.path.join(dest, "MANIFEST")) as f:
      manifest = f.read()
    self.assertIn("# tinypkg-1.0-py3-none-any.whl", manifest)
    site = os.path.join(work, "site")
    env = {"DEST": dest, "SITE": site, "WORK": os.path.join(work, "call"), "TESTS_LIMIT": "0",
           "MAXMIN": "0"}
    last = os.path.join(dest, parts[-1])
    with open(last, "rb") as f:
      tail = f.read()
    os.remove(last)
    self.assertIn(f"parts here: {len(parts) - 1} of {len(parts)}; carry next: {parts[-1]}",
                  _call("gpu_jax_next_call.sh", env))
    with open(last, "wb") as f:   # damaged on the way: its sha256 no longer matches
      f.write(tail[:-1] + bytes([tail[-1] ^ 1]))
    self.assertIn(f"carry next: {parts[-1]}", _call("gpu_jax_next_call.sh", env))
    self.assertFalse(os.path.exists(site))
    with open(last, "wb") as f:
      f.write(tail)
    out = _call("gpu_jax_next_call.sh", env)
    self.assertRegex(out, r"card: .*jax \S+ jaxlib \S+ flax \S+ orbax \S+ on cpu")
    with open(os.path.join(site, "tinypkg", "blob.bin"), "rb") as f:
      self.assertEqual(f.read(), payload)
    self.assertTrue(os.path.exists(os.path.join(site, "tinyextra.py")))
    self.assertFalse(os.path.exists(os.path.join(site, "tinypkg-1.0.data")))


if __name__ == "__main__":
  absltest.main()
