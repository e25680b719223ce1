"""Other processes competing for the cores while a row is timed.

``busy_processes(n)`` runs `n` Python processes that spin on a core each for as long as
the context is open, each confirmed running before the body starts and ended (SIGKILL,
then waited for) when it closes, whatever the body raised; a process whose parent is gone
(the bench killed) ends by itself. Rows with ``busy`` set
(`suite.Variant`) are calibrated and timed inside it: a step beside other work, as on a
shared machine, next to the same step timed quiet.

>>> with busy_processes(1) as pids:
...     len(pids)
1
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

SPIN = "import os, sys; parent = os.getppid(); sys.stdout.write('.'); sys.stdout.flush()\nwhile os.getppid() == parent: pass"
"""A busy process: says it runs, then spins as long as its parent lives."""


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[int]]:
    """`count` spinning processes while the context is open; yields their pids."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-S", "-c", SPIN], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE))
        for proc in procs:
            if proc.stdout.read(1) != b".":
                raise RuntimeError(f"busy_processes: process {proc.pid} ended before it ran (exit code {proc.wait()})")
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
            proc.stdout.close()
