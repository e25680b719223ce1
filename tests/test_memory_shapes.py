"""Several shapes, several plans (luxnn.memory.plan, csrc/plan.c): a loop whose shapes vary
(sequence lengths in buckets, a short last batch, an evaluation pass every few steps) keeps a
plan per request-size signature, at most MAX_PLANS of them, in one arena; each step takes the
plan its first requests follow. Counts of upstream allocations are checked with one kernel
thread, where no interleaving of threads can change them."""

import functools
import os

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory
from luxnn.bench import models as bench
from luxnn.memory.plan import MAX_PLANS, SHAPES_BUDGET

KiB, MiB = 1 << 10, 1 << 20
AD = lx.AutoTape()
# Under valgrind (scripts/memcheck.sh) a step is ~50x slower: fewer of them there.
LM_STEPS = 24 if os.environ.get("LUXNN_MEMCHECK") else 48


def _upstream_per_step(cache, steps):
    """Run each of `steps` (callables); the upstream allocations of each, counted from its
    beginning to the next one's (what its results' deaths cause counts)."""
    marks = []
    for step in steps:
        marks.append(cache.stats().upstream_allocs)
        step()
    return np.diff([*marks, cache.stats().upstream_allocs]).tolist()


def _bucketed_lm(verb, threads, steps=LM_STEPS):
    threads(1)
    lm = bench.LM(batch=8, vocab=500, dim=64, heads=2, buckets=(16, 32, 48, 64))
    batches = [lm.data(n) for n in lm.buckets]
    model = lm.luxnn_model()
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3))
    cache, loss = ts.allocator_cache, lx.losses.CrossEntropyLoss()
    picks = np.random.default_rng(0).integers(0, len(batches), steps)
    installs = []

    def step(k):
        def run():
            nonlocal ts
            _, _, _, ts = verb(AD, loss, batches[picks[k]], ts)
            installs.append(cache.stats().plans)
        return run

    upstream = _upstream_per_step(cache, [step(k) for k in range(steps)])
    return cache, upstream, installs


@pytest.mark.parametrize("verb", [lx.single_train_step_, lx.single_train_step])
def test_bucketed_lengths_keep_a_plan_each_and_stop_reaching_upstream(verb, threads):
    # Lengths from 4 buckets, one drawn each step: a plan per bucket, made once its length
    # repeats, shared arena; blocks kept across steps (single_train_step's new parameters
    # and optimizer state, of the same sizes in every bucket) take the same places in
    # every plan. Once each bucket has its plan, no step reaches upstream.
    cache, upstream, installs = _bucketed_lm(verb, threads)
    s, warm = cache.stats(), LM_STEPS // 2
    assert cache._planner.plans == 4 and installs[-1] == installs[-warm] <= 3 * 4  # none made again and again
    assert upstream[-warm:] == [0] * warm
    if verb is lx.single_train_step_:  # (the other's results outlive a step: figures in benchmarks/promises.py)
        assert installs[-1] == 4 and s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    cache._core.audit()


def _mlp(batches, every_epoch, threads, epochs=8):
    # MLP 256 -> 512 -> 10, Adam: for each epoch, a step per batch of `batches`, then
    # `every_epoch(ts)` if given (an evaluation pass).
    threads(1)
    model = lx.Chain(lx.Dense(256, 512, activation="relu"), lx.Dense(512, 10))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3))
    rng = np.random.default_rng(1)
    data = [(rng.standard_normal((n, 256)).astype(np.float32), rng.integers(0, 10, n)) for n in batches]
    loss = lx.losses.CrossEntropyLoss()

    def train(batch):
        def run():
            nonlocal ts
            _, _, _, ts = lx.single_train_step_(AD, loss, batch, ts)
        return run

    steps = []
    for _ in range(epochs):
        steps += [train(batch) for batch in data]
        if every_epoch is not None:
            steps.append(lambda: every_epoch(ts))
    return ts.allocator_cache, _upstream_per_step(ts.allocator_cache, steps)


def test_a_short_last_batch_gets_its_own_plan(threads):
    cache, upstream = _mlp([128, 128, 128, 40], None, threads)
    s = cache.stats()
    assert s.plans == 2 and cache._planner.plans == 2  # the full batches', the short one's
    assert upstream[3 * 4:] == [0] * (5 * 4)  # from the third epoch on
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    cache._core.audit()


