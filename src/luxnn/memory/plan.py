"""Step plans: where each block of a repeated step lives (served by ``csrc/plan.c``).

A training loop repeats one step: the same requests, with the same lifetimes. Online
placement cannot know which block dies when, so it holds more than the step uses at its
peak; a plan made from earlier steps can place every block where it fits between the
blocks alive at the same time. (What that saves, row by row: BENCHMARKS.md.) What a plan
cannot remove: the small-block pool's requests of 16 KiB and less, and blocks kept for two
steps or more.

The core records each training step, as the verbs mark it (`luxnn.memory.step`): every
request above 16 KiB, and every request made in a lane of a threaded kernel
(`luxnn.parallel.for_blocks`), with a clock at its allocation and at its death (-1: still
alive when the next step began, and then its death on the next step's clock), and for a
lane's, the kernel call, the lane and the lane's own clock. `Planner` turns two consecutive
steps with the same requests into a plan: one arena, packed over the circular two-step
schedule (`layout`), where a kernel call's lanes sit side by side for the call's span, each
packed by its own clock, which no interleaving of the threads changes. The first plan's
first step needs only the arena's first chunk, beside the warm-up's results it replaces.
A plan that misses is widened where a later step's lifetimes reach beyond it. The core
serves a request at its planned place only when every byte there is free, so a plan can
cost misses but never an overlap.
"""

from __future__ import annotations

import enum
import os
import threading
import weakref
from typing import Any, Callable, ContextManager, NamedTuple

import numpy as np

from . import _core

__all__ = ["place", "layout", "Layout", "Planner", "PlanStatus"]


BUDGET = 1.10
"""Peak reserved / peak live that the cache keeps to over a whole run (DESIGN.md)."""
STEADY_BUDGET = 1.05
"""The same, once the loop is planned."""

class PlanStatus(enum.IntEnum):
    """What became of a plan: installed by the core, to try again with the next step's
    record (the arena it must replace is in use), refused for want of room (the cache's
    limit, out of memory), or not tried as it would hold more than the split pool held."""

    INSTALLED = _core.PLAN_INSTALLED
    LATER = _core.PLAN_LATER
    NO_ROOM = _core.PLAN_NO_ROOM
    NO_GAIN = max(_core.PLAN_INSTALLED, _core.PLAN_LATER, _core.PLAN_NO_ROOM) + 1


def place(
    sizes: np.ndarray, born: np.ndarray, died: np.ndarray, born2: np.ndarray | None = None, died2: np.ndarray | None = None,
    *, first: np.ndarray | None = None, wall: int | None = None,
) -> tuple[np.ndarray, int]:
    """Offsets for blocks of `sizes` bytes alive over ``[born, died)`` (and, if given, also
    over ``[born2, died2)``; an empty interval adds nothing) such that no two blocks alive at
    the same time overlap; returns ``(offsets, bytes spanned)``. `first` (a mask): these
    blocks are placed before the others, which then never straddle the first ones' span;
    `wall`: no block straddles this offset.

    Each block at the lowest offset that clears the blocks already placed and alive with
    it, in several orders, keeping the smallest span: from the largest block down (Pisarchyk
    and Lee, "Efficient Memory Management for Deep Neural Net Inference", 2020), from the
    longest-lived down (XLA's heap simulator tries both), by birth; then, from the best of
    them, up to `REORDERINGS` times the blocks that reach the top of the span move to the
    front of the order ("squeaky wheel" optimisation, Joslin and Clements 1999), until an
    order spans no more than the most bytes alive at once (no placement spans less). On the
    circular schedule of a step the first three can miss by whole blocks that the
    reorderings place (a transformer block's step: 1.087x its peak, then 1.000x after 35).
    n vectorised steps per order.

    >>> offsets, span = place(np.array([4, 4, 8]), np.array([0, 1, 3]), np.array([2, 3, 4]))
    >>> offsets.tolist(), span    # the first two overlap in time, the third follows both
    ([0, 4, 0], 8)
    """
    sizes, born, died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died))
    born2 = np.zeros_like(born) if born2 is None else np.asarray(born2, dtype=np.int64)
    died2 = np.zeros_like(died) if died2 is None else np.asarray(died2, dtype=np.int64)
    lives = (born, died, born2, died2)
    offsets, placed = np.zeros(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=bool)
    if first is not None and first.any():
        offsets[first], wall = place(sizes[first], *(x[first] for x in lives), wall=wall)
        placed = first.copy()
    rest = np.flatnonzero(~placed)
    if not len(rest):
        return offsets, int((offsets + sizes).max(initial=0))
    bound = peak_bytes(sizes, *lives)
    span_of = np.maximum(died - born, 0) + np.maximum(died2 - born2, 0)
    start = np.where(died > born, born, born2)
    orders = [np.lexsort((born, -sizes)), np.lexsort((born, -sizes, -span_of)), np.lexsort((-sizes, start))]
    best = None
    for k in range(len(orders) + REORDERINGS):
        if k < len(orders):
            order = orders[k][~placed[orders[k]]]
        else:  # the blocks at the top of the last span first, the others as they were
            top = (at + sizes == span)[order]
            order = np.concatenate([order[top], order[~top]])
        at = _first_fit(order, sizes, lives, offsets.copy(), placed.copy(), wall)
        span = int((at + sizes).max())
        if best is None or span < best[1]:
            best = (at, span, order)
        if best[1] <= bound:
            break
        if k == len(orders) - 1:
            at, span, order = best
    return best[0], best[1]


