"""The building blocks of the optimisers: ``scale_by_*`` directions, clipping, decay,
noise, momentum and averages, each a `GradientTransformation` (optax's semantics unless a
docstring says otherwise).

Every block computes in at least float32 (`base.compute_dtype`), keeps its moments in that
dtype and returns updates in the gradient's dtype, so float16 parameters train without
their moments underflowing. A block's `update` returns new arrays and never writes into
`grads`, `params` or the old state; temporaries are combined in place (``out=``) on arrays
the block has just made. Its in-place update (`GradientTransformation.update_`) runs the
same operations in the same order with the old moments as the ``out=`` of the new ones,
so the two agree bit for bit. Step counts stay 0-d arrays: bias corrections and schedules
are computed from them as arrays, with no Python int made of the count (no host round
trip on a GPU; `add_noise` alone reads it, to seed NumPy's generator on the host).
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

from .base import (
    EmptyState, FoldedFactor, FreshUpdates, GradientTransformation, InPlace, OwnedUpdate, Params, ScalarOrSchedule,
    ScaledUpdate, Schedule, Stage, Stateless, UpdateInto, Updates, Workspace,
    cast_like, check_decay, global_norm, check_float, check_learning_rate, check_match, check_params,
    check_schedule_value, check_steps,
    compute_dtype, identity, leafwise, map_arrays, next_count, out_buffer, scalar_as, transformation, upcast,
    zero_count, zeros_for, zeros_like_tree,
)  # fmt: skip

__all__ = [
    "TraceState", "ScaleByAdamState", "ScaleByAmsgradState", "ScaleByLionState", "ScaleByBeliefState",
    "ScaleByAdaDeltaState", "ScaleByRmsState", "ScaleByStddevState", "ScaleByRssState",
    "ScaleByScheduleState", "FactoredState", "AddNoiseState", "EmaState", "ZeroNansState",
    "scale", "scale_by_schedule", "scale_by_learning_rate", "trace", "ema",
    "scale_by_adam", "scale_by_amsgrad", "scale_by_adamax", "scale_by_lion", "scale_by_radam",
    "scale_by_belief", "scale_by_adadelta", "scale_by_rms", "scale_by_stddev", "scale_by_rss",
    "scale_by_trust_ratio", "scale_by_factored_rms", "scale_by_param_block_rms",
    "clip", "clip_by_global_norm", "clip_by_block_rms", "adaptive_grad_clip",
    "add_decayed_weights", "add_noise", "zero_nans",
]  # fmt: skip


class TraceState(NamedTuple):
    """Momentum buffer of `trace`."""

    trace: Any


class ScaleByAdamState(NamedTuple):
    """Step count and first and second moments (`scale_by_adam`, `scale_by_adamax`,
    `scale_by_radam`; for adamax `nu` is the infinity norm)."""

    count: Any
    mu: Any
    nu: Any


class ScaleByAmsgradState(NamedTuple):
    """`scale_by_adam`'s state plus the running maximum of the second moment."""

    count: Any
    mu: Any
    nu: Any
    nu_max: Any


class ScaleByLionState(NamedTuple):
    """Step count and momentum of `scale_by_lion`."""

    count: Any
    mu: Any


class ScaleByBeliefState(NamedTuple):
    """Step count, first moment and the moment of the prediction error (`scale_by_belief`)."""

    count: Any
    mu: Any
    nu: Any


class ScaleByAdaDeltaState(NamedTuple):
    """Running means of squared gradients (`e_g`) and squared updates (`e_x`)."""

    e_g: Any
    e_x: Any


class ScaleByRmsState(NamedTuple):
    """Running mean of squared gradients of `scale_by_rms`."""

    nu: Any


class ScaleByStddevState(NamedTuple):
    """Running means of gradients and squared gradients of `scale_by_stddev`."""

    mu: Any
    nu: Any


class ScaleByRssState(NamedTuple):
    """Running sum of squared gradients of `scale_by_rss`."""

    sum_of_squares: Any


class ScaleByScheduleState(NamedTuple):
    """Step count of `scale_by_schedule`."""

    count: Any


class FactoredState(NamedTuple):
    """`scale_by_factored_rms`: step count, row and column statistics of factored leaves,
    full second moments of the others (unused entries are 1-element placeholders, as optax)."""

    count: Any
    v_row: Any
    v_col: Any
    v: Any


class AddNoiseState(NamedTuple):
    """Step count and seed of `add_noise`."""

    count: Any
    rng_key: Any


class EmaState(NamedTuple):
    """Step count and the (not debiased) moving average of `ema`."""

    count: Any
    ema: Any


class ZeroNansState(NamedTuple):
    """Per leaf, whether the last update held a NaN (`zero_nans`)."""

    found_nan: Any


# ----------------------------------------------------------------------------------------
# Leaf arithmetic shared by the blocks (arguments in the compute dtype)


def _moment(g: Any, m: Any, decay: float, scratch: Any = None, out: Any = None) -> Any:
    """``decay * m + (1 - decay) * g`` into `out` (None: a new array; it may be `m`);
    `scratch`, if given, is overwritten."""
    xp = module_of(m)
    out = xp.multiply(m, decay, out=out)
    out += xp.multiply(g, 1.0 - decay, out=scratch)
    return out


