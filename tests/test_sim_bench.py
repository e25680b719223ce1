"""``luxnn bench --device gpu`` and the launch budgets of its models, on the simulated CUDA
device of tests/sim_cupy.py (no GPU needed).

The bench's GPU runner (its rows, interleaved rounds, medians and ratios, kernels per step,
peak reserved and table) runs here with PyTorch's side faked where the real one needs a
GPU: its rows are a few simulated launches with a fixed peak reserved, and torch.profiler
is a profiler that reports the simulator's launches as its events. Then each training row's
luxnn model, at its real layer sizes, is trained a few steps and its launches per step
(kernels, fills, cuBLAS calls) held to a regression guard.

What the simulator cannot tell: any time, and what torch.profiler's CUPTI counts on a GPU
(scripts/gpu_check.sh runs the bench there).
"""

from __future__ import annotations

import functools
import json
import sys
import types

import pytest

import luxnn as lx
from luxnn import memory
from luxnn.bench import gpu, gpu_models, stats
from luxnn.cli import main
from luxnn.memory import cupy_backend

import sim_cupy
from test_memory_cuda import FakeDriver


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``, every CUDA cache's upstream a fake
    driver over host memory; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    monkeypatch.setattr(cupy_backend, "bind_driver", FakeDriver().bind)
    yield lx.gpu_device(force=True)


class SimProfile:
    """torch.profiler's interface over the simulated device: ``events()`` has one CUDA
    event per launch in the block, copies named as CUPTI names them, and a CPU event."""

    def __enter__(self) -> "SimProfile":
        self._counting = sim_cupy.counting()
        self.counts = self._counting.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._counting.__exit__(*exc)

    def events(self) -> list:
        cuda, cpu = "DeviceType.CUDA", "DeviceType.CPU"
        out = [types.SimpleNamespace(name="aten::mm", device_type=cpu)]
        for key, n in self.counts.items():
            if isinstance(key, tuple):
                name = "Memcpy HtoD (Pageable -> Device)" if key[0] == "memcpy" else key[1]
                out += [types.SimpleNamespace(name=name, device_type=cuda)] * n
        return out


PEER_RESERVED = 1 << 20