REORDERINGS = 64


def peak_bytes(sizes: np.ndarray, born: np.ndarray, died: np.ndarray, born2: np.ndarray, died2: np.ndarray) -> int:
    """The most bytes of blocks alive at once (as in `place`): no placement spans less.

    >>> int(peak_bytes(np.array([4, 4, 8]), np.array([0, 1, 3]), np.array([2, 3, 4]), np.zeros(3), np.zeros(3)))
    8
    """
    at = np.concatenate([born, born2])  # the bytes alive change only where a block is born
    alive = ((born <= at[:, None]) & (at[:, None] < died)) | ((born2 <= at[:, None]) & (at[:, None] < died2))
    return int((alive * sizes).sum(axis=1).max())


def _first_fit(order: np.ndarray, sizes: np.ndarray, lives: tuple, offsets: np.ndarray, placed: np.ndarray, wall: int | None) -> np.ndarray:
    born, died, born2, died2 = lives
    for i in order:
        together = (
            ((born < died[i]) & (born[i] < died)) | ((born2 < died[i]) & (born[i] < died2))
            | ((born < died2[i]) & (born2[i] < died)) | ((born2 < died2[i]) & (born2[i] < died2))
        )  # fmt: skip
        others = np.flatnonzero(placed & together)
        lo = offsets[others]
        order_lo = np.argsort(lo, kind="stable")
        lo, hi = lo[order_lo], lo[order_lo] + sizes[others][order_lo]
        # Below lo[k], the first k blocks cover up to frontier[k]: a gap fits there (from
        # the wall on, where the gap's start would straddle it).
        at = np.concatenate([[0], np.maximum.accumulate(hi)])
        if wall is not None:
            at = np.where((at < wall) & (wall < at + sizes[i]), wall, at)
        fits = np.concatenate([lo, [np.iinfo(np.int64).max]]) - at >= sizes[i]
        offsets[i] = at[np.argmax(fits)]
        placed[i] = True
    return offsets


# A step's table: one column per request, these rows (the core's record, then next_died).
SIZE, BORN, DIED, CALL, LANE, LANE_BORN, LANE_DIED, NEXT_DIED = range(8)


class Layout(NamedTuple):
    """A plan's arena: its bytes, each request's offset in even and in odd steps, the most
    bytes its blocks can hold at once (no placement holds less), and the bytes of its
    first chunk (`layout`)."""

    arena_bytes: int
    even: np.ndarray
    odd: np.ndarray
    peak: int
    first_bytes: int


