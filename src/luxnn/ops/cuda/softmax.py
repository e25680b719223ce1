"""The softmax family on CuPy arrays: one row kernel per function each way.

A row kernel runs one thread block per row of the reduced axis (several rows per block
when the grid is full), reading the row as many times as it needs (max, sum, write) and
writing nothing in between: softmax, log-softmax and the masked softmax of attention
(mask and causal limit applied inside) one launch each way, logsumexp one forward and one
elementwise launch back. Any single axis runs in place of the last (its rows strided);
several axes at once run as the CPU's passes through CuPy. The kernels exist for float32
and float64 (`floating` casts other dtypes); the twins are the CPU's functions
(ops/cpu/softmax.py).
"""

from __future__ import annotations

import math

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..block_kernels import per_dtype
from ..cpu import softmax as cpu
from .activations import floating, half_kept

__all__ = [
    "logsumexp", "logsumexp_grad", "softmax", "softmax_grad", "log_softmax", "log_softmax_grad", "masked_softmax",
    "masked_softmax_grad",
]  # fmt: skip

# Modes of the forward and gradient kernels.
SOFTMAX, LOG_SOFTMAX, MASKED = 0, 1, 2

ROWS_SOURCE = r"""
template <typename T> __device__ T luxnn_infinity();
template <> __device__ float luxnn_infinity<float>() { return __int_as_float(0x7f800000); }
template <> __device__ double luxnn_infinity<double>() { return __longlong_as_double(0x7ff0000000000000LL); }

// NumPy's maximum: a NaN wins.
template <typename T> __device__ T luxnn_nan_max(T a, T b) { return (a > b || a != a) ? a : b; }
struct NanMax { template <typename T> __device__ T operator()(T a, T b) const { return luxnn_nan_max(a, b); } };

// The block's max (block_kernels' block_reduce with NaN winning) and sum of v, to every thread.
template <typename T> __device__ T luxnn_block_max(T v) { T r[1] = {v}; block_reduce(r, NanMax(), -luxnn_infinity<T>()); return r[0]; }
template <typename T> __device__ T luxnn_block_sum(T v) { T r[1] = {v}; block_sums(r); return r[0]; }

// Row `row` of a contiguous array reduced over an axis of length n followed by `inner`
// elements: its element j is at base + j * inner.
__device__ long long luxnn_row_base(long long row, long long n, long long inner) {
    return (row / inner) * n * inner + row % inner;
}

// mode 0 (softmax): y = exp(x - max) / sum; 1 (log-softmax): y = (x - max) - log(sum);
// 2 (masked): y = exp(scale * (x - max)) * (1 / sum) over the allowed keys, 0 elsewhere;
// with a mask or causal limit, a max of +-inf counts as 0 and a sum of 0 as 1, so a row
// without keys is zeros. Key j of row `row` is allowed where j <= row % causal (if causal
// > 0) and (if has_mask) where the mask is true at mask[i0 * s[0] + i1 * s[1] + i2 * s[2] +
// j * s[3]], (i0, i1, i2) the row's index in rows = (rows / (d1 * d2), d1, d2): the mask as
// broadcast to the scores, its leading axes merged into three.
template <typename T>
__device__ void luxnn_softmax_rows(const T* x, T* y, const bool* mask, long long rows, long long n,
                                   long long inner, T scale, int has_mask, long long d1, long long d2,
                                   long long s0, long long s1, long long s2, long long s3, long long causal,
                                   int mode) {
    const T inf = luxnn_infinity<T>();
    const bool masked = has_mask || causal > 0;
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = luxnn_row_base(row, n, inner);
        const long long last = causal > 0 ? row % causal : n;
        const long long mask_row = (row / (d1 * d2)) * s0 + ((row / d2) % d1) * s1 + (row % d2) * s2;
        #define LUXNN_VALUE(j) ((has_mask && !mask[mask_row + (j) * s3]) || (j) > last ? -inf : x[base + (j) * inner])
        T m = -inf;
        for (long long j = threadIdx.x; j < n; j += blockDim.x) m = luxnn_nan_max(m, LUXNN_VALUE(j));
        m = luxnn_block_max(m);
        if (masked && (m == inf || m == -inf)) m = 0;
        T s = 0;
        for (long long j = threadIdx.x; j < n; j += blockDim.x)
            s += mode == 2 ? exp((LUXNN_VALUE(j) - m) * scale) : exp(LUXNN_VALUE(j) - m);
        s = luxnn_block_sum(s);
        if (masked && s == (T)0) s = 1;
        const T log_s = mode == 1 ? log(s) : (T)0, inv_s = (T)1 / s;
        for (long long j = threadIdx.x; j < n; j += blockDim.x) {
            const T v = LUXNN_VALUE(j) - m;
            y[base + j * inner] = mode == 0 ? exp(v) / s : mode == 1 ? v - log_s : exp(v * scale) * inv_s;
        }
        #undef LUXNN_VALUE
    }
}

// mode 0 (softmax) and 2 (masked): gx = (g - sum(g * y)) * y * scale; 1 (log-softmax):
// gx = g - exp(y) * sum(g).
template <typename T>
__device__ void luxnn_softmax_grad_rows(const T* g, const T* y, T* gx, long long rows, long long n,
                                        long long inner, T scale, int mode) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = luxnn_row_base(row, n, inner);
        T s = 0;
        for (long long j = threadIdx.x; j < n; j += blockDim.x)
            s += mode == 1 ? g[base + j * inner] : g[base + j * inner] * y[base + j * inner];
        s = luxnn_block_sum(s);
        for (long long j = threadIdx.x; j < n; j += blockDim.x) {
            const long long k = base + j * inner;
            gx[k] = mode == 1 ? g[k] - exp(y[k]) * s : (g[k] - s) * y[k] * scale;
        }
    }
}

// out[row] = log(sum(exp(x - m))) + m, m the row's max where finite, else 0.
template <typename T>
__device__ void luxnn_logsumexp_rows(const T* x, T* out, long long rows, long long n, long long inner) {
    for (long long row = blockIdx.x; row < rows; row += gridDim.x) {
        const long long base = luxnn_row_base(row, n, inner);
        T m = -luxnn_infinity<T>();
        for (long long j = threadIdx.x; j < n; j += blockDim.x) m = luxnn_nan_max(m, x[base + j * inner]);
        m = luxnn_block_max(m);
        if (!(m - m == (T)0)) m = 0;  // inf or NaN
        T s = 0;
        for (long long j = threadIdx.x; j < n; j += blockDim.x) s += exp(x[base + j * inner] - m);
        s = luxnn_block_sum(s);
        if (threadIdx.x == 0) out[row] = log(s) + m;
    }
}

"""



