"""Step plans: where each block of a repeated step lives (served by ``csrc/plan.c``).

A training loop repeats one step: the same requests, with the same lifetimes. Online
placement cannot know which block dies when, so it holds more than the step uses at its
peak; a plan made from earlier steps can place every block where it fits between the
blocks alive at the same time. (What that saves, row by row: BENCHMARKS.md.) What a plan
cannot remove: blocks kept for two steps or more, and what the pools serve between steps.

The core records each training step, as the verbs mark it (`luxnn.memory.step`): every
request, the smallest too (a bias made anew each step, out of place, left in a slab, kept
the slab's other bytes idle over the step's peak), with a clock at its allocation and at
its death (-1: still alive when the next step began, and then its death on the next step's
clock), and for one made in a lane of a threaded kernel (`luxnn.parallel.for_blocks`), the
kernel call, the lane and the lane's own clock. `Planner` turns two steps with the same
requests (a signature) into a plan, packed over the circular two-step schedule (`layout`),
where a kernel call's lanes sit side by side for the call's span, each packed by its own
clock, which no interleaving of the threads changes. A loop whose shapes vary (a short last
batch, lengths in buckets, an evaluation pass) gets a plan per signature, up to
`MAX_PLANS`, all in one arena; the core picks the plan for a step by its first requests
above `MATCH_ABOVE` (the smaller ones are alike in every shape), and blocks that outlive
their step keep the same places in every plan (a step no plan follows, of shapes not
planned yet, takes for its requests above `MATCH_ABOVE` the places of their size and rank
in a plan, where free: its results then sit where the next step's plan expects them; its
smaller ones take the pools'). The first plan's first step needs only the arena's first
chunk, beside the warm-up's results it replaces.
A plan that misses is widened where a later step's lifetimes reach beyond it. The core
serves a request at its planned place only when every byte there is free, so a plan (or
the choice of one) can cost misses but never an overlap.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, ContextManager, NamedTuple

import numpy as np

from . import _core

__all__ = ["place", "layout", "Layout", "Planner", "PlanStatus", "MAX_PLANS"]


BUDGET = 1.10
"""Peak reserved / peak live that the cache keeps to over a whole run (docs/design.md)."""
STEADY_BUDGET = 1.05
"""The same, once the loop is planned."""
SHAPES_BUDGET = 1.25
"""The same for a loop whose shapes vary (docs/design.md): a plan may grow the arena to this."""

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
    *, first: np.ndarray | None = None, early: np.ndarray | None = None, wall: int | None = None,
    fixed: np.ndarray | None = None,
) -> tuple[np.ndarray, int]:
    """Offsets for blocks of `sizes` bytes alive over ``[born, died)`` (and, if given, also
    over ``[born2, died2)``; an empty interval adds nothing) such that no two blocks alive at
    the same time overlap; returns ``(offsets, bytes spanned)``. `first` (a mask): these
    blocks are placed before the others, which then never straddle the first ones' span;
    `early` (a mask): these are placed before the others (with `first`: before the other
    first ones), from offset 0, none sharing a byte with another (as if all were alive
    together), and the others fill around them;
    `wall`: no block straddles this offset; `fixed`: an offset per block, or -1: a block
    keeps the offset given where it overlaps no block kept before it that is alive with it.

    Each block at the lowest offset that clears the blocks already placed and alive with
    it, in several orders, keeping the smallest span: from the largest block down (Pisarchyk
    and Lee, "Efficient Memory Management for Deep Neural Net Inference", 2020), from the
    longest-lived down (XLA's heap simulator tries both), by birth; then, from the best of
    them, up to `REORDERINGS` times the blocks that reach the top of the span move to the
    front of the order ("squeaky wheel" optimisation, Joslin and Clements 1999), until an
    order spans no more than the most bytes alive at once (no placement spans less). On the
    circular schedule of a step the first three can miss by whole blocks that the
    reorderings place (a transformer block's step: 1.087x its peak, then 1.000x after 35).
    n vectorised steps per order. The blocks of at most `MATCH_ABOVE` bytes, most of a
    step's requests and few of its bytes, go last, in one pass from the largest down, into
    the gaps the others leave.

    >>> MiB = 1 << 20
    >>> offsets, span = place(np.array([4, 4, 8]) * MiB, np.array([0, 1, 3]), np.array([2, 3, 4]))
    >>> (offsets // MiB).tolist(), span // MiB    # the first two overlap in time, the third follows both
    ([0, 4, 0], 8)
    """
    sizes, born, died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died))
    born2 = np.zeros_like(born) if born2 is None else np.asarray(born2, dtype=np.int64)
    died2 = np.zeros_like(died) if died2 is None else np.asarray(died2, dtype=np.int64)
    lives = (born, died, born2, died2)
    offsets, placed = np.zeros(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=bool)
    if fixed is not None:
        offsets, placed = _keep_fixed(sizes, lives, np.asarray(fixed, dtype=np.int64))
    if first is not None and first.any():
        assert fixed is None, "first and fixed blocks exclude each other"
        inner = early[first] if early is not None else None
        offsets[first], wall = place(sizes[first], *(x[first] for x in lives), early=inner, wall=wall)
        placed = first.copy()
    elif early is not None and early.any():
        assert fixed is None, "early and fixed blocks exclude each other"
        n = int(early.sum())
        offsets[early], _ = place(sizes[early], np.zeros(n), np.ones(n), wall=wall)
        placed = early.copy()
    # The blocks of at most MATCH_ABOVE bytes last, in one pass, into the gaps the others
    # leave: each order costs a pass over every block, and the small ones are most of a
    # step's requests and few of its bytes.
    last = ~placed & (sizes <= MATCH_ABOVE)
    rest, ahead = ~placed & ~last, ~last  # ahead: placed before the last ones, or by now
    if rest.any():
        bound = peak_bytes(sizes[ahead], *(x[ahead] for x in lives))
        span_of = np.maximum(died - born, 0) + np.maximum(died2 - born2, 0)
        start = np.where(died > born, born, born2)
        orders = [np.lexsort((born, -sizes)), np.lexsort((born, -sizes, -span_of)), np.lexsort((-sizes, start))]
        best = None
        for k in range(len(orders) + REORDERINGS):
            if k < len(orders):
                order = orders[k][rest[orders[k]]]
            else:  # the blocks at the top of the last span first, the others as they were
                top = (at[order] + sizes[order] == span)
                order = np.concatenate([order[top], order[~top]])
            at = _first_fit(order, sizes, lives, offsets.copy(), placed.copy(), wall)
            span = int((at + sizes)[ahead].max())
            if best is None or span < best[1]:
                best = (at, span, order)
            if best[1] <= bound:
                break
            if k == len(orders) - 1:
                at, span, order = best
        offsets, placed = best[0], placed | rest
    if last.any():
        order = np.flatnonzero(last)[np.lexsort((born[last], -sizes[last]))]
        offsets = _first_fit(order, sizes, lives, offsets.copy(), placed.copy(), wall)
    return offsets, int((offsets + sizes).max(initial=0))


REORDERINGS = 64


def peak_bytes(sizes: np.ndarray, born: np.ndarray, died: np.ndarray, born2: np.ndarray, died2: np.ndarray) -> int:
    """The most bytes of blocks alive at once (as in `place`): no placement spans less.

    >>> int(peak_bytes(np.array([4, 4, 8]), np.array([0, 1, 3]), np.array([2, 3, 4]), np.zeros(3), np.zeros(3)))
    8
    """
    at = np.concatenate([born, born2])  # the bytes alive change only where a block is born
    alive = ((born <= at[:, None]) & (at[:, None] < died)) | ((born2 <= at[:, None]) & (at[:, None] < died2))
    return int((alive * sizes).sum(axis=1).max())


def _alive_with(i: int, lives: tuple) -> np.ndarray:
    # Which blocks are alive at some time with block i.
    born, died, born2, died2 = lives
    return (
        ((born < died[i]) & (born[i] < died)) | ((born2 < died[i]) & (born[i] < died2))
        | ((born < died2[i]) & (born2[i] < died)) | ((born2 < died2[i]) & (born2[i] < died2))
    )  # fmt: skip


def _keep_fixed(sizes: np.ndarray, lives: tuple, fixed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # `place`'s fixed offsets, each where it overlaps none kept before it and alive with it.
    offsets, placed = np.zeros(len(sizes), dtype=np.int64), np.zeros(len(sizes), dtype=bool)
    for i in np.flatnonzero(fixed >= 0):
        others = np.flatnonzero(placed & _alive_with(i, lives))
        if not ((offsets[others] < fixed[i] + sizes[i]) & (fixed[i] < offsets[others] + sizes[others])).any():
            offsets[i], placed[i] = fixed[i], True
    return offsets, placed


def _first_fit(order: np.ndarray, sizes: np.ndarray, lives: tuple, offsets: np.ndarray, placed: np.ndarray, wall: int | None) -> np.ndarray:
    for i in order:
        others = np.flatnonzero(placed & _alive_with(i, lives))
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


def layout(
    table: np.ndarray, *, first_step: bool = False, wall: int | None = None,
    fixed: tuple[np.ndarray, np.ndarray] | None = None, kept_first: bool = False,
) -> Layout:
    """A plan for a recorded step, one arena (`Layout`). `table`: rows `SIZE` ...
    `NEXT_DIED` (see `Planner.step_ended`), a column per request.

    `first_step`: the plan's first step is an even one, whose step before kept its results
    outside the arena (the warm-up's, or the split pool's): the even places are packed
    first, into the arena's first chunk, which that step holds alone, those of blocks that
    outlive the step from the chunk's start (unless among the others they span less); the
    odd ones then fill the rest and a second chunk, taken once the first step is over (the
    results outside have died by then). `wall`: the end of the first chunk of the arena in
    use, which no block may straddle. `fixed`: for each request its places in even and odd
    steps, or -1: a request that outlives the step keeps the places given (those of another
    plan's blocks of its size, which steps of either plan carry into the next) where that
    overlaps no other block kept so (see `place`). `kept_first`: the requests that outlive
    the step are placed first, from the arena's start, both places of each apart from the
    others': places that a plan of other requests can keep at little cost.

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

    >>> MiB, out_of_lanes = 1 << 20, [[-1, -1]] * 4  # call, lane, lane_born, lane_died
    >>> size, even, odd, peak, first = layout(np.array([[MiB, 2 * MiB], [0, 1], [-1, 2], *out_of_lanes, [1, -1]]))
    >>> size // MiB, (even // MiB).tolist(), (odd // MiB).tolist(), peak // MiB  # a result (two places) and a temporary
    (3, [2, 0], [0, 1], 3)
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
    pins = None
    if fixed is not None:  # only blocks that outlive the step keep places
        unpinned = np.full(len(calls), -1)
        pins = [np.concatenate([np.where(died[free] < 0, f[free], -1), unpinned]) for f in fixed]
    even, odd, arena_bytes, peak, first_bytes = _circular(
        sizes, np.concatenate([born[free], region[:, 1]]), np.concatenate([died[free], region[:, 2]]),
        np.concatenate([next_died[free], np.full(len(calls), -1)]), first_step, wall, pins, kept_first,
    )
    even_at, odd_at = np.empty(len(size), dtype=np.int64), np.empty(len(size), dtype=np.int64)
    even_at[free], odd_at[free] = even[: len(free)], odd[: len(free)]
    lanes = np.flatnonzero(in_lane)
    of_call = np.searchsorted(calls, call[lanes])
    even_at[lanes] = even[len(free) + of_call] + inner[lanes]
    odd_at[lanes] = odd[len(free) + of_call] + inner[lanes]
    return Layout(arena_bytes, even_at, odd_at, peak, first_bytes)


def _circular(
    size: np.ndarray, born: np.ndarray, died: np.ndarray, next_died: np.ndarray, first_step: bool, wall: int | None,
    fixed: list | None, kept_first: bool,
) -> tuple:
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
    pins = None if fixed is None else np.concatenate(fixed)
    # A first step's kept blocks from its chunk's start, unless among its others they span
    # less: in the odd step, where they still live, at the start they leave the chunk's
    # other bytes in one piece (a 512-B result in its middle pushed an odd step's 1 MiB
    # temporary above the chunk), and they are places other plans can keep.
    if kept_first:
        earlies = [np.concatenate([kept, kept])]
    elif first_step and kept.any():
        earlies = [np.concatenate([kept, np.zeros(n, bool)]), None]
    else:
        earlies = [None]
    offsets, span = min(
        (place(sizes, start, stop, zeros, wrap_stop, first=first, early=early, wall=wall, fixed=pins) for early in earlies),
        key=lambda placed: placed[1],
    )
    first_bytes = int((offsets[:n] + size).max(initial=0)) if first_step else span if wall is None else wall
    return offsets[:n], offsets[n:], span, peak_bytes(sizes, start, stop, zeros, wrap_stop) if n else 0, min(first_bytes, span)


MAX_PLANS = _core.MAX_PLANS
"""Plans a cache keeps at once, one per request-size signature; beyond them the least
recently used one goes."""

MATCH_ABOVE = _core.MATCH_ABOVE
"""Bytes above which a step's requests out of lanes pick its plan (a plan's sequence)."""


@dataclasses.dataclass
class _Plan:
    """A plan the planner keeps: the lifetimes it was made from (`layout`'s table), its
    place in the core, whether its blocks kept across steps are at the places every plan
    keeps them (then it may stand in for a step no plan follows, ``set_stand_ins``), and
    a widening of it the arena had no room for (not tried again)."""

    table: np.ndarray
    place: int
    stand_in: bool
    unfit: np.ndarray | None = None


class Planner:
    """When a cache plans: `step_ended` gets each step's record from the core and has the
    core install plans (``install_plan``). Thread safe: steps may end in any thread.

    - A step is what the training verbs mark (`luxnn.memory.step`): one
      ``single_train_step``, or a ``compute_gradients`` and the ``apply_gradients`` after it.
      Its signature is its requests' sizes, calls and lanes; steps with no recorded
      request are no part of it.
    - A plan is made for a signature once a step of it repeats one seen before (the step
      before it, or any of the last ``2 * MAX_PLANS`` signatures seen), from the lifetimes
      of both. Up to `MAX_PLANS` plans are kept, one per signature (a short last batch,
      each bucket of sequence lengths, an evaluation pass); a new one beyond them replaces
      the least recently used. They share one arena, which grows to the largest (its
      second chunk, or, where no block lives in it, one chunk as large), and the core picks
      the plan that serves a step by the step's first requests (``csrc/plan.c``, "Step
      plans").
    - Blocks that outlive their step (new parameters and optimizer state, of the same sizes
      whatever the shapes) take the same places in every plan: a step served by one plan
      carries them into a step served by another, which then finds its places free; so
      does a step of shapes not planned yet, whose requests the core serves at the places
      of their size and rank in a plan (one whose kept blocks are at those places). A plan
      that cannot keep the places other plans have at little cost places its kept blocks
      apart from the arena's start (`layout`'s ``kept_first``), and the others are laid out
      again at those, one a step.
    - A step its plan missed, whose lifetimes reach beyond those the plan was made from,
      widens it: every block's lifetime becomes the union of what the steps showed (one
      the arena has no room for is not tried again).
    - A first plan whose arena would hold more than both the split pool held for the same
      step and `BUDGET` times the most bytes its own blocks can hold at once is not made (a
      plan that grows the arena: `SHAPES_BUDGET`); in the warm-up, where the pool served
      none of them, a plan is made whatever its arena, as the pools would place the same
      blocks online and hold more; neither is one that found no room (the cache's limit,
      out of memory). Either is not tried again for the same signature during
      `RETRY_AFTER` steps. One that had to wait (LATER: the arena must grow where a block
      lives, or it was cut elsewhere) is tried again with the next step, as often.
    - A first plan cuts its arena in two chunks (`layout`'s ``first_step``) when that holds
      at most `STEADY_BUDGET` times its peak, or no more than one chunk would.
    """

    RETRY_AFTER = 64
    WARM_UP_STEPS = 8

    def __init__(self, core: Any) -> None:
        self._core = core
        self._lock = threading.RLock()  # before_step holds it around step_ended
        with _planners_lock:
            _planners.add(self)
        self._plans: OrderedDict[bytes, _Plan] = OrderedDict()  # by signature, least recently used first
        self._seen: OrderedDict[bytes, np.ndarray] = OrderedDict()  # signatures not planned: their latest table
        self._pending: tuple[bytes, np.ndarray, int] | None = None  # signature, table, tries left
        self._refused: dict[bytes, int] = {}  # signature -> steps left before a retry
        self._kept: dict[tuple[int, int], tuple[int, int]] = {}  # (size, rank): places of a block kept across steps
        self._repin: list[bytes] = []  # plans to lay out again at the kept places
        self._arena = (0, 0, 0)  # the core's arena: bytes, cut, live bytes (0, 0, 0: none)
        self._warm_up = WarmUp(core, self.WARM_UP_STEPS)

    @property
    def plans(self) -> int:
        """The plans kept now (at most `MAX_PLANS`)."""
        with self._lock:
            return len(self._plans)

    def before_step(self, outside: Callable[[], ContextManager[Any]]) -> None:
        """Before a step begins: take the record of the step that ended last, if any, and
        plan from it. Its arrays are made inside ``outside()`` (the `uncached` scope: none of
        them comes from a cache). A step with no request a plan is made for (only ones of
        at most `MATCH_ABOVE` bytes, out of lanes), or one its plan served whole, holds nothing new, and costs no
        more than taking its record."""
        with self._lock:  # records are taken and read in one order
            record = self._core.take_record()
            if record is None:
                return
            if not record.plannable:
                self._warm_up.end()
                return
            if self._served_whole(record):
                self._warm_up.step_ended(None)
                return
            with outside():
                self.step_ended(record)

    def forget_step(self) -> None:
        """The record of the step that ended last is dropped, not planned from: a step that
        was not done (`AllocCache.forget_step`)."""
        with self._lock:
            self._core.take_record()

    def _served_whole(self, record: Any) -> bool:
        # A step its plan served with no miss: that plan is now the most recently used.
        if record.misses or record.plan < 0 or not (record.installed >> record.plan) & 1 or self._pending or self._repin:
            return False
        key = next((key for key, kept in self._plans.items() if kept.place == record.plan), None)
        if key is not None:
            self._plans.move_to_end(key)
        return key is not None

    @staticmethod
    def _held_without_plan(record: Any) -> int | None:
        """What the split pool held for a step's large requests, or None where it held less
        than they used at once (the warm-up sent them upstream at their size, or a plan
        served them): then nothing tells what the pools would hold without a plan."""
        return record.split_peak if record.split_peak >= record.large_peak else None

    def step_ended(self, record: Any) -> None:
        """Take an ended step's record (the core's ``take_record``, a `_core.Record`): its
        native int64 rows of (size, born, died, call, lane, lane_born, lane_died)
        (`layout`), its plan misses, how many of its requests a plan is made for, the
        place of the plan that served it (or -1), the places that hold plans now (bits),
        the split pool's and the large blocks' peaks, the step before's rows with their
        next_died (its blocks' deaths in this step; empty if not known), and the core's
        arena (bytes and cut)."""
        with self._lock:
            self._forget_dropped(record)
            if record.plannable:
                self._warm_up.step_ended(self._decide(record))
            else:
                self._warm_up.end()

    def _forget_dropped(self, record: Any) -> None:
        # The plans the core no longer holds (free, trim, eviction, the limit), and with
        # its arena the places of kept blocks.
        for key in [key for key, kept in self._plans.items() if not (record.installed >> kept.place) & 1]:
            del self._plans[key]
        self._arena = (record.arena_bytes, record.arena_cut, record.arena_live)
        if not record.arena_bytes:
            self._kept.clear()
        for key in list(self._refused):
            self._refused[key] -= 1
            if self._refused[key] <= 0:
                del self._refused[key]

    def _decide(self, info: Any) -> PlanStatus | None:
        # step_ended's decision, with the lock held: the status of a plan tried, if any.
        record, before = _table(info.rows, NEXT_DIED), _table(info.previous, NEXT_DIED + 1)
        without_plan = self._held_without_plan(info)
        status = None
        if len(before.T) and _signature(before) not in self._plans:
            self._remember(_signature(before), _on_own_clock(before, record))  # now with its deaths in this step
        if self._pending is not None:
            key, table, tries = self._pending
            self._pending = None
            status = self._install(key, table, without_plan, tries - 1)
        elif self._repin:  # one a step: a plan laid out again at the kept places
            key = self._repin.pop()
            if key in self._plans:
                status = self._install(key, self._plans[key].table, without_plan, self.RETRY_AFTER)
        key = _signature(record)
        kept = self._plans.get(key)
        if kept is not None:
            self._plans.move_to_end(key)
            if info.misses == 0 or info.plan != kept.place:
                return status  # served whole, or (misses of its requests) by another plan
            widened = _union(kept.table, _lifetimes(record, kept.table))
            if len(before.T) and _signature(before) == key:
                widened = _union(widened, before)
            if np.array_equal(widened, kept.table) or (kept.unfit is not None and np.array_equal(widened, kept.unfit)):
                return status  # the misses came from elsewhere (an array kept longer), or it was tried
            table = widened
        else:
            seen = self._seen.pop(key, None)
            if seen is None:
                self._remember(key, _lifetimes(record, None))  # its deaths in the next step not known yet
                return status
            table = _union(seen, _lifetimes(record, seen))
        tried = self._install(key, table, without_plan, self.RETRY_AFTER)
        return status if status == PlanStatus.INSTALLED or tried is None else tried

    def _remember(self, key: bytes, table: np.ndarray) -> None:
        self._seen[key] = table
        self._seen.move_to_end(key)
        while len(self._seen) > 2 * MAX_PLANS:
            self._seen.popitem(last=False)

    def _install(self, key: bytes, table: np.ndarray, without_plan: int | None, tries: int) -> PlanStatus | None:
        # Have the core install a plan for `table`: in its signature's place, else a free
        # one, else the least recently used plan's.
        if key in self._refused or (self._pending is not None and self._pending[0] == key):
            return None
        kept = self._plans.get(key)
        arena_bytes, cut, live = self._arena
        plan, wall, pinned = self._layout(table)
        budget = BUDGET if not arena_bytes else SHAPES_BUDGET
        # The peak counts each kernel call's lanes as if all ran at once, which another
        # interleaving of its threads may do: no plan is refused for how they ran this time.
        # A plan over the budget is refused only for pools seen to hold less: without one
        # they place online and hold more still (a random loop's 1.16x arena, its 1.88x).
        if without_plan is not None and plan.arena_bytes > arena_bytes and plan.arena_bytes > max(without_plan, budget * plan.peak):
            status = PlanStatus.NO_GAIN
        else:
            place = kept.place if kept is not None else self._free_place()
            columns = [np.ascontiguousarray(c, dtype=np.int64) for c in (table[SIZE], plan.even, plan.odd, table[CALL], table[LANE])]
            out = (table[CALL] < 0) & (table[SIZE] > MATCH_ABOVE)
            sequence = np.ascontiguousarray(table[SIZE][out][np.argsort(table[BORN][out], kind="stable")], dtype=np.int64)
            status = PlanStatus(self._core.install_plan(
                place, plan.arena_bytes, *columns[:3], call=columns[3], lane=columns[4],
                cut=wall, sequence=sequence,
            ))  # fmt: skip
        if status == PlanStatus.INSTALLED:
            for other in [k for k, p in self._plans.items() if p.place == place]:
                del self._plans[other]  # the least recently used, replaced
            self._arena = self._arena_after(table[SIZE], plan, wall)
            if not pinned and arena_bytes and _kept_keys(table):
                # Its kept blocks apart from the arena's start: the places the others keep.
                self._kept.clear()
                self._repin = list(self._plans)
                for other in self._plans.values():
                    other.stand_in = False
            self._plans[key] = _Plan(table, place, self._keep_places(table, plan))
            self._core.set_stand_ins(sum(1 << p.place for p in self._plans.values() if p.stand_in))
        elif status == PlanStatus.LATER and tries > 0:
            self._pending = (key, table, tries)
        elif kept is not None:
            kept.unfit = table  # no room for the widened plan: not again
        else:
            self._refused[key] = self.RETRY_AFTER
        return status

    def _arena_after(self, sizes: np.ndarray, plan: Layout, wall: int) -> tuple[int, int, int]:
        # The core's arena once it installed `plan` (``lx_install_plan``): a new one, the
        # same, one chunk in an idle one's stead, or one whose second chunk grew.
        arena_bytes, cut, live = self._arena
        if not arena_bytes:
            return plan.arena_bytes, wall or plan.arena_bytes, 0
        across = any(((at < cut) & (cut < at + sizes)).any() for at in (plan.even, plan.odd))
        if not across and plan.arena_bytes <= arena_bytes:
            return self._arena
        size = max(plan.arena_bytes, arena_bytes)
        return (size, size, 0) if not live else (size, cut, live)

    def _free_place(self) -> int:
        taken = {kept.place for kept in self._plans.values()}
        free = [k for k in range(MAX_PLANS) if k not in taken]
        return free[0] if free else next(iter(self._plans.values())).place

    def _layout(self, table: np.ndarray) -> tuple[Layout, int, bool]:
        # A plan, the cut its places keep clear of, and whether it keeps the places other
        # plans have for the blocks kept across steps. A first plan's first step holds its
        # first chunk alone, where that costs little in the steady state. A plan into the
        # arena keeps those places, and keeps clear of those of blocks its step does not
        # make (another plan's step keeps them, an evaluation pass's output the loop holds
        # on), where that costs little (it fits the arena, or spans at most STEADY_BUDGET
        # times as much as the alternative), else places its kept blocks apart from the
        # arena's start, for the others to keep; and it keeps the arena's cut while a
        # block lives there (else the core makes it one chunk, as large as needed).
        arena_bytes, cut, live = self._arena
        if arena_bytes:
            wall = cut if live else None
            apart, pins = layout(table, wall=wall, kept_first=bool(_kept_keys(table))), self._pins(table)
            others, even, odd = self._kept_elsewhere(table)
            if (pins[0] >= 0).any() or others.shape[1]:  # kept places where they cost little
                n = others.shape[1]
                around = layout(np.hstack([others, table]), wall=wall, fixed=(np.concatenate([even, pins[0]]), np.concatenate([odd, pins[1]])))
                pinned = around._replace(even=around.even[n:], odd=around.odd[n:])
                if pinned.arena_bytes <= max(arena_bytes, STEADY_BUDGET * apart.arena_bytes):
                    return pinned, wall or 0, True
            return apart, wall or 0, False
        whole, first = layout(table), layout(table, first_step=True)
        plan = first if first.arena_bytes <= max(whole.arena_bytes, STEADY_BUDGET * whole.peak) else whole
        return plan, plan.first_bytes, False

    def _kept_elsewhere(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        # The blocks kept across steps that `table`'s step does not make and another plan's
        # does, at the places kept for them: columns of a table (`layout`), alive all
        # round, and their places in even and in odd steps.
        mine = {key for _, key in _kept_keys(table)}
        theirs = {key for kept in self._plans.values() for _, key in _kept_keys(kept.table)} - mine
        others = [(size, places) for (size, rank), places in self._kept.items() if (size, rank) in theirs]
        columns = np.full((NEXT_DIED + 1, len(others)), -1, dtype=np.int64)
        columns[SIZE], columns[BORN] = [size for size, _ in others], 0
        even, odd = (np.array([places[k] for _, places in others], dtype=np.int64) for k in (0, 1))
        return columns, even, odd

    def _pins(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        # The places in the arena of the blocks of `table` that outlive their step, where a
        # plan has them (-1: none), by size and rank within the size.
        even, odd = np.full(table.shape[1], -1, np.int64), np.full(table.shape[1], -1, np.int64)
        for i, key in _kept_keys(table):
            even[i], odd[i] = self._kept.get(key, (-1, -1))
        return even, odd

    def _keep_places(self, table: np.ndarray, plan: Layout) -> bool:
        # The places of `plan`'s kept blocks kept where none is yet; whether all of them
        # are at the places kept.
        agrees = True
        for i, key in _kept_keys(table):
            places = (int(plan.even[i]), int(plan.odd[i]))
            agrees &= self._kept.setdefault(key, places) == places
        return agrees


def _signature(table: np.ndarray) -> bytes:
    """A step's requests (sizes, calls and lanes), as a key."""
    return table[[SIZE, CALL, LANE]].tobytes()


def _kept_keys(table: np.ndarray) -> list[tuple[int, tuple[int, int]]]:
    """(column, (size, rank among them of its size)) of each request that outlives its step."""
    kept = np.flatnonzero(table[DIED] < 0)
    ranks: dict[int, int] = {}
    keys = []
    for i in kept:
        size = int(table[SIZE, i])
        keys.append((int(i), (size, ranks.setdefault(size, 0))))
        ranks[size] += 1
    return keys


def _table(raw: bytes, rows: int) -> np.ndarray:
    """A record's native int64 rows as a table of `rows` rows (`layout`), a column per
    request, in the order in which the core matches requests to slots: those out of
    lanes by size and then by birth, whatever order threads made requests of different
    sizes in; then those of lanes by call, lane and birth on the lane's clock."""
    table = np.frombuffer(raw, dtype=np.int64).reshape(-1, rows).T
    laned = table[CALL] >= 0
    order = np.lexsort((np.where(laned, table[LANE_BORN], table[BORN]), np.where(laned, 0, table[SIZE]), table[LANE], table[CALL]))
    return table[:, order].copy()


def _lifetimes(record: np.ndarray, before: np.ndarray | None) -> np.ndarray:
    """A step's table with its `NEXT_DIED`: its blocks that outlive it are taken to die in
    the next step when the same block of the step before died in this one (not yet known
    for this step's), or to outlive it too where that is not known."""
    next_died = np.full(record.shape[1], -1, dtype=np.int64)
    if before is not None:
        next_died = np.where(before[DIED] < 0, before[NEXT_DIED], -1)
    return np.vstack([record, next_died])


def _on_own_clock(table: np.ndarray, successor: np.ndarray) -> np.ndarray:
    """`table` with the deaths of its blocks that outlive it (`NEXT_DIED`, measured in the
    step after it, `successor`'s table) on the clock of a step of its own requests, which
    the circular schedule of its plan assumes: a step of other requests has another
    clock. There, a death after the successor's last request is one at the step's end
    (no request after it could take its bytes); any other is not known: -1, outliving the
    next step too (`layout`).

    >>> t = np.array([[64, 64], [0, 1], [2, -1], *[[-1, -1]] * 4, [-1, 7]])  # a temporary, a result
    >>> s = np.array([[32] * 3, [0, 1, 2], [3, 4, 5], *[[-1] * 3] * 4])  # other sizes, births 0-2
    >>> _on_own_clock(t, s)[NEXT_DIED].tolist()  # the result died at 7, after them: at t's end
    [-1, 2]
    """
    if _signature(table) == _signature(successor):
        return table
    out, kept = table.copy(), table[DIED] < 0
    at_end = table[NEXT_DIED] > successor[BORN].max(initial=-1)
    out[NEXT_DIED] = np.where(kept, np.where(at_end, table[BORN].max() + 1, -1), table[NEXT_DIED])
    return out


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
    """The warm-up: while a cache learns its steps (from its first step, and again after
    each plan installed, until `steps` steps with recorded requests have gone by without
    one, a plan is refused, or a step has no request a plan is made for), the core serves
    the recorded requests that no plan serves (a step of a signature not planned yet)
    upstream at their size and gives them back when they die (``set_warm_up``), so the
    steps a plan is made from hold no more than they use; after it, the pools serve what
    no plan does. A loop of requests of at most `MATCH_ABOVE` bytes only, which no plan
    is made for, is so served by its slabs."""

    def __init__(self, core: Any, steps: int) -> None:
        self._core, self._steps, self._left = core, steps, steps
        core.set_warm_up(steps > 0)

    def step_ended(self, status: PlanStatus | None) -> None:
        """A step's record was planned from; `status`: of the plan tried, if any."""
        was = self._left > 0
        if status == PlanStatus.INSTALLED:
            self._left = self._steps
        elif status in (PlanStatus.NO_ROOM, PlanStatus.NO_GAIN):
            self._left = 0
        else:
            self._left = max(self._left - 1, 0)
        if (self._left > 0) != was:
            self._core.set_warm_up(self._left > 0)

    def end(self) -> None:
        """A step had no request a plan is made for: the warm-up, which waits for its plan,
        ends (its requests stay in the slabs, as after the warm-up)."""
        if self._left > 0:
            self._left = 0
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
