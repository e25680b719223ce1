"""`NCCLBackend`: CuPy arrays through NCCL, everything else through MPI (see `backend`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import Backend

__all__ = ["NCCLBackend"]


class NCCLBackend(Backend):
    """CuPy arrays through NCCL (`cupy.cuda.nccl`), each rank on the GPU of its rank on the
    host; NumPy arrays and Python objects through MPI, which also carries NCCL's unique id.
    Reductions take NCCL's integer and floating dtypes; `bcast` takes any array, as bytes.

    Every NCCL call of the communicator goes on one stream of the backend's own, after the
    work queued on the current stream (an event), so that NCCL runs them in the order they
    were issued, the same on every rank (NCCL gives no order between one communicator's
    calls on different streams). A blocking collective then waits for that stream, so that
    `stats` time the transfer; ``start_allreduce(...).wait()`` makes the current stream wait
    for it (another event) without blocking the host: the backward pass queues its kernels
    while the buckets travel.
    """

    kind = "nccl"

    def __init__(self, comm: Any) -> None:
        super().__init__(comm)
        try:
            import cupy
            from cupy.cuda import nccl
        except ImportError as err:
            raise ImportError(f"initialize('nccl') needs CuPy with NCCL: pip install 'luxnn[cuda12]' ({err})") from err
        if not getattr(nccl, "available", True):
            raise RuntimeError("initialize('nccl'): CuPy finds no NCCL library (pip install nvidia-nccl-cu12)")
        count = cupy.cuda.runtime.getDeviceCount()
        if count == 0:
            raise RuntimeError("initialize('nccl'): no CUDA device on this host")
        # NCCL takes the current device for the communicator's: bind it before.
        self.device = cupy.cuda.Device(self.host_rank % count)
        self.device.use()
        _check_one_gpu_each(self.comm, cupy.cuda.runtime.deviceGetPCIBusId(self.device.id))
        self._cupy = cupy
        self._nccl_ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX, "min": nccl.NCCL_MIN}
        self._nccl_types = {
            np.dtype(name): getattr(nccl, f"NCCL_{name.upper()}")
            for name in ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
        }
        unique_id = nccl.get_unique_id() if self.rank == 0 else None  # a tuple of 128 ints
        self.nccl = nccl.NcclCommunicator(self.size, self.comm.bcast(unique_id, root=0), self.rank)
        self._stream = cupy.cuda.Stream(non_blocking=True)  # start_allreduce's, on this rank's GPU

    def check_reducible(self, what: str, a: Any) -> None:
        if not isinstance(a, np.ndarray) and a.dtype not in self._nccl_types:
            raise TypeError(f"{what}: {self._cannot_carry(a)}")

    def _cannot_carry(self, buf: Any) -> str:
        return f"the NCCL backend carries {sorted(str(t) for t in self._nccl_types)} arrays, got {buf.dtype}"

    def _datatype(self, buf: Any) -> int:
        datatype = self._nccl_types.get(buf.dtype)
        if datatype is None:
            raise TypeError(self._cannot_carry(buf))
        return datatype

    def _transport(self, name: str, buf: Any, op: str | None, root: int | None) -> None:
        if isinstance(buf, np.ndarray):
            self._mpi_collective(name, buf, op, root)
            return
        ptr, stream = buf.data.ptr, self._after_current_stream()
        if name == "bcast":  # a copy: as bytes, so that every dtype goes (bool, complex, ...)
            self.nccl.bcast(ptr, buf.nbytes, self._nccl_types[np.dtype(np.uint8)], root, stream)
        elif name == "allreduce":
            self.nccl.allReduce(ptr, ptr, buf.size, self._datatype(buf), self._nccl_ops[op], stream)
        else:  # reduce, in place: only the root's buffer is written
            self.nccl.reduce(ptr, ptr, buf.size, self._datatype(buf), self._nccl_ops[op], root, stream)

    def _after_current_stream(self) -> int:
        """The backend's stream, made to wait for the work queued so far on the current one
        (what wrote the buffers a collective is about to read)."""
        self._stream.wait_event(self._cupy.cuda.get_current_stream().record())
        return self._stream.ptr

    def _finish(self, buf: Any) -> None:
        if not isinstance(buf, np.ndarray):
            self._stream.synchronize()

    def _start(self, buf: Any, op: str) -> tuple[Any, Any]:
        if isinstance(buf, np.ndarray):
            return super()._start(buf, op)
        cuda = self._cupy.cuda
        stream = self._after_current_stream()
        self.nccl.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._datatype(buf), self._nccl_ops[op], stream)
        reduced = self._stream.record()
        return (lambda: reduced.done), (lambda: cuda.get_current_stream().wait_event(reduced))


def _check_one_gpu_each(comm: Any, bus_id: str) -> None:
    """A `RuntimeError` on every rank if two ranks of a host got one GPU (NCCL refuses it):
    more ranks on a host than GPUs visible to them."""
    from mpi4py import MPI  # loaded: the backend's communicator is MPI's

    where = comm.allgather((MPI.Get_processor_name(), bus_id))
    first: dict[tuple[str, str], int] = {}
    for rank, place in enumerate(where):
        if place in first:
            raise RuntimeError(
                f"initialize('nccl'): ranks {first[place]} and {rank} on host {place[0]} got the same GPU ({place[1]}); "
                f"NCCL needs a GPU per rank: start at most as many ranks per host as it has GPUs"
            )
        first[place] = rank
