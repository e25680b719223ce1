"""CUDA's pooling (`luxnn.ops.pool`'s kernels for CuPy arrays): each pool's forward and
backward one kernel over the whole batch.

One thread per output element walks its window (padding read as -inf for the maximum and
left out of the sum for the mean); one thread per input element gathers the gradient of
the outputs whose windows hold it, in increasing output order: no atomics, the same bits
every run. Windows are either fixed (window, stride, padding) or adaptive (PyTorch's bins,
`luxnn.ops.pool.adaptive_bins`, over all axes at once). The kernels take three spatial
axes; inputs of one or two get leading axes of size one.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..geometry import adaptive_bins
from .conv import split_index

__all__ = [
    "max_pool_forward", "max_pool_backward", "avg_pool_forward", "avg_pool_backward", "adaptive_avg_pool_forward",
    "adaptive_avg_pool_backward", "adaptive_max_pool_forward", "adaptive_max_pool_backward",
]  # fmt: skip

AXES = 3  # the spatial axes the kernels take

# The kernels' geometry, after the input: channels, then per axis (depth, height, width)
# the input size, the output size, the window, the stride, the low padding; then whether
# the windows are adaptive (window, stride and padding unused).
_GEOMETRY = ("int64 channels, int64 n0, int64 n1, int64 n2, int64 o0, int64 o1, int64 o2, int64 k0, int64 k1, "
             "int64 k2, int64 s0, int64 s1, int64 s2, int64 p0, int64 p1, int64 p2, bool adaptive")

_WINDOWS = r"""
// The window of output o along an axis: its first input (negative in the padding) and its size.
__device__ inline void luxnn_pool_window(long long o, long long n, long long out, long long k, long long s,
                                         long long p, bool adaptive, long long* start, long long* size) {
    if (adaptive) {
        *start = o * n / out;
        *size = ((o + 1) * n + out - 1) / out - *start;
    } else {
        *start = o * s - p;
        *size = k;
    }
}

// The outputs whose windows hold input i along an axis: first to last, inclusive.
__device__ inline void luxnn_pool_outputs(long long i, long long n, long long out, long long k, long long s,
                                          long long p, bool adaptive, long long* first, long long* last) {
    if (adaptive) {
        *first = i * out / n;
        *last = ((i + 1) * out + n - 1) / n - 1;
    } else {
        const long long t = i + p - k + 1;
        *first = t <= 0 ? 0 : (t + s - 1) / s;
        *last = (i + p) / s;
    }
    if (*last > out - 1) *last = out - 1;
}

// The count of inputs (not padding) in a window along an axis (0 for a window of padding only).
__device__ inline long long luxnn_pool_inside(long long start, long long size, long long n) {
    const long long inside = (start + size < n ? start + size : n) - (start > 0 ? start : 0);
    return inside > 0 ? inside : 0;
}
"""

# Splits the loop index i of an output element (n, od, oh, ow, c) and finds its windows.
_OUTPUT_WINDOWS = split_index(("n", "od", "oh", "ow", "c"), ("", "o0", "o1", "o2", "channels")) + r"""
    long long sd, zd, sh, zh, sw, zw;
    luxnn_pool_window(od, n0, o0, k0, s0, p0, adaptive, &sd, &zd);
    luxnn_pool_window(oh, n1, o1, k1, s1, p1, adaptive, &sh, &zh);
    luxnn_pool_window(ow, n2, o2, k2, s2, p2, adaptive, &sw, &zw);
"""

# Splits the loop index i of an input element (n, id, ih, iw, c) and finds the outputs
# whose windows hold it.
_INPUT_OUTPUTS = split_index(("n", "id", "ih", "iw", "c"), ("", "n0", "n1", "n2", "channels")) + r"""
    long long fd, ld, fh, lh, fw, lw;
    luxnn_pool_outputs(id, n0, o0, k0, s0, p0, adaptive, &fd, &ld);
    luxnn_pool_outputs(ih, n1, o1, k1, s1, p1, adaptive, &fh, &lh);
    luxnn_pool_outputs(iw, n2, o2, k2, s2, p2, adaptive, &fw, &lw);
