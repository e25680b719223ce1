"""Waiting for a forked child of a test: its exit code, or a kill when it hangs."""

import os
import signal
import time


def exit_code(pid: int, seconds: float) -> int | str:
    """The exit code of child `pid`, or ``"hung"`` (the child killed) when it has not exited
    `seconds` from now. The child is looked at again once the deadline has passed, so a
    parent kept off the CPU past the deadline (valgrind runs one thread at a time, and a
    busy thread of the parent's can hold it for minutes) still sees a child that finished.

    >>> pid = os.fork()
    >>> if pid == 0:
    ...     os._exit(3)
    >>> exit_code(pid, 30)
    3
    """
    deadline = time.monotonic() + seconds
    while True:
        late = time.monotonic() > deadline  # read before the look: a pause between them is the child's
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if late:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.005)
