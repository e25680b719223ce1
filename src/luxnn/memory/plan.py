"""Step plans: where each large block of a repeated step lives (``_core.c``, section 1c).

A training loop repeats one step: the same requests, with the same lifetimes. Online
placement cannot know which block dies when, so it holds more than the step uses at its
peak; a plan made from earlier steps can place every block where it fits between the
blocks alive at the same time. (What that saves, row by row: BENCHMARKS.md.) What a plan
cannot remove: the small-block pool, blocks kept for two steps, and the lifetimes widened
to cover how threads interleave.

The core records each training step, as the verbs mark it (`luxnn.memory.step`): every
request above 64 KiB, with a clock at its allocation and at its death (-1: still alive when
the next step began, and then its death on the next step's clock). `Planner` turns two
consecutive steps with the same requests into a plan (`layout`), and widens it when a later
step's lifetimes reach beyond it (threads interleave differently from step to step) and
the plan missed. The core serves a request at its planned place only when every byte there
is free, so a plan can cost misses but never an overlap.
"""

from __future__ import annotations

import enum
import os
import threading
import weakref
from typing import Any, Callable, ContextManager

import numpy as np

from . import _core

__all__ = ["place", "layout", "Planner", "PlanStatus"]


BUDGET = 1.10
"""Peak reserved / peak live that the cache keeps to (DESIGN.md)."""

class PlanStatus(enum.IntEnum):
    """What became of a plan: installed by the core, to try again with the next step's
    record (the arena it must replace is in use), refused for want of room (the cache's
    limit, out of memory), or not tried as it would hold more than the split pool held."""

    INSTALLED = _core.PLAN_INSTALLED
    LATER = _core.PLAN_LATER
    NO_ROOM = _core.PLAN_NO_ROOM
    NO_GAIN = max(_core.PLAN_INSTALLED, _core.PLAN_LATER, _core.PLAN_NO_ROOM) + 1


def place(
    sizes: np.ndarray, born: np.ndarray, died: np.ndarray, born2: np.ndarray | None = None, died2: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """Offsets for blocks of `sizes` bytes alive over ``[born, died)`` (and, if given, also
    over ``[born2, died2)``; an empty interval adds nothing) such that no two blocks alive at
    the same time overlap; returns ``(offsets, bytes spanned)``.

    Each block at the lowest offset that clears the blocks already placed and alive with
    it, in three orders, keeping the smallest span: from the largest block down (Pisarchyk
    and Lee, "Efficient Memory Management for Deep Neural Net Inference", 2020), from the
    longest-lived down (XLA's heap simulator tries both), and by birth (on one recorded
    two-step schedule of an MLP, 1.05x its peak where the other two reached 1.24x). n
    vectorised steps per order.

    >>> offsets, span = place(np.array([4, 4, 8]), np.array([0, 1, 3]), np.array([2, 3, 4]))
    >>> offsets.tolist(), span    # the first two overlap in time, the third follows both
    ([0, 4, 0], 8)
    """
    sizes, born, died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died))
    born2 = np.zeros_like(born) if born2 is None else np.asarray(born2, dtype=np.int64)
    died2 = np.zeros_like(died) if died2 is None else np.asarray(died2, dtype=np.int64)
    lives = np.maximum(died - born, 0) + np.maximum(died2 - born2, 0)
    best = None
    first = np.where(died > born, born, born2)
    for order in (np.lexsort((born, -sizes)), np.lexsort((born, -sizes, -lives)), np.lexsort((-sizes, first))):
        offsets = _first_fit(order, sizes, born, died, born2, died2)
        span = int((offsets + sizes).max()) if len(sizes) else 0
        if best is None or span < best[1]:
            best = (offsets, span)
    return best


