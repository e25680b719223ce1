"""The interface every optimiser shares, applying updates, and the helpers the
transformations of this package have in common.

A `GradientTransformation` is a pair of functions, ``init(params) -> opt_state`` and
``update(grads, opt_state, params=None) -> (updates, opt_state)``; `chain` composes them.
The functions are bound methods of small module-level classes, `Stage` subclasses (never
local closures), so an optimiser pickles and deep-copies with its configuration. A stage
declares what more than a pure `update` it can do by subclassing the capabilities below
(`InPlaceUpdate`, `UpdateInto`, `FreshUpdates`, `OwnedUpdate`, `FoldedFactor`,
`ScaledUpdate`); `chain`, the wrappers and `update_and_apply_` look for them with
`isinstance`. A transformation made of other functions runs on the pure path.
"""

from __future__ import annotations

import abc
import math
import operator
import typing
import weakref
from types import ModuleType
from typing import Any, Callable, NamedTuple, Protocol, Union, runtime_checkable

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

__all__ = [
    "GradientTransformation", "Schedule", "ScalarOrSchedule", "EmptyState",
    "Stage", "Stateless", "InPlaceUpdate", "UpdateInto", "FreshUpdates", "OwnedUpdate", "FoldedFactor",
    "ScaledUpdate", "InPlace", "Listening", "precheck", "update_into", "listen",
    "apply_updates", "apply_updates_", "update_and_apply_", "incremental_update", "periodic_update", "global_norm",
    "identity", "set_to_zero", "chain",
]  # fmt: skip

Schedule = Callable[[Any], Any]
ScalarOrSchedule = Union[float, Schedule]
OptState = Any
Updates = Any
Params = Any


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
    A stage declaring `UpdateInto` adds each leaf's update as soon as it is computed; for
    any other, the updates are computed first and then added.

    >>> import numpy as np
    >>> from luxnn import optim, tree
    >>> params, opt = {"w": np.ones(2)}, optim.sgd(0.5)
    >>> state = update_into(opt, {"w": np.ones(2)}, opt.init(params), params, tree.leaves(params))
    >>> params["w"]
    array([0.5, 0.5])
    """
    stage = transformation.stage
    if isinstance(stage, UpdateInto):
        return stage.update_into(grads, state, params, into)
    updates, state = transformation.update_(grads, state, params)
    add_into(into, updates, grads)
    return state


def add_into(into: list, updates: Updates, like: Any) -> None:
    """``into[i] += leaf i of updates``, once every leaf is checked (`updates` shaped as
    `like`, each array of `into` able to take its update in place)."""
    for target, u in _in_place_pairs("update_into", like, into, updates, "updates"):
        target += u


class Workspace:
    """The scratch of each leaf in turn, when each leaf's update is added into its
    parameter before the next is computed (``update_into``): one flat buffer per compute
    dtype, as large as the largest array of `like` (the parameters), made on first use."""

    def __init__(self, like: list) -> None:
        self.size = max((a.size for a in like), default=0)
        self.buffers: dict = {}
        self.views: dict = {}

    def __call__(self, like: Any) -> Any:
        """A scratch array of `like`'s shape and dtype (a view of the buffer: its contents
        are those of the previous leaf's scratch)."""
        key = (like.dtype, like.shape)
        view = self.views.get(key)
        if view is None:
            buffer = self.buffers.get(like.dtype)
            if buffer is None:
                buffer = self.buffers[like.dtype] = module_of(like).empty(self.size, like.dtype)
            view = self.views[key] = buffer[: like.size].reshape(like.shape)
        return view


def out_buffer(old: Any, in_place: bool, otherwise: Any = None) -> Any:
    """The ``out=`` of a new state leaf: `old` itself when an in-place update may overwrite
    it (a writable array: CuPy's flags have no ``writeable``), else `otherwise` (None: a
    new array)."""
    if in_place:
        flags = getattr(old, "flags", None)
        if flags is not None and getattr(flags, "writeable", True):
            return old
    return otherwise


# ----------------------------------------------------------------------------------------
# Arrays: modules, counts, dtypes


