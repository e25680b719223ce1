"""The CPU's pooling (`luxnn.ops.pool`'s kernels for NumPy arrays).

Forward and backward loop over the window offsets only (``prod(window)`` whole-array
operations on strided views of the padded input), never over output positions, on blocks
of images shared out to luxnn's threads. Adaptive pooling runs one axis at a time (a box's
mean or max is that of its rows'), one whole-array operation per output index of the axis.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ...parallel import for_blocks
from ..geometry import Pairs, adaptive_bins, conv_output_size, crop_spatial, pad_spatial, window_slices

__all__ = [
    "max_pool_forward", "max_pool_backward", "avg_pool_forward", "avg_pool_backward", "adaptive_avg_pool_forward",
    "adaptive_avg_pool_backward", "adaptive_max_pool_forward", "adaptive_max_pool_backward",
]  # fmt: skip


def _padded(shape: tuple[int, ...], padding: Pairs) -> tuple[int, ...]:
    return (shape[0], *(n + lo + hi for n, (lo, hi) in zip(shape[1:-1], padding)), shape[-1])


def _windows(padded: tuple[int, ...], window: tuple[int, ...], stride: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """Output sizes, and for each window offset the index of the elements it reads from an
    input padded to shape `padded`."""
    ones = (1,) * len(window)
    out = tuple(conv_output_size(n, k, s, 1, (0, 0)) for n, k, s in zip(padded[1:-1], window, stride))
    return out, [window_slices(off, stride, ones, out) for off in itertools.product(*map(range, window))]


def max_pool_forward(x, window, stride, padding):
    """The windows' maxima, and for each the window offset of its first maximum."""
    xpad = pad_spatial(x, padding, -np.inf)
    out, slices = _windows(xpad.shape, window, stride)
    y = np.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    # arg: which offset holds each window's first maximum (strict > keeps the earliest on
    # ties). Offsets come in increasing order, so ``arg = max(arg, k * better)`` records the
    # latest improvement; unlike masked copies, every operation here is branch-free.
    arg = np.empty(y.shape, np.uint8 if len(slices) < 256 else np.int32)

    def forward(lo, hi):
        xb, yb, argb = xpad[lo:hi], y[lo:hi], arg[lo:hi]
        np.copyto(yb, xb[slices[0]])
        argb.fill(0)
        better = np.empty(yb.shape, bool)
        mark = np.empty_like(argb)
        for k, sl in enumerate(slices[1:], 1):
            v = xb[sl]
            np.greater(v, yb, out=better)
            np.maximum(yb, v, out=yb)
            np.multiply(better, k, out=mark, dtype=arg.dtype)
            np.maximum(argb, mark, out=argb)

    for_blocks(forward, y)
    return y, arg


def max_pool_backward(g, residual, shape, window, stride, padding):
    """The input gradient of `max_pool_forward`: each window's gradient to its first maximum."""
    arg, padded = residual, _padded(shape, padding)
    out, slices = _windows(padded, window, stride)
    # Windows that tile the padded input exactly write each input gradient element once.
    tiling = all(s == k and o * s == n for s, k, o, n in zip(stride, window, out, padded[1:-1]))
    disjoint = all(s >= k for s, k in zip(stride, window))
    dxpad = (np.empty if tiling else np.zeros)(padded, g.dtype)

    def backward(lo, hi):
        gb, argb, dxb = g[lo:hi], arg[lo:hi], dxpad[lo:hi]
        hit = np.empty(gb.shape, bool)
        for k, sl in enumerate(slices):
            np.equal(argb, k, out=hit)
            dst = dxb[sl]
            if disjoint:
                np.multiply(gb, hit, out=dst)
            else:
                dst += gb * hit

    for_blocks(backward, g)
    return crop_spatial(dxpad, shape[1:-1], padding)


def _divisor(x: Any, window: tuple[int, ...], stride: tuple[int, ...], padding: Pairs, out: tuple[int, ...], include_pad: bool) -> Any:
    """The window size, or without padding the count of real elements in each window,
    shaped ``(1, *out, 1)``; a product of per-axis counts."""
    if include_pad or not any(lo or hi for lo, hi in padding):
        return math.prod(window)
    count = np.ones((1,) * x.ndim, x.dtype)
    for axis, (n, k, s, (lo, _), o) in enumerate(zip(x.shape[1:-1], window, stride, padding, out), 1):
        start = np.arange(o) * s - lo
        real = np.minimum(start + k, n) - np.maximum(start, 0)
        count = count * real.astype(x.dtype).reshape(tuple(-1 if i == axis else 1 for i in range(x.ndim)))
    return count


