"""Backends: who the ranks are and how an array travels between them.

`initialize` makes the process's one backend: ``"mpi"`` (mpi4py; NumPy arrays in place,
CuPy arrays staged through the host) or ``"nccl"`` (CuPy arrays through NCCL on the
current stream, NumPy arrays still through MPI, which also carries NCCL's id and every
Python object). A backend's methods move one array each; the tree-level verbs in
`luxnn.distributed` are written on top of them.

Every call of the library is checked: before it moves anything, the ranks agree in one
small allreduce that they are all in the same call, moving arrays of the same layout
(their number, dtypes and sizes, the op and root: `Backend.call`). Ranks that are not
(one rank's step raised and its loop went on, one rank saves alone, one rank ended its
program) get a `CallMismatch` on every rank, naming each rank's call, instead of a
collective that averages another call's data or waits forever; the backend is then
unusable, every later call raising the same error. The library's messages travel on a
communicator of its own (a duplicate of the world's), so they never match the user's.

mpi4py is imported on `initialize` only, so luxnn imports without it.
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from typing import Any, Collection, Iterator

import numpy as np

from .. import parallel
from ..backend import is_array
from ..optim.arrays import overwritten

__all__ = [
    "Backend", "MPIBackend", "CollectiveStats", "Pending", "CallMismatch", "OPS", "initialize", "describe",
    "is_initialized", "current", "local_rank", "total_workers", "check_backend", "check_root", "check_int",
]  # fmt: skip

OPS = ("sum", "avg", "max", "min")
KINDS = ("mpi", "nccl")
# Set by a user (or a launcher) who chose the BLAS's threads: initialize leaves them alone.
_BLAS_THREAD_VARIABLES = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
_INSTALL_HINT = "pip install 'luxnn[mpi]' (mpi4py and the MPICH library with its mpiexec)"

_current: Backend | None = None
# The call a rank is in when its program ends (`Backend.call`): the others' calls cannot
# complete any more, so meeting it in another call is an error on every rank.
PROGRAM_END = "the end of its program"


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as err:
        raise ImportError(f"luxnn.distributed needs mpi4py and an MPI library: {_INSTALL_HINT}") from err
    return MPI


@dataclass
class CollectiveStats:
    """What a backend's array collectives did since the last `reset`: calls, bytes of the
    arrays they carried, and seconds spent in them (waiting for the slowest rank included)
    and in the small agreement that begins each of the library's calls (`Backend.call`:
    counted in seconds, not in calls or bytes), where a rank mostly waits for the others."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds = 0, 0, 0.0


class CallMismatch(RuntimeError):
    """The ranks are in different calls of luxnn.distributed (`Backend.call`): raised on
    every rank, with `calls`, each rank's call by rank."""

    def __init__(self, message: str, calls: list[str]) -> None:
        super().__init__(message)
        self.calls = calls


class Pending:
    """A collective in flight (`Backend.start_allreduce`). `wait()` returns once its result
    is in the array (later calls return at once); call it even after `test()` said True,
    as it also completes the result (the division of ``"avg"``, the copy back of a CuPy
    array staged through the host). `test()` says whether the transfer has finished,
    without blocking, and under MPI also lets it progress (MPICH moves a non-blocking
    collective on only inside MPI calls). Both count towards the backend's `stats`."""

    __slots__ = ("_test", "_wait", "_stats", "finished")

    def __init__(self, test: Any, wait: Any, stats: CollectiveStats) -> None:
        self._test, self._wait, self._stats = test, wait, stats
        self.finished = False

    def test(self) -> bool:
        if not self.finished:
            t0 = time.perf_counter()
            self.finished = bool(self._test())
            self._stats.seconds += time.perf_counter() - t0
        return self.finished

    def wait(self) -> None:
        if self._wait is not None:
            t0 = time.perf_counter()
            self._wait()
            self._wait, self.finished = None, True
            self._stats.seconds += time.perf_counter() - t0


