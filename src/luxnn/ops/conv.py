"""Convolution primitives: N-d cross-correlation and its transpose, as im2col + GEMM.

Layouts (channels last, as luxnn's layers): input ``(N, *spatial, C)``; `conv` kernel
``(*k, C/groups, O)``; `conv_transpose` kernel ``(*k, O/groups, C)``, which is the kernel of
the convolution ``O -> C`` whose input gradient the transposed convolution is (the layout of
Flux/Lux's ConvTranspose, and PyTorch's ``(C, O/groups, *k)`` transposed). The primitives
take their static configuration normalised (`stride` and `dilation` one entry per spatial
axis, `padding` one ``(low, high)`` pair per axis); `conv` and `conv_transpose` normalise it.

This module is the device-neutral part: the configuration, the output sizes, the layout
helpers and the VJP wiring. The work runs in the implementation of the arrays' device
(`luxnn.ops.traits`): ``ops/cpu/conv.py`` (blocks of images in cache on luxnn's threads)
and ``ops/cuda/conv.py`` (whole-batch im2col and col2im kernels and GEMMs). Each exports

- ``conv_forward(x, w, b, stride, padding, dilation, groups, relu, out) -> (y, residual)``
- ``conv_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out) -> (dx, dw, db)``
- ``conv_transpose_forward(...)`` and ``conv_transpose_backward(...)``, with the same parameters,

where `out` is the output's spatial sizes and `residual` what the backward pass needs of
the forward's besides its inputs (where a fused relu let its input through).

>>> import numpy as np
>>> x = np.ones((1, 5, 5, 2), np.float32); w = np.ones((3, 3, 2, 4), np.float32)
>>> conv(x, w, padding=1).shape
(1, 5, 5, 4)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from .traits import Area

__all__ = [
    "conv", "conv_transpose", "conv_output_size", "window_slices", "pad_spatial", "crop_spatial", "per_axis",
    "per_side", "grouped_kernel", "by_group",
]  # fmt: skip

_CONV = Area("conv")

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


def conv(
    x: Any, w: Any, b: Any = None, *, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1, relu: bool = False
) -> Any:
    """Cross-correlation of `x` ``(N, *spatial, C)`` with kernel `w` ``(*k, C/groups, O)``,
    plus bias `b` ``(O,)`` if given: ``(N, *out, O)`` with
    ``out = (spatial + low + high - dilation*(k-1) - 1) // stride + 1``.

    `stride`, `dilation`: an int or one per spatial axis; `padding`: an int, one per axis,
    or one ``(low, high)`` pair per axis. ``relu=True`` applies relu to the result in place
    (and its derivative in the backward pass), saving a pass and an array. The `Conv` layer
    checks shapes; this does not.
    """
    r = x.ndim - 2
    return _conv(
        x, w, b, stride=per_axis(stride, r), padding=per_side(padding, r), dilation=per_axis(dilation, r),
        groups=groups, relu=relu,
    )  # fmt: skip


def conv_transpose(
    x: Any, w: Any, b: Any = None, *, stride: Any = 1, padding: Any = 0, dilation: Any = 1, groups: int = 1,
    output_padding: Any = 0, relu: bool = False,
) -> Any:  # fmt: skip
    """Transposed convolution of `x` ``(N, *spatial, C)`` with kernel `w` ``(*k, O/groups, C)``:
    the input gradient of ``conv(·, w)`` (the convolution ``O -> C``), as PyTorch's
    ``conv_transpose``. Output ``(N, *out, O)`` with
    ``out = (spatial - 1)*stride - low - high + dilation*(k-1) + 1 + output_padding``;
    `output_padding` extends the high side. Arguments as for `conv`.
    """
    r = x.ndim - 2
    return _conv_transpose(
        x, w, b, stride=per_axis(stride, r), padding=per_side(padding, r), dilation=per_axis(dilation, r),
        groups=groups, output_padding=per_axis(output_padding, r), relu=relu,
    )  # fmt: skip


@primitive
def _conv(x, w, b, *, stride, padding, dilation, groups, relu):
    kernel = w.shape[: x.ndim - 2]
    out = tuple(conv_output_size(*args) for args in zip(x.shape[1:-1], kernel, stride, dilation, padding))
    device = _CONV[type(x)]
    y, residual = device.conv_forward(x, w, b, stride, padding, dilation, groups, relu, out)

    def vjp(g, needs):
        return device.conv_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out)

    return y, vjp


@primitive
def _conv_transpose(x, w, b, *, stride, padding, dilation, groups, output_padding, relu):
    kernel = w.shape[: x.ndim - 2]
    out = tuple(
        (i - 1) * s + d * (k - 1) + 1 - lo - hi + e
        for i, k, s, d, (lo, hi), e in zip(x.shape[1:-1], kernel, stride, dilation, padding, output_padding)
    )  # fmt: skip
    device = _CONV[type(x)]
    y, residual = device.conv_transpose_forward(x, w, b, stride, padding, dilation, groups, relu, out)

    def vjp(g, needs):
        return device.conv_transpose_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out)

    return y, vjp
