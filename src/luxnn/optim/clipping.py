"""Bounding the updates: clipping elementwise, by global norm, by block RMS, adaptively
per unit (AGC), and NaNs replaced by zeros.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

from .arithmetic import root_mean_square, scaled, times
from .arrays import Params, Updates, cast_like, leafwise, map_arrays, upcast
from .base import EmptyState, FusedUpdate, GradientTransformation, Stage, Stateless, transformation
from .checks import check_float, check_match, check_params
from .fused import Fragment, FusedStep
from .update import global_norm

__all__ = [
    "ZeroNansState", "clip", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip", "zero_nans",
]  # fmt: skip


class ZeroNansState(NamedTuple):
    """Per leaf, whether the last update held a NaN (`zero_nans`)."""

    found_nan: Any


class _Clip(Stateless):
    def __init__(self, max_delta: float) -> None:
        self.max_delta = max_delta

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        m = self.max_delta
        return map_arrays(lambda g: module_of(g).clip(g, -m, m), grads), state


def clip(max_delta: float) -> GradientTransformation:
    """Clip every element of the updates to ``[-max_delta, max_delta]``.

    >>> import numpy as np
    >>> clip(1.0).update({"w": np.array([-3.0, 0.5, 2.0])}, EmptyState())[0]["w"]
    array([-1. ,  0.5,  1. ])
    """
    return transformation(_Clip(check_float("clip: max_delta", max_delta)))


def _clip_step_twin(partials: Any, blocks: int, max_norm: float, *, dtype: Any) -> Any:
    total = 0.0
    for partial in partials[:blocks]:  # in order, as the kernel's prologue
        total += float(partial)
    norm = np.sqrt(dtype.type(total))
    return float(max_norm) / np.maximum(norm, float(max_norm))  # a Python float, as `_ClipByGlobalNorm.max_norm`


# The clip of `_ClipByGlobalNorm` as a fused fragment (`fused`): the sum of squares reduced
# per block by the launch (`sums_squares`), totalled by one thread of each block; the
# factor ``max_norm / max(norm, max_norm)`` in the compute dtype, as the CPU path's.
CLIP_FRAGMENT = Fragment(
    "clip",
    "const double $max_norm",
    "u = (P)mul((T)u, $factor);",
    _clip_step_twin,
    lambda factor, u, p: times(u, factor),
    prologue="""
    __shared__ T $shared_factor;
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int k = 0; k < $blocks; ++k) total += $partials[k];
        const T norm = sqrt((T)total);
        $shared_factor = (T)$max_norm / (!(norm <= (T)$max_norm) ? norm : (T)$max_norm);  // a NaN norm stays
    }
    __syncthreads();
    const T $factor = $shared_factor;
    """,
    sums_squares=True,
)


class _ClipByGlobalNorm(Stateless, FusedUpdate):
    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def fused_step(self, grads: Updates, state: EmptyState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, EmptyState]:
        return FusedStep(CLIP_FRAGMENT, (), (self.max_norm,)), state

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        if not tree.leaves(grads):
            return grads, state
        norm = global_norm(grads)
        factor = self.max_norm / module_of(norm).maximum(norm, self.max_norm)  # exactly 1 when norm <= max_norm
        return scaled(grads, factor), state


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates down so that their `global_norm` is at most `max_norm` (optax).

    Updates whose norm is below `max_norm` pass unchanged; otherwise each is multiplied by
    ``max_norm / norm``. The factor is computed on the arrays' device, without a sync.

    >>> import numpy as np
    >>> clip_by_global_norm(1.0).update({"w": np.array([3.0, 4.0])}, EmptyState())[0]
    {'w': array([0.6, 0.8])}
    """
    return transformation(_ClipByGlobalNorm(check_float("clip_by_global_norm: max_norm", max_norm, low_open=True)))


class _ClipByBlockRms(Stateless):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        def leaf(u: Any) -> Any:
            return times(u, 1.0 / module_of(u).maximum(1.0, root_mean_square(u) / self.threshold))

        return map_arrays(leaf, grads), state


