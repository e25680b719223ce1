"""Lion: the sign of a mix of the gradient and its momentum (Chen et al. 2023, optax)."""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from luxnn.backend import module_of

from .arrays import (
    Params, Updates, cast_like, counted, leafwise, next_count, out_buffer, upcast, zero_count, zeros_like_tree
)  # fmt: skip
from .base import FreshUpdates, FusedUpdate, GradientTransformation, InPlace, transformation
from .checks import check_decay, check_match
from .fused import Fragment, FusedStep

__all__ = [
    "ScaleByLionState", "scale_by_lion",
]  # fmt: skip


class ScaleByLionState(NamedTuple):
    """Step count and momentum of `scale_by_lion`."""

    count: Any
    mu: Any



def lion_leaf(gc: Any, m: Any, mu_out: Any, b1: Any, one_minus_b1: Any, b2: Any, one_minus_b2: Any) -> tuple[Any, Any]:
    """Lion's direction and momentum of one leaf `gc` (in its compute dtype, `m` its
    momentum): (the direction, a new array; mu, in `mu_out`, None: a new array).
    `LION_FRAGMENT` fuses these passes, in order."""
    xp = module_of(gc)
    direction = xp.multiply(m, b1)
    direction += xp.multiply(gc, one_minus_b1)
    xp.sign(direction, out=direction)
    mu = xp.multiply(m, b2, out=mu_out)
    mu += xp.multiply(gc, one_minus_b2)
    return direction, mu


# `lion_leaf` as a fused fragment (`fused`), its direction in the update's dtype (NumPy's
# sign: NaN stays).
def _lion_step_twin(b1, one_minus_b1, b2, one_minus_b2, count, new_count, *, dtype) -> tuple:
    new_count[...] = count + 1
    return float(b1), float(one_minus_b1), float(b2), float(one_minus_b2)  # Python floats, as `hyper`


def _lion_leaf_twin(constants, u, p, mu) -> Any:
    return lion_leaf(upcast(u), mu, mu, *constants)[0].astype(u.dtype, copy=False)


LION_FRAGMENT = Fragment(
    "lion",
    "const double $b1, const double $one_minus_b1, const double $b2, const double $one_minus_b2, "
    "const long long* $count, long long* $new_count",
    """
    const T gc = (T)u;
    const T d = mul($m0, $t_b1) + mul(gc, $t_one_minus_b1);
    $m0 = mul($m0, $t_b2) + mul(gc, $t_one_minus_b2);
    u = (P)(d > 0 ? (T)1 : d < 0 ? (T)-1 : d == 0 ? (T)0 : d);
    """,
    _lion_step_twin,
    _lion_leaf_twin,
    prologue="const T $t_b1 = (T)$b1, $t_one_minus_b1 = (T)$one_minus_b1, $t_b2 = (T)$b2, "
             "$t_one_minus_b2 = (T)$one_minus_b2;",
    epilogue="*$new_count = *$count + 1;",
    moments=1,
)


class _ScaleByLion(InPlace, FreshUpdates, FusedUpdate):

    def __init__(self, b1: float, b2: float) -> None:
        self.b1, self.b2 = b1, b2
        self.hyper = (b1, 1.0 - b1, b2, 1.0 - b2)  # the constants of `lion_leaf`

    def init(self, params: Params) -> ScaleByLionState:
        return ScaleByLionState(count=zero_count(params), mu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByLionState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.mu, "the optimizer state (lion momentum)", grads, "grads")

        def leaf(g: Any, m: Any) -> tuple[Any, Any]:
            direction, mu = lion_leaf(upcast(g), m, out_buffer(m, in_place), *self.hyper)
            return cast_like(direction, g), mu

        updates, mu = leafwise(leaf, grads, state.mu, outputs=2, into=into)
        return updates, ScaleByLionState(count=next_count(state.count), mu=mu)

    def fused_step(self, grads: Updates, state: ScaleByLionState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, ScaleByLionState]:
        check_match(state.mu, "the optimizer state (lion momentum)", grads, "grads")
        count = module_of(state.count).empty((), np.int64)  # written by the launch
        counted(state.count, count)
        step = FusedStep(LION_FRAGMENT, (state.mu,), (*self.hyper, state.count, count))
        return step, ScaleByLionState(count, state.mu)


def scale_by_lion(b1: float = 0.9, b2: float = 0.99) -> GradientTransformation:
    """Lion's direction ``sign((1 - b1) g + b1 m)``, then ``m = b2 m + (1 - b2) g`` (optax).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_lion(), optim.scale_by_learning_rate(1e-4))
    """
    return transformation(_ScaleByLion(check_decay("b1", b1), check_decay("b2", b2)))