def _moment_of_squares(g: Any, v: Any, decay: float, scratch: Any = None, out: Any = None) -> Any:
    """``decay * v + (1 - decay) * g**2`` into `out` (None: a new array; it may be `v`);
    `scratch`, if given, is overwritten."""
    xp = module_of(v)
    square = xp.multiply(g, g, out=scratch)
    square *= 1.0 - decay
    out = xp.multiply(v, decay, out=out)
    out += square
    return out


def _norm(x: Any) -> Any:
    """The L2 norm of all of `x`, a 0-d value in `x`'s compute dtype."""
    x = upcast(x)
    return module_of(x).sqrt(module_of(x).vdot(x, x))


def _at_least(value: Any, floor: float) -> Any:
    """`value`, or `floor` where ``value <= floor`` (optax's safe norms), on the device."""
    return module_of(value).where(value <= floor, floor, value)


class _PerDtype(dict):
    """Scalars of an update (0-d values from the count) cast once per leaf dtype."""

    def __init__(self, *values: Any) -> None:
        super().__init__()
        self.values = values

    def __missing__(self, dtype: Any) -> tuple:
        cast = self[dtype] = tuple(None if v is None else scalar_as(v, dtype) for v in self.values)
        return cast


def _mu_hat_coefficients(b1: float, count: Any, c1: Any, nesterov: bool) -> tuple[Any, Any]:
    """(a, b) with ``m_hat = a m + b g``: Adam's bias correction ``m / (1 - b1**t)`` (b is
    None), or with Nesterov's momentum (optax's NAdam, Dozat 2016)
    ``b1 m / (1 - b1**(t+1)) + (1 - b1) g / (1 - b1**t)``."""
    if nesterov:
        return b1 * _correction(b1, count + 1), (1.0 - b1) * c1
    return c1, None


def _mu_hat(mu: Any, g: Any, a: Any, b: Any) -> Any:
    """``a mu + b g`` (``a mu`` for b None) as a new array."""
    out = module_of(mu).multiply(mu, a)
    if b is not None:
        out += module_of(g).multiply(g, b)
    return out


def _no_buffer(like: Any) -> None:
    """The ``out=`` of a scratch array outside a `Workspace`: None, a new array."""
    return None


def _correction(decay: float, count: Any) -> Any:
    """``1 / (1 - decay**count)``: the bias correction of a moment after `count` steps."""
    return 1.0 / (1.0 - decay**count)


# ----------------------------------------------------------------------------------------
# Scaling


class _Scale(Stateless, FreshUpdates, OwnedUpdate, UpdateInto, FoldedFactor):

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        factor = self.factor
        return _scaled(grads, factor), state

    def update_owned(self, updates: Updates, state: EmptyState, params: Params = None):
        return _scale_in_place(updates, self.factor), state

    def update_into(self, grads: Updates, state: EmptyState, params: Params, into: list) -> EmptyState:
        factor = self.factor
        _scaled(grads, factor, into)
        return state

    def folded_factor(self, state: EmptyState) -> tuple[float, EmptyState]:
        return self.factor, state


def _times(g: Any, factor: Any) -> Any:
    """``g * factor`` computed in `g`'s compute dtype, returned in `g`'s dtype."""
    gc = upcast(g)
    return cast_like(gc * scalar_as(factor, gc.dtype), g)


def _scaled(grads: Updates, factor: Any, into: list | None = None) -> Updates:
    """Every leaf times `factor` (`_times`), as new arrays or added into `into`."""
    return map_arrays(lambda g: _times(g, factor), grads, into=into)


def _scale_in_place(updates: Updates, factor: Any) -> Updates:
    """`updates` multiplied by `factor`, written into them (half precision: a new array,
    the product taken in float32)."""

    def scale_leaf(u: Any) -> Any:
        if u.dtype != compute_dtype(u.dtype):
            return _times(u, factor)
        u *= scalar_as(factor, u.dtype)
        return u

    return map_arrays(scale_leaf, updates)


def scale(factor: float) -> GradientTransformation:
    """Multiply the updates by a constant `factor`.

    >>> import numpy as np
    >>> scale(-2.0).update({"w": np.ones(1)}, EmptyState())[0]
    {'w': array([-2.])}
    """
    return transformation(_Scale(check_float("scale: factor", factor, low=-math.inf)))


