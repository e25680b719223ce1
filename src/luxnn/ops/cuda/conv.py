"""CUDA's convolutions (`luxnn.ops.conv`'s kernels for CuPy arrays): the whole batch's
im2col in one kernel, one GEMM (a batched GEMM over the groups), and the bias and relu in
one epilogue kernel.

- im2col (`IM2COL`): one thread per column element reads its input element, or 0 in the
  padding (the padding lives in the index arithmetic: no padded copy).
- col2im (`COL2IM`), for the input gradient and the transposed convolution's forward: one
  thread per input element sums the column entries that read it, kernel offsets in
  row-major order: no atomics, the same bits every run. It adds the transposed
  convolution's bias and relu on the way.
- The epilogue (`EPILOGUE`) puts the GEMM's grouped output in place with the bias and the
  relu, and the mask of where the relu let its input through; `BY_GROUP` takes the output
  gradient through that mask into the grouped layout the backward GEMMs read.

With one group every GEMM is 2-D (cuBLAS takes transposed operands as they are); with
several, a strided batched GEMM, for which CuPy copies operands that are not C-contiguous,
so the im2col kernel writes the matrix the weight gradient needs transposed. A call holds
the column matrix of the whole batch, or, above `COLUMN_BYTES`, of as few blocks of images
as keep it under that. The kernels take three spatial axes; one or two get leading axes of
size one.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..geometry import grouped_kernel, window_slices
from . import gemm

__all__ = ["conv_forward", "conv_backward", "conv_transpose_forward", "conv_transpose_backward"]

AXES = 3  # the spatial axes the kernels take

# The most bytes of column matrix a call holds at once: about a quarter of what PyTorch's
# eager CNN of the bench reserves in all, so that the step's peak stays well under half.
COLUMN_BYTES = 64 << 20

# The kernels' geometry, after their arrays: the images, the channels of the convolution's
# input and its groups, then per axis (depth, height, width) the input size, the output
# size, the kernel, the stride, the dilation and the low padding.
_GEOMETRY = ("int64 batch, int64 channels, int64 groups, int64 n0, int64 n1, int64 n2, int64 o0, int64 o1, "
             "int64 o2, int64 k0, int64 k1, int64 k2, int64 s0, int64 s1, int64 s2, int64 d0, int64 d1, int64 d2, "
             "int64 p0, int64 p1, int64 p2")

_SIZES = r"""
    const long long cg = channels / groups, width = k0 * k1 * k2 * cg;
    const long long rows = batch * o0 * o1 * o2;
