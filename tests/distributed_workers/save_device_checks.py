"""`dist.save` with a bad label found on one rank's (simulated) GPU and not yet reported:
``mpiexec -n 2 python -m mpi4py save_device_checks.py DIR``. Every rank must raise, naming
rank 1, and no file may be written; the next save, with nothing pending, writes.
tests/sim_cupy.py stands in for CuPy.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: sim_cupy, fake_cupy

import numpy as np  # noqa: E402
import sim_cupy  # noqa: E402

sys.modules["cupy"] = sim_cupy

import luxnn as lx  # noqa: E402
from luxnn import distributed as dist  # noqa: E402

backend = dist.initialize("mpi")
gpu = lx.gpu_device(force=True)
path = os.path.join(sys.argv[1], "ts.safetensors")
labels = [0, 7] if backend.rank == 1 else [0, 1]
lx.losses.CrossEntropyLoss()(gpu(np.zeros((2, 3))), gpu(np.array(labels)))  # rank 1's loss NaN, its flag unread
try:
    dist.save(backend, path, {"w": np.ones(2)})
    raise SystemExit(f"rank {backend.rank}: FAIL save wrote")
except ValueError as err:
    assert "save: nothing written: rank 1's device found" in str(err) and "labels must lie in [0, 3)" in str(err), err
backend.barrier()
assert not os.path.exists(path)
dist.save(backend, path, {"w": np.ones(2)})
assert os.path.exists(path)
sys.stdout.write(f"rank {backend.rank}: PASS save refuses a rank's unreported bad label\n")