class _ScaleBySchedule(FreshUpdates, OwnedUpdate, UpdateInto, FoldedFactor):
    def __init__(self, step_size_fn: Schedule) -> None:
        self.step_size_fn = step_size_fn

    def init(self, params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=zero_count(params))

    def update(self, grads: Updates, state: ScaleByScheduleState, params: Params = None):
        factor, state = self.folded_factor(state)
        return _scaled(grads, factor), state

    def update_owned(self, updates: Updates, state: ScaleByScheduleState, params: Params = None):
        factor, state = self.folded_factor(state)
        return _scale_in_place(updates, factor), state

    def update_into(self, grads: Updates, state: ScaleByScheduleState, params: Params, into: list):
        factor, state = self.folded_factor(state)
        _scaled(grads, factor, into)
        return state

    def folded_factor(self, state: ScaleByScheduleState) -> tuple[Any, ScaleByScheduleState]:
        factor = self.step_size_fn(state.count)
        check_schedule_value("scale_by_schedule (a learning rate schedule)", factor, state.count)
        return factor, ScaleByScheduleState(next_count(state.count))

    def precheck(self, state: ScaleByScheduleState) -> None:
        self.folded_factor(state)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(count)``, count the updates done so far (a
    0-d array; any callable of the step works, e.g. the schedules of `luxnn.optim`).

    >>> import numpy as np
    >>> t = scale_by_schedule(lambda step: 1.0 / (step + 1))
    >>> updates, state = t.update({"w": np.ones(1)}, t.init({"w": np.ones(1)}))
    """
    if not callable(step_size_fn):
        raise ValueError(f"scale_by_schedule: step_size_fn must be callable, got {step_size_fn!r}")
    return transformation(_ScaleBySchedule(step_size_fn))


class _Signed:
    """``sign * schedule(count)``: a schedule whose sign is flipped, kept picklable."""

    def __init__(self, schedule: Schedule, sign: float) -> None:
        self.schedule, self.sign = schedule, sign

    def __call__(self, count: Any) -> Any:
        return self.sign * self.schedule(count)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule | None, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (a float or a schedule; None: no scaling).

    >>> import numpy as np
    >>> scale_by_learning_rate(0.1).update({"w": np.ones(1)}, EmptyState())[0]
    {'w': array([-0.1])}
    """
    if learning_rate is None:
        return identity()
    learning_rate = check_learning_rate("learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(_Signed(learning_rate, sign))
    return scale(sign * learning_rate)


# ----------------------------------------------------------------------------------------
# Momentum and averages


class _Trace(InPlace):
    def __init__(self, decay: float, nesterov: bool) -> None:
        self.decay, self.nesterov = decay, nesterov

    def init(self, params: Params) -> TraceState:
        return TraceState(trace=zeros_like_tree(params))

    def compute(self, grads: Updates, state: TraceState, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, TraceState]:
        check_match(state.trace, "the optimizer state (momentum)", grads, "grads")
        decay, nesterov = self.decay, self.nesterov

        def leaf(g: Any, t: Any) -> tuple[Any, Any]:
            gc = upcast(g)
            new = module_of(t).multiply(t, decay, out=out_buffer(t, in_place))
            new += gc
            if not nesterov:
                return cast_like(new, g), new
            out = new * decay
            out += gc
            return cast_like(out, g), new

        updates, traces = leafwise(leaf, grads, state.trace, outputs=2, into=into)
        return updates, TraceState(trace=traces)


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
        decay, correction = self.decay, _correction(self.decay, count) if self.debias else None

        def leaf(g: Any, e: Any) -> tuple[Any, Any]:
            new = _moment(upcast(g), e, decay, out=out_buffer(e, in_place))
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


# ----------------------------------------------------------------------------------------
# Adam and its family


class _ScaleByAdam(InPlace, FreshUpdates, ScaledUpdate):

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, nesterov: bool) -> None:
        self.b1, self.b2, self.eps, self.eps_root, self.nesterov = b1, b2, eps, eps_root, nesterov

    def init(self, params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=zero_count(params), mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByAdamState, params: Params, in_place: bool,
                into: list | None = None):
        return self.update_scaled(grads, state, params, 1.0, in_place, into)

    def update_scaled(self, grads: Updates, state: ScaleByAdamState, params: Params, factor: Any, in_place: bool,
                      into: list | None = None):
        check_match(state.mu, "the optimizer state (adam moments)", grads, "grads")
        b1, b2, eps, eps_root, nesterov = self.b1, self.b2, self.eps, self.eps_root, self.nesterov
        count = next_count(state.count)
        c1, c2 = _correction(b1, count), _correction(b2, count)
        a, b = _mu_hat_coefficients(b1, count, c1, nesterov)
        scalars = _PerDtype(c2, a * factor, None if b is None else b * factor)
        scratch_for = Workspace(into) if into is not None else _no_buffer

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp = module_of(gc)
            c2_, a_, b_ = scalars[gc.dtype]
            scratch = xp.multiply(gc, 1.0 - b1, out=scratch_for(gc))
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            nu = _moment_of_squares(gc, v, b2, scratch, out_buffer(v, in_place))
            # scratch <- sqrt(nu_hat + eps_root) + eps
            xp.multiply(nu, c2_, out=scratch)
            if eps_root:
                scratch += eps_root
            xp.sqrt(scratch, out=scratch)
            scratch += eps
            if nesterov:
                xp.divide(_mu_hat(mu, gc, a_, b_), scratch, out=scratch)
            else:  # (mu / denominator) * a: one array fewer than m_hat first
                xp.divide(mu, scratch, out=scratch)
                scratch *= a_
            return cast_like(scratch, g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, *,
                  nesterov: bool = False) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected
    moments ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2``, ``m_hat = m / (1 - b1**t)``,
    ``v_hat = v / (1 - b2**t)``, t the 1-based step (PyTorch and optax); ``nesterov=True``
    is NAdam's momentum (optax's, Dozat 2016).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_adam(), scale_by_learning_rate(1e-3))  # == adam(1e-3)
    """
    return transformation(_ScaleByAdam(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps),
                                       check_float("eps_root", eps_root), bool(nesterov)))


class _ScaleByAmsgrad(InPlace, FreshUpdates):

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, correct_mu: bool, correct_nu: bool) -> None:
        self.b1, self.b2, self.eps, self.eps_root = b1, b2, eps, eps_root
        self.correct_mu, self.correct_nu = correct_mu, correct_nu

    def init(self, params: Params) -> ScaleByAmsgradState:
        zeros = zeros_like_tree
        return ScaleByAmsgradState(count=zero_count(params), mu=zeros(params), nu=zeros(params), nu_max=zeros(params))

    def compute(self, grads: Updates, state: ScaleByAmsgradState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (amsgrad moments)", grads, "grads")
        b1, b2, eps, eps_root = self.b1, self.b2, self.eps, self.eps_root
        count = next_count(state.count)
        c1 = _correction(b1, count) if self.correct_mu else 1.0
        c2 = _correction(b2, count) if self.correct_nu else 1.0

        def leaf(g: Any, m: Any, v: Any, v_max: Any) -> tuple[Any, ...]:
            gc = upcast(g)
            xp, dtype = module_of(gc), gc.dtype
            scratch = xp.multiply(gc, 1.0 - b1)
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            nu = _moment_of_squares(gc, v, b2, scratch, out_buffer(v, in_place))
            corrected = xp.multiply(nu, scalar_as(c2, dtype), out=scratch)
            nu_max = xp.maximum(v_max, corrected, out=out_buffer(v_max, in_place))
            xp.add(nu_max, eps_root, out=scratch)
            xp.sqrt(scratch, out=scratch)
            scratch += eps
            xp.divide(mu, scratch, out=scratch)
            scratch *= scalar_as(c1, dtype)
            return cast_like(scratch, g), mu, nu, nu_max

        updates, mu, nu, nu_max = leafwise(leaf, grads, state.mu, state.nu, state.nu_max, outputs=4, into=into)
        return updates, ScaleByAmsgradState(count=count, mu=mu, nu=nu, nu_max=nu_max)


def scale_by_amsgrad(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                     bias_correction_mu: bool = True, bias_correction_nu: bool = True) -> GradientTransformation:
    """AMSGrad's direction: Adam's, with the running maximum of the (bias-corrected) second
    moment in the denominator (optax; PyTorch's ``Adam(amsgrad=True)`` takes the maximum
    of the uncorrected moment and corrects it by the current step, which differs).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_amsgrad(), scale_by_learning_rate(1e-3))  # == amsgrad(1e-3)
    """
    return transformation(_ScaleByAmsgrad(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps),
                                          check_float("eps_root", eps_root), bool(bias_correction_mu),
                                          bool(bias_correction_nu)))


class _ScaleByAdamax(InPlace, FreshUpdates):

    def __init__(self, b1: float, b2: float, eps: float) -> None:
        self.b1, self.b2, self.eps = b1, b2, eps

    def init(self, params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=zero_count(params), mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByAdamState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (adamax moments)", grads, "grads")
        b1, b2, eps = self.b1, self.b2, self.eps
        count = next_count(state.count)
        c1 = _correction(b1, count)

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp = module_of(gc)
            scratch = xp.multiply(gc, 1.0 - b1)
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            xp.multiply(v, b2, out=scratch)  # nu = max(b2 nu, |g| + eps), b2 nu taken before nu is written
            nu = xp.abs(gc, out=out_buffer(v, in_place))
            nu += eps
            xp.maximum(scratch, nu, out=nu)
            xp.divide(mu, nu, out=scratch)
            scratch *= scalar_as(c1, gc.dtype)
            return cast_like(scratch, g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)


def scale_by_adamax(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax's direction ``m_hat / u``, ``u = max(b2 u, |g| + eps)`` (optax, ``torch.optim.Adamax``).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_adamax(), scale_by_learning_rate(2e-3))  # == adamax(2e-3)
    """
    return transformation(_ScaleByAdamax(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps)))


