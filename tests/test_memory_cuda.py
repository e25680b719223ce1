"""The allocator's CUDA side without a GPU: the C core's CUDA upstream with a host-memory
fake of the driver functions bound through the same path as the real ones, and the CuPy
front end's hook (C functions that tests/fake_cupy.py's CFunctionAllocator calls through
ctypes, as CuPy's Cython does), scopes and errors, with CuPy arrays made over the fake's
memory and never computed on. tests/fake_cupy.py stands in for CuPy in every test here,
also where CuPy is installed (its CFunctionAllocator asks the CUDA runtime for the device);
`test_the_allocator_hook_is_cupys_in_the_fake_too` holds the fake to CuPy's interface.

What needs a device (real cuMemAlloc, kernels on cached arrays) is in tests/test_gpu.py.
"""

from __future__ import annotations

import ctypes
import os
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
from luxnn.memory.errors import format_bytes

import fake_cupy as cupy

try:
    import cupy as _real_cupy  # noqa: F401

    FAKE_CUPY = False
except ImportError:
    FAKE_CUPY = True

CONTEXT = 0xC0FFEE  # the "primary context" the fake expects to be pushed
OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
ALIGNMENT = 256  # of the fake driver's pointers


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
        # Aligned as cuMemAlloc's pointers are (256 bytes at least): a library that plans for
        # its operands' alignment (cuBLASLt) sees a device's addresses.
        raw = ctypes.create_string_buffer(size + ALIGNMENT - 1)
        address = -(-ctypes.addressof(raw) // ALIGNMENT) * ALIGNMENT
        self.buffers[address] = (ctypes.c_char * size).from_buffer(raw, address - ctypes.addressof(raw))
        dptr[0] = address
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


@pytest.fixture(autouse=True)
def _fake_cupy(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy)


def _never(size):
    raise AssertionError(f"a request of {size} bytes went outside the core")


def take(core, size: int, fallback=_never):
    """A block of a CUDA core for `size` bytes as CuPy takes one in a cached scope (device
    0, the null stream): a MemoryPointer of CFunctionAllocator over the core's hook; the
    block goes back when it dies. Refused: MemoryError (the reason in last_failure())."""
    hook = _core.CupyHook(core, 0, 0, cupy_backend.stream_query(), fallback, lambda: None, MemoryError)
    return cupy.cuda.memory.CFunctionAllocator(*hook.functions, hook).malloc(size)


# -- the C core's CUDA upstream -----------------------------------------------------------


def test_blocks_come_from_the_driver_and_return_to_the_free_lists():
    driver = FakeDriver()
    core = cuda_core(driver)
    a, b = take(core, 1000), take(core, 1 << 20)
    assert core.stats().bytes_live == memory.bin_size(1000) + memory.bin_size(1 << 20)
    assert {a.ptr, b.ptr} <= set(driver.buffers) and driver.allocs == 2
    ptr = a.ptr
    del a
    c = take(core, 900)
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
    blocks = [take(core, n) for n in (512, 4096, 1 << 16, 1 << 22)]
    kept = blocks.pop()
    del blocks
    # Two slabs: the first holds 512 B and 4 KiB; the 64 KiB block, larger, takes its own.
    assert core.trim(0) == _core.SLAB_MIN + (1 << 16)
    assert driver.frees == 2
    core.release_all()  # `kept` is live: released when it dies
    assert driver.frees == 2
    del kept
    assert driver.frees == 3 and driver.buffers == {}
    again = take(core, 100)  # a released core keeps working
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
            held.append(take(core, int(rng.choice(sizes)) + int(rng.integers(0, 4096))))
        elif op < 18:
            held.pop(int(rng.integers(len(held))))
        elif op == 18:
            core.trim(int(rng.choice([0, 1 << 20, 1 << 24])))
        elif step % 7 == 0:
            core.release_all()
        else:
            core.scope_exit(core.scope_enter())  # the clock of eviction
        core.audit()
        spans = sorted((b.ptr, b.ptr + memory.bin_size(b.mem.size)) for b in held)
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
        a = take(core, 1 << 20)
        result = take(core, 2 << 20)  # alive through the next cycle, as a step's result
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
        a, b = take(core, 1 << 20), take(core, 2 << 20)
        del a, b  # two whole free segments
        c = take(core, 3 << 20)
        assert (driver.allocs, driver.frees) == (3, frees), split_above
        core.audit()
        del c


def test_a_consolidation_the_device_cannot_hold_asks_for_the_request_alone():
    driver = FakeDriver(capacity=5 << 20)
    core = cuda_core(driver)
    a, b = take(core, 1 << 20), take(core, 2 << 20)
    del a, b  # 3 MiB in two whole free segments
    c = take(core, 3 << 20)  # both go back; 6 MiB does not fit, 3 MiB does
    assert (driver.allocs, driver.frees, core.stats().bytes_live) == (3, 2, 3 << 20)
    assert core.stats()[4:7] == (3 << 20, 0, 3 << 20)  # live, cached, reserved
    core.audit()
    del c
    assert driver.errors == []


def test_out_of_device_memory_trims_then_retries():
    driver = FakeDriver(capacity=3 << 20)
    core = cuda_core(driver)
    a, b = take(core, 1 << 20), take(core, 1 << 20)
    del a, b  # 2 MiB cached in the 1 MiB bin
    big = take(core, 2 << 20)  # fails at first, fits once the cache releases its blocks
    assert driver.frees == 2 and core.stats().bytes_live == 2 << 20
    with pytest.raises(MemoryError):
        take(core, 2 << 20)
    seq, over_limit, request, limit, figures, upstream_error = _core.last_failure()
    assert (over_limit, request, upstream_error) == (False, 2 << 20, OUT_OF_MEMORY)
    assert figures[4] == 2 << 20  # bytes_live when it failed
    core.audit()


def test_limit_and_unbound_core():
    core = cuda_core(FakeDriver(), limit=1 << 20)
    with pytest.raises(MemoryError):
        take(core, 2 << 20)
    assert _core.last_failure()[1] is True  # over the limit
    unbound = cuda_core()
    with pytest.raises(MemoryError):
        take(unbound, 10)
    assert _core.last_failure()[5] == -1  # never bound
    assert unbound.stats()[2] == 0


def test_cuda_cores_and_host_cores_do_not_mix():
    host, device = _core.Core(), cuda_core()
    with pytest.raises(TypeError, match="device memory"):
        device.numpy_handler()
    with pytest.raises(TypeError, match="device memory"):
        device.stress_lock(2, 10, 64)  # its threads would write into device pointers
    with pytest.raises(TypeError, match="expected a CUDA core"):
        take(host, 10)
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


@pytest.fixture
def fake_gpu(monkeypatch):
    """A CUDA cache for device 0 bound to a FakeDriver, an outside allocator that records
    the sizes it serves, and CuPy's default pool (which the hook empties when out of
    memory) replaced by one that counts."""
    released = {"pool": 0}

    class Pool:
        def free_all_blocks(self):
            released["pool"] += 1

    monkeypatch.setattr(cupy, "get_default_memory_pool", Pool)
    driver = FakeDriver()
    outside = []

    def outside_malloc(size):
        buf = ctypes.create_string_buffer(max(size, 1))
        outside.append(size)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ctypes.addressof(buf), size, buf, cupy.cuda.runtime.getDevice()), 0)

    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = driver.bind
    with cupy.cuda.using_allocator(outside_malloc):
        yield cache, driver, released, outside
    assert driver.errors == []


