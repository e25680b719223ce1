"""Normalisation layers: BatchNorm, LayerNorm, GroupNorm, RMSNorm (channel-last inputs)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..ad import stop_gradient
from ..core import Layer, LayerError, check_params
from ..ops.norm import moments, normalize, rms_normalize, scale_shift

__all__ = ["BatchNorm", "LayerNorm", "GroupNorm", "RMSNorm"]


def _positive_int(owner: str, name: str, n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {n!r}")
    return int(n)


def _shape_arg(owner: str, shape: int | tuple[int, ...]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not dims:
        raise ValueError(f"{owner}: shape must have at least one dimension, got {shape!r}")
    return tuple(_positive_int(owner, "shape", n) for n in dims)


def _non_negative(owner: str, name: str, value: float) -> float:
    if not value >= 0:
        raise ValueError(f"{owner}: {name} must be >= 0, got {value!r}")
    return float(value)


def _options(**flags: Any) -> str:
    return "".join(f", {k}={v}" for k, v in flags.items())


class _Norm(Layer):
    """What the normalisation layers share: epsilon, and the optional learned affine map
    ``y * scale (+ bias)`` over `_affine_shape` (without a bias where `with_bias` is False)."""

    default_epsilon = 1e-5
    with_bias = True

    def _init_affine(self, epsilon: float, affine: bool, shape: tuple[int, ...]) -> None:
        self.epsilon = _non_negative(type(self).__name__, "epsilon", epsilon)
        self.affine = bool(affine)
        self._affine_shape = shape

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        if not self.affine:
            return {}
        ps = {"scale": np.ones(self._affine_shape, np.float32)}
        if self.with_bias:
            ps["bias"] = np.zeros(self._affine_shape, np.float32)
        return ps

    def _check_params(self, ps: dict[str, Any]) -> None:
        names = ("scale", "bias") if self.with_bias else ("scale",)
        check_params(self, ps, {name: self._affine_shape for name in names} if self.affine else {})

    def _scale_and_shift(self, y: Any, ps: dict[str, Any]) -> Any:
        if not self.affine:
            return y
        return scale_shift(y, ps["scale"], ps["bias"]) if self.with_bias else y * ps["scale"]

    def _flags(self) -> dict[str, Any]:
        """The repr's keyword options that differ from their defaults."""
        flags: dict[str, Any] = {"epsilon": self.epsilon} if self.epsilon != self.default_epsilon else {}
        if not self.affine:
            flags["affine"] = False
        return flags


def _check_channels_last(layer: Layer, x: Any, channels: int) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2 or shape[-1] != channels:
        raise LayerError(f"{layer}: expected input of shape (N, ..., {channels}) (channels last), got {shape}")
    return shape


class BatchNorm(_Norm):
    """Batch normalisation over the last (channel) axis: input ``(N, C)``, ``(N, L, C)`` or
    ``(N, H, W, C)`` (any rank >= 2), statistics over every axis but the last.

    Parameters ``{"scale": (C,), "bias": (C,)}`` (when `affine`); state
    ``{"running_mean": (C,), "running_var": (C,), "training": True}`` (without the running
    statistics when ``track_stats=False``). In training mode the layer normalises with the
    batch statistics and returns updated running statistics, as PyTorch does:
    ``running = (1 - momentum) * running + momentum * batch`` with the unbiased batch
    variance. In test mode (`luxnn.testmode`) it uses the running statistics; with
    ``track_stats=False`` it always uses the batch statistics.

    >>> import luxnn as lx
    >>> bn = lx.BatchNorm(3)
    >>> ps, st = lx.setup(np.random.default_rng(0), bn)
    >>> y, st = bn(np.random.default_rng(1).normal(size=(8, 4, 4, 3)).astype(np.float32), ps, st)
    >>> y.shape, sorted(st)
    ((8, 4, 4, 3), ['running_mean', 'running_var', 'training'])
    """

    def __init__(
        self,
        num_features: int,
        *,
        momentum: float = 0.1,
        epsilon: float = 1e-5,
        affine: bool = True,
        track_stats: bool = True,
    ) -> None:
        self.num_features = _positive_int("BatchNorm", "num_features", num_features)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"BatchNorm: momentum must be in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        self._init_affine(epsilon, affine, (self.num_features,))
        self.track_stats = bool(track_stats)

    def init_state(self, rng: np.random.Generator) -> dict[str, Any]:
        if not self.track_stats:
            return {"training": True}
        c = self.num_features
        return {"running_mean": np.zeros(c, np.float32), "running_var": np.ones(c, np.float32), "training": True}

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        _check_channels_last(self, x, self.num_features)
        self._check_params(ps)
        expected_state = {"running_mean", "running_var", "training"} if self.track_stats else {"training"}
        if not isinstance(st, dict) or st.keys() != expected_state:
            raise LayerError(f"{self}: expected state keys {sorted(expected_state)}, got {sorted(st) if isinstance(st, dict) else type(st).__name__}")
        training = st["training"]
        if training or not self.track_stats:
            y, st = self._batch_statistics(x, st, update=training and self.track_stats)
            return self._scale_and_shift(y, ps), st
        # Test mode: the running statistics fold into one per-channel scale and shift.
        inv_std = 1.0 / np.sqrt(st["running_var"] + self.epsilon)
        if not self.affine:
            return (x - st["running_mean"]) * inv_std, st
        scale = ps["scale"] * inv_std
        return x * scale + (ps["bias"] - st["running_mean"] * scale), st

    def _batch_statistics(self, x: Any, st: dict[str, Any], update: bool) -> tuple[Any, dict[str, Any]]:
        axes = tuple(range(x.ndim - 1))
        count = math.prod(x.shape[:-1])
        if count < 2 and update:
            raise LayerError(f"{self}: expected more than 1 value per channel in training mode, got input of shape {x.shape}")
        # The statistics come from the raw values: the running statistics must never hold
        # (or keep alive) traced values, and normalize's VJP already accounts for them.
        mean, var = moments(stop_gradient(x), axes)
        y = normalize(x, axis=axes, epsilon=self.epsilon, stats=(mean, var))
        if not update:
            return y, st
        m = self.momentum
        rm, rv = st["running_mean"], st["running_var"]
        new_mean = (1 - m) * rm + m * mean.reshape(rm.shape)
        new_var = (1 - m) * rv + (m * count / (count - 1)) * var.reshape(rv.shape)
        return y, {
            "running_mean": new_mean.astype(rm.dtype, copy=False),
            "running_var": new_var.astype(rv.dtype, copy=False),
            "training": True,
        }

    def __repr__(self) -> str:
        flags = {"momentum": self.momentum} if self.momentum != 0.1 else {}
        flags.update(self._flags())
        if not self.track_stats:
            flags["track_stats"] = False
        return f"BatchNorm({self.num_features}{_options(**flags)})"


