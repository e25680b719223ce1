"""A process forked while other threads use a cache: the child allocates, plans and trains
at once (every lock of the cache's core and planner is reset in it, none left held)."""

import multiprocessing
import os
import threading
import time

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory

import forked

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

# Far above what a child needs (well under a second; under valgrind, scripts/memcheck.sh,
# tens of seconds): only a hang reaches it.
CHILD_SECONDS = 600 if os.environ.get("LUXNN_MEMCHECK") else 30
CHILDREN = 6 if os.environ.get("LUXNN_MEMCHECK") else 40


def _churn(cache, stop):
    # Scopes with requests above 64 KiB whose sizes change every few steps: the core's lock,
    # the record and the planner's lock are busy nearly all the time.
    k = 0
    while not stop.is_set():
        n = 40_000 + 8_000 * (k // 5 % 3)
        with memory.cached(cache):
            a = np.ones(n)
            b = a * 2.0
            del a
            b += 1.0
        k += 1


_shared: list = []  # the busy cache, for the pool's children (a cache does not pickle)


def _train_in_child():
    """What a forked child does: the busy cache's scopes and a few training steps."""
    cache = _shared[0]
    for k in range(6):
        with memory.cached(cache):
            x = np.full(50_000 + k, 2.0)
            assert float((x * x).sum()) == 4.0 * x.size
    cache._core.audit()
    model = lx.Chain(lx.Dense(16, 32, activation="relu"), lx.Dense(32, 4))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-2), allocator_cache=cache)
    rng = np.random.default_rng(1)
    data = (rng.standard_normal((8, 16)).astype(np.float32), rng.integers(0, 4, 8))
    for _ in range(3):
        _, loss, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.CrossEntropyLoss(), data, ts)
    assert np.isfinite(loss)
    return 0


@pytest.fixture
def busy_cache():
    cache = memory.AllocCache()
    stop = threading.Event()
    thread = threading.Thread(target=_churn, args=(cache, stop), daemon=True)
    thread.start()
    _shared.append(cache)
    yield cache
    _shared.clear()
    stop.set()
    thread.join()
    cache._core.audit()


def test_children_forked_while_a_thread_runs_scopes_train_and_exit(busy_cache):
    # Without the fork handlers, 3 to 12 of 60 children hung on the planner's lock.
    results = []
    for _ in range(CHILDREN):
        time.sleep(0.002)  # let the thread get into its scopes between forks
        pid = os.fork()
        if pid == 0:  # the child: leave by os._exit whatever happens, never back into pytest
            code = 1
            try:
                code = _train_in_child()
            finally:
                os._exit(code)
        results.append(forked.exit_code(pid, CHILD_SECONDS))
    assert results == [0] * CHILDREN


def _churn_small(cache, stop):
    # Small blocks of mixed sizes, every other one kept a little longer: slabs split and
    # coalesce, quick lists fill and flush, all the time.
    rng = np.random.default_rng(0)
    while not stop.is_set():
        with memory.cached(cache):
            kept = [np.empty(int(n), np.uint8) for n in rng.choice([8, 700, 3000, 9000, 40_000], 8)]
            del kept[::2]


def test_children_forked_while_a_thread_splits_slabs_use_them():
    cache = memory.AllocCache()
    stop = threading.Event()
    thread = threading.Thread(target=_churn_small, args=(cache, stop), daemon=True)
    thread.start()
    results = []
    try:
        for _ in range(CHILDREN // 4):
            time.sleep(0.002)
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    with memory.cached(cache):
                        blocks = [np.full(n, 7, np.uint8) for n in (8, 700, 3000, 9000, 40_000, 65_536)]
                        assert all((b == 7).all() for b in blocks)
                    del blocks
                    cache._core.audit()
                    code = 0
                finally:
                    os._exit(code)
            results.append(forked.exit_code(pid, CHILD_SECONDS))
    finally:
        stop.set()
        thread.join()
    cache._core.audit()
    assert results == [0] * (CHILDREN // 4)


def test_a_fork_pool_trains_while_a_thread_runs_scopes(busy_cache):
    context = multiprocessing.get_context("fork")
    with context.Pool(2) as pool:
        pending = [pool.apply_async(_train_in_child) for _ in range(8)]
        assert [p.get(timeout=CHILD_SECONDS) for p in pending] == [0] * 8


def test_a_child_forked_inside_its_own_scope_keeps_that_scope_open():
    # The forking thread's own scope survives in the child (only other threads' close), so
    # the child closes it as usual, and the parent's stays open and closes too.
    cache = memory.AllocCache()
    with memory.cached(cache) as scope:
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                with memory.cached(cache):
                    np.ones(100_000)
                code = 0
            finally:
                if code == 0:
                    try:
                        scope.__exit__(None, None, None)
                        cache._core.audit()
                    except BaseException:
                        code = 1
                os._exit(code)
        assert forked.exit_code(pid, CHILD_SECONDS) == 0
    assert scope.stats is not None


def test_a_step_another_thread_began_before_fork_ends_in_the_child():
    # In the child the other thread is gone, with its open scope and step: the child's own
    # steps must still be steps of their own, recorded and planned.
    cache = memory.AllocCache()
    inside, release = threading.Event(), threading.Event()

    def hold_a_step():
        with memory.step(cache):
            inside.set()
            release.wait()

    thread = threading.Thread(target=hold_a_step)
    thread.start()
    inside.wait()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            for _ in range(8):
                with memory.step(cache):
                    a = np.ones(300_000)
                    b = a * 2.0
                    del a
                    b += 1.0
            cache._core.audit()
            code = 0 if cache.stats().plan_hits > 0 else 3
        finally:
            os._exit(code)
    release.set()
    thread.join()
    assert forked.exit_code(pid, CHILD_SECONDS) == 0
