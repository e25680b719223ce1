"""Momentum (`trace`) and moving averages of the updates (`ema`)."""

from __future__ import annotations

from typing import Any, NamedTuple

from luxnn.backend import module_of

from .arithmetic import bias_correction, moving_average
from .arrays import (
    Params, Updates, cast_like, leafwise, next_count, out_buffer, scalar_as, upcast, zero_count,
    zeros_like_tree
)  # fmt: skip
from .base import FusedUpdate, GradientTransformation, InPlace, transformation
from .fused import Fragment, FusedStep
from .checks import check_decay, check_float, check_match

__all__ = [
    "TraceState", "EmaState", "trace", "ema",
]  # fmt: skip


class TraceState(NamedTuple):
    """Momentum buffer of `trace`."""

    trace: Any


class EmaState(NamedTuple):
    """Step count and the (not debiased) moving average of `ema`."""

    count: Any
    ema: Any


def trace_leaf(gc: Any, t: Any, out: Any, decay: Any, nesterov: bool) -> tuple[Any, Any]:
    """Momentum of one leaf `gc` (in its compute dtype, `t` its trace): (the update, the new
    trace, in `out`; None: a new array). `TRACE_FRAGMENT` fuses these passes, in order."""
    new = module_of(t).multiply(t, decay, out=out)
    new += gc
    if not nesterov:
        return new, new
    update = new * decay
    update += gc
    return update, new


# `trace_leaf` as a fused fragment (`fused`); products rounded one by one.
def _trace_step_twin(decay, nesterov, *, dtype) -> tuple[float, bool]:
    return float(decay), bool(nesterov)  # a Python float, as `_Trace.decay`


def _trace_leaf_twin(constants, u, p, t) -> Any:
    return trace_leaf(upcast(u), t, t, *constants)[0].astype(u.dtype, copy=False)


TRACE_FRAGMENT = Fragment(
    "trace",
    "const double $decay, const int $nesterov",
    """
    const T gc = (T)u;
    $m0 = mul($m0, $t_decay) + gc;
    u = (P)($nesterov ? mul($m0, $t_decay) + gc : $m0);
    """,
    _trace_step_twin,
    _trace_leaf_twin,
    prologue="const T $t_decay = (T)$decay;",
    moments=1,
)


class _Trace(InPlace, FusedUpdate):
    def __init__(self, decay: float, nesterov: bool) -> None:
        self.decay, self.nesterov = decay, nesterov

    def init(self, params: Params) -> TraceState:
        return TraceState(trace=zeros_like_tree(params))

    def compute(self, grads: Updates, state: TraceState, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, TraceState]:
        check_match(state.trace, "the optimizer state (momentum)", grads, "grads")
        decay, nesterov = self.decay, self.nesterov

        def leaf(g: Any, t: Any) -> tuple[Any, Any]:
            update, new = trace_leaf(upcast(g), t, out_buffer(t, in_place), decay, nesterov)
            return cast_like(update, g), new

        updates, traces = leafwise(leaf, grads, state.trace, outputs=2, into=into)
        return updates, TraceState(trace=traces)

    def fused_step(self, grads: Updates, state: TraceState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, TraceState]:
        check_match(state.trace, "the optimizer state (momentum)", grads, "grads")
        return FusedStep(TRACE_FRAGMENT, (state.trace,), (self.decay, self.nesterov)), state


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t``; the update is `t`, or ``g + decay * t`` with Nesterov.

    Matches PyTorch's SGD momentum buffer (dampening 0) and optax's `trace`.

    >>> import numpy as np
    >>> t = trace(0.9)
    >>> updates, state = t.update({"w": np.ones(1)}, t.init({"w": np.zeros(1)}))
    """
    return transformation(_Trace(check_float("trace: decay", decay), bool(nesterov)))


class _Ema(InPlace):
    def __init__(self, decay: float, debias: bool) -> None:
        self.decay, self.debias = decay, debias

    def init(self, params: Params) -> EmaState:
        return EmaState(count=zero_count(params), ema=zeros_like_tree(params))

    def compute(self, grads: Updates, state: EmaState, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, EmaState]:
        check_match(state.ema, "the optimizer state (ema)", grads, "grads")
        count = next_count(state.count)
        decay, correction = self.decay, bias_correction(self.decay, count) if self.debias else None

        def leaf(g: Any, e: Any) -> tuple[Any, Any]:
            new = moving_average(upcast(g), e, decay, out=out_buffer(e, in_place))
            out = new if correction is None else new * scalar_as(correction, new.dtype)
            return cast_like(out, g), new

        updates, averages = leafwise(leaf, grads, state.ema, outputs=2, into=into)
        return updates, EmaState(count=count, ema=averages)


def ema(decay: float, debias: bool = True) -> GradientTransformation:
    """The exponential moving average of the updates, ``e = decay e + (1 - decay) g``,
    debiased by ``1 - decay**t`` unless ``debias=False`` (optax).

    >>> import numpy as np
    >>> t = ema(0.9)
    >>> t.update({"w": np.ones(1)}, t.init({"w": np.zeros(1)}))[0]["w"]
    array([1.])
    """
    return transformation(_Ema(check_decay("ema: decay", decay), bool(debias)))
