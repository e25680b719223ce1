"""The normalisations on the CPU (NumPy arrays): blocks of the leading axis on luxnn's
threads, the rows' sums as BLAS products. Each function returns ``(out, vjp)`` as the
primitives of `luxnn.ops.norm` do."""

from __future__ import annotations

import functools
import math

import numpy as np

from ...ad.primitives import add, multiply, subtract
from ...backend import row_sums
from ...parallel import for_blocks

__all__ = [
    "moments", "normalize", "rms_normalize", "scale_shift", "normalize_affine", "frozen_normalize", "update_running",
]


def moments(x, axes):
    """Mean and biased variance of `x` over `axes`, with kept dimensions."""
    mean = np.mean(x, axis=axes, keepdims=True)
    centred = x - mean
    centred *= centred
    return mean, np.mean(centred, axis=axes, keepdims=True)


def _at_once(kernel, like):
    """A block kernel called once over the whole leading axis of `like`."""
    kernel(0, len(like))


def normalize(x, axes, epsilon, stats):
    """``(x - mean) / sqrt(var + epsilon)`` over `axes` (a sorted tuple), with `stats`
    ``(mean, var)`` given or computed here."""
    x = np.ascontiguousarray(x)
    xhat = np.empty_like(x)
    rstd = np.empty(tuple(1 if i in axes else n for i, n in enumerate(x.shape)), x.dtype)
    # Over the trailing axes (LayerNorm), each block is a matrix whose rows are normalised.
    row = math.prod(x.shape[i] for i in axes) if list(axes) == list(range(x.ndim - len(axes), x.ndim)) else 0

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
        g = np.ascontiguousarray(g)
        gx = np.empty_like(g)

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


def rms_normalize(x, axes, epsilon):
    """``x / sqrt(mean(x**2) + epsilon)`` over `axes`."""
    rstd = 1.0 / np.sqrt(np.mean(x * x, axis=axes, keepdims=True) + epsilon)
    y = x * rstd

    def vjp(g, needs):
        gx = g - y * np.mean(g * y, axis=axes, keepdims=True)
        gx *= rstd
        return (gx,)

    return y, vjp


def scale_shift(y, scale, bias):
    """``y * scale + bias`` over the blocks of y's leading axis."""
    y = np.ascontiguousarray(y)
    out = np.empty(y.shape, np.result_type(y, scale, bias))
    # Blocks of y's leading axis, unless scale and bias cover it too.
    run = for_blocks if scale.ndim < y.ndim else _at_once

    def forward(lo, hi):
        block = out[lo:hi]  # one view (``out[lo:hi] += bias`` would also assign it back)
        np.multiply(y[lo:hi], scale, out=block)
        block += bias

    run(forward, y)

    def vjp(g, needs):
        g = np.ascontiguousarray(g)
        gy = np.empty(y.shape, np.result_type(g, scale)) if needs[0] else None
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


def normalize_affine(x, scale, bias, axes, epsilon, stats, centre):
    """`normalize` (or `rms_normalize` without `centre`) then `scale_shift` (a product
    with `scale` where `bias` is None), one after the other as two primitives would."""
    y, normalize_vjp = normalize(x, axes, epsilon, stats) if centre else rms_normalize(x, axes, epsilon)
    out, affine_vjp = multiply.raw(y, scale) if bias is None else scale_shift(y, scale, bias)

    def vjp(g, needs):
        grads = affine_vjp(g, needs if bias is not None else needs[:2])
        gx = normalize_vjp(grads[0], (True,))[0] if needs[0] else None
        return gx, grads[1], None if bias is None else grads[2]

    return out, vjp


def frozen_normalize(x, scale, bias, mean, var, epsilon):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with fixed statistics, as
    ``x * s + (bias - mean * s)``, ``s = scale / sqrt(var + epsilon)`` (without `scale`:
    ``(x - mean) * (1 / sqrt(var + epsilon))``), step by step as the tape would record it."""
    inv_std = 1.0 / np.sqrt(var + epsilon)
    if scale is None:
        centred, centred_vjp = subtract.raw(x, mean)
        out, out_vjp = multiply.raw(centred, inv_std)
        return out, lambda g, needs: (centred_vjp(out_vjp(g, (True, False))[0], (True, False))[0], None, None, None, None)
    s, s_vjp = multiply.raw(scale, inv_std)
    scaled, scaled_vjp = multiply.raw(x, s)
    moved, moved_vjp = multiply.raw(mean, s)
    shift, shift_vjp = subtract.raw(bias, moved)
    out, out_vjp = add.raw(scaled, shift)

    def vjp(g, needs):
        g_scaled, g_shift = out_vjp(g, (True, True))
        gx, g_s = scaled_vjp(g_scaled, (needs[0], True))
        g_bias, g_moved = shift_vjp(g_shift, (needs[2], True))
        g_s = g_s + moved_vjp(g_moved, (False, True))[1]
        return gx, s_vjp(g_s, (True, False))[0] if needs[1] else None, g_bias, None, None

    return out, vjp


def update_running(running_mean, running_var, mean, var, momentum, count):
    """``(1 - momentum) * running + momentum * batch`` of the mean and of the unbiased
    variance, the batch's statistics (kept dimensions, ``(..., C)``) averaged over all
    but their channel axis."""
    c = running_mean.shape[-1]
    new_mean = (1 - momentum) * running_mean + momentum * mean.reshape(-1, c).mean(axis=0)
    new_var = (1 - momentum) * running_var + (momentum * count / (count - 1)) * var.reshape(-1, c).mean(axis=0)
    return new_mean, new_var
