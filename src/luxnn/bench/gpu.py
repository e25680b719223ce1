"""``luxnn bench --device gpu``: the training rows and the basics on a CUDA GPU, beside
PyTorch on the same GPU in the same process.

Rows (`gpu_models`): for each of `gpu_models.TRAINING`, ``gpu/training/NAME (luxnn eager)``
(its TrainState made with ``graphs=False``), ``(luxnn graphs)`` (``graphs=True``: its warm
steps replayed as CUDA graphs), ``(pytorch eager)`` and ``(pytorch graph)`` (the whole step
captured as one CUDA graph); ``gpu/basics/NAME (luxnn)`` and ``(pytorch eager)`` for
Lux.jl's forward calls. The PyTorch rows need torch with CUDA; without it they are left out
and named.

- Time: as the CPU suite's (`runner`): warm-up and calibration, then interleaved rounds,
  each cell the median of the round medians ± their IQR. Each sample ends with a device
  synchronisation inside its time, so that it counts the GPU work its calls launched;
  during calibration every call is synchronised.
- First step: the first call after set-up, synchronised, in the same process: CuPy
  compiles a kernel at its first launch with given dtypes (unless its disk cache has it),
  PyTorch picks its cuBLAS and cuDNN algorithms. Reported apart, never in the medians.
- Capture step: for a row replayed as CUDA graphs, the first call that captured one,
  synchronised (luxnn's: once a step was served wholly by its allocator cache's plan;
  PyTorch's: after its eager warm-up steps), within `CAPTURE_CALLS` calls after the first.
  Reported apart, never in the medians.
- CUDA kernels per step: the kernel events torch.profiler records over `KERNEL_CALLS`
  calls (its CUPTI sees every kernel of the process, CuPy's too, and those a graph
  replays), copies and memsets not counted, divided by the calls. Counted only where torch
  with CUDA is installed.
- Peak reserved: over `MEMORY_CALLS` calls, bytes held from the device at the most:
  luxnn's allocator cache's peak reserved plus the arrays the training state keeps
  outside it; PyTorch's ``torch.cuda.max_memory_reserved`` (its unused cached blocks
  released first). Not counted for the basics.
- Kernels and peak reserved are counted after the rounds, each row built anew alone (the
  timed steps released first, so that no other row's tensors count in PyTorch's figures)
  and warmed up until its graphs, if any, are captured.
- Graphs: `luxnn.graphs.stats` of each luxnn training row's state after its rounds:
  captures, replays, eager steps, graphs kept, and why the last step that could not be
  captured ran eagerly.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from typing import Any, Callable

from . import gpu_models, models, suite
from .compare import header_lines, render_table
from .runner import LocalWorker, Session, Timing, calibrate, describe_error
from .stats import format_bytes, format_count, format_duration, format_ratio, format_time, ratio, significant, summarize

LUXNN, LUXNN_EAGER, LUXNN_GRAPHS = "luxnn", "luxnn eager", "luxnn graphs"
TORCH, TORCH_GRAPH = "pytorch eager", "pytorch graph"
KERNEL_CALLS = 3
MEMORY_CALLS = 3
CAPTURE_CALLS = 16
NOT_COUNTED = "—"


def device_problem() -> str | None:
    """Why no CUDA GPU is usable through CuPy here, or None when one is."""
    from luxnn.devices import gpu_device

    try:
        gpu_device(force=True)
    except RuntimeError as e:
        return str(e.__cause__ or e)
    return None


@dataclass(frozen=True)
class _TorchVariant(suite.Variant):
    """A PyTorch row: available where torch has a usable CUDA device."""

    @property
    def available(self) -> bool:
        return gpu_models.torch_cuda() is not None


def groups() -> list[suite.Group]:
    """The GPU suite's groups, in the order they run and print: luxnn's rows, then PyTorch's."""
    out = []
    for name, row in gpu_models.TRAINING.items():
        group = f"gpu/training/{name}"
        params = {"batch": row.shape[0], "input": list(row.shape[1:]), "classes": row.classes,
                  "loss": "cross-entropy", "optimizer": "adam", "dtype": "float32"}
        out.append(suite.Group(group, (
            suite.Variant(f"{group} ({LUXNN_EAGER})", lambda _cache, row=row: row.luxnn(graphs=False), None),
            suite.Variant(f"{group} ({LUXNN_GRAPHS})", lambda _cache, row=row: row.luxnn(graphs=True), None),
            _TorchVariant(f"{group} ({TORCH})", lambda _cache, row=row: row.torch(), None),
            _TorchVariant(f"{group} ({TORCH_GRAPH})", lambda _cache, row=row: row.torch_graph(), None),
        ), params))  # fmt: skip
    for name in models.BASICS:
        group = f"gpu/basics/{name}"
        out.append(suite.Group(group, (
            suite.Variant(f"{group} ({LUXNN})", lambda _cache, name=name: gpu_models.luxnn_basic(name), None),
            _TorchVariant(f"{group} ({TORCH})", lambda _cache, name=name: gpu_models.torch_basic(name), None),
        )))  # fmt: skip
    return out


