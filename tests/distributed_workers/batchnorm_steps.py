"""BatchNorm under data parallelism when ranks fall out of step or train models of their
own: ``mpiexec -n 2 python -m mpi4py batchnorm_steps.py CASE``, where CASE is one of

- ``small-batch``: rank 1 gets a batch of 1 in step 3 (BatchNorm refuses it before its
  collective) and its loop goes on, with ``overlap=False`` and ``True``;
- ``sync-empty``: as ``small-batch`` with ``BatchNorm(sync=True)`` and an empty batch
  (the loss refuses it, after the layer's collective);
- ``own-models``: no DistributedOptimizer: each rank trains a model of its own, and
  rank 0 alone runs a training-mode forward pass.

Prints ``rank R: step S: ERROR`` for what a step raised, ``PASS ...`` lines, then
``rank R: finished``.
"""

import sys

import numpy as np

import common
import luxnn as lx
from luxnn import distributed as dist

case = sys.argv[1]
backend = dist.initialize("mpi")
rank = backend.rank
ad, loss_fn = lx.AutoTape(), lx.losses.MSELoss()
model = lx.Chain(lx.Dense(3, 8), lx.BatchNorm(8, "tanh", sync=case == "sync-empty"), lx.Dense(8, 2))
ps, st = lx.setup(np.random.default_rng(0), model)
ps = lx.tree.map(lambda a: a.astype(np.float64), ps)
st = lx.tree.map(lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) else a, st)
rng = np.random.default_rng(1)
x, y = rng.standard_normal((16, 3)) * (1 + 3 * rank), rng.standard_normal((16, 2))


def say(message):
    common.say(rank, message)


def batch(step):
    rows = slice(4 * rank + step % 2, 4 * rank + step % 2 + 4)
    if rank == 1 and step == 3 and case != "own-models":
        rows = slice(0, 1) if case == "small-batch" else slice(0, 0)
    return x[rows], y[rows]


def train(steps, optimizer):
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, optimizer)
    for step in range(1, steps + 1):
        try:
            ts = lx.single_train_step_(ad, loss_fn, batch(step), ts)[3]
        except Exception as err:  # noqa: BLE001 - the loop goes on, as a user's might
            say(f"step {step}: {type(err).__name__}: {err}")
    return ts


def everywhere(ts):
    """Whether the replicas' parameters and states are equal."""
    digests = backend.allgather_object([a.tobytes() for a in lx.tree.leaves((ts.parameters, ts.states)) if isinstance(a, np.ndarray)])
    return digests[0] == digests[1]


if case in ("small-batch", "sync-empty"):
    results = [train(6, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=64, overlap=overlap)) for overlap in (False, True)]
    for ts in results:
        assert everywhere(ts), "the replicas differ"
        assert ts.step == 5, ts.step  # step 3 applied on no rank, every other step on every rank
    for a, b in zip(lx.tree.leaves(results[0].parameters), lx.tree.leaves(results[1].parameters)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=0)
    say("PASS the replicas stay equal and training goes on")
elif case == "own-models":
    ts = train(3, lx.optim.sgd(0.1))  # rank-dependent data: the models differ
    means = backend.allgather_object(ts.states["layer_2"]["running_mean"])
    assert not np.allclose(means[0], means[1]), "the running statistics were averaged over the ranks"
    alone = lx.TrainState(model, lx.tree.map(np.copy, ps), st, lx.optim.sgd(0.1))
    for step in range(1, 4):  # what this rank computes by itself
        alone = lx.single_train_step(ad, loss_fn, batch(step), alone)[3]
    np.testing.assert_allclose(ts.states["layer_2"]["running_mean"], alone.states["layer_2"]["running_mean"], rtol=1e-12)
    if rank == 0:
        model(x, ts.parameters, ts.states)  # training mode, on one rank only
    dist.allreduce_(backend, np.ones(2))
    say("PASS each rank keeps its own statistics")
say("finished")
