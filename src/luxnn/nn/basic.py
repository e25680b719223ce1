"""Small layers: a function as a layer, the identity, an elementwise affine map (Scale) and
the bilinear form of two inputs (Bilinear), with Lux's names."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from .. import init as initializers
from ..ad import array_namespace
from ..core import check_params, input_shape, Layer, LayerError
from ..dtypes import match_eltype
from ..ops.norm import scale_shift
from .activations import get_activation

__all__ = ["WrappedFunction", "NoOpLayer", "Scale", "Bilinear"]


def _positive_ints(owner: str, name: str, value: Any) -> tuple[int, ...]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not dims or not all(isinstance(n, (int, np.integer)) and not isinstance(n, bool) and n >= 1 for n in dims):
        raise ValueError(f"{owner}: {name} must be a positive integer or a tuple of them, got {value!r}")
    return tuple(int(n) for n in dims)


def _activation_name(activation: Callable[[Any], Any] | None) -> str:
    return getattr(activation, "__name__", repr(activation))


class WrappedFunction(Layer):
    """Any function of the input as a layer (Lux's name): ``y = fn(x)``, no parameters,
    the state passed through. `fn` is written against the array namespace of its input
    (`luxnn.ops` functions, ``xp = lx.array_namespace(x)``), so it is differentiated too.

    >>> import numpy as np, luxnn as lx
    >>> layer = lx.WrappedFunction(lx.ops.relu)
    >>> layer(np.array([-1.0, 2.0]), {}, {})[0].tolist()
    [0.0, 2.0]
    """

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        if not callable(fn):
            raise TypeError(f"WrappedFunction: fn must be callable, got {type(fn).__name__}")
        self.fn = fn

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return self.fn(x), st


class NoOpLayer(Layer):
    """The identity: returns its input (Lux's name), e.g. an empty branch of `Parallel`.

    >>> import luxnn as lx
    >>> lx.NoOpLayer()(3.0, {}, {})
    (3.0, {})
    """

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        return x, st


class Scale(Layer):
    """``y = activation(x * weight + bias)`` elementwise over the trailing dimensions `dims`
    (an int or a tuple), as Lux's Scale (a diagonal Dense): x ``(..., *dims)`` -> same shape.
    Parameters ``{"weight": dims, "bias": dims}`` (no bias when ``use_bias=False``),
    initialised to ones and zeros unless `init_weight`/`init_bias` say otherwise.

    >>> import numpy as np, luxnn as lx
    >>> layer = lx.Scale(3, activation="relu")
    >>> ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> layer(np.array([[-1.0, 0.5, 2.0]], np.float32), ps, st)[0].tolist()
    [[0.0, 0.5, 2.0]]
    """

    def __init__(
        self,
        dims: int | tuple[int, ...],
        *,
        activation: str | Callable[[Any], Any] | None = None,
        use_bias: bool = True,
        init_weight: initializers.Initializer = initializers.ones,
        init_bias: initializers.Initializer = initializers.zeros,
    ) -> None:
        self.dims = _positive_ints("Scale", "dims", dims)
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        self.init_weight = init_weight
        self.init_bias = init_bias

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        ps = {"weight": self.init_weight(rng, self.dims)}
        if self.use_bias:
            ps["bias"] = self.init_bias(rng, self.dims)
        return ps

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape, k = getattr(x, "shape", None), len(self.dims)
        if shape is None or len(shape) < k or tuple(shape[len(shape) - k :]) != self.dims:
            raise LayerError(f"{self}: expected input of shape (..., {', '.join(map(str, self.dims))}), got {input_shape(x)}")
        check_params(self, ps, {name: self.dims for name in (("weight", "bias") if self.use_bias else ("weight",))})
        x = match_eltype(self, x, ps["weight"])
        y = scale_shift(x, ps["weight"], ps["bias"]) if self.use_bias else x * ps["weight"]
        return (y if self.activation is None else self.activation(y)), st

    def __repr__(self) -> str:
        dims = str(self.dims[0]) if len(self.dims) == 1 else str(self.dims)
        act = "" if self.activation is None else f", activation={_activation_name(self.activation)}"
        return f"Scale({dims}{act}{'' if self.use_bias else ', use_bias=False'})"


class Bilinear(Layer):
    """The bilinear form of two inputs, as ``torch.nn.Bilinear``:
    ``y[..., k] = activation(sum_ij x1[..., i] * weight[i, j, k] * x2[..., j] + bias[k])``.

    Input: a pair ``(x1, x2)`` of shapes ``(..., in1)`` and ``(..., in2)`` with the same
    leading axes, or one array used as both (when ``in1 == in2``, as Lux). Parameters
    ``{"weight": (in1, in2, out), "bias": (out,)}`` (PyTorch's weight ``(out, in1, in2)``
    transposed to luxnn's inputs-first layout), initialised as PyTorch: uniform in
    ±1/sqrt(in1).

    >>> import numpy as np, luxnn as lx
    >>> layer = lx.Bilinear((3, 4), 2)
    >>> ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> x1, x2 = np.ones((5, 3), np.float32), np.ones((5, 4), np.float32)
    >>> layer((x1, x2), ps, st)[0].shape
    (5, 2)
    """

    def __init__(
        self,
        in_dims: tuple[int, int],
        out_dims: int,
        *,
        activation: str | Callable[[Any], Any] | None = None,
        use_bias: bool = True,
        init_weight: initializers.Initializer | None = None,
        init_bias: initializers.Initializer | None = None,
    ) -> None:
        ins = _positive_ints("Bilinear", "in_dims", in_dims)
        if len(ins) != 2:
            raise ValueError(f"Bilinear: in_dims must be a pair (in1, in2), got {in_dims!r}")
        (self.out_dims,) = _positive_ints("Bilinear", "out_dims", out_dims)
        self.in_dims = ins
        self.activation = get_activation(activation)
        self.use_bias = bool(use_bias)
        bound = 1.0 / math.sqrt(ins[0])
        self.init_weight = init_weight or initializers.uniform(-bound, bound)
        self.init_bias = init_bias or initializers.uniform(-bound, bound)
        self._shapes = {"weight": (*ins, self.out_dims)}
        if self.use_bias:
            self._shapes["bias"] = (self.out_dims,)

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        ps = {"weight": self.init_weight(rng, self._shapes["weight"])}
        if self.use_bias:
            ps["bias"] = self.init_bias(rng, (self.out_dims,))
        return ps

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x1, x2 = x if isinstance(x, (tuple, list)) and len(x) == 2 else (x, x)
        (in1, in2), out = self.in_dims, self.out_dims
        s1, s2 = getattr(x1, "shape", None), getattr(x2, "shape", None)
        if s1 is None or s2 is None or not s1 or s1[-1] != in1 or s2[:-1] != s1[:-1] or s2[-1] != in2:
            raise LayerError(f"{self}: expected inputs of shapes (..., {in1}) and (..., {in2}) with the same leading axes, got {s1} and {s2}")
        check_params(self, ps, self._shapes)
        w = ps["weight"]
        x1, x2 = match_eltype(self, x1, w), match_eltype(self, x2, w)
        xp = array_namespace(x1, x2, w)
        rows = math.prod(s1[:-1])
        # x1 @ W as (rows, in2, out), then each row's x2 (1, in2) times its (in2, out) slice:
        # two GEMMs, no (rows, in1, in2) outer product.
        t = xp.reshape(xp.reshape(x1, (rows, in1)) @ xp.reshape(w, (in1, in2 * out)), (rows, in2, out))
        y = xp.reshape(xp.reshape(x2, (rows, 1, in2)) @ t, (*s1[:-1], out))
        if self.use_bias:
            y = y + ps["bias"]
        return (y if self.activation is None else self.activation(y)), st

    def __repr__(self) -> str:
        act = "" if self.activation is None else f", activation={_activation_name(self.activation)}"
        return f"Bilinear({self.in_dims} => {self.out_dims}{act}{'' if self.use_bias else ', use_bias=False'})"
