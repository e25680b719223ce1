"""StatefulLayer: a set-up model called like a function, keeping its state."""

from __future__ import annotations

from typing import Any

from ..core import Layer

__all__ = ["StatefulLayer"]


class StatefulLayer:
    """A model bound to its parameters and state, called as ``y = smodel(x)``; each call
    stores the state the model returns (as Lux's StatefulLuxLayer). Pass ``ps=`` to a call
    to use other parameters, for example traced ones inside `luxnn.value_and_grad`.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Dense(3, 2)
    >>> smodel = lx.StatefulLayer(model, *lx.setup(np.random.default_rng(0), model))
    >>> smodel(np.ones((4, 3), np.float32)).shape
    (4, 2)
    """

    def __init__(self, model: Layer, ps: Any, st: Any) -> None:
        if not isinstance(model, Layer):
            raise TypeError(f"StatefulLayer: expected a luxnn Layer, got {type(model).__name__}")
        self.model = model
        self.ps = ps
        self.st = st

    def __call__(self, x: Any, ps: Any = None) -> Any:
        y, self.st = self.model(x, self.ps if ps is None else ps, self.st)
        return y

    def __repr__(self) -> str:
        return f"StatefulLayer({self.model!r})".replace("\n", "\n  ")
