"""The CPU's cores for NumPy kernels: blocks of a kernel, and matrix products, on threads.

NumPy runs each operation on one thread, and a kernel that makes several passes over a
large array (GELU's eight, softmax's five) is bound by that one core and by memory traffic.
`for_blocks` cuts the leading axis into blocks of about a megabyte and runs the kernel on
them from a few threads (NumPy releases the GIL inside its loops, so they run at once);
a block's passes find it in the cache. PyTorch's CPU kernels do the same (``at::parallel_for``).

The BLAS threads its own products, but its idle threads spin for a while after each one
(OpenBLAS: about 0.1 s), taking the cores from whatever runs next, so that a kernel
threaded by `for_blocks` right after a product ran no faster than on one thread. So
`matmul` cuts large products itself, across the same threads, with the BLAS on one thread
in each; no BLAS thread is left spinning. Small products run with the BLAS on one
thread when other processes take the cores, which slows them in proportion, where the
BLAS's threads would wait for the scheduler at every product; on a machine with the cores
free they keep the BLAS's threads (see "The BLAS's threads on a busy machine"). luxnn's own
idle threads poll for 2 ms before they sleep, which bridges the gaps between a step's
kernels (waking a sleeping thread costs tens of microseconds, far more on a virtual
machine after a pause) and gives the cores back as soon as the step is over.

Kernels write into arrays made beforehand; arrays a kernel makes for itself come from the
allocator of the caller's context (the luxnn cache inside ``cached``), because each block
runs in a copy of the caller's context. Each thread's share runs in a lane of the call
(``memory._core.enter_lane``), so that the cache's step plans match the share's requests
by their order within it, which no interleaving of the threads changes. Kernels on CuPy arrays run once, whole: the GPU
is parallel already.

>>> import numpy as np
>>> x = np.arange(6.0).reshape(3, 2); y = np.empty_like(x)
>>> def square(lo, hi):
...     np.multiply(x[lo:hi], x[lo:hi], out=y[lo:hi])
>>> for_blocks(square, x)
>>> y.tolist()
[[0.0, 1.0], [4.0, 9.0], [16.0, 25.0]]
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import os
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from . import _blas
from ._contention import Contention
from .memory import _core as _memory_core

__all__ = ["cut", "for_blocks", "matmul", "num_threads", "set_num_threads", "set_follow_load", "single_threaded_blas", "step"]

Kernel = Callable[[int, int], None]

# A block's bytes of the array the blocks are cut from: large enough that the Python between
# NumPy calls is noise, small enough that a kernel's temporaries for it stay in L2. Arrays
# of one block run on the calling thread: handing work to another one costs tens of us.
_BLOCK_BYTES = 1 << 20
# Products of fewer multiply-adds are not cut: cutting them into parts costs more than it
# saves (the MLP benchmark's products are smaller than this).
_CUT_MADDS = 1 << 26

# ---- The BLAS's threads on a busy machine ----------------------------------------------
# A product on the BLAS's threads ends when its slowest thread does. On a machine with
# more runnable threads than cores (other processes, other jobs), one of the BLAS's threads
# waits for the scheduler's next turn, about a millisecond or more, whatever the product's
# size: measured on a 2-core machine beside two busy processes, a 26 M multiply-add product
# took 0.5 ms on one thread and 16 ms on two, and small models' steps, all such products,
# ran 6-17x slower than quiet (10-150x in the trial that found it). On one thread the same
# product slows only as much as the machine is shared. On a machine with the cores free,
# though, the BLAS's threads are up to 1.9x faster on such a product (the MLP step: 1.4x).
# So a product shorter than such a turn, under `_ONE_THREAD_MADDS` multiply-adds (about
# 1.4 ms on one core at the 48 G multiply-adds/s measured there), keeps the BLAS's threads
# while other processes left the cores they need idle over the last ~100 ms, and runs
# with the BLAS held to one thread otherwise. The BLAS's threads for a product are taken
# as OpenBLAS counts them, one per `_BLAS_ONE_THREAD_MADDS` up to the CPUs (its default
# thread count); the free cores are `_contention`'s: the CPU time of the process's cores
# (/proc/stat) less the process's own, so that what this process's threads do, the BLAS's
# among them, does not feed back into the choice, with `_SPARE_CORES` for the noise of
# /proc/stat's 10 ms ticks over a window. Weighed and not taken: cutting these products
# across luxnn's threads with the caller taking any part no worker has claimed yet (a busy
# machine then degrades to the caller doing all), which costs a hand-over of tens of us on
# products of 50-500 us and leaves a late worker's task alive past the call; and the
# runnable count of /proc/loadavg, one instant's, which counts this process's own threads.
# Longer products are threaded: cut here across the kernel threads (the BLAS on one thread
# in each) or, where they cannot be cut, on the BLAS's threads; a turn lost is then in
# proportion to their length. OpenBLAS itself runs products of at most
# `_BLAS_ONE_THREAD_MADDS` on one thread (SMP_THRESHOLD_MIN * GEMM_MULTITHREAD_THRESHOLD,
# 65536 * 4, in its gemm interface), so those are left as they are, at the price of one
# comparison.
# OpenBLAS's bits differ between one thread and several, so a product that follows the
# load can end a few ulp apart from one run (or one step) to the next: `set_follow_load(False)`
# holds every such product to one thread, for the same bits whatever the load.
_ONE_THREAD_MADDS = 1 << 26
_BLAS_ONE_THREAD_MADDS = 1 << 18
_SPARE_CORES = 0.5
_contention = Contention()
_follow_load = True

_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
_pool: _Workers | None = None
_pool_lock = threading.Lock()
_in_worker = threading.local()


def num_threads() -> int:
    """The threads kernels run on, the caller's included (default: the usable CPUs)."""
    return _threads


