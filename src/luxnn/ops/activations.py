"""Activation functions and the softmax family: primitives outside the array API.

Each works on NumPy and CuPy arrays and on traced values, and states its VJP beside its
forward; the kernels are the device's (`luxnn.ops.traits`: the areas "activations" and
"softmax"). The forms are the numerically stable ones (no overflow for
large |x|).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ..ad.primitives import tanh
from ..ad.tape import primitive
from .traits import Area

__all__ = [
    "relu", "leaky_relu", "elu", "sigmoid", "silu", "swish", "softplus", "gelu",
    "logsumexp", "softmax", "log_softmax", "fused_name",
]  # fmt: skip

_ACTIVATIONS = Area("activations")
_SOFTMAX = Area("softmax")


def _kernels(x):
    return _ACTIVATIONS[type(x)]


def _softmax_kernels(x):
    return _SOFTMAX[type(x)]


def _activation(kernel: str, x, *params):
    """``(y, vjp)`` of the device's activation `kernel` of `x` with `params`."""
    impl = _kernels(x)
    y, residual = getattr(impl, kernel)(x, *params)
    grad = getattr(impl, kernel + "_grad")
    return y, lambda g, needs: (grad(g, residual, *params),)


@primitive
def relu(x):
    """max(x, 0); the derivative at 0 is 0, as in PyTorch.

    >>> import numpy as np
    >>> relu(np.array([-1.0, 2.0])).tolist()
    [0.0, 2.0]
    """
    return _activation("relu", x)


@primitive
def leaky_relu(x, negative_slope=0.01):
    """x where x > 0, else ``negative_slope * x``."""
    return _activation("leaky_relu", x, negative_slope)


@primitive
def elu(x, alpha=1.0):
    """x where x > 0, else ``alpha * (exp(x) - 1)``."""
    return _activation("elu", x, alpha)


@primitive
def sigmoid(x):
    """1 / (1 + exp(-x)), without overflow for large |x|."""
    return _activation("sigmoid", x)


@primitive
def silu(x):
    """x * sigmoid(x), also called swish."""
    return _activation("silu", x)


swish = silu


@primitive
def softplus(x):
    """log(1 + exp(x)), computed as log1p(exp(-|x|)) + max(x, 0)."""
    return _activation("softplus", x)


_GELU_KERNELS = {"tanh": "gelu_tanh", "none": "gelu_erf"}


@primitive
def gelu(x, approximate="tanh"):
    """GELU. ``approximate="tanh"`` (the default, as in Flax) or ``"none"`` (exact, erf)."""
    if approximate not in _GELU_KERNELS:
        raise ValueError(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _activation(_GELU_KERNELS[approximate], x)


def fused_name(activation: Callable[[Any], Any] | None) -> str | None:
    """The name of `activation`'s kernels in the activations area (each device's module
    has ``name(x)`` and ``name_grad(g, residual)``), for the layers that fuse it into
    their own kernels: luxnn's activations with their default parameters, ``tanh`` of
    the array API included; None for any other callable.

    >>> fused_name(gelu), fused_name(print)
    ('gelu_tanh', None)
    """
    try:
        return _FUSED.get(activation)
    except TypeError:  # an unhashable callable is none of them
        return None


_FUSED = {relu: "relu", leaky_relu: "leaky_relu", elu: "elu", sigmoid: "sigmoid", silu: "silu", softplus: "softplus",
          gelu: "gelu_tanh", tanh: "tanh"}


@primitive
def logsumexp(x, axis=-1, keepdims=False):
    """log(sum(exp(x), axis)) without overflow."""
    impl = _softmax_kernels(x)
    y = impl.logsumexp(x, axis)

    def vjp(g, needs):
        if not keepdims:
            g = g.reshape(y.shape)  # also for axis=None or a tuple, which expand_dims rejects
        return (impl.logsumexp_grad(g, x, y),)

    return (y if keepdims else np.squeeze(y, axis=axis)), vjp


@primitive
def softmax(x, axis=-1):
    """exp(x) / sum(exp(x), axis), computed from x - max(x).

    >>> import numpy as np
    >>> softmax(np.zeros((1, 4))).tolist()
    [[0.25, 0.25, 0.25, 0.25]]
    """
    impl = _softmax_kernels(x)
    y = impl.softmax(x, axis)
    return y, lambda g, needs: (impl.softmax_grad(g, y, axis),)


@primitive
def log_softmax(x, axis=-1):
    """x - logsumexp(x, axis), computed from x - max(x)."""
    impl = _softmax_kernels(x)
    y = impl.log_softmax(x, axis)
    return y, lambda g, needs: (impl.log_softmax_grad(g, y, axis),)
