"""Weight initialisers: ``init(rng, shape, dtype=float32) -> array``.

Fans follow the kernel layout of luxnn's layers, where the last axis is the output:
``fan_in = prod(shape[:-1])`` and ``fan_out = prod(shape[:-2]) * shape[-1]`` (for a Dense
weight ``(in, out)`` that is ``in`` and ``out``; for a conv kernel ``(kh, kw, in, out)`` the
receptive field times the channels, as in PyTorch).

Each initialiser is a small frozen dataclass: it pickles and deep-copies with the model
that holds it, compares by its options, and its repr is the call that made it. Any other
function of ``(rng, shape, dtype)`` works wherever an initialiser goes.

>>> import numpy as np
>>> w = kaiming_uniform()(np.random.default_rng(0), (64, 128))
>>> w.shape, w.dtype
((64, 128), dtype('float32'))
>>> orthogonal(gain=2.0)
orthogonal(gain=2.0)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable

import numpy as np

Initializer = Callable[..., Any]

__all__ = [
    "Initializer", "fans", "zeros", "ones", "constant", "normal", "uniform", "glorot_uniform",
    "glorot_normal", "kaiming_uniform", "kaiming_normal", "truncated_normal", "orthogonal",
    "lecun_uniform", "lecun_normal", "variance_scaling", "identity_init", "sparse_init",
]  # fmt: skip

# The standard deviation of a standard normal truncated to [-2, 2], by which JAX's
# variance_scaling divides so that its truncated draws have the variance asked for.
_TRUNCATED_STD = 0.87962566103423978


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


def _truncated_standard_normal(rng: Any, shape: tuple[int, ...], lo: float, hi: float) -> Any:
    """Standard normal draws conditioned on ``[lo, hi]``, by the inverse CDF (float64)."""
    from scipy.special import ndtr, ndtri  # imported here: scipy costs `import luxnn` time

    u = rng.uniform(ndtr(lo), ndtr(hi), size=shape)
    return np.clip(ndtri(u), lo, hi)


def _check_positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not (isinstance(value, (int, float)) and value > 0):
            raise ValueError(f"{owner}: {name} must be a positive number, got {value!r}")


@dataclasses.dataclass(frozen=True)
class constant:  # noqa: N801 - a factory's name, as functools.partial
    """Every entry equal to `value`."""

    value: float

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return np.full(shape, self.value, dtype=dtype)


zeros = constant(0.0)
ones = constant(1.0)


@dataclasses.dataclass(frozen=True)
class normal:  # noqa: N801
    """Entries drawn from N(mean, std^2)."""

    std: float = 1.0
    mean: float = 0.0

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return (self.mean + _normal(rng, shape, self.std, np.float64)).astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class uniform:  # noqa: N801
    """Entries drawn from U(low, high)."""

    low: float = 0.0
    high: float = 1.0

    def __post_init__(self) -> None:
        if not self.low <= self.high:
            raise ValueError(f"uniform init: expected low <= high, got low={self.low}, high={self.high}")

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return rng.uniform(self.low, self.high, size=shape).astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class glorot_uniform:  # noqa: N801
    """Glorot/Xavier uniform: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""

    gain: float = 1.0

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        fan_in, fan_out = fans(shape)
        return _uniform(rng, shape, self.gain * math.sqrt(6.0 / (fan_in + fan_out)), dtype)


@dataclasses.dataclass(frozen=True)
class glorot_normal:  # noqa: N801
    """Glorot/Xavier normal: N(0, s^2), s = gain * sqrt(2 / (fan_in + fan_out))."""

    gain: float = 1.0

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        fan_in, fan_out = fans(shape)
        return _normal(rng, shape, self.gain * math.sqrt(2.0 / (fan_in + fan_out)), dtype)


