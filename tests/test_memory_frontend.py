"""The front end protocol (`luxnn.memory.frontend`) and the allocator's errors
(`luxnn.memory.errors`): scopes ask every array library's front end the same things, so a
library the scopes never heard of is served by them as NumPy is.

The CuPy front end's own tests are in tests/test_memory_cuda.py.
"""

from __future__ import annotations

import asyncio
import contextvars

import numpy as np
import pytest

from luxnn import memory
from luxnn.memory import _core, errors
from luxnn.memory.frontend import FrontEnd, NumpyFrontEnd

MiB = 1 << 20

# A library of our own: its allocator is a name, kept per context as NumPy keeps its own.
_toy_allocator: contextvars.ContextVar[str] = contextvars.ContextVar("toy_allocator", default="toy default")


class ToyFrontEnd(FrontEnd):
    """The three things a library says, and a refusal of its own error type."""

    def __init__(self, name: str) -> None:
        self.name = name

    def _route(self):
        previous = _toy_allocator.get()
        return self._switch(f"{self.name} over {previous}"), previous

    @classmethod
    def _switch(cls, allocator):
        return _toy_allocator.set(allocator)

    @classmethod
    def _switch_back(cls, undo):
        _toy_allocator.reset(undo)

    def refusal(self, exc, installed):
        return ToyOutOfMemory(f"{self.name} refused it") if isinstance(exc, ToyRefused) else None


FrontEnd.kinds.remove(ToyFrontEnd)  # one of `uncached`'s kinds only in the tests that use it


class ToyRefused(MemoryError):
    pass


class ToyOutOfMemory(memory.CacheMemoryError):
    pass


@pytest.fixture
def toy_caches():
    """Two caches served through `ToyFrontEnd`, one of `uncached`'s kinds meanwhile."""
    FrontEnd.kinds.append(ToyFrontEnd)
    caches = []
    for name in ("a", "b"):
        cache = memory.AllocCache()
        cache.front_end = ToyFrontEnd(name)
        caches.append(cache)
    yield caches
    FrontEnd.kinds.remove(ToyFrontEnd)


def test_scopes_serve_any_front_end_by_the_protocol_alone(toy_caches):
    a, b = toy_caches
    with memory.cached(a) as outer:
        assert _toy_allocator.get() == "a over toy default"
        with memory.step(b):
            assert _toy_allocator.get() == "b over a over toy default"
            with memory.uncached():
                assert _toy_allocator.get() == "toy default"  # outside every scope
            assert _toy_allocator.get() == "b over a over toy default"
        assert _toy_allocator.get() == "a over toy default"
    assert _toy_allocator.get() == "toy default"
    assert outer.stats.scopes == a.stats().scopes == b.stats().scopes == 1


def test_a_front_ends_refusal_replaces_the_error_and_a_users_own_is_left(toy_caches):
    a, _ = toy_caches
    with pytest.raises(ToyOutOfMemory, match="a refused it") as info:
        with memory.cached(a):
            raise ToyRefused("the library's report")
    assert isinstance(info.value.__cause__, ToyRefused)
    with pytest.raises(MemoryError) as info:
        with memory.cached(a):
            raise MemoryError("the user's own")
    assert type(info.value) is MemoryError
    assert _toy_allocator.get() == "toy default"


def test_asyncio_tasks_install_front_ends_each_in_its_own_context(toy_caches):
    async def task(cache, name):
        with memory.cached(cache):
            for _ in range(5):
                await asyncio.sleep(0)  # the other task's scope is open meanwhile
                assert _toy_allocator.get() == f"{name} over toy default"

    async def main():
        await asyncio.gather(task(toy_caches[0], "a"), task(toy_caches[1], "b"))

    asyncio.run(main())
    assert _toy_allocator.get() == "toy default"


