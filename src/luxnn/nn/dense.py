"""Dense (fully connected) layer."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .. import init as initializers
from .. import ops
from ..core import check_params, input_shape, Layer, LayerError
from ..dtypes import match_eltype
from .activations import get_activation


class Dense(Layer):
    """``y = activation(x @ weight + bias)`` over the last axis.

    Shapes: x ``(..., in_features)`` -> y ``(..., out_features)``; parameters
    ``{"weight": (in_features, out_features), "bias": (out_features,)}``. Defaults
    initialise as PyTorch and Lux do: weight and bias uniform in ±1/sqrt(in_features).

    >>> import luxnn as lx
    >>> layer = lx.Dense(4, 2, activation="relu")
    >>> ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> layer(np.ones((3, 4), np.float32), ps, st)[0].shape
    (3, 2)
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        activation: str | Callable[[Any], Any] | None = None,
        *,
        use_bias: bool = True,
        init_weight: initializers.Initializer | None = None,
        init_bias: initializers.Initializer | None = None,
    ) -> None:
        for name, n in (("in_features", in_features), ("out_features", out_features)):
            if not isinstance(n, (int, np.integer)) or n < 1:
                raise ValueError(f"Dense: {name} must be a positive integer, got {n!r}")
        self.in_features = int(in_features)
        self.out_features = int(out_features)
        self.activation = get_activation(activation)
        self.use_bias = use_bias
        bound = 1.0 / math.sqrt(self.in_features)
        self.init_weight = init_weight or initializers.kaiming_uniform()
        self.init_bias = init_bias or initializers.uniform(-bound, bound)
        self._shapes = {"weight": (self.in_features, self.out_features)}
        if use_bias:
            self._shapes["bias"] = (self.out_features,)

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        ps = {"weight": self.init_weight(rng, (self.in_features, self.out_features))}
        if self.use_bias:
            ps["bias"] = self.init_bias(rng, (self.out_features,))
        return ps


    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        if not shape or shape[-1] != self.in_features:
            raise LayerError(f"{self}: expected input of shape (..., {self.in_features}), got {input_shape(x)}")
        check_params(self, ps, self._shapes)
        x = match_eltype(self, x, ps["weight"])
        fused = ops.fused_name(self.activation)  # what `ops.dense` does, without its call
        y = ops.fused_dense(x, ps["weight"], ps.get("bias"), activation=fused)
        if fused is None and self.activation is not None:
            y = self.activation(y)
        return y, st

    def __repr__(self) -> str:
        act = "" if self.activation is None else f", {getattr(self.activation, '__name__', self.activation)}"
        bias = "" if self.use_bias else ", use_bias=False"
        return f"Dense({self.in_features} => {self.out_features}{act}{bias})"
