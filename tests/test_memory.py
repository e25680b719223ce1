"""The caching allocator: scopes, semantics, faults, threads and tasks.

Imports `luxnn.memory` only (NumPy and the C core), never the rest of luxnn.
"""

import asyncio
import gc
import queue
import threading

import numpy as np
import pytest

from luxnn import memory
from luxnn.memory import _core

KiB, MiB = 1 << 10, 1 << 20


def handler_name() -> str:
    return np._core.multiarray.get_handler_name()


def run_threads(work, count: int, handed_over: queue.Queue) -> None:
    """`work(i)` for i in range(count), each on a thread of its own; fails with the errors
    the threads raised, and empties `handed_over` (arrays they pass to one another)."""
    errors: list = []

    def run(i: int) -> None:
        try:
            work(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    while not handed_over.empty():
        handed_over.get()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


# ---- scopes and handlers -------------------------------------------------------------


def test_scope_sets_and_restores_exactly_the_previous_handler():
    cache = memory.AllocCache()
    before = _core.get_handler()
    with memory.cached(cache):
        assert _core.get_handler() is cache.front_end.handler
        assert handler_name() == "luxnn_cache"
    assert _core.get_handler() is before
    assert handler_name() == "default_allocator"


def test_exception_inside_scope_restores_handler():
    cache = memory.AllocCache()
    before = _core.get_handler()
    with pytest.raises(ZeroDivisionError):
        with memory.cached(cache):
            _ = np.ones(10)
            1 / 0
    assert _core.get_handler() is before


def test_arrays_come_from_the_innermost_cache_and_uncached_routes_around_all():
    a, b = memory.AllocCache(), memory.AllocCache()
    with memory.cached(a):
        x = np.empty(1000)
        with memory.cached(b):
            y = np.empty(2000)
            with memory.uncached():
                assert handler_name() == "default_allocator"
                z = np.empty(3000)
            assert _core.get_handler() is b.front_end.handler
        assert _core.get_handler() is a.front_end.handler
    assert a.stats().bytes_live == memory.bin_size(x.nbytes)
    assert b.stats().bytes_live == memory.bin_size(y.nbytes)
    del x, y, z
    assert a.stats().bytes_live == b.stats().bytes_live == 0


def test_uncached_outside_any_scope_changes_nothing():
    before = _core.get_handler()
    with memory.uncached():
        assert _core.get_handler() is before
    assert _core.get_handler() is before


def test_cached_none_is_a_no_op_scope():
    before = _core.get_handler()
    with memory.cached(None) as scope:
        assert _core.get_handler() is before
    assert scope.stats is None


def test_decorator_opens_a_fresh_scope_per_call():
    cache = memory.AllocCache()

    @memory.cached(cache)
    def step(n):
        assert _core.get_handler() is cache.front_end.handler
        return np.ones(n).sum()

    assert step(100) == step(100) == 100.0
    assert cache.stats().scopes == 2
    assert handler_name() == "default_allocator"


def test_a_scope_object_cannot_be_open_twice():
    scope = memory.cached(memory.AllocCache())
    with scope:
        with pytest.raises(RuntimeError, match="already open"):
            scope.__enter__()


def test_scope_stats_are_the_scopes_own_figures():
    cache = memory.AllocCache()
    with memory.cached(cache):
        keep = np.empty(MiB // 8)  # 1 MiB
    with memory.cached(cache) as scope:
        t = np.empty(MiB // 8)
        del t
        u = np.empty(MiB // 8)
    s = scope.stats
    assert (s.upstream_allocs, s.hits, s.scopes) == (1, 1, 1)
    assert s.bytes_live_change == MiB and s.bytes_reserved_change == MiB
    assert s.peak_live == 2 * MiB  # keep + t, then keep + u
    del keep, u


# ---- semantics ----------------------------------------------------------------------


def test_blocks_are_reused_after_the_first_step_and_peak_is_the_working_set():
    cache = memory.AllocCache()
    w = np.random.default_rng(0).standard_normal((256, 256)).astype(np.float32)

    def step(x):
        for _ in range(3):
            x = np.tanh(x @ w) * 0.5 + 0.1
        return float(x.sum())

    x = np.ones((512, 256), np.float32)
    with memory.cached(cache):
        first = step(x)
    cache.reset_peaks()
    for _ in range(5):
        with memory.cached(cache) as scope:
            assert step(x) == first
        assert scope.stats.upstream_allocs == 0
    s = cache.stats()
    assert s.peak_reserved <= 1.1 * s.peak_live
    # A pinning cache would hold every temporary of the step; we hold the working set.
    assert s.peak_live <= 4 * x.nbytes


def test_escaped_arrays_keep_their_values_across_50_heavy_scopes():
    cache = memory.AllocCache()
    rng = np.random.default_rng(1)
    kept = []
    for step in range(50):
        with memory.cached(cache):
            a = rng.standard_normal(4096)
            b = a * 2 + 1  # same size class as the kept arrays
            big = np.full(MiB, float(step))
            if step % 5 == 0:
                kept.append((b, b.copy()))
            del a, big
    for array, expected in kept:
        np.testing.assert_array_equal(array, expected)
    assert len({arr.ctypes.data for arr, _ in kept}) == len(kept)


def test_a_reused_block_serves_one_array_at_a_time():
    cache = memory.AllocCache()
    with memory.cached(cache):
        for nbytes in (100, 10_000, 8 * MiB):
            first = np.empty(nbytes, np.uint8)
            del first  # one free block of the bin
            arrays = [np.empty(nbytes, np.uint8) for _ in range(3)]
            assert len({a.ctypes.data for a in arrays}) == 3
            del arrays
    cache._core.audit()


def test_device_must_be_the_host():
    class HostDevice:  # what luxnn.devices.CPUDevice looks like to the cache
        xp = np

    assert memory.AllocCache(HostDevice()).device is not None
    with pytest.raises(NotImplementedError, match="host"):
        memory.AllocCache(device="cuda:0")
    assert memory.get_allocator_cache("cuda:0") is None


def test_nested_scopes_on_one_cache_do_not_release_outer_arrays():
    cache = memory.AllocCache()
    with memory.cached(cache):
        outer = np.full(10_000, 7.0)
        for _ in range(5):
            with memory.cached(cache):
                _ = [np.full(10_000, -1.0) for _ in range(4)]
        np.testing.assert_array_equal(outer, 7.0)


@pytest.mark.parametrize("nbytes", [4096, 8 * MiB])  # posix_memalign and mmap blocks
def test_calloc_is_zeroed_on_a_reused_block(nbytes):
    cache = memory.AllocCache()
    with memory.cached(cache):
        junk = np.empty(nbytes, np.uint8)
        junk.fill(0xAB)
        address = junk.ctypes.data
        del junk
        hits = cache.stats().hits
        zeros = np.zeros(nbytes, np.uint8)
    assert cache.stats().hits == hits + 1 and zeros.ctypes.data == address
    assert not zeros.any()


@pytest.mark.parametrize("new_len", [5, 100, 1000, 200_000])
def test_resize_keeps_the_contents(new_len):
    cache = memory.AllocCache()
    with memory.cached(cache):
        a = np.arange(100, dtype=np.int64)
        a.resize(new_len, refcheck=False)
    keep = min(100, new_len)
    np.testing.assert_array_equal(a[:keep], np.arange(keep))
    assert not a[keep:].any()  # ndarray.resize zero-fills the growth
    assert cache.stats().bytes_live == memory.bin_size(a.nbytes)
    del a
    assert cache.stats().bytes_live == 0


def test_resize_after_the_scope_still_goes_through_the_cache():
    cache = memory.AllocCache()
    with memory.cached(cache):
        a = np.arange(10, dtype=np.float64)
    a.resize(100_000, refcheck=False)  # NumPy calls the handler the array was made with
    assert cache.stats().bytes_live == memory.bin_size(a.nbytes)
    np.testing.assert_array_equal(a[:10], np.arange(10))


def test_bins_round_up_with_bounded_slack():
    sizes = [1, 511, 512, 513, 8192, 8193, 10**5, 3 * MiB + 1, 64 * MiB, 10**10]
    for n in sizes:
        b = memory.bin_size(n)
        assert b >= n and memory.bin_size(b) == b
        assert b - n < 512 or (b - n) / n < 1 / _core.BIN_DIVISIONS
    assert [memory.bin_size(n) for n in sorted(sizes)] == sorted(memory.bin_size(n) for n in sizes)


def test_evict_after_releases_bins_unused_for_that_many_scopes():
    cache = memory.AllocCache(evict_after=3)
    with memory.cached(cache):
        _ = np.empty(MiB)  # an 8 MiB block, free at once
    for still_cached in (True, True, False):  # scopes since its bin was last used: 1, 2, 3
        with memory.cached(cache):
            _ = np.empty(10)  # a small bin, used every scope: never evicted
        assert (cache.stats().bytes_cached >= 8 * MiB) is still_cached
    assert cache.stats().bytes_reserved == _core.SLAB_MIN  # what is left: the small block's slab


def test_trim_releases_least_recently_used_first():
    cache = memory.AllocCache()
    with memory.cached(cache):
        # Freed in this order: 1 MiB is the least recently used. (Each is larger than the
        # free ones before it together, so no miss consolidates them: see splitting.)
        for mib in (1, 2, 4):
            _ = np.empty(mib * MiB, np.uint8)
            del _
    assert cache.stats().bytes_cached == 7 * MiB
    assert cache.trim(6 * MiB) == 1 * MiB
    assert cache.trim(4 * MiB) == 2 * MiB
    assert cache.trim() == 4 * MiB
    assert cache.stats().bytes_reserved == 0


def test_free_with_live_arrays_releases_them_when_they_die_and_reopens():
    cache = memory.AllocCache()
    with memory.cached(cache):
        live = np.full(MiB, 3.0)
        _ = np.empty(MiB)
    del _
    cache.free()
    s = cache.stats()
    assert (s.bytes_cached, s.bytes_live) == (0, 8 * MiB)
    frees = s.upstream_frees
    np.testing.assert_array_equal(live, 3.0)
    del live
    s = cache.stats()
    assert (s.bytes_live, s.bytes_cached, s.upstream_frees) == (0, 0, frees + 1)
    with memory.cached(cache):  # reopens cleanly, and caches again
        x = np.empty(MiB)
        del x
    assert cache.stats().bytes_cached == 8 * MiB


def test_cache_collected_while_its_arrays_live():
    cache = memory.AllocCache()
    with memory.cached(cache):
        survivor = np.full(64 * MiB // 8, 5.0)  # 64 MiB, touched
    del cache
    gc.collect()
    np.testing.assert_array_equal(survivor[::4096], 5.0)
    with memory.cached(memory.AllocCache()):  # other caches unaffected
        np.testing.assert_array_equal(np.ones(3) + survivor[:3], 6.0)
    before = rss_bytes()
    del survivor  # the last reference to the core: its memory goes back to the system
    assert before - rss_bytes() > 48 * MiB


# ---- splitting large blocks ------------------------------------------------------------


def segments(cache) -> dict:
    """{(base, size): [(offset, size, live), ...]} of a cache's segments (slabs, the split
    pool's, a plan's arena), pieces in address order."""
    out: dict = {}
    for ptr, size, live, base, segment_size, _orphan in cache._core.blocks():
        out.setdefault((base, segment_size), []).append((ptr - base, size, live))
    return {key: sorted(pieces) for key, pieces in out.items()}


def test_a_free_large_block_is_split_for_smaller_requests_and_coalesces_back():
    cache = memory.AllocCache()
    with memory.cached(cache):
        big = np.empty(8 * MiB, np.uint8)
        base = big.ctypes.data
        del big
        a = np.empty(3 * MiB, np.uint8)
        b = np.empty(MiB, np.uint8)
        c = np.empty(100_000, np.uint8)
    s = cache.stats()
    assert (s.upstream_allocs, s.hits) == (1, 3)  # one segment served all three
    c_size = memory.bin_size(100_000)
    rest = 8 * MiB - 4 * MiB - c_size
    assert segments(cache) == {
        (base, 8 * MiB): [(0, 3 * MiB, True), (3 * MiB, MiB, True), (4 * MiB, c_size, True), (4 * MiB + c_size, rest, False)]
    }  # fmt: skip
    assert (s.bytes_live, s.bytes_cached) == (4 * MiB + c_size, rest)
    del b  # a free piece between two in use
    cache._core.audit()
    del a  # coalesces with it
    assert segments(cache)[(base, 8 * MiB)] == [(0, 4 * MiB, False), (4 * MiB, c_size, True), (4 * MiB + c_size, rest, False)]
    del c  # and the three are one free segment again
    assert segments(cache) == {(base, 8 * MiB): [(0, 8 * MiB, False)]}
    assert cache.stats().bytes_cached == 8 * MiB and cache.stats().upstream_frees == 0
    cache._core.audit()


def test_pieces_keep_the_alignment_of_their_segment():
    cache = memory.AllocCache()
    with memory.cached(cache):
        big = np.empty(13 * MiB + 12345, np.uint8)  # mmap'd: 2 MiB aligned
        assert big.ctypes.data % (2 * MiB) == 0
        del big
        pieces = [np.empty(n, np.uint8) for n in (70_001, 123_457, 999_999, 2 * MiB + 1, 65_537)]
    assert cache.stats().upstream_allocs == 1
    for p in pieces:
        assert p.ctypes.data % 512 == 0  # offsets are multiples of 512 B
    cache._core.audit()


def test_requests_up_to_the_split_threshold_keep_exact_bins():
    cache = memory.AllocCache()
    small = _core.SPLIT_ABOVE  # the largest exact-bin block
    with memory.cached(cache):
        big = np.empty(4 * MiB, np.uint8)
        del big
        a = np.empty(small, np.uint8)  # not carved from the free segment
        assert cache.stats().upstream_allocs == 2
        b = np.empty(small + 1, np.uint8)  # carved from it
        assert cache.stats().upstream_allocs == 2
    assert memory.bin_size(small) == small and memory.bin_size(small + 1) > small
    del a, b


def test_a_miss_consolidates_the_whole_free_segments_that_add_up_to_it():
    cache = memory.AllocCache()
    with memory.cached(cache):
        a, b = np.empty(MiB, np.uint8), np.empty(2 * MiB, np.uint8)  # two segments
        del a, b
        c = np.empty(3 * MiB, np.uint8)  # fits in neither: both go back, one segment takes all
    s = cache.stats()
    assert (s.upstream_allocs, s.upstream_frees, s.bytes_live, s.bytes_cached) == (3, 2, 3 * MiB, 3 * MiB)
    assert segments(cache) == {(c.ctypes.data, 6 * MiB): [(0, 3 * MiB, True), (3 * MiB, 3 * MiB, False)]}
    with memory.cached(cache):
        d = np.empty(3 * MiB, np.uint8)  # the rest serves the next one
    assert cache.stats().upstream_allocs == 3
    del c, d
    assert segments(cache) == {(min(segments(cache))[0], 6 * MiB): [(0, 6 * MiB, False)]}
    cache._core.audit()


def test_trim_releases_only_whole_segments():
    cache = memory.AllocCache()
    with memory.cached(cache):
        x, y = np.empty(4 * MiB, np.uint8), np.empty(2 * MiB, np.uint8)
        del x, y
        keep = np.empty(MiB, np.uint8)  # best fit: the front of the 2 MiB segment
    assert cache.stats().bytes_cached == 5 * MiB
    assert cache.trim() == 4 * MiB  # the piece left of the 2 MiB segment cannot go back
    assert cache.stats().bytes_cached == MiB
    del keep
    assert cache.trim() == 2 * MiB
    s = cache.stats()
    assert (s.bytes_reserved, s.upstream_allocs, s.upstream_frees) == (0, 2, 2)


def test_free_orphans_a_segment_in_use_until_its_last_piece_dies():
    cache = memory.AllocCache()
    with memory.cached(cache):
        big = np.empty(4 * MiB, np.uint8)
        del big
        a = np.empty(MiB // 8)  # 1 MiB: the front of the 4 MiB segment
    a.fill(1.0)
    cache.free()
    s = cache.stats()
    assert (s.bytes_live, s.bytes_cached, s.upstream_frees) == (MiB, 3 * MiB, 0)  # held, not reusable
    with memory.cached(cache):
        b = np.empty(MiB, np.uint8)  # not served from the orphan's free piece
    assert cache.stats().upstream_allocs == 2
    np.testing.assert_array_equal(a, 1.0)
    del a  # the orphan's last piece: the whole segment goes back
    s = cache.stats()
    assert (s.bytes_live, s.bytes_cached, s.upstream_frees) == (MiB, 0, 1)
    del b  # made after free(): cached as usual
    assert cache.stats().bytes_cached == MiB
    cache._core.audit()


def test_eviction_releases_whole_segments_that_served_no_request():
    cache = memory.AllocCache(evict_after=2)
    with memory.cached(cache):  # scope 1: two segments
        a, b = np.empty(4 * MiB, np.uint8), np.empty(2 * MiB, np.uint8)
        del a, b
    with memory.cached(cache):  # scope 2: the 2 MiB segment serves a request
        x = np.empty(MiB, np.uint8)
        del x
    assert cache.stats().bytes_cached == 6 * MiB
    with memory.cached(cache):  # scope 3: the 4 MiB one has served nothing for 2 scopes
        pass
    assert [size for _, size in segments(cache)] == [2 * MiB]
    assert cache.stats().bytes_cached == 2 * MiB


def test_variable_lengths_share_segments_across_sizes():
    # The attention-like loop of `benchmarks/allocator.py --sweep` (sequence length drawn
    # from 32..512 every step): with exact bins only, 1460 upstream allocations and a peak
    # reserved 8.5x the largest step's requests at the default eviction.
    rng = np.random.default_rng(0)
    cache = memory.AllocCache()
    requested = 0
    for i in range(300):
        batch, length = (5 if i % 25 == 24 else 16), int(rng.integers(32, 513))
        act, scores = batch * length * 256 * 4, batch * 8 * length * length * 4
        sizes = [act, act, scores, scores, act, act, batch * length * 4]
        with memory.cached(cache):
            held = [np.empty(n, np.uint8) for n in sizes]
            del held
        requested = max(requested, sum(sizes))
    s = cache.stats()
    assert s.peak_reserved < 2 * requested and s.upstream_allocs < 300
    cache._core.audit()


@pytest.mark.parametrize("nbytes, blocks", [(256, 20_000), (100_000, 500), (3 * MiB, 40)])  # quick list, split pool, large
def test_threads_without_the_gil_never_hold_one_block_at_once(nbytes, blocks):
    # Four threads allocate and free at once through the core's lock (NumPy would take the
    # GIL around each request), each filling its blocks with its own byte and checking it
    # before it frees them: a block handed to two of them would show the other's bytes.
    cache = memory.AllocCache()
    assert cache._core.stress_lock(4, blocks, nbytes) == 0
    cache._core.audit()
    s = cache.stats()
    assert s.bytes_live == 0 and s.hits + s.misses == 4 * blocks


@pytest.mark.parametrize("args", [(0, 10, 64), (65, 10, 64), (2, -1, 64), (2, 10, 0)])
def test_stress_lock_names_what_it_expects(args):
    with pytest.raises(ValueError, match="expected 1 to 64 threads"):
        memory.AllocCache()._core.stress_lock(*args)


def test_threads_splitting_one_cache_free_each_others_pieces():
    cache = memory.AllocCache()
    handed_over: queue.Queue = queue.Queue()
    barrier = threading.Barrier(4)
    sizes = [70_000, 300_000, MiB, 3 * MiB + 5, 5 * MiB]

    def work(i: int) -> None:
        rng = np.random.default_rng(i)
        barrier.wait()
        for step in range(100):
            with memory.cached(cache):
                a = np.full(int(rng.choice(sizes)) // 8, float(i))
                handed_over.put(a)  # dies in whichever thread takes it
                if step % 2:
                    handed_over.get()
                assert (a == i).all()
            del a

    run_threads(work, 4, handed_over)
    cache._core.audit()
    s = cache.stats()
    assert s.bytes_live == 0 and s.bytes_cached == s.bytes_reserved > 0
    # All coalesced (audit checks each pair of neighbours), but for small blocks in quick
    # lists, which coalesce when their slab's bytes are needed: a slab that holds them.
    assert all(len(pieces) == 1 or min(size for _, size, _ in pieces) <= _core.QUICK_MAX
               for pieces in segments(cache).values())


# ---- limits and out of memory --------------------------------------------------------


@pytest.mark.parametrize("limit", [0, -1, 1 << 60])
def test_bad_limit_is_a_value_error(limit):
    with pytest.raises(ValueError, match="limit"):
        memory.AllocCache(limit=limit)


@pytest.mark.parametrize("bad", [1.5, "1GiB", True])
def test_limit_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="limit"):
        memory.AllocCache(limit=bad)


def test_a_limit_set_later_is_checked_and_holds_from_the_next_request():
    cache = memory.AllocCache()
    with memory.cached(cache):
        keep = np.empty(2 * MiB, np.uint8)  # held already: stays
    cache.limit = MiB
    assert cache.limit == MiB and "limit=1.0 MiB" in repr(cache)
    with pytest.raises(memory.CacheMemoryError, match="limit of 1.0 MiB"):
        with memory.cached(cache):
            np.empty(2 * MiB, np.uint8)
    for bad, error in ((0, ValueError), (1 << 60, ValueError), (1.5, TypeError), ("1GiB", TypeError)):
        with pytest.raises(error, match="limit"):
            cache.limit = bad
        assert cache.limit == MiB  # unchanged
    cache.limit = None
    with memory.cached(cache):
        big = np.empty(2 * MiB, np.uint8)
    assert cache.limit is None and cache.stats().bytes_live >= 4 * MiB
    del keep, big


def test_evict_after_must_be_positive():
    with pytest.raises(ValueError, match="evict_after"):
        memory.AllocCache(evict_after=0)


def test_request_above_the_limit_is_a_memory_error_naming_both_and_leaks_nothing():
    cache = memory.AllocCache(limit=16 * MiB)
    with memory.cached(cache):
        keep = np.empty(MiB, np.uint8)
    before = cache.stats()
    with pytest.raises(memory.CacheMemoryError, match=r"20\.0 MiB \(20971520 bytes\).*limit of 16\.0 MiB") as info:
        with memory.cached(cache):
            np.empty(20 * MiB, np.uint8)
    assert isinstance(info.value, MemoryError)
    assert "live 1.0 MiB" in str(info.value)
    after = cache.stats()
    assert (after.bytes_live, after.bytes_reserved) == (before.bytes_live, before.bytes_reserved)
    assert after.upstream_allocs == before.upstream_allocs
    assert _core.get_handler() is not cache.front_end.handler
    del keep


def test_over_the_limit_trims_then_allocates():
    cache = memory.AllocCache(limit=10 * MiB)
    with memory.cached(cache):
        for mib in (1, 2, 4):
            _ = np.empty(mib * MiB, np.uint8)
            del _
        assert cache.stats().bytes_cached == 7 * MiB
        x = np.empty(5 * MiB, np.uint8)  # 5 + 7 > 10: trims the 1 and 2 MiB blocks (LRU)
    s = cache.stats()
    assert (s.bytes_live, s.bytes_cached, s.upstream_frees) == (5 * MiB, 4 * MiB, 2)
    assert s.bytes_reserved <= 10 * MiB
    del x


def test_upstream_out_of_memory_trims_retries_and_reports_the_figures():
    cache = memory.AllocCache()
    with memory.cached(cache):
        _ = np.empty(MiB)
    del _
    assert cache.stats().bytes_cached == 8 * MiB
    with pytest.raises(memory.CacheMemoryError, match=r"out of memory allocating 32\.0 TiB|out of memory"):
        with memory.cached(cache):
            np.empty(1 << 45, np.uint8)  # 32 TiB
    assert cache.stats().bytes_cached == 0  # released before the retry
    with memory.cached(cache):  # and still usable
        assert np.ones(4).sum() == 4


def test_memory_error_caught_inside_the_scope_is_numpys_own():
    cache = memory.AllocCache(limit=MiB)
    with memory.cached(cache):
        with pytest.raises(MemoryError) as info:
            np.empty(2 * MiB, np.uint8)
        assert not isinstance(info.value, memory.CacheMemoryError)
        assert np.ones(3).sum() == 3


# ---- threads and tasks ---------------------------------------------------------------


def test_threads_with_own_caches_and_a_shared_one_do_not_cross_talk():
    own = [memory.AllocCache() for _ in range(4)]
    shared = memory.AllocCache()
    handed_over: queue.Queue = queue.Queue()
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        barrier.wait()
        for step in range(30):
            cache = own[i] if step % 2 else shared
            with memory.cached(cache):
                assert _core.get_handler() is cache.front_end.handler
                a = np.full(5000 + 1000 * i, float(i))
                b = a * 2
                assert (b == 2 * i).all()
                handed_over.put(b)  # dies in another thread
                if step % 3 == 0:
                    handed_over.get()
            assert handler_name() == "default_allocator"

    run_threads(work, 4, handed_over)
    for cache in [*own, shared]:
        s = cache.stats()
        assert s.bytes_live == 0 and s.bytes_reserved == s.bytes_cached
    assert sum(c.stats().scopes for c in own) == shared.stats().scopes == 60
    assert handler_name() == "default_allocator"


def test_asyncio_tasks_have_their_own_scopes():
    caches = [memory.AllocCache() for _ in range(3)]

    async def task(cache: memory.AllocCache, n: int) -> float:
        with memory.cached(cache):
            total = 0.0
            for _ in range(10):
                await asyncio.sleep(0)  # the other tasks run their scopes here
                assert _core.get_handler() is cache.front_end.handler
                x = np.full(n, 1.0)
                total += float(x.sum())
            return total

    async def main() -> list:
        return await asyncio.gather(*(task(c, 1000 * (i + 1)) for i, c in enumerate(caches)))

    assert asyncio.run(main()) == [10_000.0, 20_000.0, 30_000.0]
    for i, cache in enumerate(caches):
        s = cache.stats()
        assert s.hits + s.misses >= 10 and s.bytes_live == 0
        assert s.peak_live < 2 * memory.bin_size(8000 * (i + 1)) + 4096  # its own task's arrays only
        assert s.bytes_reserved <= s.peak_live + _core.SLAB_MIN  # and slabs for them
    assert handler_name() == "default_allocator"


# ---- visible -------------------------------------------------------------------------


def test_repr_is_one_line_with_the_figures():
    cache = memory.AllocCache(limit=64 * MiB)
    text = repr(cache)
    assert "\n" not in text and text.startswith("AllocCache(") and "limit=64.0 MiB" in text


def test_timeline_records_events_and_plots(tmp_path):
    pytest.importorskip("matplotlib")
    cache = memory.AllocCache(record=True)
    for _ in range(3):
        with memory.cached(cache):
            _ = np.ones(MiB) * 2
    events = cache.timeline()
    kinds = list(events["kind"])
    assert kinds.count("scope_enter") == kinds.count("scope_exit") == 3
    assert "upstream" in kinds and "hit" in kinds and "return" in kinds
    assert (np.diff(events["t"]) >= 0).all()
    path = tmp_path / "mem.png"
    memory.plot_timeline(cache, path)
    assert path.stat().st_size > 1000


def test_plot_timeline_needs_a_recording_cache():
    with pytest.raises(ValueError, match="record=True"):
        memory.plot_timeline(memory.AllocCache())


def test_a_users_own_memory_error_after_a_caught_refusal_is_left_as_it_is():
    cache = memory.AllocCache(limit=MiB)
    with pytest.raises(MemoryError) as info:
        with memory.cached(cache):
            try:
                np.empty(2 * MiB, np.uint8)
            except MemoryError:
                pass
            raise MemoryError("the user's own")
    assert type(info.value) is MemoryError and str(info.value) == "the user's own"
    with pytest.raises(memory.CacheMemoryError):  # the cache's refusal itself still is relabelled
        with memory.cached(cache):
            np.empty(3 * MiB, np.uint8)


@pytest.mark.parametrize("switch", [lambda: memory.cached(memory.AllocCache()), memory.uncached])
def test_scopes_refuse_to_decorate_generators_and_async_functions(switch):
    def gen():
        yield np.ones(3)

    async def coro():
        return np.ones(3)

    async def agen():
        yield np.ones(3)

    for func in (gen, coro, agen):
        with pytest.raises(TypeError, match="generator or async function"):
            switch()(func)


def test_inactive_split_bytes_are_the_free_bytes_of_segments_in_use():
    cache = memory.AllocCache(plan=False)
    with memory.cached(cache):
        del_me = np.empty(MiB, np.uint8)  # one segment of 1 MiB
        del del_me
        assert cache.stats().inactive_split_bytes == 0  # whole and free: not fragmentation
        piece = np.empty(256 * KiB, np.uint8)  # a piece of it; the rest stays free beside it
        assert cache.stats().inactive_split_bytes == MiB - 256 * KiB
        cache._core.audit()
        del piece
    assert cache.stats().inactive_split_bytes == 0
    cache._core.audit()
