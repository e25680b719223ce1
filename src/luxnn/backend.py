"""Which array module (NumPy or CuPy) an array belongs to, without importing CuPy for NumPy."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["module_of", "array_module_of_type", "is_array", "row_sums", "take_rows"]


def module_of(x: Any) -> ModuleType:
    """`numpy` for NumPy arrays and scalars (and Python numbers and lists), `cupy` for CuPy
    arrays; a `TypeError` for anything else (JAX, torch, other array-API arrays, an ndarray
    subclass with arithmetic of its own), which luxnn never computes on silently.

    >>> module_of(np.zeros(2)).__name__
    'numpy'
    """
    kind = type(x)
    if kind is np.ndarray or isinstance(x, (np.generic, int, float, complex, list, tuple)):
        return np
    if kind.__module__.startswith("cupy"):
        import cupy

        return cupy
    if isinstance(x, np.ndarray) and _plain_subclass(kind):
        return np
    raise _refused(kind)


def array_module_of_type(kind: type) -> ModuleType:
    """`module_of` for the arrays of type `kind`: NumPy's ndarray (and its plain
    subclasses) or CuPy's; a `TypeError` for any other type.

    >>> array_module_of_type(np.ndarray).__name__
    'numpy'
    """
    if kind is np.ndarray or (issubclass(kind, np.ndarray) and _plain_subclass(kind)):
        return np
    if kind.__module__.startswith("cupy"):
        import cupy

        return cupy
    raise _refused(kind)


def _refused(kind: type) -> TypeError:
    return TypeError(
        f"luxnn computes on NumPy and CuPy arrays, got {kind.__module__}.{kind.__qualname__}: "
        "convert it first (np.asarray(x), or cupy.asarray(x) for GPU data)"
    )


# What an ndarray subclass may not override to be computed on as an ndarray (np.memmap
# overrides none of them; np.matrix and masked arrays do).
_ARITHMETIC = (
    "__array_ufunc__", "__array_function__", "__add__", "__radd__", "__sub__", "__rsub__",
    "__mul__", "__rmul__", "__matmul__", "__rmatmul__", "__truediv__", "__pow__", "__neg__",
)  # fmt: skip
_plain_subclasses: dict[type, bool] = {}


def _plain_subclass(kind: type) -> bool:
    plain = _plain_subclasses.get(kind)
    if plain is None:
        plain = _plain_subclasses[kind] = all(getattr(kind, n) is getattr(np.ndarray, n) for n in _ARITHMETIC)
    return plain


def is_array(x: Any) -> bool:
    """True for NumPy and CuPy arrays (not for Python numbers or traced values)."""
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy")


def row_sums(m: Any) -> Any:
    """The sums of the rows of the matrix `m` ``(rows, n)``, as a column ``(rows, 1)``: one
    BLAS product with a vector of ones, several times faster than NumPy's reduction along
    short rows (it sums without NumPy's pairwise summation, so its rounding grows with n).

    >>> row_sums(np.array([[1.0, 2.0], [3.0, 4.0]])).tolist()
    [[3.0], [7.0]]
    """
    return (m @ module_of(m).ones(m.shape[1], m.dtype))[:, None]


def take_rows(a: Any, indices: np.ndarray) -> Any:
    """``a[indices]`` for NumPy `indices` ``(k,)``, moved to CuPy first for a CuPy `a`; any
    other indexable `a` is indexed as it is (a data loader's leaves need not be arrays).

    >>> take_rows(np.arange(5) * 10, np.array([3, 1])).tolist()
    [30, 10]
    """
    if type(a).__module__.startswith("cupy"):
        import cupy

        return a[cupy.asarray(indices)]
    return a[indices]
