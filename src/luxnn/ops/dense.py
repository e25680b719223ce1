"""The dense layer's kernel: ``activation(x @ w + b)`` as one primitive.

One GEMM over the flattened leading axes, then the bias and the activation in one pass
over its output (in place where the activation allows), and a VJP that needs no separate
nodes for the add and the activation: the activation's gradient in one pass, the bias's
one reduction, then one GEMM per cotangent. Both passes are the device's
(`luxnn.ops.traits`: the area "dense", ``forward`` and ``backward``).
"""

from __future__ import annotations

from typing import Any, Callable

from ..ad.tape import primitive
from .activations import fused_name
from .traits import Area

__all__ = ["dense", "fused_dense"]

_DENSE = Area("dense")


def dense(x, w, b, *, activation: Callable[[Any], Any] | None = None):
    """``activation(x @ w + b)`` (``b`` and `activation` may be None); luxnn's activations
    (`luxnn.ops.activations.fused_name`) run fused with the bias, any other callable after.

    Shapes: x ``(..., k)``, w ``(k, m)``, b ``(m,)`` -> ``(..., m)``.

    >>> import numpy as np
    >>> from luxnn import ops
    >>> dense(np.ones((2, 3)), np.ones((3, 4)), np.full(4, -4.0), activation=ops.relu).tolist()
    [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    """
    name = fused_name(activation)
    if activation is not None and name is None:
        return activation(fused_dense(x, w, b, activation=None))
    return fused_dense(x, w, b, activation=name)


@primitive
def fused_dense(x, w, b, *, activation: str | None = None):
    """`dense` with `activation` the name of an activation's kernels (`fused_name`), or
    None: what a layer that resolved its activation once calls.

    >>> import numpy as np
    >>> fused_dense(np.ones((2, 3)), np.ones((3, 4)), None, activation="relu").shape
    (2, 4)
    """
    k, m = w.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)
    impl = _DENSE[type(rows)]
    out, residual = impl.forward(rows, w, b, activation)

    def vjp(g, needs):
        gx, gw, gb = impl.backward(g.reshape(-1, m), rows, w, residual, activation, needs[0], needs[1],
                                   b is not None and needs[2])
        return None if gx is None else gx.reshape(*lead, k), gw, gb

    return out.reshape(*lead, m), vjp
