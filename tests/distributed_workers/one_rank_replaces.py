"""Overlap with gradients that one rank replaces and the other does not (clipping by a
rank's own norm, say): ``mpiexec -n 2 python -m mpi4py one_rank_replaces.py``. Rank 1
doubles its gradients between compute_gradients and apply_gradients; rank 0 passes its
own. Every rank must then average what each passed (rank 0 its round's, rank 1 the
doubled ones) with the same collectives, and the replicas stay bit-identical; then rank 1
alone raises in its backward pass, and rank 0's update must raise too, with nothing
applied, so that both skip the step."""


import numpy as np

import common
import luxnn as lx
from luxnn import distributed as dist

backend = dist.initialize("mpi")
rank = backend.rank


def say(message):
    common.say(rank, message)


model, ps, st, x, y = common.small_problem(4, 8)
batch = (x[4 * rank : 4 * rank + 4], y[4 * rank : 4 * rank + 4])
ad, loss_fn = lx.AutoTape(), lx.losses.MSELoss()


def replaced(grads):
    return lx.tree.map(lambda g: 2.0 * g, grads) if rank == 1 else grads


results = {}
for overlap in (False, True):
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=1, overlap=overlap))
    for _ in range(2):
        grads, _, _, ts = lx.compute_gradients(ad, loss_fn, batch, ts)
        ts = lx.apply_gradients(ts, replaced(grads))
    results[overlap] = ts.parameters
for got, want in zip(lx.tree.leaves(results[True]), lx.tree.leaves(results[False])):
    np.testing.assert_array_equal(got, want)
digests = backend.allgather_object([a.tobytes() for a in lx.tree.leaves(results[True])])
assert digests[0] == digests[1]
say("PASS one rank replaces")


class Failing:
    now = False


def objective(model, ps, st, data):
    if Failing.now and rank == 1:
        raise ArithmeticError("rank 1 fails on purpose")
    return loss_fn(model, ps, st, data)


ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=1, overlap=True))
_, _, _, ts = lx.single_train_step_(ad, objective, batch, ts)
before = lx.tree.map(np.copy, ts.parameters)
Failing.now = True
try:
    lx.single_train_step_(ad, objective, batch, ts)
except (ArithmeticError, RuntimeError) as err:
    say(f"raised: {type(err).__name__}: {err}")
Failing.now = False
for got, want in zip(lx.tree.leaves(ts.parameters), lx.tree.leaves(before)):
    np.testing.assert_array_equal(got, want)  # the step was applied on no rank
_, _, _, ts = lx.single_train_step_(ad, objective, batch, ts)
digests = backend.allgather_object([a.tobytes() for a in lx.tree.leaves(ts.parameters)])
assert digests[0] == digests[1]
say("PASS one rank raises")
