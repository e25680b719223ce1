"""`AllocCache`: a pool of memory blocks that a training step reuses instead of asking the
operating system again.

A block is taken from the cache when an array is created inside `cached(cache)` and goes
back to the cache the moment its last array dies, in whatever scope or thread that happens.
So a step's peak is its working set (not the sum of its allocations), an array that escapes
the step is never handed out again while it lives, and scopes nest freely.

Figures. Every byte figure counts whole blocks: a request of n bytes takes a block of
``bin_size(n)`` bytes (see the size bins below), whether the block is a whole upstream
allocation or a piece of one (see splitting below); ``bytes_cached`` counts every byte the
cache holds that no array uses, so ``bytes_reserved == bytes_live + bytes_cached`` always
holds exactly and is what the cache holds from the system.

Size bins (``csrc/bins.h``): requests up to 8 KiB are rounded up to 512 B classes,
larger ones to 16 classes per power of two, so a block wastes less than 6.25 % of any large
request, for every shape rather than for lucky ones. Coarser classes reuse more across nearby
lengths but waste more on a fixed step; varying lengths are better served by bucketing and by
eviction. (The sweep behind the choice, ``benchmarks/allocator.py --sweep``, is in
BENCHMARKS.md, "Design measurements of the allocator".)

Eviction: a whole free segment (a slab, or above 64 KiB a segment of the split pool) that
served no request during `evict_after` scopes is released at the next scope exit (a quick
list not asked for during them first coalesces into its slab), so one-off sizes (a short
last batch, varying sequence lengths) do not grow memory without bound. A step enters one to three scopes (the verbs', a user's own),
and a bin used once per step must survive the others: the default, 16, leaves room for
nested scopes while bounding a loop of varying lengths.

Splitting (``csrc/pool.c``, "Split pool"). Exact-bin reuse alone keeps every block of a size not
in use at a step's peak reserved but idle. So a request whose block is above 64 KiB takes
the best-fitting free piece of any larger free block (a segment: one upstream allocation)
and splits it; freed neighbours coalesce at once; when a request misses and the whole free
segments add up to its size, they go back and one new segment takes their bytes and its
own; and only whole free segments go back upstream (trim, limit, eviction, out of memory).
Smaller requests have a pool of their own, so that small long-lived arrays never pin a
large segment. The 64 KiB threshold is the smallest that keeps the gain on the
suite's steps (PyTorch's 1 MiB gives most of it back). What splitting cannot remove: a
segment never merges with another, so a large request made while the free bytes lie in
pieces of segments still in use misses; step plans (below) take over from there.

Small blocks (``csrc/pool.c``, "Small blocks"): blocks up to 64 KiB are cut from slabs
(segments of 16 KiB growing to 2 MiB, a sixteenth of what the slabs already hold) and coalesce
back, as PyTorch's small pool does, so the free bytes of one small size serve another. The
smallest (up to 1 KiB) skip coalescing on the fast path: a dying one waits in its bin's quick
list for the bin's next request, and the quick lists coalesce when a miss, `trim`, `free` or
eviction needs their bytes.

Step plans (``csrc/plan.c``, "Step plans"; `luxnn.memory.plan`). Online, no placement can
know which block dies when, so the split pool holds more than a step's peak live bytes. A
training loop repeats its step, so the cache plans it. The training verbs mark each step
(`luxnn.memory.step`; plain `cached` scopes never begin or end one); a step records every
request, with its lifetime and, made in a lane of a threaded kernel, its lane, and once a
step repeats the requests of one before it, every block gets a place in one arena where no
block alive at the same time overlaps it (lane requests matched by kernel call, lane and
rank, so no interleaving of threads misses). Shapes that vary (a short last batch, lengths in
buckets, an evaluation pass) get a plan each, up to `luxnn.memory.plan.MAX_PLANS` (the least
recently used goes), all in one arena; a step's first requests above 16 KiB pick its plan.
The warm-up holds nothing: until the cache's first plan is made or refused, and for a few
steps after each plan made, a step's recorded requests that no plan serves go upstream at
their size and back when they die, so the first two steps reserve what they use; the third is
planned, and from then on the pools only serve what the plans miss.
``AllocCache(plan=False)`` turns plans off.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ContextManager

import numpy as np

from . import _core
from .errors import format_bytes
from .frontend import FrontEnd, NumpyFrontEnd
from .plan import Planner

__all__ = [
    "AllocCache", "CacheStats", "ScopeStats", "DEFAULT_EVICT_AFTER", "bin_size", "get_allocator_cache",
]  # fmt: skip

DEFAULT_EVICT_AFTER = 16
"""Scopes a size bin (above 64 KiB: a free segment) may go unused before its free blocks are
released (see above)."""

TIMELINE_CAPACITY = 1 << 16
"""Events a recording cache keeps: the most recent ones (32 bytes each). Its spans (one per
step, `AllocCache.timeline_spans`) cover the whole run."""

# Larger limits are no limits: no machine addresses this much memory (128 TiB).
_MAX_LIMIT = _core.MAX_REQUEST

_TIMELINE_DTYPE = np.dtype([("t_ns", "<i8"), ("live", "<i8"), ("reserved", "<i8"), ("kind", "<i8")])
_SPAN_FIELDS = (
    "t_enter", "t_exit", "live_enter", "reserved_enter", "peak_live", "peak_reserved", "live_exit", "reserved_exit", "spans",
)  # fmt: skip


def bin_size(nbytes: int) -> int:
    """The size of the block that serves a request of `nbytes` bytes.

    >>> bin_size(1), bin_size(513), bin_size(64 << 20)
    (512, 1024, 67108864)
    """
    return _core.bin_size(nbytes)


@dataclass(frozen=True)
class CacheStats:
    """The figures of a cache since its creation (peaks: since `AllocCache.reset_peaks`).

    hits: requests served from the free lists; misses: requests they could not serve;
    upstream_allocs / upstream_frees: blocks and segments taken from / given back to the
    system; bytes_live: bytes of blocks in use by arrays; bytes_cached: bytes of free blocks
    and free pieces of segments (after `AllocCache.free`, a segment's free pieces stay here,
    never reused, until its last array dies);
    bytes_reserved: bytes_live + bytes_cached, all that the cache holds from the system;
    peak_live / peak_reserved: the highest bytes_live / bytes_reserved;
    scopes: scopes entered; plan_hits: requests served at their place in a step plan (also
    counted in hits); plan_misses: requests above 64 KiB, made while a plan was installed,
    that it did not serve; plans: plans installed (`luxnn.memory.plan`);
    inactive_split_bytes: the free bytes of the pools' segments (the slabs of blocks up to
    64 KiB and the split pool's segments above) that still hold a live block (PyTorch's
    name): bytes only a request that fits between live blocks can use, the pools'
    fragmentation (also counted in bytes_cached; a step plan's arena is not a pool).
    """

    hits: int
    misses: int
    upstream_allocs: int
    upstream_frees: int
    bytes_live: int
    bytes_cached: int
    bytes_reserved: int
    peak_live: int
    peak_reserved: int
    scopes: int
    plan_hits: int
    plan_misses: int
    plans: int
    inactive_split_bytes: int


@dataclass(frozen=True)
class ScopeStats:
    """The figures of one scope, from its entry to its exit.

    hits, misses, upstream_allocs, upstream_frees, scopes: counted during the scope (scopes
    includes itself and the scopes nested in it, in any thread); bytes_live_change,
    bytes_cached_change, bytes_reserved_change: the figure at exit minus the figure at
    entry; peak_live / peak_reserved: the highest bytes_live / bytes_reserved of the cache
    while the scope was open.
    """

    hits: int
    misses: int
    upstream_allocs: int
    upstream_frees: int
    scopes: int
    bytes_live_change: int
    bytes_cached_change: int
    bytes_reserved_change: int
    peak_live: int
    peak_reserved: int


# An open scope of a cache, as `AllocCache.open_scope` opened it: the core's slot that keeps
# its figures at entry and its peaks.
OpenScope = int
# A closed one, as `AllocCache.close_scope` closed it: its figures in `ScopeStats`' order,
# made by the core at its exit (a plain tuple: a scope's cost stays the core's).
ClosedScope = tuple[int, ...]


def _check_device(device: Any) -> Any:
    # The core has upstreams for the host and for CUDA devices; a device's class says
    # which array module it holds, without importing CuPy.
    from ..devices import CUDADevice

    if device is None or getattr(type(device), "xp", None) is np or isinstance(device, CUDADevice):
        return device
    raise NotImplementedError(f"AllocCache serves host (NumPy) and CUDA (CuPy) memory, not {device!r}")


def get_allocator_cache(device: Any = None) -> AllocCache | None:
    """A new cache for the arrays of a training state on `device` (None: the host; a
    `CUDADevice`: its CuPy allocations), or None where luxnn has no cache for the device.

    >>> get_allocator_cache()
    AllocCache(live=0 B, cached=0 B, peak_live=0 B, peak_reserved=0 B, hits=0, misses=0, limit=none, evict_after=16)
    """
    try:
        return AllocCache(device)
    except NotImplementedError:
        return None


def _check_limit(limit: int | None) -> int | None:
    if limit is None:
        return None
    if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)):
        raise TypeError(f"limit must be a number of bytes or None, got {limit!r}")
    if not 0 < limit <= _MAX_LIMIT:
        raise ValueError(f"limit must be between 1 and {_MAX_LIMIT} bytes, got {limit}")
    return int(limit)


def _check_evict_after(evict_after: int | None) -> int:
    if evict_after is None:
        return DEFAULT_EVICT_AFTER
    if isinstance(evict_after, bool) or not isinstance(evict_after, (int, np.integer)):
        raise TypeError(f"evict_after must be a number of scopes or None, got {evict_after!r}")
    if evict_after < 1:
        raise ValueError(f"evict_after must be at least 1 scope, got {evict_after}")
    return int(evict_after)


class AllocCache:
    """A caching allocator for the arrays created inside `cached(cache)`.

    limit: bytes the cache may hold. Before taking a new block from the system would pass
    it, whole free blocks and segments are released, least recently used first; arrays in
    use are never refused, except a single request larger than the limit (`MemoryError`),
    and the free pieces of a segment in use stay with it. It can be changed later
    (``cache.limit = ...``, see `limit`).
    evict_after: scopes a size bin (above 64 KiB: a free segment) may go unused before its
    free blocks are released (default `DEFAULT_EVICT_AFTER`).
    record: keep a timeline for `plot_timeline`: the last 65536 events, and every step's
    figures (`timeline_spans`).
    plan: place the blocks above 64 KiB of a repeated training step (`luxnn.memory.step`)
    by a plan made from the steps before it (`luxnn.memory.plan`): peak reserved close to
    peak live, from the third step of a fixed-shape loop.

    `device`: None or a `CPUDevice` for NumPy arrays; a `CUDADevice` for the CuPy arrays of
    that GPU (`luxnn.memory.cupy_backend`: the device is first touched on the first scope,
    not here). The device chooses the cache's `front_end` (`luxnn.memory.frontend`), which
    `cached` installs; `open_scope` / `close_scope` and `begin_step` / `end_step` are the
    core's side of `cached` and `step`.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> cache = memory.AllocCache()
    >>> for step in range(3):
    ...     with memory.cached(cache) as scope:
    ...         x = np.ones((256, 256)) * 2.0
    ...         del x
    >>> scope.stats.upstream_allocs, scope.stats.hits > 0   # step 2 reuses step 0's blocks
    (0, True)
    """

    def __init__(
        self,
        device: Any = None,
        *,
        limit: int | None = None,
        evict_after: int | None = None,
        record: bool = False,
        plan: bool = True,
    ) -> None:
        self.device = _check_device(device)
        self._limit = _check_limit(limit)
        self.evict_after = _check_evict_after(evict_after)
        self.record = bool(record)
        if not isinstance(plan, bool):
            raise TypeError(f"plan must be True or False, got {plan!r}")
        self.plan = plan
        self._created_ns = time.monotonic_ns()  # the core's clock is CLOCK_MONOTONIC too
        device_id = getattr(self.device, "device_id", None)
        self._core = _core.Core(
            limit=self._limit or 0,
            evict_after=self.evict_after,
            timeline_capacity=TIMELINE_CAPACITY if self.record else 0,
            upstream="host" if device_id is None else "cuda",
        )
        self._planner = Planner(self._core) if self.plan else None
        # The array library's way to the core, which `cached` installs.
        if device_id is None:
            self.front_end: FrontEnd = NumpyFrontEnd(self._core)
        else:
            from .cupy_backend import CupyFrontEnd  # it imports CuPy on the first scope, not here

            self.front_end = CupyFrontEnd(self._core, device_id)

    @property
    def limit(self) -> int | None:
        """The bytes the cache may hold (None: no limit). Assigning it checks the value and
        applies to the requests from then on: blocks held already stay (free ones go as a
        later request needs their room, or with `trim`).

        >>> cache = AllocCache(limit=1 << 20)
        >>> cache.limit = 4 << 20
        >>> cache.limit
        4194304
        """
        return self._limit

    @limit.setter
    def limit(self, limit: int | None) -> None:
        checked = _check_limit(limit)
        self._core.set_limit(checked or 0)
        self._limit = checked

    def open_scope(self) -> OpenScope:
        """Count a scope of the cache from now on (`cached` does, its front end installed)."""
        return self._core.scope_enter()

    def close_scope(self, opened: OpenScope) -> ClosedScope:
        """Close the scope that `open_scope` opened; `scope_stats` makes its figures, from
        then to now, out of what this returns (only when read: the training verbs' scopes,
        one a step, never are)."""
        return self._core.scope_exit(opened)

    @staticmethod
    def scope_stats(closed: ClosedScope) -> ScopeStats:
        """The `ScopeStats` of a scope that `close_scope` closed."""
        return ScopeStats(*closed)

    def begin_step(self, outside: Callable[[], ContextManager[Any]]) -> None:
        """A training step of the cache's begins (`luxnn.memory.step` does this). First the
        planner plans from the step that ended last, if no step began since, its own arrays
        allocated in ``outside()`` (`luxnn.memory.uncached`). Plans only save memory: should
        planning fail, the cache goes on without them, and says so once."""
        planner = self._planner
        if planner is not None:
            try:
                planner.before_step(outside)
            except Exception as err:  # noqa: BLE001 - any failure: no plans, said once
                if self._planner is planner:  # another thread's step may have said it
                    self._planner = None
                    self._core.drop_plan()
                    warnings.warn(f"AllocCache stops planning steps after an error: {err!r}", RuntimeWarning, stacklevel=3)
        self._core.step_begin()

    def end_step(self) -> None:
        """The training step that began last ends (`luxnn.memory.step` does this)."""
        self._core.step_end()

    def forget_step(self) -> None:
        """The training step that ended last is not planned from: it was not done (a failed
        CUDA graph capture, whose requests stopped part way: `luxnn.graphs`)."""
        if self._planner is not None:
            self._planner.forget_step()
        else:
            self._core.take_record()

    def arena_free(self, ptrs: bytes, sizes: bytes) -> bool:
        """Whether every range ``[ptr, ptr + size)`` lies in the arena of the cache's step
        plans and holds no live array's byte; if so the arena counts as used, as by the
        planned step that a replayed CUDA graph stands for (`luxnn.graphs` asks before a
        replay writes there). `ptrs`, `sizes`: native int64 buffers of one length.

        >>> AllocCache().arena_free(b"", b"")   # no plan yet, so no arena
        False
        """
        return self._core.arena_ranges_free(ptrs, sizes)

    def in_arena(self, ptrs: bytes, sizes: bytes) -> bool:
        """Whether every range ``[ptr, ptr + size)`` lies in the arena of the cache's step
        plans, live or free (`arena_free`'s buffers).

        >>> AllocCache().in_arena(b"", b"")
        False
        """
        return self._core.arena_ranges_free(ptrs, sizes, True)

    def place_next(self, ptr: int) -> None:
        """Serve this thread's next request of the cache at address `ptr`: in the arena of
        its step plans where all of the request's bytes are free there, or with a free
        block of its pools that starts there; else as any request. A replayed CUDA graph's
        results are made where the graph writes them (`luxnn.graphs`).

        >>> AllocCache().place_next(0)   # no arena: the next request is served as any
        """
        self._core.place_next(ptr)

    def stats(self) -> CacheStats:
        """The cache's figures now (see `CacheStats`).

        >>> AllocCache().stats().bytes_reserved
        0
        """
        return CacheStats(*self._core.stats())

    def reset_peaks(self) -> None:
        """Start the peaks afresh from the current figures, e.g. after a warm-up step."""
        self._core.reset_peaks()

    def trim(self, max_cached_bytes: int = 0) -> int:
        """Release whole free blocks and segments, least recently used first, then the step
        plan's arenas if no array uses them (the plan goes with them), until at most
        `max_cached_bytes` stay cached or none is left whole (a free piece of a segment that
        an array still uses cannot go back before it). Returns the bytes released. Arrays in
        use are not affected.

        >>> AllocCache().trim()
        0
        """
        return self._core.trim(int(max_cached_bytes))

    def free(self) -> None:
        """Release every whole free block and segment now, and every other when its last
        array dies; meanwhile the free pieces of such a segment are not reused. The step plan
        goes too, its arenas now or, one in use, when its last array dies.

        The cache stays usable: blocks allocated in later scopes are cached as usual.
        """
        self._core.release_all()

    def timeline(self) -> np.ndarray:
        """The recorded events, oldest first (empty unless ``record=True``): a structured
        array with ``t`` (seconds since the cache was created), ``live`` and ``reserved``
        (bytes after the event) and ``kind`` (one of `EVENT_KINDS`)."""
        raw, _dropped = self._core.timeline()
        events = np.frombuffer(raw, dtype=_TIMELINE_DTYPE)
        out = np.empty(len(events), [("t", "f8"), ("live", "i8"), ("reserved", "i8"), ("kind", "U11")])
        out["t"] = (events["t_ns"] - self._created_ns) / 1e9
        out["live"] = events["live"]
        out["reserved"] = events["reserved"]
        out["kind"] = np.asarray(EVENT_KINDS)[events["kind"]] if len(events) else []
        return out

    def timeline_dropped(self) -> int:
        """How many of the oldest events `timeline` no longer holds (it keeps the last
        `TIMELINE_CAPACITY`)."""
        return int(self._core.timeline()[1])

    def timeline_spans(self) -> np.ndarray:
        """The whole run, step by step, however many events were dropped (empty unless
        ``record=True``): a structured array, oldest first, one row per span (from the
        opening of a scope while none of the cache's was open to the closing of the last
        open: one step of the usual loop) with ``t_enter`` and ``t_exit`` (seconds since the
        cache was created), ``live_enter`` / ``reserved_enter``, ``peak_live`` /
        ``peak_reserved`` and ``live_exit`` / ``reserved_exit`` (bytes) and ``spans`` (1;
        past 4096 rows, neighbours merge and a row holds several spans in a row).

        >>> cache = AllocCache(record=True)
        >>> from luxnn import memory
        >>> with memory.cached(cache):
        ...     x = np.ones(1 << 16)
        >>> spans = cache.timeline_spans()
        >>> len(spans), int(spans["peak_live"][0]) >= x.nbytes
        (1, True)
        """
        rows = np.frombuffer(self._core.timeline_spans(), dtype=np.int64).reshape(-1, len(_SPAN_FIELDS))
        out = np.empty(len(rows), [(name, "f8" if name.startswith("t_") else "i8") for name in _SPAN_FIELDS])
        for k, name in enumerate(_SPAN_FIELDS):
            out[name] = (rows[:, k] - self._created_ns) / 1e9 if name.startswith("t_") else rows[:, k]
        return out

    def __repr__(self) -> str:
        s = self.stats()
        limit = "none" if self.limit is None else format_bytes(self.limit)
        device = "" if isinstance(self.front_end, NumpyFrontEnd) else f"device={self.device!r}, "
        return (
            f"AllocCache({device}live={format_bytes(s.bytes_live)}, cached={format_bytes(s.bytes_cached)}, "
            f"peak_live={format_bytes(s.peak_live)}, peak_reserved={format_bytes(s.peak_reserved)}, "
            f"hits={s.hits}, misses={s.misses}, limit={limit}, evict_after={self.evict_after})"
        )


EVENT_KINDS: tuple[str, ...] = _core.EVENT_KINDS
"""Timeline event kinds: a request served from the free lists or at its planned place
("hit") or by a new block ("upstream"), a block whose array died, now cached ("return"), a
block, segment or arena given back to the system ("release"), "scope_enter" / "scope_exit",
and an arena taken from the system for a step plan ("plan")."""
