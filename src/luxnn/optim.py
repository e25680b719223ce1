"""Optimisers as composable gradient transformations, in the style of optax.

A `GradientTransformation` is a pair of pure functions:

- ``init(params) -> opt_state``
- ``update(grads, opt_state, params=None) -> (updates, opt_state)``

The updates already carry the minus sign: ``apply_updates(params, updates)`` adds them.
Named optimisers (`sgd`, `adam`, `adamw`, `rmsprop`, `adagrad`) are `chain`s of small
building blocks (`scale_by_adam`, `trace`, `scale_by_learning_rate`, ...), so a variant is
one `chain` away.

>>> import numpy as np
>>> from luxnn import optim
>>> params = {"w": np.ones(3)}
>>> opt = optim.adam(1e-3)
>>> opt_state = opt.init(params)
>>> updates, opt_state = opt.update({"w": np.full(3, 0.5)}, opt_state, params)
>>> params = optim.apply_updates(params, updates)

Conventions the rest of luxnn relies on:

- No hidden state: everything an optimiser remembers is in `opt_state`, a tree of small
  NamedTuples whose leaves are arrays. Step counts are 0-d int64 arrays created with the
  array module of the parameters (NumPy or CuPy), so the whole state saves and loads as a
  pytree of arrays.
- `update` is pure: it returns new update arrays and new moment arrays, and never writes
  into `grads`, `params` or the old state (optax semantics; an old state stays valid, e.g.
  for a retried step). Temporaries are combined with in-place operations on arrays the
  function has just created, which keeps allocations to about one per result.
- Scalars enter as Python floats, so under NEP 50 float32 arrays stay float32.
- Learning rates accept a float or a schedule (a callable ``step -> float``); a schedule is
  called with the number of updates done before this one (0 on the first update), read
  from the state's count. On CuPy that read is one small device-to-host copy per step.
- Semantics match PyTorch where PyTorch and optax differ (rmsprop's and adagrad's eps
  outside the square root, momentum applied before the learning rate), so a run can be
  compared with ``torch.optim`` step for step.
"""

from __future__ import annotations

import math
import operator
from types import ModuleType
from typing import Any, Callable, NamedTuple, Union

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

__all__ = [
    "GradientTransformation",
    "Schedule",
    "ScalarOrSchedule",
    "EmptyState",
    "TraceState",
    "ScaleByAdamState",
    "ScaleByRmsState",
    "ScaleByStddevState",
    "ScaleByRssState",
    "ScaleByScheduleState",
    "apply_updates",
    "apply_updates_",
    "global_norm",
    "identity",
    "chain",
    "scale",
    "scale_by_schedule",
    "scale_by_learning_rate",
    "trace",
    "scale_by_adam",
    "scale_by_rms",
    "scale_by_stddev",
    "scale_by_rss",
    "clip_by_global_norm",
    "add_decayed_weights",
    "sgd",
    "adam",
    "adamw",
    "rmsprop",
    "adagrad",
    "constant_schedule",
    "linear_schedule",
    "cosine_decay_schedule",
    "warmup_cosine_decay_schedule",
]

Schedule = Callable[[int], float]
ScalarOrSchedule = Union[float, Schedule]
OptState = Any
Updates = Any
Params = Any