def set_num_threads(n: int) -> None:
    """Run kernels and cut products on `n` threads from now on (1: on the calling thread,
    products threaded by the BLAS as it is set, but for small products on a busy machine
    and attention's stacks of per-head products, which its threads only slow down), as
    ``torch.set_num_threads``. Call it while no other thread runs kernels: their shares
    may be handed to the retired threads, which run what they were handed before they go,
    but a share handed over after that would wait for good.

    >>> set_num_threads(num_threads())  # unchanged
    """
    global _threads, _pool
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"set_num_threads: expected a positive int, got {n!r}")
    with _pool_lock:
        if _pool is not None and int(n) != _threads:
            _pool.shutdown()
            _pool = None
        _threads = int(n)


def for_blocks(kernel: Kernel, like: Any, *, rows: int | None = None, blas: bool = False) -> None:
    """Call ``kernel(lo, hi)`` for blocks ``[lo, hi)`` that cover ``range(len(like))``, on up
    to `num_threads` threads at once; returns when every block is done, raising the first
    exception a block raised. `like` ``(n, ...)`` is the array whose leading axis is cut;
    blocks must not write to the same elements.

    `rows`: the most rows of a block (default: about a megabyte of `like`, and one block
    for a smaller array); the blocks are as many as that needs, of equal size.
    ``blas=True``, for a kernel that calls the BLAS: the blocks share the threads only
    while the BLAS can be held to one thread in each, and run one after another otherwise.

    NumPy arrays only: on a GPU, blocks would run one after another, each launching its
    kernels (CUDA implementations run whole, `luxnn.ops.traits`).
    """
    if not isinstance(like, np.ndarray):
        raise TypeError(f"for_blocks cuts NumPy arrays for the CPU's threads, got {type(like).__module__}."
                        f"{type(like).__qualname__}")
    n = like.shape[0]
    if rows is None:
        if like.nbytes <= _BLOCK_BYTES:
            kernel(0, n)
            return
        rows = max(1, _BLOCK_BYTES * n // like.nbytes)
    blocks = cut(n, rows)
    if len(blocks) == 1 or (blas and (_set_blas_threads is None or _threads == 1)):
        _run_blocks(kernel, blocks)
    elif blas:
        with single_threaded_blas():
            _share_out(kernel, blocks)
    else:
        _share_out(kernel, blocks)


def cut(n: int, rows: int) -> list[tuple[int, int]]:
    """The blocks ``[lo, hi)`` that `for_blocks` cuts ``range(n)`` into for at most `rows`
    rows each: as few as that allows, of equal size (within a row), so that the threads'
    shares are alike; an empty range is one empty block.

    >>> cut(10, 4)
    [(0, 3), (3, 6), (6, 10)]
    """
    count = max(1, -(-n // rows))
    return [(n * i // count, n * (i + 1) // count) for i in range(count)]


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` (as ``np.matmul``, into `out` if given). A small product of NumPy arrays
    (each of a stack's fewer than `_ONE_THREAD_MADDS` multiply-adds, and more than the
    BLAS runs on one thread itself) runs with the BLAS held to one thread while other
    processes take the cores its threads would need, so that a busy machine slows it in
    proportion (see "The BLAS's threads on a busy machine"). A large
    product is cut into one part per thread, each a single-threaded BLAS call: by the
    leading axis of stacked products when every thread gets some of it, else by rows of
    `a`. Anything else (large broadcast stacks and vectors, CuPy arrays, a BLAS whose
    threads cannot be set) is ``np.matmul`` itself.

    Shapes: as ``np.matmul``, e.g. a ``(..., m, k)``, b ``(..., k, n)`` -> ``(..., m, n)``.

    >>> matmul(np.ones((2, 3)), np.ones((3, 4))).tolist()
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    madds = a.size * b.shape[-1]  # the whole call's, at least one product's: tiny ones leave at once
    if madds < _CUT_MADDS or not _cuttable(a, b):
        if madds > _BLAS_ONE_THREAD_MADDS and type(a) is np.ndarray and _held(_product_madds(a, b)):
            with single_threaded_blas():
                return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)
        return np.matmul(a, b) if out is None else np.matmul(a, b, out=out)  # the first: faster
    if out is None:
        out = np.empty((*a.shape[:-1], b.shape[-1]), np.result_type(a, b))
    axis = 0 if out.ndim > 2 and out.shape[0] >= _threads else out.ndim - 2
    lead = (slice(None),) * axis

    def part(lo, hi):
        rows = (*lead, slice(lo, hi))
        np.matmul(a[rows], b[rows] if axis == 0 and b.ndim > 2 else b, out=out[rows])

    n, parts = out.shape[axis], min(_threads, out.shape[axis])
    with single_threaded_blas():
        _share_out(part, [(n * i // parts, n * (i + 1) // parts) for i in range(parts)])
    return out


def set_follow_load(enabled: bool) -> None:
    """Whether products of fewer than 2^26 multiply-adds follow the machine's load (the
    default): on the BLAS's threads while other processes leave the cores free, on one
    thread while they take them (see "The BLAS's threads on a busy machine"). OpenBLAS
    computes such a product to other bits on one thread than on several, so that a run's
    numbers then differ in their last bits with the load; ``set_follow_load(False)`` runs
    them on one thread always, for the same bits on a quiet and a busy machine (and up to
    ~1.4x slower small steps on a quiet one).

    >>> set_follow_load(False); set_follow_load(True)
    """
    global _follow_load
    _follow_load = bool(enabled)


def _held(madds: int) -> bool:
    """Whether a product of `madds` multiply-adds runs with the BLAS held to one thread:
    one the BLAS would thread, shorter than a scheduler's turn, on a machine that has not
    the cores free for the BLAS's threads, or always when the load is not followed (see
    "The BLAS's threads on a busy machine")."""
    if not _BLAS_ONE_THREAD_MADDS < madds < _ONE_THREAD_MADDS:
        return False
    if not _follow_load:
        return True
    blas_threads = min(_contention.cores, madds // _BLAS_ONE_THREAD_MADDS)
    return _contention.free_cores() < blas_threads - _SPARE_CORES


def _product_madds(a: Any, b: Any) -> int:
    """The multiply-adds of one BLAS call of ``a @ b``: of one matrix product of a stack."""
    return (a.shape[-2] if a.ndim > 1 else 1) * a.shape[-1] * (b.shape[-1] if b.ndim > 1 else 1)


def _cuttable(a: Any, b: Any) -> bool:
    """Whether `matmul` can cut ``a @ b``: NumPy matrices or equal stacks of them (`b` may
    be one matrix), threads to cut for, and a BLAS whose threads it can set."""
    if type(a) is not np.ndarray or type(b) is not np.ndarray or a.ndim < 2 or b.ndim < 2:
        return False
    if b.ndim > 2 and a.shape[:-2] != b.shape[:-2]:
        return False
    return _threads > 1 and _set_blas_threads is not None and not getattr(_in_worker, "active", False)


# ---- threads --------------------------------------------------------------------------


def _workers() -> _Workers:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = _Workers(_threads - 1)
        return _pool


class _Task:
    """A share of a kernel's blocks, handed to a worker, which sets `finished` and then
    releases `done`, a lock of C's held until then. Waiting takes `done` and never gives it
    back, so that a wait an interrupt cut short can simply be made again: no Python code
    sits between taking the lock and knowing the task is over (an Event's lock, taken in
    Python, could be left held by a Ctrl-C in the caller)."""

    __slots__ = ("run", "done", "finished", "error")

    def __init__(self, run: Callable[[], None]) -> None:
        self.run, self.error, self.finished = run, None, False
        self.done = threading.Lock()
        self.done.acquire()

    def wait(self) -> BaseException | None:
        if not _poll(lambda: self.finished):
            self.done.acquire()  # returns once the worker released it, or raises, untaken
        return self.error


class _Workers:
    """Threads that take tasks from a queue. An idle thread, and a caller waiting for a
    task, poll for `_POLL_S` before they sleep: waking a sleeping thread takes tens of
    microseconds, and on a virtual machine an idle core's first wake-ups after a pause
    take far longer (see luxnn.bench.runner.interleaved_rounds), many times in every step.
    The queue is C's (``queue.SimpleQueue``): handing a task over is one call, which no
    interrupt can cut in two."""

    def __init__(self, count: int) -> None:
        self._tasks: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
        self._count = count
        for i in range(count):
            threading.Thread(target=self._serve, name=f"luxnn-kernel-{i}", daemon=True).start()

    def submit(self, run: Callable[[], None]) -> _Task:
        task = _Task(run)
        self._tasks.put(task)
        return task

    def shutdown(self) -> None:
        for _ in range(self._count):
            self._tasks.put(None)

    def _serve(self) -> None:
        while True:
            _poll(lambda: not self._tasks.empty())
            task = self._tasks.get()
            if task is None:  # shut down, after the tasks handed over before (a FIFO)
                return
            self._run(task)

    @staticmethod
    def _run(task: _Task) -> None:
        try:
            task.run()
        except BaseException as error:  # noqa: BLE001 - handed to the caller
            task.error = error
        # Neither the task nor this thread may keep the kernel (and the arrays it closes
        # over) alive while the thread waits for the next one: that could be a whole step.
        task.run = None
        task.finished = True
        task.done.release()


# How long a thread polls before it sleeps: long enough to bridge the gaps between the
# kernels of a step, short enough that an idle process gives its cores back at once.
_POLL_S = 2e-3


def _poll(ready: Callable[[], bool]) -> bool:
    """Whether `ready()` came true within `_POLL_S`, asked between yields of the GIL."""
    deadline = time.perf_counter() + _POLL_S
    while not ready():
        if time.perf_counter() > deadline:
            return False
        time.sleep(0)
    return True


def _run_blocks(kernel: Kernel, blocks: list[tuple[int, int]]) -> None:
    for lo, hi in blocks:
        kernel(lo, hi)


def _run_lane(kernel: Kernel, blocks: list[tuple[int, int]], call: int, lane: int) -> None:
    # The allocator's step plans match the requests a share makes by its lane and their
    # order within it, which no interleaving of threads changes (luxnn.memory.plan).
    before = _memory_core.enter_lane(call, lane)
    try:
        _run_blocks(kernel, blocks)
    finally:
        _memory_core.leave_lane(before)


def _run_in_worker(kernel: Kernel, blocks: list[tuple[int, int]], call: int, lane: int) -> None:
    _in_worker.active = True  # a kernel that cuts work again runs it here, serially
    try:
        _run_lane(kernel, blocks, call, lane)
    finally:
        _in_worker.active = False


def _share_out(kernel: Kernel, blocks: list[tuple[int, int]]) -> None:
    """Run `blocks` as one contiguous share per thread, the caller running the first."""
    threads = min(_threads, len(blocks))
    if threads == 1 or getattr(_in_worker, "active", False):  # no waiting on the pool from it
        _run_blocks(kernel, blocks)
        return
    _blas.hold_for_step()  # the step, if any, keeps the BLAS on one thread from here on
    context = contextvars.copy_context()
    shares = [blocks[len(blocks) * i // threads : len(blocks) * (i + 1) // threads] for i in range(threads)]
    pool, call = _workers(), _memory_core.kernel_call()
    tasks = [
        pool.submit(functools.partial(context.copy().run, _run_in_worker, kernel, share, call, lane))
        for lane, share in enumerate(shares[1:], start=1)
    ]
    try:  # the caller's share as a worker's: a product or kernel in it is not cut again
        _run_in_worker(kernel, shares[0], call, 0)
    finally:
        errors = _wait_for_all(tasks)
    for error in errors:
        if error is not None:
            raise error


def _wait_for_all(tasks: list[_Task]) -> list[BaseException | None]:
    """Each task's error, once every task has run. An interrupt while waiting is raised
    only then: a share still running after its caller left would write into the caller's
    arrays, with the BLAS no longer held, while the caller's next code runs."""
    errors, interrupt = [], None
    for task in tasks:
        while True:
            try:
                errors.append(task.wait())
                break
            except BaseException as error:  # noqa: BLE001 - raised once every task is done
                interrupt = interrupt or error
    if interrupt is not None:
        raise interrupt
    return errors


# ---- the BLAS's threads -----------------------------------------------------------------


def _find_blas_threads_setter() -> Callable[[int], int] | None:
    """OpenBLAS's ``openblas_set_num_threads_local(n) -> previous``, if NumPy's BLAS is an
    OpenBLAS (0.3.27 or later) loaded in this process."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.rsplit("/", 1)[-1]}
    except OSError:  # not Linux
        return None
    for path in sorted(paths, key=lambda path: ("numpy" not in path, path)):  # NumPy's before SciPy's
        try:
            setter = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        setter.restype, setter.argtypes = ctypes.c_int, [ctypes.c_int]
        return setter
    return None


_set_blas_threads = _find_blas_threads_setter()
if _set_blas_threads is not None:
    _blas.use(ctypes.cast(_set_blas_threads, ctypes.c_void_p).value)


class single_threaded_blas(_blas.Hold):
    """NumPy's BLAS on one thread while any user of this context runs (nothing where its
    threads cannot be set): for cut products and for stacks of small products, which the
    BLAS's threads only slow down. OpenBLAS built with pthreads keeps the count per process,
    so the first user in sets it and the last one out restores it. Entering and leaving are
    one C call each (`luxnn._blas`), so that an interrupt (Ctrl-C) or another thread cannot
    come between counting a user and setting the BLAS: it is restored whatever is interrupted.
    An instance is one hold: entering it again while it is entered does not nest (enter a
    new one, as ``with single_threaded_blas():`` does).

    >>> with single_threaded_blas():
    ...     pass
    """

    __slots__ = ()


# ---- a training step's threads ------------------------------------------------------------


class step(_blas.Step):
    """The scope of a forward and backward pass (`value_and_grad` runs in one, and so every
    training verb): from the first kernel or product that runs on several threads until the
    scope ends, the BLAS stays on one thread, so that no BLAS thread woken by a small
    product in between (a dense head, a bias gradient) spins on a core the next kernel's
    threads need. A pass with no such kernel (a small MLP's) keeps the BLAS's threading
    as it is set, for the products `matmul` does not hold to one thread itself.
    Opening and closing are one C call each, as for `single_threaded_blas`.

    >>> with step():
    ...     pass
    """

    __slots__ = ()



# ---- fork -----------------------------------------------------------------------------------


def _after_fork_in_child() -> None:
    """A forked child has only the thread that forked: the pool's threads are gone, and so
    are the BLAS holds of other threads. A new pool is made on the child's first kernel, and
    the free cores are measured anew (the child's CPU time starts from 0)."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()
    _contention.reset()
    _blas.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
