"""The allocator's CUDA side without a GPU: the C core's CUDA upstream with a host-memory
fake of the driver functions bound through the same path as the real ones, and the CuPy
front end's hook, scopes and errors, with CuPy arrays made over the fake's memory and never
computed on: CuPy's own where it is installed (it imports without a driver), else
tests/fake_cupy.py (CuPy's allocator API over host memory).

What needs a device (real cuMemAlloc, kernels on cached arrays) is in tests/test_gpu.py.
"""

from __future__ import annotations

import ctypes
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory
from luxnn.memory.plan import PlanStatus
from luxnn.memory import _core, cupy_backend

CONTEXT = 0xC0FFEE  # the "primary context" the fake expects to be pushed
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY


_BOUND: list = []


class FakeDriver:
    """cuMemAlloc_v2, cuMemFree_v2, cuCtxPushCurrent_v2 and cuCtxPopCurrent_v2 over host
    memory, counting calls and checking that every call runs in the bound context.

    ctypes callbacks run with the GIL taken, so use it from one thread at a time.
    Assertions cannot raise through C: problems are collected in `errors`.
    """

    ALLOC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t)
    FREE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)
    PUSH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    POP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))

    def __init__(self, capacity: int | None = None, error: int = OUT_OF_MEMORY) -> None:
        self.capacity = capacity  # bytes it will hand out at once; None: unbounded
        self.error = error  # what an allocation over the capacity returns
        self.buffers: dict[int, ctypes.Array] = {}
        self.allocs = self.frees = 0
        self.stack: list[int] = []
        self.errors: list[str] = []
        self._callbacks = (self.ALLOC(self._alloc), self.FREE(self._free), self.PUSH(self._push), self.POP(self._pop))

    @property
    def used(self) -> int:
        return sum(len(b) for b in self.buffers.values())

    def _alloc(self, dptr, size):
        if self.stack != [CONTEXT]:
            self.errors.append(f"alloc with context stack {self.stack}")
        if self.capacity is not None and self.used + size > self.capacity:
            return self.error
        buf = ctypes.create_string_buffer(size)
        self.buffers[ctypes.addressof(buf)] = buf
        dptr[0] = ctypes.addressof(buf)
        self.allocs += 1
        return 0

    def _free(self, ptr):
        if self.stack != [CONTEXT]:
            self.errors.append(f"free with context stack {self.stack}")
        if self.buffers.pop(ptr, None) is None:
            self.errors.append(f"free of unknown pointer {ptr:#x}")
        self.frees += 1
        return 0

    def _push(self, context):
        self.stack.append(context)
        return 0

    def _pop(self, out):
        out[0] = self.stack.pop() if self.stack else None
        return 0

    def bind(self, core, device_id: int = 0) -> None:
        _BOUND.append(self)  # the core calls these thunks until it dies: never free them
        core.bind_cuda(*(ctypes.cast(f, ctypes.c_void_p).value for f in self._callbacks), CONTEXT)


def cuda_core(driver: FakeDriver | None = None, **kwargs):
    core = _core.Core(upstream="cuda", **kwargs)
    if driver is not None:
        driver.bind(core)
    return core


# -- the C core's CUDA upstream -----------------------------------------------------------


def test_blocks_come_from_the_driver_and_return_to_the_free_lists():
    driver = FakeDriver()
    core = cuda_core(driver)
    a, b = core.block(1000), core.block(1 << 20)
    assert (a.size, b.size) == (memory.bin_size(1000), memory.bin_size(1 << 20))
    assert {a.ptr, b.ptr} <= set(driver.buffers) and driver.allocs == 2
    ptr = a.ptr
    del a
    c = core.block(900)
    assert c.ptr == ptr and driver.allocs == 2  # same bin: reused, no driver call
    hits, misses, allocs, frees, live, cached = core.stats()[:6]
    # The small block came from a slab, the rest of which is cached.
    live_small = memory.bin_size(1000)
    assert (hits, misses, allocs, frees, live, cached) == (1, 2, 2, 0, memory.bin_size(1 << 20) + live_small,
                                                           _core.SLAB_MIN - live_small)
    del b, c
    core.audit()
    assert driver.errors == [] and driver.stack == []


