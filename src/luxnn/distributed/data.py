"""`DistributedDataLoader`: each rank's share of every global batch.

Every rank holds the same data and draws the same order (from ``seed`` and the epoch, not
from a generator a rank could advance on its own); global batch k is the order's samples
``[k * B * R, (k + 1) * B * R)`` for a per-rank batch B and R ranks, and rank r takes its
r-th block of B. So the ranks' batches are disjoint, together they are the batch one
process would take with ``batch_size=B * R``, and every rank takes the same number of
steps: ranks with unequal step counts would wait forever in a collective the others never
enter, which is why ``drop_last=True`` is the default.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from .. import tree
from ..backend import take_rows
from .backend import Backend, check_backend, check_int

__all__ = ["DistributedDataLoader"]


class DistributedDataLoader:
    """Iterate over this rank's batches of `batch_size` samples of `data` (an array or a
    tree of arrays of one leading length, the same on every rank).

    With ``shuffle=True`` (the default) each epoch's order is a permutation drawn from
    ``numpy.random.default_rng((seed, epoch))``; the epoch counts ``iter(loader)`` calls
    from 0, or is set with `set_epoch`. ``drop_last=True`` leaves out the last global batch
    when it is short. With ``drop_last=False`` it is shared out as equal batches of
    ``ceil(rest / R)`` samples, the few missing ones taken from the start of the epoch's
    order (as PyTorch's DistributedSampler pads), so that the ranks still take equal steps.
    `device`, if given, is called on each batch. The ranks' settings are checked to agree
    (one small collective) when the loader is made.

    >>> loader = dist.DistributedDataLoader(backend, (x, y), 32, seed=0)  # doctest: +SKIP
    >>> for xb, yb in loader:  # doctest: +SKIP
    ...     grads, loss, stats, ts = lx.single_train_step_(lx.AutoTape(), loss_fn, (xb, yb), ts)
    """

    def __init__(self, backend: Backend, data: Any, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, device: Callable[[Any], Any] | None = None) -> None:
        self.backend = check_backend(backend, "DistributedDataLoader")
        self.num_samples = _num_samples(data)
        self.batch_size = check_int("DistributedDataLoader", "batch_size", batch_size, minimum=1)
        self.seed = check_int("DistributedDataLoader", "seed", seed, minimum=0)
        if device is not None and not callable(device):
            raise ValueError(f"DistributedDataLoader: device must be callable (it moves a batch), got {type(device).__name__}")
        self.data, self.shuffle, self.drop_last, self.device = data, bool(shuffle), bool(drop_last), device
        self.epoch = 0
        # Agreed first: the checks below depend on the settings alone, so that with equal
        # settings they raise on every rank or on none (one rank raising alone would leave
        # the others in this collective).
        settings = (self.num_samples, self.batch_size, self.shuffle, self.seed, self.drop_last)
        with self.backend.call("DistributedDataLoader"):
            everyone = self.backend.allgather_object(settings)
        if len(set(everyone)) > 1:
            names = ("samples", "batch_size", "shuffle", "seed", "drop_last")
            raise ValueError(
                "DistributedDataLoader: the ranks disagree on (" + ", ".join(names) + "): "
                + "; ".join(f"rank {r}: {s}" for r, s in enumerate(everyone))
            )
        ranks, per_step = self.backend.size, self.batch_size * self.backend.size
        if self.drop_last and per_step > self.num_samples:
            raise ValueError(
                f"DistributedDataLoader: drop_last=True with batch_size={batch_size} on {ranks} ranks "
                f"({per_step} samples a step) and {self.num_samples} samples would yield no batch"
            )
        if not self.drop_last and self.num_samples < ranks:
            raise ValueError(f"DistributedDataLoader: {self.num_samples} samples cannot be shared among {ranks} ranks")

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` epoch `epoch` (its order; later ones follow it)."""
        self.epoch = check_int("set_epoch", "epoch", epoch, minimum=0)

    def __len__(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size * self.backend.size)
        return full + (1 if rest and not self.drop_last else 0)

    def indices(self, epoch: int) -> list[np.ndarray]:
        """This rank's sample indices in epoch `epoch`, one array per batch."""
        n, ranks, rank, b = self.num_samples, self.backend.size, self.backend.rank, self.batch_size
        order = np.random.default_rng((self.seed, epoch)).permutation(n) if self.shuffle else np.arange(n)
        full = n // (b * ranks)
        out = [order[(k * ranks + rank) * b : (k * ranks + rank + 1) * b] for k in range(full)]
        rest = n - full * b * ranks
        if rest and not self.drop_last:
            share = -(-rest // ranks)
            tail = np.concatenate([order[full * b * ranks :], order[: share * ranks - rest]])
            out.append(tail[rank * share : (rank + 1) * share])
        return out

    def __iter__(self) -> Iterator[Any]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        for idx in self.indices(epoch):
            batch = tree.map(lambda a: take_rows(a, idx), self.data)
            yield self.device(batch) if self.device is not None else batch

    def __repr__(self) -> str:
        return (
            f"DistributedDataLoader(num_samples={self.num_samples}, batch_size={self.batch_size}, ranks={self.backend.size}, "
            f"shuffle={self.shuffle}, drop_last={self.drop_last}, batches={len(self)})"
        )


def _num_samples(data: Any) -> int:
    lengths = set()
    for path, leaf in tree.paths(data):
        shape = getattr(leaf, "shape", None)
        if not shape:
            what = f"data '{path}'" if path else "data"
            got = f"a {type(leaf).__name__}" if shape is None else "a 0-d array"
            raise ValueError(f"DistributedDataLoader: {what} must be an array with a leading sample axis, got {got}")
        lengths.add(shape[0])
    if len(lengths) != 1:
        raise ValueError(f"DistributedDataLoader: expected arrays of one leading length, got lengths {sorted(lengths)}")
    (n,) = lengths
    if n == 0:
        raise ValueError("DistributedDataLoader: expected at least one sample, got arrays of leading length 0")
    return n