class GradientTransformation(NamedTuple):
    """An optimiser: ``init(params) -> opt_state`` and
    ``update(grads, opt_state, params=None) -> (updates, opt_state)``.

    >>> import numpy as np
    >>> opt = sgd(0.1)
    >>> state = opt.init({"w": np.zeros(2)})
    >>> updates, state = opt.update({"w": np.ones(2)}, state)
    >>> updates["w"]
    array([-0.1, -0.1])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]


class EmptyState(NamedTuple):
    """The state of a transformation that remembers nothing."""


class TraceState(NamedTuple):
    """Momentum buffer of `trace`."""

    trace: Any


class ScaleByAdamState(NamedTuple):
    """Step count and first and second moments of `scale_by_adam`."""

    count: Any
    mu: Any
    nu: Any


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


# ----------------------------------------------------------------------------------------
# Helpers: array modules, validation, tree matching


def _module_of_tree(t: Any) -> ModuleType:
    leaves = tree.leaves(t)
    return module_of(leaves[0]) if leaves else np


def _zero_count(params: Params) -> Any:
    return _module_of_tree(params).zeros((), dtype=np.int64)


def _next_count(count: Any) -> Any:
    # Stays a 0-d array of the count's module (NumPy would turn `count + 1` into a scalar).
    return module_of(count).asarray(count + 1)


def _check_float(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
                 low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a Python float, or a ValueError naming `name` and the allowed range."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if math.isnan(number) or too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")
    return number


def _check_learning_rate(name: str, learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    if callable(learning_rate):
        return learning_rate
    return _check_float(name, learning_rate)


def _check_steps(name: str, value: Any, *, positive: bool) -> int:
    try:
        steps = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if steps < (1 if positive else 0):
        raise ValueError(f"{name} must be {'>= 1' if positive else '>= 0'}, got {steps}")
    return steps


def _tree_mismatch(expected: Any, got: Any, path: tuple = ()) -> str | None:
    """Where and how `got` differs from `expected` in structure or leaf shapes, or None.
    (It runs on every update: the path is only formatted once something differs.)"""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{_where(path)}: expected a dict with keys {list(expected)}, got {type(got).__name__}"
        if expected.keys() != got.keys():
            return f"{_where(path)}: expected keys {sorted(map(str, expected))}, got {sorted(map(str, got))}"
        children = [(k, expected[k], got[k]) for k in expected]
    elif isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            size = f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""
            return f"{_where(path)}: expected a sequence of length {len(expected)}, got {type(got).__name__}{size}"
        children = list(zip(range(len(expected)), expected, got))
    else:
        if isinstance(got, (dict, list, tuple)):
            return f"{_where(path)}: expected an array, got a {type(got).__name__}"
        expected_shape, got_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
        if expected_shape is not None and got_shape is not None and tuple(expected_shape) != tuple(got_shape):
            return f"{_where(path)}: expected shape {tuple(expected_shape)}, got {tuple(got_shape)}"
        return None
    for key, e, g in children:
        problem = _tree_mismatch(e, g, (*path, key))
        if problem:
            return problem
    return None


def _where(path: tuple) -> str:
    return f"at '{'/'.join(map(str, path))}'" if path else "at the root"


def _check_match(expected: Any, expected_name: str, got: Any, got_name: str) -> None:
    problem = _tree_mismatch(expected, got)
    if problem:
        raise ValueError(f"{got_name} do not match {expected_name} {problem}")


# ----------------------------------------------------------------------------------------
# Applying updates


def apply_updates(params: Params, updates: Updates) -> Params:
    """New parameters ``params + updates``; each result keeps its parameter's dtype.

    >>> import numpy as np
    >>> apply_updates({"w": np.ones(2, np.float32)}, {"w": np.full(2, -0.5)})["w"]
    array([0.5, 0.5], dtype=float32)
    """
    _check_match(params, "params", updates, "updates")
    return tree.map(lambda p, u: (p + u).astype(p.dtype, copy=False), params, updates)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """Add `updates` to `params` in place (``p += u``) and return the same `params` tree.

    Every array keeps its identity and dtype. The trees are checked before any array is
    touched, so a mismatch raises without a half-applied update.

    >>> import numpy as np
    >>> w = np.ones(2, np.float32)
    >>> apply_updates_({"w": w}, {"w": np.full(2, -0.5)})["w"] is w
    True
    """
    _check_match(params, "params", updates, "updates")

    def add_in_place(p: Any, u: Any) -> None:
        p += u

    tree.map(add_in_place, params, updates)
    return params


def global_norm(updates: Updates) -> Any:
    """The L2 norm of all leaves of `updates` taken together: a NumPy scalar, or a 0-d
    CuPy array that stays on the device (no host synchronisation). Half-precision leaves
    are summed in float32 so that their squares do not overflow.

    >>> import numpy as np
    >>> float(global_norm({"a": np.array([3.0]), "b": np.array([4.0])}))
    5.0
    """
    leaves = tree.leaves(updates)
    if not leaves:
        return np.zeros(())
    squares = [module_of(g).vdot(g, g) for g in (_at_least_float32(g) for g in leaves)]
    return module_of(leaves[0]).sqrt(sum(squares[1:], squares[0]))


def _at_least_float32(g: Any) -> Any:
    return g if g.dtype.itemsize >= 4 else g.astype(np.float32)


# ----------------------------------------------------------------------------------------
# Combinators and stateless building blocks


def identity() -> GradientTransformation:
    """Pass the updates through unchanged.

    >>> identity().update({"w": 1.0}, EmptyState())
    ({'w': 1.0}, EmptyState())
    """

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        return grads, state

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after the other; the state is the tuple of their states.

    >>> opt = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
    """
    for i, t in enumerate(transforms):
        if not isinstance(t, GradientTransformation):
            raise ValueError(f"chain: argument {i} must be a GradientTransformation, got {type(t).__name__}")

    def init(params: Params) -> tuple:
        return tuple(t.init(params) for t in transforms)

    def update(grads: Updates, state: tuple, params: Params = None) -> tuple[Updates, tuple]:
        if not isinstance(state, tuple) or len(state) != len(transforms):
            size = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(f"chain of {len(transforms)} transformations got an optimizer state of {size} entries")
        new_states = []
        for t, s in zip(transforms, state):
            grads, s = t.update(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)

    return GradientTransformation(init, update)


