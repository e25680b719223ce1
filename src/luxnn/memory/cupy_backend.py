"""The CuPy front end of the allocator (`luxnn.memory.frontend`): device memory for
`AllocCache(device=CUDADevice(k))`.

Inside ``cached(cache)`` every CuPy allocation of the current thread on device k goes
through CuPy's allocator hook (``cupy.cuda.using_allocator``, thread-local) to the cache's
``malloc``, which takes a block from the cache's C core and hands CuPy a ``MemoryPointer``
over it. The block's owner is a `_core.Block`: when CuPy's memory object for the block
dies, the block returns to the cache's free lists, as a NumPy array's block does.

Upstream: raw ``cuMemAlloc`` / ``cuMemFree`` (the CUDA driver API, called from the C core,
``csrc/upstream_cuda.c``), so the cache is the only pool between CuPy and the driver: its
figures are the driver's, ``upstream_allocs`` counts driver allocations, and a trimmed or
evicted block really goes back to the device. The alternative, CuPy's default pool as the
upstream, was not built: the pool would keep every block the cache trims or evicts, so
memory would be cached twice and peak reserved would be the pool's, not the cache's; and
the pool's own figures are what ``scripts/gpu_check.sh`` measures side by side with the
cache (``benchmarks/gpu_step.py``).

Keys. A cache serves one device and one stream: the device of its `CUDADevice` and the
stream current at its first use (usually the null stream). Requests on another device
or stream are passed to the allocator that was active before the scope, so a block
never crosses devices, and one freed by work queued on one stream is never handed to
another stream while that work may still run (CuPy's pool keys by stream for the same
reason).

Binding. Constructing the cache touches nothing: the driver functions are looked up in
``libcuda.so.1`` with ctypes and the device's primary context retained (the one the CUDA
runtime and CuPy use; it stays retained for the life of the process, as the runtime's
does) on the first scope.

Out of device memory: the core releases its whole free blocks and retries; then the front end
releases the free blocks of CuPy's default pool and retries once more; then it raises
CuPy's ``OutOfMemoryError`` (also a `CacheMemoryError`) with the cache's figures
(`luxnn.memory.errors`).
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable

from .errors import cupy_out_of_memory_error, last_failure
from .frontend import FrontEnd, Installed

__all__ = ["CupyFrontEnd", "bind_driver"]


# What the hook asks on every request: the current device and stream (the stream's
# handle). Set on first use; tests without a GPU set them to fakes beforehand.
_current_device: Callable[[], int] | None = None
_current_stream: Callable[[], int] | None = None


def _resolve_queries() -> None:
    global _current_device, _current_stream
    import cupy

    if _current_device is None:
        _current_device = cupy.cuda.runtime.getDevice
    if _current_stream is None:
        get_current_stream = cupy.cuda.get_current_stream
        _current_stream = lambda: get_current_stream().ptr  # noqa: E731


def _driver_library() -> Any:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as err:
        raise RuntimeError(f"AllocCache: cannot load the CUDA driver library libcuda.so.1 ({err})") from err


def bind_driver(core: Any, device_id: int) -> None:
    """Bind a CUDA core to the driver: cuMemAlloc/cuMemFree in device `device_id`'s
    primary context (retained here, once per cache)."""
    lib = _driver_library()

    def check(name: str, status: int) -> None:
        if status != 0:
            text = ctypes.c_char_p()
            lib.cuGetErrorName(status, ctypes.byref(text))
            raise RuntimeError(f"AllocCache: {name} failed on device {device_id}: {(text.value or b'?').decode()} ({status})")

    device, context = ctypes.c_int(), ctypes.c_void_p()
    check("cuInit", lib.cuInit(0))
    check("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(device), device_id))
    check("cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device))

    def address(name: str) -> int:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    core.bind_cuda(
        address("cuMemAlloc_v2"), address("cuMemFree_v2"), address("cuCtxPushCurrent_v2"),
        address("cuCtxPopCurrent_v2"), context.value,
    )  # fmt: skip


# A cache's first scope binds it, once, whichever threads race to it. Fork copies only the
# forking thread: a lock another thread held would stay held in the child, which starts
# with a new one.
_binding = threading.Lock()


def _new_binding_lock() -> None:
    global _binding
    _binding = threading.Lock()


os.register_at_fork(after_in_child=_new_binding_lock)


class CupyFrontEnd(FrontEnd):
    """CuPy's: the cache's ``malloc`` in CuPy's thread-local allocator hook, for one
    `AllocCache` on a `CUDADevice`. CuPy's memory objects hold their blocks, which hold the
    core: memory outlives the cache while arrays use it."""

    def __init__(self, core: Any, device_id: int, limit: int | None) -> None:
        self.core = core  # not the AllocCache: no cycle keeps a dropped cache alive
        self.device_id = device_id
        self.limit = limit
        self.stream: int | None = None  # the stream served: the one current at first use
        # Replaced by tests that plug a host-memory fake into the same code path.
        self.bind: Callable[[Any, int], None] = bind_driver

    def install(self) -> Installed:
        if self.stream is None:
            self._bind()
        return super().install()

    def _bind(self) -> None:
        # The first use: the core to the driver, and the cache to the stream current now.
        with _binding:
            if self.stream is None:  # no other thread bound it meanwhile
                _resolve_queries()
                self.bind(self.core, self.device_id)
                self.stream = _current_stream()

    def _route(self) -> tuple[Any, Any]:
        import cupy

        previous = cupy.cuda.get_allocator()
        return self._switch(self._malloc(previous)), previous

    @classmethod
    def _switch(cls, allocator: Any) -> Any:
        import cupy

        hook = cupy.cuda.using_allocator(allocator)
        hook.__enter__()
        return hook  # its exit restores the allocator it replaced

    @classmethod
    def _switch_back(cls, undo: Any) -> None:
        undo.__exit__(None, None, None)

    def _malloc(self, fallback: Callable[[int], Any]) -> Callable[[int], Any]:
        # CuPy's allocator function for the cache, ``malloc(size) -> MemoryPointer``;
        # requests the cache must not serve go to `fallback`. Out of memory, it raises
        # CuPy's error itself, so `refusal` has nothing to relabel.
        import cupy

        block_of = self.core.block
        device_id = self.device_id
        memory, pointer = cupy.cuda.UnownedMemory, cupy.cuda.MemoryPointer

        def malloc(size: int) -> Any:
            if _current_device() != device_id or _current_stream() != self.stream:
                return fallback(size)
            try:
                block = block_of(size)
            except MemoryError:
                # The core released its own free blocks already; CuPy's pool may hold
                # free device memory from outside the scope.
                cupy.get_default_memory_pool().free_all_blocks()
                try:
                    block = block_of(size)
                except MemoryError:
                    raise self._out_of_memory(size) from None
            if block is None:  # the bookkeeping itself is out of host memory
                return fallback(size)
            return pointer(memory(block.ptr, size, block, device_id), 0)

        return malloc

    def _out_of_memory(self, size: int) -> MemoryError:
        return cupy_out_of_memory_error(size, last_failure(), self.core.stats().bytes_reserved, self.limit or 0)