def module_of_tree(t: Any) -> ModuleType:
    """The array module (NumPy or CuPy) of `t`'s first leaf; NumPy for an empty tree."""
    leaves = tree.leaves(t)
    return module_of(leaves[0]) if leaves else np


def zero_count(params: Params) -> Any:
    """A 0-d int64 step count of the parameters' array module."""
    return module_of_tree(params).zeros((), dtype=np.int64)


def next_count(count: Any) -> Any:
    """``count + 1`` as a 0-d array of the count's module (NumPy would return a scalar).
    The count never leaves its device: no Python int is made of it."""
    return module_of(count).asarray(count + 1)


_COMPUTE_DTYPES: dict = {}


def compute_dtype(dtype: Any) -> Any:
    """The dtype an optimiser computes and stores moments in for leaves of `dtype`: at
    least float32 (half-precision moments underflow and eps=1e-8 rounds to 0 in float16)."""
    found = _COMPUTE_DTYPES.get(dtype)
    if found is None:
        d = np.dtype(dtype)
        found = _COMPUTE_DTYPES[dtype] = np.dtype(np.float32) if d.kind == "f" and d.itemsize < 4 else d
    return found


def upcast(x: Any) -> Any:
    """`x` in its `compute_dtype` (`x` itself for float32 and float64)."""
    dtype = compute_dtype(x.dtype)
    return x if dtype is x.dtype or dtype == x.dtype else x.astype(dtype)


def cast_like(x: Any, like: Any) -> Any:
    """`x` in `like`'s dtype, without a copy when it already is."""
    return x if x.dtype == like.dtype else x.astype(like.dtype)


def zeros_for(p: Any) -> Any:
    """Zeros of `p`'s shape in its `compute_dtype`: a fresh moment buffer."""
    return module_of(p).zeros(p.shape, dtype=compute_dtype(p.dtype))


def zeros_like_tree(params: Params) -> Any:
    return tree.map(zeros_for, params)


def scalar_as(value: Any, dtype: Any) -> Any:
    """A scalar to multiply arrays of `dtype` by without promoting them: a Python number
    as it is (NEP 50 keeps the array's dtype), a NumPy scalar or 0-d array in `dtype`."""
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):  # np.float64 is a float
        return value
    return value.astype(dtype)


def leafwise(fn: Callable[..., tuple], first: Any, *others: Any, outputs: int, into: list | None = None) -> tuple:
    """Apply `fn` to matching leaves of `first` and `others` (same structure, checked by the
    caller) and return its `outputs` results as trees shaped like `first`.

    With `into` (arrays, one per leaf), each leaf's first result, its update, is added into
    ``into[i]`` as soon as it is made and not kept: the first tree returned is then None.
    Result k (k >= 1) whose leaves are all those of ``others[k - 1]`` (a state written in
    place) comes back as that very tree, not rebuilt.

    0-d leaves are passed to `fn` as 1-element arrays and come back 0-d: NumPy turns the
    result of an operation on 0-d arrays into a scalar, which cannot be written into with
    ``out=`` and is no array to keep in a state.
    """
    leaves = tree.leaves(first)
    other_leaves = [tree.leaves(o) for o in others]
    results = []
    for i, args in enumerate(zip(leaves, *other_leaves)):
        if getattr(args[0], "ndim", None) == 0:
            views = tuple(a.reshape(1) if hasattr(a, "reshape") else a for a in args)
            result = tuple(_unviewed(r, views, args) for r in fn(*views))
        else:
            result = fn(*args)
        if into is not None:
            into[i] += result[0]
            result = (None, *result[1:])
        results.append(result)
    columns = list(zip(*results)) if results else [()] * outputs
    trees = [None if k == 0 and into is not None else _tree_of(first, column, others, other_leaves, k)
             for k, column in enumerate(columns)]
    return tuple(trees)


