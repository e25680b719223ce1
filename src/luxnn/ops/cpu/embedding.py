"""Row lookup on the CPU (NumPy arrays): the indices checked on the host, a scatter-add
VJP faster than ``np.add.at``."""

from __future__ import annotations

import numpy as np

__all__ = ["lookup_rows", "scatter_add_rows"]

# Up to this many rows, the one-hot GEMM (rows x n FLOPs per column) beats sorting;
# measured with 4096 indices and 256 columns: 0.3 ms vs 2.9 ms at 16 rows, even at ~200.
_ONE_HOT_MAX_ROWS = 128


def scatter_add_rows(g, indices, num_rows):
    """``out[indices[i]] += g[i]``: a one-hot product for few rows, else sorted sums."""
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


def lookup_rows(table, indices, owner, error):
    """``table[indices]`` after checking the indices on the host (`error` if out of range)."""
    rows, dim = table.shape
    if indices.size:
        low, high = int(indices.min()), int(indices.max())
        if low < 0 or high >= rows:
            raise error(f"{owner}: expected indices in [0, {rows}), got indices from {low} to {high}")

    def vjp(g, needs):
        if not needs[0]:
            return None, None
        return scatter_add_rows(g.reshape(-1, dim), indices.reshape(-1), rows), None

    return table[indices], vjp
