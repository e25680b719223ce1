"""Attention's fused kernels: the weights (per-head scores, scale, mask and softmax in one
pass over each block), the per-head weighted sum, and the masked softmax on its own."""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of, row_sums
from ..parallel import for_blocks, num_threads, single_threaded_blas

__all__ = ["masked_softmax", "attention_weights", "attention_combine"]


def _broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    try:
        return np.broadcast_shapes(shape, target) == target
    except ValueError:
        return False


def _allowed(mask, is_causal, shape, xp, who):
    """The keys each query may attend to, as a boolean view broadcast to the scores'
    `shape` (cut into blocks with them), or None when every key is allowed."""
    if mask is not None and mask.dtype != bool:
        raise ValueError(f"{who}: expected a boolean mask, got dtype {mask.dtype}")
    allowed = mask
    if is_causal:
        past = xp.tril(xp.ones(shape[-2:], bool))
        allowed = past if allowed is None else np.logical_and(allowed, past)
    if allowed is None:
        return None
    if not _broadcasts_to(allowed.shape, shape):
        raise ValueError(f"{who}: mask of shape {allowed.shape} does not broadcast to the scores' {shape}")
    return xp.broadcast_to(allowed, shape)


def _softmax_rows(scores, w, allowed, scale):
    """``w = softmax(scale * scores)`` over the last axis of a block, in place in `w`, among
    the `allowed` keys (a block of booleans, or None); `scores` may be `w` itself."""
    # softmax(scale * s) = exp(scale * (s - max s)) / sum(...) for scale > 0.
    if allowed is None:
        np.subtract(scores, np.max(scores, axis=-1, keepdims=True), out=w)
    else:
        if scores is not w:
            np.copyto(w, scores)
        np.copyto(w, -np.inf, where=~allowed)
        row_max = np.max(w, axis=-1, keepdims=True)
        np.copyto(row_max, 0, where=np.isinf(row_max))  # fully masked rows: exp(-inf - 0) = 0
        w -= row_max
    if scale != 1.0:
        w *= scale
    np.exp(w, out=w)
    total = row_sums(w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], 1)
    if allowed is not None:
        np.copyto(total, 1, where=total == 0)
    w *= 1.0 / total


def _softmax_grad_rows(g, w, out, scale):
    """``out = scale * w * (g - sum(g * w))`` over the last axis: softmax's VJP."""
    # einsum forms sum(g * w) per row without a full-size temporary.
    np.subtract(g, np.einsum("...k,...k->...", g, w)[..., None], out=out)
    out *= w
    if scale != 1.0:
        out *= scale


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
    allowed = _allowed(mask, is_causal, scores.shape, xp, "masked_softmax")
    scores = xp.ascontiguousarray(scores)
    w = xp.empty_like(scores)
    # blas=True: the rows' sums are BLAS products.
    for_blocks(lambda lo, hi: _softmax_rows(scores[lo:hi], w[lo:hi], None if allowed is None else allowed[lo:hi], scale), w, blas=True)

    def vjp(g, needs):
        g = module_of(g).ascontiguousarray(g)
        gs = module_of(g).empty_like(g)
        for_blocks(lambda lo, hi: _softmax_grad_rows(g[lo:hi], w[lo:hi], gs[lo:hi], scale), gs)
        return (gs,)

    return w, vjp


# The products below multiply per-head matrices that are views into (batch, seq, heads * d)
# arrays (rows of d elements, `heads * d` apart), which the BLAS takes as they are, one
# block of the batch (or of the heads, for a batch smaller than the threads) per thread.
# They run with the BLAS on one thread even when there is a single block: its threads slow
# stacks of small products down, several times over with strided operands. OpenBLAS
# threads a product from 2^18 multiply-adds (its SMP threshold); below that, holding it
# would only cost the calls that set its threads.
_BLAS_THREADS_FROM = 1 << 18