def layout(table: np.ndarray, *, first_step: bool = False, wall: int | None = None) -> Layout:
    """A plan for a recorded step, one arena (`Layout`). `table`: rows `SIZE` ...
    `NEXT_DIED` (see `Planner.step_ended`), a column per request.

    `first_step`: the plan's first step is an even one, whose step before kept its results
    outside the arena (the warm-up's, or the split pool's): the even places are packed
    first, into the arena's first chunk, which that step holds alone; the odd ones then
    fill the rest and a second chunk, taken once the first step is over (the results
    outside have died by then). `wall`: the end of the first chunk of the arena in use,
    which no block may straddle.

    The arena is packed by `place` over the circular two-step schedule: a step lasts `T`
    ticks, a block that dies within an even step lives over ``[born, died)`` and within an
    odd one over ``[T + born, T + died)``; one that outlives an even step dies at
    ``next_died`` in the odd one after it, so it lives over ``[born, T + next_died)``, and
    one of an odd step over ``[T + born, 2T)`` and ``[0, next_died)`` (``next_died < 0``: it
    outlives the next step too, and keeps its place all the time). So a step's results take
    the bytes of the step before's that died before them, and its temporaries those of the
    results that are not yet made.

    Requests made in the lanes of a threaded kernel call that die in their lane are placed
    by their lane's own clock, which threads do not change, each lane beside the others, all
    for the call's span on the step's clock (from its first request to the last death in a
    lane); the call's requests that outlive it are born at its start.

    >>> out_of_lanes = [[-1, -1]] * 4  # call, lane, lane_born, lane_died
    >>> size, even, odd, peak, first = layout(np.array([[512, 1024], [0, 1], [-1, 2], *out_of_lanes, [1, -1]]))
    >>> size, even.tolist(), odd.tolist(), peak  # a result (two places) and a temporary
    (1536, [1024, 0], [0, 512], 1536)
    """
    size, born, died, call, lane, lane_born, lane_died, next_died = (np.asarray(r, dtype=np.int64) for r in table)
    in_lane = (call >= 0) & (lane_died >= 0) & (died >= 0)
    calls = np.unique(call[in_lane])
    inner = np.zeros(len(size), dtype=np.int64)  # in-lane requests: offset within their call
    region = np.zeros((len(calls), 3), dtype=np.int64)  # per call: bytes, start, stop
    born = born.copy()
    for c in np.unique(call[call >= 0]):  # a call's requests may come in any order within it
        born[call == c] = born[call == c].min()
    for k, c in enumerate(calls):
        start, stop, base = born[call == c].min(), died[in_lane & (call == c)].max() + 1, 0
        for ln in np.unique(lane[in_lane & (call == c)]):
            mine = np.flatnonzero(in_lane & (call == c) & (lane == ln))
            offsets, span = place(size[mine], lane_born[mine], lane_died[mine])
            inner[mine] = base + offsets
            base += span
        region[k] = base, start, stop
    free = np.flatnonzero(~in_lane)
    sizes = np.concatenate([size[free], region[:, 0]])
    even, odd, arena_bytes, peak, first_bytes = _circular(
        sizes, np.concatenate([born[free], region[:, 1]]), np.concatenate([died[free], region[:, 2]]),
        np.concatenate([next_died[free], np.full(len(calls), -1)]), first_step, wall,
    )
    even_at, odd_at = np.empty(len(size), dtype=np.int64), np.empty(len(size), dtype=np.int64)
    even_at[free], odd_at[free] = even[: len(free)], odd[: len(free)]
    lanes = np.flatnonzero(in_lane)
    of_call = np.searchsorted(calls, call[lanes])
    even_at[lanes] = even[len(free) + of_call] + inner[lanes]
    odd_at[lanes] = odd[len(free) + of_call] + inner[lanes]
    return Layout(arena_bytes, even_at, odd_at, peak, first_bytes)


