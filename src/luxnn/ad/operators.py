"""Python operators and array methods of `Traced`, bound to the primitives.

They live here rather than in the class body because the primitives are defined on top of
`Traced`; importing `luxnn.ad` binds them.
"""

from __future__ import annotations

from typing import Any

from . import primitives as P
from .tape import Traced


def _raw(x: Any) -> Any:
    return x.value if type(x) is Traced else x


def _flip(fn):
    return lambda self, other: fn(other, self)


def _compare(op: str):
    return lambda self, other: getattr(self.value, op)(_raw(other))


def _reduction(fn):
    def method(self, axis=None, keepdims=False, **kwargs):
        return fn(self, axis=axis, keepdims=keepdims, **kwargs)

    return method


def _reshape(self, *shape: Any, **kwargs: Any) -> Any:
    return P.reshape(self, shape[0] if len(shape) == 1 else shape, **kwargs)


def _transpose(self, *axes: Any) -> Any:
    return P.transpose(self, axes[0] if len(axes) == 1 else (axes or None))


def _getitem(self, index: Any) -> Any:
    if isinstance(index, tuple):
        index = tuple(_raw(i) for i in index)
    else:
        index = _raw(index)
    return P.getitem(self, index)


_METHODS = {
    "__add__": P.add, "__radd__": _flip(P.add),
    "__sub__": P.subtract, "__rsub__": _flip(P.subtract),
    "__mul__": P.multiply, "__rmul__": _flip(P.multiply),
    "__truediv__": P.divide, "__rtruediv__": _flip(P.divide),
    "__pow__": P.power, "__rpow__": _flip(P.power),
    "__matmul__": P.matmul, "__rmatmul__": _flip(P.matmul),
    "__neg__": P.negative, "__pos__": lambda self: self, "__abs__": P.abs,
    "__getitem__": _getitem,
    "__lt__": _compare("__lt__"), "__le__": _compare("__le__"),
    "__gt__": _compare("__gt__"), "__ge__": _compare("__ge__"),
    "__eq__": _compare("__eq__"), "__ne__": _compare("__ne__"),
    "sum": _reduction(P.sum), "mean": _reduction(P.mean),
    "max": _reduction(P.max), "min": _reduction(P.min), "var": _reduction(P.var),
    "reshape": _reshape, "transpose": _transpose, "astype": P.astype,
    "squeeze": P.squeeze, "swapaxes": P.swapaxes,
    "T": property(P.transpose), "mT": property(P.matrix_transpose),
}  # fmt: skip

for _name, _method in _METHODS.items():
    setattr(Traced, _name, _method)
Traced.__hash__ = object.__hash__  # defining __eq__ would otherwise make it unhashable
