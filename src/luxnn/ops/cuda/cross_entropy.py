"""The fused cross-entropies on a CUDA device (CuPy arrays): forward, one kernel for every
row's loss (and what its gradient needs) and one for the reduction; backward, one kernel.

The labels are checked in the forward kernel, not on the host, so that a step costs no
host synchronisation: a label outside ``[0, K)`` (and not `ignore_index`) makes its row's
loss and gradient NaN, so a reduced loss is NaN too, never a finite wrong value, and sets
a flag that a later call reads (`luxnn.ops.device_checks`): a bad label raises the host
check's ValueError there, naming the call it was found in.
"""

from __future__ import annotations

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..block_kernels import per_dtype
from ..cpu.cross_entropy import NO_COUNT
from ..device_checks import DeferredChecks, outside

__all__ = ["softmax_cross_entropy", "nll_loss"]

THREADS = 256
ROW = 5  # per row: lse, coef, at_label, keep, count weight (see CROSS_ENTROPY_FORWARD)
HAS_WEIGHT, HAS_IGNORE, SMOOTHING, PER_ROW, MEAN, LOG_PROBS = 1, 2, 4, 8, 16, 32
_FLAGS = "HAS_WEIGHT = 1, HAS_IGNORE = 2, SMOOTHING = 4, LOG_PROBS = 32"
# Infinity and NaN without the math headers (NVRTC compiles without them).
_CONSTANTS = r"""
#define LUXNN_INF __longlong_as_double(0x7ff0000000000000LL)
#define LUXNN_NAN __longlong_as_double(0x7ff8000000000000LL)
"""


def _forward_twin(z, labels, weight, loss, rows, flag, k, smoothing, ignore, flags):
    r = z.shape[0] if z.size else loss.shape[0]
    z = z.reshape(r, k)
    w = weight if flags & HAS_WEIGHT else np.ones(k, z.dtype)
    mx = z.max(axis=1, keepdims=True)
    shifted = z - mx
    with np.errstate(all="ignore"):
        lse = np.log(np.exp(shifted).sum(axis=1))
    y = labels.astype(np.int64)
    ignored = (y == ignore) if flags & HAS_IGNORE else np.zeros(r, bool)
    bad = ~ignored & ((y < 0) | (y >= k))
    safe = np.where(ignored | bad, 0, y)
    wy = w[safe]
    s = z.dtype.type(smoothing)
    at_label = (1 - s) * wy
    value = (lse - shifted[np.arange(r), safe]) * wy
    coef = at_label
    if flags & LOG_PROBS:  # NLL: the inputs are the log-probabilities
        value, coef, lse, mx = -z[np.arange(r), safe] * wy, np.zeros(r, z.dtype), np.zeros(r, z.dtype), np.zeros((r, 1), z.dtype)
    if flags & SMOOTHING:
        total_w = w.sum()
        value = (1 - s) * value + (s / k) * (total_w * lse - shifted @ w)
        coef = at_label + (s / k) * total_w
    table = np.stack([lse + mx[:, 0], coef, at_label, np.ones(r, z.dtype), wy], axis=1)
    table[ignored, 1:] = 0
    value[ignored] = 0
    table[bad], value[bad] = np.nan, np.nan
    loss[...], rows.reshape(r, ROW)[...] = value, table
    if bad.any():
        flag[0] += bad.sum()
        low, high = y[bad & (y < 0)], y[bad & (y >= k)]
        flag[1] = min(flag[1], low.min(initial=0))
        flag[2] = max(flag[2], high.max(initial=0))