"""


class _Geometry:
    """A pool's shape in the kernels' terms (`_GEOMETRY`), three spatial axes."""

    def __init__(self, shape: tuple[int, ...], out: tuple[int, ...], window: tuple[int, ...] | None = None,
                 stride: tuple[int, ...] | None = None, padding: Any = None) -> None:
        r = len(shape) - 2
        if r > AXES:
            raise NotImplementedError(f"pooling of CuPy arrays: 1 to {AXES} spatial axes, got {r} (input shape {shape})")
        adaptive = window is None
        ones, lead = (1,) * r, AXES - r
        per_axis = [shape[1:-1], out, ones if adaptive else window, ones if adaptive else stride,
                    (0,) * r if adaptive else tuple(lo for lo, _ in padding)]
        self.axes = [(1 if i < 4 else 0,) * lead + tuple(v) for i, v in enumerate(per_axis)]
        self.args = (shape[-1], *(v for values in self.axes for v in values), adaptive)


def _twin_geometry(args: tuple) -> tuple[int, list[tuple[int, ...]], bool]:
    channels, *axes, adaptive = args
    return channels, [tuple(int(v) for v in axes[i * AXES : (i + 1) * AXES]) for i in range(5)], bool(adaptive)


def _twin_windows(args: tuple) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[np.ndarray, ...], np.ndarray, np.ndarray]:
    """As the kernels see a pool: channels, input and output sizes, and over (*out, *window)
    (the window as large as the largest) the input index per axis of each window element,
    whether the window has that element, and whether it is an input (not padding)."""
    channels, (sizes, out, window, stride, low), adaptive = _twin_geometry(args)
    index, has, inside = [], np.ones((), bool), np.ones((), bool)
    for axis, (n, o, k, s, p) in enumerate(zip(sizes, out, window, stride, low)):
        if adaptive:
            bins = np.array(adaptive_bins(n, o)).reshape(o, 2)
            start, size = bins[:, 0], bins[:, 1] - bins[:, 0]
        else:
            start, size = np.arange(o) * s - p, np.full(o, k)
        offsets = np.arange(size.max())
        at = (start[:, None] + offsets).reshape([o if a == axis else 1 for a in range(AXES)] + [-1 if a == axis else 1 for a in range(AXES)])
        index.append(at)
        has = has & (offsets < size[:, None]).reshape(at.shape)
        inside = inside & (at >= 0) & (at < n)
    return channels, sizes, out, tuple(index), has, inside


def _twin_gather(x: np.ndarray, args: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each output's window of `x` ``(N, *out, *window, C)`` (its elements in row-major
    order), whether the window has the element, and whether it is an input."""
    channels, sizes, _, index, has, inside = _twin_windows(args)
    xs = x.reshape(-1, *sizes, channels)
    clipped = tuple(np.clip(at, 0, n - 1) for at, n in zip(index, sizes))
    return xs[(slice(None), *clipped)], np.broadcast_to(has, inside.shape), inside


def _max_pool_twin(x, *args):
    *geometry, y, arg = args
    windows, has, inside = _twin_gather(x, tuple(geometry))
    channels, sizes, out, index, _, _ = _twin_windows(tuple(geometry))
    flat = (index[0] * sizes[1] + index[1]) * sizes[2] + index[2]
    values = np.where(inside[..., None], windows, -np.inf).astype(x.dtype)
    positions = np.where(inside, flat, -1)
    lead = (slice(None),) * (1 + AXES)
    best = values[lead + (0, 0, 0)].copy()
    at = np.broadcast_to(positions[lead[1:] + (0, 0, 0)][None, ..., None], best.shape).copy()
    for offset in np.ndindex(*has.shape[AXES:]):
        if offset == (0, 0, 0):
            continue
        v = values[lead + offset]
        better = has[lead[1:] + offset][None, ..., None] & (v > best)
        best = np.where(better | (has[lead[1:] + offset][None, ..., None] & np.isnan(v)), v, best)
        at = np.where(better, positions[lead[1:] + offset][None, ..., None], at)
    y.reshape(best.shape)[...] = best
    arg.reshape(at.shape)[...] = at


