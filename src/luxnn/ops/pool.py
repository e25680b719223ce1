"""Pooling primitives over the spatial axes of channels-last input ``(N, *spatial, C)``.

Forward and backward loop over the window offsets only (``prod(window)`` whole-array
operations on strided views of the padded input), never over output positions.

- `max_pool` pads with -inf; its gradient goes to the first maximum of each window in
  row-major window order, as PyTorch's (ties do not split the gradient).
- `avg_pool` pads with zeros and by default divides by the full window size, counting the
  padding (PyTorch's ``count_include_pad=True`` default); ``count_include_pad=False``
  divides by the number of real elements in each window instead.
- `adaptive_avg_pool` and `adaptive_max_pool` pool to a given output size with PyTorch's
  bins (`adaptive_bins`), one axis at a time (a box's mean or max is that of its rows'),
  one whole-array operation per output index of the axis.

>>> import numpy as np
>>> x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
>>> max_pool(x, (2, 2))[0, :, :, 0].tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from .conv import Pairs, conv_output_size, crop_spatial, pad_spatial, per_axis, per_side, window_slices
from ..parallel import for_blocks

__all__ = ["max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool", "adaptive_bins"]


def _config(x: Any, window: Any, stride: Any, padding: Any) -> tuple[tuple[int, ...], tuple[int, ...], Pairs]:
    r = x.ndim - 2
    window = per_axis(window, r)
    return window, window if stride is None else per_axis(stride, r), per_side(padding, r)


def max_pool(x: Any, window: Any, stride: Any = None, padding: Any = 0) -> Any:
    """Max over windows of `x` ``(N, *spatial, C)``: ``(N, *out, C)`` with
    ``out = (spatial + low + high - window) // stride + 1``. `window`, `stride` (default:
    the window) and `padding` as for `luxnn.ops.conv`."""
    window, stride, padding = _config(x, window, stride, padding)
    return _max_pool(x, window=window, stride=stride, padding=padding)


def avg_pool(x: Any, window: Any, stride: Any = None, padding: Any = 0, *, count_include_pad: bool = True) -> Any:
    """Mean over windows of `x` ``(N, *spatial, C)``; arguments as `max_pool`."""
    window, stride, padding = _config(x, window, stride, padding)
    return _avg_pool(x, window=window, stride=stride, padding=padding, count_include_pad=count_include_pad)


def _windows(xpad: Any, window: tuple[int, ...], stride: tuple[int, ...]) -> tuple[tuple[int, ...], list[tuple[slice, ...]]]:
    """Output sizes, and for each window offset the index of the elements it reads."""
    ones = (1,) * len(window)
    out = tuple(conv_output_size(n, k, s, 1, (0, 0)) for n, k, s in zip(xpad.shape[1:-1], window, stride))
    return out, [window_slices(off, stride, ones, out) for off in itertools.product(*map(range, window))]


@primitive
def _max_pool(x, *, window, stride, padding):
    xpad = pad_spatial(x, padding, -np.inf)
    out, slices = _windows(xpad, window, stride)
    xp = module_of(x)
    y = xp.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    # arg: which offset holds each window's first maximum (strict > keeps the earliest on
    # ties). Offsets come in increasing order, so ``arg = max(arg, k * better)`` records the
    # latest improvement; unlike masked copies, every operation here is branch-free.
    arg = xp.empty(y.shape, np.uint8 if len(slices) < 256 else np.int32)

    def forward(lo, hi):
        xb, yb, argb = xpad[lo:hi], y[lo:hi], arg[lo:hi]
        np.copyto(yb, xb[slices[0]])
        argb.fill(0)
        better = xp.empty(yb.shape, bool)
        mark = xp.empty_like(argb)
        for k, sl in enumerate(slices[1:], 1):
            v = xb[sl]
            np.greater(v, yb, out=better)
            np.maximum(yb, v, out=yb)
            np.multiply(better, k, out=mark, dtype=arg.dtype)
            np.maximum(argb, mark, out=argb)

    for_blocks(forward, y)
    padded_shape, in_sizes = xpad.shape, x.shape[1:-1]
    # Windows that tile the padded input exactly write each input gradient element once.
    tiling = all(s == k and o * s == n for s, k, o, n in zip(stride, window, out, padded_shape[1:-1]))
    disjoint = all(s >= k for s, k in zip(stride, window))

    def vjp(g, needs):
        dxpad = (xp.empty if tiling else xp.zeros)(padded_shape, g.dtype)

        def backward(lo, hi):
            gb, argb, dxb = g[lo:hi], arg[lo:hi], dxpad[lo:hi]
            hit = xp.empty(gb.shape, bool)
            for k, sl in enumerate(slices):
                np.equal(argb, k, out=hit)
                dst = dxb[sl]
                if disjoint:
                    np.multiply(gb, hit, out=dst)
                else:
                    dst += gb * hit

        for_blocks(backward, g)
        return (crop_spatial(dxpad, in_sizes, padding),)

    return y, vjp


def _divisor(x: Any, window: tuple[int, ...], stride: tuple[int, ...], padding: Pairs, out: tuple[int, ...], include_pad: bool) -> Any:
    """The window size, or without padding the count of real elements in each window,
    shaped ``(1, *out, 1)``; a product of per-axis counts."""
    if include_pad or not any(lo or hi for lo, hi in padding):
        return math.prod(window)
    xp = module_of(x)
    count = xp.ones((1,) * x.ndim, x.dtype)
    for axis, (n, k, s, (lo, _), o) in enumerate(zip(x.shape[1:-1], window, stride, padding, out), 1):
        start = xp.arange(o) * s - lo
        real = xp.minimum(start + k, n) - xp.maximum(start, 0)
        count = count * real.astype(x.dtype).reshape(tuple(-1 if i == axis else 1 for i in range(x.ndim)))
    return count


@primitive
def _avg_pool(x, *, window, stride, padding, count_include_pad):
    xpad = pad_spatial(x, padding)
    out, slices = _windows(xpad, window, stride)
    xp = module_of(x)
    y = xp.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    divisor = _divisor(x, window, stride, padding, out, count_include_pad)

    def forward(lo, hi):
        xb, yb = xpad[lo:hi], y[lo:hi]
        np.copyto(yb, xb[slices[0]])
        for sl in slices[1:]:
            yb += xb[sl]
        yb /= divisor

    for_blocks(forward, y)
    padded_shape, in_sizes = xpad.shape, x.shape[1:-1]

    def vjp(g, needs):
        share = g / divisor
        dxpad = module_of(g).zeros(padded_shape, share.dtype)

        def backward(lo, hi):
            dxb, sb = dxpad[lo:hi], share[lo:hi]
            for sl in slices:
                dxb[sl] += sb

        for_blocks(backward, share)
        return (crop_spatial(dxpad, in_sizes, padding),)

    return y, vjp


def adaptive_bins(size: int, out: int) -> tuple[tuple[int, int], ...]:
    """PyTorch's adaptive pooling windows ``[floor(i * size / out), ceil((i + 1) * size / out))``
    for ``i < out``: they cover the axis, neighbours overlapping when `out` does not divide
    `size`.

    >>> adaptive_bins(5, 3)
    ((0, 2), (1, 4), (3, 5))
    """
    return tuple((i * size // out, -(-(i + 1) * size // out)) for i in range(out))


def _adaptive_config(x: Any, out_size: Any, owner: str) -> tuple[int, ...]:
    rank = getattr(x, "ndim", 0) - 2
    if rank < 1:
        raise ValueError(f"{owner}: expected input (N, *spatial, C) with a spatial axis, got shape {getattr(x, 'shape', None)}")
    out = per_axis(out_size, rank)
    if len(out) != rank or any(o < 1 for o in out):
        raise ValueError(f"{owner}: expected {rank} positive output sizes for input of shape {x.shape}, got {out_size!r}")
    return out


def adaptive_avg_pool(x: Any, out_size: Any) -> Any:
    """Mean over PyTorch's adaptive windows: ``(N, *spatial, C)`` -> ``(N, *out_size, C)``
    (`out_size` an int for every spatial axis, or one per axis).

    >>> adaptive_avg_pool(np.arange(5.0).reshape(1, 5, 1), 3)[0, :, 0].tolist()
    [0.5, 2.0, 3.5]
    """
    y = x
    for axis, out in enumerate(_adaptive_config(x, out_size, "adaptive_avg_pool"), 1):
        if out != x.shape[axis]:
            y = _adaptive_mean_axis(y, axis=axis, bins=adaptive_bins(x.shape[axis], out))
    return y


def adaptive_max_pool(x: Any, out_size: Any) -> Any:
    """Maximum over PyTorch's adaptive windows; shapes as `adaptive_avg_pool`. The
    gradient goes to each window's first maximum in row-major order, as PyTorch's: the
    last axis is reduced first, so the earlier axes pick among the rows' first maxima."""
    out = _adaptive_config(x, out_size, "adaptive_max_pool")
    y = x
    for axis in range(len(out), 0, -1):
        if out[axis - 1] != x.shape[axis]:
            y = _adaptive_max_axis(y, axis=axis, bins=adaptive_bins(x.shape[axis], out[axis - 1]))
    return y