def _circular(size: np.ndarray, born: np.ndarray, died: np.ndarray, next_died: np.ndarray, first_step: bool, wall: int | None) -> tuple:
    # `layout`'s circle of two steps: each block's place in an even and in an odd step, the
    # bytes spanned, the most bytes alive at once, and the bytes of the first chunk.
    n, ticks = len(size), int(max(born.max(initial=0), died.max(initial=0), next_died.max(initial=0))) + 1
    kept, whole = died < 0, (died < 0) & (next_died < 0)  # whole: alive all round the circle
    start = np.concatenate([np.where(whole, 0, born), np.where(whole, 0, ticks + born)])
    stop = np.concatenate([
        np.where(whole, 2 * ticks, np.where(kept, ticks + next_died, died)),
        np.where(whole, 2 * ticks, np.where(kept, 2 * ticks, ticks + died)),
    ])  # fmt: skip
    wrap_stop = np.concatenate([np.zeros(n, np.int64), np.where(kept & ~whole, next_died, 0)])
    sizes, zeros = np.concatenate([size, size]), np.zeros(2 * n, np.int64)
    first = np.arange(2 * n) < n if first_step else None
    offsets, span = place(sizes, start, stop, zeros, wrap_stop, first=first, wall=wall)
    first_bytes = int((offsets[:n] + size).max(initial=0)) if first_step else span if wall is None else wall
    return offsets[:n], offsets[n:], span, peak_bytes(sizes, start, stop, zeros, wrap_stop) if n else 0, min(first_bytes, span)


