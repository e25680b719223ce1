"""The CUDA kernels of the normalisations, the fused cross-entropies and the embedding
lookup on a GPU (skipped without one, with the reason): every launch of each kernel is
checked against its NumPy twin on host copies of its arguments, and each layer's output,
gradients and state against the CPU path, on the configurations of tests/test_sim_norm.py.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest

import luxnn as lx
from luxnn.kernels import Raw

from test_gpu import NO_GPU
from test_sim_norm import LAYER_CASES, LOSS_CASES, _assert_close, _layer_run, _loss_run, _weights, kernels_here

pytestmark = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")

if NO_GPU is None:
    import cupy

DTYPES = [np.float32, np.float64]
GPU_TOLERANCE = {np.float32: 1e-4, np.float64: 1e-10}

@pytest.fixture
def twins_checked(monkeypatch):
    """Runs each launch of these kernels' twin on host copies of its arguments and checks
    that every array agrees after the launch; yields the launches checked by name."""
    checked = collections.Counter()
    for kernel in kernels_here():
        monkeypatch.setattr(kernel, "compiled", _shadowed(kernel, kernel.compiled, checked))
    yield checked


def _shadowed(kernel, compiled, checked):
    def make(xp):
        real = compiled(xp)

        def launch(*args, **kwargs):
            arrays = args[2] if isinstance(kernel, Raw) else args
            host = [a.get() if isinstance(a, cupy.ndarray) else a for a in arrays]
            result = real(*args, **kwargs)
            kernel.twin(*host)
            for i, (a, h) in enumerate(zip(arrays, host)):
                if isinstance(a, cupy.ndarray):
                    _assert_close(a.get(), h, f"{kernel.name} argument {i}", GPU_TOLERANCE)
            checked[kernel.name] += 1
            return result

        return launch

    return make


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_each_normalisation_on_the_gpu_matches_its_twins_and_the_cpu(name, dtype, twins_checked):
    make, shape, train = LAYER_CASES[name]
    got = _layer_run(lx.CUDADevice(0), make(), shape, dtype, train)
    _assert_close(got, _layer_run(lx.cpu_device(), make(), shape, dtype, train), name, GPU_TOLERANCE)
    assert twins_checked or 0 in shape, "no kernel of the normalisations ran"


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_each_cross_entropy_on_the_gpu_matches_its_twins_and_the_cpu(name, dtype, twins_checked):
    make, shape = LOSS_CASES[name]
    got = _loss_run(lx.CUDADevice(0), make(), shape, dtype)
    _assert_close(got, _loss_run(lx.cpu_device(), make(), shape, dtype), name, GPU_TOLERANCE)
    assert twins_checked["luxnn_cross_entropy_grad"] >= 1


@pytest.mark.parametrize("rows", [7, 1500])
def test_the_embedding_on_the_gpu_matches_its_twins_and_the_cpu(rows, twins_checked):
    rng = np.random.default_rng(0)
    table, indices = rng.standard_normal((rows, 300)), rng.integers(0, 5, (40, 9))  # repeated; > 256 columns

    def run(device):
        t, i = device((table, indices))
        y, vjp = lx.ops.lookup_rows.raw(t, i)
        return lx.cpu_device()((y, vjp(device(_weights(y)), (True, False))[0]))

    _assert_close(run(lx.CUDADevice(0)), run(lx.cpu_device()), "embedding", GPU_TOLERANCE)
    assert twins_checked["luxnn_embedding_lookup"] == 1 and twins_checked["luxnn_embedding_scatter_float64"] == 1


def test_a_bad_label_on_the_gpu_gives_nan_then_raises_at_the_next_call(twins_checked):
    loss, device = lx.losses.CrossEntropyLoss(), lx.CUDADevice(0)
    logits = device(np.zeros((4, 5), np.float32))
    assert np.isnan(float(loss(logits, device(np.array([0, 7, 1, 2])))))  # float(): the kernels have run
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 5\), got 1 outside it \(as high as 7\)"):
        loss(logits, device(np.array([0, 1, 1, 2])))