def test_cupy_arrays_in_a_scope_come_from_the_cache(fake_gpu):
    cache, driver, _, outside = fake_gpu
    before = cupy.cuda.get_allocator()
    with memory.cached(cache) as scope:
        # CuPy calls the core's C functions: no Python runs per request.
        assert isinstance(cupy.cuda.get_allocator().__self__, cupy.cuda.memory.CFunctionAllocator)
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
    try:
        import cupy as real
    except ImportError:
        return [cupy]
    return [cupy, real]


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
    allocator = cuda.memory.CFunctionAllocator(0, 0, 0, None)  # 0 bytes: no call (pointer 0)
    assert allocator.malloc(0).ptr == 0
    # The hook's stream query, where the front end looks it up.
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(sys.modules, "cupy", module)
        assert cupy_backend.stream_query() != 0


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
    cache, driver, _, outside = fake_gpu
    with cupy.cuda.Stream():  # the cache serves the stream current at its first scope
        with memory.cached(cache):
            cupy.empty(10)
    with memory.cached(cache):
        on_the_null_stream = cupy.empty(100)
        with cupy.cuda.Device(1):
            on_other_device = cupy.empty(200)
        with cupy.cuda.Stream():
            on_other_stream = cupy.empty(300)
    assert outside == [800, 1600, 2400]
    assert all(a.data.ptr not in driver.buffers for a in (on_the_null_stream, on_other_device, on_other_stream))
    assert on_other_device.data.device_id == 1 and cache.stats().upstream_allocs == 1
    live = cache.stats().bytes_live
    del on_the_null_stream, on_other_device, on_other_stream  # back to the outside allocator
    assert cache.stats().bytes_live == live and driver.errors == []


