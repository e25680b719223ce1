"""Fused normalisation: one primitive for zero-mean/unit-variance normalisation over any
axes (BatchNorm, LayerNorm, GroupNorm), one for root-mean-square normalisation (RMSNorm),
and one for the layers' affine map ``y * scale + bias``.

The VJPs are the closed forms, which need only the normalised output and the reciprocal
standard deviation, instead of the half-dozen nodes that the composition of mean,
subtract, var, sqrt and divide would record.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
from numpy.lib.array_utils import normalize_axis_tuple

from ..ad.tape import primitive
from ..backend import module_of, row_sums
from ..parallel import for_blocks

__all__ = ["moments", "normalize", "rms_normalize", "scale_shift"]


def moments(x: Any, axis: int | tuple[int, ...]) -> tuple[Any, Any]:
    """Mean and biased variance of the raw array `x` over `axis`, with kept dimensions.

    >>> m, v = moments(np.array([[1.0, 3.0]]), axis=1)
    >>> m.tolist(), v.tolist()
    ([[2.0]], [[1.0]])
    """
    mean = np.mean(x, axis=axis, keepdims=True)
    centred = x - mean
    centred *= centred
    return mean, np.mean(centred, axis=axis, keepdims=True)


def _at_once(kernel, like):
    """A block kernel called once over the whole leading axis of `like`."""
    kernel(0, len(like))


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
    xp = module_of(x)
    x = xp.ascontiguousarray(x)
    axes = normalize_axis_tuple(axis, x.ndim)
    xhat = xp.empty_like(x)
    rstd = xp.empty(tuple(1 if i in axes else n for i, n in enumerate(x.shape)), x.dtype)
    # Over the trailing axes (LayerNorm), each block is a matrix whose rows are normalised.
    row = math.prod(x.shape[i] for i in axes) if sorted(axes) == list(range(x.ndim - len(axes), x.ndim)) else 0

    def forward(lo, hi):
        xb, r, xh = x[lo:hi], rstd[lo:hi], xhat[lo:hi]
        if row and stats is None:
            _normalize_rows(xb.reshape(-1, row), epsilon, xh.reshape(-1, row), r.reshape(-1, 1))
            return
        mean, var = moments(xb, axes) if stats is None else stats
        np.add(var, epsilon, out=r)
        np.sqrt(r, out=r)
        np.divide(1, r, out=r)
        np.subtract(xb, mean, out=xh)
        xh *= r

    # Blocks of the leading axis are independent unless it is normalised over (BatchNorm,
    # which also passes whole-array stats). The rows' sums are BLAS products (blas=True).
    run = _at_once if 0 in axes or stats is not None else functools.partial(for_blocks, blas=bool(row))
    run(forward, x)

    def vjp(g, needs):
        g = module_of(g).ascontiguousarray(g)
        gx = module_of(g).empty_like(g)

        def backward(lo, hi):
            gb, xh, out = g[lo:hi], xhat[lo:hi], gx[lo:hi]
            if row:
                _normalize_rows_grad(gb.reshape(-1, row), xh.reshape(-1, row), rstd[lo:hi].reshape(-1, 1), out.reshape(-1, row))
                return
            np.subtract(gb, np.mean(gb, axis=axes, keepdims=True), out=out)
            out -= xh * np.mean(gb * xh, axis=axes, keepdims=True)
            out *= rstd[lo:hi]

        run(backward, gx)
        return (gx,)

    return xhat, vjp


def _normalize_rows(x, epsilon, xhat, rstd):
    """``xhat = (x - mean) * rstd`` and ``rstd = 1 / sqrt(var + epsilon)`` over the rows of
    the matrix `x` (into `xhat` and the column `rstd`); the variance from the centred rows."""
    n = x.shape[1]
    np.subtract(x, row_sums(x) / n, out=xhat)
    # What the first mean's rounding left, taken out: a row's mean can be far larger than
    # its spread, and `row_sums` rounds more than NumPy's pairwise summation.
    xhat -= row_sums(xhat) / n
    np.divide(np.einsum("ij,ij->i", xhat, xhat)[:, None], n, out=rstd)
    rstd += epsilon
    np.sqrt(rstd, out=rstd)
    np.divide(1, rstd, out=rstd)
    xhat *= rstd


def _normalize_rows_grad(g, xhat, rstd, out):
    """``out = rstd * (g - mean(g) - xhat * mean(g * xhat))`` over the rows of the matrix `g`."""
    n = g.shape[1]
    np.subtract(g, row_sums(g) / n, out=out)
    out -= xhat * (np.einsum("ij,ij->i", g, xhat)[:, None] / n)
    out *= rstd


@primitive
def rms_normalize(x, *, axis=-1, epsilon):
    """``x / sqrt(mean(x**2) + epsilon)`` over `axis`. Gradient:
    ``rstd * (g - y * mean(g * y))``.

    >>> rms_normalize(np.array([[3.0, 4.0]]), epsilon=0.0).round(4).tolist()
    [[0.8485, 1.1314]]
    """
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axis, keepdims=True) + epsilon)
    y = x * rstd

    def vjp(g, needs):
        gx = g - y * np.mean(g * y, axis=axis, keepdims=True)
        gx *= rstd
        return (gx,)

    return y, vjp


@primitive
def scale_shift(y, scale, bias):
    """``y * scale + bias``, with `scale` and `bias` of the shape of y's trailing axes (a
    normalisation layer's affine map), in one pass over each block of y. Gradients:
    ``g * scale``, and the sums of ``g * y`` and of ``g`` over y's leading axes.

    >>> scale_shift(np.ones((2, 3)), np.full(3, 2.0), np.arange(3.0)).tolist()
    [[2.0, 3.0, 4.0], [2.0, 3.0, 4.0]]
    """
    if scale.shape != bias.shape or scale.shape != y.shape[y.ndim - scale.ndim :]:
        raise ValueError(
            f"scale_shift: expected scale and bias of the trailing shape of y {y.shape}, got {scale.shape} and {bias.shape}"
        )
    xp = module_of(y)
    y = xp.ascontiguousarray(y)
    out = xp.empty(y.shape, np.result_type(y, scale, bias))
    # Blocks of y's leading axis, unless scale and bias cover it too.
    run = for_blocks if scale.ndim < y.ndim else _at_once

    def forward(lo, hi):
        block = out[lo:hi]  # one view (``out[lo:hi] += bias`` would also assign it back)
        np.multiply(y[lo:hi], scale, out=block)
        block += bias

    run(forward, y)

    def vjp(g, needs):
        xp = module_of(g)
        g = xp.ascontiguousarray(g)
        gy = xp.empty(y.shape, np.result_type(g, scale)) if needs[0] else None
        # One partial sum per block, added in the blocks' order: the same bits on any threads.
        scale_sums, bias_sums = {}, {}

        def backward(lo, hi):
            gb = g[lo:hi]
            if gy is not None:
                np.multiply(gb, scale, out=gy[lo:hi])
            if needs[1]:
                scale_sums[lo] = np.sum((gb * y[lo:hi]).reshape(-1, scale.size), axis=0)
            if needs[2]:
                bias_sums[lo] = np.sum(gb.reshape(-1, scale.size), axis=0)

        run(backward, g)

        def total(sums, like):
            return None if not sums else sum(sums[lo] for lo in sorted(sums)).reshape(like.shape).astype(like.dtype, copy=False)

        return gy, total(scale_sums, scale), total(bias_sums, bias)

    return out, vjp