@dataclasses.dataclass(frozen=True)
class kaiming_uniform:  # noqa: N801
    """Kaiming/He uniform on fan_in. The defaults are PyTorch's (and Lux's) for Dense and
    Conv weights: b = 1 / sqrt(fan_in)."""

    a: float = math.sqrt(5)
    nonlinearity: str = "leaky_relu"

    def __post_init__(self) -> None:
        _gain(self.nonlinearity, self.a)

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        gain = _gain(self.nonlinearity, self.a)
        return _uniform(rng, shape, gain * math.sqrt(3.0 / fans(shape)[0]), dtype)


@dataclasses.dataclass(frozen=True)
class kaiming_normal:  # noqa: N801
    """Kaiming/He normal on fan_in: N(0, s^2), s = gain / sqrt(fan_in)."""

    a: float = 0.0
    nonlinearity: str = "relu"

    def __post_init__(self) -> None:
        _gain(self.nonlinearity, self.a)

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        return _normal(rng, shape, _gain(self.nonlinearity, self.a) / math.sqrt(fans(shape)[0]), dtype)


@dataclasses.dataclass(frozen=True)
class truncated_normal:  # noqa: N801
    """N(mean, std^2) conditioned on ``[a, b]`` (absolute bounds, as PyTorch's
    ``trunc_normal_`` and Lux's ``truncated_normal``).

    >>> w = truncated_normal(std=0.02, a=-0.04, b=0.04)(np.random.default_rng(0), (1000,))
    >>> bool(w.min() >= -0.04 and w.max() <= 0.04)
    True
    """

    std: float = 1.0
    a: float = -2.0
    b: float = 2.0
    mean: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("truncated_normal", std=self.std)
        if not self.a < self.b:
            raise ValueError(f"truncated_normal: expected a < b, got a={self.a}, b={self.b}")

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        lo, hi = (self.a - self.mean) / self.std, (self.b - self.mean) / self.std
        z = _truncated_standard_normal(rng, shape, lo, hi)
        return np.clip(self.mean + self.std * z, self.a, self.b).astype(dtype, copy=False)


_MODES = ("fan_in", "fan_out", "fan_avg")
_DISTRIBUTIONS = ("truncated_normal", "normal", "uniform")


@dataclasses.dataclass(frozen=True)
class variance_scaling:  # noqa: N801
    """JAX's ``jax.nn.initializers.variance_scaling``: entries of variance
    ``scale / n``, where n is the fan_in, the fan_out or their mean (`mode`), drawn from
    a `distribution`: ``"truncated_normal"`` (within two standard deviations, rescaled by
    0.87962566, the standard deviation of such a draw), ``"normal"`` or ``"uniform"``.

    >>> w = variance_scaling(2.0, "fan_in", "normal")(np.random.default_rng(0), (500, 400))
    >>> round(float(w.std() ** 2 * 500), 1)
    2.0
    """

    scale: float = 1.0
    mode: str = "fan_in"
    distribution: str = "truncated_normal"

    def __post_init__(self) -> None:
        _check_positive("variance_scaling", scale=self.scale)
        if self.mode not in _MODES:
            raise ValueError(f"variance_scaling: mode must be one of {_MODES}, got {self.mode!r}")
        if self.distribution not in _DISTRIBUTIONS:
            raise ValueError(f"variance_scaling: distribution must be one of {_DISTRIBUTIONS}, got {self.distribution!r}")

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        fan_in, fan_out = fans(shape)
        n = {"fan_in": fan_in, "fan_out": fan_out, "fan_avg": (fan_in + fan_out) / 2}[self.mode]
        variance = self.scale / max(1.0, n)
        if self.distribution == "uniform":
            return _uniform(rng, shape, math.sqrt(3.0 * variance), dtype)
        if self.distribution == "normal":
            return _normal(rng, shape, math.sqrt(variance), dtype)
        z = _truncated_standard_normal(rng, shape, -2.0, 2.0)
        return (z * (math.sqrt(variance) / _TRUNCATED_STD)).astype(dtype, copy=False)


