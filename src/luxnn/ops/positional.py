"""Positional encodings' kernels: the sinusoidal and rotary tables, and the rotary
embedding (RoPE) as one primitive whose VJP is the inverse rotation."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of

__all__ = ["sinusoidal_table", "rotary_tables", "rotary"]


def _angles(length: int, pairs: int, dim: int, base: float) -> np.ndarray:
    """``pos / base^(2i / dim)`` for positions ``0..length-1`` and ``i < pairs``, in float64."""
    inverse_frequency = float(base) ** (-np.arange(0, 2 * pairs, 2, dtype=np.float64) / dim)
    return np.arange(length, dtype=np.float64)[:, None] * inverse_frequency


def _shared(*tables: np.ndarray) -> Any:
    for t in tables:
        t.flags.writeable = False  # handed to every caller through the cache
    return tables if len(tables) > 1 else tables[0]


# The tables are cached (read-only) by their arguments: layers ask for them on every call.
@functools.lru_cache(maxsize=64)
def sinusoidal_table(length: int, dim: int, base: float = 10000.0, dtype: Any = np.float32) -> np.ndarray:
    """The Transformer's sinusoidal table ``(length, dim)`` (Vaswani et al. 2017):
    ``T[pos, 2i] = sin(pos / base^(2i / dim))``, ``T[pos, 2i + 1] = cos(...)``; an odd `dim`
    drops the last cosine.

    >>> sinusoidal_table(2, 4, dtype=np.float64).round(4).tolist()
    [[0.0, 1.0, 0.0, 1.0], [0.8415, 0.5403, 0.01, 1.0]]
    """
    angles = _angles(length, (dim + 1) // 2, dim, base)
    table = np.empty((length, 2 * angles.shape[1]), np.float64)
    table[:, 0::2] = np.sin(angles)
    table[:, 1::2] = np.cos(angles)
    return _shared(np.ascontiguousarray(table[:, :dim], dtype=dtype))


@functools.lru_cache(maxsize=64)
def rotary_tables(length: int, head_dim: int, base: float = 10000.0, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)``, each ``(length, head_dim // 2)``, of the rotary angles
    ``pos * base^(-2i / head_dim)`` (RoPE, Su et al. 2021; LLaMA's frequencies).

    >>> cos, sin = rotary_tables(3, 4)
    >>> cos.shape, float(sin[1, 0]) == float(np.float32(np.sin(1.0)))
    ((3, 2), True)
    """
    angles = _angles(length, head_dim // 2, head_dim, base)
    return _shared(np.cos(angles).astype(dtype), np.sin(angles).astype(dtype))


def _halves(x, interleaved):
    """The two members of each rotated pair: (x[..., 2i], x[..., 2i + 1]) interleaved, else
    (x[..., i], x[..., i + d/2]) (rotate-half)."""
    if interleaved:
        return x[..., 0::2], x[..., 1::2]
    half = x.shape[-1] // 2
    return x[..., :half], x[..., half:]


def _rotate(x, cos, sin, interleaved):
    """Each pair (a, b) of `x` turned by its angle: ``(a cos - b sin, b cos + a sin)``."""
    y = module_of(x).empty(x.shape, np.result_type(x, cos))
    a, b = _halves(x, interleaved)
    ya, yb = _halves(y, interleaved)
    np.multiply(a, cos, out=ya)
    ya -= b * sin
    np.multiply(b, cos, out=yb)
    yb += a * sin
    return y


@primitive
def rotary(x, cos, sin, *, interleaved=False):
    """Rotary position embedding: every pair of features of `x` ``(batch, seq, ..., d)``
    turned by the angle of its position and frequency, ``cos``/``sin`` ``(seq, ..., d / 2)``
    (broadcast against x's axes after the batch; see `rotary_tables`). Pairs are
    ``(i, i + d/2)`` (rotate-half: Hugging Face's LLaMA and GPT-NeoX) or with
    ``interleaved=True`` ``(2i, 2i + 1)`` (Meta's LLaMA reference code). The VJP turns the
    cotangent back by the same angles.

    >>> cos, sin = rotary_tables(2, 2, dtype=np.float64)
    >>> np.round(rotary(np.array([[[1.0, 0.0], [1.0, 0.0]]]), cos, sin), 4).tolist()
    [[[1.0, 0.0], [0.5403, 0.8415]]]
    """
    return _rotate(x, cos, sin, interleaved), lambda g, needs: (_rotate(g, cos, -sin, interleaved), None, None)
