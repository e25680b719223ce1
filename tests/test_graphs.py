"""Training steps replayed as CUDA graphs (`luxnn.graphs`), on the simulated CUDA device
of tests/sim_cupy.py, which records a capture without running it and replays what it
recorded, refusing what CUDA and CuPy refuse while capturing; GEMMs go through the
simulated nvmath-python of tests/sim_nvmath.py, as on a GPU with nvmath-python.

What the simulator cannot tell: the time of a replay, and whether CUDA accepts every
captured kernel (tests/test_gpu_graphs.py, on a GPU)."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory
from luxnn.graphs import CAPTURE_TRIES, GraphFallbackWarning
from luxnn.ops import device_checks

import sim_cupy
import sim_nvmath
from test_memory_cuda import FakeDriver
from test_sim_gpu import MODELS, _LastStep

STEPS = 9  # eager until the plan serves a step (4), two captures, then replays


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy and nvmath-python simulated on the CPU; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    monkeypatch.setitem(sys.modules, "nvmath", sim_nvmath)
    device_checks.check_now()
    yield lx.gpu_device(force=True)


def _cache(**kwargs: Any) -> memory.AllocCache:
    cache = memory.AllocCache(lx.CUDADevice(0), **kwargs)
    cache.front_end.bind = FakeDriver().bind  # the C core's CUDA upstream over host memory
    return cache


BATCH = 256  # a step is planned once it makes a request above 16 KiB (memory.plan.MATCH_ABOVE)


def _state(make, device, *, graphs: bool, optimizer=None, cache=None) -> tuple[lx.TrainState, Any]:
    model, x = make()
    rng = np.random.default_rng(0)
    ps, st = device(lx.setup(np.random.default_rng(1), model))
    x = rng.standard_normal((BATCH, *x[1:]), dtype=np.float32)
    batch = device((x, rng.integers(0, 5, x.shape[0])))
    ts = lx.TrainState(model, ps, st, optimizer or lx.optim.adam(1e-2), allocator_cache=cache or _cache(),
                       graphs=graphs)
    return ts, batch


AD, LOSS = lx.AutoTape(), lx.losses.CrossEntropyLoss()  # one objective: a graph is its objective's


def _train(ts, batch, steps: int = STEPS, objective=None) -> tuple[lx.TrainState, list[float]]:
    ad, loss_fn, losses = AD, objective or LOSS, []
    for _ in range(steps):
        _, loss, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
        losses.append(float(loss))
    return ts, losses


def _host(tree: Any) -> list[np.ndarray]:
    return [x.get() for x in lx.tree.leaves(tree) if isinstance(x, sim_cupy.ndarray)]


def _assert_bitwise(a: lx.TrainState, b: lx.TrainState) -> None:
    for x, y in zip(_host((a.parameters, a.states, a.optimizer_state)), _host((b.parameters, b.states, b.optimizer_state))):
        np.testing.assert_array_equal(x, y)


_MODELS = {
    **MODELS,
    "batchnorm": lambda: (lx.Chain(lx.Dense(6, 64), lx.BatchNorm(64), lx.Dense(64, 5)), (16, 6)),
    "gru": lambda: (lx.Chain(lx.GRU(6, 32), _LastStep(), lx.Dense(32, 5)), (8, 7, 6)),
}


@pytest.mark.parametrize("name", list(_MODELS))
def test_replayed_steps_give_the_eager_steps_parameters_bit_for_bit(name, sim_gpu):
    eager, batch = _state(_MODELS[name], sim_gpu, graphs=False)
    graphed, _ = _state(_MODELS[name], sim_gpu, graphs=True)
    eager, eager_losses = _train(eager, batch)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphFallbackWarning)
        graphed, losses = _train(graphed, batch)
    assert losses == eager_losses
    _assert_bitwise(graphed, eager)
    stats = lx.graphs.stats(graphed)
    assert stats.captures == 2 and stats.replays == STEPS - stats.eager - 2 > 0 and stats.kept == 2, stats
    assert graphed.step == STEPS


def test_a_replayed_step_launches_one_graph_and_copies_no_more_than_its_batch_and_loss(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    ts, _ = _train(ts, batch)
    assert lx.graphs.stats(ts).replays > 0
    cache = ts.allocator_cache
    before = cache.stats()
    with sim_cupy.counting() as counts:
        _, loss, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)
    assert counts["graph"] == 1 and counts["cublas"] == 0 and counts["fill"] == 0, counts
    assert counts["kernel"] == len(lx.tree.leaves(batch)) + 1, counts  # the batch in, the loss out
    assert cache.stats().upstream_allocs == before.upstream_allocs


def test_a_short_batch_runs_eagerly_and_the_full_batches_are_replayed_again(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    short = tuple(x[:100] for x in batch)
    for epoch in range(3):  # a short last batch: its step's results move the next step's inputs
        replays = lx.graphs.stats(ts).replays
        for data in [batch] * STEPS + [short]:
            _, loss, _, ts = lx.single_train_step_(AD, LOSS, data, ts)
            _, want, _, eager = lx.single_train_step_(AD, LOSS, data, eager)
            assert float(loss) == float(want)
        assert lx.graphs.stats(ts).replays > replays, (epoch, lx.graphs.stats(ts))
    _assert_bitwise(ts, eager)


def test_new_parameters_or_a_changed_mode_run_eagerly_then_are_captured_anew(sim_gpu):
    ts, batch = _state(_MODELS["batchnorm"], sim_gpu, graphs=True)
    eager, _ = _state(_MODELS["batchnorm"], sim_gpu, graphs=False)
    copy = lambda t: lx.tree.map(lambda x: x.copy() if isinstance(x, sim_cupy.ndarray) else x, t)  # noqa: E731
    changes = [
        lambda t: t,
        lambda t: t.replace(parameters=copy(t.parameters), optimizer_state=copy(t.optimizer_state)),
        lx.testmode,  # another signature: BatchNorm's running statistics, kept as they are
    ]
    for change in changes:
        ts, eager = change(ts), change(eager)
        before = lx.graphs.stats(ts)
        ts, losses = _train(ts, batch, 3 * STEPS)
        eager, want = _train(eager, batch, 3 * STEPS)
        after = lx.graphs.stats(ts)
        assert losses == want
        assert after.eager > before.eager and after.captures > before.captures and after.replays > before.replays, after
    _assert_bitwise(ts, eager)


def test_a_result_kept_from_two_steps_before_is_never_overwritten(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    ts, _ = _train(ts, batch)
    ad, loss_fn = AD, LOSS
    kept, _, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
    values = _host(kept)
    for _ in range(4):
        _, _, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
    for x, want in zip(_host(kept), values):
        np.testing.assert_array_equal(x, want)


@pytest.mark.parametrize("case, reason", [
    ("sync", "D2H transfers are disallowed"),
    ("schedule", "schedule"),
    ("dropout", "random generator"),
    ("cublas", "nvmath-python"),
])  # fmt: skip
def test_what_a_capture_cannot_hold_runs_eagerly_with_one_warning_that_says_why(case, reason, sim_gpu, monkeypatch):
    if case == "cublas":
        monkeypatch.setitem(sys.modules, "nvmath", None)  # CuPy's cuBLAS for the GEMMs
    optimizer = lx.optim.adam(lx.optim.linear_schedule(1e-2, 1e-3, 10)) if case == "schedule" else None
    make = MODELS["mlp"]
    if case == "dropout":
        make = lambda: (lx.Chain(lx.Dense(20, 32), lx.Dropout(0.2), lx.Dense(32, 5)), (16, 20))  # noqa: E731
    def objective(model, ps, st, data):
        loss, st, stats = LOSS(model, ps, st, data)
        return loss, st, {"largest label": int(data[1].max())} if case == "sync" else stats

    ts, batch = _state(make, sim_gpu, graphs=True, optimizer=optimizer)
    eager, _ = _state(make, sim_gpu, graphs=False, optimizer=optimizer)
    steps = 10 * CAPTURE_TRIES  # each try after two eager steps the plan serves with no miss
    with pytest.warns(GraphFallbackWarning, match=reason) as caught:
        ts, losses = _train(ts, batch, steps, objective=objective)
    eager, want = _train(eager, batch, steps, objective=objective)
    assert sum(issubclass(w.category, GraphFallbackWarning) for w in caught) == 1 and losses == want
    _assert_bitwise(ts, eager)
    assert lx.graphs.stats(ts).replays == 0 and reason in lx.graphs.stats(ts).last_fallback


@pytest.mark.parametrize("case, reason", [
    ("small", "no plan of the allocator cache serves it"),  # every request at most 16 KiB
    ("a new size each step", "plans did not serve all of its requests at 8 steps in a row"),
])  # fmt: skip
def test_steps_the_plans_do_not_serve_wholly_run_eagerly_with_one_warning_that_says_why(case, reason, sim_gpu):
    make = (lambda: (lx.Chain(lx.Dense(4, 8), lx.Dense(8, 5)), (16, 4))) if case == "small" else MODELS["mlp"]
    sizes = iter([0] * 4 + list(range(1, 40)))

    def objective(model, ps, st, data):
        loss = LOSS(model, ps, st, data)
        if case != "small":  # once a plan serves the step, a later request of a new size each step
            sim_cupy.empty(20_000 << next(sizes), np.uint8)  # larger than any block the cache holds
        return loss

    ts, batch = _state(make, sim_gpu, graphs=True)
    with pytest.warns(GraphFallbackWarning, match=reason) as caught:
        ts, _ = _train(ts, batch, 16, objective=objective)
    assert sum(issubclass(w.category, GraphFallbackWarning) for w in caught) == 1
    stats = lx.graphs.stats(ts)
    assert stats.captures == stats.replays == 0 and stats.eager == 16 and reason in stats.last_fallback


def test_an_error_raised_inside_a_capture_is_the_eager_steps_and_leaves_the_stream_usable(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    calls = [0]

    def objective(model, ps, st, data):
        calls[0] += 1
        if calls[0] >= 6:  # from the step that would be captured on
            raise ValueError("a bad batch")
        return LOSS(model, ps, st, data)

    with pytest.raises(ValueError, match="a bad batch"):
        _train(ts, batch, objective=objective)
    assert not ts.graph_runner.stream.is_capturing()
    assert lx.graphs.stats(ts).captures == 0


def test_a_keyboard_interrupt_at_the_launch_leaves_the_step_not_done(sim_gpu, monkeypatch):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    ts, _ = _train(ts, batch)
    before = _host(ts.parameters)

    def interrupted(self, stream=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(sim_cupy.cuda.Graph, "launch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        lx.single_train_step_(AD, LOSS, batch, ts)
    assert not ts.consumed and ts.step == STEPS
    for x, want in zip(_host(ts.parameters), before):
        np.testing.assert_array_equal(x, want)
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    monkeypatch.setitem(sys.modules, "nvmath", sim_nvmath)
    _, _, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)
    assert ts.step == STEPS + 1


def test_a_bad_label_in_a_replayed_step_raises_at_a_later_call(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    ts, _ = _train(ts, batch)
    bad = (batch[0], sim_gpu(np.full(batch[1].shape, 7)))
    ad, loss_fn = AD, LOSS
    _, _, _, ts = lx.single_train_step_(ad, loss_fn, bad, ts)
    assert lx.graphs.stats(ts).replays > 0
    with pytest.raises(ValueError, match="label"):
        for _ in range(3):
            _, _, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
            device_checks.check_now()


def test_a_batch_on_the_host_is_refused_as_eagerly_and_a_strided_one_is_copied(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    ts, _ = _train(ts, batch)
    eager, _ = _train(eager, batch)
    ad, loss_fn = AD, LOSS
    with pytest.raises(ValueError, match="device"):
        lx.single_train_step_(ad, loss_fn, (batch[0].get(), batch[1].get()), ts)
    wide = sim_gpu(np.zeros((batch[0].shape[0], 2 * batch[0].shape[1]), batch[0].dtype))
    wide[:, ::2] = batch[0]
    strided = (wide[:, ::2], batch[1])
    replays = lx.graphs.stats(ts).replays
    _, loss, _, ts = lx.single_train_step_(ad, loss_fn, strided, ts)
    _, want, _, eager = lx.single_train_step_(ad, loss_fn, batch, eager)
    assert float(loss) == float(want) and lx.graphs.stats(ts).replays == replays + 1  # its signature's graph
    _assert_bitwise(ts, eager)


def test_graphs_false_or_the_cpu_has_no_runner(sim_gpu):
    ts, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    assert ts.graph_runner is None and lx.graphs.stats(ts).captures == 0
    ps, st = lx.setup(np.random.default_rng(0), lx.Dense(3, 2))
    assert lx.TrainState(lx.Dense(3, 2), ps, st, lx.optim.sgd(0.1)).graph_runner is None
    with pytest.raises(TypeError, match="graphs must be True or False"):
        lx.TrainState(lx.Dense(3, 2), ps, st, lx.optim.sgd(0.1), graphs="yes")


def test_graphs_replay_under_a_cache_limit_and_take_nothing_upstream(sim_gpu):
    eager, batch = _state(MODELS["cnn"], sim_gpu, graphs=False)
    eager, want = _train(eager, batch)
    limit = int(1.25 * eager.allocator_cache.stats().peak_reserved)
    ts, _ = _state(MODELS["cnn"], sim_gpu, graphs=True, cache=_cache(limit=limit))
    ts, losses = _train(ts, batch)
    before, replays = ts.allocator_cache.stats(), lx.graphs.stats(ts).replays
    for _ in range(4):  # no caller holding the first state (its results' places would be taken)
        _, loss, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)
    after = ts.allocator_cache.stats()
    assert losses == want and replays > 0 and lx.graphs.stats(ts).replays == replays + 4
    assert after.upstream_allocs == before.upstream_allocs and after.peak_reserved <= limit


def test_a_graph_keeps_the_fused_optimisers_pointer_table_it_reads(sim_gpu):
    from luxnn import capturing
    from luxnn.optim import fused

    rows = [[4, 1, 4096, 8192, 12288]]
    place = (sim_cupy, 0, sim_cupy.cuda.get_current_stream().ptr)
    table, _ = fused._table(place, rows)  # uploaded outside a capture, as in a warm step
    with capturing.capture() as recorded:
        again, _ = fused._table(place, rows)
    assert again is table and any(kept is table for kept in recorded.kept)  # evicted from the tables, still alive


def test_a_cache_first_used_on_another_stream_runs_eagerly_and_says_why(sim_gpu):
    cache = _cache()
    with memory.cached(cache):  # the default stream: the one the cache serves from now on
        sim_cupy.zeros(4)
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True, cache=cache)
    with pytest.warns(GraphFallbackWarning, match="first used on another stream"):
        ts, _ = _train(ts, batch)
    assert lx.graphs.stats(ts).captures == 0 and cache.stats().hits > 0  # the cache still serves the steps


def test_two_training_states_of_one_cache_share_its_stream_and_both_replay(sim_gpu):
    cache = _cache()
    first, batch = _state(MODELS["mlp"], sim_gpu, graphs=True, cache=cache)
    second, _ = _state(MODELS["mlp"], sim_gpu, graphs=True, cache=cache)
    assert first.graph_runner.stream is second.graph_runner.stream
    first, _ = _train(first, batch)
    second, _ = _train(second, batch)
    assert lx.graphs.stats(first).replays > 0 and lx.graphs.stats(second).replays > 0


def test_a_capture_the_objective_invalidates_is_ended_and_the_stream_trains_on(sim_gpu):
    def objective(model, ps, st, data):
        sim_cupy.cuda.runtime.deviceSynchronize()  # refused while capturing: the capture is invalidated
        return LOSS(model, ps, st, data)

    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    with pytest.warns(GraphFallbackWarning, match="CUDARuntimeError"):
        ts, losses = _train(ts, batch, 10 * CAPTURE_TRIES, objective=objective)
    eager, want = _train(eager, batch, 10 * CAPTURE_TRIES, objective=objective)
    assert losses == want and not ts.graph_runner.stream.is_capturing()


def test_host_values_in_the_batch_are_read_at_every_step(sim_gpu):
    def objective(model, ps, st, data):
        loss, st, stats = LOSS(model, ps, st, data[:2])
        return loss * float(data[2]), st, stats

    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    for weight in [np.float32(1.0)] * STEPS + [np.float32(w) for w in (2.0, 3.0, 1.0, 1.0, 1.0, 1.0, 5.0)]:
        _, loss, _, ts = lx.single_train_step_(AD, objective, (*batch, weight), ts)
        _, want, _, eager = lx.single_train_step_(AD, objective, (*batch, weight), eager)
        assert float(loss) == float(want), weight
    assert lx.graphs.stats(ts).replays > 0
    _assert_bitwise(ts, eager)


def test_a_keyboard_interrupt_just_after_the_launch_leaves_the_given_state_as_after_the_step(sim_gpu, monkeypatch):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    ts, _ = _train(ts, batch)
    eager, _ = _train(eager, batch, STEPS + 1)
    overwritten = lx.graphs.overwritten

    def interrupted(tree):
        monkeypatch.setattr(lx.graphs, "overwritten", overwritten)
        raise KeyboardInterrupt

    monkeypatch.setattr(lx.graphs, "overwritten", interrupted)
    replays = lx.graphs.stats(ts).replays
    with pytest.raises(KeyboardInterrupt):
        lx.single_train_step_(AD, LOSS, batch, ts)
    assert lx.graphs.stats(ts).replays == replays + 1 and not ts.consumed and ts.step == STEPS + 1
    _assert_bitwise(ts, eager)
    _, _, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)  # trains on


def test_graphs_whose_places_a_kept_state_holds_are_given_up_after_a_few_tries(sim_gpu):
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    kept = []
    with pytest.warns(GraphFallbackWarning, match="kept from earlier steps"):
        for _ in range(12 * CAPTURE_TRIES):
            kept.append(ts)  # every state the loop made, still referenced
            _, loss, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)
            _, want, _, eager = lx.single_train_step_(AD, LOSS, batch, eager)
            assert float(loss) == float(want)
    assert not lx.graphs.stats(ts).replays
    _assert_bitwise(ts, eager)


def test_a_signature_given_up_drops_its_graphs_with_the_buffers_they_read(sim_gpu):
    from luxnn import capturing

    captures = [0]

    def objective(model, ps, st, data):  # the first capture holds, every later one fails
        if capturing.active() is not None:
            captures[0] += 1
            if captures[0] >= 2:
                capturing.host_value("a value of the later captures")
        return LOSS(model, ps, st, data)

    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False)
    rng, kept = np.random.default_rng(5), []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", GraphFallbackWarning)
        for i in range(60):
            data = sim_gpu((rng.standard_normal(batch[0].shape, dtype=np.float32), batch[1]))
            if 6 <= i < 40:
                kept.append(ts)  # the first graph cannot replay meanwhile: the captures after it fail
            elif i == 40:
                kept.clear()
                with lx.memory.cached(ts.allocator_cache), ts.graph_runner.on_stream():
                    hog = [sim_cupy.full(x.shape, 3, x.dtype) for x in data]  # where freed buffers were
            _, loss, _, ts = lx.single_train_step_(AD, objective, data, ts)
            _, want, _, eager = lx.single_train_step_(AD, objective, data, eager)
            assert float(loss) == float(want), i
    assert not lx.graphs.stats(ts).kept and hog
    _assert_bitwise(ts, eager)


def test_a_fallback_warning_raised_as_an_error_leaves_the_state_as_after_the_step(sim_gpu):
    optimizer = lx.optim.adam(lx.optim.linear_schedule(1e-2, 1e-3, 10))
    ts, batch = _state(MODELS["mlp"], sim_gpu, graphs=True, optimizer=optimizer)
    eager, _ = _state(MODELS["mlp"], sim_gpu, graphs=False, optimizer=optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphFallbackWarning)
        raised = 0
        for _ in range(10 * CAPTURE_TRIES):
            try:
                _, _, _, ts = lx.single_train_step_(AD, LOSS, batch, ts)
            except GraphFallbackWarning:
                raised += 1  # the step was done: the state given is the new one
            _, _, _, eager = lx.single_train_step_(AD, LOSS, batch, eager)
            assert not ts.consumed and ts.step == eager.step
    assert raised == 1
    _assert_bitwise(ts, eager)
