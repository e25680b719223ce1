"""Fused normalisation: one primitive for zero-mean/unit-variance normalisation over any
axes (BatchNorm, LayerNorm, GroupNorm, InstanceNorm), one for root-mean-square
normalisation (RMSNorm), one for the layers' affine map ``y * scale + bias``, and one for
a normalisation and its affine map together (what the layers call).

The VJPs are the closed forms, which need only the normalised output and the reciprocal
standard deviation, instead of the half-dozen nodes that the composition of mean,
subtract, var, sqrt and divide would record. Each device has its kernels
(`luxnn.ops.cpu.norm`, `luxnn.ops.cuda.norm`); this module checks and wires them.
"""

from __future__ import annotations

from typing import Any

import numpy as np  # noqa: F401  (the docstrings' examples)
from numpy.lib.array_utils import normalize_axis_tuple

from ..ad.tape import primitive
from ..backend import is_array
from .traits import Area

__all__ = [
    "moments", "normalize", "rms_normalize", "scale_shift", "normalize_affine", "frozen_normalize", "update_running",
]

_NORM = Area("norm")


def _kernels(x: Any) -> Any:
    return _NORM[type(x)]


def _axes(axis: int | tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(sorted(normalize_axis_tuple(axis, ndim)))


def moments(x: Any, axis: int | tuple[int, ...]) -> tuple[Any, Any]:
    """Mean and biased variance of `x` over `axis`, with kept dimensions: the device's
    kernel for an array, the array API's differentiable passes for a traced value.

    >>> m, v = moments(np.array([[1.0, 3.0]]), axis=1)
    >>> m.tolist(), v.tolist()
    ([[2.0]], [[1.0]])
    """
    axes = _axes(axis, x.ndim)
    if not is_array(x):
        mean = x.mean(axis=axes, keepdims=True)
        centred = x - mean
        return mean, (centred * centred).mean(axis=axes, keepdims=True)
    return _kernels(x).moments(x, axes)


@primitive
def normalize(x, *, axis, epsilon, stats=None):
    """``(x - mean) / sqrt(var + epsilon)`` with mean and biased variance over `axis`.

    `stats` is ``(mean, var)`` of `x` itself as `moments` returns them, for a caller that
    needs them too (BatchNorm updates its running statistics from them); they are computed
    here otherwise. Gradient: ``rstd * (g - mean(g) - xhat * mean(g * xhat))``.

    >>> y = normalize(np.array([[1.0, 3.0]]), axis=-1, epsilon=0.0)
    >>> y.tolist()
    [[-1.0, 1.0]]
    """
    return _kernels(x).normalize(x, _axes(axis, x.ndim), epsilon, stats)


@primitive
def rms_normalize(x, *, axis=-1, epsilon):
    """``x / sqrt(mean(x**2) + epsilon)`` over `axis`. Gradient:
    ``rstd * (g - y * mean(g * y))``.

    >>> rms_normalize(np.array([[3.0, 4.0]]), epsilon=0.0).round(4).tolist()
    [[0.8485, 1.1314]]
    """
    return _kernels(x).rms_normalize(x, _axes(axis, x.ndim), epsilon)


def _check_affine(owner: str, y: Any, scale: Any, bias: Any) -> None:
    if scale.shape != y.shape[y.ndim - scale.ndim :] or (bias is not None and bias.shape != scale.shape):
        raise ValueError(
            f"{owner}: expected scale and bias of the trailing shape of y {y.shape}, got {scale.shape} and "
            f"{None if bias is None else bias.shape}"
        )


@primitive
def scale_shift(y, scale, bias):
    """``y * scale + bias``, with `scale` and `bias` of the shape of y's trailing axes (a
    normalisation layer's affine map), in one pass over each block of y. Gradients:
    ``g * scale``, and the sums of ``g * y`` and of ``g`` over y's leading axes.

    >>> scale_shift(np.ones((2, 3)), np.full(3, 2.0), np.arange(3.0)).tolist()
    [[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]]
    """
    _check_affine("scale_shift", y, scale, bias)
    return _kernels(y).scale_shift(y, scale, bias)


@primitive
def normalize_affine(x, scale, bias, *, axis, epsilon, stats=None, centre=True):
    """``normalize(x) * scale + bias`` (``rms_normalize`` without `centre`), `scale` and
    `bias` of x's trailing shape, `bias` None for none: a normalisation layer's forward
    pass, which a device may fuse (`luxnn.ops.cuda.norm`: one kernel). `stats` as
    `normalize`'s (only with `centre`). Gradients: those of the two steps.

    >>> normalize_affine(np.array([[1.0, 3.0]]), np.full(2, 2.0), np.ones(2), axis=-1, epsilon=0.0).tolist()
    [[-1.0, 3.0]]
    """
    _check_affine("normalize_affine", x, scale, bias)
    if stats is not None and not centre:
        raise ValueError("normalize_affine: stats (mean, var) are those of a centred normalisation, got centre=False")
    return _kernels(x).normalize_affine(x, scale, bias, _axes(axis, x.ndim), epsilon, stats, centre)


@primitive
def frozen_normalize(x, scale, bias, mean, var, *, epsilon):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with fixed statistics ``(C,)``
    (a BatchNorm's running ones in test mode) over the last axis of x ``(..., C)``;
    `scale` and `bias` ``(C,)``, or both None. Gradients: x's, scale's and bias's.

    >>> frozen_normalize(np.array([[3.0]]), None, None, np.array([1.0]), np.array([4.0]), epsilon=0.0).tolist()
    [[1.0]]
    """
    return _kernels(x).frozen_normalize(x, scale, bias, mean, var, epsilon)


def update_running(running_mean: Any, running_var: Any, mean: Any, var: Any, momentum: float,
                   count: int) -> tuple[Any, Any]:
    """Running statistics ``(C,)`` updated by a batch's `mean` and biased `var` (as
    `moments` returns them, ``(..., C)``, each of `count` values; several rows of them
    are averaged): ``(1 - momentum) * running + momentum * batch``, the variance unbiased
    (``count / (count - 1)``). New arrays, of the dtype of the running and the batch's
    statistics together.

    >>> update_running(np.zeros(1), np.ones(1), np.array([[2.0]]), np.array([[1.0]]), 0.5, 2)
    (array([1.]), array([1.5]))
    """
    return _kernels(mean).update_running(running_mean, running_var, mean, var, momentum, count)
