"""The NCCL backend on 2 ranks without a GPU: ``mpiexec -n 2 python -m mpi4py nccl_fake.py``.

A stand-in for CuPy is installed as ``cupy`` before luxnn looks for it: its arrays are host
memory reached only through CuPy's API (``data.ptr``, ``get``, ``set``, ...), its
``cuda.nccl.NcclCommunicator`` takes exactly the arguments of CuPy's (``allReduce(sendbuf,
recvbuf, count, datatype, op, stream)``, ``reduce(..., op, root, stream)``, ``bcast(buff,
count, datatype, root, stream)``, pointers and counts as ints) and reduces the memory at
those pointers over MPI, and its streams and events log what waits for what. So this runs
`NCCLBackend` as written, and checks its calls against CuPy's documented signatures: the
device bound before the communicator, NCCL's id from rank 0, datatypes, in-place reduce
and bcast, and every NCCL call (blocking or `start_allreduce`) on the backend's one stream
after an event of the current stream (one communicator's calls on one stream: NCCL runs
them in order), waited for by the host or, for `start_allreduce`, by the current stream. What it cannot check is NCCL itself.
"""

import ctypes
import sys
import types

import numpy as np
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
log = []  # ("use", device) / ("comm", ...) / ("record", stream, event) / ("wait", stream, event) / ("nccl", name, stream)

# CuPy's NCCL constants (cupy_backends/cuda/libs/nccl.pxd)
NCCL = {"NCCL_SUM": 0, "NCCL_PROD": 1, "NCCL_MAX": 2, "NCCL_MIN": 3, "NCCL_AVG": 4, "NCCL_INT8": 0, "NCCL_UINT8": 1,
        "NCCL_INT32": 2, "NCCL_UINT32": 3, "NCCL_INT64": 4, "NCCL_UINT64": 5, "NCCL_FLOAT16": 6, "NCCL_FLOAT32": 7,
        "NCCL_FLOAT64": 8}  # fmt: skip
DTYPES = {7: np.float32, 8: np.float64, 2: np.int32, 4: np.int64, 0: np.int8, 1: np.uint8, 3: np.uint32, 5: np.uint64, 6: np.float16}
MPI_OPS = {0: MPI.SUM, 2: MPI.MAX, 3: MPI.MIN}


class ndarray:  # noqa: N801 - CuPy's name
    """A "device" array: host memory, reached through CuPy's API only."""

    def __init__(self, host):
        self._host = host

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    ndim = property(lambda self: self._host.ndim)
    flags = property(lambda self: self._host.flags)
    data = property(lambda self: types.SimpleNamespace(ptr=self._host.ctypes.data))
    device = types.SimpleNamespace(id=0)

    def copy(self):
        return ndarray(self._host.copy())

    def get(self):
        return self._host.copy()

    def set(self, host):
        self._host[...] = host

    def __getitem__(self, key):
        return ndarray(self._host[key])

    def __setitem__(self, key, value):
        self._host[key] = value._host if isinstance(value, ndarray) else value

    def __itruediv__(self, n):
        self._host /= n
        return self

    def reshape(self, *shape):
        return ndarray(self._host.reshape(*shape))


ndarray.__module__ = "cupy._core.core"  # where luxnn recognises CuPy's arrays


def _memory(ptr, count, datatype):
    dtype = np.dtype(DTYPES[datatype])
    return np.frombuffer((ctypes.c_char * (count * dtype.itemsize)).from_address(ptr), dtype)


def _ints(*args):
    assert all(type(a) is int for a in args), f"NCCL takes ints (pointers, counts, enums), got {args}"


