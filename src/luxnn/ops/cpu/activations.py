"""The activations on NumPy arrays.

Each activation ``f(x, *params)`` returns ``(y, residual)``, the residual being what its
gradient ``f_grad(g, residual, *params)`` needs (the fewest arrays: a boolean mask rather
than x where that suffices). These are also the NumPy twins of the CUDA kernels
(ops/cuda/activations.py).
"""

from __future__ import annotations

import math

import numpy as np

from ...parallel import for_blocks

__all__ = [
    "relu", "relu_grad", "leaky_relu", "leaky_relu_grad", "elu", "elu_grad", "sigmoid", "sigmoid_grad",
    "tanh", "tanh_grad", "silu", "silu_grad", "softplus", "softplus_grad", "gelu_tanh", "gelu_tanh_grad",
    "gelu_erf", "gelu_erf_grad",
]  # fmt: skip

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
INV_SQRT_2 = 1.0 / math.sqrt(2.0)
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
GELU_CUBIC = 0.044715


def relu(x):
    y = np.maximum(x, 0)
    return y, y


def relu_grad(g, residual):
    y = residual
    return g * (y > 0)


def leaky_relu(x, negative_slope=0.01):
    positive = x > 0
    return np.where(positive, x, x * negative_slope), positive


def leaky_relu_grad(g, residual, negative_slope=0.01):
    positive = residual
    return np.where(positive, g, g * negative_slope)


def elu(x, alpha=1.0):
    positive = x > 0  # a boolean mask is all the gradient needs of x
    negative_part = alpha * np.expm1(np.minimum(x, 0))
    return np.where(positive, x, negative_part), (positive, negative_part)


def elu_grad(g, residual, alpha=1.0):
    positive, negative_part = residual
    return np.where(positive, g, g * (negative_part + alpha))


def _sigmoid(x):
    # exp of a non-positive number never overflows.
    e = np.exp(-np.abs(x))
    return np.where(x >= 0, 1, e) / (1 + e)


def sigmoid(x):
    y = _sigmoid(x)
    return y, y


def sigmoid_grad(g, residual):
    y = residual
    return g * y * (1 - y)


def tanh(x):
    y = np.tanh(x)
    return y, y


def tanh_grad(g, residual):
    y = residual
    return g * (1 - y * y)


def silu(x):
    s = _sigmoid(x)
    return x * s, (x, s)


def silu_grad(g, residual):
    x, s = residual
    return g * s * (1 + x * (1 - s))


def softplus(x):
    return np.log1p(np.exp(-np.abs(x))) + np.maximum(x, 0), x


def softplus_grad(g, residual):
    x = residual
    return g * _sigmoid(x)


def gelu_tanh(x):
    # In-place passes over one block of a temporary at a time: the passes find the block in
    # the cache, and the blocks run on all cores (for_blocks).
    x = np.ascontiguousarray(x)
    flat_x = x.reshape(-1)
    t = np.empty_like(flat_x)  # tanh(sqrt(2/pi) * (x + 0.044715 x^3)), kept for the gradient
    y = np.empty_like(flat_x)

    def forward(lo, hi):
        xb, tb, yb = flat_x[lo:hi], t[lo:hi], y[lo:hi]
        np.multiply(xb, xb, out=tb)
        tb *= GELU_CUBIC
        tb += 1
        tb *= xb
        tb *= SQRT_2_OVER_PI
        np.tanh(tb, out=tb)
        np.add(tb, 1, out=yb)
        yb *= xb
        yb *= 0.5

    for_blocks(forward, flat_x)
    return y.reshape(x.shape), (flat_x, t)


def gelu_tanh_grad(g, residual):
    # d/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2)
    flat_x, t = residual
    flat_g = np.ascontiguousarray(g).reshape(-1)
    dx = np.empty_like(flat_g)

    def backward(lo, hi):
        xb, tb, d = flat_x[lo:hi], t[lo:hi], dx[lo:hi]
        np.multiply(xb, xb, out=d)
        d *= 3 * GELU_CUBIC
        d += 1
        d *= xb
        d *= 0.5 * SQRT_2_OVER_PI
        one_minus_t2 = tb * tb
        np.subtract(1, one_minus_t2, out=one_minus_t2)
        d *= one_minus_t2
        d += 0.5
        half_t = np.multiply(tb, 0.5, out=one_minus_t2)  # the block's temporary again
        d += half_t
        d *= flat_g[lo:hi]

    for_blocks(backward, flat_g)
    return dx.reshape(g.shape)


def gelu_erf(x):
    from scipy.special import erf

    cdf = 0.5 * (1 + erf(x * INV_SQRT_2))
    return x * cdf, (x, cdf)


def gelu_erf_grad(g, residual):
    x, cdf = residual
    return g * (cdf + x * np.exp(-0.5 * x * x) * INV_SQRT_2PI)

