"""Attention's fused kernels: the weights (per-head scores, scale, mask and softmax), the
per-head weighted sum, and the masked softmax on its own; the kernels are the device's
(`luxnn.ops.traits`: the areas "attention" and "softmax")."""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from .traits import Area

__all__ = ["masked_softmax", "attention_weights", "attention_combine"]

_ATTENTION = Area("attention")
_SOFTMAX = Area("softmax")


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _check_mask(mask, is_causal, shape, who):
    """Refuses a mask that is not boolean or does not broadcast to the scores' `shape`."""
    if mask is not None and mask.dtype != bool:
        raise ValueError(f"{who}: expected a boolean mask, got dtype {mask.dtype}")
    if is_causal and len(shape) < 2:
        raise ValueError(f"{who}: is_causal needs scores of shape (..., q_len, kv_len), got {shape}")
    if mask is not None and not _broadcasts_to(mask.shape, shape):
        raise ValueError(f"{who}: mask of shape {mask.shape} does not broadcast to the scores' {shape}")


@primitive
def masked_softmax(scores, *, scale=1.0, mask=None, is_causal=False):
    """``softmax(scale * scores)`` over the last axis, where only the keys allowed by
    `mask` take part.

    `scores` is ``(..., q_len, kv_len)``; `mask` a boolean array broadcastable to it, True
    where a query may attend to a key (as in Flax and PyTorch's scaled_dot_product_attention);
    ``is_causal=True`` also hides key j from query i when j > i (top-left aligned, as
    PyTorch). A query that may attend to no key gets all-zero weights rather than NaNs.
    Gradient: ``scale * w * (g - sum(g * w))``.

    >>> masked_softmax(np.zeros((2, 2)), is_causal=True).tolist()
    [[1.0, 0.0], [0.5, 0.5]]
    """
    if not scale > 0:
        raise ValueError(f"masked_softmax: scale must be positive, got {scale!r}")
    if not scores.shape:
        raise ValueError("masked_softmax: expected scores of shape (..., kv_len), got a 0-d array")
    _check_mask(mask, is_causal, scores.shape, "masked_softmax")
    impl = _SOFTMAX[type(scores)]
    w = impl.masked_softmax(scores, scale, mask, is_causal)
    return w, lambda g, needs: (impl.masked_softmax_grad(g, w, scale),)


def _check_heads(who, q, k, num_heads):
    if len(q.shape) != 3 or len(k.shape) != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % num_heads:
        raise ValueError(
            f"{who}: expected q (batch, q_len, {num_heads} * d) and k (batch, kv_len, {num_heads} * d), got shapes {q.shape} and {k.shape}"
        )


@primitive
def attention_weights(q, k, *, num_heads, scale=1.0, mask=None, is_causal=False):
    """``softmax(scale * q_h @ k_h^T)`` for each head h, over the keys that `mask` and
    `is_causal` allow (as `masked_softmax`): q ``(batch, q_len, heads * d)`` and k
    ``(batch, kv_len, heads * d)`` -> weights ``(batch, heads, q_len, kv_len)``.

    Gradient: the softmax's, then two products per head.

    >>> w = attention_weights(np.ones((1, 2, 4)), np.ones((1, 3, 4)), num_heads=2)
    >>> w.shape, w.sum(-1).tolist()
    ((1, 2, 2, 3), [[[1.0, 1.0], [1.0, 1.0]]])
    """
    if not scale > 0:
        raise ValueError(f"attention_weights: scale must be positive, got {scale!r}")
    _check_heads("attention_weights", q, k, num_heads)
    _check_mask(mask, is_causal, (q.shape[0], num_heads, q.shape[1], k.shape[1]), "attention_weights")
    impl = _ATTENTION[type(q)]
    w, residual = impl.attention_weights(q, k, num_heads, scale, mask, is_causal)
    return w, lambda g, needs: impl.attention_weights_grad(g, residual, needs)


@primitive
def attention_combine(weights, v, *, num_heads):
    """``weights_h @ v_h`` for each head h, heads merged: weights ``(batch, heads, q_len,
    kv_len)`` and v ``(batch, kv_len, heads * d)`` -> ``(batch, q_len, heads * d)``.

    >>> attention_combine(np.full((1, 2, 3, 5), 0.2), np.ones((1, 5, 4)), num_heads=2).shape
    (1, 3, 4)
    """
    w_shape, v_shape = weights.shape, v.shape
    fits = len(w_shape) == 4 and len(v_shape) == 3 and w_shape[1] == num_heads
    if not fits or (w_shape[0], w_shape[3]) != v_shape[:2] or v_shape[2] % num_heads:
        raise ValueError(
            f"attention_combine: expected weights (batch, {num_heads}, q_len, kv_len) and v (batch, kv_len, {num_heads} * d), "
            f"got shapes {w_shape} and {v_shape}"
        )
    impl = _ATTENTION[type(v)]
    out, residual = impl.attention_combine(weights, v, num_heads)
    return out, lambda g, needs: impl.attention_combine_grad(g, residual, needs)