def test_the_per_thread_default_stream_is_served_in_the_binding_thread_alone(fake_gpu):
    # Its handle is the same in every thread, but each thread's is another stream.
    cache, driver, _, _ = fake_gpu
    with cupy.cuda.Stream.ptds, memory.cached(cache):
        mine = cupy.empty(10)
    arrays = []

    def other_thread():  # its allocator outside the scope: CuPy's global one
        with cupy.cuda.Stream.ptds, memory.cached(cache):
            arrays.append(cupy.empty(20))

    worker = threading.Thread(target=other_thread)
    worker.start()
    worker.join()
    assert mine.data.ptr in driver.buffers and arrays[0].data.ptr not in driver.buffers
    assert cache.stats().bytes_live == memory.bin_size(80)  # mine alone
    with cupy.cuda.Stream.ptds, memory.cached(cache):
        again = cupy.empty(10)
    assert cache.stats().bytes_live == 2 * memory.bin_size(80)  # the binding thread's again


def test_a_cache_serves_its_own_devices_stream_whatever_device_is_current_at_first(fake_gpu):
    _, driver, _, outside = fake_gpu
    cache = memory.AllocCache(lx.CUDADevice(1))
    cache.front_end.bind = driver.bind
    with cupy.cuda.Stream(), memory.cached(cache):  # device 0's stream is current: not device 1's
        with cupy.cuda.Device(1):
            on_1 = cupy.empty(10)
    assert cache.stats().bytes_live == memory.bin_size(80) and outside == []
    del on_1


def test_outside_pointers_live_as_long_as_cupys_memory_for_them(fake_gpu):
    cache, driver, _, _ = fake_gpu
    alive = []

    class Owner:  # the outside allocator's memory: alive while its MemoryPointer is
        def __init__(self, size):
            self.buf = ctypes.create_string_buffer(size)
            alive.append(size)

        def __del__(self):
            alive.remove(len(self.buf))

    def outside(size):
        owner = Owner(size)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(ctypes.addressof(owner.buf), size, owner, 1), 0)

    with cupy.cuda.using_allocator(outside):
        with memory.cached(cache):
            with cupy.cuda.Device(1):
                a, b = cupy.empty(64, cupy.uint8), cupy.empty(128, cupy.uint8)
        assert sorted(alive) == [64, 128] and driver.allocs == 0
        view = a[1:]
        del a
        assert sorted(alive) == [64, 128]  # the view holds CuPy's memory
        del view, b
        assert alive == []


def test_an_error_of_the_outside_allocator_reaches_the_caller(fake_gpu):
    cache, _, _, _ = fake_gpu

    def failing(size):
        raise MemoryError(f"outside: no {size} bytes")

    with cupy.cuda.using_allocator(failing), memory.cached(cache):
        with cupy.cuda.Device(1), pytest.raises(MemoryError, match="outside: no 800 bytes"):
            cupy.empty(100)
        kept = cupy.empty(100)  # the cache's device still served
    assert cache.stats().bytes_live == memory.bin_size(800)
    del kept


def test_out_of_device_memory_trims_retries_and_raises_cupys_error_with_the_figures(fake_gpu):
    cache, driver, released, _ = fake_gpu
    driver.capacity = 1 << 20
    with memory.cached(cache):
        kept = cupy.empty(100_000, cupy.float32)
        cupy.empty(50_000, cupy.float32)  # dies: a free block the cache holds
        assert cache.stats().bytes_cached > 0
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
            cupy.empty(1 << 20, cupy.uint8)
    assert released["pool"] == 1  # CuPy's pool was asked to let go before giving up
    assert cache.stats().bytes_cached == 0 and driver.used == memory.bin_size(400_000)  # trimmed, nothing leaked
    assert isinstance(info.value, memory.CacheMemoryError)
    live = format_bytes(memory.bin_size(400_000))
    message = str(info.value)
    assert "Out of memory allocating 1,048,576 bytes" in message and f"Cache figures: live {live}" in message
    assert f"reserved {live}" in message
    with memory.cached(cache):  # and the cache goes on serving
        again = cupy.empty(1000)
    assert again.data.ptr in driver.buffers
    del kept, again
    cache._core.audit()


