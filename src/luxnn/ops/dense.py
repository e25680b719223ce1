"""The dense layer's kernel: ``x @ w + b`` with an optional fused relu, as one primitive.

One GEMM over the flattened leading axes (NumPy would run one per leading index of a
batched input), the bias added and the relu applied in place on the GEMM's output, and a
VJP that needs no separate nodes for the add and the activation.
"""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive


@primitive
def dense(x, w, b, *, relu=False):
    """``x @ w + b`` (``b`` may be None), then ``max(., 0)`` if `relu`.

    Shapes: x ``(..., k)``, w ``(k, m)``, b ``(m,)`` -> ``(..., m)``.

    >>> dense(np.ones((2, 3)), np.ones((3, 4)), np.full(4, -4.0), relu=True).tolist()
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    k, m = w.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    y = rows @ w
    if b is not None:
        y += b
    if relu:
        np.maximum(y, 0, out=y)

    def vjp(g, needs):
        g_rows = g.reshape(-1, m)
        if relu:
            g_rows = g_rows * (y > 0)
        gx = (g_rows @ w.T).reshape(*lead, k) if needs[0] else None
        gw = rows.T @ g_rows if needs[1] else None
        gb = g_rows.sum(axis=0) if needs[2] else None
        return gx, gw, gb

    return y.reshape(*lead, m), vjp