def test_a_scope_closed_in_another_context_leaves_this_contexts_allocator_alone():
    cache = memory.AllocCache()

    def batches():
        with memory.cached(cache):
            yield np.ones(10)

    suspended = batches()
    elsewhere = contextvars.copy_context()
    elsewhere.run(next, suspended)  # the scope opens in `elsewhere`
    assert elsewhere.run(_core.get_handler) is cache.front_end.handler
    before = _core.get_handler()
    inner = memory.AllocCache()
    with memory.cached(inner):
        suspended.close()  # and closes here, inside a scope of this context's own
        assert _core.get_handler() is inner.front_end.handler
    assert _core.get_handler() is before
    with memory.cached(cache) as scope:  # the core's scope closed all the same
        np.ones(10)
    assert scope.stats.scopes == 1 and cache.stats().scopes == 2
    cache._core.audit()


def test_a_scope_the_core_cannot_open_leaves_the_allocator_as_it_was(monkeypatch):
    cache = memory.AllocCache()
    before = _core.get_handler()

    def no_memory():
        raise MemoryError("the core has no room for a scope")

    monkeypatch.setattr(cache, "open_scope", no_memory)
    with pytest.raises(MemoryError, match="no room for a scope"):
        with memory.cached(cache):
            pass
    assert _core.get_handler() is before


def test_a_step_whose_front_end_cannot_install_begins_no_step(monkeypatch):
    cache = memory.AllocCache()
    begun = []

    def unbound():
        raise RuntimeError("no device for this cache")

    monkeypatch.setattr(cache.front_end, "install", unbound)
    monkeypatch.setattr(cache, "begin_step", begun.append)
    with pytest.raises(RuntimeError, match="no device"):
        with memory.step(cache):
            pass
    assert begun == []


def test_uncached_restores_every_library_when_its_body_raises():
    cache = memory.AllocCache()
    with memory.cached(cache):
        with pytest.raises(KeyError), memory.uncached():
            assert _core.get_handler() is not cache.front_end.handler
            raise KeyError("boom")
        assert _core.get_handler() is cache.front_end.handler


def test_numpy_is_always_a_kind_of_front_end():
    assert NumpyFrontEnd in FrontEnd.kinds and isinstance(memory.AllocCache().front_end, NumpyFrontEnd)


# ---- errors ----------------------------------------------------------------------------


def test_a_refusal_is_recorded_with_named_fields_and_counted():
    cache = memory.AllocCache(limit=MiB)
    count = errors.failure_count()
    with pytest.raises(memory.CacheMemoryError) as info:
        with memory.cached(cache):
            np.empty(2 * MiB, np.uint8)
    failure = errors.last_failure()
    assert errors.failure_count() == failure.seq == count + 1
    assert (failure.over_limit, failure.request, failure.limit, failure.upstream_error) == (True, 2 * MiB, MiB, 0)
    assert failure.figures.bytes_live == 0
    assert str(info.value) == errors.failure_message(failure)


def test_failure_messages_name_the_request_the_limit_the_figures_and_a_drivers_error():
    figures = memory.AllocCache().stats()  # the figures' fields, all 0
    over = errors.Failure(1, True, 3 * MiB, 2 * MiB, figures, 0)
    assert errors.failure_message(over).startswith(
        "AllocCache cannot allocate 3.0 MiB (3145728 bytes): the request is larger than the cache's limit of 2.0 MiB"
    )
    upstream = errors.Failure(2, False, 5 << 30, 0, figures, 0)
    text = errors.failure_message(upstream)
    assert "out of memory allocating 5.0 GiB" in text and "Cache figures: live 0 B" in text and "driver" not in text
    assert "error 2 " not in errors.failure_message(upstream._replace(upstream_error=2))  # CUDA's out of memory
    assert "The CUDA driver returned error 700 (not out of memory)." in errors.failure_message(
        upstream._replace(upstream_error=700)
    )


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"), (-2048, "-2.0 KiB"), (3 << 30, "3.0 GiB")],
)
def test_format_bytes(n, text):
    assert errors.format_bytes(n) == text
