"""The suite's distributed rows: steps that run in the ranks of an ``mpiexec -n N python -m
mpi4py`` job, timed by the suite's runner like any other row.

The runner times ``step()`` in its own process, so a distributed row's step is a proxy:
it tells every rank of the job, over a Unix socket each, to run one call of the named
step, and returns once every rank has done it. Each rank waits for the next call blocked
in ``recv``, not spinning in a collective, so an idle job takes no core from the rows timed
in between. A job is started on the first build of its size (its ranks set their threads
as `luxnn.distributed.initialize` does), shared by the variants of a run, and ended when
the last of their steps is gone. A proxied call costs a round trip more than the step;
``(round trip)`` rows time that alone. Run as a script, this module is a rank:

    mpiexec -n 2 python -m mpi4py -m luxnn.bench.distributed serve SOCKET

The time a step spends in collectives (``backend.stats``: blocked in them, or for
non-blocking ones in starting, testing and waiting) is no row of the suite; this prints
it, with the step's time, as medians over interleaved calls of the steps named:

    mpiexec -n 2 python -m mpi4py -m luxnn.bench.distributed collectives [CALLS] STEP...

Steps (each the same on every rank; gradients and data are zeros or fixed draws):

- ``allreduce-raw``: mpi4py's ``Allreduce`` in place of a 25 MiB float32 buffer;
- ``allreduce-bucket``: the same 25 MiB as one `GradientBuckets` bucket, summed by
  ``GradientBuckets.allreduce`` (what `DistributedOptimizer` does between pack and unpack);
- ``allreduce-update``: `DistributedOptimizer` around ``identity()`` on a 25 MiB gradient:
  pack, allreduce, unpack (average) as one step does, in an allocator cache;
- ``mlp-ranks``: the suite's MLP step (``training/mlp``) on each rank's share of its batch
  with `DistributedOptimizer`; ``mlp-whole``: the plain step on the whole batch;
- ``mlp-buckets``, ``mlp-overlap``: ``mlp-ranks`` with 256 KiB buckets (two: the second
  layer's gradients and the first layer's bias, then the first layer's weight), without
  and with ``overlap=True``; ``mlp-local``: the share's step with the plain optimizer,
  the computation without any communication;
- ``mlp-allreduce``: the MLP's gradients through `GradientBuckets.average`, i.e. the
  communication of one ``mlp-ranks`` step; ``noop``: nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import weakref
from typing import Any, Callable

import numpy as np

from . import models

BUCKET_BYTES = 25 << 20
START_TIMEOUT_S = 120


# ---- the ranks' side --------------------------------------------------------------------------


def _allreduce_raw(backend: Any) -> Callable[[], None]:
    from mpi4py import MPI

    buffer = np.zeros(BUCKET_BYTES // 4, np.float32)
    return lambda: backend.comm.Allreduce(MPI.IN_PLACE, buffer, op=MPI.SUM)


def _allreduce_bucket(backend: Any) -> Callable[[], None]:
    from luxnn import distributed as dist, tree

    buckets = dist.GradientBuckets(backend, BUCKET_BYTES)
    leaves, structure = tree.flatten({"w": np.zeros(BUCKET_BYTES // 4, np.float32)})
    buckets.pack(leaves, structure)
    assert len(buckets.buffers) == 1 and buckets.buffers[0].nbytes == BUCKET_BYTES
    return buckets.allreduce


def _allreduce_update(backend: Any) -> Callable[[], None]:
    import luxnn as lx
    from luxnn import distributed as dist

    grads = {"w": np.zeros(BUCKET_BYTES // 4, np.float32)}
    opt = dist.DistributedOptimizer(backend, lx.optim.identity(), bucket_bytes=BUCKET_BYTES)
    state, cache = opt.init(grads), lx.memory.AllocCache()

    def step() -> None:
        with lx.memory.cached(cache):
            opt.update(grads, state, grads)

    return step


def _mlp_share(backend: Any) -> tuple[Any, tuple]:
    """The suite's MLP and this rank's share of its batch."""
    mlp = models.MLP()
    x, y = mlp.data()
    share = mlp.batch // backend.size
    lo = backend.rank * share
    return mlp, (x[lo : lo + share], y[lo : lo + share])


OVERLAP_BUCKET_BYTES = 256 << 10


def _mlp_share_step(backend: Any, distributed: bool, **options: Any) -> Callable[[], None]:
    """The MLP step on this rank's share, with `DistributedOptimizer(**options)` or, if not
    `distributed`, the plain optimizer."""
    import luxnn as lx
    from luxnn import distributed as dist

    mlp, data = _mlp_share(backend)
    optimizer = lx.optim.sgd(mlp.lr)
    if distributed:
        optimizer = dist.DistributedOptimizer(backend, optimizer, **options)
    return models.luxnn_train_step(models.luxnn_mlp(mlp.sizes), optimizer, lx.losses.CrossEntropyLoss(), data, "default")


def _mlp_whole(backend: Any) -> Callable[[], None]:
    return models.MLP().luxnn()


def _mlp_allreduce(backend: Any) -> Callable[[], None]:
    import luxnn as lx
    from luxnn import distributed as dist

    mlp, data = _mlp_share(backend)
    model = models.luxnn_mlp(mlp.sizes)
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(mlp.lr), graphs=False)  # its cache serves the current stream
    grads, _, _, ts = lx.compute_gradients(lx.AutoTape(), lx.losses.CrossEntropyLoss(), data, ts)
    buckets = dist.GradientBuckets(backend)

    def step() -> None:
        with lx.memory.cached(ts.allocator_cache):
            buckets.average(grads)

    return step


STEPS: dict[str, Callable[[Any], Callable[[], None]]] = {
    "allreduce-raw": _allreduce_raw,
    "allreduce-bucket": _allreduce_bucket,
    "allreduce-update": _allreduce_update,
    "mlp-ranks": lambda backend: _mlp_share_step(backend, True),
    "mlp-buckets": lambda backend: _mlp_share_step(backend, True, bucket_bytes=OVERLAP_BUCKET_BYTES),
    "mlp-overlap": lambda backend: _mlp_share_step(backend, True, bucket_bytes=OVERLAP_BUCKET_BYTES, overlap=True),
    "mlp-local": lambda backend: _mlp_share_step(backend, False),
    "mlp-whole": _mlp_whole,
    "mlp-allreduce": _mlp_allreduce,
    "noop": lambda backend: lambda: None,
}


def _send(stream: Any, line: str) -> None:
    stream.write(line + "\n")
    stream.flush()  # a socket's text stream buffers otherwise, even with a newline


def serve(address: str) -> None:
    """A rank: connect to `address`, say which rank it is, then for each line ``build
    NAME`` or ``run NAME`` do it and answer ``ok``, until ``exit``. A failure raises, and
    ``python -m mpi4py`` ends the job (the proxy then sees its socket close)."""
    from luxnn import distributed as dist

    backend = dist.initialize("mpi")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.connect(address)
        stream = sock.makefile("rw")
        _send(stream, str(backend.rank))
        steps: dict[str, Callable[[], None]] = {}
        for line in stream:
            op, name = (line.split() + [""])[:2]
            if op == "exit":
                break
            if op == "build":
                steps[name] = STEPS[name](backend)
            else:
                steps[name]()
            _send(stream, "ok")


def collectives(calls: int, names: list[str]) -> None:
    """A rank: `calls` rounds of one call of each step in `names`; rank 0 prints each
    step's median time and median seconds in collectives per call (the ranks start each
    call together, after a barrier; a step that communicates ends as its slowest rank)."""
    import statistics
    import time

    from luxnn import distributed as dist

    backend = dist.initialize("mpi")
    steps = {name: STEPS[name](backend) for name in names}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for _ in range(calls):
        for name, step in steps.items():
            backend.barrier()
            t0, in_collectives = time.perf_counter(), backend.stats.seconds
            step()
            times[name].append((time.perf_counter() - t0, backend.stats.seconds - in_collectives))
    if backend.rank == 0:
        for name, samples in times.items():
            step_s = statistics.median(t for t, _ in samples[calls // 5 :])  # the first fifth warms up
            comm_s = statistics.median(c for _, c in samples[calls // 5 :])
            print(f"{name}: {step_s * 1e3:.3f} ms per step, {comm_s * 1e3:.3f} ms of it in collectives "
                  f"(medians of {calls - calls // 5} calls on each of {backend.size} ranks)", flush=True)


# ---- the runner's side ---------------------------------------------------------------------------


class Job:
    """``mpiexec -n RANKS`` ranks running `serve`, and a socket to each; `close()` (or the
    job's garbage collection) ends them."""

    def __init__(self, ranks: int) -> None:
        from luxnn.distributed.launch import launcher

        start = launcher(ranks)
        self._dir = tempfile.mkdtemp(prefix="luxnn-bench-mpi-")
        address = os.path.join(self._dir, "socket")
        self._log = open(os.path.join(self._dir, "log"), "w+")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
            listener.bind(address)
            listener.listen(ranks)
            listener.settimeout(START_TIMEOUT_S)
            command = [*start, sys.executable, "-m", "mpi4py", "-m", __name__, "serve", address]
            self.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT)
            self._streams: list[Any] = [None] * ranks
            self.close = weakref.finalize(self, Job._end, self.process, self._streams, self._log, self._dir)
            try:
                for _ in range(ranks):
                    connection, _ = listener.accept()
                    stream = connection.makefile("rw")
                    connection.close()  # the stream holds the socket
                    self._streams[int(self._receive(stream))] = stream
            except (OSError, ValueError, RuntimeError) as err:
                tail = self._tail()
                self.close()
                raise RuntimeError(f"the {ranks}-rank job did not start ({err}): {tail}") from None

    def _receive(self, stream: Any) -> str:
        line = stream.readline()
        if not line:
            raise RuntimeError(f"the MPI job ended: {self._tail()}")
        return line.strip()

    def _tail(self) -> str:
        self._log.flush()
        self._log.seek(0)
        lines = self._log.read().strip().splitlines()
        return " | ".join(lines[-3:]) or f"exit status {self.process.poll()}"

    def call(self, op: str, name: str) -> None:
        for stream in self._streams:  # every rank's call sent before any answer is awaited
            _send(stream, f"{op} {name}")
        for stream in self._streams:
            self._receive(stream)

    @staticmethod
    def _end(process: subprocess.Popen, streams: list[Any], log: Any, directory: str) -> None:
        for stream in streams:
            if stream is not None:
                try:
                    _send(stream, "exit")
                    stream.close()
                except OSError:
                    pass
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(directory, ignore_errors=True)


_jobs: weakref.WeakValueDictionary[int, Job] = weakref.WeakValueDictionary()


def proxy(ranks: int, name: str) -> models.Step:
    """A step that runs step `name` once on every rank of a `ranks`-rank job."""
    job = _jobs.get(ranks)
    if job is None:
        job = _jobs[ranks] = Job(ranks)
    job.call("build", name)
    return lambda: job.call("run", name)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"] and len(sys.argv) == 3:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["collectives"] and len(sys.argv) > 2:
        counted = sys.argv[2].isdigit()
        collectives(int(sys.argv[2]) if counted else 200, sys.argv[3 if counted else 2 :])
    else:
        sys.exit("usage: mpiexec -n N python -m mpi4py -m luxnn.bench.distributed serve SOCKET\n"
                 f"       mpiexec -n N python -m mpi4py -m luxnn.bench.distributed collectives [CALLS] STEP... ({', '.join(STEPS)})")
