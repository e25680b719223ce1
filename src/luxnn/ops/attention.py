"""Attention's fused scale -> mask -> softmax, with its VJP."""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of

__all__ = ["masked_softmax"]


@primitive
def masked_softmax(scores, *, scale=1.0, mask=None, is_causal=False):
    """``softmax(scale * scores)`` over the last axis, where only the keys allowed by
    `mask` take part.

    `scores` is ``(..., q_len, kv_len)``; `mask` a boolean array broadcastable to it, True
    where a query may attend to a key (as in Flax and PyTorch's scaled_dot_product_attention);
    ``is_causal=True`` also hides key j from query i when j > i (top-left aligned, as
    PyTorch). A query that may attend to no key gets all-zero weights rather than NaNs.
    Gradient: ``scale * w * (g - sum(g * w))``. One working array, updated in place.

    >>> masked_softmax(np.zeros((2, 2)), is_causal=True).tolist()
    [[1.0, 0.0], [0.5, 0.5]]
    """
    w = scores * scale if scale != 1.0 else scores.copy()
    masked = mask is not None or is_causal
    if mask is not None:
        np.copyto(w, -np.inf, where=np.logical_not(mask))
    if is_causal:
        q_len, kv_len = w.shape[-2:]
        future = module_of(w).triu(module_of(w).ones((q_len, kv_len), bool), 1)
        np.copyto(w, -np.inf, where=future)
    row_max = np.max(w, axis=-1, keepdims=True)
    if masked:
        np.copyto(row_max, 0, where=np.isinf(row_max))  # fully masked rows: exp(-inf - 0) = 0
    w -= row_max
    np.exp(w, out=w)
    total = np.sum(w, axis=-1, keepdims=True)
    if masked:
        np.copyto(total, 1, where=total == 0)
    w *= 1.0 / total

    def vjp(g, needs):
        # einsum forms sum(g * w) per row without a full-size temporary.
        gs = g - np.einsum("...k,...k->...", g, w)[..., None]
        gs *= w
        if scale != 1.0:
            gs *= scale
        return (gs,)

    return w, vjp
