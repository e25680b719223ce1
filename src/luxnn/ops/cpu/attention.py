"""Attention's head products on NumPy arrays: per block of heads, the scores' product and
the masked softmax while the block is still in the cache, on all cores."""

from __future__ import annotations

import numpy as np

from ...parallel import for_blocks, num_threads, single_threaded_blas
from .softmax import allowed_keys, softmax_grad_rows, softmax_rows

__all__ = ["attention_weights", "attention_weights_grad", "attention_combine", "attention_combine_grad"]

# The products below multiply per-head matrices that are views into (batch, seq, heads * d)
# arrays (rows of d elements, `heads * d` apart), which the BLAS takes as they are, one
# block of the batch (or of the heads, for a batch smaller than the threads) per thread.
# They run with the BLAS on one thread even when there is a single block: its threads slow
# stacks of small products down, several times over with strided operands. OpenBLAS
# threads a product from 2^18 multiply-adds (its SMP threshold); below that, holding it
# would only cost the calls that set its threads.
_BLAS_THREADS_FROM = 1 << 18


def heads(x, num_heads):
    """(batch, seq, heads * d) -> a (batch, heads, seq, d) view of a contiguous `x`."""
    batch, seq, dim = x.shape
    return x.reshape(batch, seq, num_heads, dim // num_heads).transpose(0, 2, 1, 3)


def _head_blocks(kernel, weights, head_dim):
    """Call ``kernel(index)`` for blocks of the (batch, heads) pairs of `weights` ``(batch,
    heads, q_len, kv_len)``, on all threads: `index` selects a block of the batch, or of the
    heads of every sequence when the batch is smaller than the threads (one sequence)."""
    by_heads = weights.shape[0] < num_threads()
    like = weights.swapaxes(0, 1) if by_heads else weights
    block = (lambda lo, hi: kernel((slice(None), slice(lo, hi)))) if by_heads else (lambda lo, hi: kernel((slice(lo, hi),)))
    if weights.shape[-2] * weights.shape[-1] * head_dim < _BLAS_THREADS_FROM:
        for_blocks(block, like, blas=True)
        return
    with single_threaded_blas():
        for_blocks(block, like, blas=True)


def attention_weights(q, k, num_heads, scale, mask, is_causal):
    q, k = np.ascontiguousarray(q), np.ascontiguousarray(k)
    (batch, q_len, _), kv_len = q.shape, k.shape[1]
    shape = (batch, num_heads, q_len, kv_len)
    allowed = allowed_keys(mask, is_causal, shape)
    qh, kh = heads(q, num_heads), heads(k, num_heads)
    w = np.empty(shape, np.result_type(q, k))

    def forward(i):
        # Scaling q, not the scores: q_len * d numbers instead of q_len * kv_len per head.
        np.matmul(qh[i] * scale, kh[i].swapaxes(-1, -2), out=w[i])
        softmax_rows(w[i], w[i], None if allowed is None else allowed[i], 1.0)

    _head_blocks(forward, w, qh.shape[-1])
    return w, (q, k, w, num_heads, scale)


def attention_weights_grad(g, residual, needs):
    q, k, w, num_heads, scale = residual
    qh, kh = heads(q, num_heads), heads(k, num_heads)
    g = np.ascontiguousarray(g)
    gq = np.empty_like(q) if needs[0] else None
    gk = np.empty_like(k) if needs[1] else None
    gqh = None if gq is None else heads(gq, num_heads)
    gkh = None if gk is None else heads(gk, num_heads)

    def backward(i):
        gs = np.empty_like(g[i])  # d(scale * scores), one block
        softmax_grad_rows(g[i], w[i], gs, scale)
        if gqh is not None:
            np.matmul(gs, kh[i], out=gqh[i])
        if gkh is not None:
            np.matmul(gs.swapaxes(-1, -2), qh[i], out=gkh[i])

    _head_blocks(backward, g, qh.shape[-1])
    return gq, gk


def attention_combine(weights, v, num_heads):
    weights, v = np.ascontiguousarray(weights), np.ascontiguousarray(v)
    vh = heads(v, num_heads)
    out = np.empty((weights.shape[0], weights.shape[2], v.shape[2]), np.result_type(weights, v))
    outh = heads(out, num_heads)
    _head_blocks(lambda i: np.matmul(weights[i], vh[i], out=outh[i]), weights, vh.shape[-1])
    return out, (weights, v, num_heads)


def attention_combine_grad(g, residual, needs):
    weights, v, num_heads = residual
    vh = heads(v, num_heads)
    gh = heads(np.ascontiguousarray(g), num_heads)
    gw = np.empty_like(weights) if needs[0] else None
    gv = np.empty_like(v) if needs[1] else None
    gvh = None if gv is None else heads(gv, num_heads)

    def backward(i):
        if gw is not None:
            np.matmul(gh[i], vh[i].swapaxes(-1, -2), out=gw[i])
        if gvh is not None:
            np.matmul(weights[i].swapaxes(-1, -2), gh[i], out=gvh[i])

    _head_blocks(backward, weights, vh.shape[-1])
    return gw, gv