class LayerNorm(_Norm):
    """Layer normalisation over the trailing dimensions `shape` (an int or a tuple), as
    ``torch.nn.LayerNorm(shape)``: input ``(..., *shape)`` -> same shape; parameters
    ``{"scale": shape, "bias": shape}`` (when `affine`), initialised to ones and zeros.

    >>> import luxnn as lx
    >>> ln = lx.LayerNorm(4)
    >>> ps, st = lx.setup(np.random.default_rng(0), ln)
    >>> ln(np.arange(8, dtype=np.float32).reshape(2, 4), ps, st)[0].shape
    (2, 4)
    """

    def __init__(self, shape: int | tuple[int, ...], *, epsilon: float = 1e-5, affine: bool = True) -> None:
        self.shape = _shape_arg("LayerNorm", shape)
        self._init_affine(epsilon, affine, self.shape)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = _trailing_axes(self, x, self.shape)
        self._check_params(ps)
        return self._scale_and_shift(normalize(x, axis=axes, epsilon=self.epsilon), ps), st

    def __repr__(self) -> str:
        return f"LayerNorm({_shape_repr(self.shape)}{_options(**self._flags())})"


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the trailing dimensions `dim` (an int or a
    tuple): ``y = x / sqrt(mean(x**2) + epsilon) * scale``, no centring and no bias.
    Parameters ``{"scale": dim}`` (when `affine`), initialised to ones. The default epsilon
    is 1e-6 (Flax's and LLaMA's); PyTorch's default is the dtype's machine epsilon.

    >>> import luxnn as lx
    >>> norm = lx.RMSNorm(4)
    >>> ps, st = lx.setup(np.random.default_rng(0), norm)
    >>> sorted(ps)
    ['scale']
    """

    default_epsilon = 1e-6
    with_bias = False

    def __init__(self, dim: int | tuple[int, ...], *, epsilon: float = 1e-6, affine: bool = True) -> None:
        self.shape = _shape_arg("RMSNorm", dim)
        self._init_affine(epsilon, affine, self.shape)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = _trailing_axes(self, x, self.shape)
        self._check_params(ps)
        return self._scale_and_shift(rms_normalize(x, axis=axes, epsilon=self.epsilon), ps), st

    def __repr__(self) -> str:
        return f"RMSNorm({_shape_repr(self.shape)}{_options(**self._flags())})"


class GroupNorm(_Norm):
    """Group normalisation of channel-last input ``(N, ..., num_channels)``: the channels
    split into `num_groups` groups of consecutive channels, each normalised over its
    channels and all spatial positions of one sample (as ``torch.nn.GroupNorm`` on the
    channel-first layout). Parameters ``{"scale": (C,), "bias": (C,)}`` (when `affine`).

    >>> import luxnn as lx
    >>> gn = lx.GroupNorm(2, 4)
    >>> ps, st = lx.setup(np.random.default_rng(0), gn)
    >>> gn(np.ones((2, 3, 3, 4), np.float32), ps, st)[0].shape
    (2, 3, 3, 4)
    """

    def __init__(self, num_groups: int, num_channels: int, *, epsilon: float = 1e-5, affine: bool = True) -> None:
        self.num_groups = _positive_int("GroupNorm", "num_groups", num_groups)
        self.num_channels = _positive_int("GroupNorm", "num_channels", num_channels)
        if self.num_channels % self.num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self._init_affine(epsilon, affine, (self.num_channels,))

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        c, g = self.num_channels, self.num_groups
        shape = _check_channels_last(self, x, c)
        self._check_params(ps)
        grouped = x.reshape((*shape[:-1], g, c // g))
        axes = (*range(1, len(shape) - 1), len(shape))
        y = normalize(grouped, axis=axes, epsilon=self.epsilon).reshape(shape)
        return self._scale_and_shift(y, ps), st

    def __repr__(self) -> str:
        return f"GroupNorm({self.num_groups}, {self.num_channels}{_options(**self._flags())})"


def _trailing_axes(layer: Layer, x: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    got = getattr(x, "shape", None)
    if got is None or len(got) < len(shape) or tuple(got[len(got) - len(shape):]) != shape:
        raise LayerError(f"{layer}: expected input of shape (..., {', '.join(map(str, shape))}), got {got}")
    return tuple(range(len(got) - len(shape), len(got)))


def _shape_repr(shape: tuple[int, ...]) -> str:
    return str(shape[0]) if len(shape) == 1 else str(shape)
