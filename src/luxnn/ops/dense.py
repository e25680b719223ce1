"""The dense layer's kernel: ``activation(x @ w + b)`` as one primitive.

One GEMM over the flattened leading axes, then the bias and the activation in one pass
over its output (in place where the activation allows), and a VJP that needs no separate
nodes for the add and the activation: the activation's gradient in one pass, the bias's
one reduction, then one GEMM per cotangent. The passes are the device's (`luxnn.ops.traits`:
the area "dense").
"""

from __future__ import annotations

from typing import Any, Callable

from ..ad.primitives import rows_times_matrix
from ..ad.tape import primitive
from ..backend import module_of
from .activations import fused_name
from .traits import implementation

__all__ = ["dense"]


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
        return activation(_dense(x, w, b, activation=None))
    return _dense(x, w, b, activation=name)


@primitive
def _dense(x, w, b, *, activation=None):
    """`dense` with `activation` the name of an activation's kernels, or None."""
    y, gemm_vjp = rows_times_matrix(x, w)
    m = w.shape[1]
    impl = implementation("dense", module_of(y))
    out, residual = impl.bias_activation(y.reshape(-1, m), b, activation)

    def vjp(g, needs):
        g_rows = g.reshape(-1, m)
        if activation is not None:
            g_rows = impl.activation_grad(g_rows, residual, activation)
        gx, gw = gemm_vjp(g_rows, needs)
        gb = impl.bias_grad(g_rows) if b is not None and needs[2] else None
        return gx, gw, gb

    return out.reshape(y.shape), vjp