def _first_fit(order: np.ndarray, sizes: np.ndarray, *lives: np.ndarray) -> np.ndarray:
    born, died, born2, died2 = lives
    offsets = np.zeros(len(sizes), dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    for i in order:
        together = (
            ((born < died[i]) & (born[i] < died)) | ((born2 < died[i]) & (born[i] < died2))
            | ((born < died2[i]) & (born2[i] < died)) | ((born2 < died2[i]) & (born2[i] < died2))
        )  # fmt: skip
        others = np.flatnonzero(placed & together)
        lo = offsets[others]
        order_lo = np.argsort(lo, kind="stable")
        lo, hi = lo[order_lo], lo[order_lo] + sizes[others][order_lo]
        # Below lo[k], the first k blocks cover up to frontier[k]: a gap fits there.
        frontier = np.concatenate([[0], np.maximum.accumulate(hi)])
        gaps = np.concatenate([lo, [np.iinfo(np.int64).max]]) - frontier
        offsets[i] = frontier[np.argmax(gaps >= sizes[i])]
        placed[i] = True
    return offsets


def layout(sizes: np.ndarray, born: np.ndarray, died: np.ndarray, next_died: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """A plan for a recorded step: ``(cycle arena bytes, kept arena bytes, offsets in even
    steps, offsets in odd steps, arena of each block: 0 cycle, 1 kept)``.

    Blocks that die within the step (``died >= 0``) are packed into the cycle arena by
    `place`: it is idle between steps, so a plan widened later (threads interleave
    differently) replaces it without both being held. Blocks that outlive the step go to
    the kept arena, packed over the circular two-step schedule: a step lasts `T` ticks (its
    births and deaths), and a block that outlives an even step dies at ``next_died`` in the
    odd one after it, so it lives over ``[born, T + next_died)``, and one of an odd step over
    ``[T + born, 2T)`` and ``[0, next_died)`` (``next_died < 0``: it outlives the next step
    too, and keeps its place all the time). So a step's results take the bytes of those of
    the step before that died before them.

    >>> cycle, kept, even, odd, arena = layout(np.array([512, 1024]), np.array([0, 1]), np.array([-1, 2]), np.array([1, -1]))
    >>> cycle, kept, arena.tolist()  # the result's two places, alive together from tick 0 to 1
    (1024, 1024, [1, 0])
    """
    sizes, born, died, next_died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died, next_died))
    kept = died < 0
    even = np.empty(len(sizes), dtype=np.int64)
    odd = np.empty(len(sizes), dtype=np.int64)
    even[~kept], cycle_bytes = place(sizes[~kept], born[~kept], died[~kept])
    odd[~kept] = even[~kept]
    sizes, born, next_died = sizes[kept], born[kept], next_died[kept]
    n, ticks = len(sizes), int(max(born.max(initial=0), next_died.max(initial=0), died.max(initial=0))) + 1
    whole = next_died < 0  # alive through the next step: the whole circle
    start = np.concatenate([np.where(whole, 0, born), np.where(whole, 0, ticks + born)])
    stop = np.concatenate([np.where(whole, 2 * ticks, ticks + next_died), np.full(n, 2 * ticks)])
    wrap_stop = np.concatenate([np.zeros(n, np.int64), np.where(whole, 0, next_died)])
    offsets, kept_bytes = place(np.concatenate([sizes, sizes]), start, stop, np.zeros(2 * n, np.int64), wrap_stop)
    even[kept], odd[kept] = offsets[:n], offsets[n:]
    return cycle_bytes, kept_bytes, even, odd, kept.astype(np.int64)


