"""What a result was measured on: the machine, the versions, the BLAS kernel and threads."""

from __future__ import annotations

import os
import platform
import sys
from typing import Any

ENVIRONMENT = (
    "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE", "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
)  # fmt: skip
"""Environment variables that change the figures; the result records those that are set."""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def memory_total() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """The CPU, cores, memory, OS and the load average (1, 5, 15 minutes) right now."""
    affinity = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "memory_bytes": memory_total(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def blas() -> list[dict[str, Any]]:
    """The thread pools loaded in this process (BLAS and OpenMP), by threadpoolctl: library,
    version, kernel ("architecture") and threads. Empty without threadpoolctl."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return []
    keys = ("user_api", "internal_api", "version", "architecture", "num_threads", "threading_layer", "prefix")
    return [{k: info.get(k) for k in keys} for info in threadpool_info()]


def blas_summary(pools: list[dict[str, Any]]) -> str:
    """One line: ``openblas 0.3.31 kernel=SkylakeX threads=2``."""
    parts = [
        f"{p['internal_api']} {p.get('version')} kernel={p.get('architecture')} threads={p.get('num_threads')}"
        for p in pools
        if p.get("user_api") == "blas"
    ]
    return "; ".join(parts) or "unknown (threadpoolctl not installed)"


def blas_threads() -> int:
    """The threads of NumPy's BLAS (the usable CPUs if threadpoolctl cannot tell)."""
    threads = [p["num_threads"] for p in blas() if p.get("user_api") == "blas" and p.get("num_threads")]
    return threads[0] if threads else len(os.sched_getaffinity(0))


def versions() -> dict[str, Any]:
    """luxnn (version and where it was imported from), NumPy, and PyTorch if it is loaded."""
    import numpy as np

    import luxnn

    out = {"luxnn": luxnn.__version__, "luxnn_path": os.path.dirname(luxnn.__file__), "numpy": np.__version__}
    if hasattr(luxnn, "num_threads"):  # revisions before luxnn.parallel have no threads of their own
        out["luxnn_threads"] = luxnn.num_threads()
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = torch.__version__
        out["torch_threads"] = torch.get_num_threads()
    return out


def environment() -> dict[str, str]:
    return {k: os.environ[k] for k in ENVIRONMENT if k in os.environ}
