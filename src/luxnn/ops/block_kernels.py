"""Building blocks of the ops' raw CUDA kernels (`luxnn.ops.cuda`): reductions over the
threads of a block, and a kernel declared once for each floating dtype."""

from __future__ import annotations

import re

import numpy as np

from ..kernels import Raw

__all__ = ["BLOCK_REDUCE", "per_dtype"]

# Reductions of NV values over the threads of a block, the same order on every launch
# (warp shuffles, then the warps' results): every thread gets the results.
BLOCK_REDUCE = r"""
struct Sum { template <typename T> __device__ T operator()(T a, T b) const { return a + b; } };
struct Max { template <typename T> __device__ T operator()(T a, T b) const { return a > b ? a : b; } };

template <typename T, int NV, typename Op>
__device__ void block_reduce(T (&v)[NV], Op op, T identity) {
    __shared__ T partial[NV][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
    for (int k = 0; k < NV; ++k)
        for (int o = 16; o > 0; o >>= 1) v[k] = op(v[k], __shfl_down_sync(0xffffffffu, v[k], o));
    if (lane == 0)
        for (int k = 0; k < NV; ++k) partial[k][warp] = v[k];
    __syncthreads();
    for (int k = 0; k < NV; ++k) {
        T s = lane < warps ? partial[k][lane] : identity;
        for (int o = 16; o > 0; o >>= 1) s = op(s, __shfl_down_sync(0xffffffffu, s, o));
        v[k] = __shfl_sync(0xffffffffu, s, 0);
    }
    __syncthreads();
}

template <typename T, int NV>
__device__ void block_sums(T (&v)[NV]) { block_reduce(v, Sum(), (T)0); }
"""

def per_dtype(name: str, body: str, signature: str, call: str, twin, prelude: str = "") -> dict:
    """One `Raw` kernel per floating dtype, ``name_float32`` and ``name_float64`` (the dict's
    keys: their dtypes), each calling the template function of `body` as `call` does
    (`signature`'s ``T`` is the dtype), after `BLOCK_REDUCE` and `prelude`."""
    entry = 'extern "C" __global__ void {name}({signature}) {{ {call}; }}'
    kernels = {}
    for dtype, ctype in (("float32", "float"), ("float64", "double")):
        kernel = f"{name}_{dtype}"
        code = "\n".join([BLOCK_REDUCE, prelude, body, entry.format(
            name=kernel, signature=re.sub(r"\bT\b", ctype, signature), call=call)])
        kernels[np.dtype(dtype)] = Raw(kernel, code, twin=twin)
    return kernels
