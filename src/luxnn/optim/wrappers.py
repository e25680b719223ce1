"""Transformations of transformations (optax's semantics): parts of the model
(`masked`, `multi_transform`), gradient accumulation (`MultiSteps`), skipping bad steps
(`apply_if_finite`), and hyperparameters held in the optimizer state (`inject_hyperparams`,
changed mid-run with `set_hyperparams`).

>>> import numpy as np
>>> from luxnn import optim, tree
>>> params = {"dense": {"weight": np.ones((2, 2)), "bias": np.zeros(2)}}
>>> decay_weights = lambda ps: tree.map(lambda p: p.ndim > 1, ps)
>>> opt = optim.adamw(1e-3, weight_decay=1e-2, mask=decay_weights)  # no decay on biases
>>> opt = optim.multi_transform({"train": optim.adam(1e-3), "frozen": optim.set_to_zero()},
...                             {"dense": {"weight": "train", "bias": "frozen"}})
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from luxnn import capturing, tree
from luxnn.backend import module_of

from .arrays import (
    Params, Updates, cast_like, host_count, map_arrays, module_of_tree, next_count, out_buffer, scalar_as, shaped_like,
    upcast, zero_count, zeros_like_tree
)  # fmt: skip
from .base import (
    FusedUpdate, GradientTransformation, InPlace, Stateless, check_transformation, precheck, transformation,
    update_into
)  # fmt: skip
from .checks import check_match, check_steps, where
from .fused import FusedStep

__all__ = [
    "MaskedNode", "MaskedState", "MultiTransformState", "MultiStepsState", "ApplyIfFiniteState",
    "InjectHyperparamsState", "masked", "multi_transform", "MultiSteps", "apply_if_finite",
    "inject_hyperparams", "set_hyperparams",
]  # fmt: skip


class MaskedNode(NamedTuple):
    """Stands for a leaf a `masked` transformation does not see: a node with no leaves."""


_MASKED = MaskedNode()  # one for every hidden leaf: it holds nothing


class MaskedState(NamedTuple):
    """The inner transformation's state, over the leaves the mask selects."""

    inner_state: Any


class MultiTransformState(NamedTuple):
    """Per label, the `MaskedState` of that label's transformation."""

    inner_states: dict


class MultiStepsState(NamedTuple):
    """`MultiSteps`: the mini-step within the current k, the number of inner updates made,
    the inner optimizer's state and the gradients accumulated so far."""

    mini_step: Any
    gradient_step: Any
    inner_opt_state: Any
    acc_grads: Any


class ApplyIfFiniteState(NamedTuple):
    """`apply_if_finite`: consecutive and total skipped updates, whether the last update
    was finite, and the inner state."""

    notfinite_count: Any
    last_finite: Any
    total_notfinite: Any
    inner_state: Any


class InjectHyperparamsState(NamedTuple):
    """`inject_hyperparams`: the step count, the numeric hyperparameters (0-d arrays, set
    with `set_hyperparams`), the values the schedules gave at the last update, and the
    inner state."""

    count: Any
    hyperparams: dict
    scheduled: dict
    inner_state: Any


def _zero_update(g: Any) -> Any:
    # -0.0: adding it leaves every parameter bit-identical (see `set_to_zero`).
    return module_of(g).full_like(g, -0.0)


# ----------------------------------------------------------------------------------------
# Masks and labels: prefix trees of the parameters


def _spread(prefix: Any, full: Any, what: str, check_leaf: Callable[[Any], str | None]) -> list:
    """The leaves of `prefix` repeated over the leaves of `full` they stand for, in the
    order of ``tree.leaves(full)`` (a leaf of `prefix` may stand for a whole subtree, as in
    optax). A mismatch raises `ValueError` naming `what` and the first differing path."""
    out: list = []
    _spread_into(prefix, full, what, check_leaf, (), out)
    return out


