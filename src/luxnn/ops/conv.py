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

from ..ad.tape import primitive
from .geometry import conv_output_size, per_axis, per_side
from .traits import Area

__all__ = ["conv", "conv_transpose"]

_CONV = Area("conv")

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
