"""A stand-in for the part of CuPy that luxnn's CuPy front end uses, over host memory, so
that the front end runs as written on machines without CuPy (CI among them).

It keeps CuPy's documented signatures and semantics (``cupy/cuda/memory.pyx`` and
``cupy/cuda/__init__.py`` of CuPy 13-14): ``cuda.get_allocator()`` (the thread's allocator
from ``using_allocator``, else the global one), ``cuda.set_allocator(allocator=None)``
(refused inside ``using_allocator``), ``cuda.using_allocator(allocator=None)`` (thread-local;
its exit restores the thread's previous setting), ``cuda.alloc(size)``,
``cuda.MemoryPointer(mem, offset)``, ``cuda.UnownedMemory(ptr, size, owner,
device_id=-1)``, ``cuda.memory.OutOfMemoryError(size, total, limit=0)`` with CuPy's
message, ``get_default_memory_pool()``, ``cuda.runtime.getDevice()`` and
``cuda.get_current_stream().ptr``; and ``empty(shape, dtype=float)``, whose arrays take
their memory from ``cuda.alloc`` and hold it (views share it): ``data``, ``nbytes``,
``shape``, ``dtype``, slicing. Arrays are never computed on; anything else of CuPy's is
absent, so code that needs more fails here rather than passing on a guess.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types

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


class UnownedMemory:
    """``UnownedMemory(ptr, size, owner, device_id=-1)``: memory that `owner` keeps alive."""

    def __init__(self, ptr, size, owner, device_id=-1):
        self.ptr, self.size, self.owner, self.device_id = int(ptr), int(size), owner, int(device_id)


class MemoryPointer:
    """``MemoryPointer(mem, offset)``: a place in `mem`, which it holds."""

    def __init__(self, mem, offset):
        self.mem, self.ptr, self.device_id = mem, mem.ptr + offset, mem.device_id


def _malloc(size):
    """The raw allocator (CuPy's ``memory._malloc``), here host memory."""
    buf = ctypes.create_string_buffer(max(size, 1))
    return MemoryPointer(UnownedMemory(ctypes.addressof(buf), size, buf, runtime.getDevice()), 0)


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


runtime = types.SimpleNamespace(getDevice=lambda: 0)
_null_stream = types.SimpleNamespace(ptr=0)


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
    MemoryPointer=MemoryPointer, UnownedMemory=UnownedMemory, runtime=runtime,
    get_current_stream=lambda: _null_stream, memory=types.SimpleNamespace(OutOfMemoryError=OutOfMemoryError),
)  # fmt: skip
