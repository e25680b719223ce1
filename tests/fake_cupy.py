"""A stand-in for the part of CuPy that luxnn's CuPy front end uses, over host memory, so
that the front end runs as written on machines without CuPy (CI among them).

It keeps CuPy's documented signatures and semantics (``cupy/cuda/memory.pyx``,
``cupy/cuda/stream.pyx`` and ``cupy/cuda/__init__.py`` of CuPy 13-14): ``cuda.get_allocator()``
(the thread's allocator from ``using_allocator``, else the global one),
``cuda.set_allocator(allocator=None)`` (refused inside ``using_allocator``),
``cuda.using_allocator(allocator=None)`` (thread-local; its exit restores the thread's
previous setting), ``cuda.alloc(size)``, ``cuda.MemoryPointer(mem, offset)``,
``cuda.UnownedMemory(ptr, size, owner, device_id=-1)``,
``cuda.memory.OutOfMemoryError(size, total, limit=0)`` with CuPy's message,
``cuda.memory.CFunctionAllocator(param, malloc_func, free_func, owner)`` (below),
``get_default_memory_pool()``, ``cuda.runtime.getDevice()``, ``cuda.Device(i)`` and
``cuda.Stream()`` as context managers that make a device or a stream current (per thread;
streams per device; ``cuda.Stream.ptds``, the per-thread default stream, of device 0), ``cuda.get_current_stream().ptr``, and the C function
``get_current_stream_ptr`` in ``cuda.stream.__pyx_capi__`` (a capsule named, as Cython
names it, by its signature ``intptr_t (void)``); and ``empty(shape, dtype=float)``, whose
arrays take their memory from ``cuda.alloc`` and hold it (views share it): ``data``,
``nbytes``, ``shape``, ``dtype``, slicing. Arrays are never computed on; anything else of
CuPy's is absent, so code that needs more fails here rather than passing on a guess.
(tests/sim_cupy.py builds a simulated device that computes on this interface.)

``CFunctionAllocator`` calls the C functions as CuPy's Cython does: ``malloc(param, size,
device_id)`` with the current device, only for ``size > 0`` (a 0-byte memory has pointer
0 and is never freed), with the GIL held, and a Python error set by ``malloc`` is raised
(Cython's ``except *``) and leaves the memory with pointer 0; ``free(param, ptr,
device_id)`` when the memory object dies, with the device of its allocation. The memory
object holds neither the allocator nor its owner.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types
import weakref

import numpy as np

float32, float64, int64, uint8 = np.float32, np.float64, np.int64, np.uint8


class OutOfMemoryError(MemoryError):
    """CuPy's ``cupy.cuda.memory.OutOfMemoryError(size, total, limit=0)``."""

    def __init__(self, size, total, limit=0):
        self._size, self._total, self._limit = size, total, limit
        if limit == 0:
            msg = f"Out of memory allocating {size:,} bytes"
            if total != -1:
                msg += f" (allocated so far: {total:,} bytes)."
        else:
            msg = (
                f"Out of memory allocating {size:,} bytes "
                f"(allocated so far: {total:,} bytes, limit set to: {limit:,} bytes)."
            )
        super().__init__(msg)


_MALLOC = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)


class CFunctionAllocatorMemory:
    """CuPy's memory of a `CFunctionAllocator`: `free_func` is called when it dies."""

    def __init__(self, size, param, malloc_func, free_func, device_id):
        self._param, self._free_func, self.device_id, self.size, self.ptr = param, free_func, device_id, size, 0
        if size > 0:
            self.ptr = _MALLOC(malloc_func)(param, size, device_id) or 0  # raises malloc's Python error

    def __del__(self):
        if self.ptr:
            _FREE(self._free_func)(self._param, self.ptr, self.device_id)


class CFunctionAllocator:
    """``CFunctionAllocator(param, malloc_func, free_func, owner)``: `owner` keeps `param`
    and the functions alive while the allocator lives (not while its memory does)."""

    def __init__(self, param, malloc_func, free_func, owner):
        self._param, self._malloc_func, self._free_func, self._owner = param, malloc_func, free_func, owner

    def malloc(self, size):
        mem = CFunctionAllocatorMemory(size, self._param, self._malloc_func, self._free_func, runtime.getDevice())
        return MemoryPointer(mem, 0)


class UnownedMemory:
    """``UnownedMemory(ptr, size, owner, device_id=-1)``: memory that `owner` keeps alive."""

    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, int(device_id)


class MemoryPointer:
    """``MemoryPointer(mem, offset)``: a place in `mem`, which it holds."""

    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id

    def __add__(self, offset):
        return MemoryPointer(self.mem, self.ptr - self.mem.ptr + offset)


_host_buffers = weakref.WeakValueDictionary()  # address -> the live buffer `_malloc` made there


