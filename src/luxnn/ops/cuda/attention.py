"""Attention's head products on CuPy arrays: each product one batched GEMM over every
(batch, head) pair, the softmax one row kernel each way (ops/cuda/softmax.py).

The GEMMs take each head's rows contiguous, (batch, heads, seq, d): q (scaled, as the
CPU's), k and v are rearranged once each (one launch), q again unscaled for k's gradient,
and each product that comes back per head is merged into (batch, seq, heads * d) once.
"""

from __future__ import annotations

from ...backend import module_of
from . import gemm, softmax

__all__ = ["attention_weights", "attention_weights_grad", "attention_combine", "attention_combine_grad"]


def _split_heads(x, num_heads, scale=None):
    """(batch, seq, heads * d) -> contiguous (batch, heads, seq, d), times `scale` if given."""
    batch, seq, dim = x.shape
    xp = module_of(x)
    view = x.reshape(batch, seq, num_heads, dim // num_heads).transpose(0, 2, 1, 3)
    if scale is None:
        return xp.ascontiguousarray(view)
    return xp.multiply(view, scale, out=xp.empty(view.shape, x.dtype))


def _merge_heads(xh):
    """(batch, heads, seq, d) -> contiguous (batch, seq, heads * d)."""
    batch, num_heads, seq, d = xh.shape
    return module_of(xh).ascontiguousarray(xh.transpose(0, 2, 1, 3)).reshape(batch, seq, num_heads * d)


def attention_weights(q, k, num_heads, scale, mask, is_causal):
    # Scaling q, not the scores: q_len * d numbers instead of q_len * kv_len per head.
    kh = _split_heads(k, num_heads)
    w = softmax.masked_softmax(gemm.matmul(_split_heads(q, num_heads, scale), kh.swapaxes(-1, -2)), 1.0, mask, is_causal)
    return w, (q, kh, w, num_heads, scale)


def attention_weights_grad(g, residual, needs):
    q, kh, w, num_heads, scale = residual
    gs = softmax.masked_softmax_grad(g, w, scale)  # d(scale * scores)
    gq = _merge_heads(gemm.matmul(gs, kh)) if needs[0] else None
    gk = _merge_heads(gemm.matmul(gs.swapaxes(-1, -2), _split_heads(q, num_heads))) if needs[1] else None
    return gq, gk


def attention_combine(weights, v, num_heads):
    xp = module_of(v)
    weights, vh = xp.ascontiguousarray(weights), _split_heads(v, num_heads)
    return _merge_heads(gemm.matmul(weights, vh)), (weights, vh, num_heads)


def attention_combine_grad(g, residual, needs):
    weights, vh, num_heads = residual
    gh = _split_heads(g, num_heads)
    gw = gemm.matmul(gh, vh.swapaxes(-1, -2)) if needs[0] else None
    gv = _merge_heads(gemm.matmul(weights.swapaxes(-1, -2), gh)) if needs[1] else None
    return gw, gv
