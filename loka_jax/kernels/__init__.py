"""Kernel interface, registry and the XLA / Flax kernels (Pallas ones: kernels_pallas/)."""
from loka_jax.kernels import flax_delayed as _flax_delayed  # registers flax_fp8_delayed
from loka_jax.kernels import xla as _xla  # registers the XLA kernels
from loka_jax.kernels.base import (FUSED_OP, PER_PASS, Kernel, check_operands, dot_einsum,
                                   reference_einsum)
from loka_jax.kernels.choice import KernelChoice, KernelPlan
from loka_jax.kernels.flax_delayed import FP8_META
from loka_jax.kernels.registry import all_kernels, get, names, register
from loka_jax.kernels.site_product import per_pass_product, validate_choice
from loka_jax.kernels.spec import (ACT_ACT, ACT_WEIGHT, KINDS, PASSES, EinsumSpec, check_kind,
                                   check_pass, operand_roles)
