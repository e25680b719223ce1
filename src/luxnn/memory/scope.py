"""`cached(cache)` and `uncached()`: which allocator NumPy uses, per thread and per task,
and which allocator CuPy uses, per thread.

NumPy keeps its current data allocator (a NEP 49 handler) in a context variable, so
setting it affects only the current thread, or the current asyncio task. A scope sets the
handler on entry and puts back exactly the handler it replaced on exit, also when the body
raises. A cache on a `CUDADevice` routes CuPy's allocations instead, through CuPy's
thread-local allocator hook (`luxnn.memory.cupy_backend`), restored the same way; CuPy
keeps that hook per thread, not per asyncio task.

Out of memory. A NEP 49 handler can only return NULL, and NumPy then raises its own
`MemoryError` ("Unable to allocate ..."). The core records why a request failed (over the
limit, or the system out of memory even after the cache released its whole free blocks), per
thread; when such a `MemoryError` leaves a scope, the scope raises `CacheMemoryError`
instead, which names the request, the limit and the cache's figures, chained to NumPy's
error. Code that catches the `MemoryError` inside the scope sees NumPy's message; the
figures are in ``cache.stats()``.
"""

from __future__ import annotations

import functools
import inspect
import warnings
from contextvars import ContextVar
from typing import Any, Callable, TypeVar

from . import _core
from .cache import AllocCache, ScopeStats, format_bytes

# NumPy's error for an array it could not allocate (a private name; NumPy >= 2.0 is required).
from numpy._core._exceptions import _ArrayMemoryError

__all__ = ["cached", "step", "uncached", "Scope", "UncachedScope", "CacheMemoryError"]

F = TypeVar("F", bound=Callable[..., Any])

# The handler in effect outside every luxnn scope of this context (None: not in one), for
# `uncached` to route around all the caches that are open; likewise CuPy's allocator.
_outside_handler: ContextVar[Any] = ContextVar("luxnn_memory_outside_handler", default=None)
_outside_cupy: ContextVar[Any] = ContextVar("luxnn_memory_outside_cupy", default=None)


# The core's figures that a scope counts from its entry to its exit.
_COUNTED = ("hits", "misses", "upstream_allocs", "upstream_frees", "scopes")


class CacheMemoryError(MemoryError):
    """A request the cache could not serve: over its limit, or out of memory upstream."""


