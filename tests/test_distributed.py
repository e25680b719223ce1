"""luxnn.distributed: 2 ranks under ``mpiexec -n 2 python -m mpi4py`` in subprocesses with
timeouts (the workers are in tests/distributed_workers/), one BLAS thread per rank.

One run of checks.py carries most checks (an MPI start-up costs about a second on a
loaded machine); the raising rank and the threads' defaults need runs of their own.
"""

import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from luxnn.distributed.launch import launcher, missing

WORKERS = os.path.join(os.path.dirname(__file__), "distributed_workers")
ONE_BLAS_THREAD = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


needs_mpi = pytest.mark.skipif(missing() is not None, reason=f"needs mpi4py and an mpiexec ({missing()})")


def run_workers(worker: str, *args: str, ranks: int = 2, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``mpiexec -n RANKS python -m mpi4py WORKER ARGS`` (the launcher of mpi4py's MPI), output captured (stderr into stdout)."""
    environment = {**os.environ, **ONE_BLAS_THREAD} if env is None else env
    command = [*launcher(ranks), sys.executable, "-m", "mpi4py", os.path.join(WORKERS, worker), *args]
    return subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def checks(tmp_path_factory):
    done = run_workers("checks.py", str(tmp_path_factory.mktemp("distributed")))
    assert done.returncode == 0, done.stdout[-4000:]
    return done.stdout


def passed(output: str, name: str) -> bool:
    return all(f"rank {r}: PASS {name}" in output for r in (0, 1))


@needs_mpi
@pytest.mark.parametrize(
    "name",
    ["initialize", "bad input", "threads", "collectives", "buckets", "synchronize",
     "training equals one process, replicas bit-identical", "overlap: training equals one process, replicas bit-identical",
     "overlap: allreduces start in the backward pass, results as without overlap",
     "overlap: a backward pass that raises leaves nothing pending", "overlap: compute_gradients then apply_gradients, replaced gradients",
     "shards disjoint and covering", "loader settings",
     "batchnorm: states equal on every rank, sync=True equals one process on the whole batch",
     "checks before writing, the DistributedOptimizer outermost", "checkpoint"],
)  # fmt: skip
def test_two_ranks(checks, name):
    assert passed(checks, name), checks[-4000:]
    assert all(f"rank {r}: done" in checks for r in (0, 1))


@needs_mpi
@pytest.mark.parametrize("kind", ["shape", "keys", "dtype"])
def test_mismatched_trees_raise_on_every_rank_naming_the_difference(checks, kind):
    messages = {r: re.search(rf"rank {r}: mismatch {kind}: (.*)", checks).group(1) for r in (0, 1)}
    assert messages[0] == messages[1]
    assert messages[0].startswith("synchronize: the trees differ between ranks: ")
    expected = {
        "shape": "'layer/w' is float64[3, 4] on rank 0 but float64[4, 4] on rank 1",
        "keys": "leaf 'b' on rank 1 is missing on rank 0",
        "dtype": "'0' is float32[2] on rank 0 but float64[2] on rank 1",
    }[kind]
    assert expected in messages[0]


@needs_mpi
def test_errors_name_the_backend_and_the_devices(checks):
    for r in (0, 1):
        assert f"rank {r}: twice: initialize: luxnn.distributed is already initialized with 'mpi', asked for 'nccl'" in checks
        assert re.search(rf"rank {r}: mixed: DistributedOptimizer: the parameters must all be on one device.*CUDADevice\(0\)", checks)


@needs_mpi
@pytest.mark.parametrize("overlap", [False, True])
def test_a_raising_rank_ends_the_job_with_its_traceback(overlap):
    done = run_workers("raising_rank.py", *(["overlap"] if overlap else []), timeout=120)
    ended = time.time()
    assert done.returncode != 0
    assert "RuntimeError: rank 1 fails on purpose" in done.stdout and "finished" not in done.stdout
    raised = float(re.search(r"rank 1 raises at ([0-9.]+)", done.stdout).group(1))
    assert ended - raised < 10, done.stdout[-2000:]


@needs_mpi
def test_overlap_takes_one_path_on_every_rank_when_one_rank_replaces_its_gradients_or_raises():
    done = run_workers("one_rank_replaces.py", timeout=60)  # without one path, the ranks' collectives mismatch
    assert done.returncode == 0, done.stdout[-4000:]
    assert passed(done.stdout, "one rank replaces") and passed(done.stdout, "one rank raises"), done.stdout[-4000:]
    assert "rank 0: raised: RuntimeError: DistributedOptimizer: a rank abandoned this step's gradients" in done.stdout


MISMATCH = "CallMismatch: luxnn.distributed: the ranks are in different calls: "
AVERAGE = "DistributedOptimizer's average of the gradients"


@needs_mpi
def test_a_rank_whose_step_raises_makes_every_rank_skip_that_step_with_or_without_overlap():
    done = run_workers("disagree.py", "raises", timeout=60)  # on the old code: a hang
    assert done.returncode == 0, done.stdout[-4000:]
    assert passed(done.stdout, "the replicas stay equal"), done.stdout[-4000:]
    for step, error in ((3, "ArithmeticError: rank 1 fails on purpose"), (5, "ValueError: MSELoss: empty batch")):
        assert done.stdout.count(f"rank 1: step {step}: {error}") == 2, done.stdout[-4000:]  # both paths
        assert done.stdout.count(f"rank 0: step {step}: RuntimeError: DistributedOptimizer: a rank abandoned this step's gradients") == 2
    assert "after:" not in done.stdout and all(f"rank {r}: finished" in done.stdout for r in (0, 1))


@needs_mpi
@pytest.mark.parametrize("case, calls", [
    ("allreduce", ("step 3", f"rank 0 in allreduce_, rank 1 in {AVERAGE}")),
    ("allreduce-overlap", ("step 3", "rank 0 in allreduce_, rank 1 in DistributedOptimizer's backward pass (overlap=True)")),
    ("save", ("save", "rank 0 in save, rank 1 in synchronize")),
    ("extra-step", ("step 3", f"rank 0 in {AVERAGE}, rank 1 in save")),
    ("layout", ("layout", "rank 0 in allreduce_ (op sum, 2 arrays: float64[2], float64[2]), "
                          "rank 1 in allreduce_ (op sum, 3 arrays: float64[2], float64[2], float64[2])")),
])  # fmt: skip
def test_ranks_in_different_calls_raise_on_every_rank_and_every_later_call_raises(case, calls, tmp_path):
    done = run_workers("disagree.py", case, str(tmp_path), timeout=60)  # on the old code: a hang, or one rank's error
    assert done.returncode == 0, done.stdout[-4000:]
    where, names = calls
    for rank in (0, 1):
        said = re.findall(rf"^rank {rank}: (.*?): (CallMismatch: .*)$", done.stdout, re.M)
        assert said and said[0][1].startswith(MISMATCH + names), done.stdout[-4000:]
        assert f"rank {rank}: after: CallMismatch" in done.stdout and f"rank {rank}: finished" in done.stdout
    assert re.search(rf"^rank 0: {where}: CallMismatch", done.stdout, re.M), done.stdout[-4000:]
    assert not os.path.exists(tmp_path / "ckpt.safetensors")


@needs_mpi
@pytest.mark.parametrize("case, error", [
    ("small-batch", "LayerError: layer_2: BatchNorm(8, activation=tanh): expected more than 1 value per channel"),
    ("sync-empty", "ValueError: MSELoss: empty batch"),
])  # fmt: skip
def test_a_rank_whose_step_raises_around_batchnorm_makes_every_rank_skip_that_step(case, error):
    # On the old code: with overlap=False every later step raised CallMismatch; with overlap=True a hang.
    done = run_workers("batchnorm_steps.py", case, timeout=60)
    assert done.returncode == 0, done.stdout[-4000:]
    assert passed(done.stdout, "the replicas stay equal and training goes on"), done.stdout[-4000:]
    assert done.stdout.count(f"rank 1: step 3: {error}") == 2, done.stdout[-4000:]  # both paths
    assert done.stdout.count("rank 0: step 3: RuntimeError: DistributedOptimizer: a rank abandoned this step's gradients") == 2
    assert "CallMismatch" not in done.stdout and all(f"rank {r}: finished" in done.stdout for r in (0, 1))


@needs_mpi
def test_batchnorm_outside_a_data_parallel_step_keeps_its_ranks_statistics():
    done = run_workers("batchnorm_steps.py", "own-models", timeout=60)  # on the old code: averaged, then a CallMismatch
    assert done.returncode == 0, done.stdout[-4000:]
    assert passed(done.stdout, "each rank keeps its own statistics"), done.stdout[-4000:]


@needs_mpi
@pytest.mark.parametrize("case, step, call", [("exit", 3, AVERAGE), ("exit-overlap", 4, "DistributedOptimizer's backward pass (overlap=True)")])
def test_a_rank_that_ends_its_program_makes_the_others_raise_with_the_reason_on_both(case, step, call):
    done = run_workers("disagree.py", case, timeout=60)  # on the old code: rank 0 waits forever
    assert done.returncode == 0, done.stdout[-4000:]
    if case == "exit-overlap":  # rank 1 ended in its step 3's round: rank 0's update of it raises first
        assert "rank 0: step 3: RuntimeError: DistributedOptimizer: a rank abandoned this step's gradients" in done.stdout
    reason = f"luxnn.distributed: the ranks are in different calls: rank 0 in {call}, rank 1 in the end of its program"
    assert f"rank 0: step {step}: CallMismatch: {reason}" in done.stdout, done.stdout[-4000:]  # rank 0 raises
    assert f"rank 1: {reason}" in done.stdout, done.stdout[-4000:]  # rank 1 says it on its way out
    assert "rank 0: step 5: CallMismatch" in done.stdout and "rank 0: finished" in done.stdout
    assert "rank 1: finished" not in done.stdout


@needs_mpi
def test_initialize_shares_the_cores_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    done = run_workers("threads.py", env=env)
    assert done.returncode == 0, done.stdout[-4000:]
    assert all(f"rank {r}: PASS threads" in done.stdout for r in (0, 1))


@needs_mpi
def test_demo_with_workers_trains_data_parallel_and_reports_the_collectives():
    env = {**os.environ, **ONE_BLAS_THREAD}
    command = [sys.executable, "-m", "luxnn.cli", "demo", "--workers", "2", "--epochs", "2", "--no-progress"]
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    assert re.search(r"^test accuracy [0-9.]+%", done.stdout, re.M) and done.stdout.count("test accuracy") == 1  # rank 0 only
    assert re.search(r"data-parallel on 2 ranks: median time per step in collectives [0-9.]+ ms", done.stdout)


@needs_mpi
def test_bench_rows_run_their_steps_in_an_mpi_job():
    from luxnn.bench import distributed

    step = distributed.proxy(2, "mlp-allreduce")
    for _ in range(3):
        step()
    with pytest.raises(RuntimeError, match="the MPI job ended"):
        distributed.proxy(2, "no-such-step")  # the ranks raise; mpi4py ends the job


@needs_mpi
def test_bench_prints_the_time_steps_spend_in_collectives():
    command = [*launcher(2), sys.executable, "-m", "mpi4py", "-m", "luxnn.bench.distributed", "collectives", "5", "mlp-overlap", "mlp-local"]
    env = {**os.environ, **ONE_BLAS_THREAD}
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    lines = re.findall(r"^(mlp-\w+): [0-9.]+ ms per step, ([0-9.]+) ms of it in collectives \(medians of 4 calls on each of 2 ranks\)$", done.stdout, re.M)
    figures = dict(lines)
    assert len(lines) == 2 and set(figures) == {"mlp-overlap", "mlp-local"}, done.stdout  # rank 0 prints
    assert float(figures["mlp-local"]) == 0
    assert float(figures["mlp-overlap"]) > 0


@needs_mpi
def test_the_nccl_backend_calls_cupys_nccl_as_documented():
    done = run_workers("nccl_fake.py")  # a stand-in for CuPy and its NCCL: no GPU needed
    assert done.returncode == 0, done.stdout[-4000:]
    for name in ("one GPU per rank", "blocking collectives", "start_allreduce", "buckets"):
        assert passed(done.stdout, f"fake nccl: {name}"), done.stdout[-4000:]


@needs_mpi
def test_nccl_on_one_gpu(gpu):  # `gpu` skips, with the reason, where no GPU is usable; gpu_check.sh runs it
    done = run_workers("nccl_one_gpu.py", ranks=1)
    assert done.returncode == 0 and "PASS nccl" in done.stdout, done.stdout[-4000:]


# ---- in this process: no MPI needed -----------------------------------------------------------


def test_luxnn_imports_without_mpi4py_and_initialize_names_the_extra():
    code = (
        "import sys; sys.modules['mpi4py'] = None\n"  # as if it were not installed
        "import luxnn\n"
        "from luxnn import distributed as dist\n"
        "try:\n"
        "    dist.initialize('mpi')\n"
        "except ImportError as err:\n"
        "    print(err)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "pip install 'luxnn[mpi]'" in done.stdout


def test_the_launcher_is_that_of_mpi4pys_library_whatever_comes_first_on_path(tmp_path, monkeypatch):
    from luxnn.distributed import launch

    def install(name, says, library):  # a prefix with bin/mpiexec printing `says` and lib/`library`
        (tmp_path / name / "bin").mkdir(parents=True)
        (tmp_path / name / "lib").mkdir()
        (tmp_path / name / "lib" / library).touch()
        script = tmp_path / name / "bin" / "mpiexec"
        script.write_text(f"#!/bin/sh\necho '{says}'\n")
        script.chmod(0o755)
        return str(script), str(tmp_path / name / "lib" / library)

    openmpi, openmpi_lib = install("openmpi", "mpiexec (Open MPI) 4.1.2", "libmpi.so.40")
    mpich, mpich_lib = install("mpich", "HYDRA build details:", "libmpi.so.12")
    (tmp_path / "python").mkdir()
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python" / "python3"))  # nothing beside it
    monkeypatch.setenv("PATH", f"{tmp_path / 'openmpi' / 'bin'}{os.pathsep}{tmp_path / 'mpich' / 'bin'}")
    for uid, root in ((0, ["--allow-run-as-root"]), (1000, [])):
        monkeypatch.setattr(os, "geteuid", lambda: uid)
        monkeypatch.setattr(launch, "_library", lambda: (mpich_lib, "mpich"))
        assert launch.launcher(2) == [mpich, "-n", "2"]  # Open MPI's comes first on PATH
        monkeypatch.setattr(launch, "_library", lambda: (str(tmp_path / "elsewhere" / "libmpi.so.12"), "mpich"))
        assert launch.launcher(1) == [mpich, "-n", "1"]  # found on PATH, past Open MPI's
        monkeypatch.setattr(launch, "_library", lambda: (openmpi_lib, "openmpi"))
        assert launch.launcher(2) == [openmpi, *root, "-n", "2"]
    monkeypatch.setenv("PATH", str(tmp_path / "openmpi" / "bin"))
    monkeypatch.setattr(launch, "_library", lambda: (str(tmp_path / "elsewhere" / "libmpi.so.12"), "mpich"))
    assert "no mpich mpiexec found beside mpi4py's MPI library" in launch.missing()
    with pytest.raises(RuntimeError, match="no mpich mpiexec found"):
        launch.launcher(2)


def test_anything_before_initialize_says_to_initialize():
    from luxnn import distributed as dist
    import luxnn as lx

    assert not dist.is_initialized()  # no test initializes MPI in this process
    calls = [
        lambda: dist.allreduce_(None, np.ones(2)),
        lambda: dist.bcast_("mpi", np.ones(2)),
        lambda: dist.synchronize(None, {}),
        lambda: dist.local_rank(None),
        lambda: dist.DistributedOptimizer(None, lx.optim.sgd(0.1)),
        lambda: dist.DistributedDataLoader(None, np.ones(4), 2),
        lambda: dist.save(None, "x.safetensors", None),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"not initialized; call backend = luxnn.distributed.initialize\('mpi'\) first"):
            call()
    with pytest.raises(ValueError, match="expected a backend kind in"):
        dist.initialize("gloo")
