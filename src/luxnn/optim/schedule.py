"""Schedules (optax's semantics): callables from the 0-based step count to a value.

A schedule takes a Python int (and returns a Python float) or a 0-d array of NumPy or
CuPy (and returns a 0-d value of the same module, computed without reading the step back
to the host). Any other callable of the step is accepted wherever a schedule is. Every
schedule here is an instance of a small class, so optimisers holding one pickle.

>>> from luxnn import optim
>>> s = optim.warmup_cosine_decay_schedule(0.0, 1e-3, warmup_steps=100, decay_steps=1000)
>>> opt = optim.adamw(s, weight_decay=1e-2)
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Sequence

import numpy as np

from luxnn.backend import module_of

from .arrays import Schedule
from .checks import check_float, check_steps

__all__ = [
    "constant_schedule", "polynomial_schedule", "linear_schedule", "cosine_decay_schedule",
    "warmup_constant_schedule", "warmup_cosine_decay_schedule", "exponential_decay",
    "warmup_exponential_decay_schedule", "piecewise_constant_schedule", "piecewise_interpolate_schedule",
    "linear_onecycle_schedule", "cosine_onecycle_schedule", "join_schedules", "sgdr_schedule",
]  # fmt: skip


def _result(step: Any, value: Any) -> Any:
    """A Python float for a Python step, the array value for an array step."""
    return float(value) if isinstance(step, (int, float)) else value


class _Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, step: Any) -> float:
        return self.value


def constant_schedule(value: float) -> Schedule:
    """Always `value`.

    >>> constant_schedule(0.1)(1000)
    0.1
    """
    return _Constant(check_float("constant_schedule: value", value, low=-math.inf))


class _Polynomial:
    def __init__(self, init_value: float, end_value: float, power: float, transition_steps: int,
                 transition_begin: int) -> None:
        self.init_value, self.end_value, self.power = init_value, end_value, power
        self.transition_steps, self.transition_begin = transition_steps, transition_begin

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        done = xp.clip(step - self.transition_begin, 0, self.transition_steps)
        fraction = 1.0 - done / self.transition_steps
        return _result(step, (self.init_value - self.end_value) * fraction**self.power + self.end_value)


def polynomial_schedule(init_value: float, end_value: float, power: float, transition_steps: int,
                        transition_begin: int = 0) -> Schedule:
    """`init_value` until `transition_begin`, then ``(init - end) * (1 - k/steps)**power
    + end`` over `transition_steps` steps, then `end_value`.

    >>> s = polynomial_schedule(1.0, 0.0, power=2, transition_steps=10)
    >>> s(0), s(5), s(10)
    (1.0, 0.25, 0.0)
    """
    return _Polynomial(
        check_float("polynomial_schedule: init_value", init_value, low=-math.inf),
        check_float("polynomial_schedule: end_value", end_value, low=-math.inf),
        check_float("polynomial_schedule: power", power, low=-math.inf),
        check_steps("polynomial_schedule: transition_steps", transition_steps, positive=True),
        check_steps("polynomial_schedule: transition_begin", transition_begin, positive=False),
    )


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """`init_value` until `transition_begin`, then linearly to `end_value` over
    `transition_steps` steps, then `end_value`.

    >>> s = linear_schedule(1.0, 0.0, transition_steps=10)
    >>> s(0), s(5), s(10), s(99)
    (1.0, 0.5, 0.0, 0.0)
    """
    return _Polynomial(
        check_float("linear_schedule: init_value", init_value, low=-math.inf),
        check_float("linear_schedule: end_value", end_value, low=-math.inf),
        1.0,
        check_steps("linear_schedule: transition_steps", transition_steps, positive=True),
        check_steps("linear_schedule: transition_begin", transition_begin, positive=False),
    )


class _CosineDecay:
    def __init__(self, init_value: float, decay_steps: int, alpha: float, exponent: float) -> None:
        self.init_value, self.decay_steps, self.alpha, self.exponent = init_value, decay_steps, alpha, exponent

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        cosine = 0.5 * (1.0 + xp.cos(math.pi * xp.minimum(step, self.decay_steps) / self.decay_steps))
        return _result(step, self.init_value * ((1.0 - self.alpha) * cosine**self.exponent + self.alpha))


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0,
                          exponent: float = 1.0) -> Schedule:
    """Half a cosine (raised to `exponent`) from `init_value` down to
    ``alpha * init_value`` over `decay_steps` steps, then constant.

    >>> s = cosine_decay_schedule(1.0, decay_steps=10)
    >>> s(0), s(5), s(10)
    (1.0, 0.5, 0.0)
    """
    return _CosineDecay(
        check_float("cosine_decay_schedule: init_value", init_value, low=-math.inf),
        check_steps("cosine_decay_schedule: decay_steps", decay_steps, positive=True),
        check_float("cosine_decay_schedule: alpha", alpha, low=-math.inf),
        check_float("cosine_decay_schedule: exponent", exponent, low=-math.inf),
    )


class _Join:
    def __init__(self, schedules: tuple, boundaries: tuple[int, ...]) -> None:
        self.schedules, self.boundaries = schedules, boundaries

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        value = self.schedules[0](step)
        for boundary, schedule in zip(self.boundaries, self.schedules[1:]):
            value = xp.where(step < boundary, value, schedule(step - boundary))
        return _result(step, value)


def join_schedules(schedules: Sequence[Schedule], boundaries: Sequence[int]) -> Schedule:
    """`schedules[0]` until `boundaries[0]`, then `schedules[1]` (from its own step 0)
    until `boundaries[1]`, and so on (optax).

    >>> s = join_schedules([constant_schedule(1.0), linear_schedule(1.0, 0.0, 4)], [2])
    >>> [s(k) for k in range(7)]
    [1.0, 1.0, 1.0, 0.75, 0.5, 0.25, 0.0]
    """
    schedules, boundaries = tuple(schedules), tuple(boundaries)
    if not schedules or len(boundaries) != len(schedules) - 1:
        raise ValueError(f"join_schedules: boundaries must have one entry fewer than schedules "
                         f"({len(schedules)}), got {len(boundaries)}")
    for i, s in enumerate(schedules):
        if not callable(s):
            raise ValueError(f"join_schedules: schedules[{i}] must be callable, got {s!r}")
    boundaries = tuple(check_steps(f"join_schedules: boundaries[{i}]", b, positive=False) for i, b in enumerate(boundaries))
    return _Join(schedules, boundaries)


def warmup_constant_schedule(init_value: float, peak_value: float, warmup_steps: int) -> Schedule:
    """Linear from `init_value` to `peak_value` over `warmup_steps`, then `peak_value`.

    >>> s = warmup_constant_schedule(0.0, 1.0, 4)
    >>> s(2), s(100)
    (0.5, 1.0)
    """
    return linear_schedule(init_value, peak_value, warmup_steps)


def _with_warmup(init_value: float, peak_value: float, warmup_steps: int, after: Schedule) -> Schedule:
    if warmup_steps == 0:
        return after
    return _Join((linear_schedule(init_value, peak_value, warmup_steps), after), (warmup_steps,))


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0, exponent: float = 1.0) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then cosine
    decay to `end_value`; `decay_steps` counts the warm-up too (optax).

    >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> s(0), s(5), s(10), s(60), s(110)
    (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    warmup_steps = check_steps("warmup_cosine_decay_schedule: warmup_steps", warmup_steps, positive=False)
    decay_steps = check_steps("warmup_cosine_decay_schedule: decay_steps", decay_steps, positive=True)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps must exceed warmup_steps={warmup_steps}, got {decay_steps}"
        )
    peak_value = check_float("warmup_cosine_decay_schedule: peak_value", peak_value, low=-math.inf)
    end_value = check_float("warmup_cosine_decay_schedule: end_value", end_value, low=-math.inf)
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha, exponent)
    return _with_warmup(init_value, peak_value, warmup_steps, decay)


class _ExponentialDecay:
    def __init__(self, init_value: float, transition_steps: int, decay_rate: float, transition_begin: int,
                 staircase: bool, end_value: float | None) -> None:
        self.init_value, self.transition_steps, self.decay_rate = init_value, transition_steps, decay_rate
        self.transition_begin, self.staircase, self.end_value = transition_begin, staircase, end_value

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        since = step - self.transition_begin
        exponent = since / self.transition_steps
        if self.staircase:
            exponent = xp.floor(exponent)
        value = xp.where(since <= 0, self.init_value, self.init_value * xp.power(self.decay_rate, exponent))
        if self.end_value is not None:
            bound = xp.maximum if self.decay_rate < 1.0 else xp.minimum
            value = bound(value, self.end_value)
        return _result(step, value)


def exponential_decay(init_value: float, transition_steps: int, decay_rate: float, transition_begin: int = 0,
                      staircase: bool = False, end_value: float | None = None) -> Schedule:
    """``init_value * decay_rate**((step - transition_begin) / transition_steps)`` after
    `transition_begin` (`init_value` before); ``staircase=True`` decays in whole
    transitions; `end_value` bounds it (below for a decay, above for a growth) (optax).

    >>> s = exponential_decay(1.0, transition_steps=10, decay_rate=0.5, staircase=True)
    >>> s(0), s(9), s(10), s(25)
    (1.0, 1.0, 0.5, 0.25)
    """
    return _ExponentialDecay(
        check_float("exponential_decay: init_value", init_value, low=-math.inf),
        check_steps("exponential_decay: transition_steps", transition_steps, positive=True),
        check_float("exponential_decay: decay_rate", decay_rate, low_open=True),
        check_steps("exponential_decay: transition_begin", transition_begin, positive=False),
        bool(staircase),
        None if end_value is None else check_float("exponential_decay: end_value", end_value, low=-math.inf),
    )


def warmup_exponential_decay_schedule(init_value: float, peak_value: float, warmup_steps: int,
                                      transition_steps: int, decay_rate: float, transition_begin: int = 0,
                                      staircase: bool = False, end_value: float | None = None) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then
    `exponential_decay` from `peak_value` (its steps counted from the end of the warm-up).

    >>> s = warmup_exponential_decay_schedule(0.0, 1.0, 2, transition_steps=1, decay_rate=0.5)
    >>> [s(k) for k in range(5)]
    [0.0, 0.5, 1.0, 0.5, 0.25]
    """
    warmup_steps = check_steps("warmup_exponential_decay_schedule: warmup_steps", warmup_steps, positive=False)
    decay = exponential_decay(peak_value, transition_steps, decay_rate, transition_begin, staircase, end_value)
    return _with_warmup(init_value, peak_value, warmup_steps, decay)


