"""Random sequences of allocations (small blocks fragmenting slabs among them), drops,
resizes, nested scopes over two caches (the second under a limit), trims,
frees and step plans (several at once, in any places, even ones whose places overlap), checked against a model of
what the caches must hold, and against the core's own record of its blocks, segments and
arenas (`Core.blocks`, `Core.audit`)."""

import os

import numpy as np
import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from luxnn import memory
from luxnn.memory.plan import PlanStatus
from luxnn.memory import _core

MiB = 1 << 20
SPLIT = _core.SPLIT_ABOVE  # blocks above this come from splitting free segments
# Around the bin edges (512 B, 8 KiB, the mmap threshold at 4 MiB), the split pool's threshold
# (the last exact-bin size and the first split one), and sizes that one larger free segment
# can serve several of, in between.
SIZES = [1, 100, 513, 8192, 8193, SPLIT, SPLIT + 1, 70_000, 300_000, MiB, 4 * MiB - 1, 4 * MiB, 5 * MiB + 3]
LARGE = [MiB, 4 * MiB, 5 * MiB + 3, 12 * MiB]
SMALL = [1, 100, 700, 1500, 4000, 8193, 30_000, SPLIT]  # from slabs; up to 1 KiB through quick lists
PLANNED = sorted({memory.bin_size(n) for n in (SPLIT + 1, 70_000, 300_000, MiB)})
LANED = sorted({memory.bin_size(n) for n in (100, 8192, 70_000, MiB)})  # a kernel lane's: any size
ARENA = 4 * MiB  # places at multiples of 256 KiB up to 1.75 MiB: every PLANNED size fits
LIMIT = 12 * MiB  # the second cache's: requests, arenas and their second chunks meet it


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.caches = [memory.AllocCache(evict_after=2), memory.AllocCache(limit=LIMIT)]
        self.outside = _core.get_handler()
        self.scopes = []  # open scopes, innermost last: (scope, cache index or None)
        self.arrays = {}  # key -> (array, cache index or None, fill value)
        self.next_key = 0
        self.refused = [0, 0]  # plans refused for want of room, per cache (their arenas came and went)

    @initialize(which=st.sampled_from([0, 1, None]))
    def start_in_a_scope(self, which):
        if which is not None:
            self.enter(which)

    def routing(self):
        """The cache index new arrays come from, or None for NumPy's own allocator."""
        return self.scopes[-1][1] if self.scopes else None

    @rule(size=st.sampled_from(SIZES))
    def allocate(self, size):
        self.make(size)

    def make(self, size) -> bool:
        """Whether the array was made (only the cache with a limit may refuse one)."""
        value = self.next_key % 251
        frees = [c.stats().upstream_frees for c in self.caches]
        try:
            a = np.empty(size, np.uint8)
        except MemoryError:
            assert self.routing() == 1
            event("a request over the limit")
            return False
        if [c.stats().upstream_frees for c in self.caches] != frees:  # no limit here: only this
            event("a miss consolidated whole free segments")
        a.fill(value)
        self.arrays[self.next_key] = (a, self.routing(), value)
        self.next_key += 1
        return True

    @rule(size=st.sampled_from(SIZES), count=st.integers(2, 4))
    def allocate_several(self, size, count):
        for _ in range(count):
            self.make(size)

    @rule(
        big=st.sampled_from(LARGE),
        smaller=st.lists(st.sampled_from([n for n in SIZES if n > SPLIT]), min_size=1, max_size=4),
    )  # fmt: skip
    def carve(self, big, smaller):
        # A large block dies, then smaller requests come: served by splitting its segment
        # (where a cache routes them), whatever else is free.
        if self.make(big):
            del self.arrays[self.next_key - 1]
        for size in smaller:
            self.make(size)

    @rule(sizes=st.lists(st.sampled_from(SMALL), min_size=3, max_size=12), then=st.sampled_from(SMALL))
    def fragment_slabs(self, sizes, then):
        # Small blocks side by side in a slab, every other one dies (quick blocks and free
        # pieces between live ones), then another size comes: a piece that fits, the quick
        # lists coalesced, or a new slab (where a cache routes them).
        first = self.next_key
        made = [self.make(size) for size in sizes]
        for key, ok in zip(range(first, first + len(sizes)), made):
            if ok and key % 2:
                del self.arrays[key]
        self.make(then)
        if any(c.stats().inactive_split_bytes for c in self.caches):
            event("free bytes between live blocks of a slab or segment")

    @rule(sizes=st.lists(st.sampled_from(LARGE[:-1]), min_size=2, max_size=3), then=st.sampled_from(LARGE))
    def consolidate(self, sizes, then):
        # Blocks die in separate segments, then a request larger than each comes: a miss
        # that gives them back and takes their bytes in one segment (where a cache routes it).
        made = sum(self.make(size) for size in sizes)
        for _ in range(made):
            del self.arrays[max(self.arrays)]
        self.make(then)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data())
    def drop(self, data):
        key = data.draw(st.sampled_from(sorted(self.arrays)))
        del self.arrays[key]

    @precondition(lambda self: len(self.scopes) < 6)
    @rule(which=st.sampled_from([0, 1, None]), marks=st.sampled_from(["none", "step", "begins", "ends"]))
    def enter(self, which, marks="none"):
        # A plain scope, or one of the training verbs' (a whole step, the first or the last
        # part of one: the step's marks may come in any order and nest any way).
        step = {"none": None, "step": (True, True), "begins": (True, False), "ends": (False, True)}[marks]
        if which is None:
            scope = memory.uncached()
        elif step is None:
            scope = memory.cached(self.caches[which])
        else:
            scope = memory.step(self.caches[which], begins=step[0], ends=step[1])
        scope.__enter__()
        # uncached routes around every open cache: to NumPy's allocator
        self.scopes.append((scope, which))

    @precondition(lambda self: self.scopes)
    @rule()
    def exit(self):
        scope, _ = self.scopes.pop()
        scope.__exit__(None, None, None)

    @precondition(lambda self: self.arrays)
    @rule(data=st.data(), size=st.sampled_from(SIZES))
    def resize(self, data, size):
        # Through the handler the array was made with (np_realloc), whatever the scope.
        key = data.draw(st.sampled_from(sorted(self.arrays)))
        a, which, value = self.arrays[key]
        try:
            a.resize(size, refcheck=False)
        except MemoryError:
            assert which == 1 and a[0] == value  # over the limit: the old block stays
            return
        assert a[0] == value  # the contents moved with the block
        a.fill(value)

    @rule(which=st.sampled_from([0, 1]), keep=st.sampled_from([0, 512, 2 * MiB, 100 * MiB]))
    def trim(self, which, keep):
        cache = self.caches[which]
        before = cache.stats().bytes_cached
        released = cache.trim(keep)
        after = cache.stats().bytes_cached
        assert released == before - after
        if after > keep:  # only free pieces of segments in use are left: they cannot go back
            assert not [b for b in cache._core.blocks() if not b[2] and whole(b)]

    @rule(
        which=st.sampled_from([0, 1]),
        place=st.integers(0, _core.MAX_PLANS - 1),
        slots=st.lists(
            st.tuples(st.sampled_from(PLANNED), st.integers(0, 7), st.integers(0, 7)), min_size=1, max_size=8,
        ),
        laned=st.lists(
            st.tuples(st.integers(0, 1), st.sampled_from(LANED), st.integers(0, 7), st.integers(0, 7)), max_size=6,
        ),
        arena=st.sampled_from([ARENA, 3 * ARENA // 2]),
        cut=st.sampled_from([0, ARENA // 2, ARENA]),
        sequence=st.lists(st.sampled_from(PLANNED), max_size=4),
    )  # fmt: skip
    def install_a_plan(self, which, place, slots, laned, arena, cut, sequence):
        # Places that overlap, in one cycle or across the two parities, in any of the
        # plans the core keeps: the core serves a place only while all its bytes are free,
        # so live arrays still never share memory, whichever plan a step's first requests
        # (the plan's `sequence`, drawn from `a_cycle`'s sizes) choose, and whatever blocks
        # a step served by another plan left. With a cut, the arena comes in two chunks,
        # the second after the first cycle; a plan that grows the arena, or lies across its
        # cut, grows its second chunk or makes it one chunk where no block lives.
        # Lane slots (`a_kernel_cycle`'s first call, lanes 0 and 1).
        slots = sorted(slots) + [(size, e, o) for _, size, e, o in sorted(laned, key=lambda s: s[0])]
        lanes = [-1] * (len(slots) - len(laned)) + sorted(lane for lane, *_ in laned)
        core = self.caches[which]._core
        columns = [np.array(column, dtype=np.int64) for column in zip(*slots)]
        sizes, even, odd = columns[0], columns[1] << 18, columns[2] << 18
        lane = np.array(lanes, dtype=np.int64)
        options = dict(call=np.where(lane >= 0, 0, -1), lane=lane, cut=cut, sequence=np.array(sequence, dtype=np.int64))
        before = core.stats()
        if any(at < cut < at + n for n, e, o in zip(sizes, even, odd) for at in (e, o)):
            with pytest.raises(ValueError, match="straddle"):
                core.install_plan(place, arena, sizes, even, odd, **options)
            return
        status = core.install_plan(place, arena, sizes, even, odd, **options)
        if status == PlanStatus.LATER:  # the arena would change where a live block is
            assert before.plans > 0 and core.stats().plans == before.plans
            return
        if status == PlanStatus.NO_ROOM:  # over the limit (an arena replaced: the others dropped)
            assert which == 1 and core.stats().plans == before.plans
            self.refused[which] += 1
            return
        assert status == PlanStatus.INSTALLED and core.stats().plans == before.plans + 1
        event(f"a plan installed in place {place}")

    @precondition(lambda self: len(self.scopes) < 6)
    @rule(which=st.sampled_from([0, 1]), sizes=st.lists(st.sampled_from(PLANNED), min_size=1, max_size=6))
    def a_cycle(self, which, sizes):
        # A step of a cache none of whose scopes is open: a cycle, which its plan serves.
        if any(index == which for _, index in self.scopes):
            return
        before = self.caches[which].stats()
        self.enter(which, "step")
        made = [self.make(size) for size in sizes]
        if made[-1]:
            del self.arrays[self.next_key - 1]
        self.exit()
        after = self.caches[which].stats()
        if after.plan_hits > before.plan_hits and before.plans >= 2:
            event("a step served at planned places, one plan of several")

    @precondition(lambda self: len(self.scopes) < 6)
    @rule(
        which=st.sampled_from([0, 1]),
        shares=st.lists(st.lists(st.sampled_from(LANED), max_size=4), min_size=1, max_size=2),
        keep=st.booleans(),
    )  # fmt: skip
    def a_kernel_cycle(self, which, shares, keep):
        # A step whose first kernel call's shares make requests in their lanes (as
        # parallel.for_blocks's threads do, here one after the other); each share's last
        # array dies in its lane unless kept.
        if any(index == which for _, index in self.scopes):
            return
        hits = self.caches[which].stats().plan_hits
        self.enter(which, "step")
        call = _core.kernel_call()
        for lane, sizes in enumerate(shares):
            before = _core.enter_lane(call, lane)
            try:
                made = [self.make(size) for size in sizes]
                if made and made[-1] and not keep:
                    del self.arrays[self.next_key - 1]
            finally:
                _core.leave_lane(before)
        self.exit()
        if self.caches[which].stats().plan_hits > hits:
            event("a kernel step's request served at its planned place")

    @rule(which=st.sampled_from([0, 1]))
    def free(self, which):
        cache = self.caches[which]
        cache.free()
        blocks = cache._core.blocks()
        # What is left is in use, or a free piece of an orphan segment (or the free bytes of
        # a retired arena) that is: no block is free and whole, nothing left is reusable,
        # and the figures say so.
        assert all(b[5] for b in blocks) and not [b for b in blocks if not b[2] and whole(b)]
        held: dict = {}  # (base, bytes) of each segment or arena -> its live bytes
        for _, size, live, base, segment_size, _ in blocks:
            held[base, segment_size] = held.get((base, segment_size), 0) + (size if live else 0)
        assert cache.stats().bytes_cached == sum(total - live for (_, total), live in held.items())

    @invariant()
    def the_handler_is_the_innermost_scopes(self):
        which = self.routing()
        expected = self.outside if which is None else self.caches[which].front_end.handler
        assert _core.get_handler() is expected

    @invariant()
    def figures_match_the_model(self):
        for index, cache in enumerate(self.caches):
            s = cache.stats()
            live = sum(memory.bin_size(a.nbytes) for a, c, _ in self.arrays.values() if c == index)
            assert s.bytes_live == live
            assert s.bytes_reserved == s.bytes_live + s.bytes_cached
            assert s.bytes_cached >= 0
            assert 0 <= s.inactive_split_bytes <= s.bytes_cached  # fragmentation is cached bytes
            assert s.inactive_split_bytes == inactive_split(cache._core.blocks())
            assert s.peak_live >= s.bytes_live and s.peak_reserved >= s.bytes_reserved
            assert s.peak_reserved >= s.peak_live
            assert s.upstream_allocs >= s.upstream_frees
            plans = s.plans + self.refused[index]  # a plan: two chunks and an arena at most
            assert s.hits + s.misses + 3 * plans >= s.upstream_allocs
            cache._core.audit()  # records, free lists, LRU ring and figures agree

    @invariant()
    def the_live_blocks_are_the_arrays(self):
        for index, cache in enumerate(self.caches):
            blocks = cache._core.blocks()
            if any(not whole(b) for b in blocks):
                event("a segment split in pieces")  # how often (--hypothesis-show-statistics)
            if any(b[5] and not b[2] for b in blocks):
                event("a free piece of an orphan segment")
            if cache.stats().plan_hits:
                event("a block served at its planned place")
            live = sorted((b[0], b[1]) for b in blocks if b[2])
            arrays = sorted((a.ctypes.data, memory.bin_size(a.nbytes)) for a, c, _ in self.arrays.values() if c == index)
            assert live == arrays

    @invariant()
    def live_arrays_never_share_memory_and_keep_their_values(self):
        # A cached array holds its whole block (its size bin's bytes), a piece of a
        # segment or not: no two blocks in use, nor any other array, may overlap it.
        spans = sorted(
            (a.ctypes.data, a.ctypes.data + (a.nbytes if c is None else memory.bin_size(a.nbytes)))
            for a, c, _ in self.arrays.values()
        )  # fmt: skip
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start
        for a, c, value in self.arrays.values():
            assert a[0] == value and a[-1] == value
            assert c is None or a.ctypes.data % 64 == 0  # every block keeps 64-byte alignment

    def teardown(self):
        while self.scopes:
            self.exit()
        assert _core.get_handler() is self.outside
        self.arrays.clear()
        for cache in self.caches:
            assert cache.stats().bytes_live == 0


def inactive_split(blocks) -> int:
    """The free bytes of the slabs and segments that hold a live block, from `Core.blocks()`:
    a segment's pieces tile it (an arena's free bytes have no rows, and are not a pool's)."""
    groups: dict = {}
    for _, size, live, base, segment_size, _ in blocks:
        total, live_bytes, any_live = groups.get((base, segment_size), (0, 0, False))
        groups[base, segment_size] = (total + size, live_bytes + (size if live else 0), any_live or live)
    return sum(seg - live for (_, seg), (total, live, any_live) in groups.items() if total == seg and any_live)


def whole(block) -> bool:
    """Whether a `Core.blocks()` row is a whole upstream allocation (which alone can go back)."""
    ptr, size, _live, base, segment_size, _orphan = block
    return ptr == base and size == segment_size


# Under valgrind (scripts/memcheck.sh) an example is ~50x slower: fewer of them there.
# LUXNN_EXAMPLES=3000 for a long local hunt (about 90 s).
EXAMPLES = int(os.environ.get("LUXNN_EXAMPLES", "0")) or (12 if os.environ.get("LUXNN_MEMCHECK") else 60)
# derandomize: the same sequences on every run and machine (a failure is a bug, not luck).
CacheMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=40, deadline=None, derandomize=True)
TestCache = CacheMachine.TestCase