class NcclCommunicator:
    def __init__(self, ndev, commId, rank):  # noqa: N803 - CuPy's names
        assert type(commId) is tuple and len(commId) == 128 and all(-128 <= c < 128 for c in commId), commId
        assert len(set(WORLD.allgather(commId))) == 1, "every rank must pass rank 0's unique id"
        assert (ndev, rank) == (WORLD.Get_size(), WORLD.Get_rank())
        assert log and log[-1][0] == "use", "the device must be bound before the communicator"
        log.append(("comm",))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        _ints(sendbuf, recvbuf, count, datatype, op, stream)
        send, recv = _memory(sendbuf, count, datatype), _memory(recvbuf, count, datatype)
        WORLD.Allreduce(MPI.IN_PLACE if sendbuf == recvbuf else send, recv, op=MPI_OPS[op])
        log.append(("nccl", "allReduce", stream))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        _ints(sendbuf, recvbuf, count, datatype, op, root, stream)
        send, recv = _memory(sendbuf, count, datatype), _memory(recvbuf, count, datatype)
        if WORLD.Get_rank() == root:
            WORLD.Reduce(MPI.IN_PLACE if sendbuf == recvbuf else send, recv, op=MPI_OPS[op], root=root)
        else:
            WORLD.Reduce(send, None, op=MPI_OPS[op], root=root)
        log.append(("nccl", "reduce", stream))

    def bcast(self, buff, count, datatype, root, stream):
        _ints(buff, count, datatype, root, stream)
        WORLD.Bcast(_memory(buff, count, datatype), root=root)
        log.append(("nccl", "bcast", stream))


class Event:
    done = True


class Stream:
    made = []  # the ptrs of the streams made

    def __init__(self, null=False, non_blocking=False):
        self.ptr = 0 if null else 1000 + len(Stream.made)
        Stream.made.append(self.ptr)

    def record(self, event=None):
        event = event or Event()
        log.append(("record", self.ptr, id(event)))
        return event

    def wait_event(self, event):
        log.append(("wait", self.ptr, id(event)))

    def synchronize(self):
        log.append(("synchronize", self.ptr))


class Device:
    shared = False  # every rank sees one GPU of its own; True: the ranks of a host see the same one

    def __init__(self, device=0):
        self.id = device

    def use(self):
        log.append(("use", self.id))


null_stream = Stream(null=True)
nccl = types.ModuleType("cupy.cuda.nccl")
nccl.__dict__.update(NCCL, available=True, NcclCommunicator=NcclCommunicator,
                     get_unique_id=lambda: tuple(int(b) for b in np.random.default_rng().integers(-128, 128, 128)))  # fmt: skip
cuda = types.ModuleType("cupy.cuda")
cuda.__dict__.update(
    nccl=nccl, Stream=Stream, Event=Event, Device=Device, get_current_stream=lambda: null_stream,
    runtime=types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        deviceGetPCIBusId=lambda device: f"0000:{0 if Device.shared else WORLD.Get_rank():02x}:00.0",
    ),
)  # fmt: skip
cupy = types.ModuleType("cupy")
cupy.__dict__.update(cuda=cuda, ndarray=ndarray, empty=lambda n, dtype: ndarray(np.empty(n, dtype)),
                     divide=lambda a, n: ndarray(a._host / n))  # fmt: skip
sys.modules.update({"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.nccl": nccl})

import luxnn as lx  # noqa: E402 - after the stand-in
from luxnn import distributed as dist  # noqa: E402

backend = dist.initialize("nccl")
rank = backend.rank
assert backend.kind == "nccl" and backend.size == 2 and ("comm",) in log
assert log[: log.index(("comm",))][-1] == ("use", 0)


def say(message):
    sys.stdout.write(f"rank {rank}: {message}\n")  # one write: the ranks' lines do not mix
    sys.stdout.flush()


def device(values, dtype=np.float32):
    return ndarray(np.asarray(values, dtype))


def host(a):
    return a.get()


Device.shared = True  # a second backend (made by hand: `initialize` keeps one) on one GPU for both ranks
message = ""
try:
    dist.NCCLBackend(WORLD)
except RuntimeError as err:
    message = str(err)
assert "ranks 0 and 1 on host" in message and "got the same GPU (0000:00:00.0)" in message, message
Device.shared = False
say("PASS fake nccl: one GPU per rank")

