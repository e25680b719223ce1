"""The normalisations on a CUDA device (CuPy arrays): each statistic's mean and variance,
the normalisation and the affine map in one kernel; backward, a statistic's two sums and
its input gradient in one kernel, and the scale's and bias's gradients in another.

An array `x` normalised over some axes is seen as ``(B, S, G, J)`` with the statistics over
``S`` and ``J``: one per ``(b, g)``. A LayerNorm's rows are ``(B, 1, 1, J)``, BatchNorm's
channels ``(1, S, C, 1)``, InstanceNorm's ``(N, S, C, 1)``, GroupNorm's ``(N, S, G, C/G)``;
the affine map's channel of an element is ``g * J + j``. Other axes are moved last first.

With fixed statistics (test mode), the normalisation and the affine map are one kernel
per element, and the running statistics' update one kernel per channel.
"""

from __future__ import annotations

import math

import numpy as np

from ...ad.primitives import multiply
from ...backend import module_of
from ...kernels import Elementwise
from ..block_kernels import per_dtype

__all__ = [
    "moments", "normalize", "rms_normalize", "scale_shift", "normalize_affine", "frozen_normalize", "update_running",
]

THREADS = 256  # per block of the statistics' kernels: a multiple of 32, at most 1024


# Element t of statistic k = b * G + g, for t in [0, S * J): its offset and its channel.
_LAYOUT = r"""
struct Layout {
    long long S, G, J;
    __device__ long long offset(long long k, long long t) const {
        long long b = k / G, g = k - b * G, s = t / J;
        return ((b * S + s) * G + g) * J + (t - s * J);
    }
    __device__ long long channel(long long k, long long t) const { return (k % G) * J + t % J; }
};
"""

_FLAGS = "CENTRE = 1, GIVEN = 2, SCALE = 4, BIAS = 8, WRITE = 16, NORMED = 32, RSTD = 64"


def _norm_kernel(name: str, body: str, signature: str, call: str, twin) -> dict:
    return per_dtype(name, body, signature, call, twin, prelude=f"{_LAYOUT}\nenum {{ {_FLAGS} }};")


CENTRE, GIVEN, SCALE, BIAS, WRITE, NORMED, RSTD = 1, 2, 4, 8, 16, 32, 64  # as _FLAGS


def _forward_twin(x, scale, bias, mean, var, y, S, G, J, eps, flags):
    v = x.reshape(-1, S, G, J)  # the statistic of (b, g) over axes 1 and 3
    m_, v_ = mean.reshape(-1, 1, G, 1), var.reshape(-1, 1, G, 1)
    if not flags & GIVEN:
        m_[...] = v.mean(axis=(1, 3), keepdims=True) if flags & CENTRE else 0
        d = v - m_
        v_[...] = (d * d).mean(axis=(1, 3), keepdims=True)
    if flags & WRITE:
        out = (v - m_) * (1 / np.sqrt(v_ + v.dtype.type(eps)))
        if flags & SCALE:
            out = out * scale.reshape(G, J)
        if flags & BIAS:
            out = out + bias.reshape(G, J)
        y.reshape(v.shape)[...] = out


# Statistics, normalisation and affine map of one statistic per block (grid: B * G).
NORM_FORWARD = _norm_kernel("luxnn_norm_forward", r"""
template <typename T>
__device__ void norm_forward(const T* x, const T* scale, const T* bias, T* mean, T* var, T* y,
                             long long S, long long G, long long J, double eps, int flags) {
    const Layout at = {S, G, J};
    const long long k = blockIdx.x, n = S * J;
    T m, v;
    if (flags & GIVEN) {
        m = mean[k];
        v = var[k];
    } else {
        T s[1] = {0};
        if (flags & CENTRE) {
            for (long long t = threadIdx.x; t < n; t += blockDim.x) s[0] += x[at.offset(k, t)];
            block_sums(s);
        }
        m = s[0] / (T)n;
        T q[1] = {0};
        for (long long t = threadIdx.x; t < n; t += blockDim.x) {
            T d = x[at.offset(k, t)] - m;
            q[0] += d * d;
        }
        block_sums(q);
        v = q[0] / (T)n;
        if (threadIdx.x == 0) { mean[k] = m; var[k] = v; }
    }
    if (!(flags & WRITE)) return;
    const T rstd = (T)1 / sqrt(v + (T)eps);
    for (long long t = threadIdx.x; t < n; t += blockDim.x) {
        const long long i = at.offset(k, t), c = at.channel(k, t);
        T h = (x[i] - m) * rstd;
        if (flags & SCALE) h = h * scale[c];
        if (flags & BIAS) h = h + bias[c];
        y[i] = h;
    }
}
""", "const T* x, const T* scale, const T* bias, T* mean, T* var, T* y, long long S, long long G, long long J, "
     "double eps, int flags", "norm_forward(x, scale, bias, mean, var, y, S, G, J, eps, flags)", _forward_twin)


