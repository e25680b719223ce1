"""Directions from second moments alone: RMSprop (plain and centred) and Adagrad with
PyTorch's semantics, Adadelta, and Adafactor's factored second moments.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

from .arithmetic import divide_by_root_plus_eps, moving_average, moving_average_of_squares
from .arrays import (
    Params, Updates, cast_like, compute_dtype, leafwise, next_count, out_buffer, scalar_as, upcast, zero_count,
    zeros_for, zeros_like_tree
)  # fmt: skip
from .base import FreshUpdates, GradientTransformation, InPlace, transformation
from .checks import check_decay, check_float, check_match, check_params, check_steps

__all__ = [
    "ScaleByRmsState", "ScaleByStddevState", "ScaleByRssState", "ScaleByAdaDeltaState", "FactoredState",
    "scale_by_rms", "scale_by_stddev", "scale_by_rss", "scale_by_adadelta", "scale_by_factored_rms",
]  # fmt: skip


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


class ScaleByAdaDeltaState(NamedTuple):
    """Running means of squared gradients (`e_g`) and squared updates (`e_x`)."""

    e_g: Any
    e_x: Any


class FactoredState(NamedTuple):
    """`scale_by_factored_rms`: step count, row and column statistics of factored leaves,
    full second moments of the others (unused entries are 1-element placeholders, as optax)."""

    count: Any
    v_row: Any
    v_col: Any
    v: Any


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
            nu = moving_average_of_squares(gc, v, decay, out=out_buffer(v, in_place))
            return cast_like(divide_by_root_plus_eps(gc, nu, eps), g), nu

        updates, nu = leafwise(leaf, grads, state.nu, outputs=2, into=into)
        return updates, ScaleByRmsState(nu=nu)


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """RMSprop's direction ``g / (sqrt(v) + eps)``, ``v = decay v + (1 - decay) g**2``.

    PyTorch semantics: eps is added outside the square root and v starts at 0 (optax's
    default puts eps inside).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_rms(0.9), optim.scale_by_learning_rate(1e-2))  # == rmsprop(1e-2)
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
            mu = moving_average(gc, m, decay, out=out_buffer(m, in_place))
            nu = moving_average_of_squares(gc, v, decay, out=out_buffer(v, in_place))
            variance = mu * mu
            xp.subtract(nu, variance, out=variance)
            return cast_like(divide_by_root_plus_eps(gc, variance, eps), g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByStddevState(mu=mu, nu=nu)


def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """Centred RMSprop's direction ``g / (sqrt(v - m**2) + eps)``, m and v moving averages
    of g and g**2 (PyTorch's ``RMSprop(centered=True)``; eps outside the square root).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_stddev(0.9), optim.scale_by_learning_rate(1e-2))
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
            return cast_like(divide_by_root_plus_eps(gc, sums, eps), g), sums

        updates, sums = leafwise(leaf, grads, state.sum_of_squares, outputs=2, into=into)
        return updates, ScaleByRssState(sum_of_squares=sums)


def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Adagrad's direction ``g / (sqrt(s) + eps)``, s the running sum of g**2 started at
    `initial_accumulator_value` (PyTorch semantics; optax puts eps inside the root).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_rss(), optim.scale_by_learning_rate(1e-2))  # == adagrad(1e-2)
    """
    return transformation(_ScaleByRss(check_float("initial_accumulator_value", initial_accumulator_value),
                                      check_float("eps", eps)))


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
            new_e_g = moving_average_of_squares(gc, e_g, rho, out=out_buffer(e_g, in_place))
            # sqrt(e_x + eps) / sqrt(e_g + eps) * g
            direction = xp.add(e_x, eps)
            xp.sqrt(direction, out=direction)
            denominator = xp.add(new_e_g, eps)
            xp.sqrt(denominator, out=denominator)
            direction /= denominator
            direction *= gc
            new_e_x = moving_average_of_squares(direction, e_x, rho, denominator, out_buffer(e_x, in_place))
            return cast_like(direction, g), new_e_g, new_e_x

        updates, e_g, e_x = leafwise(leaf, grads, state.e_g, state.e_x, outputs=3, into=into)
        return updates, ScaleByAdaDeltaState(e_g=e_g, e_x=e_x)


def scale_by_adadelta(rho: float = 0.9, eps: float = 1e-6) -> GradientTransformation:
    """Adadelta's direction ``sqrt(E[dx^2] + eps) / sqrt(E[g^2] + eps) * g`` (optax,
    ``torch.optim.Adadelta``).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_adadelta(), optim.scale_by_learning_rate(1.0))  # == adadelta()
    """
    return transformation(_ScaleByAdaDelta(check_decay("rho", rho), check_float("eps", eps)))


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
