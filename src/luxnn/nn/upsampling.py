"""Upsampling layers over channels-last input: Upsample (nearest or linear) and
PixelShuffle (sub-pixel convolution's channels to space)."""

from __future__ import annotations

from typing import Any

from ..core import Layer, LayerError
from ..ops.upsample import pixel_shuffle, upsample_linear, upsample_nearest
from .conv import check_input, window_tuple

__all__ = ["Upsample", "PixelShuffle"]

_MODES = {"nearest": upsample_nearest, "bilinear": upsample_linear}


class Upsample(Layer):
    """Spatial upsampling by integer factors: ``(N, *spatial, C)`` -> ``(N, *(spatial *
    scale), C)``; `scale` is an int (2-D, both axes) or one factor per spatial axis, which
    sets the rank. ``mode="nearest"`` repeats each element; ``mode="bilinear"``
    interpolates linearly along each axis (linear, bilinear or trilinear by rank), as
    PyTorch's ``interpolate(..., align_corners=False)``.

    >>> import numpy as np, luxnn as lx
    >>> lx.Upsample(2, mode="bilinear")(np.ones((1, 4, 4, 3), np.float32), {}, {})[0].shape
    (1, 8, 8, 3)
    """

    def __init__(self, scale: int | tuple[int, ...], mode: str = "nearest") -> None:
        self.scale = window_tuple("Upsample", "scale", scale)
        if mode not in _MODES:
            raise ValueError(f"Upsample: mode must be one of {sorted(_MODES)}, got {mode!r}")
        self.mode = mode

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        check_input(self, x, len(self.scale), None)
        return _MODES[self.mode](x, self.scale), st


class PixelShuffle(Layer):
    """Channels to space by a factor `r` (Shi et al. 2016), as ``torch.nn.PixelShuffle``
    in channels-last layout: ``(N, *spatial, C * r**d)`` -> ``(N, *(spatial * r), C)`` for
    d spatial axes; channel ``c * r**2 + i * r + j`` of 2-D input goes to offset
    ``(i, j)`` of output channel c.

    >>> import numpy as np, luxnn as lx
    >>> lx.PixelShuffle(2)(np.ones((1, 4, 4, 12), np.float32), {}, {})[0].shape
    (1, 8, 8, 3)
    """

    def __init__(self, r: int) -> None:
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"PixelShuffle: r must be a positive integer, got {r!r}")
        self.r = r

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < 3 or shape[-1] % self.r ** (len(shape) - 2):
            d = "d" if shape is None or len(shape) < 3 else len(shape) - 2
            raise LayerError(f"{self}: expected input of shape (N, *spatial, C * {self.r}**{d}) with a spatial axis, got {shape}")
        return pixel_shuffle(x, self.r), st
