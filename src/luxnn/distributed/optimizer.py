"""`DistributedOptimizer`: gradients averaged over the ranks in flat buckets, then the
inner optimizer.

One collective per parameter array (what Lux's DistributedOptimizer does) pays a
collective's latency per array; a few large messages pay it a few times and run at the
transport's bandwidth. So the gradients are copied into flat buffers, one run of buffers
per dtype, each at most `bucket_bytes` (an array larger than that gets a buffer of its
own), made once for a layout of gradients and kept; each buffer is summed over the ranks in
place; the average is unpacked into fresh arrays (the division by the number of ranks and
the copy are one pass), and the inner transformation gets those. Every rank then holds the
same averaged gradients, so the same updates, and replicas started equal stay bit-identical.
"""

from __future__ import annotations

from typing import Any

from .. import memory, optim, tree
from ..backend import is_array, module_of
from .backend import Backend, check_backend, check_int
from .collectives import check_same_layout

__all__ = ["DistributedOptimizer", "GradientBuckets", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb


def _check_one_device(what: str, x: Any, name: str) -> None:
    from ..devices import get_device

    try:
        get_device(x)
    except ValueError as err:
        raise ValueError(f"{what}: the {name} must all be on one device, found {err}") from None


class GradientBuckets:
    """Flat buffers that carry a tree of arrays through an allreduce: `average(x)` returns
    the mean of `x` over the ranks as new arrays, in `x`'s structure.

    The buffers are made (outside any allocator cache) on the first call and again only
    when the layout (structure, dtypes, shapes, devices) changes; a new layout is checked
    to be every rank's (one small collective) before any buffer travels.
    `pack`, `allreduce` and `unpack` are its three passes.

    >>> buckets = GradientBuckets(backend, bucket_bytes=1 << 20)  # doctest: +SKIP
    >>> buckets.average({"w": np.full(3, float(dist.local_rank(backend)))})  # doctest: +SKIP
    {'w': array([0.5, 0.5, 0.5])}
    """

    def __init__(self, backend: Backend, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.backend = check_backend(backend, "GradientBuckets")
        self.bucket_bytes = check_int("GradientBuckets", "bucket_bytes", bucket_bytes, minimum=1)
        self.buffers: list[Any] = []  # the flat buffers, in the order they are reduced
        self._key: Any = None
        self._views: list[Any] = []  # leaf i's place in its buffer, shaped as leaf i

    def average(self, x: Any) -> Any:
        leaves, structure = tree.flatten(x)
        self.pack(leaves, structure)
        self.allreduce()
        return tree.unflatten(structure, self.unpack())

    def pack(self, leaves: list[Any], structure: tree.Structure) -> None:
        """Copy `leaves` (a flattened tree, with its `structure`) into the buffers."""
        key = (structure, tuple((a.dtype, a.shape, a.device) if is_array(a) else type(a) for a in leaves))
        if key != self._key:
            self._build(tree.unflatten(structure, leaves), key)
        for view, leaf in zip(self._views, leaves):
            view[...] = leaf

    def allreduce(self) -> None:
        """Sum every buffer over the ranks, in place."""
        for buffer in self.buffers:
            self.backend.allreduce(buffer, "sum")

    def unpack(self) -> list[Any]:
        """The leaves' averages over the ranks, as new arrays."""
        size = self.backend.size
        return [module_of(view).divide(view, size) for view in self._views]

    def _build(self, x: Any, key: Any) -> None:
        for path, leaf in tree.paths(x):
            if not is_array(leaf):
                where = f"'{path}'" if path else "the top of the tree"
                raise TypeError(f"DistributedOptimizer: expected gradients as NumPy or CuPy arrays, got {type(leaf).__name__} at {where}")
        _check_one_device("DistributedOptimizer", x, "gradients")
        check_same_layout(self.backend, "DistributedOptimizer", x)
        leaves = tree.leaves(x)
        runs: dict[Any, list[list[int]]] = {}  # dtype -> buckets of leaf indices
        for i, leaf in enumerate(leaves):
            buckets = runs.setdefault(leaf.dtype, [[]])
            used = sum(leaves[j].nbytes for j in buckets[-1])
            if buckets[-1] and used + leaf.nbytes > self.bucket_bytes:
                buckets.append([])
            buckets[-1].append(i)
        buffers, views = [], [None] * len(leaves)
        with memory.uncached():  # kept for as long as the layout lasts, no part of a step
            for dtype, buckets in runs.items():
                for members in buckets:
                    xp = module_of(leaves[members[0]])
                    buffer = xp.empty(sum(leaves[j].size for j in members), dtype)
                    offset = 0
                    for j in members:
                        views[j] = buffer[offset : offset + leaves[j].size].reshape(leaves[j].shape)
                        offset += leaves[j].size
                    buffers.append(buffer)
        self.buffers, self._views, self._key = buffers, views, key


def DistributedOptimizer(backend: Backend, optimizer: optim.GradientTransformation, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> optim.GradientTransformation:  # noqa: N802 - Lux's name
    """`optimizer` on the gradients averaged over the ranks (in buckets of at most
    `bucket_bytes`, see `GradientBuckets`): a `GradientTransformation` whose state is
    `optimizer`'s own, so a `TrainState` takes it as it is. Parameters and gradients must
    each be on one device.

    >>> opt = dist.DistributedOptimizer(backend, lx.optim.adam(1e-3))  # doctest: +SKIP
    >>> ts = lx.TrainState(model, ps, st, opt)  # doctest: +SKIP
    """
    backend = check_backend(backend, "DistributedOptimizer")
    if not isinstance(optimizer, optim.GradientTransformation):
        raise TypeError(f"DistributedOptimizer: expected an optimizer (luxnn.optim.GradientTransformation), got {type(optimizer).__name__}")
    buckets = GradientBuckets(backend, bucket_bytes)

    def init(params: Any) -> Any:
        _check_one_device("DistributedOptimizer", params, "parameters")
        return optimizer.init(params)

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return optimizer.update(buckets.average(grads), state, params)

    return optim.GradientTransformation(init, update)
