"""The training API: the four verbs, TrainState, checkpoints, and a task learned end to end."""

import numpy as np
import pytest

import luxnn as lx

AD = lx.AutoTape()


def _setup(cache=None, optimizer=None):
    model = lx.Chain(lx.Dense(4, 16, activation="tanh"), lx.Dense(16, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    return lx.TrainState(model, ps, st, optimizer or lx.optim.adam(1e-2), allocator_cache=cache)


def _data(n=64):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    return x, (np.sin(x).sum(axis=1, keepdims=True) * 0.5).astype(np.float32)


@pytest.mark.parametrize("verb", [lx.single_train_step, lx.single_train_step_])
def test_training_lowers_the_loss_a_hundredfold(verb):
    ts, data, loss = _setup(lx.memory.AllocCache()), _data(), lx.losses.MSELoss()
    _, first, _, _ = lx.compute_gradients(AD, loss, data, ts)
    for _ in range(600):
        _, last, _, ts = verb(AD, loss, data, ts)
    assert ts.step == 600
    assert float(last) < float(first) / 100


def test_out_of_place_update_leaves_old_parameters_untouched():
    ts, data = _setup(), _data()
    before = lx.tree.map(np.copy, ts.parameters)
    _, _, _, new = lx.single_train_step(AD, lx.losses.MSELoss(), data, ts)
    for old, kept, fresh in zip(*map(lx.tree.leaves, (ts.parameters, before, new.parameters))):
        np.testing.assert_array_equal(old, kept)
        assert not np.shares_memory(old, fresh)
    assert (ts.step, new.step) == (0, 1)


def test_in_place_update_writes_into_the_parameter_arrays():
    ts, data = _setup(), _data()
    arrays = lx.tree.leaves(ts.parameters)
    copies = [a.copy() for a in arrays]
    _, _, _, new = lx.single_train_step_(AD, lx.losses.MSELoss(), data, ts)
    assert all(a is b for a, b in zip(arrays, lx.tree.leaves(new.parameters)))
    assert any(not np.array_equal(a, c) for a, c in zip(arrays, copies))


def test_compute_gradients_matches_value_and_grad_and_passes_stats_and_state():
    ts, (x, y) = _setup(), _data()

    returned = []

    def objective(model, ps, st, data):
        y_hat, st = model(data[0], ps, st)
        returned.append(st)
        return ((y_hat - data[1]) ** 2).mean(), st, {"n": len(data[0])}

    grads, loss, stats, ts2 = lx.compute_gradients(AD, objective, (x, y), ts)
    expected = lx.value_and_grad(lambda ps: objective(ts.model, ps, ts.states, (x, y))[0])(ts.parameters)
    np.testing.assert_allclose(loss, expected[0])
    for a, b in zip(lx.tree.leaves(grads), lx.tree.leaves(expected[1])):
        np.testing.assert_allclose(a, b)
    assert stats == {"n": 64} and ts2.states == returned[0] and ts2.step == 0


def test_the_default_cache_is_chosen_for_the_device():
    model = lx.Dense(2, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1))
    assert ts.allocator_cache is not None
    assert lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None).allocator_cache is None
    moved = lx.cpu_device()(ts)
    assert isinstance(moved, lx.TrainState) and moved.allocator_cache is not ts.allocator_cache


def test_bad_arguments_are_named():
    ts = _setup()
    with pytest.raises(TypeError, match="AutoTape"):
        lx.compute_gradients("zygote", lx.losses.MSELoss(), _data(), ts)
    with pytest.raises(TypeError, match="expected a luxnn Layer"):
        lx.TrainState("model", {}, {}, lx.optim.sgd(0.1))
    with pytest.raises(ValueError):
        lx.apply_gradients_(ts, {"layer_1": ts.parameters["layer_1"]})
    with pytest.raises(ValueError, match="layer_1"):
        lx.compute_gradients(AD, lx.losses.MSELoss(), (np.zeros((2, 5), np.float32), np.zeros((2, 1), np.float32)), ts)


def test_checkpoint_round_trips_exactly(tmp_path):
    model = lx.Chain(lx.Dense(4, 8), lx.Dropout(0.5), lx.Dense(8, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adamw(1e-2), allocator_cache=None)
    for _ in range(3):
        _, _, _, ts = lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)
    path = tmp_path / "ckpt.safetensors"
    lx.save(path, ts)
    fresh = lx.TrainState(model, *lx.setup(np.random.default_rng(5), model), lx.optim.adamw(1e-2), allocator_cache=None)
    loaded = lx.load(path, like=fresh)
    assert loaded.step == 3
    for field in ("parameters", "optimizer_state"):
        for a, b in zip(lx.tree.leaves(getattr(ts, field)), lx.tree.leaves(getattr(loaded, field))):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
    # The dropout generator resumes where it stopped: the next masks agree.
    x = np.ones((2, 4), np.float32)
    np.testing.assert_array_equal(model(x, ts.parameters, ts.states)[0], model(x, loaded.parameters, loaded.states)[0])


def test_loading_another_structure_raises_and_changes_nothing(tmp_path):
    ts = _setup()
    path = tmp_path / "ckpt.safetensors"
    lx.save(path, ts)
    other_model = lx.Chain(lx.Dense(4, 8), lx.Dense(8, 1))
    other = lx.TrainState(other_model, *lx.setup(np.random.default_rng(0), other_model), lx.optim.adam(1e-2))
    before = [a.copy() for a in lx.tree.leaves(other.parameters)]
    with pytest.raises(ValueError, match=r"layer_1/weight: expected float32\[4, 8\], got float32\[4, 16\]"):
        lx.load(path, like=other)
    for a, b in zip(before, lx.tree.leaves(other.parameters)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="unexpected entry"):
        lx.load(path, like=lx.TrainState(other_model, *lx.setup(np.random.default_rng(0), other_model), lx.optim.sgd(0.1)))


def test_demo_trains_the_digits_mlp_to_95_percent():
    from luxnn.demo import run

    figures = run("mlp", progress=False)
    assert figures["test_accuracy"] >= 0.95
    assert figures["upstream_allocs_after_first_step"] == 0
    assert figures["cache"].peak_reserved <= 1.1 * figures["cache"].peak_live
