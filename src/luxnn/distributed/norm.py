"""Batch statistics over the ranks, for `luxnn.BatchNorm` (and InstanceNorm's running
statistics) under data parallelism.

- `average_running`: the running statistics a layer just updated from its rank's batch,
  averaged over the ranks (weighted by their batch sizes), so that the replicas' states
  stay equal, step after step;
- `batch_moments` and `normalize`: the statistics of the global batch (every rank's
  samples) and the normalisation with them, whose gradient sums over the global batch too:
  ``BatchNorm(..., sync=True)``, as PyTorch's SyncBatchNorm. The ranks' results are then
  those of one process normalising the whole batch.

Each is one call of every rank in the data-parallel step in progress (`step.Step.call`:
a rank that abandoned the step makes the others' call raise, with the step dropped on
every rank) with one small allreduce in float64, so that sums over many samples and a mean
far from zero lose nothing to rounding.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from ..ops.norm import moments
from .backend import describe
from .step import GRADIENT_SUMS, MOMENTS, RUNNING, Step

__all__ = ["average_running", "batch_moments", "normalize"]


def _summed(step: Step, name: str, parts: list[Any]) -> list[Any]:
    """`parts` (arrays of one device) summed over the ranks in float64, in one allreduce."""
    xp = module_of(parts[0])
    flat = xp.concatenate([xp.asarray(p, dtype=xp.float64).reshape(-1) for p in parts])
    with step.call(name, describe([flat], "sum")):
        step.backend.allreduce(flat, "sum")
    out, start = [], 0
    for p in parts:
        out.append(flat[start : start + p.size].reshape(p.shape))
        start += p.size
    return out


def _one(like: Any, value: float) -> Any:
    """``[value]`` in float64, on `like`'s device."""
    return module_of(like).full((1,), value, np.float64)


def average_running(step: Step, mean: Any, var: Any, weight: int) -> tuple[Any, Any]:
    """The running statistics `mean` and `var` (this rank's, from `weight` samples)
    averaged over the ranks with their weights, in their dtype; every rank gets the same.

    >>> mean, var = average_running(step, st["running_mean"], st["running_var"], len(x))  # doctest: +SKIP
    """
    w = float(weight)
    m, v, total = _summed(step, RUNNING, [mean * w, var * w, _one(mean, w)])
    total = float(total[0])
    return (m / total).astype(mean.dtype), (v / total).astype(var.dtype)


def batch_moments(step: Step, x: Any, axes: tuple[int, ...]) -> tuple[Any, Any, int]:
    """``(mean, var, count)`` of the raw array `x` over `axes` on every rank together: the
    global batch's mean and biased variance with kept dimensions (as `ops.norm.moments`),
    in `x`'s dtype, and the number of values each statistic is of.

    Each rank's mean and sum of squared deviations are combined exactly (Chan's formula),
    so a rank with an empty batch adds nothing.
    """
    n = math.prod(x.shape[a] for a in axes)
    keep = tuple(1 if i in axes else d for i, d in enumerate(x.shape))
    xp = module_of(x)
    if n:
        mean, var = moments(x, axes)
    else:
        mean = var = xp.zeros(keep, x.dtype)
    s_mean, s_m2, s_sq, count = _summed(
        step, MOMENTS, [mean * n, var * n, mean * mean * n, _one(x, n)]
    )
    total = float(count[0])
    global_mean = s_mean / total
    global_var = (s_m2 + s_sq - global_mean * global_mean * total) / total
    return global_mean.astype(x.dtype), xp.maximum(global_var, 0).astype(x.dtype), int(total)


@primitive
def normalize(x, *, axis, epsilon, stats, count, step):
    """``(x - mean) / sqrt(var + epsilon)`` with `stats` ``(mean, var)`` of the global batch
    (`batch_moments`, of `count` values each). Gradient, with sums over every rank's batch:
    ``rstd * (g - sum(g) / count - xhat * sum(g * xhat) / count)``.

    >>> mean, var, count = batch_moments(step, x, (0,))  # doctest: +SKIP
    >>> y = normalize(x, axis=(0,), epsilon=1e-5, stats=(mean, var), count=count, step=step)  # doctest: +SKIP
    """
    mean, var = stats
    xp = module_of(x)
    rstd = 1 / xp.sqrt(var + epsilon)
    xhat = (x - mean) * rstd

    def vjp(g, needs):
        s_g, s_gx = _summed(step, GRADIENT_SUMS, [g.sum(axis=axis, keepdims=True), (g * xhat).sum(axis=axis, keepdims=True)])
        return (rstd * (g - (s_g / count).astype(g.dtype) - xhat * (s_gx / count).astype(g.dtype)),)

    return xhat, vjp
