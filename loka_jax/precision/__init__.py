"""FP8 formats, dtype policies, scaling recipes and QTensor."""
from loka_jax.precision.formats import E4M3, E5M2, FORMATS, FP8Format, get_format
from loka_jax.precision.policy import BF16, FP32, DtypePolicy
from loka_jax.precision.qtensor import (BLOCK, BLOCK_1x128, BLOCK_128x128, GRANULARITIES,
                                        ROWWISE, TENSORWISE, QTensor)
from loka_jax.precision.scaling import (compute_amax, delayed_scale, dequantize, finite_abs,
                                        flush_fractions, init_amax_history, quantize,
                                        quantize_dequantize, quantize_with_scale,
                                        scale_from_amax, update_amax_history)
