"""The CPU's convolutions (`luxnn.ops.conv`'s kernels for NumPy arrays): im2col + GEMM a
block of images at a time, the blocks shared out to luxnn's threads.

How a call spends its time and memory: blocks of images, each padded (only when padding is
nonzero), its im2col matrix ``(groups, rows, prod(k)*C/groups)`` built from a strided window
view by a single copy, one GEMM per group against the kernel, and the bias and the optional
fused relu on the block's output rows while they are in cache (with the relu, a boolean
mask of where it let its input through, which the backward pass keeps instead of the
output). The blocks run on all of `luxnn.num_threads` at once, the BLAS single-threaded in
each (`luxnn.parallel.for_blocks`), and are sized so that the im2col blocks in flight hold
about 4 MB together: a call never holds the matrix of the whole batch, nor a padded copy of
the whole input. Blocks shared out to threads build their im2col matrices in buffers the
call makes before they start, one per thread, so that the cache sees the same large
requests in the same order every step. The backward pass makes one pass over blocks of
images: the relu mask, the bias gradient, the input gradient (skipped when the input is not
differentiated) and the weight gradient, a GEMM against the block's im2col matrix, rebuilt
rather than kept from the forward pass; each thread sums the weight and bias gradients of
its own blocks, and the sums are added at the end.
At stride 1 the input gradient is itself a correlation: of the output gradient, padded by the
dilated kernel's extent less the forward's padding (cropped where that is negative), with the
flipped kernel; it runs as the forward does. At other strides it is a GEMM, then a col2im
scatter-add: one strided add per kernel offset into the padded input gradient. The first
is the faster: one copy and one GEMM, where the second adds a strided pass per kernel offset.
The transposed convolution runs the same kernels the other way round: its forward is the
GEMM and col2im, its backward the im2col GEMMs of the output gradient.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from ...parallel import cut, for_blocks, matmul, num_threads
from ..geometry import Pairs, by_group, crop_spatial, grouped_kernel, pad_spatial, window_slices

__all__ = ["conv_forward", "conv_backward", "conv_transpose_forward", "conv_transpose_backward"]


def _im2col(
    xpad: Any, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], out: tuple[int, ...], groups: int,
    into: Any = None,
) -> Any:  # fmt: skip
    """The im2col matrix ``(groups, N*prod(out), prod(kernel)*C/groups)`` of `xpad`: a strided
    window view ``(N, *out, *kernel, C)`` of the input, copied once, into the front of the
    flat buffer `into` if given (no copy at all for a 1x1 kernel at stride 1 without groups,
    where the view already is the matrix)."""
    n, c = xpad.shape[0], xpad.shape[-1]
    sn, *ss, sc = xpad.strides
    cg = c // groups
    rows, width = n * math.prod(out), math.prod(kernel) * cg
    cols = None if into is None else into[: groups * rows * width]
    if cg == 1 and out[-1] > kernel[-1]:
        # One channel per group (a first layer on grey images, a depthwise conv): the view's
        # contiguous runs would be one kernel row, a few elements long, so fill the buffer one
        # kernel offset at a time instead, whose runs are whole output rows. 3x faster.
        cols = np.empty(groups * rows * width, xpad.dtype) if cols is None else cols
        grid = cols.reshape(groups, n, *out, *kernel)
        lead = (slice(None),) * (2 + len(out))
        for offset in itertools.product(*map(range, kernel)):
            grid[lead + offset] = np.moveaxis(xpad[window_slices(offset, stride, dilation, out)], -1, 0)
        return cols.reshape(groups, rows, width)
    view = np.lib.stride_tricks.as_strided(
        xpad,
        (n, *out, *kernel, groups, cg),
        (sn, *(a * s for a, s in zip(ss, stride)), *(a * d for a, d in zip(ss, dilation)), cg * sc, sc),
    )
    if groups > 1:
        view = np.moveaxis(view, -2, 0)
    if cols is None or (groups == 1 and all(k == 1 for k in kernel) and all(s == 1 for s in stride) and xpad.flags.c_contiguous):
        return view.reshape(groups, rows, width)  # a copy where the window view is not the matrix already
    np.copyto(cols.reshape(groups, n, *out, *kernel, cg), view.reshape(groups, n, *out, *kernel, cg))
    return cols.reshape(groups, rows, width)


class _ColumnBuffers:
    """A call's im2col buffers, one per thread its blocks are shared out to, made by the
    caller before the blocks start. A block's largest temporary then lies where it lay in
    the step before, whichever thread runs the block when: made by the blocks themselves, in
    an order that varied with the threads' timing, it now and then found no free piece of
    the cache that fitted, and the cache took a new segment from the system late in
    training. Blocks that run one after another on the caller (a single block, one thread)
    make their own, in the same order every time: ``take()`` gives None."""

    def __init__(self, n: int, rows: int, per_image: int, dtype: Any) -> None:
        """For blocks of at most `rows` of `n` images, `per_image` elements each, as
        `luxnn.parallel.for_blocks` cuts them (`luxnn.parallel.cut`)."""
        blocks, threads = cut(n, rows), num_threads()
        shared = len(blocks) > 1 and threads > 1
        size = max(hi - lo for lo, hi in blocks) * per_image
        self._free = [np.empty(size, dtype) for _ in range(min(len(blocks), threads))] if shared else None
        self._lock = threading.Lock()

    def take(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext() if self._free is None else self._take()

    @contextlib.contextmanager
    def _take(self) -> Iterator[Any]:
        with self._lock:
            buffer = self._free.pop()
        try:
            yield buffer
        finally:
            with self._lock:
                self._free.append(buffer)


def _channel_sum(g: Any, channels: int) -> Any:
    """Bias gradient: `g` summed over all axes but the last, as a GEMV (several times
    faster than NumPy's column sum of a tall matrix)."""
    g2 = g.reshape(-1, channels)
    return np.ones(g2.shape[0], g2.dtype) @ g2


# Images per block: about this many bytes of im2col columns (or of output rows, if more),
# so that a block is still in cache when its GEMM, its bias and relu or its col2im read it,
# and a call holds one block, never the whole matrix. Measured on the CNN: faster
# than one im2col and one GEMM over the batch, and 14 MB less peak memory.
_BLOCK_BYTES = 4 << 20


def _blocks(n: int, bytes_per_image: int) -> list[tuple[int, int]]:
    step = max(1, _BLOCK_BYTES // max(1, bytes_per_image))
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


def _block_images(bytes_per_image: int) -> int:
    """Images per block: the blocks run on all threads at once, and those in flight hold
    about `_BLOCK_BYTES` of im2col matrix together, as one block does on one thread."""
    return max(1, _BLOCK_BYTES // num_threads() // max(1, bytes_per_image))


def _accumulate(sums: dict, key: Any, value: Any) -> None:
    if key in sums:
        sums[key] += value
    else:
        sums[key] = value


def _matmul_into(out: Any, a: Any, b: Any, accumulate: bool) -> None:
    """``out = a @ b``, or ``out += a @ b``; `out` may be a strided view (BLAS writes it)."""
    if accumulate:
        out += matmul(a, b)
    else:
        matmul(a, b, out=out)


def _col2im_add(target: Any, cols: Any, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], out: tuple[int, ...], groups: int) -> None:
    """The adjoint of `_im2col`: scatter-add `cols` ``(groups, n*prod(out), prod(kernel)*C/groups)``
    into `target` ``(n, *spatial, C)`` (padded), one strided add per kernel offset."""
    n, c = target.shape[0], target.shape[-1]
    grouped = target.reshape(*target.shape[:-1], groups, c // groups)
    # (groups, n, *out, *kernel, C/groups) -> (n, *out, *kernel, groups, C/groups), a view.
    src = np.moveaxis(cols.reshape(groups, n, *out, *kernel, c // groups), 0, -2)
    lead = (slice(None),) * (1 + len(kernel))
    for offset in itertools.product(*map(range, kernel)):
        dst = grouped[window_slices(offset, stride, dilation, out)]
        dst += src[lead + offset]


def _gemm_col2im(a: Any, wg: Any, padded_shape: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], out: tuple[int, ...], groups: int, dtype: Any) -> Any:
    """col2im of ``a @ wg^T`` into a zero array of `padded_shape` ``(N, *spatial, C)``: `a`
    ``(groups, N*prod(out), c)``, `wg` ``(groups, prod(kernel)*C/groups, c)``; a block of
    images at a time."""
    per_image = math.prod(out)
    target = np.zeros(padded_shape, dtype)
    wt = wg.transpose(0, 2, 1)
    for n0, n1 in _blocks(padded_shape[0], per_image * wg.shape[1] * groups * np.dtype(dtype).itemsize):
        cols = matmul(a[:, n0 * per_image : n1 * per_image], wt).astype(dtype, copy=False)
        _col2im_add(target[n0:n1], cols, kernel, stride, dilation, out, groups)
        del cols  # before the next block is computed
    return target


def _pad_or_crop(x: Any, padding: Pairs) -> Any:
    """`x` ``(N, *spatial, C)`` padded by `padding`, a negative pad cropping that side instead;
    `x` itself, or a view of it, when nothing is padded."""
    crop = (slice(None), *(slice(max(-lo, 0), n - max(-hi, 0)) for n, (lo, hi) in zip(x.shape[1:-1], padding)), slice(None))
    return pad_spatial(x[crop], tuple((max(lo, 0), max(hi, 0)) for lo, hi in padding))


def _correlate(
    x: Any, padding: Pairs, wg: Any, y: Any, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], groups: int,
    into: Any = None,
) -> None:  # fmt: skip
    """The cross-correlation of `x` ``(n, *spatial, C)``, padded by `padding` (see
    `_pad_or_crop`), with the grouped kernel `wg` ``(groups, prod(kernel)*C/groups, O/groups)``,
    written into `y` ``(n, *out, O)``: one im2col matrix, one GEMM per group. Called with a
    block of images, so that the matrix, about ``prod(kernel)`` times `x`, stays small."""
    cols = _im2col(_pad_or_crop(x, padding), kernel, stride, dilation, y.shape[1:-1], groups, into)
    matmul(cols, wg, out=by_group(y, groups))


def _im2col_gemms(
    xpad: Any, kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...], out: tuple[int, ...], groups: int,
    forward: tuple[Any, Any] | None = None, weight_grad: tuple[Any, Any] | None = None,
) -> None:  # fmt: skip
    """The GEMMs against the im2col matrix of `xpad`, built a block of images at a time:
    ``forward = (wg, yg)``: ``yg = cols @ wg`` (`yg` ``(groups, rows, c)``, a view it writes);
    ``weight_grad = (gg, dwg)``: ``dwg = cols^T @ gg`` (`dwg` ``(groups, width, c)``)."""
    per_image = math.prod(out)
    width = math.prod(kernel) * xpad.shape[-1]
    for i, (n0, n1) in enumerate(_blocks(xpad.shape[0], per_image * width * xpad.itemsize)):
        cols = _im2col(xpad[n0:n1], kernel, stride, dilation, out, groups)
        rows = slice(n0 * per_image, n1 * per_image)
        if forward is not None:
            wg, yg = forward
            matmul(cols, wg, out=yg[:, rows])
        if weight_grad is not None:
            gg, dwg = weight_grad
            _matmul_into(dwg, cols.transpose(0, 2, 1), gg[:, rows], accumulate=i > 0)
        del cols  # before the next block is built


def _flipped_kernel(w: Any, groups: int) -> Any:
    """The kernel ``(*k, O/groups, C)`` of the correlation that is the input gradient of a
    stride-1 correlation with `w` ``(*k, C/groups, O)``: `w` flipped along its spatial axes,
    its input and output channels swapped within each group. A copy, of the kernel's size."""
    k, (cg, o) = w.shape[:-2], w.shape[-2:]
    wf = w[(slice(None, None, -1),) * len(k)].reshape(*k, cg, groups, o // groups)
    return np.swapaxes(wf, -3, -1).reshape(*k, o // groups, groups * cg)


def _image_bytes(x: Any, w: Any, out: tuple[int, ...], itemsize: int) -> int:
    """Bytes per image of a correlation's larger block: its im2col rows or its output rows."""
    return math.prod(out) * max(math.prod(w.shape[: x.ndim - 2]) * x.shape[-1], w.shape[-1]) * itemsize


def conv_forward(x, w, b, stride, padding, dilation, groups, relu, out):
    """The correlation ``(N, *out, O)`` of `luxnn.ops.conv`, with its bias and relu, and the
    mask of where the relu let its input through (None without relu)."""
    kernel = w.shape[: x.ndim - 2]
    n, c, o = x.shape[0], x.shape[-1], w.shape[-1]
    per_image = math.prod(out)
    wg = grouped_kernel(w, groups)
    y = np.empty((n, *out, o), np.result_type(x.dtype, w.dtype))
    # NumPy broadcasts a row of O channels (or a scalar, for maximum) with slow short inner
    # loops; one image's worth of bias or zeros is a long contiguous row, 2.5-4x faster.
    bias_row = None if b is None else np.tile(b.astype(y.dtype, copy=False), per_image)
    zero_row = np.zeros(per_image * o, y.dtype) if relu else None
    # Where the relu let its input through: the backward pass's mask, a quarter of y's
    # bytes (of float32), made while each block is in cache; the VJP keeps it, not y.
    passed = np.empty(y.shape, bool) if relu else None
    rows = _block_images(_image_bytes(x, w, out, y.itemsize))
    buffers = _ColumnBuffers(n, rows, per_image * math.prod(kernel) * c, x.dtype)

    def forward(n0, n1):
        with buffers.take() as cols:
            _correlate(x[n0:n1], padding, wg, y[n0:n1], kernel, stride, dilation, groups, cols)
        per_row = y[n0:n1].reshape(n1 - n0, per_image * o)
        if b is not None:
            per_row += bias_row
        if relu:
            np.greater(per_row, zero_row, out=passed[n0:n1].reshape(per_row.shape))
            np.maximum(per_row, zero_row, out=per_row)

    for_blocks(forward, y, rows=rows, blas=True)
    return y, passed


def conv_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out):
    """The gradients ``(dx, dw, db)`` of `conv_forward` (None where `needs` says not)."""
    # One pass over the blocks does everything a block of images needs: its relu mask
    # (never one of the whole batch), bias gradient, input gradient and weight gradient
    # (the im2col block rebuilt rather than kept from the forward pass: as fast, the block
    # being in cache, and between the passes the call keeps only its input).
    passed = residual
    kernel = w.shape[: x.ndim - 2]
    n, in_sizes, c, o = x.shape[0], x.shape[1:-1], x.shape[-1], w.shape[-1]
    per_image = math.prod(out)
    wg = grouped_kernel(w, groups)
    g = np.ascontiguousarray(g)
    dx = dxpad = None
    block_bytes = _image_bytes(x, w, out, np.result_type(x.dtype, w.dtype).itemsize)
    cols_per_image = per_image * math.prod(kernel) * c if needs[1] else 0
    if needs[0] and all(s == 1 for s in stride):
        # dx[i] = sum_k g[i - k*dilation + low]·w[k]: the correlation of g, padded by the
        # dilated kernel's extent less the forward's padding, with the flipped kernel,
        # which the forward's im2col GEMM computes faster than a GEMM and a col2im would.
        extent = tuple(d * (k - 1) for k, d in zip(kernel, dilation))
        g_padding = tuple((e - lo, e - hi) for e, (lo, hi) in zip(extent, padding))
        wf = grouped_kernel(_flipped_kernel(w, groups), groups)
        dx = np.empty(x.shape, g.dtype)
        block_bytes = max(block_bytes, math.prod(in_sizes) * math.prod(kernel) * o * g.itemsize)
        cols_per_image = max(cols_per_image, math.prod(in_sizes) * math.prod(kernel) * o)
    elif needs[0]:
        dxpad = np.zeros((n, *(s + lo + hi for s, (lo, hi) in zip(in_sizes, padding)), c), g.dtype)
        dx = crop_spatial(dxpad, in_sizes, padding)
    # The weight and bias gradients sum over every block: each thread sums its own blocks.
    dw_sums, db_sums = {}, {}

    rows = _block_images(block_bytes)
    buffers = _ColumnBuffers(n, rows, cols_per_image, np.result_type(x.dtype, g.dtype))

    def backward(n0, n1):
        gb = g[n0:n1] * passed[n0:n1] if passed is not None else g[n0:n1]
        ggb = by_group(gb, groups)
        thread = threading.get_ident()
        with buffers.take() as cols:
            if dxpad is not None:
                _col2im_add(dxpad[n0:n1], matmul(ggb, wg.transpose(0, 2, 1)), kernel, stride, dilation, out, groups)
            elif dx is not None:
                _correlate(gb, g_padding, wf, dx[n0:n1], kernel, stride, dilation, groups, cols)
            if needs[1]:
                xcols = _im2col(_pad_or_crop(x[n0:n1], padding), kernel, stride, dilation, out, groups, cols)
                _accumulate(dw_sums, thread, matmul(xcols.transpose(0, 2, 1), ggb))
        if needs[2]:
            _accumulate(db_sums, thread, _channel_sum(gb, o))

    for_blocks(backward, g, rows=rows, blas=True)
    dw = np.zeros(w.shape, g.dtype) if needs[1] else None
    db = np.zeros(o, g.dtype) if needs[2] else None
    for part in dw_sums.values():
        by_group(dw, groups)[...] += part
    for part in db_sums.values():
        db += part
    return dx, dw, db


def _transpose_target(x, w, stride, padding, dilation, groups, out) -> tuple[tuple[int, ...], Pairs]:
    """The shape ``(N, *spatial, O)`` of a transposed convolution's col2im target, which
    covers the full output and the output padding beyond it, and the ``(low, high)`` crop
    per axis that takes it to the output of spatial sizes `out`."""
    kernel = w.shape[: x.ndim - 2]
    full = tuple((i - 1) * s + d * (k - 1) + 1 for i, k, s, d in zip(x.shape[1:-1], kernel, stride, dilation))
    padded = (x.shape[0], *(max(f, lo + s) for f, (lo, _), s in zip(full, padding, out)), w.shape[-2] * groups)
    return padded, tuple((lo, p - lo - s) for (lo, _), p, s in zip(padding, padded[1:-1], out))


def conv_transpose_forward(x, w, b, stride, padding, dilation, groups, relu, out):
    """The transposed convolution ``(N, *out, O)`` of `luxnn.ops.conv_transpose`, with its
    bias and relu; its residual is the output when the relu is fused (None otherwise)."""
    padded, crop = _transpose_target(x, w, stride, padding, dilation, groups, out)
    wg = grouped_kernel(w, groups)  # the kernel of the convolution O -> C, grouped
    dtype = np.result_type(x.dtype, w.dtype)
    kernel = w.shape[: x.ndim - 2]
    target = _gemm_col2im(by_group(x, groups), wg, padded, kernel, stride, dilation, x.shape[1:-1], groups, dtype)
    y = crop_spatial(target, out, crop)
    y = y + b if b is not None else np.ascontiguousarray(y)
    if relu:
        np.maximum(y, 0, out=y)
    return y, y if relu else None


def conv_transpose_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out):
    """The gradients ``(dx, dw, db)`` of `conv_transpose_forward` (None where `needs` says
    not): the im2col GEMMs of the output gradient."""
    _, crop = _transpose_target(x, w, stride, padding, dilation, groups, out)
    dtype = np.result_type(x.dtype, w.dtype)
    g = g * (residual > 0) if residual is not None else np.ascontiguousarray(g)
    gpad = pad_spatial(g, crop)
    dx = np.empty(x.shape, dtype) if needs[0] else None
    # An empty batch has no blocks to write the weight gradient: it is zero.
    dw = (np.empty if x.shape[0] else np.zeros)(w.shape, dtype) if needs[1] else None
    _im2col_gemms(
        gpad, w.shape[: x.ndim - 2], stride, dilation, x.shape[1:-1], groups,
        forward=(grouped_kernel(w, groups), by_group(dx, groups)) if needs[0] else None,
        weight_grad=(by_group(x, groups), by_group(dw, groups)) if needs[1] else None,
    )  # fmt: skip
    db = _channel_sum(g, g.shape[-1]) if needs[2] else None
    return dx, dw, db
