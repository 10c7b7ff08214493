"""The timing loops on the GPU (run on the GPU host: python3 -m pytest tests_gpu): XLA keeps
every timed call of a pure product in the loop body, and updates the operands in place (no
copies of them an iteration). On the H200 in 2026-11, 16 unrolled calls through optimization
barriers ran as one, and reading an operand's own first element made XLA copy it twice an
iteration."""
import jax
import jax.numpy as jnp
import pytest

from loka_jax import timing
from loka_jax.probe import kernel_timing

SHAPES = [((2048, 1024), (1024, 1024)), ((16384, 4096), (4096, 4096))]


def _gemms(lines):
  return sum(("custom-call" in l and "__cublas" in l) or ("gemm_fusion" in l and " fusion(" in l)
             for l in lines)


def _operands(a_shape, b_shape):
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  return (timing.random_normal(ka, a_shape, jnp.bfloat16),
          timing.random_normal(kb, b_shape, jnp.bfloat16))


@pytest.mark.parametrize("a_shape,b_shape", SHAPES)
def test_probe_loop_keeps_16_gemms_an_iteration_without_copies(a_shape, b_shape):
  a, b = _operands(a_shape, b_shape)
  product = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)
  hlo = kernel_timing._looped(product, 16).lower(jnp.int32(2), a, b).compile().as_text()
  body = timing.loop_body_lines(hlo, follow_calls=False)
  assert _gemms(body) == 16
  copies = [l for l in body if " copy(" in l or "copy-start" in l]
  operand_types = {f"bf16[{','.join(map(str, s))}]" for s in (a_shape, b_shape)}
  assert not [l for l in copies if any(t in l for t in operand_types)], copies


def test_bench_infer_loop_keeps_its_step_an_iteration():
  a, b = _operands(*SHAPES[0])
  product = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)
  hlo = timing.repeat_in_loop(product, 5, unroll=1, touch=(1,)).lower(a, b).compile().as_text()
  assert _gemms(timing.loop_body_lines(hlo, follow_calls=False)) == 1