def avg_pool_forward(x, window, stride, padding, count_include_pad):
    """The windows' means, and the divisor of each (the residual)."""
    xpad = pad_spatial(x, padding)
    out, slices = _windows(xpad.shape, window, stride)
    y = np.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    divisor = _divisor(x, window, stride, padding, out, count_include_pad)

    def forward(lo, hi):
        xb, yb = xpad[lo:hi], y[lo:hi]
        np.copyto(yb, xb[slices[0]])
        for sl in slices[1:]:
            yb += xb[sl]
        yb /= divisor

    for_blocks(forward, y)
    return y, divisor


def avg_pool_backward(g, residual, shape, window, stride, padding, count_include_pad):
    """The input gradient of `avg_pool_forward`: each window's share to its elements."""
    padded = _padded(shape, padding)
    _, slices = _windows(padded, window, stride)
    share = g / residual
    dxpad = np.zeros(padded, share.dtype)

    def backward(lo, hi):
        dxb, sb = dxpad[lo:hi], share[lo:hi]
        for sl in slices:
            dxb[sl] += sb

    for_blocks(backward, share)
    return crop_spatial(dxpad, shape[1:-1], padding)


def _at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


def _bin_shape(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], n, *shape[axis + 1 :])


def _mean_axis(x, axis, bins):
    y = np.empty(_bin_shape(x.shape, axis, len(bins)), x.dtype)
    for i, (lo, hi) in enumerate(bins):
        np.mean(x[_at(axis, slice(lo, hi))], axis=axis, keepdims=True, out=y[_at(axis, slice(i, i + 1))])
    shape = x.shape

    def vjp(g):
        gx = np.zeros(shape, g.dtype)
        for i, (lo, hi) in enumerate(bins):
            gx[_at(axis, slice(lo, hi))] += g[_at(axis, slice(i, i + 1))] / (hi - lo)
        return gx

    return y, vjp


def _max_axis(x, axis, bins):
    y = np.empty(_bin_shape(x.shape, axis, len(bins)), x.dtype)
    # Per bin: where along the bin its (first) maximum lies.
    args = []
    for i, (lo, hi) in enumerate(bins):
        window = x[_at(axis, slice(lo, hi))]
        arg = np.argmax(window, axis=axis)[_at(axis, None)]
        args.append(arg)
        y[_at(axis, slice(i, i + 1))] = np.take_along_axis(window, arg, axis=axis)
    shape = x.shape

    def vjp(g):
        gx = np.zeros(shape, g.dtype)
        for i, ((lo, hi), arg) in enumerate(zip(bins, args)):
            offsets = np.arange(hi - lo).reshape(_bin_shape((1,) * g.ndim, axis, hi - lo))
            gx[_at(axis, slice(lo, hi))] += (offsets == arg) * g[_at(axis, slice(i, i + 1))]
        return gx

    return y, vjp


def _by_axes(pool_axis, x, out, axes):
    """`pool_axis` along each of `axes` in turn where the size changes: the result, and the
    axes' backward functions in the order the backward pass calls them."""
    y, vjps = x, []
    for axis in axes:
        if out[axis - 1] != x.shape[axis]:
            y, vjp = pool_axis(y, axis, adaptive_bins(x.shape[axis], out[axis - 1]))
            vjps.append(vjp)
    return y, vjps[::-1]


def _through(g, vjps):
    for vjp in vjps:
        g = vjp(g)
    return g


def adaptive_avg_pool_forward(x, out):
    """The means over adaptive windows, one axis at a time (the first first)."""
    return _by_axes(_mean_axis, x, out, range(1, len(out) + 1))


def adaptive_avg_pool_backward(g, residual, shape, out):
    """The input gradient of `adaptive_avg_pool_forward`."""
    return _through(g, residual)


def adaptive_max_pool_forward(x, out):
    """The maxima over adaptive windows, one axis at a time, the last first: the earlier
    axes then pick among the rows' first maxima, which makes each window's first maximum
    in row-major order the one that gets the gradient."""
    return _by_axes(_max_axis, x, out, range(len(out), 0, -1))


def adaptive_max_pool_backward(g, residual, shape, out):
    """The input gradient of `adaptive_max_pool_forward`."""
    return _through(g, residual)
