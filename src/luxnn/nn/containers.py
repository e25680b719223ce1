"""Containers: layers made of layers."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator

from ..core import Layer, call_child


def _named_layers(owner: str, layers: tuple[Layer, ...], named: dict[str, Layer]) -> dict[str, Layer]:
    """The children of a container, named as given or ``layer_1 ... layer_N`` (as in Lux),
    each checked to be a Layer."""
    if layers and named:
        raise ValueError(f"{owner}: pass layers either positionally or by name, not both")
    children = named or {f"layer_{i}": layer for i, layer in enumerate(layers, 1)}
    for name, layer in children.items():
        if not isinstance(layer, Layer):
            raise TypeError(f"{owner}: {name} must be a luxnn Layer, got {type(layer).__name__}")
    return children


class Chain(Layer):
    """Layers applied in sequence. Children are named ``layer_1 ... layer_N`` (as in Lux),
    or by keyword: ``Chain(encoder=..., head=...)``. Chains nest.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Chain(lx.Dense(2, 4, activation="relu"), lx.Dense(4, 1))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> sorted(ps)
    ['layer_1', 'layer_2']
    """

    def __init__(self, *layers: Layer, **named: Layer) -> None:
        self.layers = _named_layers("Chain", layers, named)

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter(self.layers.items())

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        new_st = {}
        for name, layer in self.layers.items():
            x, new_st[name] = call_child(name, layer, x, ps, st)
        return x, new_st

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, key: int | str) -> Layer:
        if isinstance(key, int):
            return list(self.layers.values())[key]
        return self.layers[key]


class SkipConnection(Layer):
    """``combine(layer(x), x)``: a residual block with the default ``combine=operator.add``.

    As Lux's SkipConnection wraps its layer, its parameters and state are the wrapped
    layer's own (no extra nesting).

    >>> import numpy as np, luxnn as lx
    >>> block = lx.SkipConnection(lx.Dense(4, 4))
    >>> ps, st = lx.setup(np.random.default_rng(0), block)
    >>> sorted(ps)
    ['bias', 'weight']
    """

    def __init__(self, layer: Layer, combine: Callable[[Any, Any], Any] = operator.add) -> None:
        if not isinstance(layer, Layer):
            raise TypeError(f"SkipConnection: layer must be a luxnn Layer, got {type(layer).__name__}")
        if not callable(combine):
            raise TypeError(f"SkipConnection: combine must be callable, got {type(combine).__name__}")
        self.layer = layer
        self.combine = combine

    def init_params(self, rng: Any) -> dict[str, Any]:
        return self.layer.init_params(rng)

    def init_state(self, rng: Any) -> dict[str, Any]:
        return self.layer.init_state(rng)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        y, st = self.layer(x, ps, st)
        return self.combine(y, x), st

    def __repr__(self) -> str:
        combine = "" if self.combine is operator.add else f", {getattr(self.combine, '__name__', self.combine)}"
        return f"SkipConnection({self.layer!r}{combine})".replace("\n", "\n  ")


class Parallel(Layer):
    """Layers applied side by side, their outputs joined by ``combine(y_1, ..., y_N)``
    (a tuple of the outputs when `combine` is None). Each layer gets `x`, or, when `x` is a
    tuple of N elements, layer i gets ``x[i]``. Children are named ``layer_1 ... layer_N``
    (or by keyword), as in Lux.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Parallel(lambda a, b: a + b, lx.Dense(3, 2), lx.Dense(3, 2))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((4, 3), np.float32), ps, st)[0].shape
    (4, 2)
    """

    def __init__(self, combine: Callable[..., Any] | None, *layers: Layer, **named: Layer) -> None:
        if not (layers or named):
            raise ValueError("Parallel: expected at least one layer")
        if combine is not None and not callable(combine):
            raise TypeError(f"Parallel: combine must be callable or None, got {type(combine).__name__}")
        self.combine = combine
        self.layers = _named_layers("Parallel", layers, named)

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter(self.layers.items())

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        split = isinstance(x, tuple) and len(x) == len(self.layers)
        outputs, new_st = [], {}
        for i, (name, layer) in enumerate(self.layers.items()):
            y, new_st[name] = call_child(name, layer, x[i] if split else x, ps, st)
            outputs.append(y)
        return (tuple(outputs) if self.combine is None else self.combine(*outputs)), new_st