def _divisors(args: tuple, include_pad: bool) -> np.ndarray:
    """Each output's divisor ``(*out)``: the window's size (adaptive windows, or counting
    the padding), else its count of inputs."""
    _, _, _, _, has, inside = _twin_windows(args)
    *_, adaptive = args
    counted = has if adaptive or include_pad else has & inside
    return counted.reshape(*counted.shape[:AXES], -1).sum(axis=-1)


def _avg_pool_twin(x, *args):
    *geometry, include_pad, y = args
    windows, has, inside = _twin_gather(x, tuple(geometry))
    total = np.zeros((windows.shape[0], *windows.shape[1 : 1 + AXES], windows.shape[-1]), x.dtype)
    lead = (slice(None),) * (1 + AXES)
    for offset in np.ndindex(*has.shape[AXES:]):
        np.add(total, windows[lead + offset], out=total, where=(has & inside)[lead[1:] + offset][None, ..., None])
    y.reshape(total.shape)[...] = total / _divisors(tuple(geometry), include_pad)[None, ..., None].astype(x.dtype)


def _scatter_twin(dx: np.ndarray, shares: np.ndarray, where: np.ndarray, flat: np.ndarray, channels: int) -> None:
    """``dx[n, flat, c] += shares[n, ..., c]`` where `where`, in the order of the output
    elements (the order in which each input's kernel thread sums): `shares`, `where` and
    `flat` broadcast to ``(N, *out, ..., C)``."""
    shape = np.broadcast_shapes(shares.shape, where.shape, flat.shape)
    n = np.broadcast_to(np.arange(shape[0]).reshape((-1,) + (1,) * (len(shape) - 1)), shape)
    c = np.broadcast_to(np.arange(shape[-1]), shape)
    chosen = np.broadcast_to(where, shape)
    target = dx.reshape(shape[0], -1, channels)
    np.add.at(target, (n[chosen], np.broadcast_to(flat, shape)[chosen], c[chosen]), np.broadcast_to(shares, shape)[chosen])


def _max_pool_grad_twin(g, arg, *args):
    *geometry, dx = args
    channels = geometry[0]
    dx[...] = 0
    _scatter_twin(dx, g, arg >= 0, np.maximum(arg, 0), channels)


def _avg_pool_grad_twin(g, *args):
    *geometry, include_pad, dx = args
    channels, sizes, out, index, has, inside = _twin_windows(tuple(geometry))
    share = g.reshape(-1, *out, channels) / _divisors(tuple(geometry), include_pad)[None, ..., None].astype(g.dtype)
    flat = (np.clip(index[0], 0, None) * sizes[1] + np.clip(index[1], 0, None)) * sizes[2] + np.clip(index[2], 0, None)
    dx[...] = 0
    _scatter_twin(dx, share.reshape(*share.shape[:-1], 1, 1, 1, channels), (has & inside)[None, ..., None],
                  flat[None, ..., None], channels)