def test_an_evaluation_pass_every_epoch_gets_its_own_plan(threads):
    rng = np.random.default_rng(2)
    held_out = rng.standard_normal((300, 256)).astype(np.float32)

    def evaluate(ts):  # a pass in test mode, marked as a step of the cache's
        with memory.step(ts.allocator_cache):
            logits, _ = ts.model(held_out, ts.parameters, lx.testmode(ts.states))
            float(logits.argmax(axis=-1).mean())

    cache, upstream = _mlp([128, 128, 128], evaluate, threads)
    s = cache.stats()
    assert s.plans == 2 and cache._planner.plans == 2  # training's, the evaluation's
    assert upstream[3 * 4:] == [0] * (5 * 4)  # from the third epoch on
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    cache._core.audit()


class _OutOfPlaceMLP:
    """MLP 256 -> 1024 -> 1024 -> 10, Adam, trained by ``single_train_step`` (a step's new
    parameters and moments outlive it) on the first n of `rows` rows, with one kernel
    thread."""

    def __init__(self, rows, threads):
        threads(1)
        model = lx.Chain(lx.Dense(256, 1024, activation="relu"), lx.Dense(1024, 1024, activation="relu"), lx.Dense(1024, 10))
        ps, st = lx.setup(np.random.default_rng(0), model)
        self.ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3))
        self.cache = self.ts.allocator_cache
        rng = np.random.default_rng(1)
        self.x, self.y = rng.standard_normal((rows, 256)).astype(np.float32), rng.integers(0, 10, rows)

    def train(self, n):
        _, _, _, self.ts = lx.single_train_step(AD, lx.losses.CrossEntropyLoss(), (self.x[:n], self.y[:n]), self.ts)


@pytest.mark.parametrize("batches", [[64] * 4 + [192, 64, 64], [128] * 3 + [64, 128, 128]])
def test_a_step_of_shapes_not_planned_yet_leaves_its_results_where_the_next_plan_expects_them(batches, threads):
    # Out of place, a step's new parameters and moments (of the same sizes whatever the
    # batch) outlive it. A step of a batch size no plan follows takes, for them, the places
    # the plans keep for them, not the bytes of the next planned step's temporaries: that
    # step (the plan's warm-up, which sends its misses upstream) makes no upstream
    # allocation.
    mlp = _OutOfPlaceMLP(max(batches), threads)
    upstream = _upstream_per_step(mlp.cache, [functools.partial(mlp.train, n) for n in batches])
    unplanned = next(k for k, n in enumerate(batches) if n != batches[0])
    assert mlp.cache.stats().plans == 1  # the first batch size's, before the other
    assert upstream[unplanned + 1:] == [0] * (len(batches) - unplanned - 1), upstream
    s = mlp.cache.stats()
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    mlp.cache._core.audit()


def _small_step(ts):
    with memory.step(ts.allocator_cache):  # a step of the cache's with no recorded request
        np.ones(100).sum()


def _evaluation(ts):
    with memory.step(ts.allocator_cache):  # a pass in test mode, planned, keeping nothing
        logits, _ = ts.model(np.ones((512, 256), np.float32), ts.parameters, lx.testmode(ts.states))
        float(logits.sum())


@pytest.mark.parametrize("between", [_small_step, _evaluation])
def test_steps_between_training_steps_leave_its_results_places_to_the_next_one(between, threads):
    # Out of place, a step's results sit at their slots' places of the step's parity and
    # the next step's take the others. A step in between that keeps nothing (small arrays
    # only, an evaluation pass) makes no next step take the places its own blocks hold.
    mlp = _OutOfPlaceMLP(64, threads)
    steps = ([functools.partial(mlp.train, 64)] * 3 + [lambda: between(mlp.ts)]) * 6
    misses = []
    for step in steps:
        before = mlp.cache.stats().plan_misses
        step()
        misses.append(mlp.cache.stats().plan_misses - before)
    assert misses[8:] == [0] * (len(steps) - 8), misses  # from the third round on
    s = mlp.cache.stats()
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    mlp.cache._core.audit()


