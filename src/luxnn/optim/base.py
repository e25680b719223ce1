"""The interface every optimiser shares: `GradientTransformation`, the `Stage` a building
block subclasses and the capabilities it declares, and `update_and_apply_`, which
runs an update in place (`update` applies updates, `arrays` and `checks` hold the helpers
of the leaves and of validation).

A `GradientTransformation` is a pair of functions, ``init(params) -> opt_state`` and
``update(grads, opt_state, params=None) -> (updates, opt_state)``; `chain` (module
`combine`) composes them.
The functions are bound methods of small module-level classes, `Stage` subclasses (never
local closures), so an optimiser pickles and deep-copies with its configuration. A stage
declares what more than a pure `update` it can do by subclassing the capabilities below
(`InPlaceUpdate`, `UpdateInto`, `FreshUpdates`, `OwnedUpdate`, `FoldedFactor`,
`ScaledUpdate`, `KernelUpdate`, `FusedUpdate`); `chain`, the wrappers and `update_and_apply_`
look for them with `isinstance`. A transformation made of other functions runs on the pure path.
"""

from __future__ import annotations

import abc
import typing
from typing import Any, Callable, NamedTuple, Protocol, runtime_checkable

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

from .arrays import OptState, Params, ScalarOrSchedule, Schedule, Updates, Workspace, out_buffer
from .checks import check_gradients, where
from .fused import FusedStep, launch
from .update import (  # apply_updates and its kin are part of base's interface, as in optax's base
    add_into, apply_updates, apply_updates_, check_separate, global_norm, in_place_pairs, incremental_update,
    periodic_update,
)

__all__ = [
    "GradientTransformation", "Schedule", "ScalarOrSchedule", "EmptyState", "Stage", "Stateless", "InPlaceUpdate",
    "UpdateInto", "FreshUpdates", "OwnedUpdate", "FoldedFactor", "ScaledUpdate", "KernelUpdate", "FusedUpdate",
    "InPlace", "Listening", "precheck", "update_into", "listen", "apply_updates", "apply_updates_", "update_and_apply_",
    "incremental_update", "periodic_update", "global_norm", "identity", "set_to_zero",
]  # fmt: skip


