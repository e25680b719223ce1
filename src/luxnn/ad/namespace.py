"""The array namespace of traced values, and `array_namespace` for layer code.

Layer code resolves ``xp = array_namespace(x, w)`` once per call and writes NumPy/array-API
code against it. For traced values `xp` is a `TracedNamespace`: differentiable functions
record primitives; functions without a derivative (comparisons, argmax, creation) run on
the raw values; any other function raises rather than silently dropping a derivative.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

import numpy as np

from ..backend import module_of
from . import primitives as P
from .tape import Traced

__all__ = ["array_namespace", "TracedNamespace", "traced_namespace"]

DIFFERENTIABLE: dict[str, Callable[..., Any]] = {
    "add": P.add, "subtract": P.subtract, "multiply": P.multiply, "divide": P.divide,
    "true_divide": P.divide, "power": P.power, "pow": P.power, "maximum": P.maximum,
    "minimum": P.minimum, "where": P.where, "negative": P.negative, "exp": P.exp,
    "log": P.log, "log1p": P.log1p, "sqrt": P.sqrt, "square": P.square, "abs": P.abs,
    "absolute": P.abs, "tanh": P.tanh, "sin": P.sin, "cos": P.cos, "clip": P.clip,
    "astype": P.astype, "matmul": P.matmul, "sum": P.sum, "mean": P.mean, "max": P.max,
    "amax": P.max, "min": P.min, "amin": P.min, "var": P.var, "reshape": P.reshape,
    "permute_dims": P.permute_dims, "transpose": P.transpose, "swapaxes": P.swapaxes,
    "matrix_transpose": P.matrix_transpose, "moveaxis": P.moveaxis,
    "expand_dims": P.expand_dims, "squeeze": P.squeeze, "broadcast_to": P.broadcast_to,
    "concat": P.concat, "concatenate": P.concat, "stack": P.stack, "split": P.split,
    "take": P.take, "tril": P.tril, "triu": P.triu,
}  # fmt: skip

# Functions whose result carries no derivative: they run on the raw values.
CONSTANT = frozenset(
    "equal not_equal less less_equal greater greater_equal logical_and logical_or logical_not "
    "isnan isinf isfinite sign floor ceil round trunc argmax argmin argsort sort shape "
    "zeros_like ones_like empty_like full_like size ndim result_type can_cast".split()
)


def _raw(x: Any) -> Any:
    if type(x) is Traced:
        return x.value
    if isinstance(x, (list, tuple)):
        return type(x)(_raw(v) for v in x)
    return x


def _constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*_raw(args), **{k: _raw(v) for k, v in kwargs.items()})

    call.__name__ = getattr(fn, "__name__", "constant")
    return call


def _conversion(name: str) -> Callable[..., Any]:
    def convert(self: "TracedNamespace", obj: Any, /, dtype: Any = None, **kwargs: Any) -> Any:
        if type(obj) is Traced:
            return obj if dtype is None or obj.dtype == dtype else P.astype(obj, dtype)
        return getattr(self._backend, name)(obj, dtype=dtype, **kwargs)

    convert.__name__ = name
    return convert


class TracedNamespace:
    """The namespace `xp` of traced values backed by `backend` (``numpy`` or ``cupy``)."""

    # Array code converts its inputs with xp.asarray: a traced value must stay on the tape
    # (converting its raw value would silently drop its derivative).
    asarray = _conversion("asarray")
    array = _conversion("array")

    def __init__(self, backend: ModuleType) -> None:
        self._backend = backend
        for name, fn in DIFFERENTIABLE.items():
            setattr(self, name, fn)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._backend, name)
        if not callable(attr) or isinstance(attr, type):
            return attr  # dtypes, constants such as pi and newaxis
        if name in CONSTANT or name in _CREATION:
            return _constant(attr)
        raise NotImplementedError(
            f"luxnn.ad: {self._backend.__name__}.{name} has no derivative rule; differentiable "
            f"functions are {', '.join(sorted(DIFFERENTIABLE))}"
        )

    def __repr__(self) -> str:
        return f"TracedNamespace({self._backend.__name__})"


_CREATION = frozenset(
    "zeros ones empty full arange linspace eye tri finfo iinfo dtype isdtype".split()
)
_NAMESPACES: dict[ModuleType, TracedNamespace] = {}


def traced_namespace(value: Any) -> TracedNamespace:
    backend = module_of(value)
    ns = _NAMESPACES.get(backend)
    if ns is None:
        ns = _NAMESPACES[backend] = TracedNamespace(backend)
    return ns


def array_namespace(*xs: Any) -> Any:
    """The namespace to write array code against for `xs`: NumPy, CuPy, or the traced
    namespace when any argument is being differentiated.

    >>> array_namespace(np.zeros(2)) is np
    True
    """
    for x in xs:
        if type(x) is Traced:
            return traced_namespace(x.value)
    for x in xs:
        if x is not None and not isinstance(x, (int, float)):
            return module_of(x)
    return np


def apply_ufunc(ufunc: Any, method: str, inputs: tuple, kwargs: dict) -> Any:
    """``np.exp(traced)`` and friends: route a NumPy ufunc to its primitive."""
    name = ufunc.__name__
    if method == "__call__" and not kwargs.get("out"):
        fn = DIFFERENTIABLE.get(name)
        if fn is not None and not kwargs:
            return fn(*inputs)
        if name in CONSTANT:
            return ufunc(*_raw(inputs), **kwargs)
    raise NotImplementedError(
        f"luxnn.ad: numpy.{name}{'' if method == '__call__' else '.' + method} with "
        f"{', '.join(sorted(kwargs)) or 'these arguments'} has no derivative rule on traced values"
    )


def apply_function(func: Any, args: tuple, kwargs: dict) -> Any:
    """``np.sum(traced)`` and friends: route a NumPy function to the traced namespace."""
    name = func.__name__
    fn = DIFFERENTIABLE.get(name)
    if fn is not None:
        return fn(*args, **kwargs)
    if name in CONSTANT or name in _CREATION:
        return func(*_raw(args), **{k: _raw(v) for k, v in kwargs.items()})
    raise NotImplementedError(f"luxnn.ad: numpy.{name} has no derivative rule on traced values")