def _spread_into(prefix: Any, full: Any, what: str, check_leaf: Callable[[Any], str | None], path: tuple,
                 out: list) -> None:
    if not isinstance(prefix, (dict, list, tuple)):
        problem = check_leaf(prefix)
        if problem:
            raise ValueError(f"{what} {where(path)}: {problem}")
        if isinstance(full, (dict, list, tuple)):
            out.extend([prefix] * len(tree.leaves(full)))
        else:
            out.append(prefix)
        return
    if isinstance(prefix, dict):
        if not isinstance(full, dict):
            raise ValueError(f"{what} does not match the parameters {where(path)}: "
                             f"a dict where the parameters have a {type(full).__name__}")
        if prefix.keys() != full.keys():
            missing, extra = sorted(map(str, full.keys() - prefix.keys())), sorted(map(str, prefix.keys() - full.keys()))
            raise ValueError(f"{what} does not match the parameters {where(path)}: "
                             f"keys missing {missing}, keys not in the parameters {extra}")
        for k in full:
            _spread_into(prefix[k], full[k], what, check_leaf, (*path, k), out)
        return
    if not isinstance(full, (list, tuple)) or len(full) != len(prefix):
        size = f" of length {len(full)}" if isinstance(full, (list, tuple)) else ""
        raise ValueError(f"{what} does not match the parameters {where(path)}: a sequence of length "
                         f"{len(prefix)} where the parameters have a {type(full).__name__}{size}")
    for i, (p, f) in enumerate(zip(prefix, full)):
        _spread_into(p, f, what, check_leaf, (*path, i), out)


def _bool_leaf(value: Any) -> str | None:
    if isinstance(value, (bool, np.bool_)):
        return None
    return f"expected a bool, got {value!r}"


def _hide(selected: list, leaves: list, template: Any) -> Any:
    """The tree of `leaves` (shaped as `template`) with the unselected ones `MaskedNode`."""
    return shaped_like(template, [leaf if keep else _MASKED for leaf, keep in zip(leaves, selected)])


def _params_leaves(params: Params, grads: Updates, count: int) -> list | None:
    if params is None:
        return None
    leaves = tree.leaves(params)
    if len(leaves) != count:
        check_match(params, "params", grads, "grads")
    return leaves


def _update(inner: GradientTransformation, in_place: bool) -> Callable[..., Any]:
    """`inner`'s update, in place (`GradientTransformation.update_`) or pure."""
    return inner.update_ if in_place else inner.update


def _inner_update(inner: GradientTransformation, grads: Updates, state: Any, params: Params, in_place: bool,
                  into: list | None) -> tuple[Updates, Any]:
    """`inner`'s update: pure, in place, or with `into` added into it (updates None)."""
    if into is not None:
        return None, update_into(inner, grads, state, params, into)
    return _update(inner, in_place)(grads, state, params)


def _zero_updates(grads: Updates, into: list | None) -> Updates:
    """Updates of -0.0; with `into`, None: adding -0.0 would leave every array as it is."""
    return None if into is not None else tree.map(_zero_update, grads)


def _masked_update(inner: GradientTransformation, selected: list, template: Any, leaves: list,
                   params_leaves: list | None, inner_state: Any, in_place: bool, into: list | None) -> Any:
    """`inner`'s update of the `selected` leaves (of a tree shaped as `template`), written
    into `leaves` (the others stay), or with `into` added into the selected arrays of
    `into` (those leaves set to None); returns the inner state."""
    hidden_params = None if params_leaves is None else _hide(selected, params_leaves, template)
    hidden = _hide(selected, leaves, template)
    if into is not None:
        inner_into = [target for target, keep in zip(into, selected) if keep]
        inner_state = update_into(inner, hidden, inner_state, hidden_params, inner_into)
        for i, keep in enumerate(selected):
            if keep:
                leaves[i] = None
        return inner_state
    new, inner_state = _update(inner, in_place)(hidden, inner_state, hidden_params)
    new_leaves = iter(tree.leaves(new))
    for i, keep in enumerate(selected):
        if keep:
            leaves[i] = next(new_leaves)
    return inner_state


