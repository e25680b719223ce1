"""`cached(cache)` and `uncached()`: which allocator an array library uses, per context.

A scope installs the front end of its cache's array library (`luxnn.memory.frontend`) on
entry and puts back exactly the allocator it replaced on exit, also when the body raises:
NumPy keeps its allocator (a NEP 49 handler) in a context variable, so a NumPy scope
affects only the current thread, or the current asyncio task; a cache on a `CUDADevice`
routes CuPy's allocations through CuPy's thread-local allocator hook
(`luxnn.memory.cupy_backend`), which CuPy keeps per thread, not per asyncio task.

Out of memory. A NEP 49 handler can only return NULL, and NumPy then raises its own
`MemoryError` ("Unable to allocate ..."). The core records why a request failed (over the
limit, or the system out of memory even after the cache released its whole free blocks), per
thread; when such a `MemoryError` leaves a scope, the scope raises `CacheMemoryError`
instead, which names the request, the limit and the cache's figures, chained to NumPy's
error (`luxnn.memory.errors`). Code that catches the `MemoryError` inside the scope sees
NumPy's message; the figures are in ``cache.stats()``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

from . import frontend
from .cache import AllocCache, ScopeStats
from .errors import CacheMemoryError

__all__ = ["cached", "step", "uncached", "Scope", "UncachedScope", "CacheMemoryError"]

F = TypeVar("F", bound=Callable[..., Any])


class _Switch:
    """A context manager that can also decorate: each call of the decorated function
    runs in a fresh scope of the same kind."""

    def _fresh(self) -> _Switch:
        raise NotImplementedError

    def __call__(self, func: F) -> F:
        # A generator's or coroutine's body runs after the call returns, one resumption at a
        # time, in whatever context resumes it: a scope around the call would close first.
        if inspect.isgeneratorfunction(func) or inspect.iscoroutinefunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(
                f"{type(self).__name__} cannot decorate {func.__qualname__}, a generator or async "
                "function: its body runs after the call returns; open the scope inside it (with ...:)"
            )

        @functools.wraps(func)
        def in_scope(*args: Any, **kwargs: Any) -> Any:
            with self._fresh():
                return func(*args, **kwargs)

        return in_scope  # type: ignore[return-value]


class Scope(_Switch):
    """An open (or closed) `cached` scope; ``stats`` holds its `ScopeStats` after exit
    (None for ``cached(None)``). `begins` / `ends`: whether it begins and ends a training
    step (`step`)."""

    def __init__(self, cache: AllocCache | None, *, begins: bool = False, ends: bool = False) -> None:
        if cache is not None and not isinstance(cache, AllocCache):
            raise TypeError(f"cached() takes an AllocCache or None, got {cache!r}")
        self.cache = cache
        self._closed: ScopeStats | tuple | None = None  # the figures, once closed
        self._begins, self._ends = begins, ends
        self._open: tuple | None = None  # what exit undoes, while open

    def _fresh(self) -> Scope:
        return Scope(self.cache, begins=self._begins, ends=self._ends)

    @property
    def stats(self) -> ScopeStats | None:
        """The scope's `ScopeStats` once it closed (None before, and for ``cached(None)``)."""
        if isinstance(self._closed, tuple):  # made when first read
            self._closed = self.cache.scope_stats(self._closed)
        return self._closed

    def __enter__(self) -> Scope:
        if self._open is not None:
            raise RuntimeError("this scope is already open; enter a new cached(cache)")
        cache = self.cache
        if cache is None:
            self._open = ()
            return self
        installed = cache.front_end.install()  # may raise (a CuPy cache's device): nothing changed yet
        try:
            if self._begins:
                cache.begin_step(uncached)
            self._open = (installed, cache.open_scope())
        except BaseException:  # the core out of memory for a scope: the front end put back
            cache.front_end.restore(installed)
            raise
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        opened, self._open = self._open, None
        cache = self.cache
        if cache is None:
            return
        installed, scope = opened
        cache.front_end.restore(installed)
        if self._ends:
            cache.end_step()
        self._closed = cache.close_scope(scope)
        error = None if exc is None else cache.front_end.refusal(exc, installed)
        if error is not None:
            raise error from exc


def cached(cache: AllocCache | None) -> Scope:
    """A scope in which every NumPy array allocation of this thread (or asyncio task)
    comes from `cache`, or every CuPy allocation of this thread on the cache's device for
    a cache on a `CUDADevice`; ``cached(None)`` changes nothing. Also a decorator.

    Arrays may outlive the scope: their blocks return to the cache when they die.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> cache = memory.AllocCache()
    >>> with memory.cached(cache) as scope:
    ...     y = np.arange(1000.0) * 2
    >>> scope.stats.upstream_allocs > 0, cache.stats().bytes_live >= y.nbytes
    (True, True)
    >>> @memory.cached(cache)
    ... def step(x):
    ...     return x + 1
    """
    return Scope(cache)


def step(cache: AllocCache | None, *, begins: bool = True, ends: bool = True) -> Scope:
    """A `cached` scope that is a training step of the cache's (or, with ``ends=False``,
    its first part; with ``begins=False``, its last). The training verbs run in these
    (``compute_gradients`` begins a step, ``apply_gradients`` ends it, a
    ``single_train_step`` is one); a loop of steps is what the cache plans
    (`luxnn.memory.plan`). A step that begins while one is open ends that one first. Plain
    `cached` scopes, open or not, neither begin nor end a step.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> cache = memory.AllocCache()
    >>> for _ in range(4):
    ...     with memory.step(cache):
    ...         y = np.ones((256, 256)) * 2.0
    ...         del y
    >>> cache.stats().plan_hits > 0
    True
    """
    return Scope(cache, begins=begins, ends=ends)


class UncachedScope(_Switch):
    """An `uncached` scope."""

    def __init__(self) -> None:
        self._open: list | None = None

    def _fresh(self) -> UncachedScope:
        return UncachedScope()

    def __enter__(self) -> UncachedScope:
        if self._open is not None:
            raise RuntimeError("this scope is already open; enter a new uncached()")
        self._open = frontend.step_outside()
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        stepped, self._open = self._open, None
        frontend.step_back(stepped)


def uncached() -> UncachedScope:
    """A scope that allocates as if no `cached` scope were open (with NumPy's and CuPy's
    allocators of the surrounding code). Also a decorator.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> cache = memory.AllocCache()
    >>> with memory.cached(cache):
    ...     with memory.uncached():
    ...         big = np.zeros(1 << 20)
    >>> cache.stats().upstream_allocs
    0
    """
    return UncachedScope()
