"""Step plans: where each large block of a repeated step lives (``_core.c``, section 1c).

A training loop repeats one step: the same requests, with the same lifetimes. Online
placement cannot know which block dies when, so it holds more than the step uses at its
peak; a plan made from earlier steps can place every block where it fits between the
blocks alive at the same time. Measured side by side with the code before plans (``luxnn
bench --filter training --against c4b6724``, peak reserved / peak live per step after four
warm-up steps, at 2f2ed14): MLP 1.27 -> 1.03, CNN 1.17 -> 1.08, transformer 1.21 -> 1.06,
64 MiB activations 1.06 -> 1.00; step times unchanged within noise. (Ad hoc, from recorded
traces of those steps: greedy placement of one step reaches 1.00-1.005 of its peak; the
rest is the small-block pool, blocks kept for two steps, and the lifetimes widened to
cover how threads interleave.)

The core records each training step, as the verbs mark it (`luxnn.memory.step`): every
request above 64 KiB, with a clock at its allocation and at its death (-1: still alive when
the next step began). `Planner` turns two consecutive steps with the same requests into a
plan (`layout`), and widens it when a later step's lifetimes reach beyond it (threads
interleave differently from step to step) and the plan missed. The core serves a request at
its planned place only when every byte there is free, so a plan can cost misses but never
an overlap.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Any, Callable, ContextManager

import numpy as np

__all__ = ["place", "layout", "Planner"]


def place(sizes: np.ndarray, born: np.ndarray, died: np.ndarray) -> tuple[np.ndarray, int]:
    """Offsets for blocks of `sizes` bytes alive over ``[born, died)`` such that no two
    blocks alive at the same time overlap; returns ``(offsets, bytes spanned)``.

    Greedy by size (Pisarchyk and Lee, "Efficient Memory Management for Deep Neural Net
    Inference", 2020): from the largest block down, each at the lowest offset that clears
    the blocks already placed and alive with it. n vectorised steps over the blocks placed
    (ad hoc, random blocks on this project's 2-core machine: 2 ms for 145, the large blocks
    of the suite's transformer step; 7 ms for 600; 26 ms for 2000).

    >>> offsets, span = place(np.array([4, 4, 8]), np.array([0, 1, 3]), np.array([2, 3, 4]))
    >>> offsets.tolist(), span    # the first two overlap in time, the third follows both
    ([0, 4, 0], 8)
    """
    sizes, born, died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died))
    offsets = np.zeros(len(sizes), dtype=np.int64)
    placed = np.zeros(len(sizes), dtype=bool)
    for i in np.lexsort((born, -sizes)):
        others = np.flatnonzero(placed & (born < died[i]) & (born[i] < died))
        if len(others):
            lo = offsets[others]
            order = np.argsort(lo, kind="stable")
            lo, hi = lo[order], lo[order] + sizes[others][order]
            # Below lo[k], the first k blocks cover up to frontier[k]: a gap fits there.
            frontier = np.concatenate([[0], np.maximum.accumulate(hi)])
            gaps = np.concatenate([lo, [np.iinfo(np.int64).max]]) - frontier
            offsets[i] = frontier[np.argmax(gaps >= sizes[i])]
        placed[i] = True
    span = int((offsets + sizes).max()) if len(sizes) else 0
    return offsets, span


def layout(sizes: np.ndarray, born: np.ndarray, died: np.ndarray) -> tuple[int, int, np.ndarray, np.ndarray, np.ndarray]:
    """A plan for one recorded cycle: ``(cycle arena bytes, kept arena bytes, offsets in
    even cycles, offsets in odd cycles, arena of each block: 0 cycle, 1 kept)``. Blocks
    that die within the cycle are packed into the cycle's arena by `place`. Blocks that
    outlived it (``died < 0``) get two places side by side in the kept arena, so that each
    step's results can live while the next step makes its own.

    >>> layout(np.array([512, 1024]), np.array([0, 1]), np.array([-1, 2]))[:2]
    (1024, 1024)
    """
    sizes, born, died = (np.asarray(a, dtype=np.int64) for a in (sizes, born, died))
    kept = died < 0
    kept_sizes = sizes[kept]
    twice = int(kept_sizes.sum())
    even = np.empty(len(sizes), dtype=np.int64)
    odd = np.empty(len(sizes), dtype=np.int64)
    even[kept] = np.cumsum(kept_sizes) - kept_sizes
    odd[kept] = even[kept] + twice
    even[~kept], span = place(sizes[~kept], born[~kept], died[~kept])
    odd[~kept] = even[~kept]
    return span, 2 * twice, even, odd, kept.astype(np.int64)


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
    - A first plan that would hold more than the split pool held for the same step (the
      blocks that outlive a step have two places each, for its whole length, where the
      split pool can reuse a dead one's bytes) is not made; neither is one that found no
      room (the cache's limit, out of memory). Either is not tried again for the same
      requests during `RETRY_AFTER` steps. One that had to wait ("later": the arena it
      replaces was in use) is tried again with the next step's record.
    """

    RETRY_AFTER = 64

    def __init__(self, core: Any) -> None:
        self._core = core
        self._lock = threading.RLock()  # before_step holds it around step_ended
        with _planners_lock:
            _planners.add(self)
        self._planned: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # what the plan covers
        self._last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None  # the last step, unplanned
        self._strangers = 0  # steps in a row unlike the plan's
        self._refused: tuple[np.ndarray, int] | None = None  # sizes, steps left before a retry

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
            if record is None:
                return
            rows, misses, planned, split_peak = record
            if self.served(misses, planned):
                return
            with outside():
                self.step_ended(rows, misses, planned, split_peak)

    def step_ended(self, rows: bytes, misses: int, planned: bool, split_peak: int) -> None:
        """Take an ended step's record (the core's ``take_record``): native int64 rows of
        (size, born, died), its plan misses, whether a plan is installed, and the most bytes
        the split pool held during the step."""
        record = np.frombuffer(rows, dtype=np.int64).reshape(-1, 3)
        # By size, then by birth: the core matches a bin's requests to its slots in that
        # order, whatever order threads made requests of different sizes in.
        record = record[np.lexsort((record[:, 1], record[:, 0]))].T.copy()
        sizes = record[0]
        with self._lock:
            if not planned:
                self._planned = None  # none was made, or the cache dropped it (free, trim, eviction)
            if self._refused is not None:
                self._refused = None if self._refused[1] <= 1 else (self._refused[0], self._refused[1] - 1)
            if not len(sizes):
                return  # nothing above 64 KiB: no plan serves it, none is made from it
            if self._planned is not None and np.array_equal(sizes, self._planned[0]):
                self._strangers = 0
                if misses == 0:
                    return
                widened = _union(self._planned, record)
                if all(np.array_equal(a, b) for a, b in zip(widened, self._planned)):
                    return  # the misses came from elsewhere (an array kept longer)
            else:
                if self._planned is not None:
                    self._strangers += 1
                    if self._strangers < 2:
                        return
                    self._core.drop_plan()
                    self._planned = None
                last, self._last = self._last, (record[0], record[1], record[2])
                if last is None or not np.array_equal(sizes, last[0]):
                    return
                widened = _union(last, record)
            if self._refused is not None and np.array_equal(sizes, self._refused[0]):
                return
            cycle_bytes, kept_bytes, even, odd, which = layout(*widened)
            if self._planned is None and cycle_bytes + kept_bytes > split_peak:
                status = "no gain"  # the split pool held less for these steps
            else:
                status = self._core.install_plan(cycle_bytes, kept_bytes, widened[0], even, odd, which)
            if status == "installed":
                self._planned, self._last, self._strangers = widened, None, 0
            elif status in ("no room", "no gain"):
                self._planned, self._refused = None, (sizes, self.RETRY_AFTER)
            elif self._planned is None:
                self._last = widened  # "later": what this step showed waits with the next


def _union(a: tuple[np.ndarray, ...], b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lifetimes that cover both records' (same sizes): earliest birth, latest death, and
    outliving the cycle if either did."""
    kept = (a[2] < 0) | (b[2] < 0)
    return a[0], np.minimum(a[1], b[1]), np.where(kept, -1, np.maximum(a[2], b[2]))


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