def _malloc(size):
    """The raw allocator (CuPy's ``memory._malloc``), here host memory."""
    buf = ctypes.create_string_buffer(max(size, 1))
    _host_buffers[ctypes.addressof(buf)] = buf
    return MemoryPointer(UnownedMemory(ctypes.addressof(buf), size, buf, runtime.getDevice()), 0)


def host_buffer(ptr):
    """The host buffer holding the raw allocation that starts at `ptr`, or None if the raw
    allocator made none there: holding it keeps those bytes valid without holding CuPy's
    memory object (tests/sim_cupy.py's graphs do, as a GPU's memory stays mapped)."""
    return _host_buffers.get(ptr)


_current_allocator = _malloc
_thread_local = threading.local()


def get_allocator():
    return getattr(_thread_local, "allocator", None) or _current_allocator


def set_allocator(allocator=None):
    global _current_allocator
    if getattr(_thread_local, "allocator", None) is not None:
        raise ValueError("Can't change the global allocator inside `using_allocator` context manager")
    _current_allocator = _malloc if allocator is None else allocator


@contextlib.contextmanager
def using_allocator(allocator=None):
    previous = getattr(_thread_local, "allocator", None)
    _thread_local.allocator = _malloc if allocator is None else allocator
    try:
        yield
    finally:
        _thread_local.allocator = previous


def alloc(size):
    return get_allocator()(size)


class _Pool:
    def free_all_blocks(self, stream=None):
        pass


_pool = _Pool()


def get_default_memory_pool():
    return _pool


_current = threading.local()  # .device, .streams: {device: stream pointer}, .entered


class Device:
    """``with Device(i):`` makes device i current in this thread."""

    def __init__(self, device=None):
        self.id = runtime.getDevice() if device is None else int(device)

    def __enter__(self):
        self._before = runtime.getDevice()
        _current.device = self.id
        return self

    def __exit__(self, *exc):
        _current.device = self._before


class Stream:
    """A stream of the current device; ``with stream:`` makes it current in this thread (of
    the current device for a stream of device -1, as CuPy's singletons are)."""

    _made = 0

    def __init__(self):
        Stream._made += 1
        self.ptr, self.device_id = 0x5000 + Stream._made, runtime.getDevice()

    def __enter__(self):
        device = runtime.getDevice() if self.device_id == -1 else self.device_id
        streams = _streams()
        _entered().append((device, streams.get(device, 0)))
        streams[device] = self.ptr
        return self

    def __exit__(self, *exc):
        device, before = _entered().pop()
        _streams()[device] = before


class _PerThreadStream(Stream):
    """``Stream.ptds``: CUDA's per-thread default stream, one handle in every thread."""

    def __init__(self):
        self.ptr, self.device_id = 2, 0


Stream.ptds = _PerThreadStream()


def _streams():
    if not hasattr(_current, "streams"):
        _current.streams = {}
    return _current.streams


def _entered():
    """This thread's streams entered and not left: (device, the stream current before)."""
    if not hasattr(_current, "entered"):
        _current.entered = []
    return _current.entered


def get_current_stream():
    return types.SimpleNamespace(ptr=_streams().get(runtime.getDevice(), 0))


runtime = types.SimpleNamespace(getDevice=lambda: getattr(_current, "device", 0))

# get_current_stream_ptr as C: a callback (it takes the GIL, which its caller holds) in a
# capsule named by its signature; the name's bytes must outlive the capsule.
_stream_ptr = ctypes.PYFUNCTYPE(ctypes.c_ssize_t)(lambda: get_current_stream().ptr)
_capsule_name = ctypes.create_string_buffer(b"intptr_t (void)")
_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
stream = types.SimpleNamespace(
    __pyx_capi__={"get_current_stream_ptr": _new_capsule(ctypes.cast(_stream_ptr, ctypes.c_void_p), _capsule_name, None)}
)


class ndarray:  # noqa: N801 - CuPy's name
    """An array's metadata over memory from the current allocator; never computed on."""

    def __init__(self, meta, data):
        self._meta, self.data = meta, data  # meta: a NumPy view of no bytes, for shapes

    shape = property(lambda self: self._meta.shape)
    dtype = property(lambda self: self._meta.dtype)
    nbytes = property(lambda self: self._meta.size * self._meta.dtype.itemsize)

    def __getitem__(self, key):
        return ndarray(self._meta[key], self.data)  # a view holds the memory too


def empty(shape, dtype=float):
    meta = np.broadcast_to(np.empty((), dtype), (shape,) if isinstance(shape, int) else tuple(shape))
    return ndarray(meta, alloc(meta.size * meta.dtype.itemsize))


cuda = types.SimpleNamespace(
    get_allocator=get_allocator, set_allocator=set_allocator, using_allocator=using_allocator, alloc=alloc,
    MemoryPointer=MemoryPointer, UnownedMemory=UnownedMemory, runtime=runtime, Device=Device, Stream=Stream,
    get_current_stream=get_current_stream, stream=stream,
    memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError, CFunctionAllocator=CFunctionAllocator),
)  # fmt: skip
