"""Containers: layers made of layers."""

from __future__ import annotations

from typing import Any, Iterator

from ..core import Layer, call_child


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
        if layers and named:
            raise ValueError("Chain: pass layers either positionally or by name, not both")
        self.layers: dict[str, Layer] = named or {f"layer_{i}": layer for i, layer in enumerate(layers, 1)}
        for name, layer in self.layers.items():
            if not isinstance(layer, Layer):
                raise TypeError(f"Chain: {name} must be a luxnn Layer, got {type(layer).__name__}")

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
