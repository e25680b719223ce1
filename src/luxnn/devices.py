"""Devices: where arrays live. A device is callable and moves a whole tree.

>>> import numpy as np, luxnn as lx
>>> dev = lx.cpu_device()
>>> dev({"w": np.zeros(2)})["w"].shape
(2,)
>>> lx.get_device({"w": np.zeros(2)})
CPUDevice()
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from . import tree
from .backend import is_array

__all__ = ["Device", "CPUDevice", "CUDADevice", "cpu_device", "gpu_device", "get_device", "check_same_device"]

_warned_no_gpu = False  # gpu_device() warns once per process, as Lux's does


class Device:
    """Base of the devices. ``device(x)`` returns `x` with every array moved to the device;
    objects with a ``to_device(device)`` method (a `TrainState`) move themselves."""

    def __call__(self, x: Any) -> Any:
        # Arrays have a to_device of their own (the array API's), taking other arguments.
        mover = None if is_array(x) else getattr(x, "to_device", None)
        if mover is not None:
            return mover(self)
        return tree.map(self._move_leaf, x)

    def _move_leaf(self, leaf: Any) -> Any:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), tuple(sorted(vars(self).items()))))


class CPUDevice(Device):
    """Host memory, NumPy arrays."""

    xp = np

    def _move_leaf(self, leaf: Any) -> Any:
        if is_array(leaf) and not isinstance(leaf, np.ndarray):
            return leaf.get()  # a CuPy array
        return leaf

    def __repr__(self) -> str:
        return "CPUDevice()"


class CUDADevice(Device):
    """An NVIDIA GPU, CuPy arrays."""

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = int(device_id)

    @property
    def xp(self) -> Any:
        import cupy

        return cupy

    def _move_leaf(self, leaf: Any) -> Any:
        if not is_array(leaf):
            return leaf
        import cupy

        if isinstance(leaf, cupy.ndarray) and leaf.device.id == self.device_id:
            return leaf
        with cupy.cuda.Device(self.device_id):
            return cupy.asarray(leaf)

    def __repr__(self) -> str:
        return f"CUDADevice({self.device_id})"


def cpu_device() -> CPUDevice:
    """The host device."""
    return CPUDevice()


def gpu_device(device_id: int | None = None, *, force: bool = False) -> Device:
    """A `CUDADevice` when CuPy and a working CUDA GPU are present; otherwise returns the
    CPU device, with a warning the first time (``force=True`` raises instead)."""
    global _warned_no_gpu
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            raise RuntimeError("no CUDA device found")
        device_id = cupy.cuda.runtime.getDevice() if device_id is None else device_id
        if not 0 <= device_id < count:
            raise RuntimeError(f"device {device_id} requested, {count} present")
        return CUDADevice(device_id)
    except Exception as err:  # ImportError, CUDA runtime errors: all mean "no usable GPU"
        if force:
            raise RuntimeError(f"gpu_device: no usable CUDA GPU ({err})") from err
        if not _warned_no_gpu:
            _warned_no_gpu = True
            warnings.warn(f"gpu_device: no usable CUDA GPU ({err}); using the CPU", stacklevel=2)
        return CPUDevice()


def _device_of(leaf: Any) -> Device:
    if isinstance(leaf, np.ndarray):
        return CPUDevice()
    return CUDADevice(leaf.device.id)


def _first_array(x: Any) -> Any:
    """The first array leaf of `x` (None if it holds none), without walking the rest."""
    if isinstance(x, dict):
        x = x.values()
    elif not isinstance(x, (list, tuple)):
        return x if is_array(x) else None
    for child in x:
        leaf = _first_array(child)
        if leaf is not None:
            return leaf
    return None


def check_same_device(what: str, a: Any, b: Any, a_name: str, b_name: str) -> None:
    """Raise `ValueError` naming both devices when the first arrays of trees `a` and `b`
    live on different devices: a check cheap enough for every training step.

    >>> check_same_device("compute_gradients", {"w": np.zeros(2)}, (np.ones(3),), "parameters", "data")
    """
    leaf_a, leaf_b = _first_array(a), _first_array(b)
    if leaf_a is None or leaf_b is None or (type(leaf_a) is np.ndarray and type(leaf_b) is np.ndarray):
        return
    dev_a, dev_b = _device_of(leaf_a), _device_of(leaf_b)
    if dev_a != dev_b:
        raise ValueError(
            f"{what}: the {a_name} are on {dev_a} but the {b_name} on {dev_b}; move both to "
            f"one device first, e.g. dev = lx.gpu_device(); ts, data = dev(ts), dev(data)"
        )


def get_device(x: Any) -> Device | None:
    """The device of every array in `x` (None if it holds no arrays); raises `ValueError`
    naming both devices when arrays live on two."""
    found: Device | None = None
    for path, leaf in tree.paths(getattr(x, "parameters", x)):
        if not is_array(leaf):
            continue
        dev = _device_of(leaf)
        if found is None:
            found = dev
        elif dev != found:
            raise ValueError(f"arrays on two devices: {found} and {dev} (at {path or 'the leaf'})")
    return found
