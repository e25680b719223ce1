"""Whether this thread is capturing a training step as a CUDA graph, and what the code of
a step does about it (the runner is `luxnn.graphs`).

A captured step is replayed without its Python: the GPU runs the kernels it recorded,
with the arguments they had. A value the host computes anew at each step (a schedule's
learning rate at the step count, a dropout seed drawn from a generator) would be
replayed as captured, so code that makes one calls `host_value`, which raises
`NotCapturable` during a capture: the runner then runs that step eagerly and says why.

Code that must act at every replay registers it while capturing: `before_launch(fn)`
runs ``fn()`` before each launch of the graph, `after_launch(fn)` after it (the labels'
device checks read the flags of the last launch before, and register the new ones after).

>>> from luxnn import capturing
>>> capturing.active() is None
True
>>> capturing.host_value("a learning-rate schedule")   # not capturing: nothing happens
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

__all__ = ["NotCapturable", "Capture", "active", "capture", "host_value", "keep", "before_launch", "after_launch"]


class NotCapturable(RuntimeError):
    """A step did something that its replay could not repeat; the message says what."""


class Capture:
    """What was registered while capturing one step: the functions run `before` and
    `after` each launch of its graph, and what the graph keeps alive (`kept`: the device
    arrays they use, and what `keep` was given)."""

    def __init__(self) -> None:
        self.before: list[Callable[[], None]] = []
        self.after: list[Callable[[], None]] = []
        self.kept: list[Any] = []


_state = threading.local()


def active() -> Capture | None:
    """The capture this thread is in, or None."""
    return getattr(_state, "capture", None)


@contextlib.contextmanager
def capture() -> Iterator[Capture]:
    """A capture of this thread, for the code it runs (`luxnn.graphs` opens it around the
    step it records on the device). Captures do not nest."""
    if active() is not None:
        raise RuntimeError("a step is already being captured in this thread")
    _state.capture = recorded = Capture()
    try:
        yield recorded
    finally:
        _state.capture = None


def host_value(what: str) -> None:
    """Raises `NotCapturable` while capturing: the caller is about to compute `what` on the
    host, a value that changes from step to step and that a replay would repeat."""
    if active() is not None:
        raise NotCapturable(f"{what} is computed on the host at every step, and a replay would repeat the captured one")


def keep(*objects: Any) -> bool:
    """Keeps `objects` (device memory that the graph being captured addresses, made outside
    the step: a pointer table, a library's workspace) alive as long as the graph; False
    (and nothing kept) when not capturing."""
    recorded = active()
    if recorded is not None:
        recorded.kept.extend(objects)
    return recorded is not None


def before_launch(fn: Callable[[], None]) -> bool:
    """Runs ``fn()`` before every launch of the graph being captured; False (and nothing
    registered) when not capturing."""
    recorded = active()
    if recorded is not None:
        recorded.before.append(fn)
    return recorded is not None


def after_launch(fn: Callable[[], None], *arrays: Any) -> bool:
    """Runs ``fn()`` after every launch of the graph being captured (the first, which does
    the captured step, included); `arrays`: the device arrays of the capture that `fn`
    reads, kept with the graph. False (and nothing registered) when not capturing."""
    recorded = active()
    if recorded is not None:
        recorded.after.append(fn)
        recorded.kept.extend(arrays)
    return recorded is not None