# Each window's maximum, and the input position (d*H + h)*W + w of its first maximum (-1: padding).
MAX_POOL = Elementwise(
    "luxnn_max_pool", f"raw T x, {_GEOMETRY}", "T y, int32 arg",
    _OUTPUT_WINDOWS + r"""
    const T minus_infinity = (T)(-__longlong_as_double(0x7ff0000000000000LL));
    T best = minus_infinity;
    int at = -1;
    for (long long a = 0; a < zd; ++a) {
        for (long long b = 0; b < zh; ++b) {
            for (long long e = 0; e < zw; ++e) {
                const long long id = sd + a, ih = sh + b, iw = sw + e;
                const bool inside = id >= 0 && id < n0 && ih >= 0 && ih < n1 && iw >= 0 && iw < n2;
                const T v = inside ? x[(((n * n0 + id) * n1 + ih) * n2 + iw) * channels + c] : minus_infinity;
                const int here = inside ? (int)((id * n1 + ih) * n2 + iw) : -1;
                if ((a == 0 && b == 0 && e == 0) || v > best) {
                    best = v;
                    at = here;
                } else if (v != v) {
                    best = v;  // NaN wins the maximum, not the gradient
                }
            }
        }
    }
    y = best;
    arg = at;
    """,
    twin=_max_pool_twin, preamble=_WINDOWS,
)  # fmt: skip

# Each input's gradient: the sum of the output gradients whose window's first maximum it is.
MAX_POOL_GRAD = Elementwise(
    "luxnn_max_pool_grad", f"raw T g, raw int32 arg, {_GEOMETRY}", "T dx",
    _INPUT_OUTPUTS + r"""
    const int here = (int)((id * n1 + ih) * n2 + iw);
    T total = 0;
    for (long long od = fd; od <= ld; ++od) {
        for (long long oh = fh; oh <= lh; ++oh) {
            for (long long ow = fw; ow <= lw; ++ow) {
                const long long o = (((n * o0 + od) * o1 + oh) * o2 + ow) * channels + c;
                if (arg[o] == here) total += g[o];
            }
        }
    }
    dx = total;
    """,
    twin=_max_pool_grad_twin, preamble=_WINDOWS,
)  # fmt: skip

# Each window's mean: the sum of its inputs over its divisor (its size, or its count of inputs).
AVG_POOL = Elementwise(
    "luxnn_avg_pool", f"raw T x, {_GEOMETRY}, bool include_pad", "T y",
    _OUTPUT_WINDOWS + r"""
    T total = 0;
    for (long long a = 0; a < zd; ++a) {
        for (long long b = 0; b < zh; ++b) {
            for (long long e = 0; e < zw; ++e) {
                const long long id = sd + a, ih = sh + b, iw = sw + e;
                if (id >= 0 && id < n0 && ih >= 0 && ih < n1 && iw >= 0 && iw < n2) {
                    total += x[(((n * n0 + id) * n1 + ih) * n2 + iw) * channels + c];
                }
            }
        }
    }
    const long long count = adaptive || include_pad ? zd * zh * zw
        : luxnn_pool_inside(sd, zd, n0) * luxnn_pool_inside(sh, zh, n1) * luxnn_pool_inside(sw, zw, n2);
    y = total / (T)count;
    """,
    twin=_avg_pool_twin, preamble=_WINDOWS,
)  # fmt: skip

# Each input's gradient: the sum of the output gradients over their divisors, of the windows that hold it.
AVG_POOL_GRAD = Elementwise(
    "luxnn_avg_pool_grad", f"raw T g, {_GEOMETRY}, bool include_pad", "T dx",
    _INPUT_OUTPUTS + r"""
    T total = 0;
    for (long long od = fd; od <= ld; ++od) {
        long long sd, zd;
        luxnn_pool_window(od, n0, o0, k0, s0, p0, adaptive, &sd, &zd);
        for (long long oh = fh; oh <= lh; ++oh) {
            long long sh, zh;
            luxnn_pool_window(oh, n1, o1, k1, s1, p1, adaptive, &sh, &zh);
            for (long long ow = fw; ow <= lw; ++ow) {
                long long sw, zw;
                luxnn_pool_window(ow, n2, o2, k2, s2, p2, adaptive, &sw, &zw);
                const long long count = adaptive || include_pad ? zd * zh * zw
                    : luxnn_pool_inside(sd, zd, n0) * luxnn_pool_inside(sh, zh, n1) * luxnn_pool_inside(sw, zw, n2);
                total += (T)(g[(((n * o0 + od) * o1 + oh) * o2 + ow) * channels + c] / (T)count);  // the share rounded first, as the twin
            }
        }
    }
    dx = total;
    """,
    twin=_avg_pool_grad_twin, preamble=_WINDOWS,
)  # fmt: skip