class _ScaleByLion(InPlace, FreshUpdates):

    def __init__(self, b1: float, b2: float) -> None:
        self.b1, self.b2 = b1, b2

    def init(self, params: Params) -> ScaleByLionState:
        return ScaleByLionState(count=zero_count(params), mu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByLionState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (lion momentum)", grads, "grads")
        b1, b2 = self.b1, self.b2

        def leaf(g: Any, m: Any) -> tuple[Any, Any]:
            gc = upcast(g)
            xp = module_of(gc)
            direction = _moment(gc, m, b1)
            xp.sign(direction, out=direction)
            return cast_like(direction, g), _moment(gc, m, b2, out=out_buffer(m, in_place))

        updates, mu = leafwise(leaf, grads, state.mu, outputs=2, into=into)
        return updates, ScaleByLionState(count=next_count(state.count), mu=mu)


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign((1 - b1) g + b1 m)``, then ``m = b2 m + (1 - b2) g`` (optax).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_lion(), scale_by_learning_rate(1e-4))
    """
    return transformation(_ScaleByLion(check_decay("b1", b1), check_decay("b2", b2)))


class _ScaleByRadam(InPlace, FreshUpdates):

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, threshold: float, nesterov: bool) -> None:
        self.b1, self.b2, self.eps, self.eps_root = b1, b2, eps, eps_root
        self.threshold, self.nesterov = threshold, nesterov
        self.ro_inf = 2.0 / (1.0 - b2) - 1.0

    def init(self, params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=zero_count(params), mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByAdamState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (radam moments)", grads, "grads")
        b1, b2, eps, eps_root, ro_inf = self.b1, self.b2, self.eps, self.eps_root, self.ro_inf
        count = next_count(state.count)
        xp = module_of(count)
        c1, c2 = _correction(b1, count), _correction(b2, count)
        b2t = b2**count
        ro = ro_inf - 2 * count * b2t / (1 - b2t)
        rectify = ro >= self.threshold  # a 0-d bool: selected by `where`, never read on the host
        ro = xp.where(rectify, ro, ro_inf)  # a value whose root is real where it is not used
        r = xp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))
        scalars = _PerDtype(c2, *_mu_hat_coefficients(b1, count, c1, self.nesterov), r)

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            dtype = gc.dtype
            scratch = xp.multiply(gc, 1.0 - b1)
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            nu = _moment_of_squares(gc, v, b2, scratch, out_buffer(v, in_place))
            c2_, a, b, r_ = scalars[dtype]
            mu_hat = _mu_hat(mu, gc, a, b)
            xp.multiply(nu, c2_, out=scratch)
            if eps_root:
                scratch += eps_root
            xp.sqrt(scratch, out=scratch)
            scratch += eps
            xp.divide(mu_hat, scratch, out=scratch)
            scratch *= r_
            return cast_like(xp.where(rectify, scratch, mu_hat), g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)


def scale_by_radam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0,
                   threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    """Rectified Adam's direction (optax): Adam's times the rectification
    ``sqrt((ro - 4)(ro - 2) ro_inf / ((ro_inf - 4)(ro_inf - 2) ro))`` once the variance is
    tractable (``ro >= threshold``), the bias-corrected momentum before.

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_radam(), scale_by_learning_rate(1e-3))  # == radam(1e-3)
    """
    return transformation(_ScaleByRadam(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps),
                                        check_float("eps_root", eps_root), check_float("threshold", threshold),
                                        bool(nesterov)))


class _ScaleByBelief(InPlace, FreshUpdates):

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, nesterov: bool) -> None:
        self.b1, self.b2, self.eps, self.eps_root, self.nesterov = b1, b2, eps, eps_root, nesterov

    def init(self, params: Params) -> ScaleByBeliefState:
        return ScaleByBeliefState(count=zero_count(params), mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByBeliefState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (adabelief moments)", grads, "grads")
        b1, b2, eps, eps_root = self.b1, self.b2, self.eps, self.eps_root
        count = next_count(state.count)
        c1, c2 = _correction(b1, count), _correction(b2, count)
        scalars = _PerDtype(c2, *_mu_hat_coefficients(b1, count, c1, self.nesterov))

        def leaf(g: Any, m: Any, s: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp, dtype = module_of(gc), gc.dtype
            mu = _moment(gc, m, b1, out=out_buffer(m, in_place))
            error = xp.subtract(gc, mu)  # the prediction error, against the new moment
            nu = _moment_of_squares(error, s, b2, error, out_buffer(s, in_place))
            nu += eps_root
            c2_, a, b = scalars[dtype]
            mu_hat = _mu_hat(mu, gc, a, b)
            scratch = xp.multiply(nu, c2_, out=error)
            xp.sqrt(scratch, out=scratch)
            scratch += eps
            xp.divide(mu_hat, scratch, out=scratch)
            return cast_like(scratch, g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByBeliefState(count=count, mu=mu, nu=nu)


def scale_by_belief(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16, eps_root: float = 1e-16, *,
                    nesterov: bool = False) -> GradientTransformation:
    """AdaBelief's direction (optax): Adam's with the second moment of the prediction
    error ``g - m`` in place of that of ``g``.

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_belief(), scale_by_learning_rate(1e-3))  # == adabelief(1e-3)
    """
    return transformation(_ScaleByBelief(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps),
                                         check_float("eps_root", eps_root), bool(nesterov)))


class _ScaleByAdaDelta(InPlace):
    def __init__(self, rho: float, eps: float) -> None:
        self.rho, self.eps = rho, eps

    def init(self, params: Params) -> ScaleByAdaDeltaState:
        return ScaleByAdaDeltaState(e_g=zeros_like_tree(params), e_x=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByAdaDeltaState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.e_g, "the optimizer state (adadelta averages)", grads, "grads")
        rho, eps = self.rho, self.eps

        def leaf(g: Any, e_g: Any, e_x: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp = module_of(gc)
            new_e_g = _moment_of_squares(gc, e_g, rho, out=out_buffer(e_g, in_place))
            # sqrt(e_x + eps) / sqrt(e_g + eps) * g
            direction = xp.add(e_x, eps)
            xp.sqrt(direction, out=direction)
            denominator = xp.add(new_e_g, eps)
            xp.sqrt(denominator, out=denominator)
            direction /= denominator
            direction *= gc
            new_e_x = _moment_of_squares(direction, e_x, rho, denominator, out_buffer(e_x, in_place))
            return cast_like(direction, g), new_e_g, new_e_x

        updates, e_g, e_x = leafwise(leaf, grads, state.e_g, state.e_x, outputs=3, into=into)
        return updates, ScaleByAdaDeltaState(e_g=e_g, e_x=e_x)


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta's direction ``sqrt(E[dx^2] + eps) / sqrt(E[g^2] + eps) * g`` (optax,
    ``torch.optim.Adadelta``).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_adadelta(), scale_by_learning_rate(1.0))  # == adadelta()
    """
    return transformation(_ScaleByAdaDelta(check_decay("rho", rho), check_float("eps", eps)))


