"""Checks of a device's inputs that its kernels make, read on the host without waiting.

A kernel that finds a bad input (a label or an index out of range) writes a small flag
array on the device, and poisons its output with NaN so that nothing computed from it is
a finite wrong value. Reading the flag at once would wait for every kernel queued before
it: a host synchronisation per call. Instead each flag is registered with a CUDA event
recorded after its kernels, and `DeferredChecks.raise_found` reads only the flags whose
event has completed (``event.done`` does not wait), on a stream of their own that does
not wait for the device's other work, and raises the first problem found. The callers
call it at their next call: a bad input raises there, one call late.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Callable

__all__ = ["DeferredChecks", "outside"]


class DeferredChecks:
    """Flags written by kernels, each with the function that raises for its values.

    >>> checks = DeferredChecks()
    >>> checks.raise_found(xp)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Any, Any, Callable[[list[int]], None]]] = []  # (event, flag, report)
        self._streams: dict[int, Any] = {}  # device id -> a stream that does not wait for the others
        self._lock = threading.Lock()  # calls from several threads take each flag once
        # The last flags, unread, are dropped while the allocator that served them lives.
        atexit.register(self._pending.clear)

    def add(self, xp: Any, flag: Any, report: Callable[[list[int]], None]) -> None:
        """Registers `flag` (a device array written by the kernels just launched);
        ``report(values)`` raises if its values say so."""
        event = xp.cuda.Event(disable_timing=True)
        event.record()
        with self._lock:
            self._pending.append((event, flag, report))

    def raise_found(self, xp: Any) -> None:
        """Reads the flags of the current device whose kernels have run and raises the
        first problem found among them."""
        device = xp.cuda.runtime.getDevice()
        with self._lock:
            ready, waiting = [], []
            for entry in self._pending:
                (ready if entry[0].done and entry[1].device.id == device else waiting).append(entry)
            self._pending[:] = waiting
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = xp.cuda.Stream(non_blocking=True)
        found = [([int(v) for v in flag.get(stream=stream)], report) for _, flag, report in ready]
        for values, report in found:
            report(values)


def outside(count: int, lowest: int, highest: int, end: int) -> str:
    """How `count` values fell outside ``[0, end)``: the extremes a kernel recorded (the
    lowest of the negative ones, else 0; the highest of those >= end, else 0).

    >>> outside(2, -1, 9, 5)
    'got 2 outside it (as low as -1 and as high as 9)'
    """
    extremes = [f"as low as {lowest}" if lowest < 0 else "", f"as high as {highest}" if highest >= end else ""]
    return f"got {count} outside it ({' and '.join(e for e in extremes if e)})"
