"""Stream capture and CUDA graphs on the simulated device (tests/sim_streams.py, under
tests/sim_cupy.py), held to what CuPy 14 and CUDA do: a capture records its stream's launches
without running them, a graph replays them over the memory as it is then, and what CuPy or
CUDA refuse in a capture fails as it fails there (CuPy's own checks leave the capture going,
CUDA's refusals invalidate it).

What the simulator cannot tell: whether a real GPU's graph computes what the recorded
launches do (the same kernels), nor anything of its speed.
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory, optim
from luxnn.ops.cuda.norm import SCALE_SHIFT

import sim_cupy as cp
from test_memory_cuda import FakeDriver

CUBLAS_REFUSED = "^calling cuBLAS API during stream capture is currently unsupported$"
INVALIDATED = "^cudaErrorStreamCaptureInvalidated: operation failed due to a previous error during capture$"
QUERY_INVALIDATED = "^the stream was capturing, but an error has invalidated the capture sequence$"


@pytest.fixture
def streams(monkeypatch):
    """Makes streams (``streams(non_blocking=True)``), with CuPy simulated as ``cupy``; a
    capture a test leaves open on one of them is ended after it."""
    monkeypatch.setitem(sys.modules, "cupy", cp)
    made = []

    def make(non_blocking: bool = True) -> cp.cuda.Stream:
        made.append(cp.cuda.Stream(non_blocking=non_blocking))
        return made[-1]

    yield make
    for stream in made:
        with contextlib.suppress(cp.cuda.runtime.CUDARuntimeError):  # not capturing, or invalidated: ended
            stream.end_capture()


def _inputs(seed: int = 0) -> tuple:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((4, 3)), rng.standard_normal((4, 3))


def _work(x: cp.ndarray, w: cp.ndarray) -> tuple:
    """Launches of each kind a capture records: new arrays and in-place writes, a reduction,
    fills, a gather by a device index, a scalar from the host, an update of an input."""
    y = cp.exp(x) * 2.0 + w
    total = y.sum(axis=0)
    z = cp.zeros_like(x)
    z += y
    z[1] = total
    picked = z[cp.arange(3)] * cp.asarray(0.5)
    x *= 3.0
    return y, total, z, picked


def _bits(*arrays: cp.ndarray) -> list[bytes]:
    return [a.get().tobytes() for a in arrays]


def _captured(stream: cp.cuda.Stream, work, *args) -> tuple:
    """(`work`'s results, its graph, the launches counted) with `work` captured on `stream`."""
    with stream, cp.counting() as counts:
        stream.begin_capture()
        results = work(*args)
        graph = stream.end_capture()
    return results, graph, counts


def test_a_capture_records_without_running_and_a_replay_computes_as_the_eager_launches(streams):
    x0, w0 = _inputs()
    with cp.counting() as eager_counts:
        expected = _bits(*_work(cp.asarray(x0), cp.asarray(w0)), cp.asarray(x0 * 3.0))
    x, w = cp.asarray(x0), cp.asarray(w0)
    (y, total, z, picked), graph, counts = _captured(streams(), _work, x, w)
    assert _bits(x, w) == [x0.tobytes(), w0.tobytes()]  # the capture changed no memory
    assert not z.get().any() and not picked.get().any()  # the fake allocator's new memory: zeros, unwritten
    eager = {key[1]: n for key, n in eager_counts.items() if isinstance(key, tuple) and key[0] != "memcpy"}
    assert {key[1]: n for key, n in counts.items() if isinstance(key, tuple)} == eager | {"host_to_device": 1}
    assert counts["captured"] == sum(eager.values()) + 1 and counts["kernel"] == counts["fill"] == 0
    with cp.counting() as replay:
        graph.launch()
    assert dict(replay) == {("graph", "launch"): 1, "graph": 1}  # the nodes launch nothing from the host
    assert _bits(y, total, z, picked, x) == expected  # bit for bit: the same NumPy work, in the same order


def test_a_replay_reads_the_inputs_as_they_are_then_and_the_host_scalars_as_they_were(streams):
    x, w = map(cp.asarray, _inputs())
    results, graph, _ = _captured(streams(), _work, x, w)
    x1, w1 = _inputs(seed=1)
    x.set(x1)
    w.set(w1)
    graph.launch()
    expected = _work(cp.asarray(x1), cp.asarray(w1))
    assert _bits(*results) == _bits(*expected)
    graph.launch()  # x was tripled by the first replay
    assert _bits(x) == [(x1 * 3.0 * 3.0).tobytes()]


@pytest.mark.parametrize("update", [
    lambda x, w, at: x.__iadd__(1.0), lambda x, w, at: x.__setitem__(slice(1, 3), 5.0),
    lambda x, w, at: x.fill(7.0), lambda x, w, at: cp.copyto(x, w), lambda x, w, at: cp.add.at(x, at, 1.0),
    lambda x, w, at: cp.multiply(x, 2.0, out=x), lambda x, w, at: x.__setitem__(at, w[1]),
    lambda x, w, at: SCALE_SHIFT(x, w, w, x),  # a luxnn ElementwiseKernel, in place
], ids=["iadd", "setitem", "fill", "copyto", "ufunc.at", "out", "scatter", "elementwise_kernel"])  # fmt: skip
def test_an_update_in_place_changes_nothing_in_the_capture_and_its_replay_does_what_it_does(update, streams):
    x0, w0 = _inputs()
    eager = cp.asarray(x0)
    update(eager, cp.asarray(w0), cp.asarray(np.array([0, 2, 2])))
    x, w, at = cp.asarray(x0), cp.asarray(w0), cp.asarray(np.array([0, 2, 2]))
    _, graph, counts = _captured(streams(), update, x, w, at)
    assert _bits(x) == [x0.tobytes()] and counts["captured"] == 1
    graph.launch()
    assert _bits(x) == _bits(eager)


def test_an_update_whose_arguments_numpy_refuses_raises_at_the_call_in_a_capture(streams):
    x, stream = cp.asarray(np.ones((4, 3))), streams()
    with stream:
        stream.begin_capture()
        with pytest.raises(ValueError):
            cp.add(x, cp.ones(5), out=x)  # shapes that do not broadcast: CuPy raises at the call too
        assert stream.is_capturing()
    assert _bits(x) == [np.ones((4, 3)).tobytes()]


@pytest.mark.parametrize("call", [
    lambda x: x @ x, lambda x: cp.matmul(x, x), lambda x: cp.dot(x, x), lambda x: x.dot(x),
    lambda x: cp.vdot(x, x), lambda x: cp.tensordot(x, x, 1), lambda x: cp.einsum("ij,jk->ik", x, x),
], ids=["@", "matmul", "dot", "ndarray.dot", "vdot", "tensordot", "einsum"])  # fmt: skip
def test_cupys_cublas_refuses_a_capture_which_goes_on(call, streams):
    x, stream = cp.asarray(np.eye(3)), streams()
    with stream:
        stream.begin_capture()
        with pytest.raises(NotImplementedError, match=CUBLAS_REFUSED):
            call(x)
        y = x + 1.0
        assert stream.is_capturing()
        graph = stream.end_capture()
    graph.launch()
    assert y.get().tolist() == (np.eye(3) + 1.0).tolist()
    assert call(x).get().shape in ((), (3, 3))  # outside the capture cuBLAS serves


@pytest.mark.parametrize("call, direction", [
    (lambda x: x.get(), "D2H"), (lambda x: x[0, 0].item(), "D2H"), (lambda x: float(x[0, 0]), "D2H"),
    (lambda x: int(x[0, 0]), "D2H"), (lambda x: bool(x[0, 0]), "D2H"), (lambda x: x.tolist(), "D2H"),
    (lambda x: cp.asnumpy(x), "D2H"), (lambda x: x[x > 0], "D2H"), (lambda x: cp.asarray(np.ones(3)), "H2D"),
    (lambda x: x.set(np.ones((3, 3))), "H2D"), (lambda x: x[np.array([0, 1])], "H2D"), (lambda x: x[[0, 1]], "H2D"),
], ids=["get", "item", "float", "int", "bool", "tolist", "asnumpy", "mask", "asarray", "set", "numpy_index",
        "list_index"])  # fmt: skip
def test_cupy_refuses_copies_between_host_and_device_in_a_capture_which_goes_on(call, direction, streams):
    x, stream = cp.asarray(np.eye(3)), streams()
    with stream:
        stream.begin_capture()
        with pytest.raises(RuntimeError, match=f"^the current stream is capturing, so {direction} transfers are "
                                               "disallowed$"):
            call(x)
        assert stream.is_capturing()
        stream.end_capture().launch()


def test_a_host_scalar_is_filled_in_on_the_device_which_a_capture_records(streams):
    (value,), graph, counts = _captured(streams(), lambda: (cp.asarray(2.5),))
    assert counts["captured"] == 1 and value.get() == 0.0
    graph.launch()
    assert value.get() == 2.5


@pytest.mark.parametrize("refused, status", [
    (lambda stream, event: stream.synchronize(), 900), (lambda stream, event: stream.done, 900),
    (lambda stream, event: cp.cuda.runtime.deviceSynchronize(), 900), (lambda stream, event: event.done, 907),
    (lambda stream, event: event.synchronize(), 907),
], ids=["stream.synchronize", "stream.done", "deviceSynchronize", "event.done", "event.synchronize"])  # fmt: skip
def test_what_cuda_refuses_in_a_capture_invalidates_it_and_its_end_raises(refused, status, streams):
    x, stream = cp.asarray(np.ones(3)), streams()
    names = {900: "cudaErrorStreamCaptureUnsupported: operation not permitted when stream is capturing",
             907: "cudaErrorCapturedEvent: operation not permitted on an event last recorded in a capturing stream"}
    with stream:
        stream.begin_capture()
        x += 1.0
        event = stream.record()
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match=f"^{names[status]}$") as refusal:
            refused(stream, event)
        assert refusal.value.status == status
        with pytest.raises(RuntimeError, match=QUERY_INVALIDATED):
            stream.is_capturing()
        with pytest.raises(cp.cuda.driver.CUDADriverError, match="^CUDA_ERROR_STREAM_CAPTURE_INVALIDATED: ") as late:
            x + 1.0  # a kernel: CuPy launches it through the driver
        assert late.value.status == 901
        with pytest.raises(RuntimeError, match=QUERY_INVALIDATED):
            x.get()  # CuPy's own check asks CUDA first
        with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match=INVALIDATED) as ended:
            stream.end_capture()
        assert ended.value.status == 901 and not stream.is_capturing()
        stream.begin_capture()  # the stream is usable again
        x += 1.0
        stream.end_capture().launch()
    assert x.get().tolist() == [2.0] * 3


