"""Multiplying the updates by a factor: a constant, a schedule or learning rate, the trust
ratio of LAMB and LARS, the parameters' root mean square (Adafactor).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from luxnn.backend import module_of

from .arithmetic import at_least, l2_norm, root_mean_square, scale_in_place, scaled, times
from .arrays import Params, ScalarOrSchedule, Schedule, Updates, host_count, map_arrays, next_count, zero_count
from .base import (
    EmptyState, FoldedFactor, FreshUpdates, GradientTransformation, OwnedUpdate, Stateless, UpdateInto, identity,
    transformation
)  # fmt: skip
from .checks import check_float, check_learning_rate, check_match, check_params, check_schedule_value

__all__ = [
    "ScaleByScheduleState", "scale", "scale_by_schedule", "scale_by_learning_rate", "scale_by_trust_ratio",
    "scale_by_param_block_rms",
]  # fmt: skip


class ScaleByScheduleState(NamedTuple):
    """Step count of `scale_by_schedule`."""

    count: Any


class _Scale(Stateless, FreshUpdates, OwnedUpdate, UpdateInto, FoldedFactor):

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        factor = self.factor
        return scaled(grads, factor), state

    def update_owned(self, updates: Updates, state: EmptyState, params: Params = None):
        return scale_in_place(updates, self.factor), state

    def update_into(self, grads: Updates, state: EmptyState, params: Params, into: list) -> EmptyState:
        factor = self.factor
        scaled(grads, factor, into)
        return state

    def folded_factor(self, state: EmptyState) -> tuple[float, EmptyState]:
        return self.factor, state


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
        return scaled(grads, factor), state

    def update_owned(self, updates: Updates, state: ScaleByScheduleState, params: Params = None):
        factor, state = self.folded_factor(state)
        return scale_in_place(updates, factor), state

    def update_into(self, grads: Updates, state: ScaleByScheduleState, params: Params, into: list):
        factor, state = self.folded_factor(state)
        scaled(grads, factor, into)
        return state

    def folded_factor(self, state: ScaleByScheduleState) -> tuple[Any, ScaleByScheduleState]:
        return self._factor(state), ScaleByScheduleState(next_count(state.count))

    def precheck(self, state: ScaleByScheduleState) -> None:
        self._factor(state)

    def _factor(self, state: ScaleByScheduleState) -> Any:
        """The schedule's value at the state's count, checked. On a GPU the schedule runs
        on the host, at the count's host value (`host_count`): no launch, no read."""
        count = host_count(state.count)
        factor = self.step_size_fn(count)
        check_schedule_value("scale_by_schedule (a learning rate schedule)", factor, count)
        return factor


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


class _ScaleByTrustRatio(Stateless):
    def __init__(self, min_norm: float, trust_coefficient: float, eps: float) -> None:
        self.min_norm, self.trust_coefficient, self.eps = min_norm, trust_coefficient, eps

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("scale_by_trust_ratio", params)
        check_match(params, "params", grads, "grads")

        def leaf(u: Any, p: Any) -> Any:
            xp = module_of(u)
            param_norm, update_norm = at_least(l2_norm(p), self.min_norm), at_least(l2_norm(u), self.min_norm)
            ratio = self.trust_coefficient * param_norm / (update_norm + self.eps)
            # A zero norm would never move the parameter: the ratio is then 1 (optax).
            ratio = xp.where((param_norm == 0.0) | (update_norm == 0.0), 1.0, ratio)
            return times(u, ratio)

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


class _ScaleByParamBlockRms(Stateless):
    def __init__(self, min_scale: float) -> None:
        self.min_scale = min_scale

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        check_params("scale_by_param_block_rms", params)
        check_match(params, "params", grads, "grads")
        return map_arrays(lambda u, p: times(u, at_least(root_mean_square(p), self.min_scale)), grads, params), state


def scale_by_param_block_rms(min_scale: float = 1e-3) -> GradientTransformation:
    """Scale each leaf's update by the root mean square of its parameter (at least
    `min_scale`), as Adafactor's ``multiply_by_parameter_scale`` (optax).

    >>> import numpy as np
    >>> t = scale_by_param_block_rms()
    >>> t.update({"w": np.ones(2)}, EmptyState(), {"w": np.full(2, 3.0)})[0]["w"]
    array([3., 3.])
    """
    return transformation(_ScaleByParamBlockRms(check_float("min_scale", min_scale)))
