"""Which backend a compiled product really got, read from the optimized HLO text."""
from __future__ import annotations

import re

# Ordered: the first pattern found names the backend.
_PATTERNS = (
    ("pallas_mosaic_gpu", re.compile(r"mosaic_gpu")),
    ("pallas_triton", re.compile(r"__gpu\$xla\.gpu\.triton|triton_kernel_call|pallas")),
    ("cublaslt_fp8", re.compile(r"__cublas\$lt\$matmul\$f8")),
    ("xla_triton_gemm", re.compile(r'"kind":"__triton_gemm"|kind=__triton_gemm|__triton_gemm')),
    ("cublaslt", re.compile(r"__cublas\$lt\$matmul")),
    ("cublas", re.compile(r"__cublas\$gemm")),
    ("xla_triton", re.compile(r"__triton")),
)


def backend_from_hlo(hlo_text: str, platform: str) -> str:
  if platform == "cpu":
    return "xla_cpu"
  for name, pattern in _PATTERNS:
    if pattern.search(hlo_text):
      return name
  return f"xla_{platform}_other"


def compiled_backend(fn, *args) -> str:
  """Compiles jit(fn)(*args) and names the GEMM backend in its optimized HLO."""
  import jax
  compiled = jax.jit(fn).lower(*args).compile()
  return backend_from_hlo(compiled.as_text(), jax.default_backend())
