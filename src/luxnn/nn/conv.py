"""Convolution layers: Conv and ConvTranspose over channels-last input, 1-D, 2-D or N-d."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from .. import init as initializers
from ..core import check_params, input_shape, Layer, LayerError
from ..dtypes import match_eltype
from ..ops.activations import relu
from ..ops.conv import conv, conv_transpose
from ..ops.geometry import Pairs, conv_output_size
from .activations import get_activation

__all__ = ["Conv", "ConvTranspose"]

PaddingSpec = int | str | Sequence[int] | Sequence[tuple[int, int]]


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def spatial_tuple(owner: str, name: str, value: Any, rank: int, minimum: int = 1) -> tuple[int, ...]:
    """An int, or one int per spatial axis, each at least `minimum`, as a tuple of `rank`."""
    values = (value,) * rank if _is_int(value) else tuple(value) if isinstance(value, (tuple, list)) else None
    if values is None or len(values) != rank or not all(_is_int(v) and v >= minimum for v in values):
        raise ValueError(
            f"{owner}: {name} must be an integer >= {minimum} or a tuple of {rank} of them, got {value!r}"
        )
    return tuple(int(v) for v in values)


def window_tuple(owner: str, name: str, value: Any) -> tuple[int, ...]:
    """A kernel or pooling window: an int (a square 2-D window) or one positive int per
    spatial axis, as a tuple whose length is the layer's spatial rank."""
    if _is_int(value):
        value = (value, value)
    if not isinstance(value, (tuple, list)) or not value:
        raise ValueError(f"{owner}: {name} must be an int (2-D) or a non-empty tuple, got {value!r}")
    return spatial_tuple(owner, name, tuple(value), len(value))


def padding_spec(owner: str, padding: Any, rank: int) -> str | Pairs:
    """``"same"``, or one ``(low, high)`` pair per spatial axis, from an int, one int per
    axis, one pair per axis, ``"same"`` or ``"valid"``."""
    if isinstance(padding, str):
        mode = padding.lower()
        if mode not in ("same", "valid"):
            raise ValueError(f"{owner}: padding must be 'same', 'valid', an int or per-axis values, got {padding!r}")
        return "same" if mode == "same" else ((0, 0),) * rank
    if _is_int(padding):
        padding = (padding,) * rank
    if isinstance(padding, (tuple, list)) and len(padding) == rank:
        pairs = [(p, p) if _is_int(p) else tuple(p) if isinstance(p, (tuple, list)) else None for p in padding]
        if all(p is not None and len(p) == 2 and all(_is_int(v) and v >= 0 for v in p) for p in pairs):
            return tuple((int(lo), int(hi)) for lo, hi in pairs)
    raise ValueError(
        f"{owner}: padding must be 'same', 'valid', an int >= 0, {rank} ints (one per spatial axis) "
        f"or {rank} (low, high) pairs, got {padding!r}"
    )


