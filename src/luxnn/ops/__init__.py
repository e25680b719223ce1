"""Kernels outside the array API; each works on NumPy, CuPy and traced values."""

from . import cpu  # noqa: F401  (the CPU's implementations load with the package)

from .activations import (
    elu, fused_name, gelu, leaky_relu, log_softmax, logsumexp, relu, sigmoid, silu, softmax, softplus, swish,
)  # fmt: skip
from .attention import attention_combine, attention_weights, masked_softmax
from .conv import conv, conv_transpose
from .cross_entropy import nll_loss, softmax_cross_entropy
from .dense import dense, fused_dense
from .embedding import lookup_rows
from .norm import moments, normalize, normalize_affine, rms_normalize, scale_shift
from .pool import avg_pool, max_pool

__all__ = [
    "elu", "gelu", "leaky_relu", "log_softmax", "logsumexp", "relu", "sigmoid", "silu", "softmax",
    "softplus", "swish", "masked_softmax", "attention_weights", "attention_combine", "conv",
    "conv_transpose", "softmax_cross_entropy", "nll_loss", "dense", "fused_dense", "fused_name", "lookup_rows",
    "moments", "normalize", "normalize_affine", "rms_normalize", "scale_shift", "avg_pool", "max_pool",
]  # fmt: skip
