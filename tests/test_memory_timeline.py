"""The memory picture covers the whole run, however many single events the ring dropped."""

import numpy as np
import pytest

from luxnn import memory
from luxnn.memory.cache import TIMELINE_CAPACITY


def _steps(cache, steps, arrays_per_step):
    for k in range(steps):
        with memory.cached(cache):
            keep = np.ones(70_000 + k)  # above 64 KiB: a peak of its own
            for _ in range(arrays_per_step):
                np.empty(16)
            del keep


def test_spans_cover_every_step_when_the_ring_drops_events():
    cache = memory.AllocCache(record=True)
    steps, per_step = 100, TIMELINE_CAPACITY // 150  # 2 events per array: ~1.3x the ring
    _steps(cache, steps, per_step)
    events, spans = cache.timeline(), cache.timeline_spans()
    assert len(events) == TIMELINE_CAPACITY and cache.timeline_dropped() > 0
    assert len(spans) == steps and (spans["spans"] == 1).all()
    assert spans["t_enter"][0] < events["t"][0]  # the ring lost the first steps, the spans not
    assert (spans["t_enter"] <= spans["t_exit"]).all() and (spans["t_exit"][:-1] <= spans["t_enter"][1:]).all()
    nbytes = [memory.bin_size(8 * (70_000 + k)) for k in range(steps)]
    assert (spans["peak_live"] >= nbytes).all()
    assert (spans["peak_reserved"] >= spans["peak_live"]).all()
    assert cache.stats().peak_live == spans["peak_live"].max()


def test_past_its_rows_spans_merge_in_pairs_and_still_cover_the_run():
    cache = memory.AllocCache(record=True)
    for _ in range(5000):
        with memory.cached(cache):
            pass
    spans = cache.timeline_spans()
    assert 2048 <= len(spans) <= 4096 and spans["spans"].sum() == 5000
    assert (spans["t_exit"][:-1] <= spans["t_enter"][1:]).all()


def test_nested_scopes_and_scopes_without_recording_make_no_spans():
    cache = memory.AllocCache(record=True)
    with memory.cached(cache):
        with memory.cached(cache):
            pass
    assert len(cache.timeline_spans()) == 1
    assert len(memory.AllocCache().timeline_spans()) == 0 and memory.AllocCache().timeline_dropped() == 0


def test_the_picture_shows_every_step_above_and_the_last_steps_event_by_event_below():
    pytest.importorskip("matplotlib")
    cache = memory.AllocCache(record=True)
    _steps(cache, 100, TIMELINE_CAPACITY // 150)
    spans, s, dropped = cache.timeline_spans(), cache.stats(), cache.timeline_dropped()
    fig = memory.plot_timeline(cache)
    run, detail = fig.axes
    for ax in (run, detail):
        assert ax.get_xlim()[0] == 0 and ax.get_ylim()[0] == 0
    # Above: the whole run, one point per step, its peaks and what it left live.
    by_label = {line.get_label(): line for line in run.lines}
    assert set(by_label) == {"peak reserved", "peak live", "live at the step's end"}
    for line in by_label.values():
        assert list(line.get_xdata()) == list(range(1, 101))
    assert run.get_ylabel() == "KiB" and list(by_label["peak live"].get_ydata() * (1 << 10)) == list(spans["peak_live"])
    assert list(by_label["live at the step's end"].get_ydata() * (1 << 10)) == list(spans["live_exit"])
    # Below: the last three steps from the first one's start, every event the ring holds.
    assert detail.get_title(loc="left").startswith("The last 3 steps (98 to 100), allocation by allocation")
    assert f"{dropped:,} earlier ones are only in the panel above" in detail.get_title(loc="left")
    live = {line.get_label(): line for line in detail.lines}["live"]
    x = live.get_xdata()
    assert x[0] == 0 and x[-1] == pytest.approx((spans["t_exit"][-1] - spans["t_enter"][-3]) * 1e3)
    assert (np.diff(x) >= 0).all()
    events = cache.timeline()
    in_window = events[(events["t"] >= spans["t_enter"][-3]) & (events["t"] <= spans["t_exit"][-1])]
    assert len(x) >= len(in_window) and max(live.get_ydata()) * (1 << 10) == spans["peak_live"][-3:].max()
    title = fig.get_suptitle()
    assert title.startswith("Memory over 100 steps (scopes of the cache): arrays held at most ")
    assert f"{s.hits:,} of {s.hits + s.misses:,} requests were served from memory the cache already held" in title


def test_a_run_whose_last_rows_merged_is_drawn_whole_with_the_events_held_below():
    pytest.importorskip("matplotlib")
    cache = memory.AllocCache(record=True)
    for _ in range(5000):
        with memory.cached(cache):
            pass
    fig = memory.plot_timeline(cache)
    assert fig.axes[0].lines[0].get_xdata()[-1] == 5000
    assert cache.timeline_spans()["spans"][-1] > 1  # no row of a single step to detail
    assert fig.axes[1].get_title(loc="left") == "The last 10,000 events"


def test_a_picture_needs_a_step_and_a_positive_number_of_detailed_steps():
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="the cache has recorded no step yet"):
        memory.plot_timeline(memory.AllocCache(record=True))
    cache = memory.AllocCache(record=True)
    _steps(cache, 2, 1)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match=f"detail_steps must be a positive integer, got {bad!r}"):
            memory.plot_timeline(cache, detail_steps=bad)
    assert memory.plot_timeline(cache, detail_steps=5).axes[1].get_title(loc="left").startswith("The last 2 steps (1 to 2)")