class _Masked(InPlace):
    def __init__(self, inner: GradientTransformation, mask: Any) -> None:
        self.inner, self.mask = inner, mask

    def _selected(self, t: Any) -> list:
        mask = self.mask(t) if callable(self.mask) else self.mask
        return _spread(mask, t, "masked: the mask", _bool_leaf)

    def init(self, params: Params) -> MaskedState:
        return MaskedState(inner_state=self.inner.init(_hide(self._selected(params), tree.leaves(params), params)))

    def precheck(self, state: MaskedState) -> None:
        precheck(self.inner, state.inner_state)

    def compute(self, grads: Updates, state: MaskedState, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, MaskedState]:
        leaves = tree.leaves(grads)
        inner_state = _masked_update(self.inner, self._selected(grads), grads, leaves,
                                     _params_leaves(params, grads, len(leaves)), state.inner_state, in_place, into)
        if into is None:
            return shaped_like(grads, leaves), MaskedState(inner_state=inner_state)
        for target, passed in zip(into, leaves):
            if passed is not None:  # an unselected leaf: its update is the incoming one
                target += passed
        return None, MaskedState(inner_state=inner_state)


class _MaskedFused(_Masked, FusedUpdate):
    """`masked` of a stateless `FusedUpdate` stage: its fused step, on the selected leaves."""

    def fused_step(self, grads: Updates, state: MaskedState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, MaskedState]:
        step, inner_state = self.inner.stage.fused_step(grads, state.inner_state, params)
        return step._replace(active=self._selected(grads)), MaskedState(inner_state=inner_state)


def masked(inner: GradientTransformation, mask: Any) -> GradientTransformation:
    """Apply `inner` to the leaves `mask` marks True; the others pass unchanged (optax).

    `mask`: a tree of bools shaped like the parameters (or a prefix of them: a bool stands
    for a whole subtree), or a function of the parameters (of the updates, in `update`)
    returning one. `inner` sees only the selected leaves (the others are `MaskedNode`).

    >>> import numpy as np
    >>> from luxnn import optim
    >>> t = masked(optim.scale(0.0), {"w": True, "b": False})
    >>> t.update({"w": np.ones(1), "b": np.ones(1)}, t.init({"w": np.ones(1), "b": np.ones(1)}))[0]
    {'w': array([0.]), 'b': array([1.])}
    """
    inner = check_transformation("masked: inner", inner)
    fused = isinstance(inner.stage, FusedUpdate) and isinstance(inner.stage, Stateless)
    return transformation((_MaskedFused if fused else _Masked)(inner, mask))


class _MultiTransform(InPlace):
    def __init__(self, transforms: dict, param_labels: Any) -> None:
        self.transforms, self.param_labels = transforms, param_labels

    def _labels_of(self, t: Any) -> list:
        labels = self.param_labels(t) if callable(self.param_labels) else self.param_labels
        known = self.transforms

        def check_label(label: Any) -> str | None:
            try:
                if label in known:
                    return None
            except TypeError:
                pass
            return f"unknown label {label!r}; the transforms are labelled {sorted(map(str, known))}"

        return _spread(labels, t, "multi_transform: the labels", check_label)

    def init(self, params: Params) -> MultiTransformState:
        labels, leaves = self._labels_of(params), tree.leaves(params)
        return MultiTransformState({
            name: MaskedState(t.init(_hide([label == name for label in labels], leaves, params)))
            for name, t in self.transforms.items()
        })  # fmt: skip

    def _check_state(self, state: Any) -> None:
        if not isinstance(state, MultiTransformState) or state.inner_states.keys() != self.transforms.keys():
            raise ValueError(f"multi_transform of labels {sorted(map(str, self.transforms))} got another "
                             f"optimizer's state ({type(state).__name__})")

    def precheck(self, state: MultiTransformState) -> None:
        self._check_state(state)
        for name, t in self.transforms.items():
            precheck(t, state.inner_states[name].inner_state)

    def compute(self, grads: Updates, state: MultiTransformState, params: Params, in_place: bool,
                into: list | None = None):
        self._check_state(state)
        labels, leaves = self._labels_of(grads), tree.leaves(grads)
        params_leaves = _params_leaves(params, grads, len(leaves))
        inner_states = {}
        for name, t in self.transforms.items():
            selected = [label == name for label in labels]
            inner = _masked_update(t, selected, grads, leaves, params_leaves, state.inner_states[name].inner_state,
                                   in_place, into)
            inner_states[name] = MaskedState(inner)
        return None if into is not None else shaped_like(grads, leaves), MultiTransformState(inner_states)