def _tree_of(template: Any, column: tuple, others: tuple, other_leaves: list, k: int) -> Any:
    """`leafwise`'s result k: ``others[k - 1]`` when `column` holds its very leaves, else a
    tree of `template`'s structure holding `column`."""
    if 0 < k <= len(others) and all(map(operator.is_, column, other_leaves[k - 1])):
        return others[k - 1]
    return shaped_like(template, column)


def _unviewed(result: Any, views: tuple, args: tuple) -> Any:
    """A 0-d result of `leafwise`: the argument itself when `result` is its 1-element view
    (written in place), else `result` reshaped to 0-d."""
    for view, arg in zip(views, args):
        if result is view:
            return arg
    return result.reshape(())


def shaped_like(template: Any, leaves: Any) -> Any:
    """A tree of `template`'s structure holding `leaves` (in `tree.leaves` order); one
    walk, cheaper than `tree.flatten` and `tree.unflatten` on every update."""
    it = iter(leaves)
    return tree.map(lambda _: next(it), template)


def map_arrays(fn: Callable[..., Any], first: Any, *others: Any, into: list | None = None) -> Any:
    """`tree.map` for leaf arithmetic: as `leafwise` with one result, arrays in and out
    (with `into`, added into its arrays: None)."""
    return leafwise(lambda *args: (fn(*args),), first, *others, outputs=1, into=into)[0]


# ----------------------------------------------------------------------------------------
# Validation


