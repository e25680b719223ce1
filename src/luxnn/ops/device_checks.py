"""Checks of a device's inputs that its kernels make, read on the host without waiting.

A kernel that finds a bad input (a label or an index out of range) writes a small flag
array on the device, and poisons its output with NaN so that nothing computed from it is
a finite wrong value. Reading the flag at once would wait for every kernel queued before
it: a host synchronisation per call. Instead each flag is registered with a CUDA event
recorded after its kernels, and `DeferredChecks.raise_found` reads only the flags whose
event has completed (``event.done`` does not wait), on a stream of their own that does
not wait for the device's other work, and raises the first problem found. The callers
call it at their next call: a bad input raises there, one or more calls late, and the
error says which call it was found in. That call was computed all the same: its output
NaN, and a training step's in-place update applied with it.

`check_now` reads every flag still pending, waiting for their kernels: call it where the
host waits for the device anyway (at the end of an epoch, before saving a checkpoint) to
raise there rather than at a later call.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import numpy as np

from .. import capturing, memory

__all__ = ["DeferredChecks", "check_now", "outside"]

# A report: ``report(values, when)`` raises if the flag's values say so; `when` names the
# call that set it ("in the previous call").
Report = Callable[[list[int], str], None]


class _Flag(NamedTuple):
    event: Any  # recorded after the kernels that write the flag
    flag: Any  # the device array
    report: Report
    owner: str
    number: int  # the owner's calls on the device, this one included


class DeferredChecks:
    """Flags written by kernels, each with the function that raises for its values, and
    the count of each owner's calls.

    >>> checks = DeferredChecks()
    >>> checks.raise_found(xp)  # doctest: +SKIP
    """

    def __init__(self) -> None:
        self._reset()
        _EVERY.add(self)

    def _reset(self) -> None:
        self._pending: list[_Flag] = []
        self._streams: dict[int, Any] = {}  # device id -> a stream that does not wait for the others
        self._calls: collections.Counter = collections.Counter()  # owner -> calls registered
        self._lock = threading.Lock()  # calls from several threads take each flag once

    @staticmethod
    def flag(xp: Any, n: int) -> Any:
        """A zeroed flag of `n` int64 for the kernels of one call, made outside the allocator
        cache: a captured step's graph keeps its flags, and kept in the cache's plan one
        would hold a place that the plan gives other blocks in later steps (and a step
        whose flags the cache serves in one run and not in another would not be planned
        alike)."""
        with memory.uncached():
            return xp.zeros(n, np.int64)

    def add(self, xp: Any, flag: Any, report: Report, owner: str) -> None:
        """Registers `flag` (a device array written by the kernels just launched for a call
        of `owner`); ``report(values, when)`` raises if its values say so. While a step is
        captured (`luxnn.capturing`), it is registered after each launch of the graph
        instead: an event recorded in a capture could not be queried."""
        if capturing.after_launch(lambda: self.add(xp, flag, report, owner), flag):
            return
        event = xp.cuda.Event(disable_timing=True)
        event.record()
        with self._lock:
            self._calls[owner] += 1
            self._pending.append(_Flag(event, flag, report, owner, self._calls[owner]))

    def raise_found(self, xp: Any, caller: str) -> None:
        """Reads the flags of the current device whose kernels have run and raises the
        first problem found among them. Called at the start of a call of `caller` (an
        owner); while a step is captured, also before each launch of its graph."""
        capturing.before_launch(lambda: self.raise_found(xp, caller))
        device = xp.cuda.runtime.getDevice()
        with self._lock:
            ready = self._take(lambda entry: entry.event.done and entry.flag.device.id == device)
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = xp.cuda.Stream(non_blocking=True)
        self._report([(entry, entry.flag.get(stream=stream)) for entry in ready], caller)

    def wait_and_raise(self) -> None:
        """Waits for the kernels of every pending flag, reads them and raises the first
        problem found (`check_now` does it for every DeferredChecks)."""
        with self._lock:
            pending = self._take(lambda entry: True)
        for entry in pending:
            entry.event.synchronize()
        self._report([(entry, entry.flag.get()) for entry in pending], None)

    def _take(self, taken: Callable[[_Flag], bool]) -> list[_Flag]:
        kept, left = [], []
        for entry in self._pending:
            (kept if taken(entry) else left).append(entry)
        self._pending[:] = left
        return kept

    def _report(self, read: list, caller: str | None) -> None:
        for entry, values in read:
            later = self._calls[entry.owner] - entry.number  # the owner's calls since
            if entry.owner == caller:  # the call being made is one more
                when = "in the previous call" if later == 0 else f"in the call {later + 1} calls before this one"
            else:
                when = "in its last call" if later == 0 else f"in its call {later} calls before its last"
            entry.report([int(v) for v in values], when)


_EVERY: "weakref.WeakSet[DeferredChecks]" = weakref.WeakSet()


def check_now() -> None:
    """Waits for the device's kernels that checked inputs (labels, indices) and raises
    the first problem they found; the flags read are then done with. A host
    synchronisation: call it where the host waits anyway, e.g. once per epoch.

    >>> import luxnn.ops.device_checks as device_checks
    >>> device_checks.check_now()  # nothing pending: returns
    """
    for checks in list(_EVERY):
        checks.wait_and_raise()


def _report_at_exit() -> None:
    # The last calls' flags: read, so that a bad label in the last batch is not lost (a
    # warning: an exit cannot raise), then dropped while the allocator that served them
    # lives. A device already gone leaves them unread.
    try:
        check_now()
    except ValueError as err:
        warnings.warn(f"luxnn: at exit, {err}", RuntimeWarning, stacklevel=1)
    except Exception:  # noqa: BLE001 - the CUDA context may be gone at exit
        pass
    for checks in list(_EVERY):
        checks._pending.clear()


def _forget_in_child() -> None:
    # A forked child has no CUDA context of its parent's: its events, flags and streams are
    # not its own, and another thread may have held a lock at the fork.
    for checks in list(_EVERY):
        checks._reset()


atexit.register(_report_at_exit)
os.register_at_fork(after_in_child=_forget_in_child)


def outside(count: int, lowest: int, highest: int, end: int) -> str:
    """How `count` values fell outside ``[0, end)``: the extremes a kernel recorded (the
    lowest of the negative ones, else 0; the highest of those >= end, else 0).

    >>> outside(2, -1, 9, 5)
    'got 2 outside it (as low as -1 and as high as 9)'
    """
    extremes = [f"as low as {lowest}" if lowest < 0 else "", f"as high as {highest}" if highest >= end else ""]
    return f"got {count} outside it ({' and '.join(e for e in extremes if e)})"