class Planner:
    """When a cache plans: `step_ended` gets each step's record from the core and has the
    core install (``install_plan``) or drop (``drop_plan``) a plan. Thread safe: steps may
    end in any thread.

    - A step is what the training verbs mark (`luxnn.memory.step`): one
      ``single_train_step``, or a ``compute_gradients`` and the ``apply_gradients`` after it.
    - A plan is made when a step repeats the requests (their sizes, calls and lanes) of
      the step before it, from the lifetimes of both. Steps with no recorded request are
      no part of it.
    - A step with the plan's requests that the plan missed, and whose lifetimes reach
      beyond those the plan was made from, widens it: every block's lifetime becomes the
      union of what the steps showed (the arena in use must hold the widened plan; one it
      cannot hold is not tried again).
    - A step with other requests (an evaluation step, a short last batch, another length
      bucket) leaves the plan alone: free bytes of its arena and the pools serve it. When
      such a step repeats the one before it, and not only once in a while (two unlike the
      plan in a row), it replaces the plan, in the same arena where that holds it: the
      loop's shapes changed, or vary (lengths in buckets), and the arena stays one.
    - A first plan whose arena would hold more than both the split pool held for the same
      step (in the warm-up: `BUDGET` times the step's peak of large blocks) and `BUDGET`
      times the most bytes its own blocks can hold at once is not made; neither is one
      that found no room (the cache's limit, out of memory). Either is not tried again for
      the same requests during `RETRY_AFTER` steps. One that had to wait (LATER: the arena
      it replaces was in use) is tried again with the next step's record.
    - A first plan cuts its arena in two chunks (`layout`'s ``first_step``) when that holds
      at most `STEADY_BUDGET` times its peak, or no more than one chunk would.
    """

    RETRY_AFTER = 64
    WARM_UP_STEPS = 4

    def __init__(self, core: Any) -> None:
        self._core = core
        self._lock = threading.RLock()  # before_step holds it around step_ended
        with _planners_lock:
            _planners.add(self)
        self._planned: np.ndarray | None = None  # the table (`layout`) it covers
        self._strangers = 0  # steps in a row unlike the plan's
        self._refused: tuple[np.ndarray, int] | None = None  # requests, steps left before a retry
        self._unfit: np.ndarray | None = None  # a widened plan the arena in use had no room for
        self._wall = 0  # the end of the first chunk of the plan's arena
        self._warm_up = WarmUp(core, self.WARM_UP_STEPS)

    def served(self, misses: int, planned: bool) -> bool:
        """Whether a step was served whole by this planner's plan (`planned`: a plan is
        installed; `misses`: the step's requests it did not serve): then its record holds
        nothing new."""
        with self._lock:
            if misses or not planned or self._planned is None:
                return False
            self._strangers = 0
            return True

    def before_step(self, outside: Callable[[], ContextManager[Any]]) -> None:
        """Before a step begins: take the record of the step that ended last, if any, and
        plan from it. Its arrays are made inside ``outside()`` (the `uncached` scope: none of
        them comes from a cache). A step the plan served whole holds nothing new, and costs
        no more than taking its record."""
        with self._lock:  # records are taken and read in one order
            record = self._core.take_record()
            if record is None or self.served(record.misses, record.planned):
                return
            with outside():
                self.step_ended(record.rows, record.misses, record.planned, self._held_without_plan(record), record.previous)

    @staticmethod
    def _held_without_plan(record: Any) -> int:
        """The most bytes a first plan for a step's large requests may hold: what the split
        pool held for them, or, where it held less than they used at once (the warm-up sent
        them upstream at their size, or a plan served them), the design's `BUDGET` times
        their peak."""
        return record.split_peak if record.split_peak >= record.large_peak else int(BUDGET * record.large_peak)

    def step_ended(self, rows: bytes, misses: int, planned: bool, without_plan: int, previous: bytes = b"") -> None:
        """Take an ended step's record (the core's ``take_record``): native int64 rows of
        (size, born, died, call, lane, lane_born, lane_died) (`layout`), its plan misses,
        whether a plan is installed, the most bytes a first plan may hold
        (`_held_without_plan`), and the step before's rows with their next_died (its
        blocks' deaths in this step; empty if not known)."""
        record, before = _table(rows, NEXT_DIED), _table(previous, NEXT_DIED + 1)
        with self._lock:
            self._decide(record, before, misses, planned, without_plan)
            self._warm_up.step_ended(done=self._planned is not None or self._refused is not None)

    def _decide(self, record: np.ndarray, before: np.ndarray, misses: int, planned: bool, without_plan: int) -> None:
        # step_ended's decision, with the lock held.
        if not planned:
            self._planned = None  # none was made, or the cache dropped it (free, trim, eviction)
        if self._refused is not None:
            self._refused = None if self._refused[1] <= 1 else (self._refused[0], self._refused[1] - 1)
        if not ((record[SIZE] > _core.SPLIT_ABOVE) | (record[CALL] >= 0)).any():
            return  # only small requests, which the small pool serves well: no plan
        repeats = _same_requests(record, before)
        if self._planned is not None and _same_requests(record, self._planned):
            self._strangers = 0
            if misses == 0:
                return
            widened = _union(self._planned, _lifetimes(record, before if repeats else None))
            if repeats:
                widened = _union(widened, before)
            if np.array_equal(widened, self._planned) or (self._unfit is not None and np.array_equal(widened, self._unfit)):
                return  # the misses came from elsewhere (an array kept longer), or it was tried
        else:
            if self._planned is not None:
                self._strangers += 1
            if not repeats or (self._planned is not None and self._strangers < 2):
                return
            widened = _union(before, _lifetimes(record, before))
        if self._refused is not None and _same_requests(widened, self._refused[0]):
            return
        plan = self._layout(widened)
        # The peak counts each kernel call's lanes as if all ran at once, which another
        # interleaving of its threads may do: no plan is refused for how they ran this time.
        if self._planned is None and plan.arena_bytes > max(without_plan, BUDGET * plan.peak):
            status = PlanStatus.NO_GAIN
        else:
            columns = [widened[SIZE], plan.even, plan.odd, np.zeros_like(plan.even), widened[CALL], widened[LANE]]
            columns = [np.ascontiguousarray(c, dtype=np.int64) for c in columns]
            status = PlanStatus(self._core.install_plan(plan.arena_bytes, 0, *columns, plan.first_bytes))
        self._unfit = None
        if status == PlanStatus.INSTALLED:
            # The arena's cut is a first plan's: a plan that replaces one goes into its arena
            # (one that spans less, in its first chunk) or into one cut where it was.
            self._wall = plan.first_bytes if self._planned is None else self._wall
            self._planned, self._strangers = widened, 0
        elif status in (PlanStatus.NO_ROOM, PlanStatus.NO_GAIN):
            self._planned, self._refused = None, (widened, self.RETRY_AFTER)
        elif self._planned is not None:
            self._unfit = widened  # LATER: the arena in use is too small for it; not again
        # LATER without a plan: the next step's record has this one's as its step before


    def _layout(self, table: np.ndarray) -> Layout:
        # A first plan's first step holds its first chunk alone, where that costs little in
        # the steady state; a plan that replaces one keeps its arena's cut.
        if self._planned is not None:
            return layout(table, wall=self._wall)
        whole, cut = layout(table), layout(table, first_step=True)
        return cut if cut.arena_bytes <= max(whole.arena_bytes, STEADY_BUDGET * whole.peak) else whole