# ---- blocking collectives: on the backend's stream after the current one's work, waited for --
(own,) = Stream.made[1:]  # the backend's stream (the first is the null stream): every NCCL call's
for dtype in (np.float32, np.float64):
    for op, want in (("sum", 3.0), ("avg", 1.5), ("max", 2.0), ("min", 1.0)):
        strided = ndarray(np.full((3, 4), rank + 1.0, dtype))[:, ::2]  # not contiguous: a copy goes, written back
        x = {"a": device([rank + 1.0] * 5, dtype), "s": strided}
        del log[:]
        dist.allreduce_(backend, x, op=op)
        np.testing.assert_array_equal(host(x["a"]), np.full(5, want, dtype))
        np.testing.assert_array_equal(host(x["s"]), np.full((3, 2), want, dtype))
        assert [e for e in log if e[0] == "nccl"] == [("nccl", "allReduce", own)] * 2 and ("synchronize", own) in log
        for i, e in enumerate(log):  # each call after its own wait for an event of the current stream
            if e[0] == "nccl":
                (_, s1, ready), (_, s2, waited) = log[i - 2 : i]
                assert (s1, s2) == (0, own) and ready == waited, log
x = device([rank + 1.0] * 3)
dist.reduce_(backend, x, op="sum", root=1)
np.testing.assert_array_equal(host(x), np.full(3, 3.0 if rank == 1 else 1.0))  # in place on the root only
x = device([rank + 1.0] * 3, np.float64)
dist.bcast_(backend, x, root=1)
np.testing.assert_array_equal(host(x), np.full(3, 2.0))
# Arrays of dtypes NCCL cannot reduce are broadcast as bytes: synchronize takes them all.
flags, z = ndarray(np.array([rank == 0, rank == 1])), ndarray(np.full(2, 1j * (rank + 1), np.complex64))
dist.synchronize(backend, {"flags": flags, "z": z, "x": x})
np.testing.assert_array_equal(host(flags), [True, False])
np.testing.assert_array_equal(host(z), np.full(2, 1j, np.complex64))
message = ""
try:
    backend.allreduce(ndarray(np.ones(2, np.complex64)))
except TypeError as err:
    message = str(err)
assert "the NCCL backend carries" in message and "complex64" in message, message
untouched = {"a": device([1.0, 2.0]), "z": ndarray(np.ones(2, np.complex64))}  # checked before any travels
try:
    dist.allreduce_(backend, untouched)
except TypeError as err:
    message = str(err)
assert message.startswith("allreduce_: the NCCL backend carries") and "complex64" in message, message
np.testing.assert_array_equal(host(untouched["a"]), [1.0, 2.0])
say("PASS fake nccl: blocking collectives")

# ---- start_allreduce: on the backend's stream, after the current stream's work ----------------------
del log[:]
a = device([rank + 1.0] * 4)
pending = backend.start_allreduce(a, "avg")
(_, s1, ready), (_, s2, waited), (_, name, s3), (_, s4, reduced) = log
assert (s1, s2, s3, s4) == (0, own, own, own) and ready == waited and name == "allReduce", log
del log[:]
pending.wait()
assert log == [("wait", 0, reduced)], log  # the current stream waits; the host does not
np.testing.assert_array_equal(host(a), np.full(4, 1.5))
say("PASS fake nccl: start_allreduce")

# ---- GradientBuckets over "device" arrays: blocking, and a round (overlap) -------------------------------
grads = {"w": device(np.full((2, 3), rank + 1.0)), "b": device(np.full(3, 2.0 * (rank + 1))), "c": device([rank + 1.0])}
buckets = dist.GradientBuckets(backend, bucket_bytes=16)
averaged = buckets.average(grads)
leaves, structure = lx.tree.flatten(grads)
receive = buckets.begin(leaves, structure)
for position in reversed(range(len(leaves))):
    receive(position, leaves[position])
streamed = lx.tree.unflatten(structure, buckets.collect(leaves))
for key, want in (("w", 1.5), ("b", 3.0), ("c", 1.5)):
    np.testing.assert_array_equal(host(averaged[key]), np.full(grads[key].shape, want))
    np.testing.assert_array_equal(host(streamed[key]), np.full(grads[key].shape, want))
say("PASS fake nccl: buckets")
