"""How many of this process's cores other processes left free, measured every ~100 ms.

`Contention.free_cores()` is the cores of the process's CPU set (``sched_getaffinity``)
less the time that anything else ran on them (other processes, the kernel, a virtual
machine's neighbours as steal time), over the last window of at least `WINDOW_S`: the
CPU time of those cores from ``/proc/stat`` minus this process's own. Asked more often,
it answers the last window's figure, one clock read and one comparison. This process's
own CPU time is left out, so that what its threads do (the BLAS on one thread or on
several) does not change the answer. Where ``/proc/stat`` cannot be read it answers 0, as
before a first window has passed.

>>> contention = Contention(clock=iter([0.0, 0.2]).__next__, read=iter([(10.0, 1.0), (10.3, 1.1)]).__next__, cores=2)
>>> contention.free_cores()  # no window yet
0.0
>>> round(contention.free_cores(), 2)  # 0.3 s of the cores' time in 0.2 s, 0.1 s of it this process's
1.0
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

WINDOW_S = 0.1
"""The shortest window a figure is measured over."""

_TICKS_PER_S = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _affinity() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def read_cpu_seconds(cpus: set[int] | None = None, stat: str = "/proc/stat") -> tuple[float, float]:
    """``(busy, own)``: the seconds the CPUs `cpus` (default: this process's) ran anything
    since boot, and this process's CPU seconds. Raises OSError where `stat` cannot be read."""
    cpus = _affinity() if cpus is None else cpus
    own = time.process_time()
    with open(stat, "rb") as file:
        lines = file.read().split(b"\n")
    ticks = 0
    for line in lines:
        if line.startswith(b"cpu") and line[3:4].isdigit():
            name, *fields = line.split()
            if int(name[3:]) in cpus:
                # user nice system idle iowait irq softirq steal: all but idle and iowait
                values = [int(field) for field in fields[:8]]
                ticks += sum(values) - values[3] - values[4]
    return ticks / _TICKS_PER_S, own


class Contention:
    """The free cores of `cores` (default: the process's CPU set), from ``read() -> (busy,
    own)`` seconds (`read_cpu_seconds`) sampled at ``clock()`` seconds at most every
    `WINDOW_S`. Thread-safe without a lock: its state is one tuple, replaced in one
    assignment, so threads that sample at once each measure a whole window from the same
    sample, and an interrupt leaves the state as it was."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[], tuple[float, float]] = read_cpu_seconds,
        cores: int | None = None,
    ) -> None:
        self._clock, self._read = clock, read
        self.cores = len(_affinity()) if cores is None else cores
        self.reset()

    def reset(self) -> None:
        """Forget the last sample (a forked child's CPU time starts again from 0)."""
        # (next sample's time, free cores, last sample (when, busy, own) or None)
        self._state: tuple[float, float, tuple[float, float, float] | None] = (float("-inf"), 0.0, None)

    def free_cores(self) -> float:
        """The cores no other work ran on over the last window, 0 to `cores`."""
        now = self._clock()
        due, free, before = self._state
        if now < due:
            return free
        try:
            busy, own = self._read()
        except (OSError, ValueError):  # no /proc/stat (not Linux, a sandbox): as if busy
            self._state = (now + WINDOW_S, 0.0, None)
            return 0.0
        if before is not None and now > before[0]:
            others = (busy - before[1]) - (own - before[2])
            free = min(max(self.cores - others / (now - before[0]), 0.0), float(self.cores))
        self._state = (now + WINDOW_S, free, (now, busy, own))
        return free