def _output_sizes(shape: tuple[int, ...], window: tuple[int, ...], stride: tuple[int, ...], padding: Any) -> tuple[int, ...]:
    return tuple((n + lo + hi - k) // s + 1 for n, k, s, (lo, hi) in zip(shape[1:-1], window, stride, padding))


def _max(x: Any, geometry: _Geometry, out: tuple[int, ...]) -> tuple[Any, Any]:
    xp = module_of(x)
    x = xp.ascontiguousarray(x)
    y = xp.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    arg = xp.empty(y.shape, np.int32)
    if y.size:
        MAX_POOL(x, *geometry.args, y, arg)
    return y, arg


def _max_grad(g: Any, arg: Any, shape: tuple[int, ...], geometry: _Geometry) -> Any:
    xp = module_of(g)
    dx = xp.empty(shape, g.dtype)
    if dx.size:
        MAX_POOL_GRAD(xp.ascontiguousarray(g), arg, *geometry.args, dx)
    return dx


def _avg(x: Any, geometry: _Geometry, out: tuple[int, ...], include_pad: bool) -> Any:
    xp = module_of(x)
    y = xp.empty((x.shape[0], *out, x.shape[-1]), x.dtype)
    if y.size:
        AVG_POOL(xp.ascontiguousarray(x), *geometry.args, include_pad, y)
    return y


def _avg_grad(g: Any, shape: tuple[int, ...], geometry: _Geometry, include_pad: bool) -> Any:
    xp = module_of(g)
    dx = xp.empty(shape, g.dtype)
    if dx.size:
        AVG_POOL_GRAD(xp.ascontiguousarray(g), *geometry.args, include_pad, dx)
    return dx


def max_pool_forward(x, window, stride, padding):
    """The windows' maxima, and the input position of each one's first maximum."""
    out = _output_sizes(x.shape, window, stride, padding)
    return _max(x, _Geometry(x.shape, out, window, stride, padding), out)


def max_pool_backward(g, residual, shape, window, stride, padding):
    """The input gradient of `max_pool_forward`."""
    return _max_grad(g, residual, shape, _Geometry(shape, g.shape[1:-1], window, stride, padding))


def avg_pool_forward(x, window, stride, padding, count_include_pad):
    """The windows' means (no residual)."""
    out = _output_sizes(x.shape, window, stride, padding)
    return _avg(x, _Geometry(x.shape, out, window, stride, padding), out, count_include_pad), None


def avg_pool_backward(g, residual, shape, window, stride, padding, count_include_pad):
    """The input gradient of `avg_pool_forward`."""
    return _avg_grad(g, shape, _Geometry(shape, g.shape[1:-1], window, stride, padding), count_include_pad)


def adaptive_avg_pool_forward(x, out):
    """The means over adaptive windows (no residual)."""
    return _avg(x, _Geometry(x.shape, out), out, False), None


def adaptive_avg_pool_backward(g, residual, shape, out):
    """The input gradient of `adaptive_avg_pool_forward`."""
    return _avg_grad(g, shape, _Geometry(shape, out), False)


def adaptive_max_pool_forward(x, out):
    """The maxima over adaptive windows, and the input position of each one's first maximum."""
    return _max(x, _Geometry(x.shape, out), out)


def adaptive_max_pool_backward(g, residual, shape, out):
    """The input gradient of `adaptive_max_pool_forward`."""
    return _max_grad(g, residual, shape, _Geometry(shape, out))