class Planner:
    """When a cache plans: `step_ended` gets each step's record from the core and has the
    core install (``install_plan``) or drop (``drop_plan``) a plan. Thread safe: steps may
    end in any thread.

    - A step is what the training verbs mark (`luxnn.memory.step`): one
      ``single_train_step``, or a ``compute_gradients`` and the ``apply_gradients`` after it.
    - A plan is made when a step repeats the requests (their sizes) of the step before it,
      from the lifetimes of both. Steps with no request above 64 KiB are no part of it.
    - A step with the plan's requests that the plan missed, and whose lifetimes reach
      beyond those the plan was made from, widens it: every block's lifetime becomes the
      union of what the steps showed, so a few steps cover the ways threads interleave.
    - A step with other requests (an evaluation step, a short last batch) leaves the plan
      alone: the split pool serves it. Two such steps in a row drop the plan: the loop's
      shapes changed, and the next repeat makes a new one.
    - A first plan that would hold more than the split pool held for the same step, or,
      in the warm-up (`WarmUp`), more than `BUDGET` times the step's peak of large blocks
      (the blocks that outlive a step have two places each, for its whole length, where
      the split pool can reuse a dead one's bytes) is not made; neither is one that found no
      room (the cache's limit, out of memory). Either is not tried again for the same
      requests during `RETRY_AFTER` steps. One that had to wait (LATER: the arena it
      replaces was in use) is tried again with the next step's record.
    """

    RETRY_AFTER = 64
    WARM_UP_STEPS = 4

    def __init__(self, core: Any) -> None:
        self._core = core
        self._lock = threading.RLock()  # before_step holds it around step_ended
        with _planners_lock:
            _planners.add(self)
        self._planned: tuple[np.ndarray, ...] | None = None  # (size, born, died, next_died) it covers
        self._strangers = 0  # steps in a row unlike the plan's
        self._refused: tuple[np.ndarray, int] | None = None  # sizes, steps left before a retry
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
        (size, born, died), its plan misses, whether a plan is installed, the most bytes a
        first plan may hold (`_held_without_plan`), and the step before's rows of (size,
        born, died, next_died) (its blocks' deaths in this step; empty if not known)."""
        record, before = _rows(rows, 3), _rows(previous, 4)
        with self._lock:
            self._decide(record, before, misses, planned, without_plan)
            self._warm_up.step_ended(done=self._planned is not None or self._refused is not None)

    def _decide(self, record: np.ndarray, before: np.ndarray, misses: int, planned: bool, without_plan: int) -> None:
        # step_ended's decision, with the lock held.
        sizes = record[0]
        if not planned:
            self._planned = None  # none was made, or the cache dropped it (free, trim, eviction)
        if self._refused is not None:
            self._refused = None if self._refused[1] <= 1 else (self._refused[0], self._refused[1] - 1)
        if not len(sizes):
            return  # nothing above 64 KiB: no plan serves it, none is made from it
        repeats = np.array_equal(sizes, before[0])
        if self._planned is not None and np.array_equal(sizes, self._planned[0]):
            self._strangers = 0
            if misses == 0:
                return
            widened = _union(self._planned, _lifetimes(record, before if repeats else None))
            if repeats:
                widened = _union(widened, tuple(before))
            if all(np.array_equal(a, b) for a, b in zip(widened, self._planned)):
                return  # the misses came from elsewhere (an array kept longer than two steps)
        else:
            if self._planned is not None:
                self._strangers += 1
                if self._strangers < 2:
                    return
                self._core.drop_plan()
                self._planned = None
            if not repeats:
                return
            widened = _union(tuple(before), _lifetimes(record, before))
        if self._refused is not None and np.array_equal(sizes, self._refused[0]):
            return
        cycle_bytes, kept_bytes, even, odd, which = layout(*widened)
        if self._planned is None and cycle_bytes + kept_bytes > without_plan:
            status = PlanStatus.NO_GAIN
        else:
            status = PlanStatus(self._core.install_plan(cycle_bytes, kept_bytes, sizes, even, odd, which))
        if status == PlanStatus.INSTALLED:
            self._planned, self._strangers = widened, 0
        elif status in (PlanStatus.NO_ROOM, PlanStatus.NO_GAIN):
            self._planned, self._refused = None, (sizes, self.RETRY_AFTER)
        # LATER: the next step's record has this one's as its step before


def _rows(raw: bytes, columns: int) -> np.ndarray:
    """A record's native int64 rows, as columns, by size and then by birth: the order in
    which the core matches a bin's requests to its slots, whatever order threads made
    requests of different sizes in."""
    rows = np.frombuffer(raw, dtype=np.int64).reshape(-1, columns)
    return rows[np.lexsort((rows[:, 1], rows[:, 0]))].T.copy()


def _lifetimes(record: np.ndarray, before: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """A step's (size, born, died, next_died): its blocks that outlive it are taken to die in
    the next step when the same block of the step before died in this one (not yet known
    for this step's), or to outlive it too where that is not known."""
    next_died = np.full(len(record[0]), -1, dtype=np.int64)
    if before is not None:
        next_died = np.where(before[2] < 0, before[3], -1)
    return record[0], record[1], record[2], next_died


class WarmUp:
    """The warm-up: until a cache's first plan is installed or refused, or `steps` steps
    with requests above 64 KiB have gone by without one, the core serves those requests
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


def _union(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """Lifetimes (size, born, died, next_died) that cover both records' (same sizes):
    earliest birth, latest death, outliving the step if either did, and then the latest
    death in the next step (-1, outliving that too, if either did)."""
    kept = (a[2] < 0) | (b[2] < 0)
    next_a, next_b = (np.where(x[2] < 0, x[3], -2) for x in (a, b))  # -2: not kept there
    next_died = np.where((next_a == -1) | (next_b == -1), -1, np.maximum(next_a, next_b))
    return a[0], np.minimum(a[1], b[1]), np.where(kept, -1, np.maximum(a[2], b[2])), np.where(kept, next_died, -1)


# Fork copies only the forking thread: a planner's lock held by another thread would stay
# held in the child for ever, over a half-made decision. So the forking thread takes every
# planner's lock before the fork (the core's locks: ``_core.c``, section 4b), the parent
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