class Backend:
    """The ranks of an MPI communicator and their collectives.

    Attributes: `kind` ("mpi" or "nccl"), `rank` and `size` in the world, `host_rank` and
    `ranks_on_host` among the ranks sharing this machine, `cores` (the CPUs this rank may
    use, its share of those it shares with other ranks), `stats` (`CollectiveStats`),
    `comm` (the library's own duplicate of the communicator it was made from).

    Each public method is a call of its own (`call`), except `start_allreduce`, which
    belongs to the call that starts it (a `GradientBuckets` round).
    """

    kind = ""

    def __init__(self, comm: Any) -> None:
        MPI = _mpi()
        self.comm = comm.Dup()  # no message of the user's own (or of another library) matches one of ours
        self._depth = 0  # calls open on this rank: only the outermost one agrees
        self._broken: str | None = None  # why no call can complete any more
        self._open: set[Any] = set()  # what `hold_open` holds
        self._min = MPI.MIN
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        host = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.host_rank, self.ranks_on_host = host.Get_rank(), host.Get_size()
        # A launcher that pins ranks (mpiexec -bind-to core) gives each its own CPUs; one
        # that does not gives all of them the same set, which they then share.
        mine = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else frozenset(range(os.cpu_count() or 1))
        sharing = sum(cpus == mine for cpus in host.allgather(mine))
        host.Free()
        self.cores = max(1, len(mine) // sharing)
        self.stats = CollectiveStats()
        self._ops = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
        self._in_place = MPI.IN_PLACE

    # ---- calls: every rank in the same one ----------------------------------------------------

    @contextlib.contextmanager
    def call(self, name: str, compatible: Collection[str] = (), layout: str = "") -> Iterator[list[str] | None]:
        """A call of the library named `name`, moving arrays laid out as `layout` (what
        must be the same on every rank: the number of collectives, their dtypes, sizes,
        ops, roots): on entering the outermost one, every rank checks that every other is
        in the same call (`agree`); calls inside it check nothing more. Yields None, or
        the ranks' calls where some rank is in one of `compatible` instead (the caller
        decides what that means).

        >>> with backend.call("my step", layout="float64[3], int64[1]"):  # doctest: +SKIP
        ...     backend.allreduce(a)
        ...     backend.bcast(b)
        """
        calls = self.agree(name, compatible, layout) if self._depth == 0 else None
        self._depth += 1
        try:
            yield calls
        finally:
            self._depth -= 1

    def agree(self, name: str, compatible: Collection[str] = (), layout: str = "") -> list[str] | None:
        """One small allreduce in which every rank compares its call `name` and its
        `layout` with the others'. None if they all agree; the ranks' calls by rank if
        some differ but each is `name` (of the same layout) or in `compatible`; otherwise
        `CallMismatch` on every rank, naming each rank's call (and layout where two ranks
        in one call differ in it), after which every call of this backend raises it at
        once (the ranks can no longer tell which of their collectives belong together)."""
        if self._broken is not None:
            raise CallMismatch(self._broken, [])
        code = zlib.crc32(f"{name}\0{layout}".encode())
        check = np.array([code, -code], np.int64)
        t0 = time.perf_counter()
        self.comm.Allreduce(self._in_place, check, op=self._min)
        self.stats.seconds += time.perf_counter() - t0
        if check[0] == -check[1]:
            return None
        gathered = self.comm.allgather((name, layout))  # every rank is here: the check's result is shared
        calls = [c for c, _ in gathered]
        if all((c, l) == (name, layout) or c in compatible for c, l in gathered):
            return calls
        where = ", ".join(f"rank {r} in {c}" + (f" ({_clip(l)})" if calls.count(c) > gathered.count((c, l)) else "")
                          for r, (c, l) in enumerate(gathered))
        self._broken = (
            f"luxnn.distributed: the ranks are in different calls: {where}; every rank must make the same calls of "
            f"luxnn.distributed in the same order, with arrays of the same dtypes and sizes (a rank whose step raised "
            f"and went on, that saved alone or took an extra step falls out of step). No collective can be trusted "
            f"now: every later call raises this error"
        )
        raise CallMismatch(self._broken, calls)

    def hold_open(self, opened: Any) -> None:
        """Keep `opened` alive until `release`: an object whose collectives are in flight in
        a call not ended (a `GradientBuckets` round, whose buffers they write). If this
        rank's program ends first, ``opened.discard()`` ends them before its last call, as
        the other ranks' end, so that the others then meet that last call."""
        self._open.add(opened)

    def release(self, opened: Any) -> None:
        """`opened`'s collectives have ended (see `hold_open`)."""
        self._open.discard(opened)

    # ---- one array, in place ----------------------------------------------------------------

    def allreduce(self, a: Any, op: str = "sum") -> None:
        """Reduce `a` (a NumPy or CuPy array) over the ranks with `op`; every rank gets the result."""
        _check_writeable("allreduce", a)
        overwritten((a,))  # a step count's host value (optim.arrays.host_count), for one
        with self.call("allreduce", layout=describe([a], op)):
            self._collective("allreduce", a, op, None)

    def reduce(self, a: Any, op: str = "sum", root: int = 0) -> None:
        """Reduce `a` over the ranks into `root`'s `a`; the other ranks' arrays are unchanged."""
        _check_writeable("reduce", a)
        overwritten((a,))  # a step count's host value (optim.arrays.host_count), for one
        with self.call("reduce", layout=describe([a], op, root)):
            self._collective("reduce", a, op, root)

    def bcast(self, a: Any, root: int = 0) -> None:
        """Overwrite `a` on every rank with `root`'s `a`."""
        _check_writeable("bcast", a)
        overwritten((a,))  # a step count's host value (optim.arrays.host_count), for one
        with self.call("bcast", layout=describe([a], root=root)):
            self._collective("bcast", a, None, root)

    def start_allreduce(self, a: Any, op: str = "sum") -> Pending:
        """Begin reducing `a` (a C-contiguous NumPy or CuPy array, left alone until the wait)
        over the ranks with `op`, without waiting for it: the returned `Pending`'s ``wait()``
        finishes it. Every rank must start the same collectives in the same order: this
        one is no call of its own, but part of the call that starts it, checked there."""
        if op not in OPS:
            raise ValueError(f"start_allreduce: expected op in {OPS}, got {op!r}")
        _check_writeable("start_allreduce", a)
        if not a.flags.c_contiguous:
            raise ValueError("start_allreduce: expected a C-contiguous array (it is reduced in place, later)")
        if op == "avg" and not np.issubdtype(a.dtype, np.inexact):
            raise TypeError(f"start_allreduce: op='avg' needs a floating-point array, got {a.dtype}")
        t0 = time.perf_counter()
        test, wait = self._start(a, op)
        if op == "avg":
            wait = _then_divide(wait, a, self.size)
        self.stats.calls += 1
        self.stats.bytes += a.nbytes
        self.stats.seconds += time.perf_counter() - t0
        return Pending(test, wait, self.stats)

    def _start(self, buf: Any, op: str) -> tuple[Any, Any]:
        """Start an allreduce of `buf` in place: ``(test, wait)`` callables."""
        if isinstance(buf, np.ndarray):
            request = self.comm.Iallreduce(self._in_place, buf, op=self._ops[op])
            return request.Test, request.Wait
        host = buf.get()  # a CuPy array: through the host, as `_transport`
        request = self.comm.Iallreduce(self._in_place, host, op=self._ops[op])

        def wait() -> None:
            request.Wait()
            buf.set(host)

        return request.Test, wait

    def _collective(self, name: str, a: Any, op: str | None, root: int | None) -> None:
        t0 = time.perf_counter()
        buf = a if a.flags.c_contiguous else a.copy()
        self._transport(name, buf, op, root)
        if op == "avg" and (name == "allreduce" or self.rank == root):
            buf /= self.size
        if buf is not a:
            a[...] = buf
        self._finish(buf)
        self.stats.calls += 1
        self.stats.bytes += a.nbytes
        self.stats.seconds += time.perf_counter() - t0

    def _transport(self, name: str, buf: Any, op: str | None, root: int | None) -> None:
        if isinstance(buf, np.ndarray):
            self._mpi_collective(name, buf, op, root)
        else:  # a CuPy array: MPI from pip is not CUDA-aware, so through the host
            host = buf.get()
            self._mpi_collective(name, host, op, root)
            buf.set(host)

    def _mpi_collective(self, name: str, buf: np.ndarray, op: str | None, root: int | None) -> None:
        if name == "allreduce":
            self.comm.Allreduce(self._in_place, buf, op=self._ops[op])
        elif name == "reduce":
            send, receive = (self._in_place, buf) if self.rank == root else (buf, None)
            self.comm.Reduce(send, receive, op=self._ops[op], root=root)
        else:
            self.comm.Bcast(buf, root=root)

    def _finish(self, buf: Any) -> None:
        """Wait for `buf`'s collective where it runs asynchronously (NCCL), so that the
        stats time the transfer and not its launch."""

    def check_reducible(self, what: str, a: Any) -> None:
        """A `TypeError` naming `what` if this backend cannot reduce array `a`'s dtype."""

    # ---- Python objects (pickled; small) ------------------------------------------------------

    def bcast_object(self, obj: Any, root: int = 0) -> Any:
        """`root`'s `obj` on every rank."""
        with self.call("bcast_object"):
            return self.comm.bcast(obj, root=root)

    def allgather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, by rank."""
        with self.call("allgather_object"):
            return self.comm.allgather(obj)

    def barrier(self) -> None:
        with self.call("barrier"):
            self.comm.Barrier()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"


class MPIBackend(Backend):
    """Collectives over MPI (mpi4py): NumPy arrays in place, CuPy arrays through the host."""

    kind = "mpi"


def describe(arrays: list[Any], op: str | None = None, root: int | None = None) -> str:
    """What the ranks of a call moving `arrays` (with `op`, to or from `root`) must agree
    on, in words: ``"op sum, 2 arrays: float64[3], float32[2]"`` (dtypes and sizes)."""
    head = [f"op {op}"] if op else []
    head += [f"root {root}"] if root is not None else []
    head.append(f"{len(arrays)} array{'s' * (len(arrays) != 1)}")
    return ", ".join(head) + ": " + ", ".join(f"{a.dtype}[{a.size}]" for a in arrays)


def _clip(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _check_writeable(what: str, a: Any) -> None:
    """A `TypeError` unless `a` is a NumPy or CuPy array, a `ValueError` if it is read-only:
    before any rank's collective starts, rather than after, on writing the result back."""
    if not is_array(a):
        raise TypeError(f"{what}: expected a NumPy or CuPy array, got {type(a).__name__}")
    if isinstance(a, np.ndarray) and not a.flags.writeable:
        raise ValueError(f"{what}: the array is read-only, and {what} writes into it")


def _then_divide(wait: Any, a: Any, size: int) -> Any:
    def finish() -> None:
        wait()
        a[...] /= size

    return finish


# ---- the process's backend --------------------------------------------------------------------


def initialize(kind: str = "mpi") -> Backend:
    """Start data parallelism over MPI (``"mpi"``) or NCCL (``"nccl"``, CuPy arrays) and
    return the backend; calling it again with the same kind returns the same backend.

    It shares this host's cores among the ranks on it: luxnn's kernel threads
    (`luxnn.set_num_threads`) unless they were set already, and the BLAS's threads
    (threadpoolctl) unless ``OMP_NUM_THREADS``, ``OPENBLAS_NUM_THREADS`` or
    ``MKL_NUM_THREADS`` is set. ``"nccl"`` binds each rank to the GPU of its rank on the host
    (a `RuntimeError` on every rank if two ranks of a host get the same GPU).

    >>> from luxnn import distributed as dist
    >>> backend = dist.initialize("mpi")  # doctest: +SKIP
    >>> dist.local_rank(backend), dist.total_workers(backend)  # doctest: +SKIP
    (0, 2)
    """
    global _current
    if kind not in KINDS:
        raise ValueError(f"initialize: expected a backend kind in {KINDS}, got {kind!r}")
    if _current is not None:
        if _current.kind != kind:
            raise RuntimeError(
                f"initialize: luxnn.distributed is already initialized with {_current.kind!r}, asked for {kind!r}; "
                f"a process has one backend"
            )
        return _current
    MPI = _mpi()
    if kind == "mpi":
        backend: Backend = MPIBackend(MPI.COMM_WORLD)
    else:
        from .nccl import NCCLBackend

        backend = NCCLBackend(MPI.COMM_WORLD)
    _share_cores(backend.cores)
    _current = backend
    atexit.register(_at_exit, backend)  # runs before mpi4py's MPI_Finalize (registered earlier, run later)
    return backend


def _at_exit(backend: Backend) -> None:
    """A rank's program ends: its last call, which the others meet in theirs (if they are
    still in any), so that they raise instead of waiting for this rank forever. Not when
    an exception ends it: ``python -m mpi4py`` then aborts the job."""
    if backend._broken is not None or backend.size == 1 or getattr(sys, "last_value", None) is not None:
        return
    try:
        for opened in list(backend._open):
            opened.discard()
        backend.agree(PROGRAM_END)
    except CallMismatch as err:
        sys.stderr.write(f"rank {backend.rank}: {err}\n")
        sys.stderr.flush()


def _share_cores(cores: int) -> None:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if parallel.num_threads() == usable:  # still luxnn's default: nobody chose
        parallel.set_num_threads(cores)
    if any(name in os.environ for name in _BLAS_THREAD_VARIABLES):
        return
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:
        warnings.warn(
            f"luxnn.distributed: threadpoolctl is not installed, so the BLAS keeps its threads; with several ranks "
            f"on a host set OMP_NUM_THREADS={cores} or {_INSTALL_HINT}",
            stacklevel=3,
        )
        return
    threadpool_limits(cores, user_api="blas")


def is_initialized() -> bool:
    """Whether `initialize` has run in this process."""
    return _current is not None


def current() -> Backend | None:
    """The backend `initialize` made in this process, or None."""
    return _current


def check_backend(backend: Any, what: str) -> Backend:
    """`backend` if it is one; otherwise the error that says what to do."""
    if isinstance(backend, Backend):
        return backend
    if _current is None:
        raise RuntimeError(f"{what}: luxnn.distributed is not initialized; call backend = luxnn.distributed.initialize('mpi') first")
    raise TypeError(f"{what}: expected the backend returned by luxnn.distributed.initialize, got {type(backend).__name__}")


def check_root(backend: Backend, what: str, root: Any) -> None:
    """A `ValueError` unless `root` is one of `backend`'s ranks."""
    if isinstance(root, bool) or not isinstance(root, (int, np.integer)) or not 0 <= root < backend.size:
        raise ValueError(f"{what}: expected root a rank in [0, {backend.size}), got {root!r}")


def check_int(what: str, name: str, value: Any, *, minimum: int) -> int:
    """`value` as an int if it is one of at least `minimum`; otherwise a `ValueError`
    naming `what`'s argument `name`."""
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{what}: expected {name} an integer >= {minimum}, got {value!r}") from None
    if value < minimum:
        raise ValueError(f"{what}: expected {name} an integer >= {minimum}, got {value}")
    return value


def local_rank(backend: Backend) -> int:
    """This process's rank among all `total_workers` (0-based; Lux's name for it)."""
    return check_backend(backend, "local_rank").rank


def total_workers(backend: Backend) -> int:
    """The number of ranks."""
    return check_backend(backend, "total_workers").size
