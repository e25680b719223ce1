"""Which implementation of a primitive runs on which device: the one place that chooses.

A primitive whose best code differs by device keeps its device-neutral part (shape checks,
the VJP's wiring, the forward and backward in terms of a few kernels) in ``ops/<area>.py``
and one implementation of those kernels per device, with the same functions (the same
``__all__`` and signatures; tests/test_ops_traits.py checks it):

- ``ops/cpu/<area>.py`` for NumPy arrays: cache-sized blocks on luxnn's threads, the C
  passes, every CPU tuning constant;
- ``ops/cuda/<area>.py`` for CuPy arrays: whole-batch kernels, luxnn's CUDA kernels
  (`luxnn.kernels`), few launches, nothing cut by the host's cores.

A primitive's module holds one `Area` per area it uses (``_CONV = Area("conv")``) and
picks the implementation once per call as ``_CONV[type(x)]``: a dictionary lookup (the
CUDA modules import CuPy only when a CuPy array comes).
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import numpy as np

from ..backend import array_module_of_type

__all__ = ["Area", "implementation", "device_of_module"]


def device_of_module(xp: ModuleType) -> str:
    """``"cpu"`` for NumPy, ``"cuda"`` for CuPy: the implementations' package."""
    return "cpu" if xp is np else "cuda"


class Area(dict):
    """One area's implementations by array type: ``area[type(x)]`` is the module for arrays
    like `x`, found the first time an array of that type comes (NumPy's at once); after
    that a dictionary lookup, with no Python call on a primitive's path.

    >>> Area("recurrent")[np.ndarray].__name__
    'luxnn.ops.cpu.recurrent'
    """

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self[np.ndarray] = importlib.import_module(f"luxnn.ops.cpu.{name}")  # loaded with the package

    def __missing__(self, kind: type) -> ModuleType:
        if issubclass(kind, (np.generic, int, float, complex)):  # a scalar: a reduction's result
            found = self[kind] = self[np.ndarray]
            return found
        found = self[kind] = importlib.import_module(
            f"luxnn.ops.{device_of_module(array_module_of_type(kind))}.{self.name}"
        )
        return found


def implementation(area: str, like: Any) -> ModuleType:
    """The module implementing `area`'s kernels for arrays like `like`.

    >>> implementation("recurrent", np.zeros(2)).__name__
    'luxnn.ops.cpu.recurrent'
    """
    return Area(area)[type(like)]