def _heads(x, num_heads):
    """(batch, seq, heads * d) -> a (batch, heads, seq, d) view of a contiguous `x`."""
    batch, seq, dim = x.shape
    return x.reshape(batch, seq, num_heads, dim // num_heads).transpose(0, 2, 1, 3)


def _check_heads(who, q, k, num_heads):
    if len(q.shape) != 3 or len(k.shape) != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or q.shape[2] % num_heads:
        raise ValueError(
            f"{who}: expected q (batch, q_len, {num_heads} * d) and k (batch, kv_len, {num_heads} * d), got shapes {q.shape} and {k.shape}"
        )


def _head_blocks(kernel, weights, head_dim):
    """Call ``kernel(index)`` for blocks of the (batch, heads) pairs of `weights` ``(batch,
    heads, q_len, kv_len)``, on all threads: `index` selects a block of the batch, or of the
    heads of every sequence when the batch is smaller than the threads (one sequence)."""
    by_heads = weights.shape[0] < num_threads()
    like = weights.swapaxes(0, 1) if by_heads else weights
    block = (lambda lo, hi: kernel((slice(None), slice(lo, hi)))) if by_heads else (lambda lo, hi: kernel((slice(lo, hi),)))
    if type(weights) is not np.ndarray or weights.shape[-2] * weights.shape[-1] * head_dim < _BLAS_THREADS_FROM:
        for_blocks(block, like, blas=True)
        return
    with single_threaded_blas():
        for_blocks(block, like, blas=True)


@primitive
def attention_weights(q, k, *, num_heads, scale=1.0, mask=None, is_causal=False):
    """``softmax(scale * q_h @ k_h^T)`` for each head h, over the keys that `mask` and
    `is_causal` allow (as `masked_softmax`): q ``(batch, q_len, heads * d)`` and k
    ``(batch, kv_len, heads * d)`` -> weights ``(batch, heads, q_len, kv_len)``.

    The scores are never a separate array: each block of heads is multiplied and
    normalised in turn, its weights still in the cache when they are a megabyte or so.
    Gradient: the softmax's, then two products per head.

    >>> w = attention_weights(np.ones((1, 2, 4)), np.ones((1, 3, 4)), num_heads=2)
    >>> w.shape, w.sum(-1).tolist()
    ((1, 2, 2, 3), [[[1.0, 1.0], [1.0, 1.0]]])
    """
    if not scale > 0:
        raise ValueError(f"attention_weights: scale must be positive, got {scale!r}")
    _check_heads("attention_weights", q, k, num_heads)
    xp = module_of(q)
    q, k = xp.ascontiguousarray(q), xp.ascontiguousarray(k)
    (batch, q_len, _), kv_len = q.shape, k.shape[1]
    shape = (batch, num_heads, q_len, kv_len)
    allowed = _allowed(mask, is_causal, shape, xp, "attention_weights")
    qh, kh = _heads(q, num_heads), _heads(k, num_heads)
    w = xp.empty(shape, np.result_type(q, k))

    def forward(i):
        # Scaling q, not the scores: q_len * d numbers instead of q_len * kv_len per head.
        np.matmul(qh[i] * scale, kh[i].swapaxes(-1, -2), out=w[i])
        _softmax_rows(w[i], w[i], None if allowed is None else allowed[i], 1.0)

    _head_blocks(forward, w, qh.shape[-1])

    def vjp(g, needs):
        xp = module_of(g)
        g = xp.ascontiguousarray(g)
        gq = xp.empty_like(q) if needs[0] else None
        gk = xp.empty_like(k) if needs[1] else None
        gqh = None if gq is None else _heads(gq, num_heads)
        gkh = None if gk is None else _heads(gk, num_heads)

        def backward(i):
            gs = xp.empty_like(g[i])  # d(scale * scores), one block
            _softmax_grad_rows(g[i], w[i], gs, scale)
            if gqh is not None:
                np.matmul(gs, kh[i], out=gqh[i])
            if gkh is not None:
                np.matmul(gs.swapaxes(-1, -2), qh[i], out=gkh[i])

        _head_blocks(backward, g, qh.shape[-1])
        return gq, gk

    return w, vjp


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
    xp = module_of(v)
    weights, v = xp.ascontiguousarray(weights), xp.ascontiguousarray(v)
    vh = _heads(v, num_heads)
    out = xp.empty((weights.shape[0], weights.shape[2], v.shape[2]), np.result_type(weights, v))
    outh = _heads(out, num_heads)
    _head_blocks(lambda i: np.matmul(weights[i], vh[i], out=outh[i]), weights, vh.shape[-1])

    def vjp(g, needs):
        xp = module_of(g)
        gh = _heads(xp.ascontiguousarray(g), num_heads)
        gw = xp.empty_like(weights) if needs[0] else None
        gv = xp.empty_like(v) if needs[1] else None
        gvh = None if gv is None else _heads(gv, num_heads)

        def backward(i):
            if gw is not None:
                np.matmul(gh[i], vh[i].swapaxes(-1, -2), out=gw[i])
            if gvh is not None:
                np.matmul(weights[i].swapaxes(-1, -2), gh[i], out=gvh[i])

        _head_blocks(backward, weights, vh.shape[-1])
        return gw, gv

    return out, vjp