def test_capture_is_refused_on_the_legacy_stream_and_begun_or_ended_once(streams):
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    for legacy in (cp.cuda.Stream.null, cp.cuda.Stream(null=True)):
        with pytest.raises(RuntimeError, match=r"^cannot capture on the default \(legacy\) stream$"):
            legacy.begin_capture()
    stream = streams()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="^cudaErrorIllegalState: "):
        stream.end_capture()
    stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeRelaxed)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="^cudaErrorIllegalState: "):
        stream.begin_capture()
    assert stream.is_capturing() and isinstance(stream.end_capture(), cp.cuda.Graph)
    with pytest.raises(NotImplementedError, match="relaxed capture mode"):  # the simulator's limit
        stream.begin_capture(mode=cp.cuda.runtime.streamCaptureModeGlobal)
    with pytest.raises(NotImplementedError, match="must be created via stream capture"):
        cp.cuda.Graph()
    with cp.cuda.Stream.ptds:  # the per-thread default stream is not the legacy one: CUDA captures it
        cp.cuda.Stream.ptds.begin_capture()
        try:
            assert cp.cuda.get_current_stream() is cp.cuda.Stream.ptds and cp.cuda.Stream.ptds.is_capturing()
        finally:
            cp.cuda.Stream.ptds.end_capture()


