"""The optimizers' step counts on a (simulated) GPU after a collective overwrote them:
``mpiexec -n 2 python -m mpi4py count_mirror.py``. Rank 0 has taken three steps, rank 1
none; once `bcast_`, `synchronize` or the backend's `bcast` gave rank 1 rank 0's state, a schedule must run at
rank 0's count on both ranks (its host mirror of the count forgotten, not stale), so the
next step leaves the same parameters on both. tests/sim_cupy.py stands in for CuPy.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: sim_cupy, fake_cupy

import numpy as np  # noqa: E402
import sim_cupy  # noqa: E402

sys.modules["cupy"] = sim_cupy

import luxnn as lx  # noqa: E402
from luxnn import distributed as dist, optim  # noqa: E402

backend = dist.initialize("mpi")
gpu = lx.gpu_device(force=True)
SCHEDULE = optim.piecewise_constant_schedule(0.1, {2: 10.0})  # 0.1 for steps 0 and 1, then 1.0


def say(message):
    sys.stdout.write(f"rank {backend.rank}: {message}\n")
    sys.stdout.flush()


def problem():
    rng = np.random.default_rng(0)  # the same on every rank
    return gpu({"w": rng.standard_normal((3, 2)), "b": rng.standard_normal(2)}), gpu({"w": np.ones((3, 2)), "b": np.ones(2)})


for name, make in {"sgd": lambda: optim.sgd(SCHEDULE, momentum=0.9), "adamw": lambda: optim.adamw(SCHEDULE)}.items():
    for verb in ("bcast_", "synchronize", "backend.bcast"):
        params, grads = problem()
        opt = make()
        state = opt.init(params)
        for _ in range(3 if backend.rank == 0 else 0):
            state = optim.update_and_apply_(opt, grads, state, params)
        if verb == "backend.bcast":  # array by array
            for a in lx.tree.leaves((params, state)):
                backend.bcast(a)
        else:
            params, state = getattr(dist, verb)(backend, (params, state))
        optim.update_and_apply_(opt, grads, state, params)
        mine = lx.cpu_device()(params)
        theirs = backend.bcast_object(mine, 0)
        for key in mine:
            np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{name} after {verb}: {key}")
        say(f"PASS {name} after {verb}")
say("done")
