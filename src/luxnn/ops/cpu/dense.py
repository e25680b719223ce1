"""The dense layer's passes after its GEMM on NumPy arrays: the bias (and a relu) added in
place block by block on all cores, any other activation by the CPU's own
(ops/cpu/activations.py)."""

from __future__ import annotations

import numpy as np

from ...parallel import for_blocks
from . import activations

__all__ = ["bias_activation", "activation_grad", "bias_grad"]


def bias_activation(y, b, activation):
    """``(activation(y + b), residual)`` of the GEMM's fresh output `y` ``(rows, m)``
    (updated in place) and `b` ``(m,)`` or None; `activation` a kernel name or None."""
    relu = activation == "relu"

    def finish(lo, hi):
        block = y[lo:hi]  # one view (``y[lo:hi] += b`` would also assign it back)
        if b is not None:
            block += b
        if relu:
            np.maximum(block, 0, out=block)

    if b is not None or relu:
        for_blocks(finish, y)
    if activation is None or relu:
        return y, y
    return getattr(activations, activation)(y)


def activation_grad(g, residual, activation):
    """The cotangent of ``y + b`` from that of the activation's output `g` ``(rows, m)``."""
    if activation == "relu":
        masked = np.empty(g.shape, g.dtype)
        for_blocks(lambda lo, hi: np.multiply(g[lo:hi], residual[lo:hi] > 0, out=masked[lo:hi]), masked)
        return masked
    return getattr(activations, f"{activation}_grad")(g, residual)


def bias_grad(g):
    """The bias's cotangent: `g` ``(rows, m)`` summed over its rows."""
    return g.sum(axis=0)