def scale(factor: float) -> GradientTransformation:
    """Multiply the updates by a constant `factor`.

    >>> import numpy as np
    >>> scale(-2.0).update({"w": np.ones(1)}, EmptyState())[0]
    {'w': array([-2.])}
    """
    factor = _check_float("scale: factor", factor, low=-math.inf)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        return tree.map(lambda g: g * factor, grads), state

    return GradientTransformation(init, update)


def scale_by_schedule(step_size_fn: Schedule) -> GradientTransformation:
    """Multiply the updates by ``step_size_fn(step)``, step = updates done so far.

    >>> import numpy as np
    >>> t = scale_by_schedule(lambda step: 1.0 / (step + 1))
    >>> updates, state = t.update({"w": np.ones(1)}, t.init({"w": np.ones(1)}))
    """
    if not callable(step_size_fn):
        raise ValueError(f"scale_by_schedule: step_size_fn must be callable, got {step_size_fn!r}")

    def init(params: Params) -> ScaleByScheduleState:
        return ScaleByScheduleState(count=_zero_count(params))

    def update(grads: Updates, state: ScaleByScheduleState, params: Params = None):
        # float(): a NumPy float64 from the schedule would promote float32 updates (NEP 50).
        factor = float(step_size_fn(int(state.count)))
        return tree.map(lambda g: g * factor, grads), ScaleByScheduleState(_next_count(state.count))

    return GradientTransformation(init, update)


def scale_by_learning_rate(learning_rate: ScalarOrSchedule, *, flip_sign: bool = True) -> GradientTransformation:
    """Multiply the updates by ``-learning_rate`` (a float or a schedule).

    >>> import numpy as np
    >>> scale_by_learning_rate(0.1).update({"w": np.ones(1)}, EmptyState())[0]
    {'w': array([-0.1])}
    """
    learning_rate = _check_learning_rate("learning_rate", learning_rate)
    sign = -1.0 if flip_sign else 1.0
    if callable(learning_rate):
        return scale_by_schedule(lambda step: sign * float(learning_rate(step)))
    return scale(sign * learning_rate)


