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
import weakref

import pytest

import luxnn as lx
from luxnn import memory
from luxnn.bench import gpu, gpu_models, stats
from luxnn.cli import main
from luxnn.memory import cupy_backend

import sim_cupy
import sim_nvmath
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


PEER_RESERVED, PEER_GRAPH_RESERVED = 1 << 20, 3 << 20
PEER_WARMUP = 3


@pytest.fixture
def fake_torch(monkeypatch):
    """PyTorch's rows as two simulated launches a step (a fill and a kernel) holding
    `PEER_RESERVED` bytes, its graph row the same holding `PEER_GRAPH_RESERVED` and
    capturing at its call after `PEER_WARMUP`; its profiler `SimProfile`. Yields the log of
    the PyTorch steps built: (row, how many of the others were alive then)."""
    alive: weakref.WeakSet = weakref.WeakSet()
    built = []

    def device_step(name, reserved, step=lambda: sim_cupy.zeros(3) * 2.0, captures=None):
        made = gpu_models.DeviceStep(step, lambda: reserved, lambda: None, captures=captures)
        built.append((name, len(alive)))
        alive.add(made)
        return made

    def graph_peer(*_args):
        calls = []

        def step():
            calls.append(1)
            return sim_cupy.zeros(3) * 2.0

        return device_step("graph", PEER_GRAPH_RESERVED, step, captures=lambda: int(len(calls) > PEER_WARMUP))

    torch = types.SimpleNamespace(zeros=lambda *a, **k: None, version=types.SimpleNamespace(cuda="13.0"))
    monkeypatch.setattr(gpu_models, "torch_cuda", lambda: torch)
    monkeypatch.setattr(gpu_models.Classifier, "torch", lambda *_: device_step("eager", PEER_RESERVED))
    monkeypatch.setattr(gpu_models.Classifier, "torch_graph", graph_peer)
    monkeypatch.setattr(gpu_models, "torch_basic", lambda *_: device_step("basic", PEER_RESERVED))
    monkeypatch.setattr(gpu, "torch_profile", SimProfile)
    yield built


def _launches(counts) -> int:
    return counts["kernel"] + counts["fill"] + counts["cublas"]


def _warm_launches(step, calls: int = 3) -> int:
    for _ in range(calls):
        with sim_cupy.counting() as counts:
            step()
    return _launches(counts)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip("|").split("|")]


def test_the_gpu_bench_times_counts_and_compares_each_row_with_pytorchs(sim_gpu, fake_torch, tmp_path, capsys,
                                                                        monkeypatch):
    monkeypatch.setitem(sys.modules, "nvmath", sim_nvmath)  # as gpu_check.sh runs it: GEMMs capturable
    path = tmp_path / "gpu.json"
    args = ["bench", "--device", "gpu", "--quick", "--rounds", "2", "--filter", "training/mlp |basics/dense", "--json", str(path)]
    assert main(args) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert doc["device"] == "gpu" and doc["unavailable"] == []
    rows = {r["name"]: r for r in doc["rows"]}
    names = [f"gpu/training/mlp ({kind})" for kind in ("luxnn eager", "luxnn graphs", "pytorch eager", "pytorch graph")]
    names += ["gpu/basics/dense (luxnn)", "gpu/basics/dense (pytorch eager)"]
    assert list(rows) == names
    assert all(r["error"] is None and len(r["times"]) == 2 for r in rows.values())

    mlp = gpu_models.TRAINING["mlp"]
    per_step = _warm_launches(mlp.luxnn(graphs=False))
    eager, graphs, peer, peer_graph = (rows[n]["memory"] for n in names[:4])
    assert eager["kernels_per_step"] == per_step and peer["kernels_per_step"] == peer_graph["kernels_per_step"] == 2
    assert peer["peak_reserved"] == PEER_RESERVED and peer_graph["peak_reserved"] == PEER_GRAPH_RESERVED
    parameters_and_moments = 3 * 4 * (784 * 256 + 256 + 256 * 10 + 10)
    assert eager["peak_reserved"] > parameters_and_moments and eager["first_step"] > 0
    assert rows[names[4]]["memory"]["peak_reserved"] is None  # not counted for the basics
    # The capture step: timed for the rows that capture (PyTorch's graph at its call after
    # the warm-up; luxnn's, None where no graph was captured), absent for the others.
    assert peer_graph["capture_step"] > 0 and graphs["capture_step"] > 0
    assert all("capture_step" not in rows[n]["memory"] for n in (names[0], names[2], names[4], names[5]))
    # luxnn's graph statistics after the rounds; its eager row never captures.
    assert set(eager["graphs"]) == set(graphs["graphs"]) == set(lx.graphs.GraphStats._fields)
    assert eager["graphs"]["captures"] == eager["graphs"]["replays"] == 0
    assert graphs["graphs"]["replays"] > 0 and graphs["graphs"]["last_fallback"] is None
    assert peer["graphs"] is None and rows[names[4]]["memory"]["graphs"] is None
    # Each row counted alone: the PyTorch rows built anew for the counts found none of the
    # timed ones alive.
    assert fake_torch == [("eager", 0), ("graph", 1), ("eager", 0), ("graph", 0), ("basic", 0), ("basic", 0)]

    main_table, graph_table = out.split("CUDA graphs of luxnn's training states")
    table = [line for line in main_table.splitlines() if line.startswith("|")]
    assert _cells(table[0]) == gpu.HEADERS
    cells = {c[0]: c for c in map(_cells, table[2:]) if c[0] in rows}
    assert list(cells) == names
    for name in names:
        assert " ± " in cells[name][1]
        assert (" ± " in cells[name][2]) == (not name.endswith("(pytorch eager)"))  # over PyTorch eager's row of its group
        assert (" ± " in cells[name][3]) == (name == names[1])  # luxnn graphs over PyTorch's graph
    assert cells[names[0]][4:6] == [str(per_step), stats.significant(per_step / 2, 3)]
    assert cells[names[0]][6] == stats.format_bytes(eager["peak_reserved"])
    assert cells[names[0]][7] == stats.significant(eager["peak_reserved"] / PEER_RESERVED, 3)
    assert cells[names[2]][4:8] == ["2", "", "1.05 MB", ""]
    assert cells[names[3]][4:8] == ["2", "1.00", "3.15 MB", "3.00"]
    assert cells[names[3]][9] == stats.format_duration(peer_graph["capture_step"]) and cells[names[0]][9] == ""
    assert len({len(line) for line in table}) == 1  # padded to equal widths
    graph_table = [line for line in graph_table.splitlines() if line.startswith("|")]
    assert _cells(graph_table[0]) == gpu.GRAPH_HEADERS
    assert [_cells(line)[0] for line in graph_table[2:]] == names[:2]
    assert "GPU: CUDA device 0, CuPy 14.0.0-simulated" in out
    assert main(["compare", str(path), str(path)]) == 0  # two GPU runs compare by time alone
    compared = capsys.readouterr().out
    assert "| gpu/training/mlp (luxnn graphs) " in compared and "Memory:" not in compared


