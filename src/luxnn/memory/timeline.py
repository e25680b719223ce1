"""`plot_timeline`: a picture of a recording cache's memory over time."""

from __future__ import annotations

from os import PathLike
from typing import Any

import numpy as np

from .cache import TIMELINE_CAPACITY, AllocCache
from .errors import format_bytes

__all__ = ["plot_timeline"]


def plot_timeline(cache: AllocCache, path: str | PathLike | None = None) -> Any:
    """Draw bytes live and bytes reserved over the whole run, with the steps (the cache's
    spans, `AllocCache.timeline_spans`) shaded; save it to `path` if given. Returns the
    matplotlib `Figure` (matplotlib is imported only here).

    Every event is drawn while the cache still holds it (the last `TIMELINE_CAPACITY`);
    before those, each step by its peaks and its end, and the title says how many events
    were dropped. The cache must have been created with ``record=True``.

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
    events, spans, dropped = cache.timeline(), cache.timeline_spans(), cache.timeline_dropped()
    # The event ring holds the last events only; before the first it holds, each step is
    # drawn from its span: its peak while it runs, and after it the lower of its figure at
    # its end and the next step's at its start (arrays die as the step's results go).
    first = events["t"][0] if len(events) else np.inf
    early = spans[: np.searchsorted(spans["t_exit"], first)] if dropped else spans[:0]
    t = np.concatenate([np.column_stack([early["t_enter"], early["t_exit"]]).ravel(), events["t"]])
    curves = {}
    for name in ("reserved", "live"):
        after = np.minimum(early[f"{name}_exit"], np.append(spans[f"{name}_enter"][1:], np.inf)[: len(early)])
        early_curve = np.column_stack([early[f"peak_{name}"], after]).ravel()
        curves[name] = np.concatenate([early_curve, events[name]])
    mib = 1 << 20
    fig = Figure(figsize=(9, 4), layout="constrained")
    ax = fig.add_subplot()
    for name, bytes_ in curves.items():
        ax.step(t, bytes_ / mib, where="post", label=name)
    # Every other span shaded darker, so back-to-back steps stay apart.
    for parity, alpha in ((0, 0.15), (1, 0.05)):
        rows = spans[parity::2]
        ax.broken_barh(
            list(zip(rows["t_enter"], rows["t_exit"] - rows["t_enter"])), (0, 1),
            transform=ax.get_xaxis_transform(), color="grey", alpha=alpha, lw=0,
        )  # fmt: skip
    s = cache.stats()
    title = (
        f"peak live {format_bytes(s.peak_live)}, peak reserved {format_bytes(s.peak_reserved)}, "
        f"{s.hits} hits, {s.upstream_allocs} upstream allocations, {s.scopes} scopes"
    )
    if dropped:
        ax.axvline(first, color="black", lw=0.8, ls=":")
        title += f"\n{dropped} of {dropped + len(events)} events dropped: left of the dotted line, steps by their peaks"
    ax.set_title(title)
    ax.set_xlabel("time since the cache was created (s)")
    ax.set_ylabel("MiB")
    fig.legend(loc="outside lower center", ncols=2)
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