# ----------------------------------------------------------------------------------------
# RMSprop and Adagrad (PyTorch's semantics)


def _divide_by_root_plus_eps(g: Any, accumulator: Any, eps: float) -> Any:
    """``g / (sqrt(accumulator) + eps)`` as a new array (PyTorch's eps outside the root)."""
    denominator = module_of(accumulator).sqrt(accumulator)
    denominator += eps
    module_of(g).divide(g, denominator, out=denominator)
    return denominator


class _ScaleByRms(InPlace, FreshUpdates):

    def __init__(self, decay: float, eps: float) -> None:
        self.decay, self.eps = decay, eps

    def init(self, params: Params) -> ScaleByRmsState:
        return ScaleByRmsState(nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByRmsState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.nu, "the optimizer state (rms)", grads, "grads")
        decay, eps = self.decay, self.eps

        def leaf(g: Any, v: Any) -> tuple[Any, Any]:
            gc = upcast(g)
            nu = _moment_of_squares(gc, v, decay, out=out_buffer(v, in_place))
            return cast_like(_divide_by_root_plus_eps(gc, nu, eps), g), nu

        updates, nu = leafwise(leaf, grads, state.nu, outputs=2, into=into)
        return updates, ScaleByRmsState(nu=nu)


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """RMSprop's direction ``g / (sqrt(v) + eps)``, ``v = decay v + (1 - decay) g**2``.

    PyTorch semantics: eps is added outside the square root and v starts at 0 (optax's
    default puts eps inside).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_rms(0.9), scale_by_learning_rate(1e-2))  # == rmsprop(1e-2)
    """
    return transformation(_ScaleByRms(check_float("decay", decay, high=1.0), check_float("eps", eps)))