def _as_rows(a, n, inner, rows):
    """`a` (contiguous) as ``(outer, n, inner)``: its rows along axis 1."""
    return a.reshape(rows // inner if inner else 0, n, inner)


def _softmax_twin(x, y, mask, rows, n, inner, scale, has_mask, d1, d2, s0, s1, s2, s3, causal, mode):
    if mode == MASKED:
        if has_mask:
            mask = np.lib.stride_tricks.as_strided(mask, (rows // (d1 * d2), d1, d2, n),
                                                   tuple(int(s) * mask.itemsize for s in (s0, s1, s2, s3)))
        shape = (-1, int(causal) or 1, n)  # queries on axis 1 for the causal limit
        allowed = cpu.allowed_keys(mask.reshape(shape) if has_mask else None, causal > 0, x.reshape(shape).shape)
        cpu.softmax_rows(x.reshape(shape), y.reshape(shape), allowed, float(scale))
        return
    forward = cpu.softmax if mode == SOFTMAX else cpu.log_softmax
    np.copyto(_as_rows(y, n, inner, rows), forward(_as_rows(x, n, inner, rows), 1))


def _softmax_grad_twin(g, y, gx, rows, n, inner, scale, mode):
    if mode == MASKED:
        cpu.softmax_grad_rows(g.reshape(-1, n), y.reshape(-1, n), gx.reshape(-1, n), float(scale))
        return
    grad = cpu.softmax_grad if mode == SOFTMAX else cpu.log_softmax_grad
    np.copyto(_as_rows(gx, n, inner, rows), grad(_as_rows(g, n, inner, rows), _as_rows(y, n, inner, rows), 1))


def _logsumexp_twin(x, out, rows, n, inner):
    np.copyto(out.reshape(-1, 1, inner), cpu.logsumexp(_as_rows(x, n, inner, rows), 1))


SOFTMAX_KERNEL = per_dtype(
    "luxnn_softmax",
    ROWS_SOURCE,
    "const T* x, T* y, const bool* mask, long long rows, long long n, long long inner, T scale, int has_mask, "
    "long long d1, long long d2, long long s0, long long s1, long long s2, long long s3, long long causal, int mode",
    "luxnn_softmax_rows(x, y, mask, rows, n, inner, scale, has_mask, d1, d2, s0, s1, s2, s3, causal, mode)",
    _softmax_twin,
)
SOFTMAX_GRAD_KERNEL = per_dtype(
    "luxnn_softmax_grad",
    ROWS_SOURCE,
    "const T* g, const T* y, T* gx, long long rows, long long n, long long inner, T scale, int mode",
    "luxnn_softmax_grad_rows(g, y, gx, rows, n, inner, scale, mode)",
    _softmax_grad_twin,
)
LOGSUMEXP_KERNEL = per_dtype(
    "luxnn_logsumexp",
    ROWS_SOURCE,
    "const T* x, T* out, long long rows, long long n, long long inner",
    "luxnn_logsumexp_rows(x, out, rows, n, inner)",
    _logsumexp_twin,
)
LOGSUMEXP_GRAD_KERNEL = Elementwise("luxnn_logsumexp_grad", "T g, T x, T y", "T gx", "gx = g * exp(x - y)",
                                    twin=lambda g, x, y, gx: np.copyto(gx, cpu.logsumexp_grad(g, x, y)))


def _launch(kernels, rows, n, *args):
    """One block of up to 256 threads per row, rows beyond the grid looped over."""
    if rows:
        threads = min(256, 32 * max(1, -(-n // 32)))
        kernels[args[0].dtype]((min(rows, 1 << 16),), (threads,), args)


def _single_axis(x, axis):
    """``(x contiguous and floating, rows, n, inner)`` for a reduction over the one `axis`,
    or None for several axes (a tuple, None)."""
    if not isinstance(axis, (int, np.integer)):
        return None
    if not -x.ndim <= axis < x.ndim:
        raise np.exceptions.AxisError(int(axis), x.ndim)  # NumPy's (and CuPy's) error
    axis = int(axis) % x.ndim
    n = x.shape[axis]
    if n == 0:
        raise ValueError("zero-size array to reduction operation maximum which has no identity")
    inner = math.prod(x.shape[axis + 1:])
    x = module_of(x).ascontiguousarray(floating(x))
    return x, x.size // n, n, inner


@half_kept
def _row_forward(x, axis, mode):
    found = _single_axis(x, axis) if x.ndim else None
    if found is None:
        return (cpu.softmax if mode == SOFTMAX else cpu.log_softmax)(x, axis)
    x, rows, n, inner = found
    xp = module_of(x)
    y = xp.empty(x.shape, x.dtype)
    _launch(SOFTMAX_KERNEL, rows, n, x, y, xp.empty(0, bool), np.int64(rows), np.int64(n), np.int64(inner),
            x.dtype.type(1), np.int32(0), *_NO_MASK, np.int64(0), np.int32(mode))
    return y


@half_kept
def _row_grad(g, y, axis, mode, scale=1.0):
    found = _single_axis(y, axis) if y.ndim else None
    if found is None:
        return (cpu.softmax_grad if mode == SOFTMAX else cpu.log_softmax_grad)(g, y, axis)
    y, rows, n, inner = found
    xp = module_of(y)
    dtype = np.result_type(floating(g), y)  # a cotangent of another dtype: NumPy's promotion, as on the CPU
    g, y = xp.ascontiguousarray(g.astype(dtype, copy=False)), y.astype(dtype, copy=False)
    gx = xp.empty(y.shape, y.dtype)
    _launch(SOFTMAX_GRAD_KERNEL, rows, n, g, y, gx, np.int64(rows), np.int64(n), np.int64(inner),
            y.dtype.type(scale), np.int32(mode))
    return gx


def softmax(x, axis):
    return _row_forward(x, axis, SOFTMAX)


def softmax_grad(g, y, axis):
    return _row_grad(g, y, axis, SOFTMAX)


def log_softmax(x, axis):
    return _row_forward(x, axis, LOG_SOFTMAX)


def log_softmax_grad(g, y, axis):
    return _row_grad(g, y, axis, LOG_SOFTMAX)


@half_kept
def logsumexp(x, axis):
    found = _single_axis(x, axis) if x.ndim else None
    if found is None:
        return cpu.logsumexp(x, axis)
    x, rows, n, inner = found
    out = module_of(x).empty(x.shape[:axis % x.ndim] + (1,) + x.shape[axis % x.ndim + 1:], x.dtype)
    _launch(LOGSUMEXP_KERNEL, rows, n, x, out, np.int64(rows), np.int64(n), np.int64(inner))
    return out


@half_kept
def logsumexp_grad(g, x, y):
    dtype = np.result_type(floating(g), floating(x), floating(y))
    g, x, y = (a.astype(dtype, copy=False) for a in (g, x, y))
    return LOGSUMEXP_GRAD_KERNEL(g, x, y, module_of(x).empty(x.shape, dtype))


_NO_MASK = tuple(np.int64(v) for v in (1, 1, 0, 0, 0, 0))


def _mask_layout(mask, shape):
    """`mask` broadcast to `shape` (a view, copied only where its leading axes do not merge
    into three) and the kernel's ``(d1, d2, s0, s1, s2, s3)`` for it: the sizes of the last
    two of its three leading axes and the strides of all four (in bytes, which are elements
    of a boolean array)."""
    xp = module_of(mask)
    view = xp.broadcast_to(mask, shape)
    axes = []  # (size, stride) of the leading axes, adjacent ones merged where they can be
    for size, stride in zip(shape[:-1], view.strides[:-1]):
        if size == 1:
            continue
        if axes and axes[-1][1] == stride * size:
            axes[-1] = (axes[-1][0] * size, stride)
        else:
            axes.append((size, stride))
    if len(axes) > 3:
        return _mask_layout(xp.ascontiguousarray(view), shape)
    (_, s0), (d1, s1), (d2, s2) = [(1, 0)] * (3 - len(axes)) + axes
    return view, tuple(np.int64(v) for v in (d1, d2, s0, s1, s2, view.strides[-1]))


@half_kept
def masked_softmax(scores, scale, mask, is_causal):
    xp = module_of(scores)
    found = _single_axis(scores, -1)
    scores, rows, n, _ = found
    has_mask = mask is not None
    mask, layout = _mask_layout(mask, scores.shape) if has_mask else (xp.empty(0, bool), _NO_MASK)
    w = xp.empty(scores.shape, scores.dtype)
    _launch(SOFTMAX_KERNEL, rows, n, scores, w, mask, np.int64(rows), np.int64(n), np.int64(1),
            scores.dtype.type(scale), np.int32(has_mask), *layout, np.int64(scores.shape[-2] if is_causal else 0),
            np.int32(MASKED))
    return w


def masked_softmax_grad(g, w, scale):
    return _row_grad(g, w, -1, MASKED, scale)
