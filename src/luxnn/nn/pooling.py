"""Pooling layers over channels-last input: windowed max and mean, their adaptive forms
(to a given output size) and their global forms."""

from __future__ import annotations

from typing import Any

from ..ad import array_namespace
from ..core import input_shape, Layer, LayerError
from ..ops.geometry import conv_output_size
from ..ops.pool import adaptive_avg_pool, adaptive_max_pool, avg_pool, max_pool
from .conv import PaddingSpec, check_input, format_padding, padding_spec, same_padding, spatial_tuple, window_tuple

__all__ = ["MaxPool", "AvgPool", "AdaptiveMaxPool", "AdaptiveAvgPool", "GlobalMaxPool", "GlobalAvgPool"]


class _Pool(Layer):
    def __init__(self, window: int | tuple[int, ...], stride: int | tuple[int, ...] | None, padding: PaddingSpec) -> None:
        owner = type(self).__name__
        self.window = window_tuple(owner, "window", window)
        self.rank = len(self.window)
        self.stride = self.window if stride is None else spatial_tuple(owner, "stride", stride, self.rank)
        self.padding = padding_spec(owner, padding, self.rank)
        if self.padding != "same":
            self._check_padding(self.padding, ValueError)

    def _check_padding(self, padding: tuple[tuple[int, int], ...], error: type[ValueError]) -> None:
        # A window made of padding only would have no input to pool.
        if any(lo >= k or hi >= k for (lo, hi), k in zip(padding, self.window)):
            raise error(f"{self}: padding must be smaller than the window on each side, got {format_padding(padding)}")

    def _config(self, x: Any) -> tuple[tuple[int, int], ...]:
        sizes = check_input(self, x, self.rank, None)
        padding = self.padding
        if padding == "same":
            padding = same_padding(sizes, self.window, self.stride, (1,) * self.rank)
            self._check_padding(padding, LayerError)
        for axis, (n, k, (lo, hi)) in enumerate(zip(sizes, self.window, padding), 1):
            if conv_output_size(n, k, 1, 1, (lo, hi)) < 1:
                raise LayerError(
                    f"{self}: window {k} is larger than the padded input along axis {axis}: "
                    f"{n} + {lo} + {hi} = {n + lo + hi}, input shape {x.shape}"
                )
        return padding

    def _options(self) -> str:
        stride = "" if self.stride == self.window else f", stride={self.stride}"
        pad = self.padding
        padding = f", padding={format_padding(pad)}" if pad == "same" or any(lo or hi for lo, hi in pad) else ""
        return f"{self.window}{stride}{padding}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._options()})"


class MaxPool(_Pool):
    """Maximum over windows: x ``(N, *spatial, C)`` -> ``(N, *out, C)``,
    ``out = (size + low + high - window) // stride + 1``; the rank is ``len(window)`` (an int
    means 2-D). `stride` defaults to the window; `padding` as for `Conv` (``"same"`` is
    TF-style), padded with -inf, and smaller than the window on each side. The gradient
    goes to the first maximum of each window, as in PyTorch.

    >>> import numpy as np, luxnn as lx
    >>> pool = lx.MaxPool(2)
    >>> pool(np.ones((2, 28, 28, 8), np.float32), {}, {})[0].shape
    (2, 14, 14, 8)
    """

    def __init__(self, window: int | tuple[int, ...], stride: int | tuple[int, ...] | None = None, padding: PaddingSpec = 0) -> None:
        super().__init__(window, stride, padding)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        padding = self._config(x)
        return max_pool(x, self.window, self.stride, padding), st