# One row (of K classes) per block: its log-sum-exp, its loss, and for the gradient
# ``(softmax * coef - [c == label] * at_label - s / K * w_c * keep) * factor`` its numbers;
# with LOG_PROBS, the row holds log-probabilities (NLL): loss ``-w_y * z_y``, coef 0.
CROSS_ENTROPY_FORWARD = per_dtype("luxnn_cross_entropy_forward", r"""
template <typename T>
__device__ void cross_entropy_forward(const T* z, const long long* labels, const T* weight, T* loss, T* rows,
                                      long long* flag, long long K, double smoothing, long long ignore, int flags) {
    const long long r = blockIdx.x;
    const T* zr = z + r * K;
    T mx[1] = {(T)-LUXNN_INF};
    T v[3] = {0, 0, 0};  // sum of exp, sum of w_c * shifted_c, sum of w_c
    if (!(flags & LOG_PROBS)) {
        for (long long c = threadIdx.x; c < K; c += blockDim.x) mx[0] = zr[c] > mx[0] ? zr[c] : mx[0];
        block_reduce(mx, Max(), (T)-LUXNN_INF);
        for (long long c = threadIdx.x; c < K; c += blockDim.x) {
            const T w = (flags & HAS_WEIGHT) ? weight[c] : (T)1, shifted = zr[c] - mx[0];
            v[0] += exp(shifted);
            v[1] += w * shifted;
            v[2] += w;
        }
        block_sums(v);
    }
    if (threadIdx.x != 0) return;
    const long long y = labels[r];
    const T lse = log(v[0]), s = (T)smoothing;
    T* out = rows + r * 5;
    if ((flags & HAS_IGNORE) && y == ignore) {
        loss[r] = 0;
        out[0] = (flags & LOG_PROBS) ? (T)0 : lse + mx[0];  // as an NLL row's, never log(0)
        out[1] = 0; out[2] = 0; out[3] = 0; out[4] = 0;
    } else if (y < 0 || y >= K) {
        atomicAdd((unsigned long long*)flag, 1ull);
        if (y < 0) atomicMin(flag + 1, y); else atomicMax(flag + 2, y);
        const T nan = (T)LUXNN_NAN;
        loss[r] = nan;
        for (int j = 0; j < 5; ++j) out[j] = nan;
    } else {
        const T wy = (flags & HAS_WEIGHT) ? weight[y] : (T)1, at_label = (1 - s) * wy;
        if (flags & LOG_PROBS) {
            loss[r] = -zr[y] * wy;
            out[0] = 0; out[1] = 0; out[2] = wy; out[3] = 1; out[4] = wy;
            return;
        }
        T value = (lse - (zr[y] - mx[0])) * wy, coef = at_label;
        if (flags & SMOOTHING) {
            value = (1 - s) * value + (s / (T)K) * (v[2] * lse - v[1]);
            coef = at_label + (s / (T)K) * v[2];
        }
        loss[r] = value;
        out[0] = lse + mx[0]; out[1] = coef; out[2] = at_label; out[3] = 1; out[4] = wy;
    }
}
""", "const T* z, const long long* labels, const T* weight, T* loss, T* rows, long long* flag, long long K, "
     "double smoothing, long long ignore, int flags",
    "cross_entropy_forward(z, labels, weight, loss, rows, flag, K, smoothing, ignore, flags)", _forward_twin,
    prelude=f"{_CONSTANTS}\nenum {{ {_FLAGS} }};")


def _reduce_twin(loss, rows, total, count, flag, n, mean):
    t, c = loss.sum(), rows.reshape(-1, ROW)[:, 4].sum()
    count[...] = c
    if mean and not c > 0:
        flag[3] = 1
        total[...] = np.nan
    else:
        total[...] = t / c if mean else t


# The rows' losses summed (divided by their count weights' sum for a mean) in one block.
CROSS_ENTROPY_REDUCE = per_dtype("luxnn_cross_entropy_reduce", r"""
template <typename T>
__device__ void cross_entropy_reduce(const T* loss, const T* rows, T* total, T* count, long long* flag,
                                     long long n, int mean) {
    T v[2] = {0, 0};
    for (long long r = threadIdx.x; r < n; r += blockDim.x) { v[0] += loss[r]; v[1] += rows[r * 5 + 4]; }
    block_sums(v);
    if (threadIdx.x != 0) return;
    *count = v[1];
    if (mean && !(v[1] > 0)) { flag[3] = 1; *total = (T)LUXNN_NAN; }
    else *total = mean ? v[0] / v[1] : v[0];
}
""", "const T* loss, const T* rows, T* total, T* count, long long* flag, long long n, int mean",
    "cross_entropy_reduce(loss, rows, total, count, flag, n, mean)", _reduce_twin, prelude=_CONSTANTS)


def _grad_twin(z, rows, labels, weight, g, count, k, s, flags, grad):
    table = rows.reshape(-1, ROW)
    with np.errstate(all="ignore"):
        out = np.where(table[:, 1:2] != 0, np.exp(z - table[:, :1]) * table[:, 1:2], 0)
    out -= np.where(np.arange(k)[None, :] == labels[:, None], table[:, 2:3], 0)
    if flags & SMOOTHING:
        out -= (s / k) * (weight[None, :] if flags & HAS_WEIGHT else 1) * table[:, 3:4]
    factor = g[:, None] if flags & PER_ROW else g[0]
    grad[...] = out * (factor / count[0] if flags & MEAN else factor)


