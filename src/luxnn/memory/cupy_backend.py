"""The CuPy front end of the allocator (`luxnn.memory.frontend`): device memory for
`AllocCache(device=CUDADevice(k))`.

Inside ``cached(cache)`` every CuPy allocation of the current thread goes through CuPy's
allocator hook (``cupy.cuda.using_allocator``, thread-local) to C functions of the cache's
core: ``cupy.cuda.memory.CFunctionAllocator(param, malloc, free, owner)`` with the core's
``CupyHook`` (``csrc/py_cuda.c``, "CuPy hook"). CuPy calls ``malloc(param, size,
device_id)`` for every request and ``free(param, ptr, device_id)`` when the memory object
it made for the pointer dies, so a block goes back to the cache's free lists exactly when
CuPy's memory object for it dies, never before. A hit runs no Python.

Keys. A cache serves one device and one stream: the device of its `CUDADevice` and that
device's stream current at the cache's first scope (usually the null stream). ``malloc`` has no stream
argument: the hook asks CuPy's own C function for the current stream,
``get_current_stream_ptr`` of ``cupy.cuda.stream`` (exported by its Cython module in
``__pyx_capi__``; looked up once, on the cache's first scope), and the device is
``malloc``'s argument. Requests on another device or stream are made by the allocator that
was active before the scope, so a block never crosses devices, and one freed by work queued
on one stream is never handed to another stream while that work may still run (CuPy's pool
keys by stream for the same reason). The per-thread default stream has the same handle in
every thread: a cache bound to it serves the thread that bound it alone.

Upstream: raw ``cuMemAlloc`` / ``cuMemFree`` (the CUDA driver API, called from the C core,
``csrc/upstream_cuda.c``), so the cache is the only pool between CuPy and the driver: its
figures are the driver's, ``upstream_allocs`` counts driver allocations, and a trimmed or
evicted block really goes back to the device. (CuPy's default pool as the upstream would
keep every block the cache trims or evicts: memory cached twice.) The driver functions are
looked up in ``libcuda.so.1`` with ctypes and the device's primary context retained (the one
the CUDA runtime and CuPy use; it stays retained for the life of the process, as the
runtime's does) on the first scope; constructing the cache touches nothing.

Out of device memory: the core releases its whole free blocks and retries; then the hook
has CuPy's default pool release its free blocks and the core retries once more; then it
raises CuPy's ``OutOfMemoryError`` (also a `CacheMemoryError`) naming the request, the
cache's live and reserved bytes and its limit (`luxnn.memory.errors`): CuPy's Cython checks
for a Python error after ``malloc``. A request over the cache's limit raises the same at
once.

Lifetimes and processes. Every pointer handed to CuPy holds the hook, which holds the core:
a cache dropped while its arrays live keeps their memory valid, and the core goes back to
the driver when the last of them dies. A forked child never calls the driver through the
cache (``csrc/upstream_cuda.c``): the parent's context is not the child's.
"""

from __future__ import annotations

import ctypes
import os
import threading
from typing import Any, Callable

from . import _core
from .errors import cupy_out_of_memory_error, last_failure
from .frontend import FrontEnd, Installed

__all__ = ["CupyFrontEnd", "bind_driver", "stream_query"]

# The signature CuPy's Cython gives `get_current_stream_ptr` in its capsule.
_STREAM_QUERY_SIGNATURE = "intptr_t (void)"
# CUDA's handle of the per-thread default stream (cudaStreamPerThread), the same in every
# thread (CuPy's with CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1).
_PER_THREAD_STREAM = 2


def stream_query() -> int:
    """The address of CuPy's C function ``intptr_t get_current_stream_ptr(void)`` (the
    current stream of the current device; call it with the GIL held), from the capsule that
    the Cython module ``cupy.cuda.stream`` exports in ``__pyx_capi__``."""
    import cupy

    try:
        capsule = cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
    except (AttributeError, KeyError) as err:
        raise RuntimeError(
            f"AllocCache: CuPy {getattr(cupy, '__version__', '?')} does not export "
            "cupy.cuda.stream.get_current_stream_ptr to C, which the cache's hook needs"
        ) from err
    get_name, get_pointer = ctypes.pythonapi.PyCapsule_GetName, ctypes.pythonapi.PyCapsule_GetPointer
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_pointer.restype, get_pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    name = get_name(capsule)
    if name is None or not name.decode().startswith(_STREAM_QUERY_SIGNATURE):
        raise RuntimeError(
            f"AllocCache: expected CuPy's get_current_stream_ptr to be {_STREAM_QUERY_SIGNATURE!r}, "
            f"its capsule says {name!r}"
        )
    return get_pointer(capsule, name)


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


def _release_cupy_pool() -> None:
    import cupy

    cupy.get_default_memory_pool().free_all_blocks()


class CupyFrontEnd(FrontEnd):
    """CuPy's: the core's `CupyHook` in CuPy's thread-local allocator hook, for one
    `AllocCache` on a `CUDADevice`. CuPy's memory objects hold the hook, which holds the
    core: memory outlives the cache while arrays use it."""

    def __init__(self, core: Any, device_id: int) -> None:
        self.core = core  # not the AllocCache: no cycle keeps a dropped cache alive
        self.device_id = device_id
        self.stream: int | None = None  # the stream served: the one current at first use
        self._current_stream = 0  # CuPy's stream query (`stream_query`), once bound
        self._thread = 0  # the thread served, for the per-thread default stream (0: any)
        # Replaced by tests that plug a host-memory fake into the same code path.
        self.bind: Callable[[Any, int], None] = bind_driver

    def install(self) -> Installed:
        if self.stream is None:
            self._bind()
        return super().install()

    def _bind(self) -> None:
        # The first use: the core to the driver, and the cache to its device's stream
        # current now.
        import cupy

        with _binding:
            if self.stream is None:  # no other thread bound it meanwhile
                query = stream_query()
                self.bind(self.core, self.device_id)
                self._current_stream = query
                with cupy.cuda.Device(self.device_id):
                    stream = ctypes.PYFUNCTYPE(ctypes.c_ssize_t)(query)()
                # The per-thread default stream has one handle in every thread: served
                # in the binding thread alone.
                self._thread = threading.get_ident() if stream == _PER_THREAD_STREAM else 0
                self.stream = stream  # last: other threads' `install` reads it unlocked

    def _route(self) -> tuple[Any, Any]:
        import cupy

        previous = cupy.cuda.get_allocator()
        hook = _core.CupyHook(
            self.core, self.device_id, self.stream, self._current_stream, previous, _release_cupy_pool, self._refuse,
            self._thread,
        )  # fmt: skip
        allocator = cupy.cuda.memory.CFunctionAllocator(*hook.functions, hook)
        return self._switch(allocator.malloc), previous

    @classmethod
    def _switch(cls, allocator: Any) -> Any:
        import cupy

        hook = cupy.cuda.using_allocator(allocator)
        hook.__enter__()
        return hook  # its exit restores the allocator it replaced

    @classmethod
    def _switch_back(cls, undo: Any) -> None:
        undo.__exit__(None, None, None)

    def _refuse(self, size: int) -> MemoryError:
        # The hook's error for a request the core refused (it raises it in CuPy's malloc,
        # so `refusal` has nothing to relabel).
        failure = last_failure()
        reserved = self.core.stats().bytes_reserved
        return cupy_out_of_memory_error(size, failure, reserved, failure.limit if failure is not None else 0)