"""


def split_index(names: tuple[str, ...], extents: tuple[str, ...]) -> str:
    """C statements splitting an elementwise kernel's loop index ``i`` over a C-contiguous
    array into its coordinates `names` (outermost first) of `extents` (C expressions; the
    outermost one's is not needed)."""
    lines = ["long long rest = i;"]
    for name, extent in zip(names[:0:-1], extents[:0:-1]):
        lines.append(f"const long long {name} = rest % {extent}; rest /= {extent};")
    return "\n".join([*lines, f"const long long {names[0]} = rest;", ""])


class _Geometry:
    """A convolution's shape in the kernels' terms (`_GEOMETRY`), for blocks of images."""

    def __init__(self, channels: int, groups: int, sizes: tuple[int, ...], out: tuple[int, ...], kernel: tuple[int, ...],
                 stride: tuple[int, ...], dilation: tuple[int, ...], padding: Any) -> None:
        r = len(sizes)
        if r > AXES:
            raise NotImplementedError(f"convolutions of CuPy arrays: 1 to {AXES} spatial axes (as cuDNN's), got {r}")
        lead = AXES - r
        per_axis = (sizes, out, kernel, stride, dilation)
        self.axes = (*((1,) * lead + tuple(v) for v in per_axis), (0,) * lead + tuple(lo for lo, _ in padding))
        self.channels, self.groups = channels, groups
        self.width = math.prod(kernel) * channels // groups  # of the column matrix of each group

    def args(self, batch: int) -> tuple:
        return (batch, self.channels, self.groups, *(v for values in self.axes for v in values))


def _twin_geometry(args: tuple) -> tuple[int, int, int, list[tuple[int, ...]]]:
    batch, channels, groups, *axes = (int(a) for a in args)
    return batch, channels, groups, [tuple(axes[i * AXES : (i + 1) * AXES]) for i in range(6)]


def _twin_padded(x: np.ndarray, args: tuple) -> tuple[np.ndarray, tuple, tuple, tuple, tuple, int, int]:
    """`x` as ``(batch, *sizes, channels)``, zero-padded to hold every window."""
    batch, channels, groups, (sizes, out, kernel, stride, dilation, low) = _twin_geometry(args)
    high = [max((o - 1) * s + (k - 1) * d + 1 - p - n, 0) for n, o, k, s, d, p in zip(sizes, out, kernel, stride, dilation, low)]
    spatial = [(0, 0), *zip(low, high), (0, 0)]
    return np.pad(x.reshape(batch, *sizes, channels), spatial), out, kernel, stride, dilation, groups, channels


def _im2col_twin(x, *args):
    *geometry, by_column, cols = args
    xpad, out, kernel, stride, dilation, groups, channels = _twin_padded(x, tuple(geometry))
    batch, cg = xpad.shape[0], channels // groups
    grid = np.empty((groups, batch, *out, *kernel, cg), x.dtype)
    lead = (slice(None),) * (2 + AXES)
    for offset in itertools.product(*map(range, kernel)):
        window = xpad[window_slices(offset, stride, dilation, out)]  # (batch, *out, channels)
        grid[lead + offset] = np.moveaxis(window.reshape(*window.shape[:-1], groups, cg), -2, 0)
    matrix = grid.reshape(groups, batch * math.prod(out), -1)
    cols.reshape(-1)[...] = (matrix.transpose(0, 2, 1) if by_column else matrix).reshape(-1)


def _col2im_twin(cols, bias, *args):
    *geometry, has_bias, relu, dx = args
    batch, channels, groups, (sizes, out, kernel, stride, dilation, low) = _twin_geometry(tuple(geometry))
    target, *_ = _twin_padded(np.zeros(batch * math.prod(sizes) * channels, dx.dtype), tuple(geometry))
    cg = channels // groups
    grid = cols.reshape(groups, batch, *out, *kernel, cg)
    lead = (slice(None),) * (2 + AXES)
    grouped = target.reshape(*target.shape[:-1], groups, cg)
    for offset in itertools.product(*map(range, kernel)):  # the kernel threads' order
        dst = grouped[window_slices(offset, stride, dilation, out)]
        dst += np.moveaxis(grid[lead + offset], 0, -2)
    y = target[(slice(None), *(slice(p, p + n) for p, n in zip(low, sizes)), slice(None))]
    if has_bias:
        y = y + bias
    if relu:
        y = np.maximum(y, 0)
    dx.reshape(y.shape)[...] = y


# Each column element (group, row, kernel offset * C/groups + channel), or with `by_column`
# the matrix transposed per group: the input element it reads, 0 in the padding.
IM2COL = Elementwise(
    "luxnn_im2col", f"raw T x, {_GEOMETRY}, bool by_column", "T cols",
    _SIZES + r"""
    long long j = i, g, r, col;
    if (by_column) {
        r = j % rows; j /= rows;
        col = j % width; g = j / width;
    } else {
        col = j % width; j /= width;
        r = j % rows; g = j / rows;
    }
    const long long ci = col % cg, kf = col / cg;
    const long long kw = kf % k2, kh = (kf / k2) % k1, kd = kf / (k1 * k2);
    const long long ow = r % o2, oh = (r / o2) % o1, od = (r / (o1 * o2)) % o0, n = r / (o0 * o1 * o2);
    const long long id = od * s0 + kd * d0 - p0, ih = oh * s1 + kh * d1 - p1, iw = ow * s2 + kw * d2 - p2;
    const bool inside = id >= 0 && id < n0 && ih >= 0 && ih < n1 && iw >= 0 && iw < n2;
    cols = inside ? x[(((n * n0 + id) * n1 + ih) * n2 + iw) * channels + g * cg + ci] : (T)0;
    """,
    twin=_im2col_twin,
)  # fmt: skip

# Each input element: the sum of the column entries that read it (kernel offsets in row-major
# order), plus the bias of its channel if `has_bias`, through relu if `relu`.
COL2IM = Elementwise(
    "luxnn_col2im", f"raw T cols, raw T bias, {_GEOMETRY}, bool has_bias, bool relu", "T dx",
    _SIZES + split_index(("n", "id", "ih", "iw", "c"), ("", "n0", "n1", "n2", "channels")) + r"""
    const long long g = c / cg, ci = c % cg;
    T total = 0;
    for (long long kd = 0; kd < k0; ++kd) {
        const long long td = id + p0 - kd * d0;
        if (td < 0 || td % s0 != 0 || td / s0 >= o0) continue;
        for (long long kh = 0; kh < k1; ++kh) {
            const long long th = ih + p1 - kh * d1;
            if (th < 0 || th % s1 != 0 || th / s1 >= o1) continue;
            for (long long kw = 0; kw < k2; ++kw) {
                const long long tw = iw + p2 - kw * d2;
                if (tw < 0 || tw % s2 != 0 || tw / s2 >= o2) continue;
                const long long r = ((n * o0 + td / s0) * o1 + th / s1) * o2 + tw / s2;
                total += cols[(g * rows + r) * width + ((kd * k1 + kh) * k2 + kw) * cg + ci];
            }
        }
    }
    if (has_bias) total += bias[c];
    if (relu && total < (T)0) total = (T)0;
    dx = total;
    """,
    twin=_col2im_twin,
)  # fmt: skip


def _epilogue_twin(yg, bias, channels, groups, rows, has_bias, relu, y, passed):
    v = np.array(yg.reshape(groups, rows, channels // groups).transpose(1, 0, 2).reshape(rows, channels))
    if has_bias:
        v = v + bias
    if relu:
        passed.reshape(v.shape)[...] = v > 0
        v = np.maximum(v, 0)
    y.reshape(v.shape)[...] = v


# Each output element (row, channel) from the grouped GEMM result (group, row, channel in
# group), plus the bias if `has_bias`; with `relu`, through relu, and whether it passed.
EPILOGUE = Elementwise(
    "luxnn_conv_epilogue", "raw T yg, raw T bias, int64 channels, int64 groups, int64 rows, bool has_bias, bool relu",
    "T y, raw bool passed",
    r"""
    const long long o = i % channels, r = i / channels, og = channels / groups;
    T v = yg[((o / og) * rows + r) * og + o % og];
    if (has_bias) v += bias[o];
    if (relu) {
        passed[i] = v > (T)0;
        if (v < (T)0) v = (T)0;
    }
    y = v;
    """,
    twin=_epilogue_twin,
)  # fmt: skip


def _by_group_twin(g, keep, channels, groups, rows, masked, gg):
    v = g.reshape(rows, channels) * (keep.reshape(rows, channels) > 0) if masked else g.reshape(rows, channels)
    gg.reshape(groups, rows, -1)[...] = v.reshape(rows, groups, -1).transpose(1, 0, 2)


# Each grouped gradient element (group, row, channel in group) from the output gradient
# (row, channel); with `masked`, times whether `keep` (the relu's mask or output) is > 0.
BY_GROUP = Elementwise(
    "luxnn_conv_by_group", "raw T g, raw M keep, int64 channels, int64 groups, int64 rows, bool masked", "T gg",
    r"""
    const long long og = channels / groups;
    const long long src = ((i / og) % rows) * channels + (i / (og * rows)) * og + i % og;
    gg = masked ? (T)(g[src] * (T)(keep[src] > (M)0)) : g[src];  // one type on both sides (float16's product is a float)
    """,
    twin=_by_group_twin,
)  # fmt: skip


def _blocks(n: int, bytes_per_image: int) -> list[tuple[int, int]]:
    """As few blocks of the `n` images as keep each one's column matrix within `COLUMN_BYTES`."""
    count = min(max(1, -(-n * bytes_per_image // COLUMN_BYTES)), n)
    step = -(-n // count) if n else 1
    return [(n0, min(n, n0 + step)) for n0 in range(0, n, step)]


def _gemm(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` per group: `a` ``(groups, m, k)``, `b` ``(groups, k, n)``: one cuBLAS call."""
    xp = module_of(a)
    if a.shape[0] == 1:
        return gemm.matmul(a[0], b[0], out=None if out is None else out[0])[None]
    return gemm.matmul(xp.ascontiguousarray(a), xp.ascontiguousarray(b), out=out)


def _bias_gradient_into(db: Any, gg: Any, accumulate: bool) -> None:
    """``db (groups * c,) = gg.sum(rows)`` of `gg` ``(groups, rows, c)``, or ``+=``. One
    group: a GEMV against ones, as the CPU computes it, so that the simulated device gives
    the CPU's bits (a bias whose gradient is rounding noise, as a convolution's before a
    norm, would otherwise lead Adam elsewhere); several: a sum over the rows."""
    xp = module_of(gg)
    if gg.shape[0] == 1:
        part = gemm.matmul(xp.ones(gg.shape[1], gg.dtype), gg[0], out=None if accumulate else db)
    else:
        part = gg.sum(axis=1, out=None if accumulate else db.reshape(gg.shape[0], -1))
    if accumulate:
        db += part.reshape(db.shape)


def _operands(dtype: Any, *arrays: Any) -> list[Any]:
    xp = module_of(arrays[0])
    return [None if a is None else xp.ascontiguousarray(a.astype(dtype, copy=False)) for a in arrays]


def _absent(xp: Any, dtype: Any) -> Any:
    """A zero-size stand-in for an array argument the kernel does not read or write."""
    return xp.empty(0, dtype)


def _im2col(x: Any, geometry: _Geometry, by_column: bool = False) -> Any:
    """The column matrix ``(groups, rows, width)`` of the images `x`, or ``(groups, width,
    rows)`` with `by_column`."""
    rows = x.shape[0] * math.prod(geometry.axes[1])
    shape = (geometry.groups, geometry.width, rows) if by_column else (geometry.groups, rows, geometry.width)
    cols = module_of(x).empty(shape, x.dtype)
    IM2COL(x, *geometry.args(x.shape[0]), by_column, cols)
    return cols


def _weight_gradient_into(dw: Any, x: Any, gg: Any, geometry: _Geometry, accumulate: bool) -> None:
    """``cols(x)^T @ gg`` per group into the kernel `dw` ``(*k, cg, groups * c)`` (or added to
    it): `gg` ``(groups, rows, c)``. Written into the caller's array, which the gradient
    hands out as it is (a view would be copied)."""
    xp = module_of(dw)
    groups, c = gg.shape[0], gg.shape[-1]
    if groups == 1:
        part = gemm.matmul(_im2col(x, geometry)[0].T, gg[0], out=None if accumulate else dw.reshape(-1, c))
    else:
        part = _gemm(_im2col(x, geometry, by_column=True), gg).transpose(1, 0, 2)
    if accumulate:
        target = dw.reshape(part.shape)
        target += part
    elif groups > 1:
        xp.copyto(dw.reshape(part.shape), part)


def conv_forward(x, w, b, stride, padding, dilation, groups, relu, out):
    """The correlation ``(N, *out, O)`` of `luxnn.ops.conv`, with its bias and relu, and the
    mask of where the relu let its input through (None without relu)."""
    xp, dtype = module_of(x), np.result_type(x.dtype, w.dtype)
    x, w, b = _operands(dtype, x, w, b)
    n, o = x.shape[0], w.shape[-1]
    geometry = _Geometry(x.shape[-1], groups, x.shape[1:-1], out, w.shape[: x.ndim - 2], stride, dilation, padding)
    wg = grouped_kernel(w, groups)
    y = xp.empty((n, *out, o), dtype)
    passed = xp.empty(y.shape if relu else 0, bool)
    bias = _absent(xp, dtype) if b is None else b
    per_image = math.prod(out)
    for n0, n1 in _blocks(n, per_image * geometry.width * groups * y.itemsize):
        rows = (n1 - n0) * per_image
        yb = y[n0:n1]
        if groups == 1:
            # The GEMM writes the output in place, which the epilogue then reads as `yb`
            # itself, each element by the thread that rewrites it.
            _gemm(_im2col(x[n0:n1], geometry), wg, out=yb.reshape(1, rows, o))
            yg = yb
        else:
            yg = _gemm(_im2col(x[n0:n1], geometry), wg)
        if groups > 1 or b is not None or relu:
            EPILOGUE(yg, bias, o, groups, rows, b is not None, relu, yb, passed[n0:n1] if relu else passed)
    return y, passed if relu else None


def conv_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out):
    """The gradients ``(dx, dw, db)`` of `conv_forward` (None where `needs` says not)."""
    xp, dtype = module_of(g), np.result_type(x.dtype, w.dtype)
    g, x, w = _operands(dtype, g, x, w)
    n, o = x.shape[0], w.shape[-1]
    geometry = _Geometry(x.shape[-1], groups, x.shape[1:-1], out, w.shape[: x.ndim - 2], stride, dilation, padding)
    wg = grouped_kernel(w, groups)
    per_image = math.prod(out)
    dx = xp.empty(x.shape, dtype) if needs[0] else None
    dw = xp.empty(w.shape, dtype) if needs[1] else None
    db = xp.empty(o, dtype) if needs[2] else None
    blocks = _blocks(n, per_image * geometry.width * groups * g.itemsize)
    for i, (n0, n1) in enumerate(blocks):
        rows = (n1 - n0) * per_image
        if residual is None and groups == 1:
            gg = g[n0:n1].reshape(1, rows, o)
        else:
            gg = xp.empty((groups, rows, o // groups), dtype)
            keep = g if residual is None else residual
            BY_GROUP(g[n0:n1], keep[n0:n1], o, groups, rows, residual is not None, gg)
        if needs[2]:
            _bias_gradient_into(db, gg, accumulate=i > 0)
        if needs[0]:
            cols = _gemm(gg, wg.transpose(0, 2, 1))
            COL2IM(cols, _absent(xp, dtype), *geometry.args(n1 - n0), False, False, dx[n0:n1])
            del cols  # before the weight gradient's matrix is built
        if needs[1]:
            _weight_gradient_into(dw, x[n0:n1], gg, geometry, accumulate=i > 0)
    return _zero_if_empty(blocks, dx, dw, db)


def _zero_if_empty(blocks: list, *grads: Any) -> tuple:
    """The gradients, the sums among them zero where no block added to them (an empty batch)."""
    if not blocks:
        for grad in grads:
            if grad is not None:
                grad.fill(0)
    return grads


def conv_transpose_forward(x, w, b, stride, padding, dilation, groups, relu, out):
    """The transposed convolution ``(N, *out, O)`` of `luxnn.ops.conv_transpose`: the GEMM
    of `x` with the kernel, then col2im with the bias and relu; its residual is the output
    when the relu is fused (None otherwise)."""
    xp, dtype = module_of(x), np.result_type(x.dtype, w.dtype)
    x, w, b = _operands(dtype, x, w, b)
    n, c, o = x.shape[0], x.shape[-1], w.shape[-2] * groups
    # The convolution O -> C whose input gradient this is: its input is y, its output x.
    geometry = _Geometry(o, groups, out, x.shape[1:-1], w.shape[: x.ndim - 2], stride, dilation, padding)
    wt = grouped_kernel(w, groups).transpose(0, 2, 1)
    y = xp.empty((n, *out, o), dtype)
    bias = _absent(xp, dtype) if b is None else b
    per_image = math.prod(x.shape[1:-1])
    for n0, n1 in _blocks(n, per_image * geometry.width * groups * y.itemsize):
        xg = x[n0:n1].reshape(-1, groups, c // groups).transpose(1, 0, 2)
        cols = _gemm(xg, wt)
        COL2IM(cols, bias, *geometry.args(n1 - n0), b is not None, relu, y[n0:n1])
        del cols
    return y, y if relu else None


def conv_transpose_backward(g, x, w, residual, needs, stride, padding, dilation, groups, out):
    """The gradients ``(dx, dw, db)`` of `conv_transpose_forward`: the im2col GEMMs of the
    output gradient."""
    xp, dtype = module_of(g), np.result_type(x.dtype, w.dtype)
    g, x, w = _operands(dtype, g, x, w)
    n, c, o = x.shape[0], x.shape[-1], w.shape[-2] * groups
    geometry = _Geometry(o, groups, out, x.shape[1:-1], w.shape[: x.ndim - 2], stride, dilation, padding)
    if residual is not None:
        masked = xp.empty(g.shape, dtype)
        BY_GROUP(g, residual, o, 1, g.size // o, True, masked)
        g = masked
    wg = grouped_kernel(w, groups)
    per_image = math.prod(x.shape[1:-1])
    dx = xp.empty(x.shape, dtype) if needs[0] else None
    dw = xp.empty(w.shape, dtype) if needs[1] else None
    blocks = _blocks(n, per_image * geometry.width * groups * g.itemsize)
    for i, (n0, n1) in enumerate(blocks):
        xg = x[n0:n1].reshape(-1, groups, c // groups).transpose(1, 0, 2)
        if needs[0]:
            grouped = dx[n0:n1].reshape(-1, groups, c // groups).transpose(1, 0, 2)
            if groups == 1:
                _gemm(_im2col(g[n0:n1], geometry), wg, out=grouped)
            else:  # the batched GEMM writes a matrix per group, which goes to its channels
                xp.copyto(grouped, _gemm(_im2col(g[n0:n1], geometry), wg))
        if needs[1]:
            _weight_gradient_into(dw, g[n0:n1], xg, geometry, accumulate=i > 0)
    (dw,) = _zero_if_empty(blocks, dw)
    db = None
    if needs[2]:
        db = xp.empty(o, dtype)
        _bias_gradient_into(db, g.reshape(1, -1, o), accumulate=False)
    return dx, dw, db
