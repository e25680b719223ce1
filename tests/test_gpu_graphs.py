"""A warm training step replayed as CUDA graphs (`luxnn.graphs`), against the eager step on
the same GPU: bitwise the same parameters, states and losses; each invalidation captures
anew; a step that cannot be captured (a host read, an injected hyperparameter) falls back
with one warning and trains; capture under a cache limit; a KeyboardInterrupt at a
replay's launch leaves a whole step or none.

Everything here needs CuPy and a GPU and skips, with the reason, without them;
`scripts/gpu_check.sh` runs it on a machine that has one (its ``graphs`` stage). The
models are tests/test_gpu.py's, on a batch large enough for their steps to be planned (a
request above 16 KiB), since a step is captured once its allocator cache's plan served it.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory

from test_gpu import MODELS, NO_GPU, _host, needs_gpu

if NO_GPU is None:
    import cupy

AD, LOSS = lx.AutoTape(), lx.losses.CrossEntropyLoss()
BATCH = 256  # every model's activations above 16 KiB: its steps are planned
WARM = 12  # steps after which a fixed-shape loop replays (planned from the third, captured after)
STEPS = 100


def _pair(name: str, optimizer=None, cache=None):
    """Two training states of model `name` (tests/test_gpu.py's) on the GPU from the same
    parameters and optimizer: graphs on, then off. `cache`: a function of the device making
    each state's allocator cache (default: the TrainState's own)."""
    model = MODELS[name][0]()
    ps, st = lx.setup(np.random.default_rng(0), model)
    gpu = lx.CUDADevice(0)
    caches = [{} if cache is None else {"allocator_cache": cache(gpu)} for _ in range(2)]
    return [lx.TrainState(model, gpu(ps), gpu(st), optimizer or lx.optim.adam(1e-3), graphs=graphs, **kw)
            for graphs, kw in zip((True, False), caches)]  # fmt: skip


def _batches(name: str, count: int = 3):
    """`count` batches of `BATCH` rows for model `name`, each of other values, on the GPU."""
    shape = (BATCH, *MODELS[name][1][1:])
    out = []
    for seed in range(count):
        rng = np.random.default_rng(10 + seed)
        out.append(lx.CUDADevice(0)((rng.standard_normal(shape).astype(np.float32), rng.integers(0, 5, BATCH))))
    return out


def _steps(states, batches, n: int, objective=LOSS):
    """`n` ``single_train_step_`` of each of `states` in turn, on `batches` in turn; returns
    the new states and each one's losses, read after its step."""
    states, losses = list(states), [[] for _ in states]
    for i in range(n):
        for k, ts in enumerate(states):
            _, loss, _, states[k] = lx.single_train_step_(AD, objective, batches[i % len(batches)], ts)
            losses[k].append(_host(loss))
    return states, losses


def _snapshot(ts) -> list:
    """Host copies of everything a step writes: parameters, optimizer state, model states."""
    return [(path, np.array(_host(leaf))) for path, leaf in lx.tree.paths((ts.parameters, ts.optimizer_state, ts.states))]


def _differences(a: list, b: list) -> list[str]:
    assert [p for p, _ in a] == [p for p, _ in b]
    return [path for (path, x), (_, y) in zip(a, b) if not np.array_equal(x, y, equal_nan=True)]


def _assert_same(graphed, eager) -> None:
    assert not _differences(_snapshot(graphed), _snapshot(eager)), "replayed and eager states differ"


# -- replay equals eager -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
@needs_gpu
def test_a_hundred_replayed_steps_equal_the_eager_ones_bitwise(name):
    (graphed, eager), losses = _steps(_pair(name), _batches(name), STEPS)
    np.testing.assert_array_equal(losses[0], losses[1])
    _assert_same(graphed, eager)
    stats = lx.graphs.stats(graphed)
    assert stats.captures >= 1 and stats.replays >= STEPS // 2 and stats.last_fallback is None, stats
    off = lx.graphs.stats(eager)
    assert off.captures == off.replays == 0, off


# -- invalidation --------------------------------------------------------------------------


