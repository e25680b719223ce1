"""Rank 1 raises inside its third training step while rank 0 goes on into the gradients'
allreduce (``raising_rank.py overlap``: its non-blocking allreduces, started in the
backward pass): under ``python -m mpi4py`` the job must end, with rank 1's traceback.
Prints the time of the raise, for the test to measure how long the job outlived it."""

import sys
import time

import numpy as np

import luxnn as lx
from luxnn import distributed as dist

backend = dist.initialize("mpi")
model = lx.Dense(4, 2)
ps, st = dist.synchronize(backend, lx.setup(np.random.default_rng(0), model))
overlap = sys.argv[1:] == ["overlap"]
ts = lx.TrainState(model, ps, st, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), overlap=overlap))
mse = lx.losses.MSELoss()
steps = 0


def objective(model, ps, st, data):
    if backend.rank == 1 and steps == 2:
        sys.stdout.write(f"rank 1 raises at {time.time():.3f}\n")
        sys.stdout.flush()
        raise RuntimeError("rank 1 fails on purpose")
    return mse(model, ps, st, data)


data = (np.ones((8, 4), np.float32), np.zeros((8, 2), np.float32))
for steps in range(5):
    _, _, _, ts = lx.single_train_step_(lx.AutoTape(), objective, data, ts)
print(f"rank {backend.rank} finished, which it must not", flush=True)
