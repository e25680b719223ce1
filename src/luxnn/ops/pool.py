"""Pooling primitives over the spatial axes of channels-last input ``(N, *spatial, C)``.

- `max_pool` pads with -inf; its gradient goes to the first maximum of each window in
  row-major window order, as PyTorch's (ties do not split the gradient).
- `avg_pool` pads with zeros and by default divides by the full window size, counting the
  padding (PyTorch's ``count_include_pad=True`` default); ``count_include_pad=False``
  divides by the number of real elements in each window instead.
- `adaptive_avg_pool` and `adaptive_max_pool` pool to a given output size with PyTorch's
  bins (`luxnn.ops.geometry.adaptive_bins`).

This module is the device-neutral part (the configuration and the VJP wiring); the work
runs in the implementation of the arrays' device (`luxnn.ops.traits`), ``ops/cpu/pool.py``
or ``ops/cuda/pool.py``, which export for each pool ``<pool>_forward(x, ...) -> (y,
residual)`` and ``<pool>_backward(g, residual, shape, ...) -> dx`` (`shape`: the input's).

>>> import numpy as np
>>> x = np.arange(16, dtype=np.float32).reshape(1, 4, 4, 1)
>>> max_pool(x, (2, 2))[0, :, :, 0].tolist()
[[5.0, 7.0], [13.0, 15.0]]
"""

from __future__ import annotations

from typing import Any

from ..ad.tape import primitive
from .geometry import per_axis, per_side
from .traits import Area

__all__ = ["max_pool", "avg_pool", "adaptive_avg_pool", "adaptive_max_pool"]

_POOL = Area("pool")


def _config(x: Any, window: Any, stride: Any, padding: Any) -> tuple[tuple[int, ...], tuple[int, ...], tuple]:
    r = x.ndim - 2
    window = per_axis(window, r)
    return window, window if stride is None else per_axis(stride, r), per_side(padding, r)


def max_pool(x: Any, window: Any, stride: Any = None, padding: Any = 0) -> Any:
    """Max over windows of `x` ``(N, *spatial, C)``: ``(N, *out, C)`` with
    ``out = (spatial + low + high - window) // stride + 1``. `window`, `stride` (default:
    the window) and `padding` as for `luxnn.ops.conv`."""
    window, stride, padding = _config(x, window, stride, padding)
    return _pool(x, kind="max_pool", config=(window, stride, padding))


def avg_pool(x: Any, window: Any, stride: Any = None, padding: Any = 0, *, count_include_pad: bool = True) -> Any:
    """Mean over windows of `x` ``(N, *spatial, C)``; arguments as `max_pool`."""
    window, stride, padding = _config(x, window, stride, padding)
    return _pool(x, kind="avg_pool", config=(window, stride, padding, count_include_pad))


@primitive
def _pool(x, *, kind, config):
    """The pool `kind` (``"max_pool"``, ``"avg_pool"``, ...) of the arrays' device, with the
    static `config` its forward and backward take after their arrays."""
    device = _POOL[type(x)]
    y, residual = getattr(device, f"{kind}_forward")(x, *config)
    shape = x.shape

    def vjp(g, needs):
        return (getattr(device, f"{kind}_backward")(g, residual, shape, *config),)

    return y, vjp


def _adaptive_config(x: Any, out_size: Any, owner: str) -> tuple[int, ...]:
    rank = getattr(x, "ndim", 0) - 2
    if rank < 1:
        raise ValueError(f"{owner}: expected input (N, *spatial, C) with a spatial axis, got shape {getattr(x, 'shape', None)}")
    out = per_axis(out_size, rank)
    if len(out) != rank or any(o < 1 for o in out):
        raise ValueError(f"{owner}: expected {rank} positive output sizes for input of shape {x.shape}, got {out_size!r}")
    return out


def adaptive_avg_pool(x: Any, out_size: Any) -> Any:
    """Mean over PyTorch's adaptive windows: ``(N, *spatial, C)`` -> ``(N, *out_size, C)``
    (`out_size` an int for every spatial axis, or one per axis).

    >>> import numpy as np
    >>> adaptive_avg_pool(np.arange(5.0).reshape(1, 5, 1), 3)[0, :, 0].tolist()
    [0.5, 2.0, 3.5]
    """
    out = _adaptive_config(x, out_size, "adaptive_avg_pool")
    return x if out == x.shape[1:-1] else _pool(x, kind="adaptive_avg_pool", config=(out,))


def adaptive_max_pool(x: Any, out_size: Any) -> Any:
    """Maximum over PyTorch's adaptive windows; shapes as `adaptive_avg_pool`. The
    gradient goes to each window's first maximum in row-major order, as PyTorch's."""
    out = _adaptive_config(x, out_size, "adaptive_max_pool")
    return x if out == x.shape[1:-1] else _pool(x, kind="adaptive_max_pool", config=(out,))
