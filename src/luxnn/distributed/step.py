"""The data-parallel step in progress on this rank, and the calls its layers make.

A `DistributedOptimizer` opens a step when the training verbs begin one (its ``listen``,
at the start of `compute_gradients` and `single_train_step*`) and closes it in its update.
Only inside an open step do layers synchronise over the ranks (`luxnn.BatchNorm`'s
running statistics and ``sync=True`` batch statistics, `luxnn.distributed.norm`): a
forward pass anywhere else (evaluation, a rank training a model of its own, one rank
alone) stays on its rank.

A layer's collectives are calls of their own (`Backend.call`) that a rank abandoning the
step may meet: one whose forward pass raised (and whose loop went on) starts its next step
with `UNUSED` or `ABANDONED`, which the others, still in the layer's call, accept; then
every rank drops the step (nothing was averaged yet, no rank applies it) and the layer
raises `RuntimeError` (`ABANDONED_STEP`) on the ranks that were in it.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from .backend import Backend

__all__ = ["Step", "current", "begin", "end", "LAYER_CALLS", "UNUSED", "ABANDONED", "BACKWARD", "ABANDONED_STEP"]

# The layers' calls in a step (`luxnn.distributed.norm`).
RUNNING = "the running statistics' average (BatchNorm)"
MOMENTS = "the batch statistics (BatchNorm(sync=True))"
GRADIENT_SUMS = "the gradient's sums (BatchNorm(sync=True))"
LAYER_CALLS = (RUNNING, MOMENTS, GRADIENT_SUMS)
# How a rank abandons a step before anything of it was averaged: a new backward pass while
# the last one's gradients were never used (overlap=False), or the end of a round whose
# backward pass never began (overlap=True); and the start of that backward pass.
UNUSED = "compute_gradients again before an update (DistributedOptimizer)"
ABANDONED = "the end of a step abandoned before its backward pass (DistributedOptimizer, overlap=True)"
BACKWARD = "the start of the backward pass (DistributedOptimizer, overlap=True)"
ABANDONED_STEP = (
    "DistributedOptimizer: a rank abandoned this step's gradients (its compute_gradients raised, or it computed "
    "gradients again before an update); no rank applies the step, so the replicas stay equal"
)


class Step:
    """A step in progress: its `backend`, and `drop()`, which forgets the step on this
    rank without any collective (every rank drops it together)."""

    def __init__(self, backend: Backend, drop: Callable[[], None]) -> None:
        self.backend, self.drop = backend, drop

    @contextlib.contextmanager
    def call(self, name: str, layout: str = "") -> Iterator[None]:
        """A layer's call `name` (one of `LAYER_CALLS`) in this step: `RuntimeError` on this
        rank, with the step dropped, where another rank abandons the step instead.

        >>> with step.call(RUNNING, "float64[9]"):  # doctest: +SKIP
        ...     step.backend.allreduce(flat)
        """
        with self.backend.call(name, compatible=(UNUSED, ABANDONED), layout=layout) as calls:
            if calls is not None:
                self.drop()
                end(self)
                raise RuntimeError(ABANDONED_STEP)
            yield


_current: Step | None = None


def current() -> Step | None:
    """The step in progress on this rank, or None."""
    return _current if _current is not None and _current.backend.size > 1 else None


def begin(step: Step) -> None:
    """`step` is in progress (until `end`)."""
    global _current
    _current = step


def end(step: Any) -> None:
    """`step` is no longer in progress (nothing if another one is)."""
    global _current
    if _current is step:
        _current = None