def clip_by_global_norm(max_norm: float) -> GradientTransformation:
    """Scale the updates down so that their `global_norm` is at most `max_norm` (optax).

    Updates whose norm is below `max_norm` pass unchanged; otherwise each is multiplied by
    ``max_norm / norm``. The factor is computed on the arrays' device, without a sync.

    >>> import numpy as np
    >>> clip_by_global_norm(1.0).update({"w": np.array([3.0, 4.0])}, EmptyState())[0]
    {'w': array([0.6, 0.8])}
    """
    max_norm = _check_float("clip_by_global_norm: max_norm", max_norm, low_open=True)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        leaves = tree.leaves(grads)
        if not leaves:
            return grads, state
        norm = global_norm(grads)
        factor = max_norm / module_of(norm).maximum(norm, max_norm)  # exactly 1 when norm <= max_norm
        return tree.map(lambda g: g * factor.astype(g.dtype), grads), state

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (needs `params` in `update`).

    Before `scale_by_learning_rate` this is L2 regularisation, as PyTorch's SGD
    ``weight_decay``; after `scale_by_adam` it is AdamW's decoupled decay.

    >>> import numpy as np
    >>> t = add_decayed_weights(0.1)
    >>> t.update({"w": np.zeros(1)}, EmptyState(), {"w": np.ones(1)})[0]
    {'w': array([0.1])}
    """
    weight_decay = _check_float("add_decayed_weights: weight_decay", weight_decay)

    def init(params: Params) -> EmptyState:
        return EmptyState()

    def update(grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        if params is None:
            raise ValueError("add_decayed_weights needs the parameters: call update(grads, opt_state, params)")
        _check_match(params, "params", grads, "grads")

        def decay(g: Any, p: Any) -> Any:
            out = p * weight_decay
            out += g
            return out

        return tree.map(decay, grads, params), state

    return GradientTransformation(init, update)


# ----------------------------------------------------------------------------------------
# Stateful building blocks


def _zeros_like_tree(params: Params) -> Any:
    return tree.map(lambda p: module_of(p).zeros_like(p), params)


def _moving_average(g: Any, m: Any, decay: float) -> Any:
    """``decay * m + (1 - decay) * g`` as a new array."""
    out = m * decay
    out += g * (1.0 - decay)
    return out


def _moving_average_of_squares(g: Any, v: Any, decay: float) -> Any:
    """``decay * v + (1 - decay) * g**2`` as a new array."""
    square = g * g
    square *= 1.0 - decay
    out = v * decay
    out += square
    return out


def trace(decay: float, nesterov: bool = False) -> GradientTransformation:
    """Momentum: ``t = g + decay * t``; the update is `t`, or ``g + decay * t`` with Nesterov.

    Matches PyTorch's SGD momentum buffer (dampening 0).

    >>> import numpy as np
    >>> t = trace(0.9)
    >>> updates, state = t.update({"w": np.ones(1)}, t.init({"w": np.zeros(1)}))
    """
    decay = _check_float("trace: decay", decay)

    def init(params: Params) -> TraceState:
        return TraceState(trace=_zeros_like_tree(params))

    def update(grads: Updates, state: TraceState, params: Params = None) -> tuple[Updates, TraceState]:
        _check_match(state.trace, "the optimizer state (momentum)", grads, "grads")

        def new_trace(g: Any, t: Any) -> Any:
            out = t * decay
            out += g
            return out

        traces = tree.map(new_trace, grads, state.trace)
        updates = tree.map(new_trace, grads, traces) if nesterov else traces
        return updates, TraceState(trace=traces)

    return GradientTransformation(init, update)


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's direction ``m_hat / (sqrt(v_hat) + eps)`` with bias-corrected moments.

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2``, ``m_hat = m / (1 - b1**t)``,
    ``v_hat = v / (1 - b2**t)`` with t the 1-based step (PyTorch and optax).

    >>> opt = chain(scale_by_adam(), scale_by_learning_rate(1e-3))  # == adam(1e-3)
    """
    b1 = _check_float("b1", b1, high=1.0, high_open=True)
    b2 = _check_float("b2", b2, high=1.0, high_open=True)
    eps = _check_float("eps", eps)

    def init(params: Params) -> ScaleByAdamState:
        return ScaleByAdamState(count=_zero_count(params), mu=_zeros_like_tree(params), nu=_zeros_like_tree(params))

    def update(grads: Updates, state: ScaleByAdamState, params: Params = None):
        _check_match(state.mu, "the optimizer state (adam moments)", grads, "grads")
        count = _next_count(state.count)
        step = int(count)
        correction1 = 1.0 - b1**step
        correction2 = 1.0 - b2**step
        mu = tree.map(lambda g, m: _moving_average(g, m, b1), grads, state.mu)
        nu = tree.map(lambda g, v: _moving_average_of_squares(g, v, b2), grads, state.nu)

        def direction(m: Any, v: Any) -> Any:
            denominator = v / correction2
            module_of(denominator).sqrt(denominator, out=denominator)
            denominator += eps
            out = m / correction1
            out /= denominator
            return out

        return tree.map(direction, mu, nu), ScaleByAdamState(count=count, mu=mu, nu=nu)

    return GradientTransformation(init, update)