def _table(raw: bytes, rows: int) -> np.ndarray:
    """A record's native int64 rows as a table of `rows` rows (`layout`), a column per
    request, in the order in which the core matches requests to slots: those out of
    lanes by size and then by birth, whatever order threads made requests of different
    sizes in; then those of lanes by call, lane and birth on the lane's clock."""
    table = np.frombuffer(raw, dtype=np.int64).reshape(-1, rows).T
    laned = table[CALL] >= 0
    order = np.lexsort((np.where(laned, table[LANE_BORN], table[BORN]), np.where(laned, 0, table[SIZE]), table[LANE], table[CALL]))
    return table[:, order].copy()


def _same_requests(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two tables hold the same requests: sizes, calls and lanes."""
    return a.shape[1] == b.shape[1] and all(np.array_equal(a[r], b[r]) for r in (SIZE, CALL, LANE))


def _lifetimes(record: np.ndarray, before: np.ndarray | None) -> np.ndarray:
    """A step's table with its `NEXT_DIED`: its blocks that outlive it are taken to die in
    the next step when the same block of the step before died in this one (not yet known
    for this step's), or to outlive it too where that is not known."""
    next_died = np.full(record.shape[1], -1, dtype=np.int64)
    if before is not None:
        next_died = np.where(before[DIED] < 0, before[NEXT_DIED], -1)
    return np.vstack([record, next_died])


def _union(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Lifetimes that cover both tables' (the same requests): earliest birth, latest
    death, outliving the step if either did, and then the latest death in the next step
    (-1, outliving that too, if either did); in a lane likewise, dying out of it if either
    did."""
    kept = (a[DIED] < 0) | (b[DIED] < 0)
    next_a, next_b = (np.where(x[DIED] < 0, x[NEXT_DIED], -2) for x in (a, b))  # -2: not kept there
    next_died = np.where((next_a == -1) | (next_b == -1), -1, np.maximum(next_a, next_b))
    out = a.copy()
    out[BORN], out[LANE_BORN] = np.minimum(a[BORN], b[BORN]), np.minimum(a[LANE_BORN], b[LANE_BORN])
    out[DIED], out[NEXT_DIED] = np.where(kept, -1, np.maximum(a[DIED], b[DIED])), np.where(kept, next_died, -1)
    out[LANE_DIED] = np.where((a[LANE_DIED] < 0) | (b[LANE_DIED] < 0), -1, np.maximum(a[LANE_DIED], b[LANE_DIED]))
    return out


class WarmUp:
    """The warm-up: until a cache's first plan is installed or refused, or `steps` steps
    with recorded requests have gone by without one, the core serves those requests
    upstream at their size and gives them back when they die (``set_warm_up``), so the
    steps a plan is made from hold no more than they use; after it, the split pool serves
    what no plan does."""

    def __init__(self, core: Any, steps: int) -> None:
        self._core, self._left = core, steps
        core.set_warm_up(steps > 0)

    def step_ended(self, done: bool) -> None:
        if self._left > 0:
            self._left = 0 if done else self._left - 1
            if self._left == 0:
                self._core.set_warm_up(False)


# Fork copies only the forking thread: a planner's lock held by another thread would stay
# held in the child for ever, over a half-made decision. So the forking thread takes every
# planner's lock before the fork (the core's locks: ``csrc/fork.c``), the parent
# releases them after it, and the child, whose only thread holds them, starts afresh.
_planners: weakref.WeakSet[Planner] = weakref.WeakSet()
_planners_lock = threading.Lock()  # over adding to _planners and iterating it
_held: list[Planner] = []


def _before_fork() -> None:
    with _planners_lock:
        planners = list(_planners)
    for planner in planners:
        planner._lock.acquire()
        _held.append(planner)


def _after_fork_in_parent() -> None:
    while _held:
        _held.pop()._lock.release()


def _after_fork_in_child() -> None:
    global _planners_lock
    _planners_lock = threading.Lock()
    for planner in _held:
        planner._lock = threading.RLock()
    _held.clear()


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child)
