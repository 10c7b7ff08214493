"""XLA flags set by our scripts: accepted by this XLA, refused once JAX has started."""
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from absl.testing import absltest

from cli_helpers import cpu_env
from loka_jax import xla_env

# A child process that sets the flags, then runs a scatter-add (what deterministic ops change)
# and prints XLA_FLAGS. XLA aborts the process on a flag it does not know.
CHILD = """
import sys
from loka_jax import xla_env
xla_env.add_xla_flags(*sys.argv[1:])
import jax, jax.numpy as jnp
x = jnp.zeros(8).at[jnp.array([1, 1, 3])].add(jnp.array([1.0, 2.0, 3.0]))
print(float(x[1]), float(x[3]))
import os
print(os.environ["XLA_FLAGS"])
"""


class XlaEnvTest(absltest.TestCase):

  def test_this_xla_accepts_the_flags_before_jax_starts(self):
    autotune = os.path.join(tempfile.mkdtemp(prefix="loka_xla_env_"), "autotune.textproto")
    flags = (xla_env.DETERMINISTIC, xla_env.autotune_flag(autotune))
    done = subprocess.run([sys.executable, "-c", CHILD, *flags], env=cpu_env(),
                          capture_output=True, text=True, timeout=120)
    self.assertEqual(done.returncode, 0, done.stderr[-2000:])
    sums, xla_flags = done.stdout.strip().splitlines()[-2:]
    self.assertEqual(sums, "3.0 3.0")
    self.assertTrue(xla_flags.endswith(" ".join(flags)), xla_flags)

  def test_flags_after_jax_started_are_refused(self):
    jnp.ones(2).block_until_ready()   # this process's backend is up
    before = os.environ.get("XLA_FLAGS")
    with self.assertRaisesRegex(RuntimeError, "must be set before JAX starts"):
      xla_env.add_xla_flags(xla_env.DETERMINISTIC)
    self.assertEqual(os.environ.get("XLA_FLAGS"), before)
    self.assertNotEmpty(jax.devices())

  def test_the_autotune_flag_loads_what_exists_and_dumps_otherwise(self):
    path = os.path.join(tempfile.mkdtemp(prefix="loka_xla_env_"), "autotune.textproto")
    self.assertEqual(xla_env.autotune_flag(path),
                     f"--xla_gpu_dump_autotune_results_to={path}")
    open(path, "w").close()
    self.assertEqual(xla_env.autotune_flag(path),
                     f"--xla_gpu_load_autotune_results_from={path}")


if __name__ == "__main__":
  absltest.main()
