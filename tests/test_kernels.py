"""luxnn.kernels: the registry of luxnn's CUDA kernels and their NumPy twins."""

from __future__ import annotations

import importlib
import itertools
import pkgutil

import numpy as np
import pytest

import luxnn as lx  # noqa: F401  (declares the kernels of every module it imports)
import luxnn.ops.cuda
from luxnn import kernels

# The CUDA implementations load when a CuPy array first comes: load them all here.
for _module in pkgutil.iter_modules(luxnn.ops.cuda.__path__):
    importlib.import_module(f"luxnn.ops.cuda.{_module.name}")

import cupy_source

NVCC = cupy_source.nvcc()
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels' CUDA sources")


def test_every_kernel_is_registered_by_name_with_its_twin():
    assert {"luxnn_sum_of_squares_float32", "luxnn_dropout_mask", "luxnn_lstm_cell"} <= set(kernels.KERNELS)
    for name, kernel in kernels.KERNELS.items():
        assert kernel.name == name and callable(kernel.twin), name


def test_a_second_kernel_of_a_known_name_or_without_luxnns_prefix_is_refused():
    twin = lambda x, y: np.copyto(y, x)  # noqa: E731
    with pytest.raises(ValueError, match="two CUDA kernels named 'luxnn_dropout_mask'"):
        kernels.Elementwise("luxnn_dropout_mask", "T x", "T y", "y = x", twin=twin)
    with pytest.raises(ValueError, match="starts with 'luxnn_'"):
        kernels.Elementwise("copy", "T x", "T y", "y = x", twin=twin)
    assert "copy" not in kernels.KERNELS and kernels.KERNELS["luxnn_dropout_mask"].in_params != "T x"


def test_the_same_declaration_again_is_the_same_kernel(monkeypatch):
    first = kernels.KERNELS["luxnn_dropout_mask"]
    monkeypatch.setitem(kernels.KERNELS, "luxnn_dropout_mask", first)  # restored after the test
    again = kernels.Elementwise("luxnn_dropout_mask", first.in_params, first.out_params, first.operation,
                                twin=first.twin, preamble=first.preamble)  # what a module reload does
    assert kernels.KERNELS["luxnn_dropout_mask"] is again


def test_a_kernel_refuses_numpy_arrays_with_the_types_it_got():
    with pytest.raises(TypeError, match="runs on CuPy arrays, got float, ndarray"):
        kernels.KERNELS["luxnn_dropout_mask"](0.5, np.zeros(3))


# -- the CUDA sources compile (tests/cupy_source.py: what CuPy compiles for each kernel) ----------


@needs_nvcc
def test_every_kernels_cuda_source_compiles_as_cupy_would_compile_it():
    assert cupy_source.compile_errors(list(kernels.KERNELS.values()), NVCC) == {}


def _no_twin(*_args, **_kwargs) -> None:
    raise AssertionError("a kernel of this test only compiles")


@needs_nvcc
def test_the_compile_check_names_each_kernel_with_a_typo_or_a_type_error(monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))  # these test kernels leave with the test
    broken = [
        kernels.Elementwise("luxnn_test_typo", "T x", "T y", "y = exq(x)", twin=_no_twin),
        kernels.Elementwise("luxnn_test_pointer", "T x, int32 n", "T y", "y = &x + n", twin=_no_twin),
        kernels.Reduction("luxnn_test_norm", "T x", "T y", "x * x", "a + b", "y = sqrtt(a)", "0", twin=_no_twin),
        kernels.Raw("luxnn_test_raw", 'extern "C" __global__ void luxnn_test_raw(float* x) { x[threadIdx.x] = nothing; }',
                    twin=_no_twin),
    ]  # fmt: skip
    fine = kernels.Elementwise("luxnn_test_square", "T x, G g", "T y", "y = x * (T)g + CUDART_PI_F", twin=_no_twin)
    errors = cupy_source.compile_errors([*broken, fine], NVCC)
    assert set(errors) == {k.name for k in broken}, errors
    assert errors["luxnn_test_typo"] == ['T=float: identifier "exq" is undefined', 'T=double: identifier "exq" is undefined']
    assert "cannot be assigned to an entity of type" in errors["luxnn_test_pointer"][0]
    assert 'identifier "sqrtt" is undefined' in errors["luxnn_test_norm"][0]
    assert errors["luxnn_test_raw"] == ['identifier "nothing" is undefined']


def test_an_elementwise_kernels_source_is_cupys_at_every_float_and_double_combination(monkeypatch):
    monkeypatch.setattr(kernels, "KERNELS", dict(kernels.KERNELS))  # the test kernel leaves with the test
    axpy = kernels.Elementwise("luxnn_test_axpy", "G g, T a, bool add", "P p, T m",
                               "m = a * (T)g; if (add) p = (P)((T)p + m);", twin=_no_twin,
                               preamble="__device__ float unused_helper() { return 0.f; }")
    found = cupy_source.instances([axpy])
    assert len(found) == 8 and {tuple(i.types.values()) for i in found} == set(itertools.product(("float", "double"), repeat=3))
    source = found[0].source
    assert "typedef float G;\ntypedef float P;\ntypedef float T;\n" in source
    assert 'extern "C" __global__ void luxnn_test_axpy__0(const CArray<float, 1, true, true> _raw_g, ' in source
    assert "CArray<bool, 1, true, true> _raw_add, CArray<float, 1, true, true> _raw_p" in source
    assert "const G &g = _raw_g[_ind.get()];" in source and "P &p = _raw_p[_ind.get()];" in source
    assert source.index(axpy.preamble) < source.index("__global__") < source.index(axpy.operation)
