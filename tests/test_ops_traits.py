"""luxnn.ops.traits: one implementation of each area's kernels per device, with the same
functions on every device."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys

import numpy as np
import pytest

from luxnn.ops import cpu, cuda, traits

AREAS = sorted(m.name for m in pkgutil.iter_modules(cpu.__path__))


CUDA_SHARED = {"gemm"}  # ops/cuda's modules that its areas share, areas of none


def test_every_area_has_an_implementation_for_each_device():
    assert AREAS == sorted(m.name for m in pkgutil.iter_modules(cuda.__path__) if m.name not in CUDA_SHARED)


@pytest.mark.parametrize("area", AREAS)
def test_both_devices_implement_the_same_functions_with_the_same_parameters(area):
    on_cpu = importlib.import_module(f"luxnn.ops.cpu.{area}")
    on_cuda = importlib.import_module(f"luxnn.ops.cuda.{area}")
    assert on_cpu.__all__ and sorted(on_cpu.__all__) == sorted(on_cuda.__all__)
    for name in on_cpu.__all__:
        cpu_parameters = inspect.signature(getattr(on_cpu, name)).parameters
        assert list(cpu_parameters) == list(inspect.signature(getattr(on_cuda, name)).parameters), name


def test_numpy_arrays_get_the_cpus_implementation_and_cupys_the_cuda_one(monkeypatch):
    import sim_cupy

    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    for area in AREAS:
        assert traits.implementation(area, np.zeros(2)).__name__ == f"luxnn.ops.cpu.{area}"
        assert traits.implementation(area, sim_cupy.zeros(2)).__name__ == f"luxnn.ops.cuda.{area}"
    with pytest.raises(ModuleNotFoundError):
        traits.implementation("no_such_area", np.zeros(2))
    with pytest.raises(TypeError, match="NumPy and CuPy arrays, got builtins.object"):
        traits.implementation("conv", object())
    with pytest.raises(TypeError, match="NumPy and CuPy arrays, got numpy.matrix"):
        traits.Area("conv")[np.matrix]  # an ndarray subclass with arithmetic of its own


def test_every_cpu_implementation_loads_with_the_package():
    assert sorted(cpu.__all__) == AREAS  # a new area is added to ops/cpu/__init__.py's imports


def test_scalars_and_traced_reductions_take_the_cpus_implementation():
    import luxnn as lx
    from luxnn import ops

    assert traits.implementation("activations", np.float64(1.0)).__name__ == "luxnn.ops.cpu.activations"
    assert float(ops.relu(ops.relu(np.array(-2.0)))) == 0.0  # relu of a 0-d array is a NumPy scalar
    value, grad = lx.value_and_grad(lambda x: ops.sigmoid((x * x).mean()))(np.array([1.0, 2.0]))
    s = 1 / (1 + np.exp(-2.5))
    np.testing.assert_allclose(grad, s * (1 - s) * np.array([1.0, 2.0]))
    mean, var = lx.value_and_grad(lambda x: ops.moments(x, 0)[1].sum())(np.array([1.0, 3.0]))
    assert float(mean) == 1.0 and grad.shape == (2,)
