"""Row lookup on a CUDA device (CuPy arrays): one kernel each way, the gradient's sums in
a fixed order (no atomics: the same bits on every run).

The lookup checks the indices on the device: an index out of range gives a row of NaN and
sets a flag that a later lookup reads (`luxnn.ops.device_checks`), raising the host
check's error there, naming the call it was found in, without a host synchronisation per
call.
"""

from __future__ import annotations

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..block_kernels import per_dtype
from ..device_checks import DeferredChecks, outside

__all__ = ["lookup_rows", "scatter_add_rows"]

THREADS = 256
MAX_BLOCKS = 1024  # of the scatter-add: block b owns the rows r with r % blocks == b
CHECKS = DeferredChecks()


def _lookup_twin(indices, table, rows, dim, out, flag):
    r = indices.reshape(-1)
    bad = (r < 0) | (r >= rows)
    out.reshape(-1, dim)[...] = np.where(bad[:, None], np.nan, table.reshape(rows, dim)[np.where(bad, 0, r)])
    if bad.any():
        flag[0] += bad.sum()
        flag[1] = min(flag[1], r[r < 0].min(initial=0))
        flag[2] = max(flag[2], r[r >= rows].max(initial=0))


# out[i, d] = table[indices[i], d]; an index out of range: NaN, counted in the flag.
EMBEDDING_LOOKUP = Elementwise(
    "luxnn_embedding_lookup",
    "raw int64 indices, raw T table, int64 rows, int64 dim",
    "T out, raw int64 flag",
    """
    const long long row = i / dim, d = i - row * dim, r = indices[row];
    if (r < 0 || r >= rows) {
        out = (T)__longlong_as_double(0x7ff8000000000000LL);
        if (d == 0) {
            atomicAdd((unsigned long long*)&flag[0], 1ull);
            if (r < 0) atomicMin(&flag[1], r); else atomicMax(&flag[2], r);
        }
    } else {
        out = table[r * dim + d];
    }
    """,
    twin=_lookup_twin,
)


def _scatter_twin(g, indices, out, n, rows, dim):
    out[...] = 0
    kept = (indices >= 0) & (indices < rows)  # the kernel skips an index out of range
    np.add.at(out.reshape(rows, dim), indices[kept], g.reshape(n, dim)[kept])  # in the indices' order


# out[r] = sum of g[i] over i with indices[i] == r, in increasing i: block b zeroes and
# sums the rows r == b (mod gridDim.x), its threads one column each.
EMBEDDING_SCATTER = per_dtype("luxnn_embedding_scatter", r"""
template <typename T>
__device__ void embedding_scatter(const T* g, const long long* indices, T* out, long long n, long long rows,
                                  long long dim) {
    const long long blocks = gridDim.x, b = blockIdx.x;
    for (long long r = b; r < rows; r += blocks)
        for (long long d = threadIdx.x; d < dim; d += blockDim.x) out[r * dim + d] = 0;
    for (long long i = 0; i < n; ++i) {
        const long long r = indices[i];
        if (r < 0 || r >= rows || r % blocks != b) continue;
        for (long long d = threadIdx.x; d < dim; d += blockDim.x) out[r * dim + d] += g[i * dim + d];
    }
}
""", "const T* g, const long long* indices, T* out, long long n, long long rows, long long dim",
    "embedding_scatter(g, indices, out, n, rows, dim)", _scatter_twin)


def scatter_add_rows(g, indices, num_rows):
    """``out[indices[i]] += g[i]``: one launch, deterministic."""
    xp = module_of(g)
    dtype = np.dtype(np.float64) if g.dtype == np.float64 else np.dtype(np.float32)
    g2 = xp.ascontiguousarray(g).astype(dtype, copy=False)
    n, dim = g2.shape
    out = xp.empty((num_rows, dim), dtype)
    if num_rows and dim:
        threads = min(THREADS, -(-dim // 32) * 32)
        EMBEDDING_SCATTER[dtype]((min(num_rows, MAX_BLOCKS),), (threads,), (
            g2, xp.ascontiguousarray(indices).astype(np.int64, copy=False), out, np.int64(n), np.int64(num_rows),
            np.int64(dim)))
    return out.astype(g.dtype, copy=False)


def lookup_rows(table, indices, owner, error):
    """``table[indices]`` in one launch, the indices checked by the kernel (`error`, one
    call late, if out of range); gradient: `scatter_add_rows`, one launch."""
    xp = module_of(table)
    CHECKS.raise_found(xp, owner)
    rows, dim = table.shape
    flat = xp.ascontiguousarray(indices).reshape(-1).astype(np.int64, copy=False)
    flag = CHECKS.flag(xp, 3)
    out, _ = EMBEDDING_LOOKUP(flat, xp.ascontiguousarray(table), np.int64(rows), np.int64(dim),
                              xp.empty((*indices.shape, dim), table.dtype), flag)
    CHECKS.add(xp, flag, lambda found, when: _report(found, when, rows, owner, error), owner)

    def vjp(g, needs):
        if not needs[0]:
            return None, None
        return scatter_add_rows(g.reshape(-1, dim), flat, rows), None

    return out, vjp


def _report(found, when, rows, owner, error):
    if found[0]:
        raise error(f"{owner}: expected indices in [0, {rows}), {outside(*found, rows)}; found {when} on the device, "
                    "which was computed all the same: its rows NaN, and a training step's in-place update applied with "
                    "them (parameters may be NaN)")