def _divide_by_root_plus_eps(g: Any, accumulator: Any, eps: float) -> Any:
    """``g / (sqrt(accumulator) + eps)`` as a new array (PyTorch's eps outside the root)."""
    denominator = module_of(accumulator).sqrt(accumulator)
    denominator += eps
    return g / denominator


def scale_by_rms(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """RMSprop's direction ``g / (sqrt(v) + eps)``, ``v = decay v + (1 - decay) g**2``.

    PyTorch semantics: eps is added outside the square root and v starts at 0 (optax's
    default puts eps inside).

    >>> opt = chain(scale_by_rms(0.9), scale_by_learning_rate(1e-2))  # == rmsprop(1e-2)
    """
    decay = _check_float("decay", decay, high=1.0)
    eps = _check_float("eps", eps)

    def init(params: Params) -> ScaleByRmsState:
        return ScaleByRmsState(nu=_zeros_like_tree(params))

    def update(grads: Updates, state: ScaleByRmsState, params: Params = None):
        _check_match(state.nu, "the optimizer state (rms)", grads, "grads")
        nu = tree.map(lambda g, v: _moving_average_of_squares(g, v, decay), grads, state.nu)
        return tree.map(lambda g, v: _divide_by_root_plus_eps(g, v, eps), grads, nu), ScaleByRmsState(nu=nu)

    return GradientTransformation(init, update)


def scale_by_stddev(decay: float = 0.9, eps: float = 1e-8) -> GradientTransformation:
    """Centred RMSprop's direction ``g / (sqrt(v - m**2) + eps)``, m and v moving averages
    of g and g**2 (PyTorch's ``RMSprop(centered=True)``; eps outside the square root).

    >>> opt = chain(scale_by_stddev(0.9), scale_by_learning_rate(1e-2))
    """
    decay = _check_float("decay", decay, high=1.0)
    eps = _check_float("eps", eps)

    def init(params: Params) -> ScaleByStddevState:
        return ScaleByStddevState(mu=_zeros_like_tree(params), nu=_zeros_like_tree(params))

    def update(grads: Updates, state: ScaleByStddevState, params: Params = None):
        _check_match(state.mu, "the optimizer state (centered rms)", grads, "grads")
        mu = tree.map(lambda g, m: _moving_average(g, m, decay), grads, state.mu)
        nu = tree.map(lambda g, v: _moving_average_of_squares(g, v, decay), grads, state.nu)

        def direction(g: Any, m: Any, v: Any) -> Any:
            variance = m * m
            module_of(variance).subtract(v, variance, out=variance)
            return _divide_by_root_plus_eps(g, variance, eps)

        return tree.map(direction, grads, mu, nu), ScaleByStddevState(mu=mu, nu=nu)

    return GradientTransformation(init, update)


def scale_by_rss(initial_accumulator_value: float = 0.0, eps: float = 1e-10) -> GradientTransformation:
    """Adagrad's direction ``g / (sqrt(s) + eps)``, s the running sum of g**2 started at
    `initial_accumulator_value` (PyTorch semantics; optax puts eps inside the root).

    >>> opt = chain(scale_by_rss(), scale_by_learning_rate(1e-2))  # == adagrad(1e-2)
    """
    initial_accumulator_value = _check_float("initial_accumulator_value", initial_accumulator_value)
    eps = _check_float("eps", eps)

    def init(params: Params) -> ScaleByRssState:
        return ScaleByRssState(
            sum_of_squares=tree.map(lambda p: module_of(p).full_like(p, initial_accumulator_value), params)
        )

    def update(grads: Updates, state: ScaleByRssState, params: Params = None):
        _check_match(state.sum_of_squares, "the optimizer state (adagrad sums)", grads, "grads")

        def accumulate(g: Any, s: Any) -> Any:
            out = g * g
            out += s
            return out

        sums = tree.map(accumulate, grads, state.sum_of_squares)
        updates = tree.map(lambda g, s: _divide_by_root_plus_eps(g, s, eps), grads, sums)
        return updates, ScaleByRssState(sum_of_squares=sums)

    return GradientTransformation(init, update)


# ----------------------------------------------------------------------------------------
# Named optimisers


def sgd(learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """Stochastic gradient descent, with optional (Nesterov) momentum, as ``torch.optim.SGD``.

    For L2 weight decay, put ``add_decayed_weights(wd)`` in front: ``chain(add_decayed_weights(wd), sgd(lr))``.

    >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    """
    learning_rate = _check_learning_rate("sgd: learning_rate", learning_rate)
    momentum = _check_float("sgd: momentum", momentum)
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0.0")
    if momentum == 0.0:
        return chain(scale_by_learning_rate(learning_rate))
    return chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))


