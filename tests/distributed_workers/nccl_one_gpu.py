"""The NCCL backend on one GPU (``mpiexec -n 1``; scripts/gpu_check.sh runs it where a
GPU is lent): collectives on CuPy trees, a non-blocking allreduce on the backend's stream,
synchronize, and DistributedOptimizer steps, blocking and overlapped, that match the same
steps with the plain optimizer."""

import cupy
import numpy as np

import luxnn as lx
from luxnn import distributed as dist

backend = dist.initialize("nccl")
assert dist.initialize("nccl") is backend and backend.size == 1
x = {"a": cupy.arange(6, dtype=cupy.float32).reshape(2, 3), "b": cupy.ones(4, cupy.float64)}
x["strided"] = cupy.arange(8.0)[::2]
for op in ("sum", "avg", "max", "min"):
    before = {k: v.copy() for k, v in x.items()}
    dist.allreduce_(backend, x, op=op)
    for k in x:  # one rank: every op leaves the values as they were
        cupy.testing.assert_allclose(x[k], before[k])
dist.bcast_(backend, x)
dist.reduce_(backend, x, op="max")
host = {"h": np.ones(3)}  # NumPy arrays go through MPI on the NCCL backend
dist.allreduce_(backend, host)
assert (host["h"] == 1).all()

a = cupy.arange(10, dtype=cupy.float32)
pending = backend.start_allreduce(a, "avg")  # on the backend's stream, after the arange
pending.wait()  # the current stream waits for it; the division comes after
cupy.testing.assert_allclose(a, cupy.arange(10, dtype=cupy.float32))

dev = lx.gpu_device(force=True)
model = lx.Chain(lx.Dense(5, 16, activation="tanh"), lx.Dense(16, 3))
ps, st = dev(lx.setup(np.random.default_rng(0), model))
ps, st = dist.synchronize(backend, (ps, st))
rng = np.random.default_rng(1)
data = dev((rng.standard_normal((32, 5)).astype(np.float32), rng.standard_normal((32, 3)).astype(np.float32)))
loss_fn, ad = lx.losses.MSELoss(), lx.AutoTape()
plain = lx.TrainState(model, lx.tree.map(cupy.copy, ps), st, lx.optim.adam(1e-2))
for _ in range(5):
    _, _, _, plain = lx.single_train_step_(ad, loss_fn, data, plain)
for overlap in (False, True):
    optimizer = dist.DistributedOptimizer(backend, lx.optim.adam(1e-2), bucket_bytes=1, overlap=overlap)
    ts = lx.TrainState(model, lx.tree.map(cupy.copy, ps), st, optimizer)
    for _ in range(5):
        _, _, _, ts = lx.single_train_step_(ad, loss_fn, data, ts)
    for got, want in zip(lx.tree.leaves(ts.parameters), lx.tree.leaves(plain.parameters)):
        cupy.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
print(f"PASS nccl: {backend.stats.calls} collectives, {backend.stats.seconds * 1e3:.2f} ms", flush=True)