def _backward_twin(gy, x, scale, mean, var, gx, S, G, J, eps, flags):
    v, g = x.reshape(-1, S, G, J), gy.reshape(-1, S, G, J)
    m_ = mean.reshape(-1, 1, G, 1) if flags & CENTRE else 0
    rstd = 1 / np.sqrt(var.reshape(-1, 1, G, 1) + v.dtype.type(eps))
    d = g * scale.reshape(G, J) if flags & SCALE else g
    h = (v - m_) * rstd
    n = S * J
    a, b = d.sum(axis=(1, 3), keepdims=True) / n, (d * h).sum(axis=(1, 3), keepdims=True) / n
    gx.reshape(v.shape)[...] = ((d - a - h * b) if flags & CENTRE else (d - h * b)) * rstd


# The input gradient of one statistic per block: ``rstd * (d - mean(d) - h * mean(d * h))``
# with ``d = g * scale`` and h the normalised input (without the mean(d) term for RMS).
NORM_BACKWARD = _norm_kernel("luxnn_norm_backward", r"""
template <typename T>
__device__ void norm_backward(const T* gy, const T* x, const T* scale, const T* mean, const T* var, T* gx,
                              long long S, long long G, long long J, double eps, int flags) {
    const Layout at = {S, G, J};
    const long long k = blockIdx.x, n = S * J;
    const T m = (flags & CENTRE) ? mean[k] : (T)0, rstd = (T)1 / sqrt(var[k] + (T)eps);
    T s[2] = {0, 0};
    for (long long t = threadIdx.x; t < n; t += blockDim.x) {
        const long long i = at.offset(k, t);
        const T d = (flags & SCALE) ? gy[i] * scale[at.channel(k, t)] : gy[i];
        s[0] += d;
        s[1] += d * ((x[i] - m) * rstd);
    }
    block_sums(s);
    const T a = (flags & CENTRE) ? s[0] / (T)n : (T)0, b = s[1] / (T)n;
    for (long long t = threadIdx.x; t < n; t += blockDim.x) {
        const long long i = at.offset(k, t);
        const T d = (flags & SCALE) ? gy[i] * scale[at.channel(k, t)] : gy[i];
        gx[i] = (d - a - ((x[i] - m) * rstd) * b) * rstd;
    }
}
""", "const T* gy, const T* x, const T* scale, const T* mean, const T* var, T* gx, long long S, long long G, "
     "long long J, double eps, int flags", "norm_backward(gy, x, scale, mean, var, gx, S, G, J, eps, flags)",
    _backward_twin)


