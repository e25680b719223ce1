"""luxnn.ops.cuda.gemm, the one GEMM of luxnn's CUDA ops, on the simulated CUDA device of
tests/sim_cupy.py: with nvmath-python simulated by tests/sim_nvmath.py (cuBLASLt through a
planned ``Matmul`` per layout) and without it (CuPy's matmul), each call site's products
against NumPy's, the plans kept and rebound, and the launches per training step of the
bench's models the same either way.

What the simulators cannot tell: whether cuBLASLt computes and captures as nvmath-python's
source says it does (the last test, on a GPU).
"""

from __future__ import annotations

import sys
import weakref

import numpy as np
import pytest

import luxnn as lx
from luxnn.bench import gpu_models
from luxnn.memory import cupy_backend
from luxnn.ops.cuda import gemm

import sim_cupy
import sim_nvmath
from test_memory_cuda import FakeDriver
from test_sim_gpu import MODELS, _assert_same_training, _device_cache, _run_both


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``, every CUDA cache's upstream a fake
    driver over host memory; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    monkeypatch.setattr(cupy_backend, "bind_driver", FakeDriver().bind)
    yield lx.gpu_device(force=True)


def _gemms_through(library, monkeypatch):
    """The GEMMs through `library` installed as ``nvmath`` (None: blocked, CuPy's matmul),
    with no plan kept from before."""
    gemm.clear()
    monkeypatch.setitem(sys.modules, "nvmath", library)


@pytest.fixture(params=["nvmath", "cupy"])
def backend(request, monkeypatch, sim_gpu):
    """The GEMMs through the simulated nvmath, or through CuPy."""
    _gemms_through(sim_nvmath if request.param == "nvmath" else None, monkeypatch)
    yield request.param
    gemm.clear()


@pytest.fixture
def nvmath(monkeypatch, sim_gpu):
    """The GEMMs through the simulated nvmath: the module."""
    _gemms_through(sim_nvmath, monkeypatch)
    yield sim_nvmath
    gemm.clear()


def _host(x):
    return x.get() if isinstance(x, sim_cupy.ndarray) else x


def _device(rng, *shape, dtype=np.float64):
    return sim_cupy.asarray(rng.standard_normal(shape).astype(dtype))


def _products(rng):
    """Each call site's products: (name, a, b, out or None), in the layouts the callers pass."""
    rows, w, g = _device(rng, 16, 20), _device(rng, 20, 32), _device(rng, 16, 32)
    q, k = _device(rng, 2, 3, 6, 4), _device(rng, 2, 3, 5, 4)  # (batch, heads, seq, head dim)
    scores = _device(rng, 2, 3, 6, 5)
    cols, kernel, grouped = _device(rng, 50, 18), _device(rng, 18, 8), _device(rng, 2, 50, 9)
    hs, w_hh, d = _device(rng, 8, 4, 12), _device(rng, 12, 48), _device(rng, 7, 4, 48)
    return [
        ("dense forward", rows, w, None),
        ("dense input gradient", g, w.T, None),
        ("dense weight gradient", rows.T, g, None),
        ("attention scores", q, k.swapaxes(-1, -2), None),
        ("attention combine", scores, k, None),
        ("attention key gradient", scores.swapaxes(-1, -2), q, None),
        ("conv im2col", cols, kernel, sim_cupy.empty((50, 8))),
        ("conv weight gradient", cols.T, _device(rng, 50, 8), sim_cupy.empty((18, 8))),
        ("conv bias gradient", sim_cupy.ones(50), _device(rng, 50, 8), sim_cupy.empty(8)),
        ("conv groups", grouped, _device(rng, 2, 9, 4), None),
        ("recurrent step", hs[3], w_hh, sim_cupy.empty((8, 4, 48))[5]),
        ("recurrent step gradient", d[2], w_hh.T, sim_cupy.empty((4, 12))),
        ("recurrent weight gradient", hs[:7].reshape(28, 12).T, d.reshape(28, 48), None),
        ("float32", _device(rng, 5, 3, dtype=np.float32), _device(rng, 3, 4, dtype=np.float32), None),
        ("float16", _device(rng, 5, 3, dtype=np.float16), _device(rng, 3, 4, dtype=np.float16), None),
        ("every other column", _device(rng, 6, 10)[:, ::2], _device(rng, 5, 3), None),
        ("into every other column", _device(rng, 6, 5), _device(rng, 5, 3), sim_cupy.empty((6, 6))[:, ::2]),
        ("a stack times a matrix", _device(rng, 2, 3, 6, 5), _device(rng, 5, 4), None),
        ("a matrix times a vector", _device(rng, 6, 5), _device(rng, 5), None),
        ("a vector times a vector", _device(rng, 5), _device(rng, 5), None),
    ]


