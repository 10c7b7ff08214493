"""The timing chains and loops on the GPU (run on the GPU host: python3 -m pytest tests/gpu -m gpu):
XLA keeps every timed call of a pure product, and updates the operands in place (no copies
of them). On the H200 in 2026-11, 16 unrolled calls through optimization barriers ran as
one, and reading an operand's own first element made XLA copy it twice an iteration."""
import re

import jax
import jax.numpy as jnp
import pytest

from loka_jax import timing

SHAPES = [((2048, 1024), (1024, 1024)), ((16384, 4096), (4096, 4096))]


def _gemms(lines):
  """GEMM instructions: cuBLAS custom calls and XLA's Triton GEMM fusions (by their name)."""
  count = 0
  for line in lines:
    head = re.match(r"\s*(?:ROOT )?%(\S+) = ", line)
    if not head:
      continue
    cublas = " custom-call(" in line and "__cublas" in line
    triton = " fusion(" in line and "kind=kCustom" in line and "gemm" in head.group(1)
    count += cublas or triton
  return count


def _operands(a_shape, b_shape):
  ka, kb = jax.random.split(jax.random.PRNGKey(0))
  return (timing.random_normal(ka, a_shape, jnp.bfloat16),
          timing.random_normal(kb, b_shape, jnp.bfloat16))


@pytest.mark.parametrize("a_shape,b_shape", SHAPES)
def test_a_chain_keeps_16_gemms_without_copying_the_operands(a_shape, b_shape):
  a, b = _operands(a_shape, b_shape)
  product = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)
  hlo = timing.chain(product, 16).lower(a, b).compile().as_text()
  lines = hlo.splitlines()
  assert _gemms(lines) == 16
  operand_types = {f"bf16[{','.join(map(str, s))}]" for s in (a_shape, b_shape)}
  copies = [l for l in lines if (" copy(" in l or "copy-start" in l)
            and any(f"= {t}" in l for t in operand_types)]
  assert len(copies) <= 2, copies  # at most once each, on entry (the parameters are not donated)


def test_bench_infer_loop_keeps_its_step_an_iteration():
  a, b = _operands(*SHAPES[0])
  product = lambda x, y: jnp.dot(x, y, preferred_element_type=jnp.bfloat16)
  hlo = timing.repeat_in_loop(product, 5, unroll=1, touch=(1,)).lower(a, b).compile().as_text()
  assert _gemms(timing.loop_body_lines(hlo, follow_calls=False)) == 1
