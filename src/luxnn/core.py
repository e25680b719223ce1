"""The layer base and the functions every model goes through.

A layer holds configuration only; its parameters and state are plain nested dicts that the
caller keeps and passes in, as in Lux.jl:

>>> import numpy as np, luxnn as lx
>>> model = lx.Chain(lx.Dense(2, 3, activation="relu"), lx.Dense(3, 1))
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> y, st = model(np.ones((4, 2), np.float32), ps, st)
>>> y.shape
(4, 1)
"""

from __future__ import annotations

import contextlib
import inspect
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import numpy as np

from . import tree

__all__ = [
    "Layer", "LayerError", "setup", "apply", "parameter_count", "trainmode", "testmode",
    "call_child", "call_layer", "check_params", "intercept_calls", "layer_path",
]  # fmt: skip


class LayerError(ValueError):
    """A layer rejected its input or parameters; the message starts with the layer's path
    in the model (``layer_2/weight: ...``), which containers fill in as the error rises."""

    def __init__(self, message: str, path: tuple[str, ...] = ()) -> None:
        self.message = message
        self.path = path
        super().__init__(f"{'/'.join(path)}: {message}" if path else message)

    def within(self, name: str) -> "LayerError":
        err = LayerError(self.message, (name, *self.path))
        err.__traceback__ = self.__traceback__
        return err


class Layer:
    """Base class of every layer: configuration only, no arrays.

    Subclasses override `init_params` and `init_state` (both default to ``{}``) and
    ``__call__(x, ps, st) -> (y, st)``. A container also overrides `children`, so that
    `setup`, `trainmode` and error paths walk into it. Example of a custom layer:

    >>> class Scale(Layer):
    ...     def __init__(self, dim):
    ...         self.dim = dim
    ...     def init_params(self, rng):
    ...         return {"scale": np.ones(self.dim, np.float32)}
    ...     def __call__(self, x, ps, st):
    ...         return x * ps["scale"], st
    >>> ps, st = setup(np.random.default_rng(0), Scale(3))
    >>> Scale(3)(np.ones((2, 3), np.float32), ps, st)[0].shape
    (2, 3)
    """

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        return {name: child.init_params(rng) for name, child in self.children()}

    def init_state(self, rng: np.random.Generator) -> dict[str, Any]:
        return {name: child.init_state(rng) for name, child in self.children()}

    def children(self) -> Iterator[tuple[str, "Layer"]]:
        """(name, layer) pairs of the layers this one contains; none by default."""
        return iter(())

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        raise NotImplementedError(f"{type(self).__name__} does not define __call__(x, ps, st)")

    def __repr__(self) -> str:
        """The layer's configuration: its constructor's arguments that differ from their
        defaults (read from the attributes of the same names), then its children."""
        head = f"{type(self).__name__}({', '.join(_configuration(self))}"
        kids = list(self.children())
        if not kids:
            return head + ")"
        inner = "\n".join(f"  {name} = {layer!r}".replace("\n", "\n  ") for name, layer in kids)
        return f"{head}{',' if head[-1] != '(' else ''}\n{inner}\n)"


def _configuration(layer: Layer) -> Iterator[str]:
    """``value`` or ``name=value`` for each argument of the layer's ``__init__`` that it
    keeps as an attribute of the same name and that differs from the default; layers
    (shown as children) and ``*args``/``**kwargs`` are left out."""
    params = list(inspect.signature(type(layer).__init__).parameters.values())[1:]
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or not hasattr(layer, p.name):
            continue
        value = getattr(layer, p.name)
        if isinstance(value, Layer) or (p.default is not p.empty and _same(value, p.default)):
            continue
        text = getattr(value, "__name__", None) if callable(value) and not isinstance(value, type) else None
        text = text or repr(value)
        yield text if p.default is p.empty and p.kind is not p.KEYWORD_ONLY else f"{p.name}={text}"


def _same(value: Any, default: Any) -> bool:
    try:
        return value is default or bool(type(value) is type(default) and value == default)
    except Exception:  # an __eq__ without a truth value (arrays): not the default
        return False


# The path of the layer being called, as `call_child` descends: for messages that name a
# layer by its place in the model (the dtype policy's warnings, `layer_path`).
_path: ContextVar[tuple[str, ...]] = ContextVar("luxnn_layer_path", default=())