# d(loss)/d(logits) of every element of the (rows, k) logits: the row's numbers from the
# forward pass, times the cotangent (the row's, or the reduced loss's over the count).
CROSS_ENTROPY_GRAD = Elementwise(
    "luxnn_cross_entropy_grad",
    "T z, raw T rows, raw int64 labels, raw T weight, raw T g, raw T count, int64 k, T s, int32 flags",
    "T grad",
    """
    const long long r = i / k, c = i - r * k;
    T out = rows[r * 5 + 1] != 0 ? exp(z - rows[r * 5]) * rows[r * 5 + 1] : (T)0;
    if (c == labels[r]) out -= rows[r * 5 + 2];
    if (flags & 4) out -= (s / (T)k) * ((flags & 1) ? weight[c] : (T)1) * rows[r * 5 + 3];
    const T factor = g[(flags & 8) ? r : 0];
    grad = out * ((flags & 16) ? factor / count[0] : factor);
    """,
    twin=_grad_twin,
)

CHECKS = DeferredChecks()  # the labels' flags of the calls not read yet


def softmax_cross_entropy(logits, labels, label_smoothing, reduction, weight, ignore_index, owner):
    """Per-example ``-log softmax(logits)[label]`` (smoothed, weighted, ignoring
    `ignore_index`), reduced by `reduction`: two or three launches; backward, one."""
    return _fused(logits, labels, label_smoothing, reduction, weight, ignore_index, owner, 0)


def nll_loss(log_probs, labels, reduction, weight, ignore_index, owner):
    """Per-example ``-weight[label] * log_probs[label]`` (0 for `ignore_index`), reduced by
    `reduction`: two or three launches; backward, one."""
    return _fused(log_probs, labels, 0.0, reduction, weight, ignore_index, owner, LOG_PROBS)


def _fused(logits, labels, label_smoothing, reduction, weight, ignore_index, owner, flags):
    xp = module_of(logits)
    CHECKS.raise_found(xp, owner)
    k = logits.shape[-1]
    dtype = np.dtype(np.float64) if logits.dtype == np.float64 else np.dtype(np.float32)
    z = xp.ascontiguousarray(logits).astype(dtype, copy=False).reshape(-1, k)
    y = xp.ascontiguousarray(labels).reshape(-1).astype(np.int64, copy=False)
    n = y.size
    w = z if weight is None else xp.ascontiguousarray(xp.asarray(weight, dtype=dtype)).reshape(-1)  # read flat
    flags |= (HAS_WEIGHT if weight is not None else 0) | (HAS_IGNORE if ignore_index is not None else 0)
    flags |= SMOOTHING if label_smoothing else 0
    loss, rows, flag = xp.empty(n, dtype), xp.empty(n * ROW, dtype), CHECKS.flag(xp, 4)
    if n:
        CROSS_ENTROPY_FORWARD[dtype]((n,), (THREADS,), (
            z, y, w, loss, rows, flag, np.int64(k), np.float64(label_smoothing),
            np.int64(0 if ignore_index is None else ignore_index), np.int32(flags)))
    if reduction == "none":
        out, count = loss.reshape(labels.shape), rows
    else:
        out, count = xp.empty((), dtype), xp.empty(1, dtype)
        CROSS_ENTROPY_REDUCE[dtype]((1,), (THREADS,), (loss, rows, out, count, flag, np.int64(n),
                                                        np.int32(reduction == "mean")))
    CHECKS.add(xp, flag, lambda found, when: _report(found, when, k, owner), owner)
    grad_flags = flags | (PER_ROW if reduction == "none" else 0) | (MEAN if reduction == "mean" else 0)

    def vjp(g, needs):
        g = xp.ascontiguousarray(g).astype(dtype, copy=False).reshape(-1)
        grad = CROSS_ENTROPY_GRAD(z, rows, y, w, g, count, np.int64(k), dtype.type(label_smoothing),
                                  np.int32(grad_flags), xp.empty(z.shape, dtype))
        return grad.reshape(logits.shape).astype(logits.dtype, copy=False), None

    return out.astype(logits.dtype, copy=False), vjp


def _report(found: list[int], when: str, k: int, owner: str) -> None:
    bad, lowest, highest, no_count = found
    computed = (f"; found {when} on the device, which was computed all the same: its loss NaN, and a training "
                "step's in-place update applied with it (parameters may be NaN)")
    if bad:
        raise ValueError(f"{owner}: labels must lie in [0, {k}), {outside(bad, lowest, highest, k)}{computed}")
    if no_count:
        raise ValueError(NO_COUNT.format(owner=owner) + computed)