class _ScaleByStddev(InPlace, FreshUpdates):

    def __init__(self, decay: float, eps: float) -> None:
        self.decay, self.eps = decay, eps

    def init(self, params: Params) -> ScaleByStddevState:
        return ScaleByStddevState(mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByStddevState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (centered rms)", grads, "grads")
        decay, eps = self.decay, self.eps

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp = module_of(gc)
            mu = _moment(gc, m, decay, out=out_buffer(m, in_place))
            nu = _moment_of_squares(gc, v, decay, out=out_buffer(v, in_place))
            variance = mu * mu
            xp.subtract(nu, variance, out=variance)
            return cast_like(_divide_by_root_plus_eps(gc, variance, eps), g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByStddevState(mu=mu, nu=nu)


def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """Centred RMSprop's direction ``g / (sqrt(v - m**2) + eps)``, m and v moving averages
    of g and g**2 (PyTorch's ``RMSprop(centered=True)``; eps outside the square root).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_stddev(0.9), scale_by_learning_rate(1e-2))
    """
    return transformation(_ScaleByStddev(check_float("decay", decay, high=1.0), check_float("eps", eps)))


class _ScaleByRss(InPlace, FreshUpdates):

    def __init__(self, initial_accumulator_value: float, eps: float) -> None:
        self.initial_accumulator_value, self.eps = initial_accumulator_value, eps

    def init(self, params: Params) -> ScaleByRssState:
        def start(p: Any) -> Any:
            s = zeros_for(p)
            s += self.initial_accumulator_value
            return s

        return ScaleByRssState(sum_of_squares=tree.map(start, params))

    def compute(self, grads: Updates, state: ScaleByRssState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.sum_of_squares, "the optimizer state (adagrad sums)", grads, "grads")
        eps = self.eps

        def leaf(g: Any, s: Any) -> tuple[Any, Any]:
            gc = upcast(g)
            square = gc * gc
            sums = module_of(s).add(square, s, out=out_buffer(s, in_place, otherwise=square))
            return cast_like(_divide_by_root_plus_eps(gc, sums, eps), g), sums

        updates, sums = leafwise(leaf, grads, state.sum_of_squares, outputs=2, into=into)
        return updates, ScaleByRssState(sum_of_squares=sums)


def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Adagrad's direction ``g / (sqrt(s) + eps)``, s the running sum of g**2 started at
    `initial_accumulator_value` (PyTorch semantics; optax puts eps inside the root).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_rss(), scale_by_learning_rate(1e-2))  # == adagrad(1e-2)
    """
    return transformation(_ScaleByRss(check_float("initial_accumulator_value", initial_accumulator_value),
                                      check_float("eps", eps)))


# ----------------------------------------------------------------------------------------
# Per-block scalings: trust ratio, factored second moments, parameter scale


class _ScaleByTrustRatio(Stateless):
    def __init__(self, min_norm: float, trust_coefficient: float, eps: float) -> None:
        self.min_norm, self.trust_coefficient, self.eps = min_norm, trust_coefficient, eps

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("scale_by_trust_ratio", params)
        check_match(params, "params", grads, "grads")

        def leaf(u: Any, p: Any) -> Any:
            xp = module_of(u)
            param_norm, update_norm = _at_least(_norm(p), self.min_norm), _at_least(_norm(u), self.min_norm)
            ratio = self.trust_coefficient * param_norm / (update_norm + self.eps)
            # A zero norm would never move the parameter: the ratio is then 1 (optax).
            ratio = xp.where((param_norm == 0.0) | (update_norm == 0.0), 1.0, ratio)
            return _times(u, ratio)

        return map_arrays(leaf, grads, params), state


def scale_by_trust_ratio(min_norm: float = 0.0, trust_coefficient: float = 1.0,
                         eps: float = 0.0) -> GradientTransformation:
    """Scale each leaf's update by ``trust_coefficient * |p| / (|u| + eps)`` (norms of the
    whole leaf, at least `min_norm`; 1 where either is zero), as LAMB and LARS (optax).

    >>> import numpy as np
    >>> t = scale_by_trust_ratio()
    >>> t.update({"w": np.array([3.0, 4.0])}, EmptyState(), {"w": np.array([0.0, 10.0])})[0]["w"]
    array([6., 8.])
    """
    return transformation(_ScaleByTrustRatio(check_float("min_norm", min_norm),
                                             check_float("trust_coefficient", trust_coefficient),
                                             check_float("eps", eps)))


def _factored_dims(shape: tuple, factored: bool, min_dim_size_to_factor: int) -> tuple[int, int] | None:
    """The axes (second largest, largest) of a leaf whose second moment is factored, or
    None when it is kept whole (fewer than 2 axes, or the second largest is too small)."""
    if not factored or len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim_size_to_factor:
        return None
    return int(order[-2]), int(order[-1])


def _factored_decay(xp: Any, steps: Any, decay_rate: float) -> Any:
    """Adafactor's decay ``1 - t**-decay_rate`` (t = steps + 1) as optax defines it: a float32
    computation, the exponent a float32 too. The power is taken in float64 and rounded once,
    which gives the correctly rounded float32 power (NumPy's float32 power is an ulp off it
    at some steps, e.g. t = 4 for 0.8, which moves the updates by 1e-8 relative)."""
    t = xp.asarray(steps + 1, dtype=np.float64)
    power = (t ** float(np.float32(-decay_rate))).astype(np.float32)
    return 1.0 - power


class _ScaleByFactoredRms(InPlace):
    def __init__(self, factored: bool, decay_rate: float, step_offset: int, min_dim_size_to_factor: int,
                 epsilon: float) -> None:
        self.factored, self.decay_rate, self.step_offset = factored, decay_rate, step_offset
        self.min_dim_size_to_factor, self.epsilon = min_dim_size_to_factor, epsilon

    def _dims(self, shape: tuple) -> tuple[int, int] | None:
        return _factored_dims(shape, self.factored, self.min_dim_size_to_factor)

    def init(self, params: Params) -> FactoredState:
        def leaf(p: Any) -> tuple[Any, Any, Any]:
            xp, dtype = module_of(p), compute_dtype(p.dtype)
            placeholder = xp.zeros((1,), dtype)
            dims = self._dims(p.shape)
            if dims is None:
                return placeholder, placeholder, zeros_for(p)
            d1, d0 = dims
            row = tuple(n for i, n in enumerate(p.shape) if i != d0)
            col = tuple(n for i, n in enumerate(p.shape) if i != d1)
            return xp.zeros(row, dtype), xp.zeros(col, dtype), placeholder

        v_row, v_col, v = leafwise(leaf, params, outputs=3)
        return FactoredState(count=zero_count(params), v_row=v_row, v_col=v_col, v=v)

    def compute(self, grads: Updates, state: FactoredState, params: Params, in_place: bool,
                into: list | None = None):
        check_params("scale_by_factored_rms", params)
        check_match(params, "params", grads, "grads")
        xp = module_of(state.count)
        decay = _factored_decay(xp, state.count - self.step_offset, self.decay_rate)
        retain = 1.0 - decay  # in float32, as optax
        epsilon = self.epsilon

        def leaf(g: Any, v_row: Any, v_col: Any, v: Any) -> tuple[Any, ...]:
            gc = upcast(g)
            d, r = scalar_as(decay, gc.dtype), scalar_as(retain, gc.dtype)
            square = gc * gc
            square += epsilon
            dims = self._dims(g.shape)
            if dims is None:
                new_v = xp.multiply(v, d, out=out_buffer(v, in_place))
                new_v += square * r
                update = new_v ** -0.5
                update *= gc
                return cast_like(update, g), v_row, v_col, new_v
            d1, d0 = dims
            new_row = xp.multiply(v_row, d, out=out_buffer(v_row, in_place))
            new_row += square.mean(axis=d0) * r
            new_col = xp.multiply(v_col, d, out=out_buffer(v_col, in_place))
            new_col += square.mean(axis=d1) * r
            reduced_d1 = d1 - 1 if d1 > d0 else d1
            row_factor = (new_row / new_row.mean(axis=reduced_d1, keepdims=True)) ** -0.5
            col_factor = new_col ** -0.5
            update = gc * xp.expand_dims(row_factor, d0)
            update *= xp.expand_dims(col_factor, d1)
            return cast_like(update, g), new_row, new_col, v

        updates, v_row, v_col, v = leafwise(leaf, grads, state.v_row, state.v_col, state.v, outputs=4, into=into)
        return updates, FactoredState(count=next_count(state.count), v_row=v_row, v_col=v_col, v=v)


def scale_by_factored_rms(factored: bool = True, decay_rate: float = 0.8, step_offset: int = 0,
                          min_dim_size_to_factor: int = 128, epsilon: float = 1e-30) -> GradientTransformation:
    """Adafactor's direction (optax): ``g / sqrt(v)`` with v the moving average of
    ``g**2 + epsilon`` at decay ``1 - t**-decay_rate``; for leaves with two axes of at
    least `min_dim_size_to_factor`, v is factored into row and column means (Shazeer & Stern 2018).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_factored_rms(), optim.scale(-1e-2))
    """
    return transformation(_ScaleByFactoredRms(bool(factored), check_float("decay_rate", decay_rate),
                                              check_steps("step_offset", step_offset, positive=False),
                                              check_steps("min_dim_size_to_factor", min_dim_size_to_factor,
                                                          positive=False),
                                              check_float("epsilon", epsilon)))


def _rms(x: Any) -> Any:
    x = upcast(x)
    return module_of(x).sqrt(module_of(x).vdot(x, x) / max(x.size, 1))


class _ScaleByParamBlockRms(Stateless):
    def __init__(self, min_scale: float) -> None:
        self.min_scale = min_scale

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("scale_by_param_block_rms", params)
        check_match(params, "params", grads, "grads")
        return map_arrays(lambda u, p: _times(u, _at_least(_rms(p), self.min_scale)), grads, params), state


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Scale each leaf's update by the root mean square of its parameter (at least
    `min_scale`), as Adafactor's ``multiply_by_parameter_scale`` (optax).

    >>> import numpy as np
    >>> t = scale_by_param_block_rms()
    >>> t.update({"w": np.ones(2)}, EmptyState(), {"w": np.full(2, 3.0)})[0]["w"]
    array([3., 3.])
    """
    return transformation(_ScaleByParamBlockRms(check_float("min_scale", min_scale)))


