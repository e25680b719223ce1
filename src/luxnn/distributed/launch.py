"""Starting ranks: finding ``mpiexec``, and ``luxnn demo --workers N``.

``luxnn demo --workers N`` runs ``mpiexec -n N python -m mpi4py -m
luxnn.distributed.launch demo OPTIONS``: every rank trains the digits demo on its share
of each batch (`luxnn.demo.run` with a backend), and rank 0 prints the demo's figures and
the time spent in collectives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from typing import Any

__all__ = ["mpiexec", "missing", "run_demo"]


def mpiexec() -> str | None:
    """The ``mpiexec`` beside this Python (where pip's mpich puts it), else the one on PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return beside if os.access(beside, os.X_OK) else shutil.which("mpiexec")


def missing() -> str | None:
    """What is missing to start ranks (mpi4py, mpiexec), or None."""
    if importlib.util.find_spec("mpi4py") is None:
        return "mpi4py is not installed: pip install 'luxnn[mpi]'"
    if mpiexec() is None:
        return "no mpiexec found beside this Python or on PATH: pip install 'luxnn[mpi]'"
    return None


def run_demo(workers: int, options: dict[str, Any]) -> int:
    """Run `luxnn.demo.run(**options)` on `workers` ranks; returns mpiexec's exit status."""
    command = [mpiexec(), "-n", str(workers), sys.executable, "-m", "mpi4py", "-m", __name__, "demo", json.dumps(options)]
    return subprocess.call(command)


def _demo_rank(options: dict[str, Any]) -> None:
    from .. import demo
    from .backend import initialize

    backend = initialize("nccl" if options.get("device") == "gpu" else "mpi")
    figures = demo.run(**options, backend=backend)
    if backend.rank == 0:
        print(demo.report(figures), flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] != ["demo"] or len(sys.argv) != 3:
        sys.exit("usage: mpiexec -n N python -m mpi4py -m luxnn.distributed.launch demo OPTIONS_JSON")
    _demo_rank(json.loads(sys.argv[2]))