def test_another_stream_runs_at_once_during_a_capture(streams):
    x, capturing, other = cp.asarray(np.ones(3)), streams(), streams()
    with capturing:
        capturing.begin_capture()
        with other, cp.counting() as counts:
            assert cp.cuda.get_current_stream() is other and not other.is_capturing()
            assert (x + 1.0).get().tolist() == [2.0] * 3
        y = x * 5.0
        assert cp.cuda.get_current_stream() is capturing and (x * 2.0).get(stream=other).tolist() == [0.0] * 3
        graph = capturing.end_capture()
    assert counts["kernel"] == 1 and counts["memcpy"] == 1 and counts["captured"] == 0
    graph.launch(stream=other)
    assert y.get().tolist() == [5.0] * 3


def test_the_legacy_stream_is_unusable_while_a_blocking_stream_captures(streams):
    x, blocking, non_blocking = cp.asarray(np.ones((2, 2))), streams(non_blocking=False), streams()
    implicit = "operation would make the legacy stream depend on a capturing blocking stream$"
    with non_blocking:
        non_blocking.begin_capture()
    assert (x + 1.0).get().tolist() == [[2.0, 2.0]] * 2  # on the null stream, at once
    non_blocking.end_capture()
    with blocking:
        blocking.begin_capture()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match=f"^cudaErrorStreamCaptureImplicit: {implicit}"):
        x @ x  # CuPy's query of the stream fails, before any work: the capture goes on
    assert blocking.is_capturing()
    with pytest.raises(cp.cuda.driver.CUDADriverError, match=f"^CUDA_ERROR_STREAM_CAPTURE_IMPLICIT: {implicit}"):
        x + 1.0  # work: the capture is invalidated
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match=INVALIDATED):
        blocking.end_capture()


