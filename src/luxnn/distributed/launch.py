"""Starting ranks: the launcher of mpi4py's MPI library, and ``luxnn demo --workers N``.

Ranks must be started by the ``mpiexec`` of the MPI library that mpi4py loads (MPICH's
Hydra for MPICH, Open MPI's for Open MPI): another one starts N separate one-rank jobs or
refuses to start. `launcher` asks mpi4py for its library (``python -m mpi4py
--mpi-library`` and ``--mpi-lib-version``) and takes the first ``mpiexec`` of the same
family beside that library, beside this Python, or on PATH, whatever comes first on PATH
(with mpi4py before 4.0, which cannot name its library, beside this Python or on PATH).
Open MPI refuses to run as root unless told: `launcher` tells it when this process is root.

``luxnn demo --workers N`` runs ``LAUNCHER -n N python -m mpi4py -m
luxnn.distributed.launch demo OPTIONS``: every rank trains the digits demo on its share
of each batch (`luxnn.demo.run` with a backend), and rank 0 prints the demo's figures and
the time spent in collectives.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["launcher", "missing", "run_demo"]

_NAMES = ("mpiexec", "mpirun", "mpiexec.hydra", "mpiexec.mpich", "mpiexec.openmpi", "mpirun.openmpi")


def _family(version: str) -> str | None:
    """The MPI family that a library's or a launcher's version text names ("openmpi" or
    "mpich", Intel MPI's included), or None."""
    if any(word in version for word in ("Open MPI", "OpenRTE", "PRRTE", "prterun")):
        return "openmpi"
    if any(word in version for word in ("MPICH", "HYDRA", "Intel(R) MPI")):
        return "mpich"
    return None


# Asked in a child process: loading mpi4py's MPI here would tie this process to it.
_VERSION = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"


def _ask(*args: str) -> str | None:
    try:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


@functools.cache
def _library() -> tuple[str, str | None] | None:
    """``(path, family)`` of the MPI library mpi4py loads in this Python (the path is ""
    where mpi4py cannot say it: before 4.0), or None without mpi4py or its library."""
    if importlib.util.find_spec("mpi4py") is None:
        return None
    version = _ask("-c", _VERSION)
    if version is None:
        return None
    return (_ask("-m", "mpi4py", "--mpi-library") or "").strip(), _family(version)


@functools.cache
def _launcher_family(path: str) -> str | None:
    try:
        done = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return _family(done.stdout + done.stderr)


def _candidates(library: str) -> list[str]:
    """Launchers to try, in order: beside the library (its prefix's bin, also through
    symbolic links), beside this Python, then on PATH."""
    dirs = [os.path.join(os.path.dirname(os.path.dirname(p)), "bin") for p in (library, os.path.realpath(library))] if library else []
    dirs += [os.path.dirname(sys.executable), *os.environ.get("PATH", "").split(os.pathsep)]
    found = []
    for directory in dict.fromkeys(d for d in dirs if d):
        for name in _NAMES:
            path = os.path.join(directory, name)
            if os.path.isfile(path) and os.access(path, os.X_OK) and path not in found:
                found.append(path)
    return found


def launcher(ranks: int) -> list[str]:
    """The command that starts `ranks` ranks with the launcher of mpi4py's MPI library
    (see the module's docstring); a `RuntimeError` saying what is missing if none is found.

    >>> launcher(2)  # doctest: +SKIP
    ['/venv/bin/mpiexec', '-n', '2']
    """
    problem = missing()
    if problem is not None:
        raise RuntimeError(problem)
    library, family = _library()
    path = next(p for p in _candidates(library) if family is None or _launcher_family(p) == family)
    root = ["--allow-run-as-root"] if family == "openmpi" and hasattr(os, "geteuid") and os.geteuid() == 0 else []
    return [path, *root, "-n", str(ranks)]


def missing() -> str | None:
    """What is missing to start ranks (mpi4py, its MPI library's launcher), or None."""
    library = _library()
    if library is None:
        return "mpi4py is not installed (or finds no MPI library): pip install 'luxnn[mpi]'"
    path, family = library
    if not any(family is None or _launcher_family(p) == family for p in _candidates(path)):
        return (
            f"no {family or 'MPI'} mpiexec found beside mpi4py's MPI library ({path or 'path unknown'}), this Python or on PATH: "
            f"pip install 'luxnn[mpi]'"
        )
    return None


def run_demo(workers: int, options: dict[str, Any]) -> int:
    """Run `luxnn.demo.run(**options)` on `workers` ranks; returns mpiexec's exit status."""
    command = [*launcher(workers), sys.executable, "-m", "mpi4py", "-m", __name__, "demo", json.dumps(options)]
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
