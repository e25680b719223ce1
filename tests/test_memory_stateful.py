"""Random sequences of allocations, drops, nested scopes over two caches, trims and frees,
checked against a model of what the caches must hold."""

import os

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from luxnn import memory
from luxnn.memory import _core

MiB = 1 << 20
# Around the bin edges (512 B, 8 KiB, the mmap threshold at 4 MiB) and in between.
SIZES = [1, 100, 513, 8192, 8193, 70_000, 4 * MiB - 1, 4 * MiB, 5 * MiB + 3]


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.caches = [memory.AllocCache(evict_after=2), memory.AllocCache()]
        self.outside = _core.get_handler()
        self.scopes = []  # open scopes, innermost last: (scope, cache index or None)
        self.arrays = {}  # key -> (array, cache index or None, fill value)
        self.next_key = 0

    def routing(self):
        """The cache index new arrays come from, or None for NumPy's own allocator."""
        return self.scopes[-1][1] if self.scopes else None

    @rule(size=st.sampled_from(SIZES))
    def allocate(self, size):
        value = self.next_key % 251
        a = np.empty(size, np.uint8)
        a.fill(value)
        self.arrays[self.next_key] = (a, self.routing(), value)
        self.next_key += 1

    @rule(size=st.sampled_from(SIZES), count=st.integers(2, 4))
    def allocate_several(self, size, count):
        for _ in range(count):
            self.allocate(size)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def drop(self, data):
        key = data.draw(st.sampled_from(sorted(self.arrays)))
        del self.arrays[key]

    @precondition(lambda self: len(self.scopes) < 6)
    @rule(which=st.sampled_from([0, 1, None]))
    def enter(self, which):
        scope = memory.uncached() if which is None else memory.cached(self.caches[which])
        scope.__enter__()
        # uncached routes around every open cache: to NumPy's allocator
        self.scopes.append((scope, which))

    @precondition(lambda self: self.scopes)
    @rule()
    def exit(self):
        scope, _ = self.scopes.pop()
        scope.__exit__(None, None, None)

    @rule(which=st.sampled_from([0, 1]), keep=st.sampled_from([0, 512, 2 * MiB, 100 * MiB]))
    def trim(self, which, keep):
        cache = self.caches[which]
        before = cache.stats().bytes_cached
        released = cache.trim(keep)
        after = cache.stats().bytes_cached
        assert after <= keep and released == before - after

    @rule(which=st.sampled_from([0, 1]))
    def free(self, which):
        self.caches[which].free()
        assert self.caches[which].stats().bytes_cached == 0

    @invariant()
    def the_handler_is_the_innermost_scopes(self):
        which = self.routing()
        expected = self.outside if which is None else self.caches[which]._numpy_handler
        assert _core.get_handler() is expected

    @invariant()
    def figures_match_the_model(self):
        for index, cache in enumerate(self.caches):
            s = cache.stats()
            live = sum(memory.bin_size(a.nbytes) for a, c, _ in self.arrays.values() if c == index)
            assert s.bytes_live == live
            assert s.bytes_reserved == s.bytes_live + s.bytes_cached
            assert s.bytes_cached >= 0
            assert s.peak_live >= s.bytes_live and s.peak_reserved >= s.bytes_reserved
            assert s.peak_reserved >= s.peak_live
            assert s.upstream_allocs >= s.upstream_frees
            assert s.hits + s.misses >= s.upstream_allocs
            cache._core.audit()  # records, free lists, LRU ring and figures agree

    @invariant()
    def live_arrays_never_share_memory_and_keep_their_values(self):
        spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a, _, _ in self.arrays.values())
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
        for a, _, value in self.arrays.values():
            assert a[0] == value and a[-1] == value

    def teardown(self):
        while self.scopes:
            self.exit()
        assert _core.get_handler() is self.outside
        self.arrays.clear()
        for cache in self.caches:
            assert cache.stats().bytes_live == 0


# Under valgrind (scripts/memcheck.sh) an example is ~50x slower: fewer of them there.
EXAMPLES = 12 if os.environ.get("LUXNN_MEMCHECK") else 60
CacheMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None)
TestCache = CacheMachine.TestCase