class GradientTransformation(NamedTuple):
    """An optimiser: ``init(params) -> opt_state`` and
    ``update(grads, opt_state, params=None) -> (updates, opt_state)``.

    `update` is optax's pure function: it never writes into `grads`, `params` or
    `opt_state`. `update_` is its in-place twin, for loops that consume their state.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> opt = optim.sgd(0.1)
    >>> state = opt.init({"w": np.zeros(2)})
    >>> updates, state = opt.update({"w": np.ones(2)}, state)
    >>> updates["w"]
    array([-0.1, -0.1])
    """

    init: Callable[[Params], OptState]
    update: Callable[..., tuple[Updates, OptState]]

    def update_(self, grads: Updates, opt_state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        """`update` with the same numbers, but free to write the new state into the arrays
        of `opt_state`, which it consumes: afterwards only the returned state is valid
        (the old one, and every copy sharing its arrays, may hold new values). It never
        writes into `grads` or `params`; the updates may share memory with the new state,
        so use them before the next update. If it raises, `opt_state` may be partly
        updated (`update_and_apply_` checks its input before anything is written).

        The building blocks, `chain` and the wrappers of `luxnn.optim` update their
        moments in place; a transformation that has no in-place update (one written as
        ``GradientTransformation(init_fn, update_fn)``) runs its `update`.

        >>> import numpy as np
        >>> from luxnn import optim
        >>> opt = optim.adam(0.1)
        >>> state = opt.init({"w": np.zeros(2)})
        >>> mu = state[0].mu["w"]
        >>> updates, state = opt.update_({"w": np.ones(2)}, state)
        >>> state[0].mu["w"] is mu, mu
        (True, array([0.1, 0.1]))
        """
        stage = self.stage
        if isinstance(stage, InPlaceUpdate):
            return stage.update_in_place(grads, opt_state, params)
        return self.update(grads, opt_state, params)

    @property
    def stage(self) -> Stage | None:
        """The `Stage` whose ``update`` method this transformation's `update` is (every
        building block, `chain` and wrapper of `luxnn.optim`), or None for one made of
        other functions: what declares its capabilities."""
        owner = getattr(self.update, "__self__", None)
        return owner if isinstance(owner, Stage) and owner.update == self.update else None


class EmptyState(NamedTuple):
    """The state of a transformation that remembers nothing."""


class Stage(abc.ABC):
    """A building block of an optimiser: the `init` and pure `update` of the
    ``GradientTransformation(stage.init, stage.update)``, its configuration in its fields.

    A stage that can do more declares it by also subclassing the capabilities below; what
    it does not declare runs on the pure path, with the same numbers. The results of the
    faster paths are those of `update`, bit for bit.

    >>> import numpy as np
    >>> from luxnn import optim, tree
    >>> class Halve(optim.Stateless, optim.FoldedFactor):  # a factor chain folds into Adam
    ...     def update(self, grads, state, params=None):
    ...         return tree.map(lambda g: 0.5 * g, grads), state
    ...     def folded_factor(self, state):
    ...         return 0.5, state
    >>> halve = Halve()
    >>> opt = optim.chain(optim.scale_by_adam(), optim.GradientTransformation(halve.init, halve.update))
    >>> opt.update({"w": np.ones(2)}, opt.init({"w": np.zeros(2)}))[0]["w"]
    array([0.5, 0.5])
    """

    @abc.abstractmethod
    def init(self, params: Params) -> OptState:
        """The state before the first update."""

    @abc.abstractmethod
    def update(self, grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        """The updates and the new state; writes into none of its arguments."""

    def precheck(self, state: OptState) -> None:
        """Raise what `update` of `state` would raise for another reason than the gradients
        (a hyperparameter or a schedule's value out of its domain); a stage holding inner
        transformations passes it on to them (`precheck`). What lets `update_and_apply_`
        refuse bad input before its first stage writes anything. Nothing, by default."""


class InPlaceUpdate(Stage):
    """A stage that can write its new state into the arrays of the old one."""

    @abc.abstractmethod
    def update_in_place(self, grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        """As `update`, with the new state written into the arrays of `state` where they can
        be (`out_buffer`): what `GradientTransformation.update_` calls."""


class UpdateInto(Stage):
    """A stage that can add its updates into the parameters as it makes them."""

    @abc.abstractmethod
    def update_into(self, grads: Updates, state: OptState, params: Params, into: list) -> OptState:
        """As ``update_in_place``, with each leaf's update added into ``into[i]`` (the
        parameters' arrays, in leaf order) instead of returned, as soon as it is computed
        (one leaf's update alive at a time; a `Workspace` may hold every leaf's scratch);
        returns the new state. What `update_and_apply_` runs."""


class FreshUpdates(Stage):
    """A stage whose updates are arrays it has just made, held by nothing else (not the
    gradients, not a buffer of its state): the next stage may write into them."""


class OwnedUpdate(Stage):
    """A stage that can compute its updates in the arrays of the updates it is given."""

    @abc.abstractmethod
    def update_owned(self, updates: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        """As `update`, free to write into `updates`: `chain` calls it after a stage with
        `FreshUpdates`."""


class FoldedFactor(Stage):
    """A stage that only multiplies the updates by a scalar (a learning rate)."""

    @abc.abstractmethod
    def folded_factor(self, state: OptState) -> tuple[Any, OptState]:
        """The factor of this update and the new state."""


class ScaledUpdate(Stage):
    """A stage that can multiply its updates by a factor within its last product: `chain`
    folds a `FoldedFactor` stage that follows it into it (Adam's direction and the learning
    rate: one pass over memory fewer per leaf)."""

    @abc.abstractmethod
    def update_scaled(self, grads: Updates, state: OptState, params: Params, factor: Any, in_place: bool,
                      into: list | None = None) -> tuple[Updates, OptState]:
        """The pure (`in_place` False), in-place or added-`into` update, times `factor`."""


class KernelUpdate(Stage):
    """A stage whose update added into parameters on the GPU is one elementwise kernel per
    leaf, computing the whole stage and writing the parameter and the state's moments in
    place: `update_into` and `chain` (this stage last, or followed by a `FoldedFactor`
    stage, folded in) run it when the parameters are CuPy arrays."""

    @abc.abstractmethod
    def kernel_update_into(self, grads: Updates, state: OptState, params: Params, into: list,
                           factor: Any = 1.0) -> OptState:
        """As `UpdateInto.update_into`, with the updates times `factor`, one kernel launch
        per leaf; `into` holds CuPy arrays."""


class FusedUpdate(Stage):
    """A stage whose update of an element is CUDA code (a `fused.Fragment`): adding into
    CuPy parameters, `update_into` and `chain` (when each of its stages is a `FusedUpdate`
    or a `FoldedFactor`) compose the fragments into one kernel over all leaves of a dtype,
    which writes the parameters and the moments in place (`fused.launch`)."""

    @abc.abstractmethod
    def fused_step(self, grads: Updates, state: OptState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, OptState]:
        """This update's part of the fused launch and the new state (the arrays of `state`
        the step names are written by the launch). `factor`: that of a `FoldedFactor` stage
        that follows a stage that is also `ScaledUpdate`, folded into its update (1.0 for
        any other). Raises what `update` would, before anything is launched."""


def on_device(into: list) -> bool:
    """Whether `into` (the parameters' arrays) are CuPy arrays: what a `KernelUpdate` fuses."""
    return bool(into) and module_of(into[0]) is not np


@runtime_checkable
class Listening(Protocol):
    """An optimizer that takes the gradients while the backward pass finishes them (e.g.
    ``luxnn.distributed.DistributedOptimizer(..., overlap=True)``): see `listen`."""

    def listen(self, params: Params) -> Callable[[int, Any], None] | None: ...


def listen(optimizer: GradientTransformation, params: Params) -> Callable[[int, Any], None] | None:
    """The training verbs call this before each backward pass: for a `Listening` optimizer,
    its ``on_gradient(position, gradient)``, which `luxnn.ad.value_and_grad` calls once per
    leaf of `params` (`position` in `luxnn.tree.leaves` order) as soon as its gradient is
    final; None for any other optimizer (or one that does not listen to this pass).

    >>> import numpy as np
    >>> from luxnn import optim
    >>> listen(optim.adam(1e-3), {"w": np.zeros(2)}) is None
    True
    """
    return optimizer.listen(params) if isinstance(optimizer, Listening) else None


def transformation(stage: Stage) -> GradientTransformation:
    """The `GradientTransformation` of `stage` (its bound ``init`` and ``update``)."""
    return GradientTransformation(stage.init, stage.update)


def state_type(stage: Any) -> type | None:
    """The NamedTuple class of the states that `stage`'s ``init`` is annotated to return
    (None when it is not annotated with one): what its update reads fields of."""
    cls = type(stage)
    found = _STATE_TYPES.get(cls, _UNKNOWN)
    if found is _UNKNOWN:
        try:
            found = typing.get_type_hints(cls.init).get("return")
        except Exception:  # no init, or annotations that do not resolve: nothing to check
            found = None
        if not (isinstance(found, type) and issubclass(found, tuple) and hasattr(found, "_fields")):
            found = None
        _STATE_TYPES[cls] = found
    return found


_STATE_TYPES: dict = {}
_UNKNOWN = object()


def check_state_type(stage: Any, state: Any) -> None:
    """A ValueError unless `state` is of the type `stage`'s ``init`` makes (a state made by
    another optimizer would otherwise fail on a missing field, after earlier stages wrote)."""
    expected = state_type(stage)
    if expected is not None and not isinstance(state, expected):
        raise ValueError(
            f"expected an optimizer state of type {expected.__name__}, got one of type {type(state).__name__}: "
            "it was made by another optimizer; pass the state this optimizer's init made (opt.init(params))"
        )


def precheck(transformation: GradientTransformation, state: OptState) -> None:
    """Raise, before anything is written, what `transformation`'s update of `state` would
    raise for another reason than its gradients: a state made by another optimizer, a
    hyperparameter or a schedule's value out of its domain (`Stage.precheck`).
    `update_and_apply_` runs it first; a transformation that is no `Stage` checks nothing.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> precheck(optim.adam(1e-3), optim.sgd(0.1, momentum=0.9).init({"w": np.zeros(2)}))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: expected an optimizer state of type ScaleByAdamState, got one of type TraceState: ...
    """
    stage = transformation.stage
    if stage is not None:
        check_state_type(stage, state)
        stage.precheck(state)


class Stateless(Stage):
    """Base of the stages that remember nothing: `init` returns `EmptyState` (so their
    in-place update is their update)."""

    def init(self, params: Params) -> EmptyState:
        return EmptyState()


class InPlace(InPlaceUpdate, UpdateInto):
    """Base of the stages that make their three updates from one
    ``compute(grads, state, params, in_place, into=None)``: ``update`` with
    ``in_place=False`` (pure, as optax), ``update_in_place`` with True, and
    ``update_into`` with `into` given (it then returns None for the updates it added, or
    the updates, which are then added here)."""

    @abc.abstractmethod
    def compute(self, grads: Updates, state: OptState, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, OptState]:
        """The update (see the class)."""

    def update(self, grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        check_state_type(self, state)
        return self.compute(grads, state, params, False)

    def update_in_place(self, grads: Updates, state: OptState, params: Params = None) -> tuple[Updates, OptState]:
        check_state_type(self, state)
        return self.compute(grads, state, params, True)

    def update_into(self, grads: Updates, state: OptState, params: Params, into: list) -> OptState:
        check_state_type(self, state)
        updates, state = self.compute(grads, state, params, True, into)
        if updates is not None:
            add_into(into, updates, grads)
        return state


def update_into(transformation: GradientTransformation, grads: Updates, state: OptState, params: Params,
                into: list) -> OptState:
    """`transformation`'s in-place update (`GradientTransformation.update_`, which consumes
    `state`) with its updates added into `into`, a list of arrays, one per leaf of `grads`
    (usually the parameters' arrays, ``luxnn.tree.leaves(params)``); returns the new state.
    A stage declaring `FusedUpdate` updates every leaf of CuPy arrays of a dtype in one
    kernel; one declaring `KernelUpdate` computes each leaf of CuPy arrays in one kernel; one
    declaring `UpdateInto` adds each leaf's update as soon as it is computed; for any
    other, the updates are computed first and then added.

    >>> import numpy as np
    >>> from luxnn import optim, tree
    >>> params, opt = {"w": np.ones(2)}, optim.sgd(0.5)
    >>> state = update_into(opt, {"w": np.ones(2)}, opt.init(params), params, tree.leaves(params))
    >>> params["w"]
    array([0.5, 0.5])
    """
    count = len(tree.leaves(grads))
    if len(into) != count:
        raise ValueError(f"update_into: expected into to hold one array per leaf of grads ({count}), got {len(into)}")
    stage = transformation.stage
    if isinstance(stage, FusedUpdate) and on_device(into):
        check_state_type(stage, state)
        step, new_state = stage.fused_step(grads, state, params)
        if launch([step], grads, into):
            return new_state
    if isinstance(stage, KernelUpdate) and on_device(into):
        check_state_type(stage, state)
        return stage.kernel_update_into(grads, state, params, into)
    if isinstance(stage, UpdateInto):
        return stage.update_into(grads, state, params, into)
    updates, state = transformation.update_(grads, state, params)
    add_into(into, updates, grads)
    return state


def check_transformation(name: str, value: Any) -> GradientTransformation:
    """`value`, checked to be an optimizer that can go inside another (`chain`, the
    wrappers). A `Listening` one (a DistributedOptimizer) cannot: the training verbs look
    for it outermost (`listen`), to stream the gradients and to open the step in which
    layers keep their statistics in step over the ranks; inside another it would silently
    do neither."""
    if not isinstance(value, GradientTransformation):
        raise ValueError(f"{name} must be a GradientTransformation, got {type(value).__name__}")
    if isinstance(value, Listening):
        raise ValueError(
            f"{name} is an optimizer that listens to the backward pass (a DistributedOptimizer), which must be the "
            "outermost optimizer, where the training verbs find it: wrap the other way round, e.g. "
            "DistributedOptimizer(backend, MultiSteps(adam(1e-3), 4))"
        )
    return value


def update_and_apply_(optimizer: GradientTransformation, grads: Updates, opt_state: OptState,
                      params: Params) -> OptState:
    """One update of `optimizer` added into `params` in place, its state updated in place
    (`GradientTransformation.update_`); returns the new optimizer state. The numbers are
    those of ``apply_updates_(params, optimizer.update(grads, opt_state, params)[0])``.

    `opt_state` is consumed (see `update_`). Each leaf's update is added into its
    parameter as soon as it is computed (the building blocks, `chain` and the wrappers:
    one leaf's update is alive at a time), so no tree of updates is made. `grads` are
    checked against `params` first (structure, shapes, writable parameters, dtypes), so
    bad input raises `ValueError` with the parameters and `opt_state` as they were. This
    is what the in-place training verbs (`luxnn.apply_gradients_`,
    `luxnn.single_train_step_`) run.

    >>> import numpy as np
    >>> from luxnn import optim
    >>> params = {"w": np.ones(2)}
    >>> opt = optim.sgd(0.5)
    >>> state = update_and_apply_(opt, {"w": np.ones(2)}, opt.init(params), params)
    >>> params["w"]
    array([0.5, 0.5])
    """
    targets = tree.leaves(params)
    pairs = in_place_pairs("update_and_apply_", params, targets, grads, "grads")  # updates have the gradients' dtypes
    check_gradients("update_and_apply_", params, grads, [g for _, g in pairs])
    check_separate("update_and_apply_", params, targets)
    precheck(optimizer, opt_state)
    return update_into(optimizer, grads, opt_state, params, targets)


class _Identity(Stateless):
    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        return grads, state


def identity() -> GradientTransformation:
    """Pass the updates through unchanged.

    >>> identity().update({"w": 1.0}, EmptyState())
    ({'w': 1.0}, EmptyState())
    """
    return transformation(_Identity())


class _SetToZero(Stateless):
    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        # -0.0, not +0.0: x + (-0.0) is x for every x including -0.0, so a frozen leaf
        # stays bit-identical (and the update equals optax's zeros).
        return tree.map(lambda g: module_of(g).full_like(g, -0.0), grads), state


def set_to_zero() -> GradientTransformation:
    """Updates of zeros: with `multi_transform`, it freezes a part of the model.

    >>> import numpy as np
    >>> set_to_zero().update({"w": np.ones(2)}, EmptyState())[0]["w"]
    array([-0., -0.])
    """
    return transformation(_SetToZero())
