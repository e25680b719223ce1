"""Lanes (memory/csrc/record.c and plan.c, luxnn.memory.plan.layout): the requests made in a share of a
threaded kernel carry its lane, and a plan matches them by (kernel call, lane, rank in the
lane), so that no interleaving of the threads can make it miss. Nothing here bounds how
threads interleave: what is checked holds for every interleaving."""

import numpy as np
import pytest

from luxnn import memory, parallel
from luxnn.memory import _core
from luxnn.memory.plan import CALL, DIED, LANE, LANE_BORN, LANE_DIED, NEXT_DIED, SIZE, _table

MiB = 1 << 20
ROWS = 256  # rows of x: 2 MiB of float64 rows 1 KiB each, cut into blocks of 32 rows


def _kernel_step(x, out):
    # A step: a temporary out of lanes, then a kernel whose blocks each make a temporary
    # above the split threshold (256 KiB), then a result that outlives the step.
    scratch = x * 2.0

    def block(lo, hi):
        t = np.repeat(x[lo:hi], 8, axis=1)  # 32 x 1024 float64: 256 KiB, dies in its lane
        np.add(t[:, : x.shape[1]], scratch[lo:hi], out=out[lo:hi])

    parallel.for_blocks(block, x, rows=32)
    return out.copy()


def test_a_kernels_requests_carry_their_call_and_lane_and_die_in_it(threads):
    threads(2)
    cache = memory.AllocCache()
    x, out = np.ones((ROWS, 128)), np.empty((ROWS, 128))
    with memory.step(cache):
        result = _kernel_step(x, out)
    taken = cache._core.take_record()
    record = _table(taken.rows, NEXT_DIED)
    laned, large = record[CALL] >= 0, record[SIZE] > 64 * 1024
    assert (laned & large).sum() == ROWS // 32  # one large temporary per block (and NumPy's small ones)
    assert taken.plannable == (laned | large).sum() > (laned & large).sum()  # a plan's: lanes' small ones too
    assert set(record[CALL][laned]) == {0} and set(record[LANE][laned]) == {0, 1}  # two shares
    assert (record[LANE_DIED][laned] > record[LANE_BORN][laned]).all()  # each died in its lane
    for lane in (0, 1):  # a share's blocks one after another on its lane's clock
        mine = np.flatnonzero(laned & large & (record[LANE] == lane))
        assert (record[LANE_DIED][mine[:-1]] < record[LANE_BORN][mine[1:]]).all()
    assert (record[CALL][~laned] == -1).all() and (record[DIED][~laned] == -1).sum() == 1  # the result
    assert record[SIZE][laned & large].tolist() == [256 * 1024] * (ROWS // 32) and result[0, 0] == 3.0


def test_a_planned_threaded_kernel_takes_its_lanes_places_in_every_step(threads):
    threads(2)
    cache = memory.AllocCache()
    x, out = np.ones((ROWS, 128)), np.empty((ROWS, 128))
    result = None
    for step in range(12):
        x[:] = step
        previous = result
        with memory.step(cache):
            result = _kernel_step(x, out)
        cache._core.audit()  # no two live blocks share a byte
        assert step == 0 or (previous == 3.0 * (step - 1)).all()  # the step before's, intact
        del previous
        if step == 3:
            planned = cache.stats()
    s = cache.stats()
    assert planned.plans == 1 and s.plans == 1  # one plan, never widened
    assert s.plan_misses == planned.plan_misses
    per_step = planned.plan_hits // 2  # steps 3 and 4 were planned, every request of theirs
    assert per_step >= 2 + ROWS // 32 and s.plan_hits - planned.plan_hits == 8 * per_step
    assert (result == 33.0).all()


def test_a_lane_left_set_by_an_earlier_step_counts_as_none():
    cache = memory.AllocCache()
    before = _core.enter_lane(_core.kernel_call(), 0)  # a lane whose call began before the step
    try:
        with memory.step(cache):
            y = np.ones(MiB // 8)
    finally:
        _core.leave_lane(before)
    record = _table(cache._core.take_record().rows, NEXT_DIED)
    assert MiB in record[SIZE] and (record[CALL] == -1).all() and (record[LANE] == -1).all() and y[0] == 1.0


@pytest.mark.parametrize("call, lane", [(0, 0), (1, -1), (1 << 62, 0)])  # (1 << 62: no kernel_call() gave it)
def test_enter_lane_takes_a_call_of_kernel_call_and_a_lane(call, lane):
    with pytest.raises(ValueError, match="kernel_call"):
        _core.enter_lane(call, lane)
