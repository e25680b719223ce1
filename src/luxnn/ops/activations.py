"""Activation functions and fused softmax family: primitives outside the array API.

Each works on NumPy and CuPy arrays and on traced values, and states its VJP beside its
forward. The forms are the numerically stable ones (no overflow for large |x|).
"""

from __future__ import annotations

import math

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from ..parallel import for_blocks

__all__ = [
    "relu", "leaky_relu", "elu", "sigmoid", "silu", "swish", "softplus", "gelu",
    "logsumexp", "softmax", "log_softmax",
]  # fmt: skip

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


@primitive
def relu(x):
    """max(x, 0); the derivative at 0 is 0, as in PyTorch."""
    y = np.maximum(x, 0)
    return y, lambda g, needs: (g * (y > 0),)


@primitive
def leaky_relu(x, negative_slope=0.01):
    positive = x > 0
    return np.where(positive, x, x * negative_slope), lambda g, needs: (np.where(positive, g, g * negative_slope),)


@primitive
def elu(x, alpha=1.0):
    positive = x > 0  # saved instead of x: a boolean mask is all the VJP needs
    negative_part = alpha * np.expm1(np.minimum(x, 0))
    y = np.where(positive, x, negative_part)
    return y, lambda g, needs: (np.where(positive, g, g * (negative_part + alpha)),)


def _sigmoid(x):
    # exp of a non-positive number never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1, e) / (1 + e)


@primitive
def sigmoid(x):
    y = _sigmoid(x)
    return y, lambda g, needs: (g * y * (1 - y),)


@primitive
def silu(x):
    """x * sigmoid(x), also called swish."""
    s = _sigmoid(x)
    return x * s, lambda g, needs: (g * s * (1 + x * (1 - s)),)


swish = silu


@primitive
def softplus(x):
    """log(1 + exp(x)), computed as log1p(exp(-|x|)) + max(x, 0)."""
    y = np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0)
    return y, lambda g, needs: (g * _sigmoid(x),)


def _erf(x):
    xp = module_of(x)
    if xp is np:
        from scipy.special import erf
    else:
        from cupyx.scipy.special import erf
    return erf(x)


@primitive
def gelu(x, approximate="tanh"):
    """GELU. ``approximate="tanh"`` (the default, as in Flax) or ``"none"`` (exact, erf)."""
    if approximate == "tanh":
        # In-place passes over one block of a temporary at a time: the passes find the block
        # in the cache, and the blocks run on all cores (for_blocks).
        xp = module_of(x)
        x = xp.ascontiguousarray(x)
        flat_x = x.reshape(-1)
        t = xp.empty_like(flat_x)  # tanh(sqrt(2/pi) * (x + 0.044715 x^3)), kept for the VJP
        y = xp.empty_like(flat_x)

        def forward(lo, hi):
            xb, tb, yb = flat_x[lo:hi], t[lo:hi], y[lo:hi]
            np.multiply(xb, xb, out=tb)
            tb *= 0.044715
            tb += 1
            tb *= xb
            tb *= _SQRT_2_OVER_PI
            np.tanh(tb, out=tb)
            np.add(tb, 1, out=yb)
            yb *= xb
            yb *= 0.5

        for_blocks(forward, flat_x)

        def vjp(g, needs):
            # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
            flat_g = module_of(g).ascontiguousarray(g).reshape(-1)
            dx = module_of(g).empty_like(flat_g)

            def backward(lo, hi):
                xb, tb, d = flat_x[lo:hi], t[lo:hi], dx[lo:hi]
                np.multiply(xb, xb, out=d)
                d *= 3 * 0.044715
                d += 1
                d *= xb
                d *= 0.5 * _SQRT_2_OVER_PI
                one_minus_t2 = tb * tb
                np.subtract(1, one_minus_t2, out=one_minus_t2)
                d *= one_minus_t2
                d += 0.5
                half_t = np.multiply(tb, 0.5, out=one_minus_t2)  # the block's temporary again
                d += half_t
                d *= flat_g[lo:hi]

            for_blocks(backward, flat_g)
            return (dx.reshape(x.shape),)

        return y.reshape(x.shape), vjp
    if approximate == "none":
        cdf = 0.5 * (1 + _erf(x * _INV_SQRT_2))
        return x * cdf, lambda g, needs: (g * (cdf + x * np.exp(-0.5 * x * x) * _INV_SQRT_2PI),)
    raise ValueError(f"gelu: approximate must be 'tanh' or 'none', got {approximate!r}")


@primitive
def logsumexp(x, axis=-1, keepdims=False):
    """log(sum(exp(x), axis)) without overflow."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    y = np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m

    def vjp(g, needs):
        if not keepdims:
            g = g.reshape(y.shape)  # also for axis=None or a tuple, which expand_dims rejects
        return (g * np.exp(x - y),)

    return (y if keepdims else np.squeeze(y, axis=axis)), vjp


@primitive
def softmax(x, axis=-1):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    y = e / np.sum(e, axis=axis, keepdims=True)
    return y, lambda g, needs: (y * (g - np.sum(g * y, axis=axis, keepdims=True)),)


@primitive
def log_softmax(x, axis=-1):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    y = shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))
    return y, lambda g, needs: (g - np.exp(y) * np.sum(g, axis=axis, keepdims=True),)