def _check_boundaries(name: str, boundaries_and_scales: dict | None) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if not boundaries_and_scales:
        return (), ()
    if not isinstance(boundaries_and_scales, dict):
        raise ValueError(f"{name}: boundaries_and_scales must be a dict of step -> scale, "
                         f"got {type(boundaries_and_scales).__name__}")
    pairs = sorted((check_steps(f"{name}: boundary", b, positive=False), check_float(f"{name}: scale at step {b}", s))
                   for b, s in boundaries_and_scales.items())
    return tuple(b for b, _ in pairs), tuple(s for _, s in pairs)


class _PiecewiseConstant:
    def __init__(self, init_value: float, boundaries: tuple[int, ...], scales: tuple[float, ...]) -> None:
        self.init_value, self.boundaries, self.scales = init_value, boundaries, scales

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        value: Any = self.init_value
        for boundary, s in zip(self.boundaries, self.scales):
            value = xp.where(step < boundary, value, value * s)
        return _result(step, value)


def piecewise_constant_schedule(init_value: float, boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """`init_value`, multiplied by ``boundaries_and_scales[b]`` from each step b on (optax).

    >>> s = piecewise_constant_schedule(1.0, {3: 0.5, 6: 0.1})
    >>> s(0), s(3), s(6)
    (1.0, 0.5, 0.05)
    """
    boundaries, scales = _check_boundaries("piecewise_constant_schedule", boundaries_and_scales)
    return _PiecewiseConstant(check_float("piecewise_constant_schedule: init_value", init_value, low=-math.inf),
                              boundaries, scales)


class _PiecewiseInterpolate:
    def __init__(self, cosine: bool, init_value: float, boundaries: tuple[int, ...], scales: tuple[float, ...]) -> None:
        self.cosine = cosine
        self.bounds = np.array((0, *boundaries), dtype=np.float64)
        self.values = np.cumprod(np.array((init_value, *scales), dtype=np.float64))

    def __call__(self, step: Any) -> Any:
        xp = module_of(step)
        bounds, values = xp.asarray(self.bounds), xp.asarray(self.values)
        start, end = values[:-1], values[1:]
        sizes = xp.maximum(bounds[1:] - bounds[:-1], 1.0)
        inside = (bounds[:-1] <= step) & (step < bounds[1:])
        fraction = (step - bounds[:-1]) / sizes
        if self.cosine:
            between = end + (start - end) / 2.0 * (xp.cos(math.pi * fraction) + 1.0)
        else:
            between = (end - start) * fraction + start
        value = xp.where(inside, between, 0.0).sum() + (bounds[-1] <= step) * values[-1]
        return _result(step, value)


def piecewise_interpolate_schedule(interpolate_type: str, init_value: float,
                                   boundaries_and_scales: dict[int, float] | None = None) -> Schedule:
    """From `init_value`, the value is multiplied by each boundary's scale, reached by
    ``"linear"`` or ``"cosine"`` interpolation from the previous boundary (optax).

    >>> s = piecewise_interpolate_schedule("linear", 1.0, {4: 0.5})
    >>> s(0), s(2), s(4), s(9)
    (1.0, 0.75, 0.5, 0.5)
    """
    if interpolate_type not in ("linear", "cosine"):
        raise ValueError(f"piecewise_interpolate_schedule: interpolate_type must be 'linear' or 'cosine', "
                         f"got {interpolate_type!r}")
    boundaries, scales = _check_boundaries("piecewise_interpolate_schedule", boundaries_and_scales)
    init_value = check_float("piecewise_interpolate_schedule: init_value", init_value, low=-math.inf)
    return _PiecewiseInterpolate(interpolate_type == "cosine", init_value, boundaries, scales)


def linear_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3, pct_final: float = 0.85,
                             div_factor: float = 25.0, final_div_factor: float = 1e4) -> Schedule:
    """One cycle (Smith & Topin 2018), linear: from ``peak / div_factor`` up to `peak_value`
    at ``pct_start`` of the run, back down at `pct_final`, then to
    ``peak / (div_factor * final_div_factor)`` at `transition_steps` (optax).

    >>> s = linear_onecycle_schedule(100, 1.0)
    >>> s(0), s(30), s(85)
    (0.04, 1.0, 0.04)
    """
    transition_steps = check_steps("linear_onecycle_schedule: transition_steps", transition_steps, positive=True)
    peak_value = check_float("linear_onecycle_schedule: peak_value", peak_value, low=-math.inf)
    div_factor = check_float("linear_onecycle_schedule: div_factor", div_factor, low_open=True)
    final_div_factor = check_float("linear_onecycle_schedule: final_div_factor", final_div_factor, low_open=True)
    check_float("linear_onecycle_schedule: pct_start", pct_start, high=1.0)
    check_float("linear_onecycle_schedule: pct_final", pct_final, high=1.0)
    return piecewise_interpolate_schedule("linear", peak_value / div_factor, {
        int(pct_start * transition_steps): div_factor,
        int(pct_final * transition_steps): 1.0 / div_factor,
        transition_steps: 1.0 / final_div_factor,
    })  # fmt: skip


