"""Which implementation of a primitive runs on which device: the one place that chooses.

A primitive whose best code differs by device keeps its device-neutral part (shape checks,
the VJP's wiring, the forward and backward in terms of a few kernels) in ``ops/<area>.py``
and one implementation of those kernels per device, with the same functions (the same
``__all__`` and signatures; tests/test_ops_traits.py checks it):

- ``ops/cpu/<area>.py`` for NumPy arrays: cache-sized blocks on luxnn's threads, the C
  passes, every CPU tuning constant;
- ``ops/cuda/<area>.py`` for CuPy arrays: whole-batch kernels, luxnn's CUDA kernels
  (`luxnn.kernels`), few launches, nothing cut by the host's cores.

``implementation("conv", xp)`` is the module for arrays of the module `xp`, chosen once
per call of the primitive (the CUDA modules import CuPy only when a CuPy array comes).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import numpy as np

__all__ = ["implementation", "device_of_module"]

_CHOSEN: dict[tuple[str, ModuleType], ModuleType] = {}


def device_of_module(xp: ModuleType) -> str:
    """``"cpu"`` for NumPy, ``"cuda"`` for CuPy: the implementations' package."""
    return "cpu" if xp is np else "cuda"


def implementation(area: str, xp: ModuleType) -> ModuleType:
    """The module implementing `area`'s kernels for arrays of the module `xp`.

    >>> implementation("recurrent", np).__name__
    'luxnn.ops.cpu.recurrent'
    """
    key = (area, xp)
    found = _CHOSEN.get(key)
    if found is None:
        found = _CHOSEN[key] = importlib.import_module(f"luxnn.ops.{device_of_module(xp)}.{area}")
    return found
