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


def test_the_picture_starts_at_the_first_step_and_says_what_was_dropped():
    pytest.importorskip("matplotlib")
    cache = memory.AllocCache(record=True)
    _steps(cache, 100, TIMELINE_CAPACITY // 150)
    fig = memory.plot_timeline(cache)
    ax = fig.axes[0]
    dropped = cache.timeline_dropped()
    assert f"{dropped} of {dropped + TIMELINE_CAPACITY} events dropped" in ax.get_title()
    first_step = cache.timeline_spans()["t_enter"][0]
    for line in ax.lines[:2]:  # reserved and live
        assert line.get_xdata()[0] == first_step
    assert max(ax.lines[1].get_ydata()) * (1 << 20) == cache.stats().peak_live
