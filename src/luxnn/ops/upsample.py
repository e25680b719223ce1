"""Resizing channels-last input ``(N, *spatial, C)`` by integer factors: nearest-neighbour
and (bi/tri)linear upsampling, and the pixel shuffle of sub-pixel convolutions.

Both upsampling primitives work one whole-array operation per output phase, never per
output position: with an integer factor ``s`` along an axis, output ``s * j + r`` reads
input ``j`` (nearest), or a fixed mix of inputs ``j`` and ``j - 1`` or ``j + 1`` (linear),
the same for every ``j``. Linear interpolation is separable, so it runs axis by axis.

>>> import numpy as np
>>> x = np.array([0.0, 1.0]).reshape(1, 2, 1)
>>> upsample_nearest(x, 2)[0, :, 0].tolist()
[0.0, 0.0, 1.0, 1.0]
>>> upsample_linear(x, 2)[0, :, 0].tolist()
[0.0, 0.25, 0.75, 1.0]
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ad import array_namespace
from ..ad.tape import primitive
from ..backend import module_of

__all__ = ["upsample_nearest", "upsample_linear", "pixel_shuffle"]


def _factors(x: Any, scale: int | tuple[int, ...], owner: str) -> tuple[int, ...]:
    rank = getattr(x, "ndim", 0) - 2
    if rank < 1:
        raise ValueError(f"{owner}: expected input (N, *spatial, C) with a spatial axis, got shape {getattr(x, 'shape', None)}")
    scale = (scale,) * rank if isinstance(scale, (int, np.integer)) else tuple(scale)
    if len(scale) != rank or not all(isinstance(s, (int, np.integer)) and s >= 1 for s in scale):
        raise ValueError(f"{owner}: expected {rank} positive integer factors for input of shape {x.shape}, got {scale}")
    return tuple(int(s) for s in scale)


def upsample_nearest(x: Any, scale: int | tuple[int, ...]) -> Any:
    """Each input element repeated `scale` times along each spatial axis:
    ``(N, *spatial, C)`` -> ``(N, *(spatial * scale), C)``, as PyTorch's ``"nearest"``
    mode with integer factors. Gradient: the sum over each element's copies."""
    return _upsample_nearest(x, scale=_factors(x, scale, "upsample_nearest"))


@primitive
def _upsample_nearest(x, *, scale):
    n, *sizes, c = x.shape
    # (N, H, 1, W, 1, C) broadcast to (N, H, sh, W, sw, C): one copy, no index arrays.
    spread = (n, *[d for size, s in zip(sizes, scale) for d in (size, s)], c)
    y = np.broadcast_to(x.reshape((n, *[d for size in sizes for d in (size, 1)], c)), spread)
    y = y.reshape((n, *[size * s for size, s in zip(sizes, scale)], c))
    summed = tuple(range(2, 2 * len(sizes) + 1, 2))

    def vjp(g, needs):
        return (g.reshape(spread).sum(axis=summed),)

    return module_of(x).ascontiguousarray(y), vjp


def upsample_linear(x: Any, scale: int | tuple[int, ...]) -> Any:
    """Linear interpolation along each spatial axis by an integer factor (bilinear for
    2-D input), as PyTorch's ``"linear"``/``"bilinear"``/``"trilinear"`` modes with
    ``align_corners=False``: output ``i`` samples the input at ``(i + 0.5) / s - 0.5``,
    clamped to the edges."""
    y = x
    for axis, s in enumerate(_factors(x, scale, "upsample_linear"), 1):
        if s > 1:
            y = _linear_axis(y, axis=axis, scale=s)
    return y


def _phases(scale: int) -> list[tuple[int, float]]:
    """Per output phase r: the padded input offset of its left neighbour and the weight of
    the right one. Output ``s*j + r`` samples input ``j + d`` with ``d = (r + .5)/s - .5``
    in (-1/2, 1/2): between ``j - 1`` and ``j`` when d < 0, else ``j`` and ``j + 1``."""
    phases = []
    for r in range(scale):
        d = (r + 0.5) / scale - 0.5
        phases.append((0, 1.0 + d) if d < 0 else (1, d))
    return phases