def _columns_twin(gy, x, mean, var, gscale, gbias, R, C, S, G, J, eps, flags):
    h = x.reshape(R, C)
    if flags & NORMED:
        stat = (np.arange(R)[:, None] // S) * G + np.arange(C)[None, :] // J
        m_ = mean.reshape(-1)[stat] if flags & CENTRE else 0
        rstd = var.reshape(-1)[stat] if flags & RSTD else 1 / np.sqrt(var.reshape(-1)[stat] + h.dtype.type(eps))
        h = (h - m_) * rstd
    g = gy.reshape(R, C)
    if flags & SCALE:
        gscale[...] = (g * h).sum(axis=0).reshape(gscale.shape)
    if flags & BIAS:
        gbias[...] = g.sum(axis=0).reshape(gbias.shape)


# The affine map's gradients: the sums over the R rows of the (R, C) matrices g * h and g,
# h the input (with NORMED: normalised by the statistics, `var` holding the reciprocal
# standard deviations with RSTD); 32 columns per block of 32 x 8.
AFFINE_BACKWARD = _norm_kernel("luxnn_affine_backward", r"""
template <typename T>
__device__ void affine_backward(const T* gy, const T* x, const T* mean, const T* var, T* gscale, T* gbias,
                                long long R, long long C, long long S, long long G, long long J, double eps,
                                int flags) {
    __shared__ T part[2][8][33];
    const long long c = blockIdx.x * 32LL + threadIdx.x;
    T a = 0, b = 0;
    if (c < C) {
        for (long long r = threadIdx.y; r < R; r += 8) {
            const long long i = r * C + c;
            T h = x[i];
            if (flags & NORMED) {
                const long long k = (r / S) * G + c / J;
                const T rstd = (flags & RSTD) ? var[k] : (T)1 / sqrt(var[k] + (T)eps);
                h = (h - ((flags & CENTRE) ? mean[k] : (T)0)) * rstd;
            }
            a += gy[i] * h;
            b += gy[i];
        }
    }
    part[0][threadIdx.y][threadIdx.x] = a;
    part[1][threadIdx.y][threadIdx.x] = b;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
        for (int y = 1; y < 8; ++y) { a += part[0][y][threadIdx.x]; b += part[1][y][threadIdx.x]; }
        if (flags & SCALE) gscale[c] = a;
        if (flags & BIAS) gbias[c] = b;
    }
}
""", "const T* gy, const T* x, const T* mean, const T* var, T* gscale, T* gbias, long long R, long long C, "
     "long long S, long long G, long long J, double eps, int flags",
    "affine_backward(gy, x, mean, var, gscale, gbias, R, C, S, G, J, eps, flags)", _columns_twin)


def _layout(shape: tuple[int, ...], axes: tuple[int, ...]) -> tuple[int, int, int, int] | None:
    """``(B, S, G, J)`` of an array of `shape` normalised over `axes`, or None where the
    axes are not one or two runs, the second one trailing."""
    runs: list[list] = [[False, 1]]  # [reduced?, size], starting with a kept run (maybe of 1)
    for i, n in enumerate(shape):
        if runs[-1][0] != (i in axes):
            runs.append([i in axes, 1])
        runs[-1][1] *= n
    sizes = [n for _, n in runs]
    if len(runs) == 1:  # nothing normalised over: every element its own statistic
        return 1, 1, sizes[0], 1
    if len(runs) == 2:
        return sizes[0], 1, 1, sizes[1]
    if len(runs) in (3, 4):
        return (*sizes, 1) if len(runs) == 3 else tuple(sizes)
    return None


class _Normalized:
    """An array `x` normalised over `axes` as the kernels see it: contiguous in their dtype
    (`dtype`: float64, else float32), ``(B, S, G, J)``, the normalised axes moved last
    where they do not fit that layout."""

    def __init__(self, x, axes, dtype):
        self.xp, self.out_dtype = module_of(x), dtype
        self.dtype = np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)
        self.stat_shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape))
        self.layout = _layout(x.shape, axes)
        self.order = None
        if self.layout is None:
            self.order = (*(i for i in range(x.ndim) if i not in axes), *axes)
            x = self.xp.transpose(x, self.order)
            self.layout = (math.prod(x.shape[: x.ndim - len(axes)]), 1, 1, math.prod(x.shape[x.ndim - len(axes):]))
        self.x = self.to_kernel(x, moved=True)
        b, s, g, j = self.layout
        self.rows, self.channels, self.statistics = b * s, g * j, b * g

    def to_kernel(self, a, moved=False):
        """`a` (of the input's shape) as the kernels take it."""
        if self.order is not None and not moved:
            a = self.xp.transpose(a, self.order)
        return self.xp.ascontiguousarray(a).astype(self.dtype, copy=False)

    def back(self, y, dtype):
        """A result of the kernels in the input's axes' order and `dtype`."""
        if self.order is not None:
            y = self.xp.ascontiguousarray(self.xp.transpose(y, tuple(int(a) for a in np.argsort(self.order))))
        return y.astype(dtype, copy=False)

    def per_channel(self, scale):
        """Whether `scale` holds one value per channel ``g * J + j``, of x's trailing shape."""
        shape = self.x.shape
        return self.order is None and scale.size == self.channels and scale.shape == shape[len(shape) - scale.ndim:]

    def parameter(self, p):
        """A parameter (or None) as the kernels take it: the input stands in for None."""
        return self.x if p is None else self.xp.ascontiguousarray(p).astype(self.dtype, copy=False).reshape(-1)

    def statistic(self, a):
        return self.xp.ascontiguousarray(a).astype(self.dtype, copy=False).reshape(-1)

    def numbers(self, epsilon, flags):
        b, s, g, j = self.layout
        return np.int64(s), np.int64(g), np.int64(j), np.float64(epsilon), np.int32(flags)

    def launch(self, kernels, *args):
        """`kernels` (NORM_FORWARD or NORM_BACKWARD) over the statistics, none if empty."""
        if self.statistics and self.x.size:
            kernels[self.dtype]((self.statistics,), (THREADS,), args)

    def affine_grads(self, gy, mean, var, scale, bias, epsilon, flags, needs):
        """The gradients of `scale` and `bias` (where `needs` says) from the cotangent `gy`."""
        if not (needs[0] or needs[1]):
            return None, None
        make = self.xp.empty if self.rows else self.xp.zeros  # sums over no rows are 0
        grads = [make(p.shape, self.dtype) if need else None for p, need in zip((scale, bias), needs)]
        flags |= (SCALE if needs[0] else 0) | (BIAS if needs[1] else 0)
        if self.rows and self.channels:
            b, s, g, j = self.layout
            gs, gb = (self.x if a is None else a for a in grads)
            AFFINE_BACKWARD[self.dtype](((self.channels + 31) // 32,), (32, 8), (
                gy, self.x, mean, var, gs, gb, np.int64(self.rows), np.int64(self.channels), np.int64(s),
                np.int64(g), np.int64(j), np.float64(epsilon), np.int32(flags)))
        return tuple(None if a is None else a.astype(p.dtype, copy=False) for a, p in zip(grads, (scale, bias)))


