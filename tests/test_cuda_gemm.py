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
from luxnn import capturing
from luxnn.bench import gpu_models
from luxnn.ops.cuda import gemm

import sim_cupy
import sim_nvmath
from test_sim_bench import sim_gpu  # noqa: F401 - the fixture: CuPy simulated, caches over a fake driver
from test_sim_gpu import LAYERS, MODELS, _assert_same_training, _device_cache, _run_both


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


def _device(rng, *shape, dtype=np.float64, offset=0):
    """Random values on the device, their first element `offset` elements after a 256-byte
    boundary (cudaMalloc's and luxnn's blocks are so aligned; the host's here need not be)."""
    values = rng.standard_normal(shape).astype(dtype)
    size = values.dtype.itemsize
    buffer = sim_cupy.empty(values.size + offset + 256 // size, dtype)
    start = -buffer.data.ptr % 256 // size + offset
    x = buffer[start : start + values.size].reshape(shape)
    x.set(values)
    return x


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


def _operands(rng, m, k, n, offset=0):
    """a ``(m, k)`` (`offset` elements off its alignment), b ``(k, n)`` and out ``(m, n)``."""
    return _device(rng, m, k, offset=offset), _device(rng, k, n), _device(rng, m, n)


def _check(a, b, out):
    assert gemm.matmul(a, b, out=out) is out
    np.testing.assert_allclose(out.get(), a.get() @ b.get())


def test_one_plan_per_layout_rebound_to_each_calls_operands_and_releasing_them(nvmath):
    rng = np.random.default_rng(1)
    before = len(nvmath.made)
    for _ in range(3):
        a, b, out = _operands(rng, 6, 4, 3)
        _check(a, b, out)
    (plan,) = nvmath.made[before:]
    assert plan.resets == 3 and plan.executes == 3 and plan.released
    kept = weakref.ref(a)
    del a
    assert kept() is None  # the plan holds no operand between calls
    a, b, out = _operands(rng, 6, 4, 3)
    _check(a, _device(rng, 3, 4).T, out)  # b column-major: another layout, another plan
    assert len(nvmath.made) == before + 2


def test_operands_less_aligned_than_a_plans_get_a_plan_of_their_own(nvmath):
    rng = np.random.default_rng(6)
    before = len(nvmath.made)
    for offset in (0, 1, 0):  # 256 bytes, 8 bytes, 256 bytes
        _check(*_operands(rng, 6, 4, 3, offset=offset))
    assert [plan.planned_alignment[0] for plan in nvmath.made[before:]] == [256, 8]


def test_the_least_recently_used_plan_is_freed_past_the_bound(nvmath, monkeypatch):
    monkeypatch.setattr(gemm, "PLANS", 2)
    rng = np.random.default_rng(2)
    rows = {"first": 2, "second": 3, "third": 5}
    before = len(nvmath.made)
    for name in ("first", "second", "first", "third"):
        _check(*_operands(rng, rows[name], 4, 3))
    first, second, third = nvmath.made[before:]
    assert not second.valid and first.valid and third.valid  # "second" was the least recently used
    _check(*_operands(rng, rows["second"], 4, 3))
    assert len(nvmath.made) == before + 4 and not first.valid


def test_a_capture_keeps_the_plans_it_launches_and_cannot_plan(nvmath):
    rng = np.random.default_rng(7)
    _check(*_operands(rng, 6, 4, 3))
    plan = nvmath.made[-1]
    with capturing.capture() as recorded:
        _check(*_operands(rng, 6, 4, 3))
        with pytest.raises(capturing.NotCapturable, match=r"a GEMM of a layout not planned before \(\(6, 5\) @"):
            gemm.matmul(*_operands(rng, 6, 5, 3)[:2])
    assert nvmath.made[-1] is plan  # nothing planned while capturing
    gemm.clear()
    assert plan.valid  # the graph that launches it keeps its workspace
    del recorded
    _check(*_operands(rng, 2, 2, 2))  # a plan made: the retired ones no graph launches freed
    assert not plan.valid


def test_a_captured_product_reads_and_writes_the_memory_as_it_is_at_each_launch(nvmath):
    rng = np.random.default_rng(8)
    a, b, out = _operands(rng, 6, 4, 3)
    stream = sim_cupy.cuda.Stream(non_blocking=True)  # capture needs a stream other than the default one
    with stream:
        _check(a, b, out)  # planned on this stream
        stream.begin_capture()
        gemm.matmul(a, b, out=out)
        graph = stream.end_capture()
        out.fill(np.nan)
        for scale in (2.0, 3.0):
            a *= scale
            graph.launch(stream)
            np.testing.assert_allclose(out.get(), a.get() @ b.get())


def test_a_plans_workspace_comes_from_the_current_allocator_at_its_first_execution_only(nvmath):
    rng = np.random.default_rng(3)
    sizes, upstream = [], sim_cupy.cuda.get_allocator()

    def recording(size):
        sizes.append(size)
        return upstream(size)

    operands = [(_device(rng, 8, 4), _device(rng, 4, 6), _device(rng, 8, 6)) for _ in range(3)]
    with sim_cupy.cuda.using_allocator(recording):
        for a, b, out in operands:
            gemm.matmul(a, b, out=out)
    assert sizes == [sim_nvmath.WORKSPACE_BYTES]


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


# tests/test_sim_gpu.py's models, and its layers whose GEMMs take other paths of ops/cuda
TRAINED = {**MODELS, **{name: LAYERS[name] for name in ("gru", "rnn", "bidirectional_lstm", "conv_transpose",
                                                        "conv_strided_grouped")}}  # fmt: skip


@pytest.mark.parametrize("name", list(TRAINED))
def test_each_model_trains_through_cublaslt_as_on_the_cpu(name, nvmath):
    with sim_cupy.counting() as counts:
        cpu, gpu = _run_both(TRAINED[name], lx.CUDADevice(0))
    _assert_same_training(cpu, gpu)
    assert counts["cublas"] == counts["cublas", "cublasLt_matmul"] > 0  # no product left to CuPy's cuBLAS


BATCH = 4  # tests/test_sim_bench.py's


def _launches_per_step(name: str) -> tuple[int, int, int]:
    """(launches, cuBLAS calls, those through cuBLASLt) of the third training step of the
    bench's row `name`."""
    step = gpu_models.TRAINING[name].luxnn(_device_cache(), batch=BATCH)
    for _ in range(3):
        with sim_cupy.counting() as counts:
            step()
    return counts["kernel"] + counts["fill"] + counts["cublas"], counts["cublas"], counts["cublas", "cublasLt_matmul"]


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention", "lstm"])
def test_the_bench_models_launch_the_same_with_and_without_nvmath(name, sim_gpu, monkeypatch):
    counts = {}
    for library in (sim_nvmath, None):
        gemm.clear()
        monkeypatch.setitem(sys.modules, "nvmath", library)
        counts[library] = _launches_per_step(name)
    gemm.clear()
    (launches, blas, lt), without = counts[sim_nvmath], counts[None]
    print(f"{name}: {launches} launches and {blas} cuBLAS calls per training step with nvmath, {without[:2]} without")
    assert (launches, blas) == without[:2] and lt == blas and without[2] == 0


def test_on_a_gpu_cublaslt_writes_each_product_into_out_without_reading_it_and_is_captured(gpu):
    pytest.importorskip("nvmath", reason="needs nvmath-python (pip install 'luxnn[cuda13]')")
    import cupy

    gemm.clear()
    rng = np.random.default_rng(5)
    matrix = lambda *shape: cupy.asarray(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    stream = cupy.cuda.Stream(non_blocking=True)  # capture needs a stream other than the default one
    with stream:
        for a, b in [(matrix(64, 32), matrix(32, 48)), (matrix(48, 32).T, matrix(48, 64)),
                     (matrix(2, 4, 16, 8), matrix(2, 4, 16, 8).swapaxes(-1, -2))]:  # fmt: skip
            out = cupy.full((*a.shape[:-1], b.shape[-1]), np.nan, np.float32)
            for _ in range(2):  # planned, then rebound
                out.fill(np.nan)
                assert gemm.matmul(a, b, out=out) is out
                np.testing.assert_allclose(out.get(), cupy.matmul(a, b).get(), rtol=1e-5, atol=1e-5)
            stream.begin_capture()
            gemm.matmul(a, b, out=out)
            graph = stream.end_capture()
            a[...] = 2 * a  # new values at the captured addresses
            out.fill(np.nan)
            graph.launch(stream)
            np.testing.assert_allclose(out.get(), cupy.matmul(a, b).get(), rtol=1e-5, atol=1e-5)
    gemm.clear()
