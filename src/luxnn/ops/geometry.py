"""The geometry of windows over spatial axes, shared by convolutions and pooling on every
device: output sizes, padding and cropping, the slices a window offset reads, per-axis
and per-side arguments, the kernel and arrays by group, adaptive pooling's bins.
Channels last: ``(N, *spatial, C)``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..backend import module_of

__all__ = [
    "Pairs", "conv_output_size", "pad_spatial", "crop_slices", "crop_spatial", "window_slices", "grouped_kernel",
    "by_group", "per_axis", "per_side", "adaptive_bins",
]  # fmt: skip

Pairs = tuple[tuple[int, int], ...]


def conv_output_size(size: int, kernel: int, stride: int, dilation: int, padding: tuple[int, int]) -> int:
    """Output length of a convolution (or pooling window) along one axis; < 1 when the
    dilated kernel is larger than the padded input."""
    return (size + padding[0] + padding[1] - dilation * (kernel - 1) - 1) // stride + 1


def pad_spatial(x: Any, padding: Pairs, value: float = 0.0) -> Any:
    """`x` ``(N, *spatial, C)`` padded with `value` on each spatial side; `x` itself when
    there is no padding."""
    if not any(lo or hi for lo, hi in padding):
        return x
    shape = (x.shape[0], *(n + lo + hi for n, (lo, hi) in zip(x.shape[1:-1], padding)), x.shape[-1])
    out = module_of(x).empty(shape, x.dtype)
    out[crop_slices(x.shape[1:-1], padding)] = x
    # Only the borders need the value: one slab at each end of each spatial axis.
    for axis, (lo, hi) in enumerate(padding, 1):
        lead = (slice(None),) * axis
        out[lead + (slice(0, lo),)] = value
        out[lead + (slice(shape[axis] - hi, shape[axis]),)] = value
    return out


def crop_slices(sizes: tuple[int, ...], padding: Pairs) -> tuple[slice, ...]:
    """The index of the unpadded region (of spatial `sizes`) inside a padded array."""
    return (slice(None), *(slice(lo, lo + n) for n, (lo, _) in zip(sizes, padding)), slice(None))


def crop_spatial(xpad: Any, sizes: tuple[int, ...], padding: Pairs) -> Any:
    """The view of `xpad` that `pad_spatial` filled from an input of spatial `sizes`."""
    if not any(lo or hi for lo, hi in padding):
        return xpad
    return xpad[crop_slices(sizes, padding)]


def window_slices(offset: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], out: tuple[int, ...]) -> tuple[slice, ...]:
    """Index of the ``(N, *out, C)`` elements that kernel offset `offset` reads from a
    padded input: element ``o`` along an axis sits at ``o * stride + offset * dilation``."""
    return (
        slice(None),
        *(slice(k * d, k * d + s * (o - 1) + 1, s) for k, s, d, o in zip(offset, stride, dilation, out)),
        slice(None),
    )


def grouped_kernel(w: Any, groups: int) -> Any:
    """Kernel ``(*k, Cin/groups, Cout)`` as ``(groups, prod(k)*Cin/groups, Cout/groups)``, a view:
    output channel ``o`` belongs to group ``o // (Cout/groups)``, as in PyTorch."""
    return w.reshape(-1, groups, w.shape[-1] // groups).transpose(1, 0, 2)


def by_group(a: Any, groups: int) -> Any:
    """``(..., groups * c)`` as a ``(groups, rows, c)`` view of its contiguous data."""
    a = a.reshape(-1, groups, a.shape[-1] // groups)
    return a.transpose(1, 0, 2)


def per_axis(value: Any, r: int) -> tuple[int, ...]:
    """An int or a sequence, as one int per spatial axis (`r` of them)."""
    return (int(value),) * r if isinstance(value, (int, np.integer)) else tuple(int(v) for v in value)


def per_side(padding: Any, r: int) -> Pairs:
    """Padding as an int, one int per axis or one ``(low, high)`` pair per axis, as pairs."""
    if isinstance(padding, (int, np.integer)):
        return ((int(padding), int(padding)),) * r
    return tuple((p, p) if isinstance(p, (int, np.integer)) else (int(p[0]), int(p[1])) for p in padding)


def adaptive_bins(size: int, out: int) -> tuple[tuple[int, int], ...]:
    """PyTorch's adaptive pooling windows ``[floor(i * size / out), ceil((i + 1) * size / out))``
    for ``i < out``: they cover the axis, neighbours overlapping when `out` does not divide
    `size`.

    >>> adaptive_bins(5, 3)
    ((0, 2), (1, 4), (3, 5))
    """
    return tuple((i * size // out, -(-(i + 1) * size // out)) for i in range(out))
