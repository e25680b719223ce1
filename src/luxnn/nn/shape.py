"""Shape layers: Flatten and Reshape, which keep the batch axis."""

from __future__ import annotations

import math
from typing import Any

from ..ad import array_namespace
from ..core import Layer, LayerError

__all__ = ["Flatten", "Reshape"]


class Flatten(Layer):
    """All axes but the first (batch) into one: ``(N, *rest)`` -> ``(N, prod(rest))``, in
    row-major order (for NHWC input: H, then W, then C).

    >>> import numpy as np, luxnn as lx
    >>> lx.Flatten()(np.ones((2, 7, 7, 64), np.float32), {}, {})[0].shape
    (2, 3136)
    """

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        if not shape:
            raise LayerError(f"{self}: expected an input with a batch axis, got shape {shape}")
        return array_namespace(x).reshape(x, (shape[0], math.prod(shape[1:]))), st


class Reshape(Layer):
    """Each sample to `shape` (one entry may be -1), keeping the batch axis:
    ``(N, *rest)`` -> ``(N, *shape)``.

    >>> import numpy as np, luxnn as lx
    >>> lx.Reshape((7, 7, 64))(np.ones((2, 3136), np.float32), {}, {})[0].shape
    (2, 7, 7, 64)
    """

    def __init__(self, shape: int | tuple[int, ...]) -> None:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        if not all(isinstance(n, int) and (n >= 0 or n == -1) for n in shape) or shape.count(-1) > 1:
            raise ValueError(f"Reshape: shape must be non-negative ints with at most one -1, got {shape!r}")
        self.shape = shape

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        if not shape:
            raise LayerError(f"{self}: expected an input with a batch axis, got shape {shape}")
        size, known = math.prod(shape[1:]), math.prod(n for n in self.shape if n != -1)
        fits = size % known == 0 if -1 in self.shape and known else size == known
        if not fits:
            raise LayerError(f"{self}: cannot reshape samples of shape {shape[1:]} ({size} elements) to {self.shape}")
        return array_namespace(x).reshape(x, (shape[0], *self.shape)), st

    def __repr__(self) -> str:
        return f"Reshape({self.shape})"
