"""Fused softmax cross-entropy with integer labels: one pass forward, ``softmax - target``
backward, never materialising a one-hot matrix or a log-softmax for the tape. Each device
has its kernels (`luxnn.ops.cpu.cross_entropy`, `luxnn.ops.cuda.cross_entropy`)."""

from __future__ import annotations

import numpy as np  # noqa: F401  (the docstrings' examples)

from ..ad.tape import primitive
from .traits import Area

__all__ = ["softmax_cross_entropy", "nll_loss"]

_CROSS_ENTROPY = Area("cross_entropy")

REDUCTIONS = ("none", "mean", "sum")


@primitive
def softmax_cross_entropy(logits, labels, label_smoothing=0.0, reduction="none", weight=None, ignore_index=None,
                          owner="softmax_cross_entropy"):
    """Per-example ``-log softmax(logits)[label]`` over the last axis, with optional label
    smoothing (the target is ``(1 - s) * one_hot + s / K``), and optionally its "mean" or
    "sum" over the examples (fused: no separate reduction node).

    As PyTorch's ``cross_entropy``: `weight` ``(K,)`` weighs each example by its label's
    weight (and the smoothing term by every class's), labels equal to `ignore_index` add
    nothing, and "mean" divides by the total weight of the examples not ignored (their
    count without `weight`). A label outside ``[0, K)`` or a "mean" over no weight at all
    raises `ValueError` (named after `owner`); on a CUDA device at the next call, the
    loss of the call itself NaN (`luxnn.ops.cuda.cross_entropy`: no host synchronisation).

    Shapes: logits ``(..., K)`` floating, labels ``(...)`` integer in ``[0, K)`` (or
    `ignore_index`) -> ``(...)`` (a scalar when reduced).

    >>> softmax_cross_entropy(np.zeros((2, 4)), np.array([0, 3])).round(4).tolist()
    [1.3863, 1.3863]
    """
    _check(logits, labels, reduction, owner)
    return _CROSS_ENTROPY[type(logits)].softmax_cross_entropy(
        logits, labels, label_smoothing, reduction, weight, ignore_index, owner)


@primitive
def nll_loss(log_probs, labels, reduction="none", weight=None, ignore_index=None, owner="nll_loss"):
    """Per-example negative log-likelihood ``-weight[label] * log_probs[..., label]`` of
    integer labels under log-probabilities ``(..., K)`` (a `log_softmax`'s output), as
    PyTorch's ``nll_loss``: labels equal to `ignore_index` add nothing, "mean" divides by
    the total weight of the examples not ignored; labels checked as
    `softmax_cross_entropy`'s. Shapes: ``(..., K)`` and ``(...)`` -> ``(...)`` (a scalar
    when reduced).

    >>> nll_loss(np.log(np.array([[0.5, 0.5], [0.9, 0.1]])), np.array([0, 1]), "sum").round(4).tolist()
    2.9957
    """
    _check(log_probs, labels, reduction, owner)
    return _CROSS_ENTROPY[type(log_probs)].nll_loss(
        log_probs, labels, reduction, weight, ignore_index, owner)


def _check(scores, labels, reduction, owner):
    if reduction not in REDUCTIONS:
        raise ValueError(f"{owner}: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if getattr(labels, "shape", None) != scores.shape[:-1]:
        raise ValueError(f"{owner}: expected integer labels of shape {scores.shape[:-1]}, got {getattr(labels, 'shape', None)}")
