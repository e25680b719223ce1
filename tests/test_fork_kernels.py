"""A forked child trains at once: the kernel pool, the BLAS holds and the contention window
of luxnn.parallel are reset in it (the allocator's side: test_memory_fork.py).

The fork tests (this file and test_memory_fork.py) run before any test makes a JAX array
(pytest runs the files in name order; test_nn_contract.py and test_optim_optax.py make
them, and no test does while collecting): JAX's threads, which start with its first
array, could hold a lock at the fork that no thread of the child will release.
"""

import multiprocessing
import os
import threading

import numpy as np
import pytest
import threadpoolctl

import luxnn as lx
from luxnn import _blas, _contention, parallel

import forked

MiB = 1 << 20


def blas_threads() -> list[int]:
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas" and "numpy" in p["filepath"]]


def _in_a_forked_child(body, timeout=60.0):
    """Run `body()` in a child forked now; fail unless it returns within `timeout` seconds."""
    pid = os.fork()
    if pid == 0:  # the child: report by exit status only
        code = 1
        try:
            body()
            code = 0
        finally:
            os._exit(code)
    code = forked.exit_code(pid, timeout)
    assert code == 0, f"the forked child ended with {code!r} (hung: not within {timeout} s)"


def _train_a_few_steps():
    model = lx.Chain(lx.Dense(16, 32, activation="gelu"), lx.LayerNorm(32), lx.Dense(32, 4))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-2))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16384, 16)).astype(np.float32), rng.integers(0, 4, 16384)  # 2 MiB activations
    for _ in range(3):
        _, loss, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.CrossEntropyLoss(), (x, y), ts)
    assert np.isfinite(float(loss))
    assert any(t.name.startswith("luxnn-kernel") for t in threading.enumerate())  # the kernels ran on threads


def _share_out_blocks():
    like = np.zeros((8, MiB // 4), np.float32)
    names = set()
    parallel.for_blocks(lambda lo, hi: names.add(threading.current_thread().name), like)
    assert len(names) == 2  # the child's own new worker ran a share


def test_a_child_forked_after_the_kernel_threads_started_runs_threaded_kernels(threads):
    threads(2)
    _share_out_blocks()  # the pool's thread is running
    _in_a_forked_child(_share_out_blocks)
    _in_a_forked_child(_train_a_few_steps)


def test_a_fork_pool_trains_in_its_workers(threads):
    threads(2)
    _share_out_blocks()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        assert pool.apply_async(_train_and_say_done).get(timeout=60) == "done"
        assert pool.map_async(_double_in_blocks, [1, 2]).get(timeout=60) == [2.0, 4.0]


def _train_and_say_done():
    _train_a_few_steps()
    return "done"


def _double_in_blocks(k):
    x = np.full((8, MiB // 4), float(k), np.float32)
    y = np.empty_like(x)
    parallel.for_blocks(lambda lo, hi: np.multiply(x[lo:hi], 2, out=y[lo:hi]), x)
    return float(y[0, 0])


@pytest.mark.skipif(parallel._set_blas_threads is None, reason="NumPy's BLAS is not an OpenBLAS whose threads can be set")
def test_a_child_forked_while_another_thread_held_the_blas_gets_its_threads_back():
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):
        before = blas_threads()
        held, release = threading.Event(), threading.Event()

        def hold():
            with parallel.single_threaded_blas():
                held.set()
                release.wait(30)

        holder = threading.Thread(target=hold)
        holder.start()
        try:
            assert held.wait(30)
            assert blas_threads() == [1] * len(before)

            def check():
                assert _blas.holds() == 0 and blas_threads() == before

            _in_a_forked_child(check)
        finally:
            release.set()
            holder.join()
        assert blas_threads() == before


def test_a_forked_child_measures_the_free_cores_anew(monkeypatch):
    now = [100.0]
    times = iter([(10.0, 1.0), (10.0, 1.0)] + [(10.0, 0.0)] * 10)
    contention = _contention.Contention(clock=lambda: now[0], read=lambda: next(times), cores=2)
    monkeypatch.setattr(parallel, "_contention", contention)
    contention.free_cores()
    now[0] += 0.2
    assert contention.free_cores() == 2.0  # quiet in the parent

    def check():  # in the child: its CPU time starts from 0, and the parent's window is gone
        assert contention.free_cores() == 0.0

    _in_a_forked_child(check)