def test_trim_free_and_destruction_give_every_block_back_to_the_driver():
    driver = FakeDriver()
    core = cuda_core(driver)
    blocks = [core.block(n) for n in (512, 4096, 1 << 16, 1 << 22)]
    kept = blocks.pop()
    del blocks
    # Two slabs: the first holds 512 B and 4 KiB; the 64 KiB block, larger, takes its own.
    assert core.trim(0) == _core.SLAB_MIN + (1 << 16)
    assert driver.frees == 2
    core.release_all()  # `kept` is live: released when it dies
    assert driver.frees == 2
    del kept
    assert driver.frees == 3 and driver.buffers == {}
    again = core.block(100)  # a released core keeps working
    del core  # the block holds the core
    assert driver.frees == 3
    del again  # the last block dies: the core goes, its free slab back to the driver
    assert driver.allocs == driver.frees == 4 and driver.errors == []


def test_device_segments_are_split_and_go_back_to_the_driver_only_whole():
    driver = FakeDriver()
    core = cuda_core(driver, evict_after=3)
    rng = np.random.default_rng(0)
    sizes = [1000, 70_000, 300_000, 1 << 20, 3 << 20, 5 << 20]
    held: list = []
    for step in range(2000):
        op = rng.integers(0, 20)
        if op < 10 or not held:
            held.append(core.block(int(rng.choice(sizes)) + int(rng.integers(0, 4096))))
        elif op < 18:
            held.pop(int(rng.integers(len(held))))
        elif op == 18:
            core.trim(int(rng.choice([0, 1 << 20, 1 << 24])))
        elif step % 7 == 0:
            core.release_all()
        else:
            core.scope_exit(core.scope_enter())  # the clock of eviction
        core.audit()
        spans = sorted((b.ptr, b.ptr + b.size) for b in held)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    pieces = [(ptr - base) for ptr, _, _, base, _, _ in core.blocks()]
    assert all(offset % 512 == 0 for offset in pieces) and any(pieces)  # some were split
    # The driver was only ever asked to free what it allocated (FakeDriver checks it).
    held.clear()
    core.trim(0)
    assert driver.buffers == {} and driver.allocs == driver.frees and driver.errors == []


def test_plans_take_their_arenas_from_the_driver_and_give_them_back():
    driver = FakeDriver()
    core = cuda_core(driver)
    sizes = np.array([1 << 20, 2 << 20], dtype=np.int64)  # a block of the cycle, one that outlives it
    even, odd = np.array([0, 1 << 20]), np.array([0, 3 << 20])
    assert core.install_plan(0, 5 << 20, sizes, even, odd) == PlanStatus.INSTALLED
    arenas = [(base, len(buf)) for base, buf in driver.buffers.items()]
    assert [size for _, size in arenas] == [5 << 20]  # one arena, in one chunk
    previous = None
    for _ in range(4):
        slot = core.scope_enter()
        core.step_begin()
        a = core.block(1 << 20)
        result = core.block(2 << 20)  # alive through the next cycle, as a step's result
        del a
        core.step_end()
        core.scope_exit(slot)
        assert any(base <= result.ptr < base + size for base, size in arenas)
        assert previous is None or result.ptr != previous.ptr  # the other place
        previous = result
        core.audit()
    assert core.stats().plan_hits == 8 and core.stats().plan_misses == 0 and driver.allocs == 1
    del result, previous
    core.release_all()
    assert driver.frees == 1 and driver.buffers == {} and driver.errors == []


def test_a_plan_the_device_cannot_hold_leaves_no_plan_and_nothing_taken():
    driver = FakeDriver(capacity=3 << 20)
    core = cuda_core(driver)
    sizes = np.array([2 << 20, 2 << 20], dtype=np.int64)
    status = core.install_plan(0, 4 << 20, sizes, np.array([0, 2 << 20]), np.array([0, 2 << 20]))
    assert status == PlanStatus.NO_ROOM
    assert core.stats().plans == 0 and driver.buffers == {} and driver.errors == []
    core.audit()


def test_split_above_sets_which_requests_go_to_the_split_pool():
    # Only the split pool consolidates: a miss gives back the whole free segments that add
    # up to it, and its new segment takes their bytes too. Slabs never do.
    for split_above, frees in [(_core.MAX_REQUEST, 0), (0, 2)]:  # never: slabs; always
        driver = FakeDriver()
        core = cuda_core(driver, split_above=split_above)
        a, b = core.block(1 << 20), core.block(2 << 20)
        del a, b  # two whole free segments
        c = core.block(3 << 20)
        assert (driver.allocs, driver.frees) == (3, frees), split_above
        core.audit()
        del c