@pytest.fixture
def fake_torch(monkeypatch):
    """PyTorch's rows as two simulated launches a step (a fill and a kernel) holding
    `PEER_RESERVED` bytes; its profiler `SimProfile`."""

    def peer(*_args) -> gpu_models.DeviceStep:
        return gpu_models.DeviceStep(lambda: sim_cupy.zeros(3) * 2.0, lambda: PEER_RESERVED, lambda: None)

    torch = types.SimpleNamespace(zeros=lambda *a, **k: None, version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setattr(gpu_models, "torch_cuda", lambda: torch)
    monkeypatch.setattr(gpu_models.Classifier, "torch", peer)
    monkeypatch.setattr(gpu_models, "torch_basic", peer)
    monkeypatch.setattr(gpu, "torch_profile", SimProfile)


def _launches(counts) -> int:
    return counts["kernel"] + counts["fill"] + counts["cublas"]


def _warm_launches(step, calls: int = 3) -> int:
    for _ in range(calls):
        with sim_cupy.counting() as counts:
            step()
    return _launches(counts)


def test_the_gpu_bench_times_counts_and_compares_each_row_with_pytorchs(sim_gpu, fake_torch, tmp_path, capsys):
    path = tmp_path / "gpu.json"
    args = ["bench", "--device", "gpu", "--quick", "--rounds", "2", "--filter", "training/mlp |basics/dense", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["device"] == "gpu" and doc["unavailable"] == []
    rows = {r["name"]: r for r in doc["rows"]}
    names = ["gpu/training/mlp (luxnn)", "gpu/training/mlp (pytorch eager)", "gpu/basics/dense (luxnn)", "gpu/basics/dense (pytorch eager)"]
    assert list(rows) == names
    assert all(r["error"] is None and len(r["times"]) == 2 for r in rows.values())

    mlp = gpu_models.TRAINING["mlp"]
    per_step = _warm_launches(mlp.luxnn())
    luxnn, peer = rows[names[0]]["memory"], rows[names[1]]["memory"]
    assert luxnn["kernels_per_step"] == per_step and peer["kernels_per_step"] == 2
    assert peer["peak_reserved"] == PEER_RESERVED
    parameters_and_moments = 3 * 4 * (784 * 256 + 256 + 256 * 10 + 10)
    assert luxnn["peak_reserved"] > parameters_and_moments and luxnn["first_step"] > 0
    assert rows[names[2]]["memory"]["peak_reserved"] is None  # not counted for the basics

    table = [line for line in out.splitlines() if line.startswith("|")]
    assert [c.strip() for c in table[0].strip("|").split("|")] == [
        "name", "time", "time / pytorch eager", "CUDA kernels per step", "kernels / pytorch eager",
        "peak reserved", "reserved / pytorch eager", "first step",
    ]  # fmt: skip
    cells = [c.strip() for c in table[2].strip("|").split("|")]
    assert cells[0] == names[0] and " ± " in cells[1] and " ± " in cells[2]
    assert cells[3:5] == [str(per_step), stats.significant(per_step / 2, 3)]
    assert cells[5] == stats.format_bytes(luxnn["peak_reserved"])
    assert cells[6] == stats.significant(luxnn["peak_reserved"] / PEER_RESERVED, 3)
    peer_cells = [c.strip() for c in table[3].strip("|").split("|")]
    assert peer_cells[2] == "" and peer_cells[3] == "2" and peer_cells[5] == "1.05 MB"
    assert len({len(line) for line in table}) == 1  # padded to equal widths
    assert "GPU: CUDA device 0, CuPy 14.0.0-simulated" in out
    assert main(["compare", str(path), str(path)]) == 0  # two GPU runs compare by time alone
    compared = capsys.readouterr().out
    assert "| gpu/training/mlp (luxnn) " in compared and "Memory:" not in compared


def test_without_torchs_cuda_its_rows_and_the_kernel_counts_are_named_as_not_run(sim_gpu, monkeypatch, capsys):
    monkeypatch.setattr(gpu_models, "torch_cuda", lambda: None)
    assert main(["bench", "--device", "gpu", "--quick", "--rounds", "1", "--filter", "basics/conv"]) == 0
    out = capsys.readouterr().out
    assert "not run (needs torch with CUDA): gpu/basics/conv (pytorch eager)" in out
    assert "CUDA kernels not counted" in out
    row = next(line for line in out.splitlines() if line.startswith("| gpu/basics/conv (luxnn)"))
    assert [c.strip() for c in row.strip("|").split("|")][3] == "—"


def test_a_row_that_fails_is_reported_in_its_cell_and_the_others_run(sim_gpu, fake_torch, monkeypatch, capsys):
    def broken(*_args):
        raise ValueError("no such kernel")

    monkeypatch.setattr(gpu_models, "torch_basic", broken)
    assert main(["bench", "--device", "gpu", "--quick", "--rounds", "1", "--filter", "basics/dense"]) == 0
    out = capsys.readouterr().out
    table = {cells[0]: cells for cells in ([c.strip() for c in line.strip("|").split("|")] for line in out.splitlines() if line.startswith("| gpu/"))}
    assert table["gpu/basics/dense (pytorch eager)"][1] == "error: ValueError: no such kernel"
    assert " ± " in table["gpu/basics/dense (luxnn)"][1] and table["gpu/basics/dense (luxnn)"][2] == ""


def test_a_filter_that_matches_no_gpu_row_names_the_gpu_rows(sim_gpu, capsys):
    assert main(["bench", "--device", "gpu", "--filter", "training/resnet"]) == 2
    err = capsys.readouterr().err
    assert "matches no row" in err and "gpu/training/lstm (pytorch eager)" in err and "time_to_load" not in err


@pytest.mark.parametrize("name", list(gpu_models.TRAINING))
def test_each_pytorch_peer_trains_its_rows_network_on_the_cpu(name, torch):
    row = gpu_models.TRAINING[name]
    step = row.torch(device="cpu", batch=4)
    step()
    step()
    assert step.peak_reserved() is None


@pytest.mark.parametrize("name", ["dense", "conv", "MHA"])
def test_each_pytorch_basic_runs_on_the_cpu(name, torch):
    outputs = gpu_models.torch_basic(name, device="cpu")()
    y = outputs[0] if isinstance(outputs, tuple) else outputs
    assert not y.requires_grad and y.shape[0] == {"dense": 3, "conv": 4, "MHA": 2}[name]


def test_kernel_events_are_the_devices_kernels_without_copies_and_memsets():
    event = lambda name, device: types.SimpleNamespace(name=name, device_type=f"DeviceType.{device}")  # noqa: E731
    events = [event("aten::addmm", "CPU"), event("sgemm_128x64", "CUDA"), event("luxnn_adam", "CUDA"),
              event("Memcpy DtoH (Device -> Pageable)", "CUDA"), event("Memset (Device)", "CUDA")]  # fmt: skip

    class Profile:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def events(self):
            return events

    synced = []
    assert gpu.cuda_kernels(lambda: None, 2, lambda: synced.append(1), Profile) == 1.0  # 2 kernels over 2 calls
    assert synced == [1]


# -- launch budgets of the bench's models ------------------------------------------------------

# Launches per training step (kernels, fills and cuBLAS calls) of each `luxnn bench --device
# gpu` training row's model at its real layer sizes on a batch of BATCH (the rows launch
# the same on any batch: checked below). Issue 26's targets are at most 1.5x PyTorch eager's
# CUDA kernels per step on an H200: MLP 40 (PyTorch's 27 kernels), CNN 72 (48), attention
# 109 (73), LSTM 440 (293); this simulator counted 45, 150 (313 at batch 128), 196 and 2294
# before the CUDA implementations of ops/cuda and the fused optimiser. The guard is today's
# counts plus MARGIN.
TARGETS = {"mlp": 40, "mlp-wide": 40, "cnn": 72, "attention": 109, "lstm": 440}
LAUNCHES = {"mlp": 16, "mlp-wide": 22, "cnn": 37, "attention": 65, "lstm": 281}
MARGIN = 1.1
BATCH = 4


def _device_cache() -> memory.AllocCache:
    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = FakeDriver().bind
    return cache


@functools.lru_cache(maxsize=None)
def _launches_per_step(name: str, batch: int | None = None) -> tuple[int, ...]:
    """Launches in each of 3 training steps of the row `name` on the simulated device (its
    own batch size if `batch` is None); the fixture `sim_gpu` must be active."""
    step = gpu_models.TRAINING[name].luxnn(_device_cache(), batch=batch)
    launches = []
    for _ in range(3):
        with sim_cupy.counting() as counts:
            step()
        launches.append(_launches(counts))
    return tuple(launches)


@pytest.mark.parametrize("name", list(gpu_models.TRAINING))
def test_launches_per_training_step_of_each_bench_model_stay_under_todays_counts(name, sim_gpu):
    launches = _launches_per_step(name, BATCH)
    print(f"{name}: {launches[-1]} launches per training step ({launches})")
    assert launches[1] == launches[2], f"{name}: the same work every step, got {launches}"
    assert launches[-1] <= min(LAUNCHES[name] * MARGIN, TARGETS[name])


@pytest.mark.parametrize("name, batch", [("mlp", None), ("cnn", 32)])
def test_launches_do_not_depend_on_the_batch(name, batch, sim_gpu):
    # `batch` None: the row's own; the CNN at 32, a cheaper size than its 128.
    small, large = _launches_per_step(name, BATCH)[-1], _launches_per_step(name, batch)[-1]
    assert small == large, f"{name}: {small} launches a step on a batch of {BATCH}, {large} on {batch or 'its own'}"
