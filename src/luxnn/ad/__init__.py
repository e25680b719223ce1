"""Reverse-mode automatic differentiation over NumPy and CuPy arrays.

>>> import numpy as np
>>> from luxnn import ad
>>> value, g = ad.value_and_grad(lambda w: (w ** 3).sum())(np.array([1.0, 2.0]))
>>> g.tolist()
[3.0, 12.0]
"""

from . import operators as _operators  # noqa: F401 - binds Traced's operators
from .namespace import TracedNamespace, array_namespace
from .tape import Tape, Traced, grad, primitive, stop_gradient, value_and_grad


class AutoTape:
    """The AD backend passed to the training API: luxnn's own tape-based reverse mode."""

    def __repr__(self) -> str:
        return "AutoTape()"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, AutoTape)

    def __hash__(self) -> int:
        return hash(AutoTape)


__all__ = [
    "AutoTape", "Tape", "Traced", "TracedNamespace", "array_namespace", "grad",
    "primitive", "stop_gradient", "value_and_grad",
]  # fmt: skip
