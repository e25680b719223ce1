"""Ranks that fall out of step: ``mpiexec -n 2 python -m mpi4py disagree.py CASE``, where
CASE is one of

- ``raises``: rank 1's objective raises in step 3, then gets an empty batch in step 5,
  and its loop goes on, with ``overlap=False`` and ``True``: the other rank's update of
  those steps raises too, no rank applies them, and the replicas stay equal (and equal
  between the two paths);
- ``allreduce`` / ``allreduce-overlap``: rank 0 calls one ``allreduce_`` more in step 3;
- ``save``: rank 0 alone calls ``dist.save``, then both call ``synchronize``;
- ``extra-step``: rank 0 takes one step more, then both call ``dist.save``;
- ``layout``: both call ``allreduce_``, rank 0 with 2 arrays, rank 1 with 3;
- ``exit``: rank 1 ends its program (``sys.exit(0)``) after 2 steps while rank 0 goes on;
  ``exit-overlap``: with ``overlap=True``, after its third backward pass.

Each rank's loop catches what its calls raise and prints ``rank R: step S: ERROR``; a
call of the backend after ranks disagreed raises at once. Ends with ``rank R: finished``.
"""

import os
import sys

import numpy as np

import common
import luxnn as lx
from luxnn import distributed as dist

case = sys.argv[1]
backend = dist.initialize("mpi")
rank = backend.rank


def say(message):
    common.say(rank, message)


model, ps, st, x, y = common.small_problem(8, 16)
ad, loss_fn = lx.AutoTape(), lx.losses.MSELoss()


def batch(step):
    """This rank's share of step `step`'s batch (an empty one for rank 1 in case "raises", step 5)."""
    rows = slice(0, 0) if (case == "raises" and rank == 1 and step == 5) else slice(4 * rank + step % 2, 4 * rank + step % 2 + 4)
    return x[rows], y[rows]


def objective(model, ps, st, data):
    if case == "raises" and rank == 1 and objective.step == 3:
        raise ArithmeticError("rank 1 fails on purpose")
    return loss_fn(model, ps, st, data)


def train(steps, overlap=False):
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=64, overlap=overlap))
    for step in range(1, steps + 1):
        objective.step = step
        try:
            if case.startswith("allreduce") and rank == 0 and step == 3:
                dist.allreduce_(backend, np.ones(2))
            if case == "exit" and rank == 1 and step == 3:
                sys.exit(0)
            grads, _, _, ts = lx.compute_gradients(ad, objective, batch(step), ts)
            if case == "exit-overlap" and rank == 1 and step == 3:
                sys.exit(0)  # its round's allreduces started, not ended
            ts = lx.apply_gradients_(ts, grads)
        except Exception as err:  # noqa: BLE001 - the loop goes on, as a user's might
            say(f"step {step}: {type(err).__name__}: {err}")
    return ts


if case == "raises":
    results = [train(7, overlap) for overlap in (False, True)]
    for ts in results:
        digests = backend.allgather_object([a.tobytes() for a in lx.tree.leaves(ts.parameters)])
        assert digests[0] == digests[1], "the replicas differ"
    for a, b in zip(lx.tree.leaves(results[0].parameters), lx.tree.leaves(results[1].parameters)):
        np.testing.assert_allclose(a, b, rtol=1e-13, atol=0)
    assert results[0].step == results[1].step == 5, results[0].step  # steps 3 and 5 applied on no rank
    say("PASS the replicas stay equal")
elif case in ("allreduce", "allreduce-overlap", "exit", "exit-overlap"):
    train(5, overlap=case.endswith("overlap"))
elif case == "save":
    ts = train(1)
    if rank == 0:
        try:
            dist.save(backend, os.path.join(sys.argv[2], "ckpt.safetensors"), ts)
        except Exception as err:  # noqa: BLE001
            say(f"save: {type(err).__name__}: {err}")
    try:
        dist.synchronize(backend, {"w": np.full(3, float(rank))})
    except Exception as err:  # noqa: BLE001
        say(f"synchronize: {type(err).__name__}: {err}")
elif case == "layout":
    try:
        dist.allreduce_(backend, {key: np.ones(2) for key in ("ab" if rank == 0 else "abc")})
    except Exception as err:  # noqa: BLE001
        say(f"layout: {type(err).__name__}: {err}")
elif case == "extra-step":
    ts = train(3 if rank == 0 else 2)
    try:
        dist.save(backend, os.path.join(sys.argv[2], "ckpt.safetensors"), ts)
    except Exception as err:  # noqa: BLE001
        say(f"save: {type(err).__name__}: {err}")
try:
    dist.allreduce_(backend, np.ones(2))
except Exception as err:  # noqa: BLE001
    say(f"after: {type(err).__name__}")
say("finished")
