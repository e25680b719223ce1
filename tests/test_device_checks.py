"""Checks of inputs made on the device (`luxnn.ops.device_checks`), on the simulated CUDA
device of tests/sim_cupy.py: which call a late error names, `check_now`, and a forked
child's fresh state."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops import device_checks
from luxnn.ops.cuda import cross_entropy as cuda_cross_entropy

import forked
import sim_cupy
from test_distributed import needs_mpi, run_workers


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    device_checks.check_now()  # earlier tests' flags read
    yield lx.gpu_device(force=True)


class _HeldEvent:
    """An event whose kernels have not run until `HELD` is cleared (a busy device)."""

    HELD = [True]

    def __init__(self, **_) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    done = property(lambda self: not _HeldEvent.HELD[0])

    def synchronize(self) -> None:
        _HeldEvent.HELD[0] = False


@pytest.fixture
def busy_device(sim_gpu, monkeypatch):
    monkeypatch.setattr(sim_cupy.cuda, "Event", _HeldEvent)
    _HeldEvent.HELD[0] = True
    yield sim_gpu


def test_a_late_error_names_the_call_it_was_found_in_and_says_that_call_was_computed(busy_device):
    loss, logits = lx.losses.CrossEntropyLoss(), busy_device(np.zeros((2, 3)))
    good, bad = busy_device(np.array([0, 1])), busy_device(np.array([0, 5]))
    loss(logits, bad)
    loss(logits, good)
    loss(logits, good)  # the device has not run the first call's kernels yet
    _HeldEvent.HELD[0] = False
    with pytest.raises(ValueError, match=r"^CrossEntropyLoss: labels must lie in \[0, 3\), got 1 outside it \(as high "
                       r"as 5\); found in the call 3 calls before this one on the device, which was computed all the "
                       r"same: its loss NaN, and a training step's in-place update applied with it"):
        loss(logits, good)


def test_check_now_waits_for_the_flags_and_raises_for_the_last_call(busy_device):
    layer = lx.Embedding(4, 2)
    ps, st = busy_device(lx.setup(np.random.default_rng(0), layer))
    layer(busy_device(np.array([1, 2])), ps, st)
    layer(busy_device(np.array([1, -3])), ps, st)
    with pytest.raises(lx.LayerError, match=r"got 1 outside it \(as low as -3\); found in its last call on the device"):
        device_checks.check_now()
    device_checks.check_now()  # reported once
    layer(busy_device(np.array([1, 2])), ps, st)


def test_a_forked_child_starts_with_no_flags_and_a_free_lock(sim_gpu):
    loss = lx.losses.NLLLoss()
    loss(sim_gpu(np.zeros((2, 3))), sim_gpu(np.array([0, 7])))  # a bad label, its flag pending
    with cuda_cross_entropy.CHECKS._lock:  # held by a thread of the parent's at the fork
        pid = os.fork()
        if pid == 0:  # the child, the lock held as it was: reports by its exit status only
            code = 1
            try:
                signal.alarm(20)  # a lock never released: the child dies
                device_checks.check_now()  # neither the parent's flags nor its held lock
                code = 0
            finally:
                os._exit(code)
    assert forked.exit_code(pid, 30) == 0
    with pytest.raises(ValueError, match="labels must lie in"):  # the parent still has its flag
        device_checks.check_now()


def test_a_checkpoint_is_not_written_while_a_bad_label_waits_to_be_reported(sim_gpu, tmp_path):
    loss = lx.losses.CrossEntropyLoss()
    loss(sim_gpu(np.zeros((2, 3))), sim_gpu(np.array([0, 7])))  # NaN; its flag not read yet
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        lx.save(tmp_path / "ts.safetensors", {"w": np.ones(2)})
    assert list(tmp_path.iterdir()) == []
    lx.save(tmp_path / "ts.safetensors", {"w": np.ones(2)})  # reported once: the next save writes


@needs_mpi
def test_a_distributed_save_refuses_on_every_rank_a_bad_label_one_rank_found(tmp_path):
    done = run_workers("save_device_checks.py", str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    assert all(f"rank {r}: PASS save refuses" in done.stdout for r in (0, 1)), done.stdout[-3000:]


def test_a_bad_label_in_the_last_call_is_reported_at_exit(tmp_path):
    script = tmp_path / "last_batch.py"
    script.write_text(
        "import sys; sys.path.insert(0, %r)\n"
        "import numpy as np, sim_cupy; sys.modules['cupy'] = sim_cupy\n"
        "import luxnn as lx\n"
        "gpu = lx.gpu_device(force=True)\n"
        "print(float(lx.losses.CrossEntropyLoss()(gpu(np.zeros((2, 3))), gpu(np.array([0, 9])))))\n"
        % os.path.dirname(os.path.abspath(__file__))
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "nan", done.stderr[-2000:]
    assert "RuntimeWarning: luxnn: at exit, CrossEntropyLoss: labels must lie in [0, 3)" in done.stderr, done.stderr[-2000:]