def select(pattern: str | None) -> suite.Selection:
    """The GPU rows whose names `pattern` matches (`suite.select`'s rules)."""
    return suite.select_from(groups(), pattern, with_time_to_load=False)


# ---- counting kernels --------------------------------------------------------------------


def torch_profile() -> Any:
    """torch.profiler recording the CUDA activity of the whole process (CUPTI)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    return torch.profiler.profile(activities=activities)


def is_kernel(event: Any) -> bool:
    """A profiler event that is a kernel run on the device (not a copy or a memset)."""
    return str(event.device_type).endswith("CUDA") and not event.name.startswith(("Memcpy", "Memset"))


def cuda_kernels(step: Callable[[], Any], calls: int, sync: Callable[[], Any], profile: Callable[[], Any]) -> float:
    """CUDA kernels per call of `step`: those that `profile()` (a context manager with
    torch.profiler's ``events()``) records over `calls` calls, synchronised."""
    with profile() as prof:
        for _ in range(calls):
            step()
        sync()
    return sum(map(is_kernel, prof.events())) / calls


# ---- running --------------------------------------------------------------------------------


class GPUSession(Session):
    """A group's rows on the GPU: `runner.Session`'s rounds, each sample synchronised, with
    the first step and the capture step timed at set-up, and the kernels and peak reserved
    counted after the rounds on each row built anew alone."""

    def __init__(self, group: suite.Group, names: list[str], timing: Timing, sync: Callable[[], Any],
                 profile: Callable[[], Any] | None) -> None:
        self.sync, self.profile = sync, profile
        self.first_step: dict[str, float] = {}
        self.capture_step: dict[str, float | None] = {}
        super().__init__(group, names, timing)

    def _timed(self, step: Callable[[], Any]) -> float:
        t0 = time.perf_counter()
        step()
        self.sync()
        return time.perf_counter() - t0

    def _setup(self, variant: suite.Variant) -> tuple[Callable[[], Any], tuple[int, int, float]]:
        step = variant.build("default")
        self.first_step[variant.name] = first = self._timed(step)
        if step.captures is not None:
            self.capture_step[variant.name] = first if step.captures() else self._capturing_call(step)

        def synced() -> None:
            step()
            self.sync()

        return step, calibrate(synced, self.timing, self.group.warmup_calls)

    def _capturing_call(self, step: gpu_models.DeviceStep) -> float | None:
        """Seconds of the first of the next `CAPTURE_CALLS` calls of `step` that captures a
        graph; None if none does."""
        for _ in range(CAPTURE_CALLS):
            seconds = self._timed(step)
            if step.captures():
                return seconds
        return None

    def _warm_up(self, step: gpu_models.DeviceStep) -> None:
        """The group's warm-up calls; then, for a step that captures graphs, calls until two
        in a row after its first capture capture nothing (at most `CAPTURE_CALLS`)."""
        for _ in range(self.group.warmup_calls):
            step()
        quiet = 0
        for _ in range(CAPTURE_CALLS if step.captures is not None else 0):
            before = step.captures()
            step()
            quiet = quiet + 1 if before and step.captures() == before else 0
            if quiet == 2:
                break
        self.sync()

    def _count(self, variant: suite.Variant) -> dict[str, Any]:
        """CUDA kernels per step and peak reserved of `variant` built anew and warmed up."""
        step = variant.build("default")
        self._warm_up(step)
        kernels = None if self.profile is None else cuda_kernels(step, KERNEL_CALLS, self.sync, self.profile)
        step.reset_peaks()
        for _ in range(MEMORY_CALLS):
            step()
        self.sync()
        return {"kernels_per_step": kernels, "peak_reserved": step.peak_reserved()}

    def _after_rounds(self, name: str) -> dict[str, Any]:
        """The figures of row `name` taken at set-up and from its timed step."""
        step = self.steps[name]
        captured = {"capture_step": self.capture_step[name]} if name in self.capture_step else {}
        try:
            graphs = None if step.graph_stats is None else step.graph_stats()
        except Exception as e:  # noqa: BLE001 - reported in the row, as the time is
            return {"error": describe_error(e)}
        return {"first_step": self.first_step[name], **captured, "graphs": graphs}

    def memory(self) -> dict[str, Any]:
        """Per row: first step and capture step (s; the latter only for rows that capture,
        None when none of their calls did), `luxnn.graphs.stats` after the rounds as a dict
        (None: not a luxnn training row), CUDA kernels per step and peak reserved (bytes;
        None where not counted). ``bytes`` is None: no host allocations are counted on the
        GPU. Releases the timed steps: the counts are made on each row built anew alone."""
        out = {name: self._after_rounds(name) for name in self.steps}
        self.steps.clear()
        for name, figures in out.items():
            gc.collect()  # the rows counted before, and their tensors, gone
            if "error" in figures:
                continue
            try:
                figures.update(self._count(self.group.variant(name)), bytes=None)
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": describe_error(e)}
        return out


class GPUWorker(LocalWorker):
    """Runs the GPU groups in this process for `runner.run`. `profile`: what counts kernels
    (`torch_profile` by default where torch has CUDA; None: kernels not counted)."""

    def __init__(self, timing: Timing, profile: Callable[[], Any] | None | str = "torch") -> None:
        import cupy

        super().__init__(True, timing)
        self.cupy, self.sync = cupy, cupy.cuda.runtime.deviceSynchronize
        torch = gpu_models.torch_cuda()
        self.profile = (torch_profile if torch is not None else None) if profile == "torch" else profile
        # Start both libraries' CUDA contexts now, not in whichever row's first step comes first.
        cupy.zeros(1)
        if torch is not None:
            torch.zeros(1, device="cuda")
        self.sync()

    def _session(self, group: str, names: list[str]) -> GPUSession:
        found = next(g for g in groups() if g.name == group)
        return GPUSession(found, names, self.timing, self.sync, self.profile)

    def teardown(self, group: str) -> None:
        super().teardown(group)
        self.cupy.get_default_memory_pool().free_all_blocks()

    def info(self) -> dict[str, Any]:
        info = super().info()
        info["versions"].update(cupy=self.cupy.__version__, gpu=_gpu_name(self.cupy))
        torch = gpu_models.torch_cuda()
        if torch is not None:
            info["versions"]["torch_cuda"] = torch.version.cuda
        return info


def _gpu_name(cupy: Any) -> str:
    runtime = cupy.cuda.runtime
    device = runtime.getDevice()
    properties = getattr(runtime, "getDeviceProperties", None)
    if properties is None:  # a simulated device (the tests')
        return f"CUDA device {device}"
    name = properties(device)["name"]
    return name.decode() if isinstance(name, bytes) else str(name)


# ---- the table -----------------------------------------------------------------------------

HEADERS = ["name", "time", "time / pytorch eager", "time / pytorch graph", "CUDA kernels per step",
           "kernels / pytorch eager", "peak reserved", "reserved / pytorch eager", "first step", "capture step"]
GRAPH_HEADERS = ["name", "captures", "replays", "eager steps", "graphs kept", "last fallback"]


def report(document: dict[str, Any], *, markdown: bool = False) -> str:
    """The tables of a GPU run: per row its time, CUDA kernels per step, peak reserved, first
    step and capture step, each figure over PyTorch eager's row of the same group, and the
    time of luxnn's graphs row over PyTorch's graph row; then luxnn's graph statistics."""
    rows = document["rows"]
    eager_peers, graph_peers = _peers(rows, TORCH), _peers(rows, TORCH_GRAPH)
    table = []
    for r in rows:
        m = r.get("memory") or {}
        if r.get("error") or "error" in m:
            table.append([r["name"], "error: " + _one_line(r.get("error") or m["error"]), *[""] * (len(HEADERS) - 2)])
            continue
        eager = None if _is(r, TORCH) else eager_peers.get(r["group"])
        graph = graph_peers.get(r["group"]) if _is(r, LUXNN_GRAPHS) else None
        eager_m = (eager or {}).get("memory") or {}
        table.append([
            r["name"], format_time(*summarize(r["times"])), _time_ratio(r, eager), _time_ratio(r, graph),
            _figure(m.get("kernels_per_step"), format_count), _ratio(m.get("kernels_per_step"), eager_m.get("kernels_per_step")),
            _figure(m.get("peak_reserved"), format_bytes), _ratio(m.get("peak_reserved"), eager_m.get("peak_reserved")),
            _figure(m.get("first_step"), format_duration), _capture_cell(m),
        ])  # fmt: skip
    v = document.get("versions", {})
    torch = f", torch {v.get('torch', '?')} (CUDA {v['torch_cuda']})" if "torch_cuda" in v else ""
    out = header_lines([("run", document)], markdown)
    gpu_line = f"GPU: {v.get('gpu', '?')}, CuPy {v.get('cupy', '?')}{torch}"
    out += [f"- {gpu_line}" if markdown else gpu_line, ""]
    out.append(render_table(HEADERS, table, markdown))
    graph_rows = [[r["name"], *map(str, (g["captures"], g["replays"], g["eager"], g["kept"])), _one_line(g["last_fallback"] or "")]
                  for r in rows if (g := (r.get("memory") or {}).get("graphs"))]  # fmt: skip
    if graph_rows:
        out += ["", "CUDA graphs of luxnn's training states after their rounds (luxnn.graphs.stats):", ""]
        out.append(render_table(GRAPH_HEADERS, graph_rows, markdown))
    notes = []
    if document.get("unavailable"):
        notes.append(f"not run (needs torch with CUDA): {', '.join(document['unavailable'])}")
    if any((r.get("memory") or {}).get("kernels_per_step", 0) is None for r in rows):
        notes.append("CUDA kernels not counted: torch.profiler counts them, and needs torch with CUDA")
    if any((r.get("memory") or {}).get("capture_step", 0) is None for r in rows):
        notes.append(f"capture step 'none': no graph was captured within {CAPTURE_CALLS} calls after the first")
    return "\n".join(out + ([""] + notes if notes else []))


def _is(row: dict[str, Any], kind: str) -> bool:
    return row["name"].endswith(f"({kind})")


def _peers(rows: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    """The row of each group named `kind` that ran."""
    return {r["group"]: r for r in rows if _is(r, kind) and not r.get("error")}


def _time_ratio(row: dict[str, Any], peer: dict[str, Any] | None) -> str:
    return format_ratio(*ratio(*summarize(row["times"]), *summarize(peer["times"]))) if peer else ""


def _figure(value: float | None, fmt: Callable[[float], str]) -> str:
    return NOT_COUNTED if value is None else fmt(value)


def _ratio(value: float | None, peer: float | None) -> str:
    return significant(value / peer, 3) if value is not None and peer else ""


def _capture_cell(memory: dict[str, Any]) -> str:
    if "capture_step" not in memory:  # a row that never captures
        return ""
    seconds = memory["capture_step"]
    return "none" if seconds is None else format_duration(seconds)


def _one_line(text: str) -> str:
    """`text` fit for a table cell: one line, no pipe."""
    return " ".join(text.split()).replace("|", "/")


def row_names() -> list[str]:
    """Every row of the GPU suite."""
    return [v.name for g in groups() for v in g.variants]