# ----------------------------------------------------------------------------------------
# Clipping


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


class _ClipByGlobalNorm(Stateless):
    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        if not tree.leaves(grads):
            return grads, state
        norm = global_norm(grads)
        factor = self.max_norm / module_of(norm).maximum(norm, self.max_norm)  # exactly 1 when norm <= max_norm
        return _scaled(grads, factor), state


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
            return _times(u, 1.0 / module_of(u).maximum(1.0, _rms(u) / self.threshold))

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


# ----------------------------------------------------------------------------------------
# Weight decay, noise, NaNs


class _AddDecayedWeights(Stateless, FreshUpdates):

    def __init__(self, weight_decay: float) -> None:
        self.weight_decay = weight_decay

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("add_decayed_weights", params)
        check_match(params, "params", grads, "grads")
        weight_decay = self.weight_decay

        def decay(g: Any, p: Any) -> Any:
            out = upcast(p) * weight_decay
            out += g
            return cast_like(out, g)

        return map_arrays(decay, grads, params), state


def add_decayed_weights(weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (needs `params` in `update`); `mask`
    (a tree of bools, or a function of the parameters returning one) limits it to the
    leaves marked True, e.g. no decay on biases and norm scales (see `masked`).

    Before `scale_by_learning_rate` this is L2 regularisation, as PyTorch's SGD
    ``weight_decay``; after `scale_by_adam` it is AdamW's decoupled decay.

    >>> import numpy as np
    >>> t = add_decayed_weights(0.1)
    >>> t.update({"w": np.zeros(1)}, EmptyState(), {"w": np.ones(1)})[0]
    {'w': array([0.1])}
    """
    t = transformation(_AddDecayedWeights(check_float("add_decayed_weights: weight_decay", weight_decay)))
    if mask is None:
        return t
    from .wrappers import masked

    return masked(t, mask)


class _AddNoise(Stage):
    def __init__(self, eta: float, gamma: float, seed: int) -> None:
        self.eta, self.gamma, self.seed = eta, gamma, seed

    def init(self, params: Params) -> AddNoiseState:
        return AddNoiseState(count=zero_count(params), rng_key=np.asarray(self.seed, dtype=np.int64))

    def update(self, grads: Updates, state: AddNoiseState, params: Params = None):
        count = next_count(state.count)
        std = module_of(count).sqrt(self.eta / count**self.gamma)
        # The noise of step t comes from the seed and t alone (NumPy's generator, on the
        # host: reading the two 0-d arrays is no device round trip on the CPU).
        entropy = [int(_on_host(state.rng_key)), int(_on_host(count))]
        rng = np.random.default_rng(np.random.SeedSequence(entropy))

        def leaf(g: Any) -> Any:
            gc = upcast(g)
            xp = module_of(gc)
            noise = xp.asarray(rng.standard_normal(gc.shape, dtype=gc.dtype if gc.dtype.kind == "f" else None))
            noise *= scalar_as(std, gc.dtype)
            noise += gc
            return cast_like(noise, g)

        return map_arrays(leaf, grads), AddNoiseState(count=count, rng_key=state.rng_key)


def _on_host(x: Any) -> Any:
    return x.get() if hasattr(x, "get") else x


def add_noise(eta: float = 0.01, gamma: float = 0.55, seed: int = 0) -> GradientTransformation:
    """Add Gaussian noise of variance ``eta / t**gamma`` to the updates, t the 1-based
    step (Neelakantan et al. 2015, optax). The noise of each step is drawn from `seed` and
    the step alone (NumPy's generator on the host: on a GPU, one read of the count and one
    copy of the noise per step), so a run repeats exactly; it cannot equal optax's (JAX's
    generator) number for number.

    >>> import numpy as np
    >>> t = add_noise(0.01, 0.55, seed=0)
    >>> updates, state = t.update({"w": np.zeros(3)}, t.init({"w": np.zeros(3)}))
    """
    return transformation(_AddNoise(check_float("add_noise: eta", eta), check_float("add_noise: gamma", gamma),
                                    int(seed)))


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