def _fewer_rows(batch):
    return tuple(a[: BATCH // 2] for a in batch)


def _copied_parameters(ts):
    return ts.replace(parameters=lx.tree.map(lambda a: a.copy(), ts.parameters))


def _new_plan(ts):
    ts.allocator_cache.free()  # the plan goes: the next steps are planned anew
    return ts


# Each change of a warm loop: (of the training state, of the batches); None leaves it.
CHANGES = {
    "batch_shape": (None, _fewer_rows),
    "parameters": (_copied_parameters, None),
    "test_mode": (lx.testmode, None),
    "new_plan": (_new_plan, None),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@needs_gpu
def test_each_invalidation_captures_anew_and_steps_stay_equal_to_eager(change):
    """On the CNN (BatchNorm: the mode changes what a step computes), from a warm loop that
    replays: the change made to both states, then as many steps again. The graphed state
    captures again, replays after it, and stays bitwise equal to the eager one."""
    batches = _batches("cnn")
    states, _ = _steps(_pair("cnn"), batches, WARM)
    before = lx.graphs.stats(states[0])
    assert before.replays > 0, before
    of_state, of_batch = CHANGES[change]
    states = [of_state(ts) for ts in states] if of_state else states
    batches = [of_batch(b) for b in batches] if of_batch else batches
    (graphed, eager), losses = _steps(states, batches, WARM)
    after = lx.graphs.stats(graphed)
    assert after.captures > before.captures and after.replays > before.replays, (change, before, after)
    np.testing.assert_array_equal(losses[0], losses[1])
    _assert_same(graphed, eager)


# -- what cannot be captured -----------------------------------------------------------------


def _reads_the_loss(model, ps, st, data):
    """The cross-entropy objective, with the loss's value read on the host in its stats:
    a synchronisation no graph can hold."""
    loss, st, _ = LOSS(model, ps, st, data)
    return loss, st, {"loss": float(loss)}


def _fallbacks(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, lx.graphs.GraphFallbackWarning)]


@needs_gpu
def test_a_step_that_reads_a_value_on_the_host_falls_back_with_one_warning_and_trains():
    batches = _batches("mlp")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (graphed, eager), losses = _steps(_pair("mlp"), batches, 2 * WARM, objective=_reads_the_loss)
    stats = lx.graphs.stats(graphed)
    assert stats.replays == 0 and stats.kept == 0 and stats.last_fallback, stats
    assert len(_fallbacks(caught)) == 1 and stats.last_fallback in _fallbacks(caught)[0], _fallbacks(caught)
    assert issubclass(lx.graphs.GraphFallbackWarning, RuntimeWarning)
    np.testing.assert_array_equal(losses[0], losses[1])
    assert float(losses[0][-1]) < float(losses[0][0])  # it trained
    _assert_same(graphed, eager)


@needs_gpu
def test_hyperparameters_set_on_an_injected_optimizer_apply_in_its_eager_steps():
    """`inject_hyperparams` reads its hyperparameters on the host at every step, so its
    steps are not captured (one warning says so); a `set_hyperparams` between steps
    applies to the next, as on the eager state."""
    batches = _batches("mlp")
    injected = lx.optim.inject_hyperparams(lx.optim.adam)(learning_rate=1e-3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        states, first = _steps(_pair("mlp", injected), batches, WARM)
        states = [lx.optim.set_hyperparams(ts, learning_rate=3e-4) for ts in states]
        (graphed, eager), then = _steps(states, batches, WARM)
    assert len(_fallbacks(caught)) == 1 and "inject_hyperparams" in _fallbacks(caught)[0], _fallbacks(caught)
    assert lx.graphs.stats(graphed).replays == 0
    np.testing.assert_array_equal(first[0] + then[0], first[1] + then[1])
    _assert_same(graphed, eager)


@needs_gpu
def test_steps_are_captured_and_replayed_under_a_cache_limit():
    """The limit: a quarter above what the graphed loop reserved without one. Under it the
    loop captures and replays, stays equal to the eager loop, reserves no more than the
    limit, and a replay takes no memory from anywhere (the cache's upstream nor CuPy's pool)."""
    batches = _batches("cnn")
    (unlimited, _), _ = _steps(_pair("cnn"), batches, WARM)
    limit = int(1.25 * unlimited.allocator_cache.stats().peak_reserved)
    states, _ = _steps(_pair("cnn", cache=lambda gpu: memory.AllocCache(gpu, limit=limit)), batches, WARM)
    cache, pool = states[0].allocator_cache, cupy.get_default_memory_pool()
    before = (cache.stats().upstream_allocs, pool.total_bytes(), lx.graphs.stats(states[0]).replays)
    (graphed, eager), losses = _steps(states, batches, WARM)
    after = (cache.stats().upstream_allocs, pool.total_bytes(), lx.graphs.stats(graphed).replays)
    assert after[2] > before[2] > 0, (before, after)
    assert after[:2] == before[:2], "a replay took memory"
    assert cache.stats().peak_reserved <= limit
    np.testing.assert_array_equal(losses[0], losses[1])
    _assert_same(graphed, eager)


# -- a KeyboardInterrupt in a replay ---------------------------------------------------------


class _Interruptible:
    """A captured graph (CuPy's) whose launch raises KeyboardInterrupt instead of launching,
    once `switch` holds "before", taking it out."""

    def __init__(self, graph, switch: list) -> None:
        self._graph, self._switch = graph, switch

    def launch(self, stream=None):
        if self._switch and self._switch[-1] == "before":
            self._switch.pop()
            raise KeyboardInterrupt
        self._graph.launch(stream)

    def __getattr__(self, name):
        return getattr(self._graph, name)


@pytest.fixture
def interrupt_switch(monkeypatch):
    """Every graph CuPy's streams capture from now on is `_Interruptible` by the list
    yielded; "after" interrupts the runner at its first step after a launch returned."""
    switch: list = []
    owner = next(c for c in cupy.cuda.Stream.__mro__ if "end_capture" in vars(c))
    end_capture = owner.end_capture
    monkeypatch.setattr(owner, "end_capture", lambda stream: _Interruptible(end_capture(stream), switch))
    overwritten = lx.graphs.overwritten

    def interrupted_after_the_launch(tree):
        if switch and switch[-1] == "after":
            switch.pop()
            raise KeyboardInterrupt
        overwritten(tree)

    monkeypatch.setattr(lx.graphs, "overwritten", interrupted_after_the_launch)
    return switch


@pytest.mark.parametrize("when", ["before", "after"])
@needs_gpu
def test_a_keyboard_interrupt_at_a_replays_launch_leaves_a_whole_step_or_none(when, interrupt_switch):
    """On the CNN, whose BatchNorm states a step replaces (its parameters and moments it
    writes in place): interrupted before the launch, the state trains on as if the call
    had never been made; after it, the step is done and the state given is consumed (a
    verb refuses it), never half of one."""
    batches = _batches("cnn")
    (graphed, eager), _ = _steps(_pair("cnn"), batches, WARM)
    assert lx.graphs.stats(graphed).replays > 0
    batch = batches[WARM % len(batches)]
    not_started = _snapshot(graphed)
    _, _, _, eager = lx.single_train_step_(AD, LOSS, batch, eager)
    interrupt_switch.append(when)
    with pytest.raises(KeyboardInterrupt):
        lx.single_train_step_(AD, LOSS, batch, graphed)
    assert not interrupt_switch, "the replayed step did not reach the interrupt"
    cupy.cuda.runtime.deviceSynchronize()  # the stream is usable
    if when == "after":
        assert graphed.consumed
        with pytest.raises(ValueError, match="consumed"):
            lx.single_train_step_(AD, LOSS, batch, graphed)
        return
    assert not graphed.consumed and not _differences(_snapshot(graphed), not_started)
    _, _, _, graphed = lx.single_train_step_(AD, LOSS, batch, graphed)
    _assert_same(graphed, eager)
    (graphed, eager), losses = _steps([graphed, eager], batches, 3)
    np.testing.assert_array_equal(losses[0], losses[1])
    _assert_same(graphed, eager)