def same_padding(sizes: tuple[int, ...], kernel: tuple[int, ...], stride: tuple[int, ...], dilation: tuple[int, ...]) -> Pairs:
    """TF/Flax ``SAME``: output ``ceil(size / stride)``, the padding split evenly with any odd
    element at the high side (at stride 1: ``dilation * (k - 1)`` in total, as PyTorch's
    ``padding="same"``)."""
    pads = []
    for n, k, s, d in zip(sizes, kernel, stride, dilation):
        total = max((-(-n // s) - 1) * s + d * (k - 1) + 1 - n, 0)
        pads.append((total // 2, total - total // 2))
    return tuple(pads)


def check_input(layer: Layer, x: Any, rank: int, channels: int | None) -> tuple[int, ...]:
    """Raise a `LayerError` unless `x` is ``(N, *spatial, channels)`` with `rank` spatial
    axes; return its spatial sizes."""
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != rank + 2 or (channels is not None and shape[-1] != channels):
        axes = ("H", "W") if rank == 2 else ("L",) if rank == 1 else tuple(f"D{i}" for i in range(1, rank + 1))
        expected = ", ".join(("N", *axes, str(channels) if channels is not None else "C"))
        raise LayerError(f"{layer}: expected input of shape ({expected}), got {input_shape(x)}")
    return tuple(shape[1:-1])


def format_padding(padding: str | Pairs) -> str:
    if isinstance(padding, str):
        return repr(padding)
    if all(lo == hi for lo, hi in padding):
        return str(tuple(lo for lo, _ in padding))
    return str(padding)


class _ConvLayer(Layer):
    """Configuration and parameters shared by Conv and ConvTranspose."""

    def __init__(
        self,
        kernel_size: int | tuple[int, ...],
        in_channels: int,
        out_channels: int,
        activation: str | Callable[[Any], Any] | None,
        stride: int | tuple[int, ...],
        padding: PaddingSpec,
        dilation: int | tuple[int, ...],
        groups: int,
        use_bias: bool,
        init_weight: initializers.Initializer | None,
        init_bias: initializers.Initializer | None,
    ) -> None:
        owner = type(self).__name__
        self.kernel_size = window_tuple(owner, "kernel_size", kernel_size)
        self.rank = len(self.kernel_size)
        for name, n in (("in_channels", in_channels), ("out_channels", out_channels), ("groups", groups)):
            if not _is_int(n) or n < 1:
                raise ValueError(f"{owner}: {name} must be a positive integer, got {n!r}")
        if in_channels % groups or out_channels % groups:
            raise ValueError(
                f"{owner}: in_channels ({in_channels}) and out_channels ({out_channels}) must both be "
                f"divisible by groups ({groups})"
            )
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.stride = spatial_tuple(owner, "stride", stride, self.rank)
        self.dilation = spatial_tuple(owner, "dilation", dilation, self.rank)
        self.padding = padding_spec(owner, padding, self.rank)
        self.activation = get_activation(activation)
        self.use_bias = use_bias
        fan_in = initializers.fans(self._weight_shape())[0]
        bound = 1.0 / math.sqrt(fan_in)
        self.init_weight = init_weight or initializers.kaiming_uniform()
        self.init_bias = init_bias or initializers.uniform(-bound, bound)

    def _weight_shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    def _expected(self) -> dict[str, tuple[int, ...]]:
        shapes = {"weight": self._weight_shape()}
        if self.use_bias:
            shapes["bias"] = (self.out_channels,)
        return shapes

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        ps = {"weight": self.init_weight(rng, self._weight_shape())}
        if self.use_bias:
            ps["bias"] = self.init_bias(rng, (self.out_channels,))
        return ps

    def _check_call(self, x: Any, ps: dict[str, Any]) -> tuple[Any, tuple[int, ...]]:
        """Validate a call's input and parameters; return the input as the layer computes
        on it (the dtype policy's) and its spatial sizes."""
        sizes = check_input(self, x, self.rank, self.in_channels)
        check_params(self, ps, self._expected())
        return match_eltype(self, x, ps["weight"]), sizes

    def _fused_relu(self) -> bool:
        # relu runs inside the convolution primitive, in place on its result.
        return self.activation is relu

    def _finish(self, y: Any) -> Any:
        return y if self.activation is None or self._fused_relu() else self.activation(y)

    def _options(self) -> str:
        parts = []
        if self.activation is not None:
            parts.append(getattr(self.activation, "__name__", repr(self.activation)))
        ones = (1,) * self.rank
        for name, value in (("stride", self.stride), ("dilation", self.dilation)):
            if value != ones:
                parts.append(f"{name}={value}")
        if self.padding == "same" or any(lo or hi for lo, hi in self.padding):
            parts.append(f"padding={format_padding(self.padding)}")
        if self.groups != 1:
            parts.append(f"groups={self.groups}")
        if not self.use_bias:
            parts.append("use_bias=False")
        return "".join(f", {p}" for p in parts)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.kernel_size}, {self.in_channels} => {self.out_channels}{self._options()})"


class Conv(_ConvLayer):
    """Convolution (cross-correlation, as PyTorch and Flax) over channels-last input.

    Shapes: x ``(N, *spatial, in_channels)`` -> y ``(N, *out, out_channels)``, where the
    spatial rank is ``len(kernel_size)`` (an int `kernel_size` means 2-D: ``(N, H, W, C)``;
    ``Conv((3,), ...)`` takes ``(N, L, C)``) and
    ``out = (size + low + high - dilation*(k-1) - 1) // stride + 1``.
    Parameters ``{"weight": (*kernel_size, in_channels/groups, out_channels),
    "bias": (out_channels,)}`` (HWIO); the defaults initialise as PyTorch does: weight
    kaiming-uniform with ``a = sqrt(5)`` on ``fan_in = prod(kernel_size) * in/groups``, bias
    uniform in ±1/sqrt(fan_in).

    `padding`: an int, one int per spatial axis, one ``(low, high)`` pair per axis (e.g.
    ``((top, bottom), (left, right))``), ``"valid"`` (none) or ``"same"``: TF/Flax SAME, an
    output of ``ceil(size / stride)`` with the padding split evenly and any odd element on the
    high side (at stride 1 that is PyTorch's ``padding="same"``). `groups` splits the input
    and output channels into that many independent convolutions.

    >>> import luxnn as lx
    >>> layer = lx.Conv(3, 1, 8, activation="relu", padding="same")
    >>> ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> layer(np.ones((2, 28, 28, 1), np.float32), ps, st)[0].shape
    (2, 28, 28, 8)
    """

    def __init__(
        self,
        kernel_size: int | tuple[int, ...],
        in_channels: int,
        out_channels: int,
        activation: str | Callable[[Any], Any] | None = None,
        *,
        stride: int | tuple[int, ...] = 1,
        padding: PaddingSpec = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        use_bias: bool = True,
        init_weight: initializers.Initializer | None = None,
        init_bias: initializers.Initializer | None = None,
    ) -> None:
        super().__init__(
            kernel_size, in_channels, out_channels, activation, stride, padding, dilation, groups,
            use_bias, init_weight, init_bias,
        )  # fmt: skip

    def _weight_shape(self) -> tuple[int, ...]:
        return (*self.kernel_size, self.in_channels // self.groups, self.out_channels)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, sizes = self._check_call(x, ps)
        padding = self.padding
        if padding == "same":
            padding = same_padding(sizes, self.kernel_size, self.stride, self.dilation)
        for axis, (n, k, d, (lo, hi)) in enumerate(zip(sizes, self.kernel_size, self.dilation, padding), 1):
            if conv_output_size(n, k, 1, d, (lo, hi)) < 1:
                raise LayerError(
                    f"{self}: kernel of extent {d * (k - 1) + 1} (size {k}, dilation {d}) is larger than the "
                    f"padded input along axis {axis}: {n} + {lo} + {hi} = {n + lo + hi}, input shape {x.shape}"
                )
        y = conv(
            x, ps["weight"], ps.get("bias"), stride=self.stride, padding=padding, dilation=self.dilation,
            groups=self.groups, relu=self._fused_relu(),
        )  # fmt: skip
        return self._finish(y), st


class ConvTranspose(_ConvLayer):
    """Transposed convolution (PyTorch's ``ConvTranspose``): the input gradient of a
    convolution ``out_channels -> in_channels`` with the same kernel, stride, padding,
    dilation and groups, as an upsampling layer.

    Shapes: x ``(N, *spatial, in_channels)`` -> y ``(N, *out, out_channels)`` with
    ``out = (size - 1)*stride - low - high + dilation*(k-1) + 1 + output_padding``.
    Parameters ``{"weight": (*kernel_size, out_channels/groups, in_channels),
    "bias": (out_channels,)}``: the weight is the kernel of that convolution in Conv's layout,
    as in Flux/Lux. PyTorch's ``(in, out/groups, kh, kw)`` is ``weight.transpose(3, 2, 0, 1)``,
    the same permutation that takes Conv's HWIO kernel to PyTorch's OIHW. Initialised as
    PyTorch does (``fan_in = prod(kernel_size) * out/groups``).

    `padding` crops the output (as PyTorch's); ``"same"`` gives an output of exactly
    ``size * stride``, cropping as the ``"same"`` padding of the matching convolution (which
    maps ``size * stride`` back to ``size``) would pad. `output_padding` (an int or one per
    axis, each below max(stride, dilation), not with ``"same"``) adds that many elements at
    the high side, to reach sizes that a strided convolution maps to the same size.

    >>> import luxnn as lx
    >>> layer = lx.ConvTranspose(4, 8, 3, stride=2, padding=1)
    >>> ps, st = lx.setup(np.random.default_rng(0), layer)
    >>> layer(np.ones((2, 7, 7, 8), np.float32), ps, st)[0].shape
    (2, 14, 14, 3)
    """

    def __init__(
        self,
        kernel_size: int | tuple[int, ...],
        in_channels: int,
        out_channels: int,
        activation: str | Callable[[Any], Any] | None = None,
        *,
        stride: int | tuple[int, ...] = 1,
        padding: PaddingSpec = 0,
        dilation: int | tuple[int, ...] = 1,
        groups: int = 1,
        output_padding: int | tuple[int, ...] = 0,
        use_bias: bool = True,
        init_weight: initializers.Initializer | None = None,
        init_bias: initializers.Initializer | None = None,
    ) -> None:
        super().__init__(
            kernel_size, in_channels, out_channels, activation, stride, padding, dilation, groups,
            use_bias, init_weight, init_bias,
        )  # fmt: skip
        self.output_padding = spatial_tuple("ConvTranspose", "output_padding", output_padding, self.rank, minimum=0)
        for op, s, d in zip(self.output_padding, self.stride, self.dilation):
            if op >= max(s, d):
                raise ValueError(
                    f"ConvTranspose: output_padding {self.output_padding} must be smaller than "
                    f"max(stride, dilation) on each axis (stride {self.stride}, dilation {self.dilation})"
                )
        if self.padding == "same" and any(self.output_padding):
            raise ValueError("ConvTranspose: output_padding cannot be combined with padding='same'")

    def _weight_shape(self) -> tuple[int, ...]:
        return (*self.kernel_size, self.out_channels // self.groups, self.in_channels)

    def _crop(self) -> tuple[Pairs, tuple[int, ...]]:
        """The padding and output padding of the call: for "same", an output of
        ``size * stride`` exactly."""
        if self.padding != "same":
            return self.padding, self.output_padding
        pads, extra = [], []
        for k, s, d in zip(self.kernel_size, self.stride, self.dilation):
            total = d * (k - 1) + 1 - s
            pads.append((max(total, 0) // 2, max(total, 0) - max(total, 0) // 2))
            extra.append(max(-total, 0))
        return tuple(pads), tuple(extra)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, sizes = self._check_call(x, ps)
        padding, output_padding = self._crop()
        for axis, (n, k, s, d, (lo, hi), e) in enumerate(
            zip(sizes, self.kernel_size, self.stride, self.dilation, padding, output_padding), 1
        ):
            if (n - 1) * s + d * (k - 1) + 1 + e - lo - hi < 1:
                raise LayerError(
                    f"{self}: padding ({lo}, {hi}) crops the whole output along axis {axis} "
                    f"(input size {n}, input shape {x.shape})"
                )
        y = conv_transpose(
            x, ps["weight"], ps.get("bias"), stride=self.stride, padding=padding, dilation=self.dilation,
            groups=self.groups, output_padding=output_padding, relu=self._fused_relu(),
        )  # fmt: skip
        return self._finish(y), st

    def _options(self) -> str:
        extra = f", output_padding={self.output_padding}" if any(self.output_padding) else ""
        return super()._options() + extra
