"""The softmax family on NumPy arrays: softmax, log-softmax and logsumexp over any axis,
and the masked softmax of attention over the last one, each with its gradient.

The forwards take the axis; the gradients take the forward's output. These are also the
NumPy twins of the CUDA row kernels (ops/cuda/softmax.py).
"""

from __future__ import annotations

import numpy as np

from ...backend import row_sums
from ...parallel import for_blocks

__all__ = [
    "logsumexp", "logsumexp_grad", "softmax", "softmax_grad", "log_softmax", "log_softmax_grad", "masked_softmax",
    "masked_softmax_grad",
]  # fmt: skip


def logsumexp(x, axis):
    """``log(sum(exp(x)))`` over `axis`, keeping its dimensions."""
    m = np.max(x, axis=axis, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    return np.log(np.sum(np.exp(x - m), axis=axis, keepdims=True)) + m


def logsumexp_grad(g, x, y):
    """`g` and `y` with `logsumexp`'s kept dimensions."""
    return g * np.exp(x - y)


def softmax(x, axis):
    e = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return e / np.sum(e, axis=axis, keepdims=True)


def softmax_grad(g, y, axis):
    return y * (g - np.sum(g * y, axis=axis, keepdims=True))


def log_softmax(x, axis):
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


def log_softmax_grad(g, y, axis):
    return g - np.exp(y) * np.sum(g, axis=axis, keepdims=True)


def allowed_keys(mask, is_causal, shape):
    """The keys each query may attend to, as a boolean view broadcast to the scores'
    `shape` (cut into blocks with them), or None when every key is allowed."""
    allowed = mask
    if is_causal:
        past = np.tril(np.ones(shape[-2:], bool))
        allowed = past if allowed is None else np.logical_and(allowed, past)
    return None if allowed is None else np.broadcast_to(allowed, shape)


def softmax_rows(scores, w, allowed, scale):
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


def softmax_grad_rows(g, w, out, scale):
    """``out = scale * w * (g - sum(g * w))`` over the last axis: softmax's VJP."""
    # einsum forms sum(g * w) per row without a full-size temporary.
    np.subtract(g, np.einsum("...k,...k->...", g, w)[..., None], out=out)
    out *= w
    if scale != 1.0:
        out *= scale


def masked_softmax(scores, scale, mask, is_causal):
    """``softmax(scale * scores)`` over the last axis among the keys `mask` (a boolean
    array broadcastable to `scores`, or None) and `is_causal` allow; one working array,
    updated in place block by block."""
    allowed = allowed_keys(mask, is_causal, scores.shape)
    scores = np.ascontiguousarray(scores)
    w = np.empty_like(scores)
    # blas=True: the rows' sums are BLAS products.
    for_blocks(lambda lo, hi: softmax_rows(scores[lo:hi], w[lo:hi], None if allowed is None else allowed[lo:hi], scale), w, blas=True)
    return w


def masked_softmax_grad(g, w, scale):
    g = np.ascontiguousarray(g)
    gs = np.empty_like(g)
    for_blocks(lambda lo, hi: softmax_grad_rows(g[lo:hi], w[lo:hi], gs[lo:hi], scale), gs)
    return gs