def test_a_consolidation_the_device_cannot_hold_asks_for_the_request_alone():
    driver = FakeDriver(capacity=5 << 20)
    core = cuda_core(driver)
    a, b = core.block(1 << 20), core.block(2 << 20)
    del a, b  # 3 MiB in two whole free segments
    c = core.block(3 << 20)  # both go back; 6 MiB does not fit, 3 MiB does
    assert (driver.allocs, driver.frees, c.size) == (3, 2, 3 << 20)
    assert core.stats()[4:7] == (3 << 20, 0, 3 << 20)  # live, cached, reserved
    core.audit()
    del c
    assert driver.errors == []


def test_out_of_device_memory_trims_then_retries():
    driver = FakeDriver(capacity=3 << 20)
    core = cuda_core(driver)
    a, b = core.block(1 << 20), core.block(1 << 20)
    del a, b  # 2 MiB cached in the 1 MiB bin
    big = core.block(2 << 20)  # fails at first, fits once the cache releases its blocks
    assert driver.frees == 2 and big.size == 2 << 20
    with pytest.raises(MemoryError):
        core.block(2 << 20)
    seq, over_limit, request, limit, figures, upstream_error = _core.last_failure()
    assert (over_limit, request, upstream_error) == (False, 2 << 20, OUT_OF_MEMORY)
    assert figures[4] == 2 << 20  # bytes_live when it failed
    core.audit()


def test_limit_and_unbound_core():
    core = cuda_core(FakeDriver(), limit=1 << 20)
    with pytest.raises(MemoryError):
        core.block(2 << 20)
    assert _core.last_failure()[1] is True  # over the limit
    unbound = cuda_core()
    with pytest.raises(MemoryError):
        unbound.block(10)
    assert _core.last_failure()[5] == -1  # never bound
    assert unbound.stats()[2] == 0


def test_cuda_cores_and_host_cores_do_not_mix():
    host, device = _core.Core(), cuda_core()
    with pytest.raises(TypeError, match="device memory"):
        device.numpy_handler()
    with pytest.raises(TypeError, match="device memory"):
        device.stress_lock(2, 10, 64)  # its threads would write into device pointers
    with pytest.raises(ValueError, match="host memory"):
        host.block(10)
    with pytest.raises(TypeError, match="host memory"):
        FakeDriver().bind(host)
    driver = FakeDriver()
    driver.bind(device)
    with pytest.raises(RuntimeError, match="already bound"):
        driver.bind(device)
    with pytest.raises(ValueError, match="upstream"):
        _core.Core(upstream="tpu")


def test_a_cuda_cache_constructs_without_touching_the_device():
    cache = memory.AllocCache(lx.CUDADevice(3), limit=1 << 30)
    assert cache.stats().bytes_reserved == 0 and "CUDADevice(3)" in repr(cache)
    assert isinstance(memory.get_allocator_cache(lx.CUDADevice(0)), memory.AllocCache)


# -- the CuPy front end, over the fake driver ---------------------------------------------

try:
    import cupy

    FAKE_CUPY = False
