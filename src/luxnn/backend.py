"""Which array module (NumPy or CuPy) an array belongs to, without importing CuPy for NumPy."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["module_of", "is_array"]


def module_of(x: Any) -> ModuleType:
    """`numpy` for NumPy arrays and scalars (and Python numbers), `cupy` for CuPy arrays.

    >>> module_of(np.zeros(2)).__name__
    'numpy'
    """
    if type(x) is np.ndarray or isinstance(x, (np.generic, int, float)):
        return np
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def is_array(x: Any) -> bool:
    """True for NumPy and CuPy arrays (not for Python numbers or traced values)."""
    return isinstance(x, np.ndarray) or type(x).__module__.startswith("cupy")
