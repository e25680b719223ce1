"""Fused softmax cross-entropy with integer labels: one pass forward, ``softmax - target``
backward, never materialising a one-hot matrix or a log-softmax for the tape."""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of


@primitive
def softmax_cross_entropy(logits, labels, label_smoothing=0.0, reduction="none", weight=None, ignore_index=None):
    """Per-example ``-log softmax(logits)[label]`` over the last axis, with optional label
    smoothing (the target is ``(1 - s) * one_hot + s / K``), and optionally its "mean" or
    "sum" over the examples (fused: no separate reduction node).

    As PyTorch's ``cross_entropy``: `weight` ``(K,)`` weighs each example by its label's
    weight (and the smoothing term by every class's), labels equal to `ignore_index` add
    nothing, and "mean" divides by the total weight of the examples not ignored (their
    count without `weight`). A "mean" over no weight at all raises `ValueError`.

    Shapes: logits ``(..., K)`` floating, labels ``(...)`` integer in ``[0, K)`` (or
    `ignore_index`) -> ``(...)`` (a scalar when reduced).

    >>> softmax_cross_entropy(np.zeros((2, 4)), np.array([0, 3])).round(4).tolist()
    [1.3863, 1.3863]
    """
    k = logits.shape[-1]
    xp = module_of(logits)
    shifted = logits - np.max(logits, axis=-1, keepdims=True)
    e = np.exp(shifted)
    total = np.sum(e, axis=-1, keepdims=True)
    lse = np.log(total).reshape(-1)
    flat_shifted = shifted.reshape(-1, k)
    # The labels' entries of the (rows, K) view: plain fancy indexing, which is several
    # times cheaper than take_along_axis on small batches.
    rows = module_of(labels).arange(labels.size)
    flat_labels = labels.reshape(-1)
    keep = None
    if ignore_index is not None:
        keep = flat_labels != ignore_index
        flat_labels = np.where(keep, flat_labels, 0)
    if weight is not None:
        weight = xp.asarray(weight, dtype=logits.dtype)
        label_weight = weight[flat_labels]
    loss = lse - flat_shifted[rows, flat_labels]
    if weight is not None:
        loss *= label_weight
    if label_smoothing:
        # sum over the classes c of w_c * -log softmax_c (w_c = 1 without weights)
        smooth = k * lse - flat_shifted.sum(axis=-1) if weight is None else weight.sum() * lse - flat_shifted @ weight
        loss = (1 - label_smoothing) * loss + (label_smoothing / k) * smooth
    if keep is not None:
        loss *= keep

    if reduction == "mean":
        if weight is not None:
            count = (label_weight * keep).sum() if keep is not None else label_weight.sum()
        else:
            count = keep.sum() if keep is not None else labels.size
        if not count > 0:
            raise ValueError(
                "softmax_cross_entropy: no target counts towards the mean (every label ignored or of "
                "weight 0); use reduction='sum' for a batch that may have none"
            )

    def vjp(g, needs):
        grad = e / total  # the softmax
        flat = grad.reshape(-1, k)
        if weight is None:
            flat[rows, flat_labels] -= 1 - label_smoothing
            if label_smoothing:
                grad -= label_smoothing / k
        else:
            # d/dz of (1-s) w_y (lse - z_y) + (s/K) sum_c w_c (lse - z_c)
            flat *= ((1 - label_smoothing) * label_weight + (label_smoothing / k) * weight.sum())[:, None]
            flat[rows, flat_labels] -= (1 - label_smoothing) * label_weight
            if label_smoothing:
                flat -= (label_smoothing / k) * weight
        if keep is not None:
            flat *= keep[:, None]
        if reduction == "none":
            grad *= g[..., None]
        else:
            grad *= g / count if reduction == "mean" else g
        return grad, None

    if reduction == "none":
        return loss.reshape(labels.shape), vjp
    total_loss = loss.sum()
    return (total_loss / count if reduction == "mean" else total_loss), vjp
