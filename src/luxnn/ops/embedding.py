"""Row lookup (embedding tables) with a scatter-add VJP. Each device has its kernels
(`luxnn.ops.cpu.embedding`, `luxnn.ops.cuda.embedding`)."""

from __future__ import annotations

from typing import Any

import numpy as np  # noqa: F401  (the docstrings' examples)

from ..ad.tape import primitive
from .traits import Area

__all__ = ["lookup_rows", "scatter_add_rows"]

_EMBEDDING = Area("embedding")


def scatter_add_rows(g: Any, indices: Any, num_rows: int) -> Any:
    """``out[indices[i]] += g[i]`` for a 1-D integer `indices` and a 2-D `g`; repeated
    indices accumulate. ``np.add.at`` does this too, but 3-30x slower on NumPy.

    >>> scatter_add_rows(np.ones((3, 2)), np.array([1, 1, 0]), 3).tolist()
    [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]
    """
    return _EMBEDDING[type(g)].scatter_add_rows(g, indices, num_rows)


@primitive
def lookup_rows(table, indices, owner="lookup_rows", error=IndexError):
    """``table[indices]`` for a 2-D `table` ``(rows, dim)`` and integer `indices` of any
    shape: output ``(*indices.shape, dim)``. The table's gradient sums the cotangents of
    repeated indices. An index outside ``[0, rows)`` raises `error` (its message starting
    with `owner`); on a CUDA device at the next call, the rows of the call itself NaN
    (`luxnn.ops.cuda.embedding`: no host synchronisation).

    >>> lookup_rows(np.arange(6.0).reshape(3, 2), np.array([[2, 0]])).tolist()
    [[[4.0, 5.0], [0.0, 1.0]]]
    """
    return _EMBEDDING[type(table)].lookup_rows(table, indices, owner, error)