_NAMES = [name for name, *_ in _products(np.random.default_rng(0))]


@pytest.mark.parametrize("case", range(len(_NAMES)), ids=_NAMES)
def test_each_call_sites_product_is_numpys(case, backend):
    name, a, b, out = _products(np.random.default_rng(case))[case]
    want = np.matmul(_host(a), _host(b))
    with sim_cupy.counting() as counts:
        got = gemm.matmul(a, b, out=out)
    assert got is out if out is not None else got.flags.c_contiguous, name
    assert got.shape == want.shape and got.dtype == want.dtype, name
    tolerance = 1e-2 if want.dtype == np.float16 else 1e-5 if want.dtype == np.float32 else 1e-12
    np.testing.assert_allclose(_host(got), want, rtol=tolerance, atol=tolerance, err_msg=name)
    library = ("cublas", "cublasLt_matmul") if backend == "nvmath" else ("cublas", "matmul")
    assert counts[library] == 1 and counts["cublas"] == 1, (name, counts)


def test_one_plan_per_layout_rebound_to_each_calls_operands_and_releasing_them(nvmath):
    rng = np.random.default_rng(1)
    before = len(nvmath.made)
    a, b = _device(rng, 6, 4), _device(rng, 4, 3)
    for _ in range(3):
        a, b = _device(rng, 6, 4), _device(rng, 4, 3)
        np.testing.assert_allclose(gemm.matmul(a, b).get(), a.get() @ b.get())
    (plan,) = nvmath.made[before:]
    assert plan.resets == 3 and plan.executes == 3 and plan.released
    kept = weakref.ref(a)
    del a
    assert kept() is None  # the plan holds no operand between calls
    gemm.matmul(_device(rng, 6, 4), b.T.copy().T)  # b column-major: another layout, another plan
    assert len(nvmath.made) == before + 2


def test_the_least_recently_used_plan_is_freed_past_the_bound(nvmath, monkeypatch):
    monkeypatch.setattr(gemm, "PLANS", 2)
    rng = np.random.default_rng(2)
    shapes = {name: ((n, 4), (4, 3)) for name, n in (("first", 2), ("second", 3), ("third", 5))}
    before = len(nvmath.made)
    for name in ("first", "second", "first", "third"):
        gemm.matmul(*(_device(rng, *shape) for shape in shapes[name]))
    first, second, third = nvmath.made[before:]
    assert not second.valid and first.valid and third.valid  # "second" was the least recently used
    gemm.matmul(*(_device(rng, *shape) for shape in shapes["second"]))
    assert len(nvmath.made) == before + 4 and not first.valid


def test_a_plans_workspace_comes_from_the_current_allocator_at_its_first_execution_only(nvmath):
    rng = np.random.default_rng(3)
    sizes, upstream = [], sim_cupy.cuda.get_allocator()

    def recording(size):
        sizes.append(size)
        return upstream(size)

    a, b, out = _device(rng, 8, 4), _device(rng, 4, 6), sim_cupy.empty((8, 6))
    with sim_cupy.cuda.using_allocator(recording):
        gemm.matmul(a, b, out=out)
        gemm.matmul(_device(rng, 8, 4), _device(rng, 4, 6), out=out)
    assert sizes == [sim_nvmath.WORKSPACE_BYTES, 8 * 4 * 8, 4 * 6 * 8]  # then the second call's operands