def _dtype(*arrays):
    return np.result_type(*(a.dtype for a in arrays if a is not None))


def moments(x, axes):
    """Mean and biased variance of `x` over `axes`, with kept dimensions: one launch."""
    n = _Normalized(x, axes, x.dtype)
    mean, var = (n.xp.empty(n.statistics, n.dtype) for _ in range(2))
    n.launch(NORM_FORWARD, n.x, n.x, n.x, mean, var, n.x, *n.numbers(0.0, CENTRE))
    if not n.x.size:  # means over no values
        mean.fill(np.nan)
        var.fill(np.nan)
    return tuple(a.reshape(n.stat_shape).astype(x.dtype, copy=False) for a in (mean, var))


def normalize_affine(x, scale, bias, axes, epsilon, stats, centre):
    """The normalisation (centred or RMS), times `scale`, plus `bias` (each may be None),
    in one launch; backward, two (three without a per-channel scale)."""
    dtype = _dtype(x, scale, bias)
    n = _Normalized(x, axes, dtype)
    if scale is not None and not n.per_channel(scale):  # an affine map of another shape
        y, normalize_vjp = normalize_affine(x, None, None, axes, epsilon, stats, centre)
        out, affine_vjp = multiply.raw(y, scale) if bias is None else scale_shift(y, scale, bias)

        def composed_vjp(g, needs):
            grads = affine_vjp(g, needs if bias is not None else needs[:2])
            gx = normalize_vjp(grads[0], (True, False, False))[0] if needs[0] else None
            return gx, grads[1], None if bias is None else grads[2]

        return out, composed_vjp
    xp = n.xp
    if stats is None:
        mean, var = (xp.empty(n.statistics, n.dtype) for _ in range(2))
    else:
        mean, var = (n.statistic(a) for a in stats)
    flags = (CENTRE if centre else 0) | (GIVEN if stats is not None else 0)
    flags |= (SCALE if scale is not None else 0) | (BIAS if bias is not None else 0)
    sc, bi = n.parameter(scale), n.parameter(bias)
    y = xp.empty(n.x.shape, n.dtype)
    n.launch(NORM_FORWARD, n.x, sc, bi, mean, var, y, *n.numbers(epsilon, flags | WRITE))

    def vjp(g, needs):
        gy = n.to_kernel(g)
        gx = None
        if needs[0]:
            gx = xp.empty(gy.shape, n.dtype)
            n.launch(NORM_BACKWARD, gy, n.x, sc, mean, var, gx, *n.numbers(epsilon, flags & (CENTRE | SCALE)))
            gx = n.back(gx, x.dtype)
        gs, gb = n.affine_grads(gy, mean, var, scale, bias, epsilon, NORMED | (flags & CENTRE), needs[1:])
        return gx, gs, gb

    return n.back(y, dtype), vjp