def layer_path() -> tuple[str, ...]:
    """The path in the model of the layer being called (``("layer_2", "weight")`` style
    names of its containers' children); ``()`` outside any container.

    >>> layer_path()
    ()
    """
    return _path.get()


def call_child(name: str, layer: Layer, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, Any]:
    """Call child `name` of a container with its own parameters and state; a `LayerError`
    raised inside gains `name` in its path, and a child that does not return ``(y, st)``
    raises one naming it."""
    try:
        child_ps, child_st = ps[name], st[name]
    except (KeyError, TypeError):
        raise LayerError(
            f"parameters/state do not match the model: expected an entry {name!r} for "
            f"{type(layer).__name__}, got keys {_keys(ps)} and {_keys(st)}"
        ) from None
    token = _path.set((*_path.get(), name))
    try:
        return call_layer(layer, x, child_ps, child_st)
    except LayerError as err:
        raise err.within(name) from None
    finally:
        _path.reset(token)


# What `call_layer` calls instead of the layer itself while `intercept_calls` is active.
_interceptor: ContextVar[Callable[..., Any] | None] = ContextVar("luxnn_call_interceptor", default=None)


@contextlib.contextmanager
def intercept_calls(interceptor: Callable[..., Any]) -> Iterator[None]:
    """Within the block, every layer call made through `call_layer` (so every child that
    a container calls, and `apply`) runs as ``interceptor(layer, x, ps, st)``, which calls
    ``layer(x, ps, st)`` itself and returns its ``(y, st)``; `layer_path` says where the
    layer sits. For tools that look into a model's calls (`luxnn.summary`) without
    changing its classes. An inner block replaces an outer one's interceptor.

    >>> import luxnn as lx
    >>> seen = []
    >>> def note(layer, x, ps, st):
    ...     seen.append(type(layer).__name__)
    ...     return layer(x, ps, st)
    >>> model = lx.Chain(lx.Dense(2, 2)); ps, st = lx.setup(np.random.default_rng(0), model)
    >>> with intercept_calls(note):
    ...     _ = lx.apply(model, np.ones((1, 2), np.float32), ps, st)
    >>> seen
    ['Chain', 'Dense']
    """
    token = _interceptor.set(interceptor)
    try:
        yield
    finally:
        _interceptor.reset(token)


def call_layer(layer: Layer, x: Any, ps: Any, st: Any) -> tuple[Any, Any]:
    """``layer(x, ps, st)``, checked to be a pair ``(y, st)`` whose state is a dict (or of
    the type of `st`): a `LayerError` naming the layer otherwise. For wrappers whose
    layer shares their parameters (`SkipConnection`) and for calling a whole model.

    >>> import luxnn as lx
    >>> layer = lx.Dense(2, 1); ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> call_layer(layer, np.ones((3, 2), np.float32), ps, st)[0].shape
    (3, 1)
    """
    intercept = _interceptor.get()
    out = layer(x, ps, st) if intercept is None else intercept(layer, x, ps, st)
    if not isinstance(out, tuple) or len(out) != 2 or not isinstance(out[1], (dict, type(st))):
        raise LayerError(f"{type(layer).__name__} returned {describe(out)}: a layer returns a pair (y, st)")
    return out


def describe(out: Any) -> str:
    """What `out` is, for messages about what a function returned.

    >>> describe((1.0, {}))
    'a tuple of 2 (float, dict)'
    """
    if isinstance(out, tuple):
        return f"a {type(out).__name__} of {len(out)} ({', '.join(type(v).__name__ for v in out)})"
    shape = getattr(out, "shape", None)
    return f"a {type(out).__name__}" + ("" if shape is None else f" of shape {shape}")


def input_shape(x: Any) -> str:
    """`x`'s shape for a message about a layer's input, or what `x` is when it has none.

    >>> input_shape(np.zeros((2, 3))), input_shape([1.0])
    ('(2, 3)', 'a list')
    """
    shape = getattr(x, "shape", None)
    return describe(x) if shape is None else str(shape)


def _keys(d: Any) -> Any:
    return sorted(d) if isinstance(d, dict) else type(d).__name__