def lecun_uniform() -> variance_scaling:
    """LeCun uniform (as JAX's): variance ``1 / fan_in``, uniform."""
    return variance_scaling(1.0, "fan_in", "uniform")


def lecun_normal() -> variance_scaling:
    """LeCun normal (as JAX's): variance ``1 / fan_in``, truncated normal."""
    return variance_scaling(1.0, "fan_in", "truncated_normal")


@dataclasses.dataclass(frozen=True)
class orthogonal:  # noqa: N801
    """A (semi-)orthogonal matrix times `gain`, as JAX's ``orthogonal`` (and PyTorch's
    ``orthogonal_`` in luxnn's layout): the weight seen as a matrix
    ``(prod(shape[:-1]), shape[-1])`` has orthonormal columns, or orthonormal rows when it
    is wider than tall; from the QR decomposition of a Gaussian matrix, signs fixed so that
    the draw is uniform (Haar) over such matrices.

    >>> w = orthogonal()(np.random.default_rng(0), (6, 4), np.float64)
    >>> bool(np.allclose(w.T @ w, np.eye(4)))
    True
    """

    gain: float = 1.0

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(f"orthogonal init: expected a shape of at least 2 dimensions, got {shape}")
        rows, cols = math.prod(shape[:-1]), shape[-1]
        a = rng.standard_normal((max(rows, cols), min(rows, cols)))
        q, r = np.linalg.qr(a)
        q *= np.sign(np.diag(r))  # a zero diagonal has probability zero
        if rows < cols:
            q = q.T
        return (self.gain * q).reshape(shape).astype(dtype, copy=False)


@dataclasses.dataclass(frozen=True)
class identity_init:  # noqa: N801
    """`gain` times the identity: a weight ``(in, out)`` gets ``gain * eye(in, out)``; a
    conv kernel ``(*window, in, out)`` gets `gain` at the window's centre from input
    channel i to output channel i (PyTorch's ``dirac_``), so the layer passes its input on.

    >>> identity_init()(None, (2, 3)).tolist()
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]]
    """

    gain: float = 1.0

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        shape = tuple(shape)
        if len(shape) < 2:
            raise ValueError(f"identity_init: expected a shape of at least 2 dimensions, got {shape}")
        w = np.zeros(shape, dtype)
        n = min(shape[-2:])
        centre = tuple(k // 2 for k in shape[:-2])
        w[(*centre, np.arange(n), np.arange(n))] = self.gain
        return w


@dataclasses.dataclass(frozen=True)
class sparse_init:  # noqa: N801
    """A sparse weight ``(in, out)`` as PyTorch's ``sparse_`` (and Lux's): entries from
    N(0, std^2), and in each input's row ``ceil(sparsity * out)`` of them, chosen at
    random, zero (PyTorch zeroes that many rows of each column of its ``(out, in)``).

    >>> w = sparse_init(0.5)(np.random.default_rng(0), (3, 4))
    >>> (w == 0).sum(axis=1).tolist()
    [2, 2, 2]
    """

    sparsity: float
    std: float = 0.01

    def __post_init__(self) -> None:
        if not (isinstance(self.sparsity, (int, float)) and 0.0 <= self.sparsity <= 1.0):
            raise ValueError(f"sparse_init: sparsity must be in [0, 1], got {self.sparsity!r}")
        _check_positive("sparse_init", std=self.std)

    def __call__(self, rng: Any, shape: tuple[int, ...], dtype: Any = np.float32) -> Any:
        shape = tuple(shape)
        if len(shape) != 2:
            raise ValueError(f"sparse_init: expected a 2-dimensional shape (in, out), got {shape}")
        rows, cols = shape
        w = rng.standard_normal(shape) * self.std
        zeros_per_row = math.ceil(self.sparsity * cols)
        # A random permutation of each row's columns; its first entries are zeroed.
        order = np.argsort(rng.random(shape), axis=1)[:, :zeros_per_row]
        w[np.arange(rows)[:, None], order] = 0.0
        return w.astype(dtype, copy=False)
