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

from typing import Any, Iterator

import numpy as np

from . import tree

__all__ = [
    "Layer", "LayerError", "setup", "apply", "parameter_count", "trainmode", "testmode",
    "call_child", "check_params",
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
        kids = list(self.children())
        if not kids:
            return f"{type(self).__name__}()"
        inner = "\n".join(f"  {name} = {layer!r}".replace("\n", "\n  ") for name, layer in kids)
        return f"{type(self).__name__}(\n{inner}\n)"


def call_child(name: str, layer: Layer, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, Any]:
    """Call child `name` of a container with its own parameters and state; a `LayerError`
    raised inside gains `name` in its path."""
    try:
        child_ps, child_st = ps[name], st[name]
    except (KeyError, TypeError):
        raise LayerError(
            f"parameters/state do not match the model: expected an entry {name!r} for "
            f"{type(layer).__name__}, got keys {_keys(ps)} and {_keys(st)}"
        ) from None
    try:
        return layer(x, child_ps, child_st)
    except LayerError as err:
        raise err.within(name) from None


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
    return model.init_params(rng), model.init_state(rng)


def apply(model: Layer, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``model(x, ps, st)``: the output and the new state."""
    return model(x, ps, st)


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


def trainmode(st: dict[str, Any]) -> dict[str, Any]:
    """A copy of state `st` with every layer in training mode (batch statistics, dropout on)."""
    return _set_training(st, True)


def testmode(st: dict[str, Any]) -> dict[str, Any]:
    """A copy of state `st` with every layer in test mode (running statistics, dropout off)."""
    return _set_training(st, False)