class AvgPool(_Pool):
    """Mean over windows; shapes and arguments as `MaxPool`, padded with zeros. By default
    the padding counts in each window's mean (PyTorch's ``count_include_pad=True``);
    ``count_include_pad=False`` averages the real elements only (TF's SAME pooling).

    >>> import numpy as np, luxnn as lx
    >>> pool = lx.AvgPool(3, stride=2, padding=1)
    >>> pool(np.ones((2, 28, 28, 8), np.float32), {}, {})[0].shape
    (2, 14, 14, 8)
    """

    def __init__(
        self,
        window: int | tuple[int, ...],
        stride: int | tuple[int, ...] | None = None,
        padding: PaddingSpec = 0,
        *,
        count_include_pad: bool = True,
    ) -> None:
        self.count_include_pad = bool(count_include_pad)
        super().__init__(window, stride, padding)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        padding = self._config(x)
        return avg_pool(x, self.window, self.stride, padding, count_include_pad=self.count_include_pad), st

    def _options(self) -> str:
        return super()._options() + ("" if self.count_include_pad else ", count_include_pad=False")


class _AdaptivePool(Layer):
    # The adaptive pooling op of `luxnn.ops.pool`; the subclasses differ only in it.
    pool: Any

    def __init__(self, out_size: int | tuple[int, ...]) -> None:
        self.out_size = window_tuple(type(self).__name__, "out_size", out_size)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        check_input(self, x, len(self.out_size), None)
        return type(self).pool(x, self.out_size), st


class AdaptiveAvgPool(_AdaptivePool):
    """Mean pooling to a fixed output size, as ``torch.nn.AdaptiveAvgPool1d/2d/3d``:
    ``(N, *spatial, C)`` -> ``(N, *out_size, C)``, output i of an axis of size n averaging
    inputs ``floor(i * n / out)`` to ``ceil((i + 1) * n / out) - 1``. `out_size` is an int
    (2-D, both axes) or one size per spatial axis, which sets the rank.

    >>> import numpy as np, luxnn as lx
    >>> lx.AdaptiveAvgPool((2, 3))(np.ones((2, 7, 9, 4), np.float32), {}, {})[0].shape
    (2, 2, 3, 4)
    """

    pool = adaptive_avg_pool


class AdaptiveMaxPool(_AdaptivePool):
    """Max pooling to a fixed output size, as ``torch.nn.AdaptiveMaxPool1d/2d/3d``; bins
    and shapes as `AdaptiveAvgPool`. The gradient goes to each window's first maximum in
    row-major order, as PyTorch's.

    >>> import numpy as np, luxnn as lx
    >>> lx.AdaptiveMaxPool(1)(np.ones((2, 7, 9, 4), np.float32), {}, {})[0].shape
    (2, 1, 1, 4)
    """

    pool = adaptive_max_pool


class _GlobalPool(Layer):
    # The name of the array namespace's reduction (``mean``, ``max``) that pools all
    # spatial axes; the subclasses differ only in it.
    reduction: str

    def _axes(self, x: Any) -> tuple[int, ...]:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) < 3:
            raise LayerError(f"{self}: expected input of shape (N, *spatial, C) with at least one spatial axis, got {input_shape(x)}")
        return tuple(range(1, len(shape) - 1))

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = self._axes(x)
        reduce = getattr(array_namespace(x), self.reduction)
        return reduce(x, axis=axes, keepdims=True), st


class GlobalAvgPool(_GlobalPool):
    """Mean over all spatial axes, keeping them as singletons (as Lux's GlobalMeanPool):
    x ``(N, *spatial, C)`` -> ``(N, 1, ..., 1, C)``; follow with `Flatten` for ``(N, C)``.

    >>> import numpy as np, luxnn as lx
    >>> lx.GlobalAvgPool()(np.ones((2, 7, 7, 8), np.float32), {}, {})[0].shape
    (2, 1, 1, 8)
    """

    reduction = "mean"


class GlobalMaxPool(_GlobalPool):
    """Maximum over all spatial axes, keeping them as singletons: ``(N, *spatial, C)`` ->
    ``(N, 1, ..., 1, C)``. Tied maxima share the gradient evenly (as PyTorch's ``amax``).

    >>> import numpy as np, luxnn as lx
    >>> lx.GlobalMaxPool()(np.ones((2, 7, 7, 8), np.float32), {}, {})[0].shape
    (2, 1, 1, 8)
    """

    reduction = "max"
