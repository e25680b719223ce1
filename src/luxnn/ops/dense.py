"""The dense layer's kernel: ``x @ w + b`` with an optional fused relu, as one primitive.

One GEMM over the flattened leading axes, the bias added and the relu applied in place on
the GEMM's output, and a VJP that needs no separate nodes for the add and the activation.
"""

from __future__ import annotations

from ..ad.primitives import rows_times_matrix
from ..ad.tape import primitive


@primitive
def dense(x, w, b, *, relu=False):
    """``x @ w + b`` (``b`` may be None), then ``max(., 0)`` if `relu`.

    Shapes: x ``(..., k)``, w ``(k, m)``, b ``(m,)`` -> ``(..., m)``.

    >>> import numpy as np
    >>> dense(np.ones((2, 3)), np.ones((3, 4)), np.full(4, -4.0), relu=True).tolist()
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    return rows_times_matrix(x, w, b, relu)