def check_params(layer: Layer, ps: Any, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise a `LayerError` unless `ps` holds exactly the arrays named in `expected`,
    with those shapes."""
    if not isinstance(ps, dict) or ps.keys() != expected.keys():
        raise LayerError(f"{layer}: expected parameters {sorted(expected)}, got {_keys(ps)}")
    for key, shape in expected.items():
        got = getattr(ps[key], "shape", None)
        if got != shape:
            raise LayerError(f"{layer}: expected parameter {key!r} of shape {shape}, got {got}")


def setup(rng: np.random.Generator, model: Layer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Initial ``(parameters, state)`` of `model`, drawn from `rng`.

    >>> import luxnn as lx
    >>> ps, st = lx.setup(np.random.default_rng(0), lx.Dense(2, 3))
    >>> {k: v.shape for k, v in ps.items()}
    {'weight': (2, 3), 'bias': (3,)}
    """
    if not isinstance(model, Layer):
        raise TypeError(f"setup: expected a luxnn Layer, got {type(model).__name__}")
    _check_children(model)
    return model.init_params(rng), model.init_state(rng)


def _check_children(model: Layer) -> None:
    """Raise a `LayerError` where a layer holds a layer that is nowhere among the model's
    children (as `children` names them): it would get no parameters, and the first call a
    bare KeyError. A layer held twice (weight tying) is a child somewhere: it passes."""
    layers = list(_walk(model, ()))
    known = {id(layer) for _, layer in layers}
    for path, layer in layers:
        # A layer with init_params of its own (a wrapper sharing its layer's parameters, as
        # SkipConnection) answers for its layers itself; the default builds on children().
        if type(layer).init_params is not Layer.init_params or not hasattr(layer, "__dict__"):
            continue
        for attribute, held in vars(layer).items():
            for child in _layers_in(held):
                if id(child) not in known:
                    raise LayerError(
                        f"{type(layer).__name__} holds the layer {type(child).__name__} in {attribute!r}, but its "
                        "children() does not name it: a container defines children() yielding (name, layer) "
                        "pairs and calls them with call_child (see help(luxnn.Layer))",
                        path,
                    )


def _walk(layer: Layer, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Layer]]:
    yield path, layer
    for name, child in layer.children():
        yield from _walk(child, (*path, name))


def _layers_in(value: Any) -> list[Layer]:
    if isinstance(value, Layer):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, Layer)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, Layer)]
    return []


def apply(model: Layer, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``model(x, ps, st)``: the output and the new state (checked to be such a pair)."""
    return call_layer(model, x, ps, st)


def parameter_count(ps: Any) -> int:
    """Number of scalars in a parameter tree.

    >>> parameter_count({"w": np.zeros((2, 3)), "b": np.zeros(3)})
    9
    """
    return int(sum(getattr(leaf, "size", 0) for leaf in tree.leaves(ps)))


def _set_training(st: Any, training: bool) -> Any:
    if isinstance(st, dict):
        return {k: (training if k == "training" else _set_training(v, training)) for k, v in st.items()}
    if isinstance(st, (list, tuple)):
        return type(st)(_set_training(v, training) for v in st)
    return st


def _with_training(who: str, st: Any, training: bool) -> Any:
    """`st` (a state tree, or a `TrainState` whose states are set) with every layer's
    ``training`` flag set; a TypeError for anything else, which has no layer to set."""
    from .training import TrainState  # training builds on this module

    if isinstance(st, TrainState):
        return st.replace(states=_set_training(st.states, training))
    if not isinstance(st, (dict, list, tuple)):
        raise TypeError(f"{who}: expected a model state (the st of lx.setup) or a TrainState, got {type(st).__name__}")
    return _set_training(st, training)


def trainmode(st: Any) -> Any:
    """A copy of state `st` with every layer in training mode (batch statistics, dropout
    on); given a `TrainState`, a copy of it whose states are in training mode.

    >>> import luxnn as lx
    >>> trainmode({"layer_1": {"training": False}})
    {'layer_1': {'training': True}}
    """
    return _with_training("trainmode", st, True)


def testmode(st: Any) -> Any:
    """A copy of state `st` with every layer in test mode (running statistics, dropout
    off); given a `TrainState`, a copy of it whose states are in test mode (sharing its
    arrays, as `TrainState.replace` does).

    >>> import luxnn as lx
    >>> model = lx.Chain(lx.Dense(2, 2), lx.Dropout(0.5))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> testmode(st)["layer_2"]["training"]
    False
    """
    return _with_training("testmode", st, False)


testmode.__test__ = False  # pytest, which collects src/luxnn for its doctests, would take it for a test