def clip_by_block_rms(threshold: float) -> GradientTransformation:
    """Scale each leaf's update down so that its root mean square is at most `threshold`.

    >>> import numpy as np
    >>> clip_by_block_rms(1.0).update({"w": np.full(2, 4.0)}, EmptyState())[0]["w"]
    array([1., 1.])
    """
    return transformation(_ClipByBlockRms(check_float("clip_by_block_rms: threshold", threshold, low_open=True)))


def _unitwise_norm(x: Any) -> Any:
    """The norm of each unit of `x`, broadcast to its shape: of the whole of a vector or
    scalar, over the inputs of a Dense kernel (axis 0 of 2 or 3 axes), over the window and
    inputs of a conv kernel (axes 0-2 of 4, 0-3 of 5), as optax's AGC."""
    xp = module_of(x)
    square = x * x
    if sum(n > 1 for n in x.shape) <= 1:
        total = square.sum(keepdims=True)
    elif x.ndim in (2, 3):
        total = square.sum(axis=0, keepdims=True)
    elif x.ndim in (4, 5):
        total = square.sum(axis=tuple(range(x.ndim - 1)), keepdims=True)
    else:
        raise ValueError(f"adaptive_grad_clip: expected a leaf with 1 to 5 axes, got shape {x.shape}")
    return xp.broadcast_to(xp.sqrt(total), x.shape)


class _AdaptiveGradClip(Stateless):
    def __init__(self, clipping: float, eps: float) -> None:
        self.clipping, self.eps = clipping, eps

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("adaptive_grad_clip", params)
        check_match(params, "params", grads, "grads")

        def leaf(g: Any, p: Any) -> Any:
            gc = upcast(g)
            xp = module_of(gc)
            g_norm, p_norm = _unitwise_norm(gc), _unitwise_norm(upcast(p))
            max_norm = xp.maximum(p_norm, self.eps) * self.clipping
            clipped = gc * (max_norm / xp.maximum(g_norm, 1e-6))
            return cast_like(xp.where(g_norm < max_norm, gc, clipped), g)

        return map_arrays(leaf, grads, params), state


def adaptive_grad_clip(clipping: float, eps: float = 1e-3) -> GradientTransformation:
    """Adaptive gradient clipping (Brock et al. 2021, optax): each unit's gradient is
    scaled down to at most ``clipping * max(|p|, eps)``, norms taken per output unit.

    >>> import numpy as np
    >>> t = adaptive_grad_clip(0.1)
    >>> t.update({"w": np.array([10.0])}, EmptyState(), {"w": np.array([2.0])})[0]["w"]
    array([0.2])
    """
    return transformation(_AdaptiveGradClip(check_float("adaptive_grad_clip: clipping", clipping),
                                            check_float("adaptive_grad_clip: eps", eps)))


class _ZeroNans(Stage):
    def init(self, params: Params) -> ZeroNansState:
        return ZeroNansState(found_nan=tree.map(lambda p: module_of(p).zeros((), dtype=bool), params))

    def update(self, grads: Updates, state: ZeroNansState, params: Params = None):
        def leaf(g: Any) -> tuple[Any, Any]:
            xp = module_of(g)
            nan = xp.isnan(g)
            return xp.where(nan, xp.zeros((), g.dtype), g), xp.asarray(nan.any())

        updates, found = leafwise(leaf, grads, outputs=2)
        return updates, ZeroNansState(found_nan=found)


def zero_nans() -> GradientTransformation:
    """Replace NaNs in the updates by zeros; the state records, per leaf, whether the last
    update held one (optax).

    >>> import numpy as np
    >>> t = zero_nans()
    >>> t.update({"w": np.array([np.nan, 1.0])}, t.init({"w": np.zeros(2)}))[0]["w"]
    array([0., 1.])
    """
    return transformation(_ZeroNans())
