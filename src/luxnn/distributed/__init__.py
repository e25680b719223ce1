"""Data-parallel training over MPI (mpi4py) and NCCL (CuPy), with Lux.jl's
DistributedUtils verbs: one process per rank, each with a full replica of the model and its
share of every batch; gradients are averaged over the ranks before the optimizer runs.

Run a script with ``mpiexec -n 4 python -m mpi4py train.py`` (``-m mpi4py`` makes a rank
that raises abort the whole job instead of leaving the others waiting)::

    import luxnn as lx
    from luxnn import distributed as dist

    backend = dist.initialize("mpi")            # or "nccl" for CuPy arrays
    ps, st = dist.synchronize(backend, lx.setup(rng, model))   # rank 0's initial values everywhere
    opt = dist.DistributedOptimizer(backend, lx.optim.adam(1e-3))
    ts = lx.TrainState(model, ps, st, opt)
    loader = dist.DistributedDataLoader(backend, (x, y), batch_size=32, seed=0)
    for xb, yb in loader:
        grads, loss, stats, ts = lx.single_train_step_(lx.AutoTape(), loss_fn, (xb, yb), ts)
    dist.save(backend, "ckpt.safetensors", ts)   # rank 0 writes; every rank can lx.load it

- `backend`: `initialize`, `local_rank`, `total_workers`, the backends (`nccl`: NCCL's) and their
  `CollectiveStats` (``backend.stats``: calls, bytes, seconds in collectives), `Pending`
  (a collective in flight, from ``backend.start_allreduce``), `CallMismatch` (ranks in
  different calls: every call begins with the ranks' agreement, ``backend.call``);
- `collectives`: `bcast_`, `allreduce_`, `reduce_` on trees of arrays, `synchronize`;
- `optimizer`: `DistributedOptimizer` and its `GradientBuckets`; with ``overlap=True``
  the buckets' allreduces run during the backward pass (a `ListeningTransformation`);
- `data`: `DistributedDataLoader`; `checkpoint`: `save` (every rank calls it);
- `norm`: batch statistics over the ranks, for `luxnn.BatchNorm` (``sync=True``), inside
  the data-parallel step in progress (`step`, opened by `DistributedOptimizer`);
- `launch`: the ``mpiexec`` of mpi4py's MPI library, and ``luxnn demo --workers N``.

luxnn imports without mpi4py; `initialize` then raises an error naming ``luxnn[mpi]``.

>>> from luxnn import distributed as dist
>>> dist.is_initialized()
False
"""

from .backend import (
    OPS, Backend, CallMismatch, CollectiveStats, MPIBackend, Pending, current, initialize, is_initialized, local_rank,
    total_workers,
)  # fmt: skip
from .checkpoint import save
from .nccl import NCCLBackend
from .collectives import allreduce_, bcast_, reduce_, synchronize
from .data import DistributedDataLoader
from .optimizer import DEFAULT_BUCKET_BYTES, DistributedOptimizer, GradientBuckets, ListeningTransformation

__all__ = [
    "initialize", "is_initialized", "local_rank", "total_workers", "bcast_", "allreduce_", "reduce_",
    "synchronize", "DistributedOptimizer", "GradientBuckets", "ListeningTransformation", "DistributedDataLoader",
    "save", "Backend", "MPIBackend", "NCCLBackend", "CollectiveStats", "Pending", "CallMismatch", "current", "OPS",
    "DEFAULT_BUCKET_BYTES",
]  # fmt: skip
