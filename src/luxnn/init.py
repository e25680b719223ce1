"""Weight initialisers: ``init(rng, shape, dtype=float32) -> array``.

Fans follow the kernel layout of luxnn's layers, where the last axis is the output:
``fan_in = prod(shape[:-1])`` and ``fan_out = prod(shape[:-2]) * shape[-1]`` (for a Dense
weight ``(in, out)`` that is ``in`` and ``out``; for a conv kernel ``(kh, kw, in, out)`` the
receptive field times the channels, as in PyTorch).

>>> import numpy as np
>>> w = kaiming_uniform()(np.random.default_rng(0), (64, 128))
>>> w.shape, w.dtype
((64, 128), dtype('float32'))
"""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

Initializer = Callable[..., Any]

__all__ = [
    "Initializer", "fans", "zeros", "ones", "constant", "normal", "uniform", "glorot_uniform",
    "glorot_normal", "kaiming_uniform", "kaiming_normal",
]  # fmt: skip


def fans(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(fan_in, fan_out)`` of a weight of `shape` (last axis = outputs)."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return shape[0], shape[0]
    receptive = math.prod(shape[:-2])
    return receptive * shape[-2], receptive * shape[-1]


def _gain(nonlinearity: str, a: float) -> float:
    # PyTorch's calculate_gain for the nonlinearities kaiming init is used with.
    if nonlinearity == "relu":
        return math.sqrt(2.0)
    if nonlinearity == "leaky_relu":
        return math.sqrt(2.0 / (1 + a * a))
    if nonlinearity in ("linear", "sigmoid"):
        return 1.0
    if nonlinearity == "tanh":
        return 5.0 / 3
    raise ValueError(f"kaiming init: unknown nonlinearity {nonlinearity!r}; expected relu, leaky_relu, linear, sigmoid or tanh")


def _uniform(rng: Any, shape: tuple[int, ...], bound: float, dtype: Any) -> Any:
    return rng.uniform(-bound, bound, size=shape).astype(dtype, copy=False)


def _normal(rng: Any, shape: tuple[int, ...], std: float, dtype: Any) -> Any:
    return (rng.standard_normal(size=shape) * std).astype(dtype, copy=False)


def constant(value: float) -> Initializer:
    """Every entry equal to `value`."""

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return np.full(shape, value, dtype=dtype)

    return init


zeros = constant(0.0)
ones = constant(1.0)


def normal(std: float = 1.0, mean: float = 0.0) -> Initializer:
    """Entries drawn from N(mean, std^2)."""

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return (mean + _normal(rng, shape, std, np.float64)).astype(dtype, copy=False)

    return init


def uniform(low: float = 0.0, high: float = 1.0) -> Initializer:
    """Entries drawn from U(low, high)."""
    if not low <= high:
        raise ValueError(f"uniform init: expected low <= high, got low={low}, high={high}")

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return rng.uniform(low, high, size=shape).astype(dtype, copy=False)

    return init


def glorot_uniform(gain: float = 1.0) -> Initializer:
    """Glorot/Xavier uniform: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        fan_in, fan_out = fans(shape)
        return _uniform(rng, shape, gain * math.sqrt(6.0 / (fan_in + fan_out)), dtype)

    return init


def glorot_normal(gain: float = 1.0) -> Initializer:
    """Glorot/Xavier normal: N(0, s^2), s = gain * sqrt(2 / (fan_in + fan_out))."""

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        fan_in, fan_out = fans(shape)
        return _normal(rng, shape, gain * math.sqrt(2.0 / (fan_in + fan_out)), dtype)

    return init


def kaiming_uniform(a: float = math.sqrt(5), nonlinearity: str = "leaky_relu") -> Initializer:
    """Kaiming/He uniform on fan_in. The defaults are PyTorch's (and Lux's) for Dense and
    Conv weights: b = 1 / sqrt(fan_in)."""
    gain = _gain(nonlinearity, a)

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return _uniform(rng, shape, gain * math.sqrt(3.0 / fans(shape)[0]), dtype)

    return init


def kaiming_normal(a: float = 0.0, nonlinearity: str = "relu") -> Initializer:
    """Kaiming/He normal on fan_in: N(0, s^2), s = gain / sqrt(fan_in)."""
    gain = _gain(nonlinearity, a)

    def init(rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return _normal(rng, shape, gain / math.sqrt(fans(shape)[0]), dtype)

    return init
