"""luxnn.kernels: the registry of luxnn's CUDA kernels and their NumPy twins."""

from __future__ import annotations

import numpy as np
import pytest

import luxnn as lx  # noqa: F401  (declares the kernels of every module)
from luxnn import kernels


def test_every_kernel_is_registered_by_name_with_its_twin():
    assert {"luxnn_sum_of_squares_float32", "luxnn_dropout_mask"} <= set(kernels.KERNELS)
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
