"""``luxnn bench --device gpu``: the training rows and the basics on a CUDA GPU, beside
PyTorch eager on the same GPU in the same process.

Rows (`gpu_models`): ``gpu/training/NAME (luxnn)`` and ``(pytorch eager)`` for each of
`gpu_models.TRAINING`, ``gpu/basics/NAME (...)`` for Lux.jl's forward calls. The PyTorch
rows need torch with CUDA; without it they are left out and named.

- Time: as the CPU suite's (`runner`): warm-up and calibration, then interleaved rounds,
  each cell the median of the round medians ± their IQR. Each sample ends with a device
  synchronisation inside its time, so that it counts the GPU work its calls launched;
  during calibration every call is synchronised.
- First step: the first call after set-up, synchronised, in the same process: CuPy
  compiles a kernel at its first launch with given dtypes (unless its disk cache has it),
  PyTorch picks its cuBLAS and cuDNN algorithms. Reported apart, never in the medians.
- CUDA kernels per step: the kernel events torch.profiler records over `KERNEL_CALLS`
  calls (its CUPTI sees every kernel of the process, CuPy's too), copies and memsets not
  counted, divided by the calls. Counted only where torch with CUDA is installed.
- Peak reserved: over `MEMORY_CALLS` calls after the rounds, bytes held from the device
  at the most: luxnn's allocator cache's peak reserved plus the arrays the training
  state keeps outside it; PyTorch's ``torch.cuda.max_memory_reserved`` (its unused
  cached blocks released first). Not counted for the basics.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from . import gpu_models, models, suite
from .compare import header_lines, render_table
from .runner import LocalWorker, Session, Timing, calibrate, describe_error
from .stats import format_bytes, format_count, format_duration, format_ratio, format_time, ratio, significant, summarize

LUXNN, TORCH = "luxnn", "pytorch eager"
KERNEL_CALLS = 3
MEMORY_CALLS = 3
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
    """The GPU suite's groups, in the order they run and print: luxnn's row, then PyTorch's."""
    out = []
    for name, row in gpu_models.TRAINING.items():
        group = f"gpu/training/{name}"
        params = {"batch": row.shape[0], "input": list(row.shape[1:]), "classes": row.classes,
                  "loss": "cross-entropy", "optimizer": "adam", "dtype": "float32"}
        out.append(suite.Group(group, (
            suite.Variant(f"{group} ({LUXNN})", lambda _cache, row=row: row.luxnn(), None),
            _TorchVariant(f"{group} ({TORCH})", lambda _cache, row=row: row.torch(), None),
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
    the first step timed at set-up and the kernels and peak reserved counted after."""

    def __init__(self, group: suite.Group, names: list[str], timing: Timing, sync: Callable[[], Any],
                 profile: Callable[[], Any] | None) -> None:
        self.sync, self.profile = sync, profile
        self.first_step: dict[str, float] = {}
        super().__init__(group, names, timing)

    def _setup(self, variant: suite.Variant) -> tuple[Callable[[], Any], tuple[int, int, float]]:
        step = variant.build("default")
        t0 = time.perf_counter()
        step()
        self.sync()
        self.first_step[variant.name] = time.perf_counter() - t0

        def synced() -> None:
            step()
            self.sync()

        return step, calibrate(synced, self.timing, self.group.warmup_calls)

    def memory(self) -> dict[str, Any]:
        """Per row: first step (s), CUDA kernels per step, peak reserved (bytes); None where
        not counted. ``bytes`` is None: no host allocations are counted on the GPU."""
        out: dict[str, Any] = {}
        for name, step in self.steps.items():
            try:
                kernels = None if self.profile is None else cuda_kernels(step, KERNEL_CALLS, self.sync, self.profile)
                step.reset_peaks()
                for _ in range(MEMORY_CALLS):
                    step()
                self.sync()
                out[name] = {"first_step": self.first_step[name], "kernels_per_step": kernels,
                             "peak_reserved": step.peak_reserved(), "bytes": None}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - reported in the row, as the time is
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


def report(document: dict[str, Any], *, markdown: bool = False) -> str:
    """The table of a GPU run: per row its time, CUDA kernels per step, peak reserved and
    first step, and for luxnn's rows each figure over PyTorch's row of the same group."""
    rows = document["rows"]
    peers = {r["group"]: r for r in rows if r["name"].endswith(f"({TORCH})") and not r.get("error")}
    table = []
    for r in rows:
        m = r.get("memory") or {}
        peer = peers.get(r["group"]) if r["name"].endswith(f"({LUXNN})") else None
        peer_m = (peer or {}).get("memory") or {}
        if r.get("error") or "error" in m:
            table.append([r["name"], "error: " + (r.get("error") or m["error"]), *[""] * 6])
            continue
        time_ratio = format_ratio(*ratio(*summarize(r["times"]), *summarize(peer["times"]))) if peer else ""
        table.append([
            r["name"], format_time(*summarize(r["times"])), time_ratio,
            _figure(m.get("kernels_per_step"), format_count), _ratio(m.get("kernels_per_step"), peer_m.get("kernels_per_step")),
            _figure(m.get("peak_reserved"), format_bytes), _ratio(m.get("peak_reserved"), peer_m.get("peak_reserved")),
            _figure(m.get("first_step"), format_duration),
        ])  # fmt: skip
    v = document.get("versions", {})
    torch = f", torch {v.get('torch', '?')} (CUDA {v['torch_cuda']})" if "torch_cuda" in v else ""
    out = header_lines([("run", document)], markdown)
    gpu_line = f"GPU: {v.get('gpu', '?')}, CuPy {v.get('cupy', '?')}{torch}"
    out += [f"- {gpu_line}" if markdown else gpu_line, ""]
    headers = ["name", "time", "time / pytorch eager", "CUDA kernels per step", "kernels / pytorch eager",
               "peak reserved", "reserved / pytorch eager", "first step"]
    out.append(render_table(headers, table, markdown))
    notes = []
    if document.get("unavailable"):
        notes.append(f"not run (needs torch with CUDA): {', '.join(document['unavailable'])}")
    if any((r.get("memory") or {}).get("kernels_per_step", 0) is None for r in rows):
        notes.append("CUDA kernels not counted: torch.profiler counts them, and needs torch with CUDA")
    return "\n".join(out + ([""] + notes if notes else []))


def _figure(value: float | None, fmt: Callable[[float], str]) -> str:
    return NOT_COUNTED if value is None else fmt(value)


def _ratio(value: float | None, peer: float | None) -> str:
    return significant(value / peer, 3) if value is not None and peer else ""


def row_names() -> list[str]:
    """Every row of the GPU suite."""
    return [v.name for g in groups() for v in g.variants]
