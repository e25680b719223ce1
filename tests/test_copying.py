"""Copying and pickling a TrainState: its trees are copied, its allocator cache never is (a
copy gets a fresh cache for its device, as `to_device` gives)."""

import copy
import pickle

import numpy as np
import pytest

import luxnn as lx

AD = lx.AutoTape()
LOSS = lx.losses.MSELoss()


# A model and an optimiser made only of module-level functions, so that these tests see
# TrainState's own pickling apart from the library's initialisers and optimisers (the last
# test pickles those too).
def _init_weight(rng, shape, dtype=np.float32):
    return (rng.standard_normal(shape) * 0.3).astype(dtype)


def _init_bias(rng, shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def _sgd_init(params):
    return {"count": np.zeros((), np.int64)}


def _sgd_update(grads, state, params=None):
    return lx.tree.map(lambda g: -0.1 * g, grads), {"count": state["count"] + 1}


def _picklable_train_state(cache=True):
    model = lx.Chain(
        lx.Dense(4, 8, activation="tanh", init_weight=_init_weight, init_bias=_init_bias),
        lx.Dropout(0.25),
        lx.Dense(8, 1, init_weight=_init_weight, init_bias=_init_bias),
    )
    ps, st = lx.setup(np.random.default_rng(0), model)
    optimizer = lx.optim.GradientTransformation(_sgd_init, _sgd_update)
    if cache:
        return lx.TrainState(model, ps, st, optimizer)
    return lx.TrainState(model, ps, st, optimizer, allocator_cache=None)


def _data():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((16, 4)).astype(np.float32)
    return x, np.sin(x).sum(axis=1, keepdims=True).astype(np.float32)


def _assert_same_trees(a, b, *, shared):
    leaves_a, leaves_b = lx.tree.leaves(a), lx.tree.leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        if isinstance(x, np.ndarray):
            np.testing.assert_array_equal(x, y)
            assert x.dtype == y.dtype and np.shares_memory(x, y) == shared
        elif isinstance(x, np.random.Generator):
            assert (x is y) == shared
            assert x.bit_generator.state["state"] == y.bit_generator.state["state"]
        else:
            assert x == y


def _assert_fresh_cache(copied, original):
    if original.allocator_cache is None:
        assert copied.allocator_cache is None
        return
    assert isinstance(copied.allocator_cache, lx.memory.AllocCache)
    assert copied.allocator_cache is not original.allocator_cache
    assert copied.allocator_cache.stats().misses == 0  # nothing came along with it


def _trains_apart(copied, original):
    """The copy trains as the original would, and training it changes nothing of the original."""
    before = lx.tree.map(lambda x: x.copy() if isinstance(x, np.ndarray) else x, original.parameters)
    cache_before = original.allocator_cache and original.allocator_cache.stats()
    for _ in range(3):
        _, loss_copy, _, copied = lx.single_train_step_(AD, LOSS, _data(), copied)
    _assert_same_trees(original.parameters, before, shared=False)
    if cache_before is not None:
        after = original.allocator_cache.stats()
        assert (after.hits, after.misses) == (cache_before.hits, cache_before.misses)
    for _ in range(3):
        _, loss_original, _, original = lx.single_train_step_(AD, LOSS, _data(), original)
    np.testing.assert_allclose(float(loss_copy), float(loss_original), rtol=1e-5)
    assert copied.step == original.step


@pytest.mark.parametrize("cache", [True, False])
def test_deepcopy_copies_every_tree_and_gives_a_fresh_cache(cache):
    ts = _picklable_train_state(cache)
    copied = copy.deepcopy(ts)
    for field in ("parameters", "states", "optimizer_state"):
        _assert_same_trees(getattr(copied, field), getattr(ts, field), shared=False)
    _assert_fresh_cache(copied, ts)
    _trains_apart(copied, ts)


def test_a_shallow_copy_shares_the_trees_but_not_the_cache():
    ts = _picklable_train_state()
    copied = copy.copy(ts)
    _assert_same_trees(copied.parameters, ts.parameters, shared=True)
    _assert_fresh_cache(copied, ts)


@pytest.mark.parametrize("cache", [True, False])
def test_pickling_round_trips_every_tree_and_gives_a_fresh_cache(cache):
    ts = _picklable_train_state(cache)
    for _ in range(2):
        _, _, _, ts = lx.single_train_step_(AD, LOSS, _data(), ts)
    loaded = pickle.loads(pickle.dumps(ts))
    assert isinstance(loaded, lx.TrainState) and loaded.step == 2
    for field in ("parameters", "states", "optimizer_state"):
        _assert_same_trees(getattr(loaded, field), getattr(ts, field), shared=False)
    _assert_fresh_cache(loaded, ts)
    _trains_apart(loaded, ts)


def test_a_train_state_of_the_librarys_own_layers_and_optimiser_pickles():
    model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dropout(0.5), lx.Dense(8, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adamw(1e-2))
    loaded = pickle.loads(pickle.dumps(ts))
    _assert_same_trees(loaded.optimizer_state, ts.optimizer_state, shared=False)
    _assert_fresh_cache(loaded, ts)
    _trains_apart(loaded, ts)


def test_a_gpu_train_state_unpickles_with_a_fresh_cache_for_its_device(gpu):
    import cupy

    ts = _picklable_train_state().to_device(gpu)
    for loaded in (pickle.loads(pickle.dumps(ts)), copy.deepcopy(ts)):
        assert isinstance(loaded.parameters["layer_1"]["weight"], cupy.ndarray)
        assert loaded.allocator_cache is not ts.allocator_cache
        assert repr(loaded.allocator_cache.device) == repr(ts.allocator_cache.device)
        _, loss, _, _ = lx.single_train_step_(AD, LOSS, gpu(_data()), loaded)
        assert bool(cupy.isfinite(loss))