def normalize(x, axes, epsilon, stats):
    """``(x - mean) / sqrt(var + epsilon)`` over `axes`: one launch; backward, one."""
    y, vjp = normalize_affine(x, None, None, axes, epsilon, stats, True)
    return y, lambda g, needs: vjp(g, (True, False, False))[:1]


def rms_normalize(x, axes, epsilon):
    """``x / sqrt(mean(x**2) + epsilon)`` over `axes`: one launch; backward, one."""
    y, vjp = normalize_affine(x, None, None, axes, epsilon, None, False)
    return y, lambda g, needs: vjp(g, (True, False, False))[:1]


def _scale_shift_twin(y, scale, bias, out):
    np.multiply(y, scale, out=out)
    out += bias


SCALE_SHIFT = Elementwise("luxnn_scale_shift", "T y, T scale, T bias", "T out", "out = y * scale + bias;",
                          twin=_scale_shift_twin)


def scale_shift(y, scale, bias):
    """``y * scale + bias`` (scale and bias of y's trailing shape): one launch; backward,
    one for y's gradient and one for both parameters'."""
    xp, dtype = module_of(y), _dtype(y, scale, bias)
    out = SCALE_SHIFT(*(a.astype(dtype, copy=False) for a in (y, scale, bias)), xp.empty(y.shape, dtype))
    # Seen as a normalisation over the leading axes (B = 1), with y taken as it is.
    n = _Normalized(y, tuple(range(y.ndim - scale.ndim)), dtype)

    def vjp(g, needs):
        gy = xp.multiply(g, scale) if needs[0] else None
        gs, gb = n.affine_grads(n.to_kernel(g), n.x, n.x, scale, bias, 0.0, 0, needs[1:])
        return gy, gs, gb

    return out, vjp


def _inverse_std_twin(var, eps, out):
    np.divide(1, np.sqrt(var + var.dtype.type(eps)), out=out)


# 1 / sqrt(var + eps) in the statistics' dtype (NumPy's promotion of the CPU path).
INVERSE_STD = Elementwise("luxnn_inverse_std", "S var, float64 eps", "S out", "out = (S)1 / sqrt(var + (S)eps);",
                          twin=_inverse_std_twin)


def _frozen_twin(x, scale, bias, mean, inv, affine, y):
    inv = inv.astype(y.dtype)
    if affine:
        s = scale.astype(y.dtype) * inv
        y[...] = x * s + (bias.astype(y.dtype) - mean.astype(y.dtype) * s)
    else:
        y[...] = (x - mean.astype(y.dtype)) * inv


# The normalisation by fixed (running) statistics and the affine map, per element, as
# ``x * s + (bias - mean * s)`` with ``s = scale * inv`` (``(x - mean) * inv`` without).
FROZEN_FORWARD = Elementwise(
    "luxnn_frozen_normalize",
    "X x, P scale, P bias, S mean, S inv, int32 affine",
    "O y",
    """
    if (affine) {
        const O s = (O)scale * (O)inv;
        y = (O)x * s + ((O)bias - (O)mean * s);
    } else {
        y = ((O)x - (O)mean) * (O)inv;
    }
    """,
    twin=_frozen_twin,
)


