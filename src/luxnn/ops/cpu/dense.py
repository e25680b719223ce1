"""The dense layer on NumPy arrays: luxnn's GEMM (`luxnn.parallel.matmul`), the bias (and
a relu) added in place block by block on all cores, any other activation by the CPU's own
(ops/cpu/activations.py)."""

from __future__ import annotations

import numpy as np

from ...parallel import for_blocks, matmul
from . import activations

__all__ = ["forward", "backward"]


def forward(rows, w, b, activation):
    """``(activation(rows @ w + b), residual)`` for rows ``(n, k)``, w ``(k, m)``, b
    ``(m,)`` or None; `activation` a kernel name or None."""
    y = matmul(rows, w)
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


def backward(g, rows, w, residual, activation, need_x, need_w, need_b):
    """``(gx_rows, gw, gb)`` from the output's cotangent `g` ``(n, m)`` (None where not
    needed)."""
    if activation == "relu":
        masked = np.empty(g.shape, g.dtype)
        for_blocks(lambda lo, hi: np.multiply(g[lo:hi], residual[lo:hi] > 0, out=masked[lo:hi]), masked)
        g = masked
    elif activation is not None:
        g = getattr(activations, f"{activation}_grad")(g, residual)
    gx = matmul(g, w.T) if need_x else None
    gw = matmul(rows.T, g) if need_w else None
    return gx, gw, g.sum(axis=0) if need_b else None
