"""Positional embeddings without parameters: the sinusoidal table and rotary (RoPE)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ad.tape import stop_gradient
from ..backend import module_of
from ..core import input_shape, Layer, LayerError
from ..dtypes import match_eltype
from ..ops.positional import rotary, rotary_tables, sinusoidal_table

__all__ = ["SinusoidalPositionalEmbedding", "RotaryPositionalEmbedding", "rope"]

_MODES = ("add", "return")


def _check_positive(owner: str, name: str, n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {n!r}")
    return int(n)


def check_base(owner: str, base: Any) -> float:
    """`base` of a positional layer as a float, checked."""
    if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1:
        raise ValueError(f"{owner}: base must be a number above 1, got {base!r}")
    return float(base)


def _floating_dtype(x: Any) -> Any:
    """The dtype a table for `x` takes: x's when floating, else float32."""
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    return dtype if dtype.kind == "f" else np.dtype(np.float32)


def _on_device_of(table: np.ndarray, x: Any) -> Any:
    return module_of(stop_gradient(x)).asarray(table)


class SinusoidalPositionalEmbedding(Layer):
    """The Transformer's sinusoidal positional embedding (Vaswani et al. 2017) for ``(batch,
    seq, dim)`` inputs: ``T[pos, 2i] = sin(pos / base^(2i / dim))``, ``T[pos, 2i + 1] =
    cos(pos / base^(2i / dim))``. ``mode="add"`` returns ``x + T[:seq]``; ``mode="return"``
    returns the table ``T[:seq]`` ``(seq, dim)`` itself, for the caller to combine, given
    x ``(batch, seq, dim)`` or token ids ``(batch, seq)`` (in x's floating dtype, else
    float32). No parameters and no state; sequences up to `max_len` long.

    >>> import luxnn as lx
    >>> pe = lx.SinusoidalPositionalEmbedding(8)
    >>> ps, st = lx.setup(np.random.default_rng(0), pe)
    >>> y, st = pe(np.zeros((2, 5, 8), np.float32), ps, st)
    >>> y.shape, float(y[0, 0, 1])
    ((2, 5, 8), 1.0)
    """

    def __init__(self, dim: int, *, max_len: int = 4096, base: float = 10000.0, mode: str = "add") -> None:
        name = "SinusoidalPositionalEmbedding"
        self.dim = _check_positive(name, "dim", dim)
        self.max_len = _check_positive(name, "max_len", max_len)
        self.base = check_base(name, base)
        if mode not in _MODES:
            raise ValueError(f"{name}: mode must be one of {_MODES}, got {mode!r}")
        self.mode = mode

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        ids = self.mode == "return" and shape is not None and len(shape) == 2
        if shape is None or not (ids or (len(shape) == 3 and shape[2] == self.dim)) or shape[1] > self.max_len:
            also = " or token ids (batch, seq)" if self.mode == "return" else ""
            raise LayerError(f"{self}: expected input of shape (batch, seq <= {self.max_len}, {self.dim}){also}, got {input_shape(x)}")
        x = match_eltype(self, x, None)
        table = _on_device_of(sinusoidal_table(shape[1], self.dim, self.base, _floating_dtype(x)), x)
        if self.mode == "return":
            return table, st
        return x + table, st

    def __repr__(self) -> str:
        extra = "" if self.mode == "add" else f", mode={self.mode!r}"
        return f"SinusoidalPositionalEmbedding({self.dim}{extra})"


class RotaryPositionalEmbedding(Layer):
    """Rotary positional embedding (RoPE, Su et al. 2021) with LLaMA's frequencies: each pair
    of features at position p turned by the angle ``p * base^(-2i / head_dim)``.

    Input ``(batch, seq, heads, head_dim)`` or ``(batch, seq, head_dim)``; the output has
    its shape. Pairs are ``(i, i + head_dim/2)`` (rotate-half, as Hugging Face's LLaMA and
    GPT-NeoX), or ``(2i, 2i + 1)`` with ``interleaved=True`` (as Meta's LLaMA reference
    code); the two differ by a fixed permutation of the features. Applied to queries and
    keys, the scores ``q_m . k_n`` depend only on ``m - n``. No parameters and no state;
    sequences up to `max_len` long. `MultiHeadAttention(..., rotary=True)` applies it per head.

    >>> import luxnn as lx
    >>> rope = lx.RotaryPositionalEmbedding(4)
    >>> ps, st = lx.setup(np.random.default_rng(0), rope)
    >>> y, st = rope(np.ones((2, 3, 2, 4), np.float32), ps, st)
    >>> y.shape, bool(np.allclose(y[:, 0], 1.0))
    ((2, 3, 2, 4), True)
    """

    def __init__(self, head_dim: int, *, base: float = 10000.0, max_len: int = 4096, interleaved: bool = False) -> None:
        name = "RotaryPositionalEmbedding"
        self.head_dim = _check_positive(name, "head_dim", head_dim)
        if self.head_dim % 2:
            raise ValueError(f"{name}: head_dim must be even (features rotate in pairs), got {head_dim}")
        self.base = check_base(name, base)
        self.max_len = _check_positive(name, "max_len", max_len)
        self.interleaved = bool(interleaved)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) not in (3, 4) or shape[-1] != self.head_dim or shape[1] > self.max_len:
            raise LayerError(
                f"{self}: expected input of shape (batch, seq <= {self.max_len}, [heads,] {self.head_dim}), got {input_shape(x)}"
            )
        return rope(match_eltype(self, x, None), base=self.base, interleaved=self.interleaved), st

    def __repr__(self) -> str:
        extra = ", interleaved=True" if self.interleaved else ""
        return f"RotaryPositionalEmbedding({self.head_dim}{extra})"


def rope(x: Any, *, base: float = 10000.0, interleaved: bool = False) -> Any:
    """`x` ``(batch, seq, [heads,] d)`` with each feature pair rotated by its position, as
    `RotaryPositionalEmbedding` does (without its checks): the function `MultiHeadAttention`
    applies per head.

    >>> rope(np.ones((1, 2, 2)), base=10.0).round(4).tolist()
    [[[1.0, 1.0], [-0.3012, 1.3818]]]
    """
    cos, sin = rotary_tables(x.shape[1], x.shape[-1], base, _floating_dtype(x))
    if len(x.shape) == 4:  # the tables broadcast over the heads
        cos, sin = cos[:, None], sin[:, None]
    return rotary(x, _on_device_of(cos, x), _on_device_of(sin, x), interleaved=interleaved)
