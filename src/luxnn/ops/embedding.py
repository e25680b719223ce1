"""Row lookup (embedding tables) with a scatter-add VJP faster than ``np.add.at``."""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of

__all__ = ["lookup_rows", "scatter_add_rows"]

# Up to this many rows, the one-hot GEMM (rows x n FLOPs per column) beats sorting;
# measured with 4096 indices and 256 columns: 0.3 ms vs 2.9 ms at 16 rows, even at ~200.
_ONE_HOT_MAX_ROWS = 128


def scatter_add_rows(g: Any, indices: Any, num_rows: int) -> Any:
    """``out[indices[i]] += g[i]`` for a 1-D integer `indices` and a 2-D `g`; repeated
    indices accumulate. ``np.add.at`` does this too, but 3-30x slower on NumPy.

    >>> scatter_add_rows(np.ones((3, 2)), np.array([1, 1, 0]), 3).tolist()
    [[1.0, 1.0], [2.0, 2.0], [0.0, 0.0]]
    """
    xp = module_of(g)
    if xp is not np:
        out = xp.zeros((num_rows, g.shape[1]), g.dtype)
        xp.add.at(out, indices, g)  # CuPy's add.at is an atomic scatter kernel
        return out
    if num_rows <= _ONE_HOT_MAX_ROWS:
        one_hot = np.zeros((num_rows, len(indices)), g.dtype)
        one_hot[indices, np.arange(len(indices))] = 1
        return one_hot @ g
    order = np.argsort(indices, kind="stable")
    sorted_indices = indices[order]
    starts = np.flatnonzero(np.concatenate(([True], sorted_indices[1:] != sorted_indices[:-1])))
    out = np.zeros((num_rows, g.shape[1]), g.dtype)
    out[sorted_indices[starts]] = np.add.reduceat(g[order], starts, axis=0)
    return out


@primitive
def lookup_rows(table, indices):
    """``table[indices]`` for a 2-D `table` ``(rows, dim)`` and integer `indices` of any
    shape: output ``(*indices.shape, dim)``. The table's gradient sums the cotangents of
    repeated indices.

    >>> lookup_rows(np.arange(6.0).reshape(3, 2), np.array([[2, 0]])).tolist()
    [[[4.0, 5.0], [0.0, 1.0]]]
    """
    rows, dim = table.shape

    def vjp(g, needs):
        if not needs[0]:
            return None, None
        return scatter_add_rows(g.reshape(-1, dim), indices.reshape(-1), rows), None

    return table[indices], vjp