def test_a_request_over_the_limit_raises_cupys_error_naming_the_limit(fake_gpu):
    _, driver, released, _ = fake_gpu
    cache = memory.AllocCache(lx.CUDADevice(0), limit=1 << 20)
    cache.front_end.bind = driver.bind
    with memory.cached(cache), pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
        cupy.empty(2 << 20, cupy.uint8)
    assert "limit set to: 1,048,576 bytes" in str(info.value) and "limit of 1.0 MiB" in str(info.value)
    assert released["pool"] == 0 and driver.allocs == 0  # no trim can make room for it
    cache.limit = 4 << 20  # from the next request on
    with memory.cached(cache):
        a = cupy.empty(2 << 20, cupy.uint8)
    assert a.data.ptr in driver.buffers


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


def test_a_forked_child_never_calls_the_driver(fake_gpu):
    cache, driver, released, _ = fake_gpu
    with memory.cached(cache):
        kept = cupy.empty(1 << 18, cupy.uint8)
        cupy.empty(1 << 18, cupy.uint8)  # a free block
    calls = driver.allocs + driver.frees
    pid = os.fork()
    if pid == 0:  # the child: its blocks die, its cache trims and asks for more (CuPy's pool not
        # asked to release either: a CUDA call)
        status = 1
        try:
            del kept
            cache.trim()
            with memory.cached(cache):
                try:
                    cupy.empty(1 << 22, cupy.uint8)
                except MemoryError:
                    pass
            status = 0 if driver.allocs + driver.frees == calls and driver.errors == [] and released["pool"] == 0 else 2
        finally:
            os._exit(status)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    frees = driver.frees
    assert cache.trim() > 0 and driver.frees == frees + 1  # the parent's cache still works
    del kept


def _step_loop(cache, empty, steps=8):
    # A fixed-shape step as the verbs mark it: temporaries of several sizes whose lifetimes
    # overlap, as a forward and backward pass makes them. Its figures: driver allocations
    # per step, plans, plan hits, and peak reserved / peak live from the fourth step on.
    MiB, allocs = 1 << 20, []
    for step in range(steps):
        before = cache.stats().upstream_allocs
        if step == 3:
            cache.reset_peaks()
        with memory.step(cache):
            a, b, small = empty(4 * MiB), empty(MiB), [empty(n) for n in (700, 3000, 20_000)]
            del a
            c, d = empty(3 * MiB), empty(2 * MiB + 4096)
            del b
            e, f = empty(7 * MiB // 2), empty(100_000)
            del c, d, small, e, f
        allocs.append(cache.stats().upstream_allocs - before)
    s = cache.stats()
    return allocs, s.plans, s.plan_hits, s.peak_reserved / s.peak_live


def test_a_device_cache_plans_steps_as_a_host_cache_does(fake_gpu):
    cache, _, _, _ = fake_gpu
    on_device = _step_loop(cache, lambda n: cupy.empty(n, cupy.uint8))
    on_host = _step_loop(memory.AllocCache(), lambda n: np.empty(n, np.uint8))
    assert on_device == on_host
    allocs, plans, plan_hits, reserved_per_live = on_device
    assert plans == 1 and plan_hits > 0 and allocs[3:] == [0] * 5 and reserved_per_live <= 1.05
    cache._core.audit()


@pytest.mark.skipif(
    FAKE_CUPY, reason="CuPy is not installed: the verbs need its ndarray, tests/fake_cupy.py has its allocator only"
)
def test_mixed_devices_are_refused_by_the_training_verbs():
    import cupy as real

    def host_malloc(size):  # metadata only: these arrays are never computed on
        buf = ctypes.create_string_buffer(max(size, 1))
        return real.cuda.MemoryPointer(real.cuda.UnownedMemory(ctypes.addressof(buf), size, buf, 0), 0)

    with real.cuda.using_allocator(host_malloc):
        on_gpu = real.empty((4, 3), real.float32)
    model = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(ValueError, match=r"CPUDevice\(\) and CUDADevice\(0\)"):
        lx.get_device({"w": ps["weight"], "x": on_gpu})
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None)
    with pytest.raises(ValueError, match=r"parameters are on CPUDevice\(\) but the data on CUDADevice\(0\)"):
        lx.compute_gradients(lx.AutoTape(), lx.losses.MSELoss(), (on_gpu, np.zeros((4, 2), np.float32)), ts)
    with pytest.raises(ValueError, match=r"CUDADevice\(0\)"):
        lx.single_train_step(lx.AutoTape(), lx.losses.MSELoss(), (on_gpu, on_gpu), ts)