def test_an_evaluation_output_held_over_the_training_steps_is_planned_around_not_planned_again_and_again(threads):
    # Out of place, with an evaluation pass every fourth step whose output (20 KiB, a
    # recorded request) the loop holds until the next one. The evaluation's plan, whose
    # step makes none of the training step's results, keeps clear of their places rather
    # than claim the arena's start for its output (which had the training plan laid out
    # again, and then the evaluation's, every step, 17 plans in 24 steps).
    mlp = _OutOfPlaceMLP(64, threads)
    held = []

    def evaluate():
        with memory.step(mlp.cache):
            held[:] = [mlp.ts.model(np.ones((512, 256), np.float32), mlp.ts.parameters, lx.testmode(mlp.ts.states))[0]]

    _upstream_per_step(mlp.cache, ([functools.partial(mlp.train, 64)] * 3 + [evaluate]) * 6)
    s = mlp.cache.stats()
    assert s.plans <= 3, s  # training's, the evaluation's, one widened
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    mlp.cache._core.audit()


def _bucket_step(cache, k, result=None):
    # A step of bucket k: temporaries of its own sizes, and (given `result`) a result of one
    # size whatever the bucket, which outlives the step (the next one reads it and makes its
    # own).
    with memory.step(cache):
        scratch = np.full((k + 2) * 16 * KiB, float(k))  # (k + 2) x 128 KiB
        total = np.repeat(scratch, 2)[: scratch.size] + 1.0
        return None if result is None else result * 0.5 + float(total[0])


def test_beyond_MAX_PLANS_signatures_the_least_recently_used_plan_goes():
    cache = memory.AllocCache()
    for k in list(range(MAX_PLANS)) * 3:  # each planned once it repeats, then served
        _bucket_step(cache, k)
    assert cache.stats().plans == MAX_PLANS and cache._planner.plans == MAX_PLANS
    before = cache.stats()
    for k in range(MAX_PLANS):
        _bucket_step(cache, k)
    s = cache.stats()
    assert s.upstream_allocs == before.upstream_allocs and s.plan_misses == before.plan_misses  # each its own plan
    assert s.plan_hits - before.plan_hits >= 3 * MAX_PLANS  # and the small ones
    _bucket_step(cache, 0)  # bucket 1's plan is now the least recently used
    for _ in range(3):
        _bucket_step(cache, MAX_PLANS)  # a new bucket: its plan takes the least recently used one's place
    assert cache.stats().plans == MAX_PLANS + 1 and cache._planner.plans == MAX_PLANS
    hits = cache.stats().plan_hits
    _bucket_step(cache, 2)
    assert cache.stats().plan_hits >= hits + 3  # bucket 2 kept its plan
    hits = cache.stats().plan_hits
    _bucket_step(cache, 1)
    assert cache.stats().plan_hits == hits  # bucket 1 lost its own: none serves it
    cache._core.audit()


def test_steps_that_switch_plans_never_overlap_the_blocks_they_carry():
    # Buckets in a fixed pseudo-random order, each step's result carried into the next
    # (served by another plan, or none): every value stays intact, whatever plan serves.
    cache = memory.AllocCache()
    result, value = np.zeros(MiB // 8), 0.0
    for k in np.random.default_rng(0).integers(0, 5, 60):
        previous, before = result, value
        result = _bucket_step(cache, int(k), result)
        value = value * 0.5 + float(k + 1)
        assert np.all(result == value) and np.all(previous == before)
        cache._core.audit()
    assert cache._planner.plans == 5


def test_blocks_carried_into_steps_of_other_lengths_are_planned_to_live_to_the_end_of_the_next_step():
    # Steps of three buckets in turn, each with its own count of temporaries (its own
    # clock), each carrying a result into the next one, where it dies at the end. A plan
    # made from a step whose successor was of another bucket takes that death, on the
    # other's clock, as one at the end of its own next step, not in its middle (where its
    # later temporaries would then be placed on the carried block's bytes).
    def step(k, result):
        with memory.step(cache):
            total = 0.0
            for j in range(k + 1):  # k + 1 temporaries of (k + 2) x 128 KiB, one after another
                scratch = np.full((k + 2) * 16 * KiB, float(j))
                total += float(scratch[-1])
                del scratch
            return result * 0.5 + total

    cache = memory.AllocCache()
    result, misses = np.zeros(MiB // 8), []
    for k in [0, 1, 3] * 8:
        before = cache.stats().plan_misses
        result = step(k, result)
        misses.append(cache.stats().plan_misses - before)
    s = cache.stats()
    assert cache._planner.plans == 3 and misses[12:] == [0] * 12, misses
    assert s.peak_reserved <= SHAPES_BUDGET * s.peak_live, s
    cache._core.audit()
