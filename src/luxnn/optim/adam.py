"""Adam and its family: directions from bias-corrected first and second moments (Adam,
NAdam, AMSGrad, Adamax, RAdam, AdaBelief).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from luxnn.backend import module_of

from .arithmetic import (
    PerDtype, bias_correction, corrected_mu, corrected_mu_coefficients, moving_average, moving_average_of_squares,
    no_buffer,
)  # fmt: skip
from .arrays import (
    Params, Updates, Workspace, cast_like, counted, leafwise, next_count, out_buffer, scalar_as, upcast,
    zero_count, zeros_like_tree
)  # fmt: skip
from .base import FreshUpdates, FusedUpdate, GradientTransformation, InPlace, ScaledUpdate, transformation
from .fused import FACTOR_PROLOGUE, Fragment, FusedStep, factor_arguments, factor_of
from .checks import check_decay, check_float, check_match

__all__ = [
    "ScaleByAdamState", "ScaleByAmsgradState", "ScaleByBeliefState", "scale_by_adam", "scale_by_amsgrad",
    "scale_by_adamax", "scale_by_radam", "scale_by_belief",
]  # fmt: skip


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


class ScaleByBeliefState(NamedTuple):
    """Step count, first moment and the moment of the prediction error (`scale_by_belief`)."""

    count: Any
    mu: Any
    nu: Any


def adam_leaf(gc: Any, m: Any, v: Any, scratch: Any, mu_out: Any, nu_out: Any, b1: Any, one_minus_b1: Any, b2: Any,
              one_minus_b2: Any, eps: Any, eps_root: Any, c2: Any, a: Any, b: Any) -> tuple[Any, Any, Any]:
    """Adam's moments and direction of one leaf `gc` (in its compute dtype, `m` and `v` its
    moments), pass by pass: (the direction, in `scratch`; mu, in `mu_out`; nu, in `nu_out`)
    (an ``out=`` of None: a new array). ``b`` is None, or Nesterov's coefficient of `gc`
    (`corrected_mu_coefficients`). `ADAM_FRAGMENT` fuses these passes, in the same order."""
    xp = module_of(gc)
    scratch = xp.multiply(gc, one_minus_b1, out=scratch)
    mu = xp.multiply(m, b1, out=mu_out)
    mu += scratch
    xp.multiply(gc, gc, out=scratch)
    scratch *= one_minus_b2
    nu = xp.multiply(v, b2, out=nu_out)
    nu += scratch
    # scratch <- sqrt(nu_hat + eps_root) + eps
    xp.multiply(nu, c2, out=scratch)
    if eps_root:
        scratch += eps_root
    xp.sqrt(scratch, out=scratch)
    scratch += eps
    if b is not None:
        xp.divide(corrected_mu(mu, gc, a, b), scratch, out=scratch)
    else:  # (mu / denominator) * a: one array fewer than m_hat first
        xp.divide(mu, scratch, out=scratch)
        scratch *= a
    return scratch, mu, nu


# `adam_leaf` as a fused fragment (`fused`): the count, the bias corrections and Nesterov's
# coefficients computed in the kernel from the step count, as `_ScaleByAdam._scalars` does;
# products rounded one by one (`MUL_PREAMBLE`).
def _adam_step_twin(b1, one_minus_b1, b2, one_minus_b2, eps, eps_root, nesterov, count, new_count, factor_value,
                    factor_array, *, dtype) -> tuple:
    new_count[...] = count + 1
    c2, a, b = adam_scalars(b1, b2, count + 1, bool(nesterov), factor_of(factor_value, factor_array))
    hyper = (float(x) for x in (b1, one_minus_b1, b2, one_minus_b2, eps, eps_root))  # Python floats, as `hyper`
    return (*hyper, c2.astype(dtype), a.astype(dtype), None if b is None else b.astype(dtype))


def _adam_leaf_twin(constants, u, p, mu, nu) -> Any:
    return adam_leaf(upcast(u), mu, nu, None, mu, nu, *constants)[0].astype(u.dtype, copy=False)


ADAM_FRAGMENT = Fragment(
    "adam",
    "const double $b1, const double $one_minus_b1, const double $b2, const double $one_minus_b2, const double $eps, "
    "const double $eps_root, const int $nesterov, const long long* $count, long long* $new_count, "
    "const double $factor_value, const double* $factor_array",
    """
    const T gc = (T)u;
    $m0 = mul($m0, $t_b1) + mul(gc, $t_one_minus_b1);
    $m1 = mul($m1, $t_b2) + mul(mul(gc, gc), $t_one_minus_b2);
    const T denominator = sqrt(mul($m1, $c2) + $t_eps_root) + $t_eps;
    u = (P)($nesterov ? (mul($m0, $a) + mul(gc, $b)) / denominator : mul($m0 / denominator, $a));
    """,
    _adam_step_twin,
    _adam_leaf_twin,
    prologue=FACTOR_PROLOGUE + """
    const T $t_b1 = (T)$b1, $t_one_minus_b1 = (T)$one_minus_b1, $t_b2 = (T)$b2, $t_one_minus_b2 = (T)$one_minus_b2;
    const T $t_eps = (T)$eps, $t_eps_root = (T)$eps_root;
    const double $t = (double)(*$count + 1), $c1 = 1.0 / (1.0 - pow($b1, $t));
    const T $c2 = (T)(1.0 / (1.0 - pow($b2, $t)));
    const T $a = (T)(($nesterov ? $b1 * (1.0 / (1.0 - pow($b1, $t + 1.0))) : $c1) * $factor);
    const T $b = (T)($nesterov ? (1.0 - $b1) * $c1 * $factor : 0.0);
    """,
    epilogue="*$new_count = *$count + 1;",
    moments=2,
)


def adam_scalars(b1: float, b2: float, count: Any, nesterov: bool, factor: Any) -> tuple[Any, Any, Any]:
    """(c2, a, b) of `adam_leaf` after `count` steps, the direction times `factor`."""
    c1, c2 = bias_correction(b1, count), bias_correction(b2, count)
    a, b = corrected_mu_coefficients(b1, count, c1, nesterov)
    return c2, a * factor, None if b is None else b * factor


class _ScaleByAdam(InPlace, FreshUpdates, ScaledUpdate, FusedUpdate):

    def __init__(self, b1: float, b2: float, eps: float, eps_root: float, nesterov: bool) -> None:
        self.b1, self.b2, self.eps, self.eps_root, self.nesterov = b1, b2, eps, eps_root, nesterov
        self.hyper = (b1, 1.0 - b1, b2, 1.0 - b2, eps, eps_root)  # the constants of `adam_leaf`

    def init(self, params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=zero_count(params), mu=zeros_like_tree(params), nu=zeros_like_tree(params))

    def compute(self, grads: Updates, state: ScaleByAdamState, params: Params, in_place: bool,
                into: list | None = None):
        return self.update_scaled(grads, state, params, 1.0, in_place, into)

    def _step(self, grads: Updates, state: ScaleByAdamState, factor: Any) -> tuple[Any, tuple]:
        """The new count and the scalars (c2, a, b) of `adam_leaf`."""
        check_match(state.mu, "the optimizer state (adam moments)", grads, "grads")
        count = next_count(state.count)
        return count, adam_scalars(self.b1, self.b2, count, self.nesterov, factor)

    def update_scaled(self, grads: Updates, state: ScaleByAdamState, params: Params, factor: Any, in_place: bool,
                      into: list | None = None):
        count, scalars = self._step(grads, state, factor)
        scalars = PerDtype(*scalars)
        scratch_for = Workspace(into) if into is not None else no_buffer

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            direction, mu, nu = adam_leaf(gc, m, v, scratch_for(gc), out_buffer(m, in_place), out_buffer(v, in_place),
                                          *self.hyper, *scalars[gc.dtype])
            return cast_like(direction, g), mu, nu

        updates, mu, nu = leafwise(leaf, grads, state.mu, state.nu, outputs=3, into=into)
        return updates, ScaleByAdamState(count=count, mu=mu, nu=nu)

    def fused_step(self, grads: Updates, state: ScaleByAdamState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, ScaleByAdamState]:
        check_match(state.mu, "the optimizer state (adam moments)", grads, "grads")
        count = module_of(state.count).empty((), np.int64)  # written by the launch
        counted(state.count, count)
        arguments = (*self.hyper, self.nesterov, state.count, count, *factor_arguments(factor))
        return FusedStep(ADAM_FRAGMENT, (state.mu, state.nu), arguments), ScaleByAdamState(count, state.mu, state.nu)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8, eps_root: float = 0.0, *,
                  nesterov: bool = False) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat + eps_root) + eps)`` with bias-corrected
    moments ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2``, ``m_hat = m / (1 - b1**t)``,
    ``v_hat = v / (1 - b2**t)``, t the 1-based step (PyTorch and optax); ``nesterov=True``
    is NAdam's momentum (optax's, Dozat 2016).

    >>> from luxnn import optim
    >>> opt = optim.chain(scale_by_adam(), optim.scale_by_learning_rate(1e-3))  # == adam(1e-3)
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
        c1 = bias_correction(b1, count) if self.correct_mu else 1.0
        c2 = bias_correction(b2, count) if self.correct_nu else 1.0

        def leaf(g: Any, m: Any, v: Any, v_max: Any) -> tuple[Any, ...]:
            gc = upcast(g)
            xp, dtype = module_of(gc), gc.dtype
            scratch = xp.multiply(gc, 1.0 - b1)
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            nu = moving_average_of_squares(gc, v, b2, scratch, out_buffer(v, in_place))
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
    >>> opt = optim.chain(scale_by_amsgrad(), optim.scale_by_learning_rate(1e-3))  # == amsgrad(1e-3)
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
        c1 = bias_correction(b1, count)

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
    >>> opt = optim.chain(scale_by_adamax(), optim.scale_by_learning_rate(2e-3))  # == adamax(2e-3)
    """
    return transformation(_ScaleByAdamax(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps)))


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
        c1, c2 = bias_correction(b1, count), bias_correction(b2, count)
        b2t = b2**count
        ro = ro_inf - 2 * count * b2t / (1 - b2t)
        rectify = ro >= self.threshold  # a 0-d bool: selected by `where`, never read on the host
        ro = xp.where(rectify, ro, ro_inf)  # a value whose root is real where it is not used
        r = xp.sqrt((ro - 4.0) * (ro - 2.0) * ro_inf / ((ro_inf - 4.0) * (ro_inf - 2.0) * ro))
        scalars = PerDtype(c2, *corrected_mu_coefficients(b1, count, c1, self.nesterov), r)

        def leaf(g: Any, m: Any, v: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            dtype = gc.dtype
            scratch = xp.multiply(gc, 1.0 - b1)
            mu = xp.multiply(m, b1, out=out_buffer(m, in_place))
            mu += scratch
            nu = moving_average_of_squares(gc, v, b2, scratch, out_buffer(v, in_place))
            c2_, a, b, r_ = scalars[dtype]
            mu_hat = corrected_mu(mu, gc, a, b)
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
    >>> opt = optim.chain(scale_by_radam(), optim.scale_by_learning_rate(1e-3))  # == radam(1e-3)
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
        c1, c2 = bias_correction(b1, count), bias_correction(b2, count)
        scalars = PerDtype(c2, *corrected_mu_coefficients(b1, count, c1, self.nesterov))

        def leaf(g: Any, m: Any, s: Any) -> tuple[Any, Any, Any]:
            gc = upcast(g)
            xp, dtype = module_of(gc), gc.dtype
            mu = moving_average(gc, m, b1, out=out_buffer(m, in_place))
            error = xp.subtract(gc, mu)  # the prediction error, against the new moment
            nu = moving_average_of_squares(error, s, b2, error, out_buffer(s, in_place))
            nu += eps_root
            c2_, a, b = scalars[dtype]
            mu_hat = corrected_mu(mu, gc, a, b)
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
    >>> opt = optim.chain(scale_by_belief(), optim.scale_by_learning_rate(1e-3))  # == adabelief(1e-3)
    """
    return transformation(_ScaleByBelief(check_decay("b1", b1), check_decay("b2", b2), check_float("eps", eps),
                                         check_float("eps_root", eps_root), bool(nesterov)))