def test_an_event_recorded_in_a_capture_cannot_be_queried_until_recorded_again_outside(streams):
    stream, before = streams(), cp.cuda.Event()
    assert before.done  # never recorded: nothing to wait for, as CUDA says
    before.record()
    with stream:
        stream.begin_capture()
        assert before.done  # recorded outside the capture: a query is allowed in relaxed mode
        inside = stream.record()
        graph = stream.end_capture()
    graph.launch()
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="^cudaErrorCapturedEvent: ") as refusal:
        inside.synchronize()
    assert refusal.value.status == 907
    inside.record()
    assert inside.done


def test_a_graph_holds_no_memory_of_the_allocator(streams):
    """On a GPU a graph keeps its addresses, not CuPy's memory: the arrays made in a capture
    go back to the allocator when they die, and the replay writes where they were."""
    cache, stream = memory.AllocCache(lx.CUDADevice(0)), streams()
    cache.front_end.bind = FakeDriver().bind
    x = cp.asarray(np.ones(1000))
    with stream, memory.cached(cache):  # the cache serves the stream current at its first scope
        live = cache.stats().bytes_live
        stream.begin_capture()
        y = x * 2.0
        raw = cp.empty(1000)
        graph = stream.end_capture()
        assert cache.stats().bytes_live > live
        raw_memory = weakref.ref(raw.data.mem)
        del y, raw
        gc.collect()
        assert cache.stats().bytes_live == live and raw_memory() is None
        graph.launch()  # into the cache's free block, as on a GPU


def test_a_fused_optimiser_step_captured_on_a_warm_stream_replays_the_eager_step(streams):
    rng, stream, device = np.random.default_rng(3), streams(), lx.gpu_device(force=True)
    params, grads = ({"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)} for _ in range(2))
    opt = optim.adam(1e-2)
    with stream:
        eager_params, captured_params, g = device(params), device(params), device(grads)
        eager_state, captured_state = opt.init(eager_params), opt.init(captured_params)
        stream.begin_capture()
        with pytest.raises(RuntimeError, match="H2D transfers are disallowed"):
            optim.update_and_apply_(opt, g, captured_state, captured_params)  # its table of pointers not uploaded
        stream.end_capture()
        captured_state = optim.update_and_apply_(opt, g, captured_state, captured_params)  # uploads it
        eager_state = optim.update_and_apply_(opt, g, eager_state, eager_params)
        stream.begin_capture()
        new_state = optim.update_and_apply_(opt, g, captured_state, captured_params)
        graph = stream.end_capture()
        eager_state = optim.update_and_apply_(opt, g, eager_state, eager_params)
        with cp.counting() as counts:
            graph.launch()
    host = lx.cpu_device()
    assert counts["graph"] == 1 and counts["kernel"] == 0
    for want, got in ((eager_params, captured_params), (eager_state, new_state)):
        for (path, a), (_, b) in zip(lx.tree.paths(host(want)), lx.tree.paths(host(got))):
            assert a.tobytes() == b.tobytes(), path