def multi_transform(transforms: dict[Any, GradientTransformation], param_labels: Any) -> GradientTransformation:
    """Parameter groups (optax): each leaf is updated by ``transforms[label]``, its label
    read from `param_labels`, a tree of labels shaped like the parameters (or a prefix of
    them) or a function of the parameters returning one. With `set_to_zero` as a group's
    transformation, that part of the model is frozen.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> opt = multi_transform({"fast": optim.sgd(1.0), "slow": optim.sgd(0.1)}, {"a": "fast", "b": "slow"})
    >>> params = {"a": np.ones(1), "b": np.ones(1)}
    >>> opt.update(params, opt.init(params), params)[0]
    {'a': array([-1.]), 'b': array([-0.1])}
    """
    if not isinstance(transforms, dict) or not transforms:
        raise ValueError(f"multi_transform: transforms must be a non-empty dict of label -> transformation, "
                         f"got {transforms!r}")
    for label, t in transforms.items():
        check_transformation(f"multi_transform: transforms[{label!r}]", t)
    return transformation(_MultiTransform(dict(transforms), param_labels))


# ----------------------------------------------------------------------------------------
# Gradient accumulation


class _MultiSteps(InPlace):
    def __init__(self, opt: GradientTransformation, every_k_schedule: Any, use_grad_mean: bool) -> None:
        self.opt, self.every_k_schedule, self.use_grad_mean = opt, every_k_schedule, use_grad_mean

    def _k(self, gradient_step: Any) -> int:
        """The k of the current accumulation: the int given, or the schedule's value at
        `gradient_step` read on the host and checked to be an integer >= 1."""
        if not callable(self.every_k_schedule):
            return self.every_k_schedule
        gradient_step = host_count(gradient_step)  # what the schedule gets on the CPU, not read from a GPU
        k = self.every_k_schedule(gradient_step)
        try:
            number = float(k)
        except (TypeError, ValueError):
            number = math.nan
        if not (number >= 1 and number.is_integer()):
            raise ValueError(f"MultiSteps: every_k_schedule gave {k!r} after {gradient_step} inner updates; "
                             "it must give an integer >= 1 (the number of gradients to accumulate)")
        return int(number)

    def precheck(self, state: MultiStepsState) -> None:
        self._k(state.gradient_step)
        precheck(self.opt, state.inner_opt_state)

    def init(self, params: Params) -> MultiStepsState:
        return MultiStepsState(mini_step=zero_count(params), gradient_step=zero_count(params),
                               inner_opt_state=self.opt.init(params), acc_grads=zeros_like_tree(params))

    def compute(self, grads: Updates, state: MultiStepsState, params: Params, in_place: bool,
                into: list | None = None):
        check_match(state.acc_grads, "the optimizer state (accumulated gradients)", grads, "grads")
        mini = state.mini_step
        k = self._k(state.gradient_step)
        share = 1.0 / (mini + 1)  # a running mean: acc + (g - acc) / (n + 1)

        def accumulate(g: Any, acc: Any) -> Any:
            gc = upcast(g)
            xp = module_of(gc)
            if not self.use_grad_mean:
                return xp.add(gc, acc, out=out_buffer(acc, in_place))
            step = gc - acc
            step *= scalar_as(share, step.dtype)
            return xp.add(step, acc, out=out_buffer(acc, in_place, otherwise=step))

        acc = map_arrays(accumulate, grads, state.acc_grads)
        mini_next = module_of(mini).asarray((mini + 1) % k)
        # The one read of the step on the host: the inner update runs only every k-th step.
        if bool(mini == k - 1):
            updates, inner_state = _inner_update(self.opt, tree.map(cast_like, acc, grads), state.inner_opt_state,
                                                 params, in_place, into)
            # New zeros, not the accumulator zeroed: the updates may be the accumulator.
            return updates, MultiStepsState(mini_next, next_count(state.gradient_step), inner_state,
                                            zeros_like_tree(acc))
        return _zero_updates(grads, into), MultiStepsState(mini_next, state.gradient_step, state.inner_opt_state, acc)


