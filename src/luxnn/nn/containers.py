"""Containers: layers made of layers."""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator

from ..ad import array_namespace
from ..core import Layer, LayerError, call_child, call_layer


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


class _Layers(Layer):
    """A container of named layers (``layer_1 ... layer_N`` or by keyword), its children."""

    layers: dict[str, Layer]

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter(self.layers.items())

    def _each(self, x: Any, ps: dict[str, Any], st: dict[str, Any], split: bool) -> tuple[list[Any], dict[str, Any]]:
        """Every layer's output, on `x` or (`split`) on its own element of the tuple `x`."""
        outputs, new_st = [], {}
        for i, (name, layer) in enumerate(self.layers.items()):
            y, new_st[name] = call_child(name, layer, x[i] if split else x, ps, st)
            outputs.append(y)
        return outputs, new_st


class Chain(_Layers):
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
        y, st = call_layer(self.layer, x, ps, st)
        return self.combine(y, x), st

    def __repr__(self) -> str:
        combine = "" if self.combine is operator.add else f", {getattr(self.combine, '__name__', self.combine)}"
        return f"SkipConnection({self.layer!r}{combine})".replace("\n", "\n  ")


class Parallel(_Layers):
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

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        outputs, new_st = self._each(x, ps, st, split=isinstance(x, tuple) and len(x) == len(self.layers))
        return (tuple(outputs) if self.combine is None else self.combine(*outputs)), new_st


class BranchLayer(_Layers):
    """Every layer applied to the same input, as Lux's BranchLayer: the tuple of their
    outputs, or ``fusion(outputs)`` (the tuple as one argument) when `fusion` is given.
    Children are named ``layer_1 ... layer_N`` (or by keyword).

    >>> import numpy as np, luxnn as lx
    >>> model = lx.BranchLayer(lx.Dense(3, 2), lx.Dense(3, 4))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> [y.shape for y in model(np.ones((5, 3), np.float32), ps, st)[0]]
    [(5, 2), (5, 4)]
    """

    def __init__(self, *layers: Layer, fusion: Callable[[tuple[Any, ...]], Any] | None = None, **named: Layer) -> None:
        if not (layers or named):
            raise ValueError("BranchLayer: expected at least one layer")
        if fusion is not None and not callable(fusion):
            raise TypeError(f"BranchLayer: fusion must be callable or None, got {type(fusion).__name__}")
        self.fusion = fusion
        self.layers = _named_layers("BranchLayer", layers, named)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        outputs, new_st = self._each(x, ps, st, split=False)
        return (tuple(outputs) if self.fusion is None else self.fusion(tuple(outputs))), new_st


class Maxout(_Layers):
    """The elementwise maximum of the layers' outputs on the same input (Lux's Maxout,
    Goodfellow et al. 2013); the outputs must have one shape. Ties share the gradient.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Maxout(lx.Dense(3, 2), lx.Dense(3, 2))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((5, 3), np.float32), ps, st)[0].shape
    (5, 2)
    """

    def __init__(self, *layers: Layer, **named: Layer) -> None:
        if not (layers or named):
            raise ValueError("Maxout: expected at least one layer")
        self.layers = _named_layers("Maxout", layers, named)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        outputs, new_st = self._each(x, ps, st, split=False)
        shapes = {getattr(y, "shape", None) for y in outputs}
        if len(shapes) != 1:
            raise LayerError(f"Maxout: expected outputs of one shape, got {[getattr(y, 'shape', None) for y in outputs]}")
        y = outputs[0]
        if len(outputs) > 1:
            xp = array_namespace(*outputs)
            for other in outputs[1:]:
                y = xp.maximum(y, other)
        return y, new_st


class PairwiseFusion(_Layers):
    """Layers whose outputs are fused with the inputs in turn, as Lux's PairwiseFusion:
    ``y = x_1``, then for each layer i, ``y = combine(layer_i(y), x_{i+1})``, where the
    input is a tuple of N + 1 arrays ``(x_1, ..., x_{N+1})`` for N layers, or one array
    ``x`` that stands for every ``x_i``.

    >>> import numpy as np, operator, luxnn as lx
    >>> model = lx.PairwiseFusion(operator.add, lx.Dense(2, 2), lx.Dense(2, 2))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> x = np.ones((4, 2), np.float32)
    >>> model((x, x, x), ps, st)[0].shape
    (4, 2)
    """

    def __init__(self, combine: Callable[[Any, Any], Any], *layers: Layer, **named: Layer) -> None:
        if not callable(combine):
            raise TypeError(f"PairwiseFusion: combine must be callable, got {type(combine).__name__}")
        if not (layers or named):
            raise ValueError("PairwiseFusion: expected at least one layer")
        self.combine = combine
        self.layers = _named_layers("PairwiseFusion", layers, named)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        n = len(self.layers)
        if isinstance(x, tuple):
            if len(x) != n + 1:
                raise LayerError(f"PairwiseFusion: expected a tuple of {n + 1} inputs for {n} layers, got {len(x)}")
            inputs = x
        else:
            inputs = (x,) * (n + 1)
        y, new_st = inputs[0], {}
        for i, (name, layer) in enumerate(self.layers.items(), 1):
            out, new_st[name] = call_child(name, layer, y, ps, st)
            y = self.combine(out, inputs[i])
        return y, new_st


class RepeatedLayer(Layer):
    """One layer applied `repeats` times with the same parameters, as Lux's RepeatedLayer:
    ``x = layer(x)`` each time, the state threaded through the repeats; with
    ``input_injection=True`` the layer gets ``(x, input)`` each time (deep equilibrium
    style). Parameters and state ``{"layer": ...}``, the layer's own.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.RepeatedLayer(lx.Dense(3, 3, activation="tanh"), 4)
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((2, 3), np.float32), ps, st)[0].shape
    (2, 3)
    """

    def __init__(self, layer: Layer, repeats: int = 10, *, input_injection: bool = False) -> None:
        if not isinstance(layer, Layer):
            raise TypeError(f"RepeatedLayer: layer must be a luxnn Layer, got {type(layer).__name__}")
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise ValueError(f"RepeatedLayer: repeats must be a positive integer, got {repeats!r}")
        self.layer = layer
        self.repeats = repeats
        self.input_injection = bool(input_injection)

    def children(self) -> Iterator[tuple[str, Layer]]:
        yield "layer", self.layer

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        y = x
        for _ in range(self.repeats):
            y, layer_st = call_child("layer", self.layer, (y, x) if self.input_injection else y, ps, st)
            st = {"layer": layer_st}
        return y, st