def _frozen_grad_twin(g, scale, inv, affine, gx):
    inv = inv.astype(gx.dtype)
    gx[...] = g * (scale.astype(gx.dtype) * inv if affine else inv)


# Both sides of the ?: are cast to O, one type: for float16 a product may come out a float.
FROZEN_BACKWARD = Elementwise(
    "luxnn_frozen_normalize_grad",
    "G g, P scale, S inv, int32 affine",
    "O gx",
    "gx = (O)g * (affine ? (O)((O)scale * (O)inv) : (O)inv);",
    twin=_frozen_grad_twin,
)


def frozen_normalize(x, scale, bias, mean, var, epsilon):
    """``(x - mean) / sqrt(var + epsilon) * scale + bias`` with fixed per-channel
    statistics: two launches (one of C threads); backward, one for x and one for both
    parameters."""
    xp = module_of(x)
    dtype = _dtype(x, scale, bias, mean, var)
    affine = scale is not None
    sc, bi = (scale, bias) if affine else (mean, mean)
    inv = INVERSE_STD(var, np.float64(epsilon), xp.empty(var.shape, var.dtype))
    y = FROZEN_FORWARD(x, sc, bi, mean, inv, np.int32(affine), xp.empty(x.shape, dtype))

    def vjp(g, needs):
        gx = None
        if needs[0]:
            gx = FROZEN_BACKWARD(g, sc, inv, np.int32(affine), xp.empty(x.shape, _dtype(g, scale, inv)))
            gx = gx.astype(x.dtype, copy=False)
        if not affine:
            return gx, None, None, None, None
        n = _Normalized(x, tuple(range(x.ndim - 1)), dtype)  # channels last: statistic c of channel c
        gs, gb = n.affine_grads(n.to_kernel(g), n.statistic(mean), n.statistic(inv), scale, bias, epsilon,
                                NORMED | CENTRE | RSTD, needs[1:3])
        return gx, gs, gb, None, None

    return y, vjp


def _running_twin(mean, var, rows, channels, momentum, unbias, running_mean, running_var, new_mean, new_var):
    m = mean.reshape(rows, channels).mean(axis=0)
    v = var.reshape(rows, channels).mean(axis=0)
    new_mean[...] = (1 - momentum) * running_mean + momentum * m
    new_var[...] = (1 - momentum) * running_var + unbias * v


# The running statistics' update of each channel: the batch's (per-sample, for
# InstanceNorm) statistics averaged over their rows, then the moving averages. The new
# statistics (N) may be of a wider dtype than the running ones (R): CuPy binds a letter
# to one dtype, the outputs' first.
RUNNING_UPDATE = Elementwise(
    "luxnn_running_update",
    "raw T mean, raw T var, int64 rows, int64 channels, float64 momentum, float64 unbias, R running_mean, "
    "R running_var",
    "N new_mean, N new_var",
    """
    T m = 0, v = 0;
    for (long long r = 0; r < rows; ++r) { m += mean[r * channels + i]; v += var[r * channels + i]; }
    m = m / (T)rows;
    v = v / (T)rows;
    new_mean = (N)((1 - momentum) * (double)running_mean + momentum * (double)m);
    new_var = (N)((1 - momentum) * (double)running_var + unbias * (double)v);
    """,
    twin=_running_twin,
)


def update_running(running_mean, running_var, mean, var, momentum, count):
    """The moving averages of the running statistics: one launch."""
    xp, c = module_of(mean), running_mean.shape[-1]
    mean, var = xp.ascontiguousarray(mean), xp.ascontiguousarray(var)
    return RUNNING_UPDATE(mean, var, np.int64(mean.size // c), np.int64(c), np.float64(momentum),
                          np.float64(momentum * count / (count - 1)), running_mean, running_var,
                          *(xp.empty(r.shape, np.result_type(r.dtype, mean.dtype)) for r in (running_mean, running_var)))
