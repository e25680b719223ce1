"""Front ends: how one array library's allocations reach an `AllocCache`'s C core.

A cache serves one array library through the front end it chooses when it is made:
`NumpyFrontEnd` (here) for host memory, the core's NEP 49 handler, which NumPy keeps in a
context variable, so per thread and per asyncio task; `CupyFrontEnd`
(`luxnn.memory.cupy_backend`) for a GPU, CuPy's allocator hook, which CuPy keeps per thread.
`cached` and `uncached` ask every front end the same things, so each has one code path:

- `FrontEnd.install`: route this context's allocations of the library to the cache, and
  give back what was there;
- `FrontEnd.restore`: put that back, in the context that installed (closed in another
  context, as a generator that yielded inside the scope may be, the scope leaves that
  context's allocator alone: it is not the scope's to change);
- `step_outside` / `step_back`: route this context's allocations of every library to its
  allocator outside every luxnn scope, for `uncached`, and back;
- `FrontEnd.refusal`: the library's `MemoryError` for a request the core refused
  (`luxnn.memory.errors`).

A library says how it routes its allocations to the cache (`_route`) and how it switches
allocators (`_switch`, `_switch_back`); the bookkeeping above is the same for all:
each front end class keeps, per context, its library's allocator outside every luxnn scope
(what the outermost scope replaced).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextvars import ContextVar
from typing import Any, ClassVar

from . import _core
from .errors import CacheMemoryError, failure_count, failure_message, last_failure

# NumPy's error for an array it could not allocate (a private name; NumPy >= 2.0 is required).
from numpy._core._exceptions import _ArrayMemoryError

__all__ = ["FrontEnd", "Installed", "NumpyFrontEnd", "step_back", "step_outside"]


# What `FrontEnd.install` gives back, for `FrontEnd.restore` and `FrontEnd.refusal`: what
# puts back the library's allocator that was there, the context's token of its record of the
# allocator outside every luxnn scope, and how many requests this thread had been refused
# (`failure_count`). A plain tuple: a scope's entry and exit cost stays the core's.
Installed = tuple[Any, Any, int]


class FrontEnd(ABC):
    """One array library's way into a cache's core (see the module's docstring)."""

    kinds: ClassVar[list[type[FrontEnd]]] = []  # every front end class, for `uncached`
    _outside: ClassVar[ContextVar[Any]]  # the library's allocator outside every luxnn scope

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._outside = ContextVar(f"luxnn_memory_outside_{cls.__name__}", default=None)
        FrontEnd.kinds.append(cls)

    # -- what each library says --------------------------------------------------------------

    @abstractmethod
    def _route(self) -> tuple[Any, Any]:
        """Make the cache's allocator the library's in this context; returns what
        `_switch_back` needs to put back the one it replaced, and that one."""

    @classmethod
    @abstractmethod
    def _switch(cls, allocator: Any) -> Any:
        """Make `allocator` the library's allocator in this context; returns what
        `_switch_back` needs to put back the one it replaced."""

    @classmethod
    @abstractmethod
    def _switch_back(cls, undo: Any) -> None:
        """Undo a `_route` or a `_switch`."""

    # -- what `cached` and `uncached` ask ------------------------------------------------------

    def install(self) -> Installed:
        """Route this context's allocations of the library to the cache."""
        undo, previous = self._route()
        outside = self._outside.get()
        return undo, self._outside.set(previous if outside is None else outside), failure_count()

    def restore(self, installed: Installed) -> None:
        """Put back the allocator that `install` replaced, if this is the context it ran in."""
        undo, outside, _ = installed
        try:
            self._outside.reset(outside)
        except ValueError:  # installed in another context
            return
        self._switch_back(undo)

    def refusal(self, exc: BaseException | None, installed: Installed) -> MemoryError | None:
        """The library's error to raise instead of `exc` as the scope closes, when `exc` is
        the library's report of a request the cache refused in the scope; else None (a
        user's own `MemoryError` is never relabelled)."""
        return None


class NumpyFrontEnd(FrontEnd):
    """NumPy's: the core's NEP 49 handler, in NumPy's context variable. Each array made
    through it holds the handler, which holds the core: memory outlives the cache while
    arrays use it.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> front = NumpyFrontEnd(memory._core.Core())
    >>> installed = front.install()
    >>> np._core.multiarray.get_handler_name()
    'luxnn_cache'
    >>> front.restore(installed)
    >>> np._core.multiarray.get_handler_name()
    'default_allocator'
    """

    def __init__(self, core: Any) -> None:
        self.handler = core.numpy_handler()

    def _route(self) -> tuple[Any, Any]:
        previous = _core.set_handler(self.handler)  # it serves every request
        return previous, previous

    @classmethod
    def _switch(cls, allocator: Any) -> Any:
        return _core.set_handler(allocator)  # the handler it replaced

    @classmethod
    def _switch_back(cls, undo: Any) -> None:
        _core.set_handler(undo)

    def refusal(self, exc: BaseException | None, installed: Installed) -> MemoryError | None:
        # A NEP 49 handler can only return NULL, and NumPy raises its own error ("Unable
        # to allocate ..."): the core's refusal is the one of this thread since the scope
        # opened, for the bytes NumPy's error names.
        if not isinstance(exc, _ArrayMemoryError):
            return None
        latest = last_failure()
        if latest is None or latest.seq == installed[2]:
            return None
        if latest.request != max(int(getattr(exc, "_total_size", -1)), 1):
            return None
        return CacheMemoryError(failure_message(latest))


def step_outside() -> list[tuple[type[FrontEnd], Any]]:
    """Route this context's allocations of every library to its allocator outside every
    luxnn scope (`uncached`); returns what `step_back` needs."""
    stepped = []
    for kind in FrontEnd.kinds:
        outside = kind._outside.get()
        if outside is not None:  # a scope of the library is open in this context
            stepped.append((kind, kind._switch(outside)))
    return stepped


def step_back(stepped: list[tuple[type[FrontEnd], Any]]) -> None:
    """Undo a `step_outside`."""
    for kind, undo in reversed(stepped):
        kind._switch_back(undo)
