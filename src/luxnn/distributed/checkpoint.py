"""Checkpoints of a data-parallel run: one rank writes, every rank can read.

Every rank calls `save`; the replicas are equal, so rank `root` alone writes
`luxnn.save`'s file; the others wait until it is written (or its writing failed, which then raises on every rank rather than
leaving them waiting). Any rank reads it back with `luxnn.load`.
"""

from __future__ import annotations

import os
from typing import Any

from ..checkpoint import save as save_checkpoint
from ..ops import device_checks
from .backend import Backend, check_backend, check_root

__all__ = ["save"]


def save(backend: Backend, path: str | os.PathLike, ts: Any, *, root: int = 0) -> None:
    """Rank `root` writes `ts` to `path` (`luxnn.save`); every rank returns once the file
    is complete, or raises `RuntimeError` with `root`'s error if writing failed. A bad
    input a GPU's kernels found on any rank and no call reported yet
    (`luxnn.ops.device_checks`) raises `ValueError` on every rank, naming it, before
    anything is written: the allreduced parameters carry it to every rank.

    >>> dist.save(backend, "ckpt.safetensors", ts)  # doctest: +SKIP
    >>> ts = lx.load("ckpt.safetensors", like=ts)  # doctest: +SKIP
    """
    backend = check_backend(backend, "save")
    check_root(backend, "save", root)
    failure: Exception | None = None
    # A call of every rank: on rank `root` alone it would meet another call of the others
    # (`CallMismatch` on every rank) rather than leave them a message to take for theirs.
    with backend.call("save"):
        found = [(rank, problem) for rank, problem in enumerate(backend.allgather_object(_unreported())) if problem]
        if found:
            rank, problem = found[0]
            raise ValueError(f"save: nothing written: rank {rank}'s device found {problem}")
        if backend.rank == root:
            try:
                save_checkpoint(path, ts)
            except Exception as err:  # noqa: BLE001 - sent to every rank, raised there
                failure = err
        # The barrier: no rank returns (and reads) before the file is whole.
        error = backend.bcast_object(None if failure is None else f"{type(failure).__name__}: {failure}", root)
    if error is not None:
        raise RuntimeError(f"save: rank {root} could not write {os.fspath(path)}: {error}") from failure


def _unreported() -> str | None:
    """The first bad input this rank's device found and no call reported, or None."""
    try:
        device_checks.check_now()
    except ValueError as err:
        return str(err)
    return None