def cosine_onecycle_schedule(transition_steps: int, peak_value: float, pct_start: float = 0.3,
                             div_factor: float = 25.0, final_div_factor: float = 1e4) -> Schedule:
    """One cycle with cosine annealing: from ``peak / div_factor`` up to `peak_value` at
    ``pct_start`` of the run, then down to ``peak / (div_factor * final_div_factor)``
    (optax; PyTorch's ``OneCycleLR(anneal_strategy="cos", three_phase=False)``).

    >>> s = cosine_onecycle_schedule(100, 1.0)
    >>> round(s(0), 12), s(30)
    (0.04, 1.0)
    """
    transition_steps = check_steps("cosine_onecycle_schedule: transition_steps", transition_steps, positive=True)
    peak_value = check_float("cosine_onecycle_schedule: peak_value", peak_value, low=-math.inf)
    div_factor = check_float("cosine_onecycle_schedule: div_factor", div_factor, low_open=True)
    final_div_factor = check_float("cosine_onecycle_schedule: final_div_factor", final_div_factor, low_open=True)
    check_float("cosine_onecycle_schedule: pct_start", pct_start, high=1.0)
    return piecewise_interpolate_schedule("cosine", peak_value / div_factor, {
        int(pct_start * transition_steps): div_factor,
        transition_steps: 1.0 / (div_factor * final_div_factor),
    })  # fmt: skip


def sgdr_schedule(cosine_kwargs: Iterable[dict[str, Any]]) -> Schedule:
    """Warm restarts (Loshchilov & Hutter 2017): one `warmup_cosine_decay_schedule` per
    dict of its arguments in `cosine_kwargs`, each starting when the previous one's
    `decay_steps` are done (optax).

    >>> cycle = dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10)
    >>> s = sgdr_schedule([cycle, cycle])
    >>> s(2), s(10), s(12)
    (1.0, 0.0, 1.0)
    """
    schedules, boundaries, step = [], [], 0
    for i, kwargs in enumerate(cosine_kwargs):
        if not isinstance(kwargs, dict) or "decay_steps" not in kwargs:
            raise ValueError(f"sgdr_schedule: cosine_kwargs[{i}] must be a dict of warmup_cosine_decay_schedule's "
                             f"arguments with decay_steps, got {kwargs!r}")
        schedules.append(warmup_cosine_decay_schedule(**kwargs))
        step += kwargs["decay_steps"]
        boundaries.append(step)
    if not schedules:
        raise ValueError("sgdr_schedule: cosine_kwargs must hold at least one cycle")
    return _Join(tuple(schedules), tuple(boundaries[:-1]))