class MultiSteps(GradientTransformation):
    """Gradient accumulation (optax's `MultiSteps`): the first k-1 of every k updates are
    zeros while the gradients are accumulated (their mean, or their sum with
    ``use_grad_mean=False``, in at least float32); the k-th applies `opt`'s update to it.
    `every_k_schedule`: an int, or a function of the number of inner updates made.

    It is itself a `GradientTransformation` (``init``, ``update``); `has_updated` says
    whether the last update applied `opt`. Each update reads its mini-step on the host (on
    a GPU one 0-d copy), so that `opt` runs only on the k-th.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> opt = MultiSteps(optim.adam(1e-3), every_k_schedule=4)
    >>> state = opt.init({"w": np.zeros(2)})
    """

    __slots__ = ()

    def __new__(cls, opt: GradientTransformation, every_k_schedule: int | Callable[[Any], Any],
                use_grad_mean: bool = True) -> "MultiSteps":
        check_transformation("MultiSteps: opt", opt)
        if not callable(every_k_schedule):
            every_k_schedule = check_steps("MultiSteps: every_k_schedule", every_k_schedule, positive=True)
        stage = _MultiSteps(opt, every_k_schedule, bool(use_grad_mean))
        return super().__new__(cls, stage.init, stage.update)

    def __getnewargs__(self) -> tuple:  # pickle and copy rebuild it from its arguments
        stage = self.stage
        return stage.opt, stage.every_k_schedule, stage.use_grad_mean

    @property
    def inner_opt(self) -> GradientTransformation:
        return self.stage.opt

    def has_updated(self, state: MultiStepsState) -> Any:
        """Whether the update that produced `state` applied the inner optimizer."""
        return (state.mini_step == 0) & (state.gradient_step > 0)

    def gradient_transformation(self) -> GradientTransformation:
        return GradientTransformation(self.init, self.update)


# ----------------------------------------------------------------------------------------
# Skipping non-finite updates


class _ApplyIfFinite(InPlace):
    def __init__(self, inner: GradientTransformation, max_consecutive_errors: int) -> None:
        self.inner, self.max_consecutive_errors = inner, max_consecutive_errors

    def init(self, params: Params) -> ApplyIfFiniteState:
        xp = module_of_tree(params)
        return ApplyIfFiniteState(notfinite_count=zero_count(params), last_finite=xp.asarray(True),
                                  total_notfinite=zero_count(params), inner_state=self.inner.init(params))

    def precheck(self, state: ApplyIfFiniteState) -> None:
        precheck(self.inner, state.inner_state)

    def compute(self, grads: Updates, state: ApplyIfFiniteState, params: Params, in_place: bool,
                into: list | None = None):
        xp = module_of(state.notfinite_count)
        finite = xp.asarray(True)
        for g in tree.leaves(grads):
            finite = finite & module_of(g).isfinite(g).all()
        notfinite = xp.where(finite, 0, state.notfinite_count + 1)
        total = xp.where(finite, state.total_notfinite, state.total_notfinite + 1)
        # One read on the host: the inner update runs only when it is applied.
        if bool(finite | (notfinite > self.max_consecutive_errors)):
            updates, inner_state = _inner_update(self.inner, grads, state.inner_state, params, in_place, into)
        else:
            updates, inner_state = _zero_updates(grads, into), state.inner_state
        return updates, ApplyIfFiniteState(xp.asarray(notfinite), xp.asarray(finite), xp.asarray(total), inner_state)


def apply_if_finite(inner: GradientTransformation, max_consecutive_errors: int) -> GradientTransformation:
    """Skip (zero updates, inner state kept) every update whose gradients hold a NaN or an
    inf, counting them; after more than `max_consecutive_errors` in a row the update is
    applied anyway (optax). Whether to apply is read on the host (on a GPU one 0-d copy),
    so that a skipped step costs no inner update.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> opt = apply_if_finite(optim.adam(1e-3), max_consecutive_errors=5)
    >>> state = opt.init({"w": np.zeros(1)})
    >>> updates, state = opt.update({"w": np.array([np.nan])}, state)
    >>> int(state.total_notfinite), updates["w"]
    (1, array([-0.]))
    """
    return transformation(_ApplyIfFinite(check_transformation("apply_if_finite: inner", inner),
                                         check_steps("apply_if_finite: max_consecutive_errors",
                                                     max_consecutive_errors, positive=False)))