def _along(axis: int, ndim: int, index: Any) -> tuple[Any, ...]:
    return (slice(None),) * axis + (index,) + (slice(None),) * (ndim - axis - 1)


@primitive
def _linear_axis(x, *, axis, scale):
    xp = module_of(x)
    n = x.shape[axis]
    # Edge padding makes the clamping at both ends the same formula as in the middle.
    first, last = x[_along(axis, x.ndim, slice(0, 1))], x[_along(axis, x.ndim, slice(n - 1, n))]
    xpad = xp.concatenate([first, x, last], axis=axis)
    out_shape = (*x.shape[:axis], n, scale, *x.shape[axis + 1 :])
    y = xp.empty(out_shape, x.dtype)
    phases = _phases(scale)
    for r, (lo, w) in enumerate(phases):
        dst = y[_along(axis + 1, y.ndim, r)]
        np.multiply(xpad[_along(axis, x.ndim, slice(lo, lo + n))], 1.0 - w, out=dst)
        dst += w * xpad[_along(axis, x.ndim, slice(lo + 1, lo + 1 + n))]
    padded_shape = xpad.shape

    def vjp(g, needs):
        g = g.reshape(out_shape)
        gpad = module_of(g).zeros(padded_shape, g.dtype)
        for r, (lo, w) in enumerate(phases):
            gr = g[_along(axis + 1, g.ndim, r)]
            gpad[_along(axis, gpad.ndim, slice(lo, lo + n))] += (1.0 - w) * gr
            gpad[_along(axis, gpad.ndim, slice(lo + 1, lo + 1 + n))] += w * gr
        gx = gpad[_along(axis, gpad.ndim, slice(1, n + 1))].copy()
        gx[_along(axis, gx.ndim, slice(0, 1))] += gpad[_along(axis, gpad.ndim, slice(0, 1))]
        gx[_along(axis, gx.ndim, slice(n - 1, n))] += gpad[_along(axis, gpad.ndim, slice(n + 1, n + 2))]
        return (gx,)

    return y.reshape((*x.shape[:axis], n * scale, *x.shape[axis + 1 :])), vjp


def pixel_shuffle(x: Any, r: int) -> Any:
    """Channels to space: ``(N, *spatial, C * r**d)`` -> ``(N, *(spatial * r), C)`` for d
    spatial axes, the channel ``c * r**d + (i1 * r + i2) ...`` moving to offset
    ``(i1, i2, ...)`` of output channel c: PyTorch's ``pixel_shuffle`` in channels-last
    layout (the same numbers after NCHW <-> NHWC transposes).

    >>> pixel_shuffle(np.arange(4.0).reshape(1, 1, 1, 4), 2)[0, :, :, 0].tolist()
    [[0.0, 1.0], [2.0, 3.0]]
    """
    if not isinstance(r, (int, np.integer)) or r < 1:
        raise ValueError(f"pixel_shuffle: r must be a positive integer, got {r!r}")
    shape = getattr(x, "shape", ())
    d = len(shape) - 2
    if d < 1 or shape[-1] % r**d:
        raise ValueError(f"pixel_shuffle: expected input (N, *spatial, C * {r}**d) with d >= 1 spatial axes, got shape {shape}")
    xp = array_namespace(x)
    n, *sizes, channels = shape
    c = channels // r**d
    y = xp.reshape(x, (n, *sizes, c, *(r,) * d))
    # (N, S1..Sd, C, R1..Rd) -> (N, S1, R1, ..., Sd, Rd, C)
    order = (0, *[a for i in range(d) for a in (1 + i, 2 + d + i)], 1 + d)
    y = xp.permute_dims(y, order)
    return xp.reshape(y, (n, *[size * r for size in sizes], c))