def check_float(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
                low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite Python float, or a ValueError naming `name` and the allowed
    range (an infinite or NaN hyperparameter is never meant: it turns every update into
    inf or NaN)."""
    try:
        if isinstance(value, (str, bytes)):  # float("0.1") parses: a typo or a config left unparsed
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")
    return number


def check_decay(name: str, value: Any) -> float:
    """A decay rate or beta: in [0, 1)."""
    return check_float(name, value, high=1.0, high_open=True)


def check_learning_rate(name: str, learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    if callable(learning_rate):
        return learning_rate
    return check_float(name, learning_rate)


def check_schedule_value(name: str, value: Any, count: Any) -> None:
    """A ValueError naming `name` unless `value`, what a schedule gave at step `count`, is
    a finite number. A value on a GPU is not read back for the check: that would wait for
    the device on every update."""
    if isinstance(value, (int, float, np.generic, np.ndarray)):
        number = value.item() if isinstance(value, np.ndarray) and value.size == 1 else value
        if isinstance(number, np.ndarray) or not math.isfinite(number):
            raise ValueError(f"{name}: the schedule gave {value!r} at step {count}; "
                             "a schedule must give a finite number")


def check_steps(name: str, value: Any, *, positive: bool) -> int:
    try:
        steps = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if steps < (1 if positive else 0):
        raise ValueError(f"{name} must be {'>= 1' if positive else '>= 0'}, got {steps}")
    return steps


def check_transformation(name: str, value: Any) -> GradientTransformation:
    if not isinstance(value, GradientTransformation):
        raise ValueError(f"{name} must be a GradientTransformation, got {type(value).__name__}")
    return value


def tree_mismatch(expected: Any, got: Any, path: tuple = ()) -> str | None:
    """Where and how `got` differs from `expected` in structure or leaf shapes, or None.
    (It runs on every update: the path is only formatted once something differs.)"""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{where(path)}: expected a dict with keys {list(expected)}, got {type(got).__name__}"
        if expected.keys() != got.keys():
            return f"{where(path)}: expected keys {sorted(map(str, expected))}, got {sorted(map(str, got))}"
        children = [(k, expected[k], got[k]) for k in expected]
    elif isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            size = f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""
            return f"{where(path)}: expected a sequence of length {len(expected)}, got {type(got).__name__}{size}"
        children = list(zip(range(len(expected)), expected, got))
    else:
        if isinstance(got, (dict, list, tuple)):
            return f"{where(path)}: expected an array, got a {type(got).__name__}"
        expected_shape, got_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
        if expected_shape is not None and got_shape is not None and tuple(expected_shape) != tuple(got_shape):
            return f"{where(path)}: expected shape {tuple(expected_shape)}, got {tuple(got_shape)}"
        return None
    for key, e, g in children:
        problem = tree_mismatch(e, g, (*path, key))
        if problem:
            return problem
    return None


def where(path: tuple) -> str:
    """``at 'a/b'`` for a path of keys, ``at the root`` for the empty path."""
    return f"at '{'/'.join(map(str, path))}'" if path else "at the root"


def _matches(expected: Any, got: Any) -> bool:
    """Whether `got` has `expected`'s structure and leaf shapes: `tree_mismatch`'s answer
    without its paths, for the check every update makes."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or expected.keys() != got.keys():
            return False
        for k, v in expected.items():
            if not _matches(v, got[k]):
                return False
        return True
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return False
        for e, g in zip(expected, got):
            if not _matches(e, g):
                return False
        return True
    if isinstance(got, (dict, list, tuple)):
        return False
    expected_shape, got_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
    return expected_shape is None or got_shape is None or tuple(expected_shape) == tuple(got_shape)


def check_match(expected: Any, expected_name: str, got: Any, got_name: str) -> None:
    if _matches(expected, got):
        return
    problem = tree_mismatch(expected, got)
    if problem:
        raise ValueError(f"{got_name} do not match {expected_name} {problem}")


def check_gradients(who: str, params: Params, grads: Updates, leaves: list | None = None) -> None:
    """A ValueError naming `who` and the first path of `params` whose gradient is no array
    (a Python float: the optimisers compute on arrays). `leaves`: those of `grads`, if
    already at hand. Structure and shapes are checked where the gradients are used."""
    for i, g in enumerate(tree.leaves(grads) if leaves is None else leaves):
        if type(g) is not np.ndarray and not (hasattr(g, "dtype") and hasattr(g, "shape")):
            check_match(params, "params", grads, "grads")  # else the paths of params are not the gradients'
            path, p = tree.paths(params)[i]
            raise ValueError(f"{who}: the gradient at '{path}' is a {type(g).__name__}; expected an array "
                             f"of shape {tuple(getattr(p, 'shape', ()))} like its parameter")


def check_params(name: str, params: Params) -> None:
    if params is None:
        raise ValueError(f"{name} needs the parameters: call update(grads, opt_state, params)")


# ----------------------------------------------------------------------------------------
# Applying updates


def apply_updates(params: Params, updates: Updates) -> Params:
    """New parameters ``params + updates``; each result keeps its parameter's dtype.

    >>> import numpy as np
    >>> apply_updates({"w": np.ones(2, np.float32)}, {"w": np.full(2, -0.5)})["w"]
    array([0.5, 0.5], dtype=float32)
    """
    check_match(params, "params", updates, "updates")
    return tree.map(lambda p, u: (p + u).astype(p.dtype, copy=False), params, updates)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """Add `updates` to `params` in place (``p += u``) and return the same `params` tree.

    Every array keeps its identity and dtype. Every leaf is checked before the first is
    written (same structure and shapes, a writable array, an update dtype that casts into
    the parameter's), so a bad update raises `ValueError` and leaves every parameter as it was.

    >>> import numpy as np
    >>> w = np.ones(2, np.float32)
    >>> apply_updates_({"w": w}, {"w": np.full(2, -0.5)})["w"] is w
    True
    """
    targets = tree.leaves(params)
    pairs = _in_place_pairs("apply_updates_", params, targets, updates, "updates")
    check_separate("apply_updates_", params, targets)
    for p, u in pairs:
        p += u
    return params


def _in_place_pairs(who: str, params: Params, targets: list, updates: Updates, updates_name: str) -> list:
    """The (target, update) leaf pairs (`targets`: the arrays of `params`, or of a tree
    shaped as them), once every target is checked to take its update in place; else a
    ValueError naming `who` and the first path that cannot."""
    check_match(params, "params", updates, updates_name)
    pairs = list(zip(targets, tree.leaves(updates)))
    for i, (p, u) in enumerate(pairs):
        problem = _in_place_problem(p, u)
        if problem:
            raise ValueError(f"{who}: the parameter at '{tree.paths(params)[i][0]}' {problem}; nothing was updated")
    return pairs


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
    pairs = _in_place_pairs("update_and_apply_", params, targets, grads, "grads")  # updates have the gradients' dtypes
    check_gradients("update_and_apply_", params, grads, [g for _, g in pairs])
    check_separate("update_and_apply_", params, targets)
    precheck(optimizer, opt_state)
    return update_into(optimizer, grads, opt_state, params, targets)


def check_separate(who: str, params: Params, targets: list) -> None:
    """A ValueError naming `who` and two paths of `params` whose arrays (`targets`, its
    leaves) share memory, the same array twice or overlapping views: an in-place update
    would change that memory once for each, where `apply_updates` gives each its own
    new array. Arrays that own their memory are told apart by identity alone; views are
    compared by their memory once, and the verdict kept for the same arrays."""
    if len(set(map(id, targets))) == len(targets) and all(getattr(t, "base", None) is None for t in targets):
        return
    last = _SEPARATE[0]
    if len(last) == len(targets) and all(ref() is t for ref, t in zip(last, targets)):
        return
    pair = _sharing_pair(targets)
    if pair is not None:
        paths = tree.paths(params)
        raise ValueError(
            f"{who}: the parameters at '{paths[pair[0]][0]}' and '{paths[pair[1]][0]}' share memory (the same array, "
            "or overlapping views of one), so an in-place update would change it once for each; give each "
            "parameter its own array (e.g. lx.tree.map(np.copy, ps)); nothing was updated"
        )
    _SEPARATE[0] = [weakref.ref(t) for t in targets]  # weak: the check keeps no parameter alive


_SEPARATE: list = [[]]  # the last parameter arrays found to share no memory


def _sharing_pair(arrays: list) -> tuple[int, int] | None:
    """The positions of two of `arrays` that share memory, or None. Only views of one
    owner can; within each owner's views, those whose byte spans overlap are compared."""
    by_owner: dict[int, list] = {}
    for i, a in enumerate(arrays):
        owner = a
        while getattr(owner, "base", None) is not None:
            owner = owner.base
        by_owner.setdefault(id(owner), []).append(i)
    for members in by_owner.values():
        spans = sorted((_byte_span(arrays[i]), i) for i in members)
        for k, ((_, high), i) in enumerate(spans):
            for (low, _), j in spans[k + 1:]:
                if low >= high:
                    break
                if module_of(arrays[i]).shares_memory(arrays[i], arrays[j]):
                    return min(i, j), max(i, j)
    return None


def _byte_span(a: Any) -> tuple[int, int]:
    """The addresses ``[low, high)`` that array `a` may touch."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    low = high = interface["data"][0]
    if a.size == 0:
        return low, high
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high + a.itemsize


def _in_place_problem(p: Any, u: Any) -> str | None:
    if type(p) is np.ndarray and p.flags.writeable and getattr(u, "dtype", None) == p.dtype:
        return None  # the common case, decided without the checks below
    if not hasattr(p, "dtype") or not hasattr(p, "shape") or isinstance(p, np.generic):
        return f"is a {type(p).__name__}, not an array that can be updated in place"
    flags = getattr(p, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        return "is read-only"
    u_dtype = u.dtype if hasattr(u, "dtype") else np.result_type(u)
    if u_dtype != p.dtype and not np.can_cast(u_dtype, p.dtype, casting="same_kind"):
        return f"has dtype {p.dtype}, which an update of dtype {u_dtype} cannot be cast into"
    return None


def incremental_update(new_tensors: Params, old_tensors: Params, step_size: float) -> Params:
    """Polyak averaging: ``step_size * new + (1 - step_size) * old`` leaf by leaf (optax),
    in the dtype of `old_tensors`; e.g. a target network tracking the online one.

    >>> import numpy as np
    >>> incremental_update({"w": np.ones(2)}, {"w": np.zeros(2)}, 0.25)["w"]
    array([0.25, 0.25])
    """
    step_size = check_float("incremental_update: step_size", step_size, high=1.0)
    check_match(old_tensors, "old_tensors", new_tensors, "new_tensors")

    def average(new: Any, old: Any) -> Any:
        out = new * step_size
        out += old * (1.0 - step_size)
        return cast_like(out, old)

    return tree.map(average, new_tensors, old_tensors)


def periodic_update(new_tensors: Params, old_tensors: Params, steps: Any, update_period: int) -> Params:
    """`new_tensors` when ``steps`` is a multiple of `update_period`, else `old_tensors`
    (optax): a target network copied every `update_period` steps.

    >>> periodic_update({"w": 1.0}, {"w": 0.0}, steps=10, update_period=5)
    {'w': 1.0}
    """
    update_period = check_steps("periodic_update: update_period", update_period, positive=True)
    check_match(old_tensors, "old_tensors", new_tensors, "new_tensors")
    return new_tensors if steps % update_period == 0 else old_tensors


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
    squares = [module_of(g).vdot(g, g) for g in (upcast(g) for g in leaves)]
    return module_of(leaves[0]).sqrt(sum(squares[1:], squares[0]))


# ----------------------------------------------------------------------------------------
# The simplest transformations and their composition


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


# How `chain` runs a stage: its own update (pure, in place or adding `into`), its update
# into the updates the stage before made (`OwnedUpdate` after `FreshUpdates`), or its
# update scaled by the factor of the stage after it (`ScaledUpdate`, then `FoldedFactor`).
_OWN, _OWNED, _SCALED = "own", "owned", "scaled"


def _plan(stages: list) -> list[tuple[int, str]]:
    """(position of the stage, how it runs) for each step of a chain of `stages` (None for
    a transformation that is no `Stage`), from what they declare."""
    steps, i, fresh = [], 0, False  # fresh: the updates so far are arrays nothing else holds
    while i < len(stages):
        stage, follower = stages[i], stages[i + 1] if i + 1 < len(stages) else None
        if isinstance(stage, ScaledUpdate) and isinstance(follower, FoldedFactor):
            steps.append((i, _SCALED))
            stage, i = follower, i + 2
        else:
            steps.append((i, _OWNED if fresh and isinstance(stage, OwnedUpdate) else _OWN))
            i += 1
        fresh = isinstance(stage, FreshUpdates)
    return steps


class _Chain(InPlace):
    def __init__(self, transforms: tuple[GradientTransformation, ...]) -> None:
        self.transforms = transforms
        self.stages = [t.stage for t in transforms]
        self.steps = _plan(self.stages)

    def init(self, params: Params) -> tuple:
        return tuple(t.init(params) for t in self.transforms)

    def _check_state(self, state: Any) -> None:
        """A ValueError unless `state` holds one state of the right type per stage."""
        n = len(self.transforms)
        if not isinstance(state, tuple) or len(state) != n:
            size = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(f"chain of {n} transformations got an optimizer state of {size} entries")
        for stage, s in zip(self.stages, state):
            check_state_type(stage, s)

    def precheck(self, state: tuple) -> None:
        self._check_state(state)
        for stage, s in zip(self.stages, state):
            if stage is not None:
                stage.precheck(s)

    def compute(self, grads: Updates, state: tuple, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, tuple]:
        self._check_state(state)
        new_states: list = []
        last = len(self.transforms) - 1
        for i, how in self.steps:
            t, stage, s = self.transforms[i], self.stages[i], state[i]
            if how == _SCALED:
                factor, follower_state = self.stages[i + 1].folded_factor(state[i + 1])
                grads, s = stage.update_scaled(grads, s, params, factor, in_place, into if i + 1 == last else None)
                new_states += [s, follower_state]
                continue
            if how == _OWNED:
                grads, s = stage.update_owned(grads, s, params)
            elif into is not None and i == last:  # the last stage adds its updates
                grads, s = None, update_into(t, grads, s, params, into)
            else:
                grads, s = (t.update_ if in_place else t.update)(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after the other; the state is the tuple of their states.

    >>> from luxnn import optim
    >>> opt = chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3))
    """
    for i, t in enumerate(transforms):
        check_transformation(f"chain: argument {i}", t)
    return transformation(_Chain(transforms))