def test_products_cublaslt_does_not_take_are_cupys(backend):
    rng = np.random.default_rng(4)
    a, b = sim_cupy.asarray(rng.integers(0, 5, (3, 4))), sim_cupy.asarray(rng.integers(0, 5, (4, 2)))
    made = len(sim_nvmath.made)
    with sim_cupy.counting() as counts:
        got = gemm.matmul(a, b)
    assert got.get().tolist() == (a.get() @ b.get()).tolist() and counts["cublas", "matmul"] == 1
    assert len(sim_nvmath.made) == made


@pytest.mark.parametrize("a, b, out, message", [
    ((3, 4), (5, 2), None, r"a \(3, 4\) has 4 columns, b \(5, 2\) has 5 rows"),
    ((2, 3, 4), (3, 4, 2), None, "the leading axes of a"),
    ((3, 4), (4, 2), (2, 3), r"out is float64 \(2, 3\), the product of a \(3, 4\) and b \(4, 2\) is float64 \(3, 2\)"),
])  # fmt: skip
def test_operands_of_no_product_are_refused_naming_their_shapes(a, b, out, message, nvmath):
    made = len(nvmath.made)
    with pytest.raises(ValueError, match=message):
        gemm.matmul(sim_cupy.zeros(a), sim_cupy.zeros(b), out=None if out is None else sim_cupy.zeros(out))
    assert len(nvmath.made) == made


@pytest.mark.parametrize("name", list(MODELS))
def test_each_model_trains_through_cublaslt_as_on_the_cpu(name, nvmath):
    _assert_same_training(*_run_both(MODELS[name], lx.CUDADevice(0)))


BATCH = 4  # tests/test_sim_bench.py's


def _launches_per_step(name: str) -> tuple[int, int]:
    """(launches, cuBLAS calls) of the third training step of the bench's row `name`."""
    step = gpu_models.TRAINING[name].luxnn(_device_cache(), batch=BATCH)
    for _ in range(3):
        with sim_cupy.counting() as counts:
            step()
    return counts["kernel"] + counts["fill"] + counts["cublas"], counts["cublas"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention", "lstm"])
def test_the_bench_models_launch_the_same_with_and_without_nvmath(name, sim_gpu, monkeypatch):
    counts = {}
    for library in (sim_nvmath, None):
        gemm.clear()
        monkeypatch.setitem(sys.modules, "nvmath", library)
        counts[library] = _launches_per_step(name)
    gemm.clear()
    print(f"{name}: (launches, cuBLAS calls) per training step {counts[sim_nvmath]} with nvmath, {counts[None]} without")
    assert counts[sim_nvmath] == counts[None]


def test_on_a_gpu_cublaslt_writes_each_product_into_out_without_reading_it(gpu):
    pytest.importorskip("nvmath", reason="needs nvmath-python (pip install 'luxnn[cuda13]')")
    import cupy

    gemm.clear()
    rng = np.random.default_rng(5)
    matrix = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    for a, b in [(matrix(64, 32), matrix(32, 48)), (matrix(48, 32).T, matrix(48, 64)),
                 (matrix(2, 4, 16, 8), matrix(2, 4, 16, 8).swapaxes(-1, -2))]:  # fmt: skip
        for _ in range(2):  # planned, then rebound
            out = cupy.full((*a.shape[:-1], b.shape[-1]), np.nan, np.float32)
            assert gemm.matmul(a, b, out=out) is out
            np.testing.assert_allclose(out.get(), cupy.matmul(a, b).get(), rtol=1e-5, atol=1e-5)
    gemm.clear()
