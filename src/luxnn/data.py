"""Mini-batches over in-memory arrays.

>>> import numpy as np
>>> from luxnn.data import DataLoader
>>> x, y = np.zeros((10, 3)), np.arange(10)
>>> loader = DataLoader((x, y), batch_size=4, shuffle=True, rng=np.random.default_rng(0))
>>> len(loader)
3
>>> [xb.shape for xb, yb in loader]
[(4, 3), (4, 3), (2, 3)]
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator

import numpy as np

from luxnn import tree
from luxnn.backend import take_rows

__all__ = ["DataLoader"]


def _leading_length(path: str, leaf: Any) -> int:
    shape = getattr(leaf, "shape", None)
    name = f"data '{path}'" if path else "data"
    if shape is None:
        raise ValueError(f"DataLoader: {name} must be an array, got {type(leaf).__name__}")
    if len(shape) == 0:
        raise ValueError(f"DataLoader: {name} must have a leading sample axis, got a 0-d array")
    return shape[0]


def _num_samples(data: Any) -> int:
    """The common leading length of the arrays of `data`, or a ValueError naming them."""
    lengths = {path: _leading_length(path, leaf) for path, leaf in tree.paths(data)}
    if not lengths:
        raise ValueError(f"DataLoader: expected an array or a tuple/dict of arrays, got an empty {type(data).__name__}")
    distinct = set(lengths.values())
    if len(distinct) > 1:
        listed = ", ".join(f"'{path}': {n}" for path, n in lengths.items())
        raise ValueError(f"DataLoader: all arrays must have the same leading length, got {listed}")
    (n,) = distinct
    if n == 0:
        raise ValueError("DataLoader: expected at least one sample, got arrays of leading length 0")
    return n


class DataLoader:
    """Iterate over `data` in batches of `batch_size` samples along the leading axis.

    `data` is an array or a tree (tuple, list, dict, nested) of arrays of one leading
    length; each batch has the same structure. Without shuffling, batches are views of
    `data` (slices, no copy); with ``shuffle=True`` they are gathered copies, in an order
    drawn from `rng` (a ``numpy.random.Generator``) afresh at the start of every epoch,
    i.e. every ``iter(loader)``. `device`, if given, is called on each batch (e.g. a luxnn
    device, which moves a whole tree). ``len(loader)`` is the number of batches; with
    ``drop_last=True`` a last short batch is left out.

    >>> import numpy as np
    >>> loader = DataLoader({"x": np.arange(5)}, batch_size=2)
    >>> [batch["x"].tolist() for batch in loader]
    [[0, 1], [2, 3], [4]]
    """

    def __init__(self, data: Any, batch_size: int, *, shuffle: bool = False, drop_last: bool = False,
                 rng: np.random.Generator | None = None, device: Callable[[Any], Any] | None = None) -> None:
        self.num_samples = _num_samples(data)
        if isinstance(batch_size, bool):
            raise ValueError(f"DataLoader: batch_size must be an integer >= 1, got {batch_size!r}")
        try:
            batch_size = operator.index(batch_size)
        except TypeError:
            raise ValueError(f"DataLoader: batch_size must be an integer >= 1, got {batch_size!r}") from None
        if batch_size < 1:
            raise ValueError(f"DataLoader: batch_size must be an integer >= 1, got {batch_size}")
        if drop_last and batch_size > self.num_samples:
            raise ValueError(
                f"DataLoader: drop_last=True with batch_size={batch_size} larger than the "
                f"{self.num_samples} samples would yield no batch"
            )
        if rng is not None and not isinstance(rng, np.random.Generator):
            raise ValueError(f"DataLoader: rng must be a numpy.random.Generator, got {type(rng).__name__}")
        if device is not None and not callable(device):
            raise ValueError(f"DataLoader: device must be callable (it moves a batch), got {type(device).__name__}")
        self.data = data
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.rng = rng if rng is not None else np.random.default_rng()
        self.device = device

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[Any]:
        order = self.rng.permutation(self.num_samples) if self.shuffle else None
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            stop = min(start + self.batch_size, self.num_samples)
            if order is None:
                batch = tree.map(lambda a: a[start:stop], self.data)
            else:
                indices = order[start:stop]
                batch = tree.map(lambda a: take_rows(a, indices), self.data)
            yield self.device(batch) if self.device is not None else batch

    def __repr__(self) -> str:
        return (
            f"DataLoader(num_samples={self.num_samples}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, batches={len(self)})"
        )
