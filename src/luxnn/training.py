"""The training API: a `TrainState` and four verbs, as in Lux.jl.

Every verb runs inside ``memory.step(ts.allocator_cache)`` (a `memory.cached` scope that
marks the training step for the cache's plans; a no-op for ``None``), so a step's
temporaries come from the cache; escaping results (gradients, new parameters) are safe
because a block is reused only after its last array dies.

>>> import numpy as np, luxnn as lx
>>> model = lx.Dense(3, 2)
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None)
>>> x, y = np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32)
>>> grads, loss, stats, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.MSELoss(), (x, y), ts)
>>> ts.step
1
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
from typing import Any, Callable, Iterator

from . import graphs, optim, tree
from .ad import AutoTape, Traced, value_and_grad
from .backend import module_of
from .core import Layer, describe
from .devices import CUDADevice, check_same_device
from .memory import cached, get_allocator_cache, step
from .optim.checks import check_gradients

__all__ = [
    "TrainState", "compute_gradients", "apply_gradients", "apply_gradients_",
    "single_train_step", "single_train_step_",
]  # fmt: skip

_DEFAULT = object()  # "pick the cache for the parameters' device"

Objective = Callable[[Layer, Any, Any, Any], tuple[Any, Any, Any]]


@dataclasses.dataclass(frozen=True, eq=False, init=False)
class TrainState:
    """Everything a training loop carries from step to step.

    ``TrainState(model, parameters, states, optimizer)`` initialises the optimizer state,
    starts at step 0 and picks the allocator cache for the parameters' device
    (`luxnn.get_allocator_cache`); pass ``allocator_cache=`` your own `AllocCache` or None.

    On a CUDA device with an allocator cache, ``graphs=True`` (the default) replays a warm
    fixed-shape loop of `single_train_step_` as CUDA graphs (`luxnn.graphs`; the verbs then
    run on a stream of the state's, which its cache serves); ``graphs=False`` runs every
    step eagerly. On the CPU it changes nothing.

    `step` counts the gradients applied (calls of `apply_gradients` and of the
    ``single_train_step`` verbs). Under `luxnn.optim.MultiSteps` the optimizer updates
    once every k of them: its schedules run on its own count,
    ``ts.optimizer_state.gradient_step`` (``ts.step // k`` for an int k), so the learning
    rate of its next update is ``schedule(ts.optimizer_state.gradient_step)``.

    An in-place verb (`apply_gradients_`, `single_train_step_`) consumes the state it is
    given, and every copy sharing its arrays (made by `replace` or `copy.copy`, or by
    `luxnn.optim.set_hyperparams`): any verb given one of them again raises `ValueError`
    (use the returned state). A copy given both new ``parameters`` and a new
    ``optimizer_state`` (as `luxnn.load` and the pure verbs make) is a state of its own.
    """

    model: Layer
    parameters: Any
    states: Any
    optimizer: optim.GradientTransformation
    optimizer_state: Any
    step: int
    allocator_cache: Any

    def __init__(
        self,
        model: Layer,
        parameters: Any,
        states: Any,
        optimizer: optim.GradientTransformation,
        *,
        optimizer_state: Any = None,
        step: int = 0,
        allocator_cache: Any = _DEFAULT,
        graphs: bool = True,
    ) -> None:
        if not isinstance(model, Layer):
            raise TypeError(f"TrainState: expected a luxnn Layer as model, got {type(model).__name__}")
        if not isinstance(optimizer, optim.GradientTransformation):
            raise TypeError(f"TrainState: expected an optimizer (luxnn.optim.GradientTransformation), got {type(optimizer).__name__}")
        if allocator_cache is _DEFAULT:
            from .devices import get_device

            allocator_cache = get_allocator_cache(get_device(parameters))
        if not isinstance(graphs, bool):
            raise TypeError(f"TrainState: graphs must be True or False, got {graphs!r}")
        runner = _graph_runner(parameters, allocator_cache) if graphs else None
        if optimizer_state is None:
            # Made in the cache, so that the first update's replacement of it is the last
            # one that reaches upstream: from the second step on, blocks alternate.
            with runner.on_stream() if runner is not None else contextlib.nullcontext(), cached(allocator_cache):
                optimizer_state = optimizer.init(parameters)
        fields = {
            "model": model,
            "parameters": parameters,
            "states": states,
            "optimizer": optimizer,
            "optimizer_state": optimizer_state,
            "step": int(step),
            "allocator_cache": allocator_cache,
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)
        self.__dict__.update(_lineage=_Lineage(), _version=0, _graphs=runner)

    def replace(self, **changes: Any) -> "TrainState":
        """A copy with some fields changed (no re-validation: it runs every step). It
        shares this state's arrays, and so is consumed with it, unless it is given both
        new ``parameters`` and a new ``optimizer_state``."""
        unknown = changes.keys() - _FIELDS
        if unknown:
            raise TypeError(f"TrainState has no fields {sorted(unknown)}")
        new = object.__new__(TrainState)
        new.__dict__.update(self.__dict__, **changes)
        if "parameters" in changes and "optimizer_state" in changes:
            new.__dict__.update(_lineage=_Lineage(), _version=0)
        return new

    @property
    def consumed(self) -> bool:
        """Whether an in-place verb has updated this state's arrays since it was made
        (then only the state that verb returned is valid)."""
        return self._version != self._lineage.updates

    def to_device(self, device: Any) -> "TrainState":
        """This state's arrays on `device`, with a fresh allocator cache for that device
        (a cache serves one device). On the device the arrays are already on, they are
        the same arrays: the copy is then consumed with this state."""
        _check_not_consumed(self, "to_device")
        moved = self.replace(
            parameters=device(self.parameters),
            states=device(self.states),
            optimizer_state=device(self.optimizer_state),
            allocator_cache=get_allocator_cache(device) if self.allocator_cache is not None else None,
        )
        if self._graphs is not None:
            moved.__dict__["_graphs"] = _graph_runner(moved.parameters, moved.allocator_cache)
        if any(map(operator.is_, tree.leaves(moved.parameters)[:1], tree.leaves(self.parameters)[:1])):
            moved.__dict__.update(_lineage=self._lineage, _version=self._version)
        return moved

    # Pickling and copy.copy/deepcopy leave the allocator cache behind (its C core and its
    # blocks belong to this process and this state): the pickled form says only whether
    # there was one, and the copy gets a fresh cache for its parameters' device, as
    # `to_device` does.
    # The graph runner likewise: its graphs and stream are this process's; the pickled form
    # says whether there was one.
    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "allocator_cache": self.allocator_cache is not None,
                "_graphs": self.__dict__.get("_graphs") is not None}

    def __setstate__(self, state: dict[str, Any]) -> None:
        from .devices import get_device

        cache = get_allocator_cache(get_device(state["parameters"])) if state["allocator_cache"] else None
        self.__dict__.update(_lineage=_Lineage(), _version=0)  # for a pickled state that carries none
        runner = _graph_runner(state["parameters"], cache) if state.get("_graphs", True) else None
        self.__dict__.update(state, allocator_cache=cache, _graphs=runner)

    @property
    def graph_runner(self) -> "graphs.Runner | None":
        """The runner that captures and replays this state's `single_train_step_` as CUDA
        graphs (`luxnn.graphs`), shared by the states made from it; None on the CPU, with
        ``graphs=False`` or without an allocator cache."""
        return self.__dict__.get("_graphs")

    def __repr__(self) -> str:
        from .core import parameter_count

        return (
            f"TrainState(model={type(self.model).__name__}, parameters={parameter_count(self.parameters)}, "
            f"step={self.step}, allocator_cache={self.allocator_cache!r})"
        )


_FIELDS = frozenset(f.name for f in dataclasses.fields(TrainState))


def _graph_runner(parameters: Any, cache: Any) -> "graphs.Runner | None":
    """A graph runner for a training state of `parameters` served by `cache`: on a CUDA
    device with an allocator cache, else None."""
    arrays = tree.leaves(parameters)
    if cache is None or not isinstance(cache.device, CUDADevice) or not arrays:
        return None
    return graphs.Runner(module_of(arrays[0]), cache)


class _Lineage:
    """What a `TrainState` shares with its copies holding the same arrays: how many
    in-place updates those arrays have had, and which verb made the last one, at which
    step. A state is consumed when its own count (``_version``) is behind."""

    def __init__(self) -> None:
        self.updates, self.last = 0, ""

    def advance(self, who: str, step: int) -> int:
        self.updates += 1
        self.last = f"{who} at step {step}"
        return self.updates


def _check_not_consumed(ts: TrainState, who: str) -> None:
    behind = ts._lineage.updates - ts._version
    if behind:
        raise ValueError(
            f"{who}: this TrainState was consumed: an in-place verb wrote new parameters and optimizer state into "
            f"its arrays ({behind} update{'s' if behind > 1 else ''} since, the last by {ts._lineage.last}); use the "
            "TrainState that call returned (grads, loss, stats, ts = lx.single_train_step_(...), "
            "ts = lx.apply_gradients_(ts, grads))"
        )


def _check_ad(ad: Any) -> None:
    if not isinstance(ad, AutoTape):
        raise TypeError(f"expected an AD backend such as luxnn.AutoTape(), got {type(ad).__name__}")


# The verbs below enter the cache once, in a scope that marks the training step: a
# compute_gradients begins one, the apply_gradients after it ends it, and the
# single_train_step variants are one (a scope costs a few microseconds, and counts towards
# eviction). With a graph runner, on its stream: the one its cache serves.


@contextlib.contextmanager
def _in_step(ts: TrainState, **ends: bool) -> Iterator[None]:
    runner = ts.graph_runner
    with runner.on_stream() if runner is not None else contextlib.nullcontext(), step(ts.allocator_cache, **ends):
        yield


def _compute_gradients(objective: Objective, data: Any, ts: TrainState) -> tuple[Any, Any, Any, TrainState]:
    check_same_device("compute_gradients", ts.parameters, data, "parameters", "data")

    def loss_fn(ps: Any) -> tuple[Any, tuple[Any, Any]]:
        out = objective(ts.model, ps, ts.states, data)
        if not (isinstance(out, tuple) and len(out) == 3):
            raise ValueError(f"compute_gradients: the objective returned {describe(out)}; an objective returns "
                             "(loss, st, stats), e.g. return loss, st, {}")
        loss, st, stats = out
        if not isinstance(loss, Traced) and tree.leaves(ps):
            raise ValueError(
                f"compute_gradients: the objective's loss ({describe(loss)}) does not depend on the parameters: "
                "compute it from the ps the objective is given (model(x, ps, st)), not from ts.parameters, and "
                "return it as an array, not float(loss)"
            )
        problem = None if st is ts.states else _structure_problem(ts.states, st)
        if problem:
            raise ValueError(f"compute_gradients: the state the objective returned does not have the structure of "
                             f"ts.states: {problem}; return the st the model returned (y, st = model(x, ps, st))")
        return loss, (st, stats)

    # A `luxnn.optim.Listening` optimizer (such as `distributed.DistributedOptimizer(...,
    # overlap=True)`) takes each gradient as soon as the backward pass has finished it.
    on_gradient = optim.listen(ts.optimizer, ts.parameters)
    (loss, (states, stats)), grads = value_and_grad(loss_fn, has_aux=True, on_gradient=on_gradient)(ts.parameters)
    return grads, loss, stats, ts.replace(states=states)


_CONTAINERS = (dict, list, tuple)


def _structure_problem(expected: Any, got: Any) -> str | None:
    """Where `got` differs from `expected` in containers (dicts with the same keys, sequences
    of the same length), or None: a layer's state leaves may change, its containers not."""
    found = _first_difference(expected, got)
    if found is None:
        return None
    path, what = found
    return f"at '{'/'.join(map(str, reversed(path)))}' {what}" if path else f"at the root {what}"


def _first_difference(expected: Any, got: Any) -> tuple[list, str] | None:
    """(the path, innermost key first, and what differs there) or None. It runs every
    step: a subtree the layer passed through unchanged (the same object) is not walked,
    and a path is built only once something differs."""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return [], f"expected a dict with keys {sorted(map(str, expected))}, got {describe(got)}"
        if expected.keys() != got.keys():
            return [], f"expected keys {sorted(map(str, expected))}, got {sorted(map(str, got))}"
        pairs: Any = ((k, e, got[k]) for k, e in expected.items())
    elif isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return [], f"expected a sequence of length {len(expected)}, got {describe(got)}"
        pairs = zip(range(len(expected)), expected, got)
    else:
        return ([], f"expected a leaf, got {describe(got)}") if isinstance(got, _CONTAINERS) else None
    for key, e, g in pairs:
        if e is not g and (isinstance(e, _CONTAINERS) or isinstance(g, _CONTAINERS)):
            found = _first_difference(e, g)
            if found is not None:
                found[0].append(key)
                return found
    return None


def _apply_gradients(ts: TrainState, grads: Any, who: str | None) -> TrainState:
    """The optimizer's update of `ts` with `grads`: pure, or in place when `who` (the
    verb) is given, which consumes `ts`."""
    if who is not None:
        new = _update_in_place(ts, grads)
        _Transition(new, ts, who)
        return new
    check_gradients("apply_gradients", ts.parameters, grads)
    updates, opt_state = ts.optimizer.update(grads, ts.optimizer_state, ts.parameters)
    return ts.replace(parameters=optim.apply_updates(ts.parameters, updates), optimizer_state=opt_state,
                      step=ts.step + 1)


def _update_in_place(ts: TrainState, grads: Any) -> TrainState:
    """The in-place update's new state, not yet consuming `ts` (`_Transition`)."""
    opt_state = optim.update_and_apply_(ts.optimizer, grads, ts.optimizer_state, ts.parameters)
    return ts.replace(optimizer_state=opt_state, step=ts.step + 1)


class _Transition:
    """An in-place verb's step from state `old` to `new`: `old` (and its copies) consumed by
    `who`, `new` the state to use. `undo` takes it back, for a step not done after all;
    `settle` makes `old` itself the new state, for a step done whose call was interrupted
    before it could return `new`."""

    def __init__(self, new: TrainState, old: TrainState, who: str) -> None:
        self.new, self.old = new, old
        self.before = (old._lineage.updates, old._lineage.last)
        new.__dict__["_version"] = old._lineage.advance(who, old.step)

    def undo(self) -> None:
        self.old._lineage.updates, self.old._lineage.last = self.before

    def settle(self) -> None:
        self.old.__dict__.update(self.new.__dict__)


def compute_gradients(ad: AutoTape, objective: Objective, data: Any, ts: TrainState) -> tuple[Any, Any, Any, TrainState]:
    """Gradients of ``objective(model, ps, st, data) -> (loss, st, stats)`` with respect to
    the parameters. Returns ``(grads, loss, stats, ts)``; `ts` carries the new model state.
    Parameters and `data` must be on one device (`ValueError` naming both otherwise).
    """
    _check_ad(ad)
    _check_not_consumed(ts, "compute_gradients")
    with _in_step(ts, ends=False):
        return _compute_gradients(objective, data, ts)


def apply_gradients(ts: TrainState, grads: Any) -> TrainState:
    """One optimizer update with `grads`; returns a new `TrainState` with new parameter
    and optimizer-state arrays (optax's pure update: `ts` is left untouched and stays
    valid, e.g. for a retried step)."""
    _check_not_consumed(ts, "apply_gradients")
    with _in_step(ts, begins=False):
        return _apply_gradients(ts, grads, None)


def apply_gradients_(ts: TrainState, grads: Any) -> TrainState:
    """One optimizer update with `grads`, written in place: the updates are added into the
    parameter arrays and the optimizer's moments are updated in their arrays
    (`luxnn.optim.update_and_apply_`), with the numbers of `apply_gradients`.

    It consumes `ts`: use the returned `TrainState` from then on (`ts`, and every copy
    sharing its arrays, such as ``ts.replace(...)``, sees the new values, and any verb
    given one of them raises `ValueError`). `grads` are not written. Bad input
    (gradients that do not match the parameters, a read-only parameter, parameters that
    share memory, an optimizer state or hyperparameter the optimizer refuses) raises
    `ValueError` before anything is written."""
    _check_not_consumed(ts, "apply_gradients_")
    with _in_step(ts, begins=False):
        return _apply_gradients(ts, grads, "apply_gradients_")


def single_train_step(ad: AutoTape, objective: Objective, data: Any, ts: TrainState) -> tuple[Any, Any, Any, TrainState]:
    """`compute_gradients` then `apply_gradients`: ``(grads, loss, stats, ts)``."""
    _check_ad(ad)
    _check_not_consumed(ts, "single_train_step")
    with _in_step(ts):
        grads, loss, stats, ts = _compute_gradients(objective, data, ts)
        return grads, loss, stats, _apply_gradients(ts, grads, None)


def single_train_step_(ad: AutoTape, objective: Objective, data: Any, ts: TrainState) -> tuple[Any, Any, Any, TrainState]:
    """`compute_gradients` then `apply_gradients_`: parameters and optimizer state updated
    in place, `ts` consumed (see `apply_gradients_`)."""
    _check_ad(ad)
    _check_not_consumed(ts, "single_train_step_")

    def work(batch: Any) -> tuple[Any, Any, Any, TrainState]:
        grads, loss, stats, new = _compute_gradients(objective, batch, ts)
        return grads, loss, stats, _update_in_place(new, grads)

    runner = ts.graph_runner
    if runner is not None:
        check_same_device("single_train_step_", ts.parameters, data, "parameters", "data")
        return runner.step(ad, objective, data, ts, work, lambda new, old: _Transition(new, old, "single_train_step_"))
    with step(ts.allocator_cache):
        grads, loss, stats, new = work(data)
    _Transition(new, ts, "single_train_step_")
    return grads, loss, stats, new
