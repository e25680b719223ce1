"""Small blocks (up to 64 KiB, csrc/pool.c "Small blocks"): cut from slabs that split and
coalesce, the smallest through quick lists; their fragmentation is `inactive_split_bytes`."""

import queue
import threading

import numpy as np

from luxnn import memory
from luxnn.memory import _core
from test_memory import run_threads  # threads whose errors fail the test

KiB, MiB = 1 << 10, 1 << 20
SLAB = _core.SLAB_MIN  # the first slab of a cache


def rows(cache) -> dict:
    """ptr -> (size, live, segment base, segment size) of every block the cache owns."""
    return {ptr: (size, live, base, seg) for ptr, size, live, base, seg, _ in cache._core.blocks()}


def test_small_blocks_of_several_sizes_share_one_slab():
    cache = memory.AllocCache()
    with memory.cached(cache):
        arrays = [np.empty(n, np.uint8) for n in (64, 700, 3000, 9000)]  # 13.5 KiB of blocks
    s = cache.stats()
    assert s.upstream_allocs == 1 and s.bytes_reserved == SLAB
    assert {rows(cache)[a.ctypes.data][2:] for a in arrays} == {(min(rows(cache)), SLAB)}
    del arrays
    cache._core.audit()


def test_freed_small_blocks_coalesce_and_serve_a_larger_size():
    cache = memory.AllocCache()
    with memory.cached(cache):
        blocks = [np.empty(4 * KiB, np.uint8) for _ in range(3)]  # side by side in the slab
        keep = np.empty(SLAB - 12 * KiB, np.uint8)  # after them: the three coalesce into one piece
        first = blocks[0].ctypes.data
        del blocks
        before = cache.stats()
        bigger = np.empty(12 * KiB, np.uint8)  # a size no block had: their bytes serve it
        after = cache.stats()
    assert bigger.ctypes.data == first
    assert (after.hits - before.hits, after.upstream_allocs) == (1, before.upstream_allocs)
    del bigger, keep
    cache._core.audit()
    assert [(size, live) for size, live, *_ in rows(cache).values()] == [(SLAB, False)]  # one piece


def test_the_smallest_blocks_wait_in_quick_lists_and_coalesce_when_a_miss_needs_them():
    cache = memory.AllocCache()
    with memory.cached(cache):
        tiny = [np.empty(8, np.uint8) for _ in range(SLAB // 512 - 1)]  # 512 B blocks
        last = np.empty(8, np.uint8)  # they fill the slab
        assert cache.stats().upstream_allocs == 1
        del tiny  # into their quick list, not coalesced
        ptr = last.ctypes.data
        del last
        assert len(rows(cache)) == SLAB // 512
        again = np.empty(8, np.uint8)  # the fast path: the block that died last
        assert again.ctypes.data == ptr
        del again
        before = cache.stats()
        whole = np.empty(SLAB, np.uint8)  # no free piece fits: the quick lists coalesce
    s = cache.stats()
    assert s.upstream_allocs == before.upstream_allocs and s.hits == before.hits + 1
    assert rows(cache) == {whole.ctypes.data: (SLAB, True, whole.ctypes.data, SLAB)}
    del whole
    cache._core.audit()


def test_inactive_split_bytes_are_the_free_bytes_of_slabs_and_segments_in_use():
    cache = memory.AllocCache(plan=False)
    with memory.cached(cache):
        small, gone = np.empty(512, np.uint8), np.empty(4 * KiB, np.uint8)
        del gone  # a free piece beside a live block of its slab
        assert cache.stats().inactive_split_bytes == SLAB - 512
        seg = np.empty(MiB, np.uint8)
        del seg
        large = np.empty(256 * KiB, np.uint8)  # a piece of the 1 MiB segment
        assert cache.stats().inactive_split_bytes == (SLAB - 512) + (MiB - 256 * KiB)  # one figure, both pools
        del small
        assert cache.stats().inactive_split_bytes == MiB - 256 * KiB  # a slab with no live block: not fragmentation
        cache._core.audit()
        del large
    assert cache.stats().inactive_split_bytes == 0
    cache._core.audit()


def test_slabs_grow_by_a_sixteenth_of_what_they_hold_up_to_the_largest():
    cache = memory.AllocCache()
    with memory.cached(cache):
        blocks = [np.empty(SLAB, np.uint8) for _ in range(2500)]  # 39 MiB; each slab holds whole ones
    segments = {}  # base -> size, in the order the slabs came
    for b in blocks:
        segments.setdefault(rows(cache)[b.ctypes.data][2], rows(cache)[b.ctypes.data][3])
    held, expected = 0, []
    while sum(expected) < len(blocks) * SLAB:  # the rule, as csrc/pool.c states it
        size = min(max(-(-(held // 16) // SLAB) * SLAB, SLAB), _core.SLAB_MAX)
        expected.append(size)
        held += size
    assert list(segments.values()) == expected and max(expected) == _core.SLAB_MAX
    s = cache.stats()
    assert s.bytes_reserved == sum(expected) and s.bytes_reserved <= s.bytes_live + _core.SLAB_MAX
    del blocks
    cache._core.audit()


def test_a_limit_without_room_for_a_slab_takes_the_block_alone():
    cache = memory.AllocCache(limit=SLAB // 2)
    with memory.cached(cache):
        a = np.empty(3000, np.uint8)
    assert rows(cache) == {a.ctypes.data: (memory.bin_size(3000), True, a.ctypes.data, memory.bin_size(3000))}
    assert cache.stats().bytes_reserved == memory.bin_size(3000)
    del a
    cache._core.audit()


def test_a_quick_list_unused_for_evict_after_scopes_coalesces_and_its_slab_goes_back():
    cache = memory.AllocCache(evict_after=2)
    with memory.cached(cache):
        np.empty(8, np.uint8)  # dies at once: into its quick list
    assert cache.stats().bytes_reserved == SLAB
    for still_held in (True, False):  # scopes since the bin was last asked for: 1, 2
        with memory.cached(cache):
            pass
        assert (cache.stats().bytes_reserved == SLAB) is still_held
    assert cache.stats().upstream_frees == 1
    cache._core.audit()


def test_trim_and_free_coalesce_the_quick_lists_first():
    for release in (lambda c: c.trim(0), lambda c: c.free()):
        cache = memory.AllocCache()
        with memory.cached(cache):
            tiny = [np.empty(8, np.uint8) for _ in range(10)]
        del tiny  # quick blocks: the slab is free, though not yet one piece
        release(cache)
        assert cache.stats().bytes_reserved == 0 and rows(cache) == {}
        cache._core.audit()


def test_threads_freeing_each_others_small_blocks_keep_the_slabs_consistent():
    cache = memory.AllocCache()
    handed_over: queue.Queue = queue.Queue()
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        rng = np.random.default_rng(i)
        barrier.wait()
        for _ in range(300):
            with memory.cached(cache):
                a = np.full(int(rng.choice([8, 700, 3000, 9000, 40_000])), i, np.uint8)
                handed_over.put(a)  # dies in whichever thread takes it
                if rng.random() < 0.6:
                    handed_over.get()
                assert (a == i).all()
            del a

    run_threads(work, 4, handed_over)
    cache._core.audit()
    assert cache.stats().bytes_live == 0
