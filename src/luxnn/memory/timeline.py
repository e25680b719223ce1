"""`plot_timeline`: a picture of a recording cache's memory over time."""

from __future__ import annotations

from os import PathLike
from typing import Any

from .cache import AllocCache, format_bytes

__all__ = ["plot_timeline"]


def plot_timeline(cache: AllocCache, path: str | PathLike | None = None) -> Any:
    """Draw bytes live and bytes reserved over time, with the scopes shaded; save it to
    `path` if given. Returns the matplotlib `Figure` (matplotlib is imported only here).

    The cache must have been created with ``record=True``.

    >>> import numpy as np
    >>> from luxnn import memory
    >>> cache = memory.AllocCache(record=True)
    >>> for _ in range(3):
    ...     with memory.cached(cache):
    ...         _ = np.ones(1 << 20) + 1
    >>> fig = memory.plot_timeline(cache)   # or plot_timeline(cache, "mem.png")
    """
    try:
        from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    except ImportError as err:
        raise ImportError("plot_timeline needs matplotlib: pip install 'luxnn[plot]'") from err

    if not cache.record:
        raise ValueError("this cache keeps no timeline: create it with AllocCache(record=True)")
    events = cache.timeline()
    mib = 1 << 20
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.add_subplot()
    ax.step(events["t"], events["reserved"] / mib, where="post", label="reserved")
    ax.step(events["t"], events["live"] / mib, where="post", label="live")
    # Shade every other outermost scope, so back-to-back steps stay apart. Entries and
    # exits are paired in time order, which is exact for nested scopes (scopes of several
    # threads or tasks that interleave merge into one span).
    marks = sorted(
        [(t, +1) for t in events["t"][events["kind"] == "scope_enter"]]
        + [(t, -1) for t in events["t"][events["kind"] == "scope_exit"]]
    )
    depth, start, outermost = 0, 0.0, 0
    for t, step in marks:
        if depth == 0 and step > 0:
            start = t
        depth = max(depth + step, 0)
        if depth == 0 and step < 0:
            ax.axvspan(start, t, color="grey", alpha=0.15 if outermost % 2 == 0 else 0.05, lw=0)
            outermost += 1
    s = cache.stats()
    ax.set_title(
        f"peak live {format_bytes(s.peak_live)}, peak reserved {format_bytes(s.peak_reserved)}, "
        f"{s.hits} hits, {s.upstream_allocs} upstream allocations, {s.scopes} scopes"
    )
    ax.set_xlabel("time since the cache was created (s)")
    ax.set_ylabel("MiB")
    ax.legend(loc="upper left")
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