def _at(axis: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,)


def _bin_shape(shape: tuple[int, ...], axis: int, n: int) -> tuple[int, ...]:
    return (*shape[:axis], n, *shape[axis + 1 :])


@primitive
def _adaptive_mean_axis(x, *, axis, bins):
    y = module_of(x).empty(_bin_shape(x.shape, axis, len(bins)), x.dtype)
    for i, (lo, hi) in enumerate(bins):
        np.mean(x[_at(axis, slice(lo, hi))], axis=axis, keepdims=True, out=y[_at(axis, slice(i, i + 1))])
    shape = x.shape

    def vjp(g, needs):
        gx = module_of(g).zeros(shape, g.dtype)
        for i, (lo, hi) in enumerate(bins):
            gx[_at(axis, slice(lo, hi))] += g[_at(axis, slice(i, i + 1))] / (hi - lo)
        return (gx,)

    return y, vjp


@primitive
def _adaptive_max_axis(x, *, axis, bins):
    xp = module_of(x)
    y = xp.empty(_bin_shape(x.shape, axis, len(bins)), x.dtype)
    # Per bin: where along the bin its (first) maximum lies.
    args = []
    for i, (lo, hi) in enumerate(bins):
        window = x[_at(axis, slice(lo, hi))]
        arg = xp.argmax(window, axis=axis)[_at(axis, None)]
        args.append(arg)
        y[_at(axis, slice(i, i + 1))] = xp.take_along_axis(window, arg, axis=axis)
    shape = x.shape

    def vjp(g, needs):
        gx = module_of(g).zeros(shape, g.dtype)
        for i, ((lo, hi), arg) in enumerate(zip(bins, args)):
            offsets = xp.arange(hi - lo).reshape(_bin_shape((1,) * g.ndim, axis, hi - lo))
            gx[_at(axis, slice(lo, hi))] += (offsets == arg) * g[_at(axis, slice(i, i + 1))]
        return (gx,)

    return y, vjp