def _gpu_row(kind: str, ms: float, memory: dict | None = None) -> dict:
    return {"name": f"gpu/training/mlp ({kind})", "group": "gpu/training/mlp", "kind": "step", "params": {},
            "times": [[ms * 1e-3]] * 3, "inner": 1, "memory": memory, "error": None}  # fmt: skip


def test_the_gpu_table_gives_each_ratio_the_capture_step_and_why_a_row_fell_back():
    figures = {"kernels_per_step": 4.0, "peak_reserved": 2e6, "bytes": None, "first_step": 0.5}
    fell_back = {"captures": 0, "replays": 0, "eager": 30, "kept": 0, "last_fallback": "float(loss) | a host\nread"}
    doc = {"suite": "quick", "versions": {"gpu": "H200", "cupy": "14.2"}, "rows": [
        _gpu_row("luxnn eager", 2.0, {**figures, "graphs": {**fell_back, "last_fallback": None}}),
        _gpu_row("luxnn graphs", 0.5, {**figures, "kernels_per_step": 1.0, "capture_step": None, "graphs": fell_back}),
        _gpu_row("pytorch eager", 1.0, {**figures, "peak_reserved": 4e6, "graphs": None}),
        _gpu_row("pytorch graph", 0.25, {**figures, "capture_step": 0.02, "graphs": None}),
    ]}  # fmt: skip
    out = gpu.report(doc, markdown=True)
    main_table, graph_table = out.split("CUDA graphs of luxnn's training states")
    table = {c[0]: c for c in map(_cells, main_table.splitlines()) if c[0].startswith("gpu/")}
    eager, graphs, peer, peer_graph = (table[r["name"]] for r in doc["rows"][:4])
    assert eager[2:4] == ["2.00 ± 0", ""] and graphs[2:4] == ["0.500 ± 0", "2.00 ± 0"]
    assert peer[2:] == ["", "", "4", "", "4.00 MB", "", "500 ms", ""]
    assert peer_graph[2] == "0.250 ± 0" and peer_graph[7:] == ["0.500", "500 ms", "20.0 ms"]
    assert graphs[4:6] == ["1", "0.250"] and graphs[9] == "none"
    assert "no graph was captured within 16 calls" in out
    rows = [_cells(line) for line in graph_table.splitlines() if line.startswith("| gpu/")]
    assert rows == [["gpu/training/mlp (luxnn eager)", "0", "0", "30", "0", ""],
                    ["gpu/training/mlp (luxnn graphs)", "0", "0", "30", "0", "float(loss) / a host read"]]


def test_without_torchs_cuda_its_rows_and_the_kernel_counts_are_named_as_not_run(sim_gpu, monkeypatch, capsys):
    monkeypatch.setattr(gpu_models, "torch_cuda", lambda: None)
    assert main(["bench", "--device", "gpu", "--quick", "--rounds", "1", "--filter", "basics/conv"]) == 0
    out = capsys.readouterr().out
    assert "not run (needs torch with CUDA): gpu/basics/conv (pytorch eager)" in out
    assert "CUDA kernels not counted" in out
    row = next(line for line in out.splitlines() if line.startswith("| gpu/basics/conv (luxnn)"))
    assert _cells(row)[gpu.HEADERS.index("CUDA kernels per step")] == "—"


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
    step = gpu_models.TRAINING[name].luxnn(_device_cache(), batch=batch, graphs=False)
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