except ImportError:
    import fake_cupy as cupy

    FAKE_CUPY = True


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA cache for device 0 bound to a FakeDriver, with the hook's device and stream
    queries faked (device 0, the null stream), an outside allocator that records, and
    CuPy's default pool (which the hook empties when out of memory) replaced; without
    CuPy, tests/fake_cupy.py is `cupy` meanwhile."""
    if FAKE_CUPY:
        monkeypatch.setitem(sys.modules, "cupy", cupy)
    where = {"device": 0, "stream": 0, "pool_released": 0}

    class Pool:
        def free_all_blocks(self):
            where["pool_released"] += 1

    monkeypatch.setattr(cupy, "get_default_memory_pool", Pool)
    monkeypatch.setattr(cupy_backend, "_current_device", lambda: where["device"])
    monkeypatch.setattr(cupy_backend, "_current_stream", lambda: where["stream"])
    driver = FakeDriver()
    outside = []

    def outside_malloc(size):
        buf = ctypes.create_string_buffer(max(size, 1))
        outside.append(size)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ctypes.addressof(buf), size, buf, where["device"]), 0)

    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = driver.bind
    with cupy.cuda.using_allocator(outside_malloc):
        yield cache, driver, where, outside
    assert driver.errors == []


def test_cupy_arrays_in_a_scope_come_from_the_cache(fake_gpu):
    cache, driver, _, outside = fake_gpu
    before = cupy.cuda.get_allocator()
    with memory.cached(cache) as scope:
        a = cupy.empty((256, 256), cupy.float32)
        b = cupy.empty(10, cupy.int64)
        assert a.data.ptr in driver.buffers and b.data.ptr in driver.buffers
        assert cache.stats().bytes_live == memory.bin_size(a.nbytes) + memory.bin_size(b.nbytes)
        with memory.uncached():
            c = cupy.empty(7)
        assert c.data.ptr not in driver.buffers and outside == [56]
        del b
    assert cupy.cuda.get_allocator() is before  # restored
    assert scope.stats.upstream_allocs == 2 and scope.stats.misses == 2
    ptr = a.data.ptr
    view = a[1:]
    del a
    assert cache.stats().bytes_live > 0  # the view keeps the block
    del view
    with memory.cached(cache) as scope:
        again = cupy.empty((256, 256), cupy.float32)
    assert again.data.ptr == ptr and scope.stats.upstream_allocs == 0 and scope.stats.hits == 1
    cache._core.audit()


def _cupys():
    import fake_cupy

    return [fake_cupy] if FAKE_CUPY else [fake_cupy, cupy]


@pytest.mark.parametrize("module", _cupys(), ids=lambda m: m.__name__)
def test_the_allocator_hook_is_cupys_in_the_fake_too(module):
    # What the front end relies on, run against tests/fake_cupy.py and (where installed) CuPy.
    cuda = module.cuda
    default = cuda.get_allocator()
    seen = []

    def mine(size):
        raise AssertionError("never called")

    with cuda.using_allocator(mine):
        assert cuda.get_allocator() is mine
        worker = threading.Thread(target=lambda: seen.append(cuda.get_allocator()))
        worker.start()
        worker.join()
        with pytest.raises(ValueError):
            cuda.set_allocator(None)  # not inside using_allocator
    assert seen == [default] and cuda.get_allocator() is default
    for args in ((10, 20), (10, -1), (1 << 20, 20, 30)):
        assert str(cuda.memory.OutOfMemoryError(*args)).startswith(f"Out of memory allocating {args[0]:,} bytes")
    assert str(cuda.memory.OutOfMemoryError(10, 20, 30)) == (
        "Out of memory allocating 10 bytes (allocated so far: 20 bytes, limit set to: 30 bytes)."
    )
    unowned = cuda.UnownedMemory(4096, 512, owner=None, device_id=0)
    pointer = cuda.MemoryPointer(unowned, 256)
    assert (pointer.ptr, pointer.device_id, pointer.mem) == (4096 + 256, 0, unowned)
    assert callable(module.get_default_memory_pool().free_all_blocks) and callable(cuda.runtime.getDevice)


def test_uncached_steps_outside_a_cupy_and_a_numpy_scope_at_once(fake_gpu):
    cache, driver, _, outside = fake_gpu
    host = memory.AllocCache()
    before_numpy, before_cupy = _core.get_handler(), cupy.cuda.get_allocator()
    with memory.cached(cache), memory.cached(host):
        in_scopes = cupy.cuda.get_allocator()
        with memory.uncached():
            assert _core.get_handler() is before_numpy and cupy.cuda.get_allocator() is before_cupy
            outside_both = cupy.empty(7)
            assert host.stats().bytes_live == 0  # nor from the host cache
        assert _core.get_handler() is host.front_end.handler and cupy.cuda.get_allocator() is in_scopes
        inside = cupy.empty(7)
    assert outside == [56] and outside_both.data.ptr not in driver.buffers and inside.data.ptr in driver.buffers
    assert _core.get_handler() is before_numpy and cupy.cuda.get_allocator() is before_cupy


def test_no_two_live_cupy_arrays_share_a_block(fake_gpu):
    cache, _, _, _ = fake_gpu
    rng = np.random.default_rng(0)
    kept = []
    for step in range(50):
        with memory.cached(cache):
            temporaries = [cupy.empty(int(n), cupy.float32) for n in rng.integers(1, 5000, 8)]
            kept.append(temporaries[0])
            del temporaries
        spans = sorted((a.data.ptr, a.data.ptr + memory.bin_size(a.nbytes)) for a in kept)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    cache._core.audit()


def test_other_devices_and_streams_get_the_outside_allocator(fake_gpu):
    cache, driver, where, outside = fake_gpu
    with memory.cached(cache):
        cupy.empty(10)  # binds the cache to the null stream
        where["device"] = 1
        on_other_device = cupy.empty(100)
        where["device"], where["stream"] = 0, 12345
        on_other_stream = cupy.empty(200)
    assert outside == [800, 1600]
    assert on_other_device.data.ptr not in driver.buffers and on_other_stream.data.ptr not in driver.buffers
    assert cache.stats().upstream_allocs == 1


def test_out_of_device_memory_raises_cupys_error_with_the_figures(fake_gpu):
    cache, driver, where, _ = fake_gpu
    driver.capacity = 1 << 20
    with memory.cached(cache):
        kept = cupy.empty(100_000, cupy.float32)
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
            cupy.empty(1 << 20, cupy.uint8)
    assert where["pool_released"] == 1  # CuPy's pool was asked to let go before giving up
    assert isinstance(info.value, memory.CacheMemoryError)
    message = str(info.value)
    assert "Out of memory allocating 1,048,576 bytes" in message and "Cache figures: live" in message
    del kept


def test_a_failing_driver_is_named(fake_gpu):
    cache, driver, _, _ = fake_gpu
    driver.capacity, driver.error = 0, 999
    with memory.cached(cache), pytest.raises(cupy.cuda.memory.OutOfMemoryError, match="error 999"):
        cupy.empty(10)


def test_the_hook_is_per_thread_and_restored_on_errors(fake_gpu):
    cache, driver, _, _ = fake_gpu
    before = cupy.cuda.get_allocator()
    seen = []
    with pytest.raises(KeyError):
        with memory.cached(cache):
            worker = threading.Thread(target=lambda: seen.append(cupy.cuda.get_allocator()))
            worker.start()
            worker.join()
            raise KeyError("boom")
    assert cupy.cuda.get_allocator() is before
    assert seen and seen[0] is not None and cupy.cuda.get_allocator() is before
    assert cache.stats().scopes == 1


def test_threads_racing_to_a_caches_first_scope_bind_it_once(fake_gpu):
    _, driver, _, _ = fake_gpu
    cache = memory.AllocCache(lx.CUDADevice(0))
    binds = []

    def slow_bind(core, device_id):
        binds.append(device_id)
        time.sleep(0.05)  # the other thread reaches its first scope meanwhile
        driver.bind(core, device_id)

    cache.front_end.bind = slow_bind
    both = threading.Barrier(2)

    def first_scope():
        both.wait()
        with memory.cached(cache):
            cupy.empty(10)

    with ThreadPoolExecutor(2) as pool:
        scopes = [pool.submit(first_scope) for _ in range(2)]
    for scope in scopes:
        scope.result()  # raises what the thread raised
    assert binds == [0] and cache.stats().scopes == 2


def test_the_cache_can_die_before_its_arrays(fake_gpu):
    _, driver, _, _ = fake_gpu
    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = driver.bind
    with memory.cached(cache):
        a = cupy.empty(1000)
    frees = driver.frees
    del cache
    assert a.data.ptr in driver.buffers and driver.frees == frees
    del a  # the last block of the core: the core goes, and its blocks back to the driver
    assert driver.frees == frees + 1


@pytest.mark.skipif(
    FAKE_CUPY, reason="CuPy is not installed: the verbs need its ndarray, tests/fake_cupy.py has its allocator only"
)
def test_mixed_devices_are_refused_by_the_training_verbs(fake_gpu):
    cache, _, _, _ = fake_gpu
    with memory.cached(cache):
        on_gpu = cupy.empty((4, 3), cupy.float32)  # metadata only: never computed on
    model = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(ValueError, match=r"CPUDevice\(\) and CUDADevice\(0\)"):
        lx.get_device({"w": ps["weight"], "x": on_gpu})
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None)
    with pytest.raises(ValueError, match=r"parameters are on CPUDevice\(\) but the data on CUDADevice\(0\)"):
        lx.compute_gradients(lx.AutoTape(), lx.losses.MSELoss(), (on_gpu, np.zeros((4, 2), np.float32)), ts)
    with pytest.raises(ValueError, match=r"CUDADevice\(0\)"):
        lx.single_train_step(lx.AutoTape(), lx.losses.MSELoss(), (on_gpu, on_gpu), ts)
