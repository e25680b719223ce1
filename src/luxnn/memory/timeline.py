"""`plot_timeline`: a picture of a recording cache's memory over a run."""

from __future__ import annotations

from os import PathLike
from typing import Any

import numpy as np

from .cache import TIMELINE_CAPACITY, AllocCache
from .errors import format_bytes

__all__ = ["plot_timeline"]

_COLORS = {"reserved": "tab:blue", "live": "tab:orange", "kept": "tab:green"}


def plot_timeline(cache: AllocCache, path: str | PathLike | None = None, *, detail_steps: int = 3) -> Any:
    """Draw a recording cache's memory in two panels and save it to `path` if given;
    returns the matplotlib `Figure` (matplotlib is imported only here).

    Above, the whole run step by step (the cache's spans, `AllocCache.timeline_spans`):
    each step's peak reserved and peak live bytes, and the bytes live when it ended (what
    outlives a step: parameters, optimizer state). Below, the last `detail_steps` steps
    event by event, as far as the cache still holds their events (the last
    `TIMELINE_CAPACITY`). Both axes start at 0; the title says the figures in words. The
    cache must have been created with ``record=True`` and have recorded a step.

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
    if not isinstance(detail_steps, int) or isinstance(detail_steps, bool) or detail_steps < 1:
        raise ValueError(f"plot_timeline: detail_steps must be a positive integer, got {detail_steps!r}")
    spans, events = cache.timeline_spans(), cache.timeline()
    if not len(spans):
        raise ValueError("plot_timeline: the cache has recorded no step yet (no scope of it has closed)")
    s = cache.stats()
    # The largest binary unit in which the peak is at least 1, so the ticks read as numbers.
    unit, scale = next(((u, 1 << b) for u, b in (("GiB", 30), ("MiB", 20), ("KiB", 10)) if s.peak_reserved >= 1 << b), ("B", 1))

    fig = Figure(figsize=(10, 7), layout="constrained")
    run, detail = fig.subplots(2, 1)
    shown = _steps_in_detail(spans, events, cache.timeline_dropped(), detail_steps)
    _draw_run(run, spans, scale, shown)
    _draw_detail(detail, spans, events, scale, shown, cache.timeline_dropped())
    for ax in (run, detail):
        ax.set_ylabel(unit)
        ax.set_xlim(left=0)
        ax.set_ylim(bottom=0, top=max(ax.get_ylim()[1], 1e-3))
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    requests = s.hits + s.misses
    fig.suptitle(
        f"Memory over {int(spans['spans'].sum()):,} steps (scopes of the cache): arrays held at most {format_bytes(s.peak_live)} (live); "
        f"the cache held at most {format_bytes(s.peak_reserved)} (reserved, {s.peak_reserved / max(s.peak_live, 1):.2f}x live)\n"
        f"{s.hits:,} of {requests:,} requests were served from memory the cache already held; "
        f"it took {s.upstream_allocs:,} blocks from the system",
        fontsize="medium",
    )
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig


def _steps_in_detail(spans: np.ndarray, events: np.ndarray, dropped: int, detail_steps: int) -> np.ndarray:
    """The rows of the last `detail_steps` steps whose events the cache still holds (rows
    of one step each: merged rows are old)."""
    last = np.arange(max(len(spans) - detail_steps, 0), len(spans))
    first_held = -np.inf if not dropped else events["t"][0] if len(events) else np.inf
    return last[(spans["spans"][last] == 1) & (spans["t_enter"][last] >= first_held)]


def _draw_run(ax: Any, spans: np.ndarray, scale: float, shown: np.ndarray) -> None:
    """Each step's figures against its number; the steps `shown` below shaded."""
    step = np.cumsum(spans["spans"])  # a merged row (past 4096 rows) ends at its last step
    few = len(step) <= 50  # a handful of steps: markers, or a single step would be invisible
    for name, label in (("peak_reserved", "peak reserved"), ("peak_live", "peak live"), ("live_exit", "live at the step's end")):
        color = _COLORS["kept" if name == "live_exit" else name.split("_")[1]]
        ax.plot(step, spans[name] / scale, color=color, label=label, marker="o" if few else None, ms=3)
    if len(shown):
        ax.axvspan(step[shown[0]] - 0.5, step[shown[-1]] + 0.5, color="grey", alpha=0.25, lw=0, label="shown below")
    ax.set_xlabel("step")
    ax.set_title("The whole run: each step's peaks", loc="left", fontsize="medium")


def _draw_detail(ax: Any, spans: np.ndarray, events: np.ndarray, scale: float, shown: np.ndarray, dropped: int) -> None:
    """The events of the steps `shown` (or, if the cache holds no whole step, the events
    it holds), in milliseconds from the start of the first."""
    if len(shown):
        start, stop = spans["t_enter"][shown[0]], spans["t_exit"][shown[-1]]
        first, last = np.cumsum(spans["spans"])[[shown[0], shown[-1]]]
        what = f"step ({first:,})" if len(shown) == 1 else f"{len(shown)} steps ({first:,} to {last:,})"
        title = f"The last {what}, allocation by allocation"
    elif len(events):
        start, stop = events["t"][0], events["t"][-1]
        title = f"The last {len(events):,} events"
    else:
        start = stop = 0.0
        title = "No event recorded"
    if dropped:
        title += f"\n(the cache keeps its last {TIMELINE_CAPACITY:,} events; {dropped:,} earlier ones are only in the panel above)"
    ax.set_title(title, loc="left", fontsize="medium")
    ax.set_xlabel("milliseconds from the start of the first of these steps" if len(shown) else "milliseconds")
    # From the last event before the window (the figures as it opens) to the last in it.
    t = events["t"]
    window = events[max(np.searchsorted(t, start) - 1, 0) : np.searchsorted(t, stop, side="right")]
    if len(window):
        x = (np.append(np.maximum(window["t"], start), stop) - start) * 1e3
        for name in ("reserved", "live"):
            ax.step(x, np.append(window[name], window[name][-1]) / scale, where="post", color=_COLORS[name], label=name)
    for k, row in enumerate(shown):  # every other step darker, so back-to-back steps stay apart
        ax.axvspan((spans["t_enter"][row] - start) * 1e3, (spans["t_exit"][row] - start) * 1e3,
                   color="grey", alpha=0.15 if k % 2 == 0 else 0.07, lw=0)  # fmt: skip
