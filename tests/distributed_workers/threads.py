"""Run without OMP_NUM_THREADS / OPENBLAS_NUM_THREADS / MKL_NUM_THREADS: `initialize`
sets luxnn's kernel threads and the BLAS's to this rank's share of the host's cores."""

import os

from threadpoolctl import threadpool_info

import luxnn as lx
from luxnn import distributed as dist

assert not {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"} & os.environ.keys()
usable = len(os.sched_getaffinity(0))
assert lx.num_threads() == usable
backend = dist.initialize("mpi")
expected = max(1, usable // backend.ranks_on_host)  # mpiexec leaves every rank all the CPUs
blas = {pool["num_threads"] for pool in threadpool_info() if pool["user_api"] == "blas"}
assert backend.cores == expected and lx.num_threads() == expected and blas == {expected}, (backend.cores, lx.num_threads(), blas)
print(f"rank {backend.rank}: PASS threads {expected} of {usable}", flush=True)