def _failure_message(failure: tuple) -> str:
    _seq, over_limit, request, limit, figures, _upstream_error = failure
    live, cached, reserved = figures.bytes_live, figures.bytes_cached, figures.bytes_reserved
    peak_live, peak_reserved = figures.peak_live, figures.peak_reserved
    asked = f"{format_bytes(request)} ({request} bytes)"
    if over_limit:
        head = (
            f"AllocCache cannot allocate {asked}: the request is larger than the cache's "
            f"limit of {format_bytes(limit)} ({limit} bytes); raise the limit or allocate "
            "it inside memory.uncached()"
        )
    else:
        head = (
            f"AllocCache is out of memory allocating {asked}, even after releasing its "
            "whole free blocks"
        )
    return (
        f"{head}. Cache figures: live {format_bytes(live)}, cached {format_bytes(cached)}, "
        f"reserved {format_bytes(reserved)}, peak live {format_bytes(peak_live)}, "
        f"peak reserved {format_bytes(peak_reserved)}."
    )


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
        self.stats: ScopeStats | None = None
        self._begins, self._ends = begins, ends
        self._open: tuple | None = None  # what exit undoes, while open

    def _fresh(self) -> Scope:
        return Scope(self.cache, begins=self._begins, ends=self._ends)

    def __enter__(self) -> Scope:
        if self._open is not None:
            raise RuntimeError("this scope is already open; enter a new cached(cache)")
        if self.cache is None:
            self._open = ()
            return self
        core = self.cache._core
        if self._begins:
            _plan(self.cache)
            core.step_begin()
        if self.cache._cupy is not None:
            return self._enter_cupy(core)
        failure = _core.last_failure()
        before = core.stats()
        slot = core.scope_enter()
        previous = _core.set_handler(self.cache._numpy_handler)
        outside = _outside_handler.get()
        token = _outside_handler.set(previous if outside is None else outside)
        self._open = (failure, before, slot, previous, token)
        return self

    def _enter_cupy(self, core: Any) -> Scope:
        hook, previous = self.cache._cupy.scope()
        before = core.stats()
        slot = core.scope_enter()
        outside = _outside_cupy.get()
        token = _outside_cupy.set(previous if outside is None else outside)
        self._open = (None, before, slot, hook, token)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        opened, self._open = self._open, None
        if self.cache is None:
            return
        failure, before, slot, previous, token = opened
        core = self.cache._core
        # Closed in another context (a generator that yielded inside the scope, closed or
        # resumed elsewhere): the allocator of the context it opened in is not this one's to
        # change; the core's scope closes all the same.
        if _reset(_outside_handler if self.cache._cupy is None else _outside_cupy, token):
            if self.cache._cupy is not None:
                previous.__exit__(None, None, None)  # CuPy's hook: its allocator before the scope
            else:
                _core.set_handler(previous)
        if self._ends:
            core.step_end()
        peak_live, peak_reserved = core.scope_exit(slot)
        after = core.stats()
        change = {name: getattr(after, name) - getattr(before, name) for name in _COUNTED}
        self.stats = ScopeStats(
            **change, bytes_live_change=after.bytes_live - before.bytes_live,
            bytes_cached_change=after.bytes_cached - before.bytes_cached,
            bytes_reserved_change=after.bytes_reserved - before.bytes_reserved,
            peak_live=peak_live, peak_reserved=peak_reserved,
        )  # fmt: skip
        latest = _refused(exc, failure)
        if latest is not None:
            raise CacheMemoryError(_failure_message(latest)) from exc


def _reset(var: ContextVar[Any], token: Any) -> bool:
    """Undo a context variable's `token` if it was made in this context."""
    try:
        var.reset(token)
    except ValueError:  # made in another context
        return False
    return True


def _refused(exc: BaseException | None, before: tuple | None) -> tuple | None:
    """The core's record of the request whose refusal raised `exc`, if it did: NumPy's own
    error for an array of the bytes of a failure of this thread since `before` (a user's
    MemoryError, or NumPy's for another request, is left as it is)."""
    if not isinstance(exc, _ArrayMemoryError):
        return None
    latest = _core.last_failure()
    if latest is None or (before is not None and latest[0] == before[0]):
        return None
    return latest if latest[2] == max(int(getattr(exc, "_total_size", -1)), 1) else None


def _plan(cache: AllocCache) -> None:
    # Before a step begins: the cache's planner plans from the step that ended last, if no
    # step began since (luxnn.memory.plan). Plans only save memory: should planning fail,
    # the cache goes on without them.
    planner = cache._planner
    if planner is None:
        return
    try:
        planner.before_step(uncached)
    except Exception as err:  # noqa: BLE001 - any failure: no plans, said once
        if cache._planner is planner:
            cache._planner = None
            cache._core.drop_plan()
            warnings.warn(f"AllocCache stops planning steps after an error: {err!r}", RuntimeWarning, stacklevel=3)


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
        self._open: tuple | None = None

    def _fresh(self) -> UncachedScope:
        return UncachedScope()

    def __enter__(self) -> UncachedScope:
        if self._open is not None:
            raise RuntimeError("this scope is already open; enter a new uncached()")
        outside = _outside_handler.get()
        outside_cupy = _outside_cupy.get()
        hook = None
        if outside_cupy is not None:
            import cupy

            hook = cupy.cuda.using_allocator(outside_cupy)
            hook.__enter__()
        self._open = (None if outside is None else _core.set_handler(outside), hook)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        (previous, hook), self._open = self._open, None
        if previous is not None:
            _core.set_handler(previous)
        if hook is not None:
            hook.__exit__(None, None, None)


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