# ----------------------------------------------------------------------------------------
# Hyperparameters in the state


class _Injected(InPlace):
    def __init__(self, factory: Callable[..., GradientTransformation], static: dict, numeric: dict,
                 schedules: dict) -> None:
        self.factory, self.static, self.numeric, self.schedules = factory, static, numeric, schedules

    def inner(self, values: dict) -> GradientTransformation:
        """The inner transformation for these hyperparameter values (validated by the factory)."""
        return self.factory(**self.static, **{k: float(v) for k, v in values.items()})

    def _scheduled(self, count: Any) -> dict:
        """The schedules' values at `count` (at its `host_count`, as on the CPU), as 0-d
        float64 arrays of the count's module."""
        xp, at = module_of(count), host_count(count)
        return {k: xp.asarray(f(at), dtype=np.float64) for k, f in self.schedules.items()}

    def init(self, params: Params) -> InjectHyperparamsState:
        count, xp = zero_count(params), module_of_tree(params)
        hyperparams = {k: xp.asarray(v, dtype=np.float64) for k, v in self.numeric.items()}
        scheduled = self._scheduled(count)
        inner_state = self.inner({**hyperparams, **scheduled}).init(params)
        return InjectHyperparamsState(count, hyperparams, scheduled, inner_state)

    def precheck(self, state: InjectHyperparamsState) -> None:
        precheck(self.inner({**state.hyperparams, **self._scheduled(state.count)}), state.inner_state)

    def compute(self, grads: Updates, state: InjectHyperparamsState, params: Params, in_place: bool,
                into: list | None = None):
        capturing.host_value("an injected hyperparameter (inject_hyperparams), read on the host")
        scheduled = self._scheduled(state.count)
        inner = self.inner({**state.hyperparams, **scheduled})
        updates, inner_state = _inner_update(inner, grads, state.inner_state, params, in_place, into)
        return updates, InjectHyperparamsState(next_count(state.count), state.hyperparams, scheduled, inner_state)


class _InjectHyperparams:
    """The factory `inject_hyperparams` returns: call it with the inner factory's arguments."""

    def __init__(self, factory: Callable[..., GradientTransformation], static_args: frozenset) -> None:
        self.factory, self.static_args = factory, static_args
        self.signature = inspect.signature(factory)
        unknown = static_args - self.signature.parameters.keys()
        if unknown:
            raise ValueError(f"inject_hyperparams: static_args {sorted(unknown)} are not arguments of "
                             f"{factory.__name__}; it takes {list(self.signature.parameters)}")

    def __call__(self, *args: Any, **kwargs: Any) -> GradientTransformation:
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise ValueError(f"inject_hyperparams({self.factory.__name__}): {e}") from None
        bound.apply_defaults()
        static, numeric, schedules = {}, {}, {}
        for name, value in bound.arguments.items():
            default = self.signature.parameters[name].default
            numeric_argument = default is inspect.Parameter.empty or isinstance(default, (int, float))
            if name in self.static_args or isinstance(value, (bool, np.bool_)) or value is None:
                static[name] = value
            elif callable(value) and numeric_argument and not isinstance(value, GradientTransformation):
                schedules[name] = value  # (a callable for an argument such as mask=None stays static)
            elif isinstance(value, (int, float, np.number)):
                numeric[name] = float(value)
            else:
                static[name] = value
        stage = _Injected(self.factory, static, numeric, schedules)
        stage.inner({**numeric, **stage._scheduled(np.zeros((), np.int64))})  # validates every argument now
        return transformation(stage)