def adam(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999,
         eps: float = 1e-8) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` and ``optax.adam``.

    >>> opt = adam(3e-4)
    """
    learning_rate = _check_learning_rate("adam: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(learning_rate))


def adamw(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          weight_decay: float = 1e-4) -> GradientTransformation:
    """Adam with decoupled weight decay, ``p -= lr * (adam_direction + weight_decay * p)``,
    as ``torch.optim.AdamW`` and ``optax.adamw`` (the decay is scaled by the learning rate).

    >>> opt = adamw(1e-3, weight_decay=1e-2)
    """
    learning_rate = _check_learning_rate("adamw: learning_rate", learning_rate)
    return chain(
        scale_by_adam(b1, b2, eps),
        add_decayed_weights(weight_decay),
        scale_by_learning_rate(learning_rate),
    )


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8, momentum: float = 0.0,
            centered: bool = False) -> GradientTransformation:
    """RMSprop with PyTorch's semantics: ``torch.optim.RMSprop(lr, alpha=decay, eps,
    momentum, centered)``. eps is added outside the square root, the averages start at 0,
    and momentum is applied before the learning rate (optax differs on the first and last).

    >>> opt = rmsprop(1e-2, decay=0.99, momentum=0.9, centered=True)
    """
    learning_rate = _check_learning_rate("rmsprop: learning_rate", learning_rate)
    momentum = _check_float("rmsprop: momentum", momentum)
    direction = scale_by_stddev(decay, eps) if centered else scale_by_rms(decay, eps)
    if momentum == 0.0:
        return chain(direction, scale_by_learning_rate(learning_rate))
    return chain(direction, trace(momentum), scale_by_learning_rate(learning_rate))


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.0,
            eps: float = 1e-10) -> GradientTransformation:
    """Adagrad with PyTorch's semantics (``torch.optim.Adagrad`` with lr_decay=0):
    ``p -= lr * g / (sqrt(sum g**2) + eps)``.

    >>> opt = adagrad(1e-2, initial_accumulator_value=0.1)
    """
    learning_rate = _check_learning_rate("adagrad: learning_rate", learning_rate)
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))


# ----------------------------------------------------------------------------------------
# Schedules (optax semantics): callables from the 0-based step to a float


def constant_schedule(value: float) -> Schedule:
    """Always `value`.

    >>> constant_schedule(0.1)(1000)
    0.1
    """
    value = float(value)
    return lambda step: value


def linear_schedule(init_value: float, end_value: float, transition_steps: int,
                    transition_begin: int = 0) -> Schedule:
    """`init_value` until `transition_begin`, then linearly to `end_value` over
    `transition_steps` steps, then `end_value`.

    >>> s = linear_schedule(1.0, 0.0, transition_steps=10)
    >>> s(0), s(5), s(10), s(99)
    (1.0, 0.5, 0.0, 0.0)
    """
    init_value, end_value = float(init_value), float(end_value)
    transition_steps = _check_steps("linear_schedule: transition_steps", transition_steps, positive=True)
    transition_begin = _check_steps("linear_schedule: transition_begin", transition_begin, positive=False)

    def schedule(step: int) -> float:
        done = min(max(step - transition_begin, 0), transition_steps)
        return (init_value - end_value) * (1.0 - done / transition_steps) + end_value

    return schedule


def cosine_decay_schedule(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Half a cosine from `init_value` down to ``alpha * init_value`` over `decay_steps`
    steps, then constant.

    >>> s = cosine_decay_schedule(1.0, decay_steps=10)
    >>> s(0), s(5), s(10)
    (1.0, 0.5, 0.0)
    """
    init_value = float(init_value)
    decay_steps = _check_steps("cosine_decay_schedule: decay_steps", decay_steps, positive=True)
    alpha = _check_float("cosine_decay_schedule: alpha", alpha, low=-math.inf)

    def schedule(step: int) -> float:
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(step, decay_steps) / decay_steps))
        return init_value * ((1.0 - alpha) * cosine + alpha)

    return schedule


def warmup_cosine_decay_schedule(init_value: float, peak_value: float, warmup_steps: int, decay_steps: int,
                                 end_value: float = 0.0) -> Schedule:
    """Linear warm-up from `init_value` to `peak_value` over `warmup_steps`, then cosine
    decay to `end_value`; `decay_steps` counts the warm-up too (optax).

    >>> s = warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=110)
    >>> s(0), s(5), s(10), s(60), s(110)
    (0.0, 0.5, 1.0, 0.5, 0.0)
    """
    warmup_steps = _check_steps("warmup_cosine_decay_schedule: warmup_steps", warmup_steps, positive=False)
    decay_steps = _check_steps("warmup_cosine_decay_schedule: decay_steps", decay_steps, positive=True)
    if decay_steps <= warmup_steps:
        raise ValueError(
            f"warmup_cosine_decay_schedule: decay_steps must exceed warmup_steps={warmup_steps}, got {decay_steps}"
        )
    peak_value, end_value = float(peak_value), float(end_value)
    alpha = 0.0 if peak_value == 0.0 else end_value / peak_value
    decay = cosine_decay_schedule(peak_value, decay_steps - warmup_steps, alpha)
    if warmup_steps == 0:
        return decay
    warmup = linear_schedule(init_value, peak_value, warmup_steps)

    def schedule(step: int) -> float:
        return warmup(step) if step < warmup_steps else decay(step - warmup_steps)

    return schedule
