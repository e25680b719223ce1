"""Attention's fused kernels: per-head scores, scale -> mask -> softmax, per-head weighted sum."""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from ..parallel import for_blocks, matmul

__all__ = ["masked_softmax", "attention_scores", "attention_combine"]


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


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
    if not scale > 0:
        raise ValueError(f"masked_softmax: scale must be positive, got {scale!r}")
    xp = module_of(scores)
    allowed = mask
    if is_causal:
        past = xp.tril(xp.ones(scores.shape[-2:], bool))
        allowed = past if allowed is None else np.logical_and(allowed, past)
    if allowed is not None:
        if not _broadcasts_to(allowed.shape, scores.shape):
            raise ValueError(f"masked_softmax: mask of shape {allowed.shape} does not broadcast to the scores' {scores.shape}")
        allowed = xp.broadcast_to(allowed, scores.shape)  # a view, cut into blocks with the scores
    scores = xp.ascontiguousarray(scores)
    w = xp.empty_like(scores)

    def forward(lo, hi):
        # softmax(scale * s) = exp(scale * (s - max s)) / sum(...) for scale > 0.
        wb = w[lo:hi]
        if allowed is None:
            np.subtract(scores[lo:hi], np.max(scores[lo:hi], axis=-1, keepdims=True), out=wb)
        else:
            np.copyto(wb, scores[lo:hi])
            np.copyto(wb, -np.inf, where=~allowed[lo:hi])
            row_max = np.max(wb, axis=-1, keepdims=True)
            np.copyto(row_max, 0, where=np.isinf(row_max))  # fully masked rows: exp(-inf - 0) = 0
            wb -= row_max
        if scale != 1.0:
            wb *= scale
        np.exp(wb, out=wb)
        total = np.sum(wb, axis=-1, keepdims=True)
        if allowed is not None:
            np.copyto(total, 1, where=total == 0)
        wb *= 1.0 / total

    for_blocks(forward, w)

    def vjp(g, needs):
        g = module_of(g).ascontiguousarray(g)
        gs = module_of(g).empty_like(g)

        def backward(lo, hi):
            # einsum forms sum(g * w) per row without a full-size temporary.
            gb, wb, out = g[lo:hi], w[lo:hi], gs[lo:hi]
            np.subtract(gb, np.einsum("...k,...k->...", gb, wb)[..., None], out=out)
            out *= wb
            if scale != 1.0:
                out *= scale

        for_blocks(backward, gs)
        return (gs,)

    return w, vjp


# The two products of attention work on heads split out of (batch, seq, heads * head_dim)
# arrays. Every batched GEMM below multiplies C-contiguous operands without transposition:
# measured on OpenBLAS 0.3.31 with 2 threads, (256 x 128 x 32) @ (256 x 32 x 128) took
# 10-18 ms that way and 125-700 ms with either operand a transposed view. The transposed
# copies this needs are of the (seq, head_dim) operands, 4x smaller than the scores here.


def _split_heads(x, num_heads, transpose=False, scale=1.0):
    """(batch, seq, heads * d) -> a new contiguous (batch, heads, seq, d), or (batch, heads,
    d, seq) with `transpose`, times `scale`."""
    batch, seq, dim = x.shape
    split = x.reshape(batch, seq, num_heads, dim // num_heads).transpose((0, 2, 3, 1) if transpose else (0, 2, 1, 3))
    if scale == 1.0:
        return np.ascontiguousarray(split)
    # A new array in any case: with one head, ascontiguousarray would return x itself.
    out = module_of(x).empty(split.shape, x.dtype)
    np.multiply(split, scale, out=out)
    return out


def _merge_heads(x, transposed=False):
    """(batch, heads, seq, d), or (batch, heads, d, seq) if `transposed`, -> contiguous
    (batch, seq, heads * d)."""
    merged = x.transpose((0, 3, 1, 2) if transposed else (0, 2, 1, 3))
    return merged.reshape(*merged.shape[:2], -1)


@primitive
def attention_scores(q, k, *, num_heads, scale=1.0):
    """``scale * q_h @ k_h^T`` for each head h: q ``(batch, q_len, heads * d)`` and k
    ``(batch, kv_len, heads * d)`` -> scores ``(batch, heads, q_len, kv_len)``.

    >>> attention_scores(np.ones((1, 2, 4)), np.ones((1, 3, 4)), num_heads=2).shape
    (1, 2, 2, 3)
    """
    scores = matmul(_split_heads(q, num_heads, scale=scale), _split_heads(k, num_heads, transpose=True))

    def vjp(g, needs):
        gq = gk = None
        if needs[0]:
            gq = _merge_heads(matmul(g, _split_heads(k, num_heads, scale=scale)))
        if needs[1]:
            # dk_h^T = (scale q_h)^T @ g, with the transposed q as a contiguous copy.
            gk = _merge_heads(matmul(_split_heads(q, num_heads, transpose=True, scale=scale), g), transposed=True)
        return gq, gk

    return scores, vjp


@primitive
def attention_combine(weights, v, *, num_heads):
    """``weights_h @ v_h`` for each head h, heads merged: weights ``(batch, heads, q_len,
    kv_len)`` and v ``(batch, kv_len, heads * d)`` -> ``(batch, q_len, heads * d)``.

    >>> attention_combine(np.full((1, 2, 3, 5), 0.2), np.ones((1, 5, 4)), num_heads=2).shape
    (1, 3, 4)
    """
    out = _merge_heads(matmul(weights, _split_heads(v, num_heads)))

    def vjp(g, needs):
        gw = gv = None
        if needs[0]:
            gw = matmul(_split_heads(g, num_heads), _split_heads(v, num_heads, transpose=True))
        if needs[1]:
            # dv_h^T = g_h^T @ weights_h, with the transposed g as a contiguous copy.
            gv = _merge_heads(matmul(_split_heads(g, num_heads, transpose=True), weights), transposed=True)
        return gw, gv

    return out, vjp