def inject_hyperparams(inner_factory: Callable[..., GradientTransformation],
                       static_args: str | Iterable[str] = ()) -> Callable[..., GradientTransformation]:
    """Make the numeric arguments of `inner_factory` (e.g. `adam`'s learning rate and
    betas) live in the optimizer state, so `set_hyperparams` changes them mid-run without
    rebuilding anything (optax; Lux's ``Optimisers.adjust!``). Callables given for numeric
    arguments are schedules, evaluated at each step; booleans, None, masks (trees or
    functions) and `static_args` stay fixed.

    The inner transformation is rebuilt from the values at every update, reading the
    0-d values back to the host (one small copy per hyperparameter on a GPU).

    >>> import numpy as np
    >>> from luxnn import optim
    >>> opt = inject_hyperparams(optim.adam)(learning_rate=1e-3)
    >>> state = opt.init({"w": np.zeros(2)})
    >>> float(state.hyperparams["learning_rate"])
    0.001
    """
    if not callable(inner_factory):
        raise ValueError(f"inject_hyperparams: inner_factory must be callable, got {inner_factory!r}")
    static = frozenset({static_args} if isinstance(static_args, str) else static_args)
    return _InjectHyperparams(inner_factory, static)


def set_hyperparams(target: Any, **values: float) -> Any:
    """A copy of `target` (a `TrainState` or an optimizer state) with the hyperparameters
    of its `inject_hyperparams` state(s) set to `values`; nothing is rebuilt.

    Raises `ValueError` naming the hyperparameter when the optimizer was not made with
    `inject_hyperparams`, has no such hyperparameter, has it from a schedule, or (for a
    TrainState, whose optimizer checks every injected stage, nested ones too) when the
    value is outside its domain. An optimizer state alone is checked at its next update,
    which (in place) raises before anything is written.

    >>> import numpy as np, luxnn as lx
    >>> opt = lx.optim.inject_hyperparams(lx.optim.adam)(learning_rate=1e-3)
    >>> state = set_hyperparams(opt.init({"w": np.zeros(2)}), learning_rate=1e-4)
    >>> float(state.hyperparams["learning_rate"])
    0.0001
    """
    is_train_state = hasattr(target, "optimizer_state") and hasattr(target, "replace")
    state = target.optimizer_state if is_train_state else target
    found: list[InjectHyperparamsState] = []
    _collect_injected(state, found)
    if not found:
        raise ValueError(f"set_hyperparams({', '.join(values)}): the optimizer was not made with inject_hyperparams; "
                         "build it as lx.optim.inject_hyperparams(lx.optim.adam)(learning_rate=...)")
    for name, value in values.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"set_hyperparams: {name} must be a real number, got {value!r}") from None
        if not math.isfinite(number):
            raise ValueError(f"set_hyperparams: {name} must be a finite number, got {value!r}")
        if not any(name in s.hyperparams for s in found):
            if any(name in s.scheduled for s in found):
                raise ValueError(f"set_hyperparams: {name} comes from a schedule; give inject_hyperparams a number "
                                 "for it to set it")
            known = sorted({k for s in found for k in s.hyperparams})
            raise ValueError(f"set_hyperparams: the optimizer has no hyperparameter {name!r}; it has {known}")
        values[name] = number
    new_state = _set_injected(state, values)
    if is_train_state:
        precheck(target.optimizer, new_state)  # every injected stage, nested ones too, checks its new values
        return target.replace(optimizer_state=new_state)
    return new_state


def _collect_injected(state: Any, found: list) -> None:
    if isinstance(state, InjectHyperparamsState):
        found.append(state)
        _collect_injected(state.inner_state, found)
    elif isinstance(state, dict):
        for v in state.values():
            _collect_injected(v, found)
    elif isinstance(state, (list, tuple)):
        for v in state:
            _collect_injected(v, found)


def _set_injected(state: Any, values: dict) -> Any:
    if isinstance(state, InjectHyperparamsState):
        hyperparams = {k: (module_of(v).asarray(values[k], dtype=v.dtype) if k in values else v)
                       for k, v in state.hyperparams.items()}
        return state._replace(hyperparams=hyperparams, inner_state=_set_injected(state.inner_state, values))
    if isinstance(state, dict):
        return {k: _set_injected(v, values) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        children = [_set_injected(v, values) for v in state]
        return type(state)(*children) if hasattr(type(state), "_fields") else type(state)(children)
    return state
