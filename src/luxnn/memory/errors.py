"""What the allocator says when it cannot serve a request, and how it words bytes.

The C core refuses a request by returning NULL (NumPy's handler) or raising a bare
`MemoryError` (a CuPy block), and records why, per thread (`last_failure`): over the
cache's limit, or the system or the device out of memory even after the cache released
its whole free blocks. The front ends (`luxnn.memory.frontend`) turn that record into their
library's error: `CacheMemoryError` for NumPy, CuPy's own ``OutOfMemoryError`` (also a
`CacheMemoryError`) for CuPy, both worded by `failure_message`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from . import _core

__all__ = [
    "CacheMemoryError", "Failure", "cupy_out_of_memory_error", "failure_count", "failure_message", "format_bytes",
    "last_failure",
]  # fmt: skip

# The CUDA driver's CUDA_ERROR_OUT_OF_MEMORY; any other driver error is named in the message.
_CUDA_ERROR_OUT_OF_MEMORY = 2


class CacheMemoryError(MemoryError):
    """A request the cache could not serve: over its limit, or out of memory upstream."""


class Failure(NamedTuple):
    """The core's record of the last request it refused in this thread.

    seq: which refusal (they are numbered per thread); over_limit: refused as larger than
    the limit (else: upstream out of memory); request: its bytes; limit: the cache's limit
    (0: none); figures: the cache's figures when it refused (``CacheStats`` fields);
    upstream_error: the CUDA driver's error code (0 for host memory, -1 for a device core
    never bound).
    """

    seq: int
    over_limit: bool
    request: int
    limit: int
    figures: Any
    upstream_error: int


def last_failure() -> Failure | None:
    """This thread's last refused request, of any cache (None: none yet).

    >>> last_failure() is None or isinstance(last_failure(), Failure)
    True
    """
    failure = _core.last_failure()
    return None if failure is None else Failure._make(failure)


def failure_count() -> int:
    """How many requests of any cache this thread has been refused (`Failure.seq` of the
    last): compare before and after to know whether a refusal happened in between."""
    failure = _core.last_failure()
    return 0 if failure is None else failure[0]


def format_bytes(n: int) -> str:
    """`n` bytes for people, in binary units.

    >>> format_bytes(100), format_bytes(3 << 20), format_bytes(5 << 40)
    ('100 B', '3.0 MiB', '5120.0 GiB')
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def failure_message(failure: Failure) -> str:
    """Why `failure`'s request was refused, with the cache's figures at the time."""
    figures = failure.figures
    asked = f"{format_bytes(failure.request)} ({failure.request} bytes)"
    if failure.over_limit:
        head = (
            f"AllocCache cannot allocate {asked}: the request is larger than the cache's "
            f"limit of {format_bytes(failure.limit)} ({failure.limit} bytes); raise the limit or allocate "
            "it inside memory.uncached()"
        )
    else:
        head = f"AllocCache is out of memory allocating {asked}, even after releasing its whole free blocks"
    message = (
        f"{head}. Cache figures: live {format_bytes(figures.bytes_live)}, cached {format_bytes(figures.bytes_cached)}, "
        f"reserved {format_bytes(figures.bytes_reserved)}, peak live {format_bytes(figures.peak_live)}, "
        f"peak reserved {format_bytes(figures.peak_reserved)}."
    )
    if failure.upstream_error not in (0, _CUDA_ERROR_OUT_OF_MEMORY):
        message += f" The CUDA driver returned error {failure.upstream_error} (not out of memory)."
    return message


_cupy_out_of_memory_type: type | None = None


def cupy_out_of_memory_error(size: int, failure: Failure | None, reserved: int, limit: int) -> MemoryError:
    """CuPy's ``OutOfMemoryError(size, total, limit)`` for a request of `size` bytes, which
    is also a `CacheMemoryError` (so that `cached` passes it on unchanged): CuPy's message
    followed by `failure_message`. Imports CuPy."""
    global _cupy_out_of_memory_type
    if _cupy_out_of_memory_type is None:
        import cupy

        _cupy_out_of_memory_type = type(
            "CacheOutOfMemoryError", (cupy.cuda.memory.OutOfMemoryError, CacheMemoryError),
            {"__module__": __name__, "__doc__": "CuPy's OutOfMemoryError, raised by an AllocCache."},
        )  # fmt: skip
    err = _cupy_out_of_memory_type(size, reserved, limit)
    message = "" if failure is None else failure_message(failure)
    err.args = (f"{err.args[0] if err.args else ''} {message}".strip(),)
    return err
