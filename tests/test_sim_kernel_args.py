"""The simulated device's kernel launches take their arguments as CuPy and CUDA take them
(tests/sim_cupy.py): an ElementwiseKernel's type letters bound as CuPy binds them, a
RawKernel's arguments checked against its C parameters, a strided array read flat from its
first element."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from luxnn import kernels

import sim_cupy as cp


@pytest.fixture
def made(monkeypatch):
    """Two test kernels, gone with the test: ``y = x * a`` elementwise (x and y of one
    letter) and a raw kernel with one parameter of each kind."""
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))
    scale = kernels.Elementwise("luxnn_test_sim_scale", "T x, T a, int32 k", "T y", "y = x * a * k;",
                                twin=lambda x, a, k, y: np.multiply(x * a, k, out=y))

    def raw_twin(x, y, n, k, d, f):
        y[:n] = x[:n] * f

    raw = kernels.Raw("luxnn_test_sim_raw", r"""
extern "C" __global__ void luxnn_test_sim_raw(const float* x, float* y, long long n, int k, double d, float f) {
    for (long long i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * f;
}""", twin=raw_twin)
    return scale, raw


def test_an_elementwise_kernels_letter_is_bound_by_its_output_first_and_its_arrays_must_match(made):
    scale, _ = made
    x = cp.asarray(np.arange(3.0, dtype=np.float32))
    assert scale(x, np.float64(2.0), 2.5, cp.empty(3, np.float32)).get().tolist() == [0.0, 4.0, 8.0]  # scalars cast
    with pytest.raises(TypeError, match="^Type is mismatched. x <class 'numpy.float32'> <class 'numpy.float64'> T"):
        scale(x, 2.0, 1, cp.empty(3, np.float64))
    with pytest.raises(TypeError, match="^Type is mismatched. a"):
        scale(x, cp.asarray(np.ones(3)), 1, cp.empty(3, np.float32))
    with pytest.raises(TypeError, match="^Type is mismatched. k"):  # an array of a named dtype: exactly that
        scale(x, 2.0, cp.asarray(np.ones(3, np.int64)), cp.empty(3, np.float32))


def test_a_raw_kernels_arguments_are_checked_against_its_c_parameters(made):
    _, raw = made
    x, y = cp.asarray(np.arange(4.0, dtype=np.float32)), cp.empty(4, np.float32)
    raw((1,), (32,), (x, y, 4, np.int32(0), 0.5, np.float32(2.0)))  # CuPy passes an int as int64, a float as double
    assert y.get().tolist() == [0.0, 2.0, 4.0, 6.0]
    bad = {
        "x": ((cp.asarray(np.ones(4)), y, 4, np.int32(0), 0.5, np.float32(2.0)), "takes a float32 array, got float64"),
        "n": ((x, y, np.int32(4), np.int32(0), 0.5, np.float32(2.0)), "takes a int64, got int32"),
        "k": ((x, y, 4, 0, 0.5, np.float32(2.0)), "takes a int32, got int"),
        "f": ((x, y, 4, np.int32(0), 0.5, 2.0), "takes a float32, got float"),
        "y": ((x, 0.5, 4, np.int32(0), 0.5, np.float32(2.0)), "takes a device array, got float"),
    }
    for name, (args, message) in bad.items():
        with pytest.raises(TypeError, match=rf"^sim_cupy: luxnn_test_sim_raw's parameter `[^`]*\b{name}` {message}"):
            raw((1,), (32,), args)
    with pytest.raises(TypeError, match="takes 6 arguments, got 5"):
        raw((1,), (32,), (x, y, 4, np.int32(0), 0.5))


def test_a_raw_kernel_reads_a_strided_array_flat_from_its_first_element(made):
    _, raw = made
    every_other, y = cp.asarray(np.arange(8.0, dtype=np.float32))[::2], cp.empty(4, np.float32)
    raw((1,), (32,), (every_other, y, 4, np.int32(0), 0.0, np.float32(1.0)))
    assert y.get().tolist() == [0.0, 1.0, 2.0, 3.0]  # not the view's 0, 2, 4, 6
