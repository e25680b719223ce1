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
    assert figures["upstream_allocs_after_warm_up"] == 0
    assert figures["cache"].peak_reserved <= 1.1 * figures["cache"].peak_live


# ---- a consumed TrainState ------------------------------------------------------------


def _dropout_state():
    model = lx.Chain(lx.Dense(4, 8), lx.Dropout(0.5), lx.Dense(8, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    return lx.TrainState(model, ps, st, lx.optim.adam(1e-2), allocator_cache=None)


CONSUMED = (r"this TrainState was consumed: an in-place verb wrote new parameters .* "
            r"\(1 update since, the last by single_train_step_ at step 0\)")


@pytest.mark.parametrize("verb", [
    lambda ts: lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts),
    lambda ts: lx.single_train_step(AD, lx.losses.MSELoss(), _data(8), ts),
    lambda ts: lx.compute_gradients(AD, lx.losses.MSELoss(), _data(8), ts),
    lambda ts: lx.apply_gradients_(ts, lx.tree.map(np.ones_like, ts.parameters)),
    lambda ts: lx.apply_gradients(ts, lx.tree.map(np.ones_like, ts.parameters)),
    lambda ts: ts.to_device(lx.cpu_device()),
], ids=["single_train_step_", "single_train_step", "compute_gradients", "apply_gradients_", "apply_gradients",
        "to_device"])  # fmt: skip
def test_a_state_an_in_place_step_consumed_is_refused_by_every_verb(verb):
    ts = _dropout_state()
    copy_before = ts.replace(model=ts.model)  # shares its arrays: consumed with it
    lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)  # the returned state forgotten
    params = [a.copy() for a in lx.tree.leaves(ts.parameters)]
    for stale in (ts, copy_before):
        with pytest.raises(ValueError, match=f"{CONSUMED}.*use the TrainState that call returned"):
            verb(stale)
        assert stale.consumed
    for now, then in zip(lx.tree.leaves(ts.parameters), params):
        np.testing.assert_array_equal(now, then)


def test_the_returned_state_trains_on_and_the_consumed_one_stays_refused():
    ts = _dropout_state()
    _, _, _, new = lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)
    grads, _, _, new = lx.compute_gradients(AD, lx.losses.MSELoss(), _data(8), new)
    newer = lx.apply_gradients_(new, grads)
    assert newer.step == 2 and int(newer.optimizer_state[0].count) == 2 and not newer.consumed
    with pytest.raises(ValueError, match=r"\(1 update since, the last by apply_gradients_ at step 1\)"):
        lx.apply_gradients_(new, grads)
    with pytest.raises(ValueError, match=r"\(2 updates since, the last by apply_gradients_ at step 1\)"):
        lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)
    # set_hyperparams' copies and testmode's share the arrays: consumed with their state.
    injected = lx.TrainState(ts.model, *lx.setup(np.random.default_rng(0), ts.model),
                             lx.optim.inject_hyperparams(lx.optim.adam)(learning_rate=1e-2), allocator_cache=None)
    slower, evaluated = lx.optim.set_hyperparams(injected, learning_rate=1e-3), lx.testmode(injected)
    lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), slower)
    assert injected.consumed and slower.consumed and evaluated.consumed


def test_copies_with_arrays_of_their_own_are_states_of_their_own(tmp_path):
    import copy
    import pickle

    ts = _dropout_state()
    deep, pickled = copy.deepcopy(ts), pickle.loads(pickle.dumps(ts))
    pure = lx.single_train_step(AD, lx.losses.MSELoss(), _data(8), ts)[3]
    path = tmp_path / "ckpt.safetensors"
    lx.save(path, ts)
    _, _, _, _ = lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)
    loaded = lx.load(path, like=ts)  # a consumed state is a fine template
    for other in (deep, pickled, pure, loaded):
        assert not other.consumed
        _, _, _, other = lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), other)
        assert other.step >= 1
    # A copy of a consumed state holds its outdated count: consumed too.
    assert copy.deepcopy(ts).consumed and pickle.loads(pickle.dumps(ts)).consumed


def test_forgetting_the_returned_state_no_longer_trains_silently():
    ts = _dropout_state()
    lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)
    with pytest.raises(ValueError, match="use the TrainState that call returned"):
        for _ in range(100):
            lx.single_train_step_(AD, lx.losses.MSELoss(), _data(8), ts)


# ---- the objective and the gradients ---------------------------------------------------


def _mse(model, ps, st, data):
    y_hat, st = model(data[0], ps, st)
    return ((y_hat - data[1]) ** 2).mean(), st


@pytest.mark.parametrize("objective, fragment", [
    (_mse, r"the objective returned a tuple of 2 \(Traced, dict\); an objective returns \(loss, st, stats\)"),
    (lambda model, ps, st, data: _mse(model, ps, st, data)[0],
     r"the objective returned a Traced of shape \(\); an objective returns \(loss, st, stats\)"),
    (lambda model, ps, st, data: (_mse(model, ps, st, data)[0], None, {}),
     r"the state the objective returned does not have the structure of ts.states: at the root expected a dict "
     r"with keys \['layer_1', 'layer_2', 'layer_3'\], got a NoneType"),
    (lambda model, ps, st, data: (_mse(model, ps, st, data)[0], {**st, "layer_2": {}}, {}),
     r"the state the objective returned .* at 'layer_2' expected keys \['rng', 'training'\], got \[\]"),
    (lambda model, ps, st, data: (float(_mse(model, ps, st, data)[0]), st, {}),
     r"the objective's loss \(a float\) does not depend on the parameters"),
])  # fmt: skip
@pytest.mark.parametrize("verb", [lx.single_train_step_, lx.single_train_step, lx.compute_gradients])
def test_an_objective_that_breaks_the_contract_is_named_and_nothing_changes(objective, fragment, verb):
    ts = _dropout_state()
    before = [a.copy() for a in lx.tree.leaves((ts.parameters, ts.optimizer_state))]
    with pytest.raises(ValueError, match=f"^compute_gradients: {fragment}"):
        verb(AD, objective, _data(8), ts)
    assert not ts.consumed and ts.step == 0
    for now, then in zip(lx.tree.leaves((ts.parameters, ts.optimizer_state)), before):
        np.testing.assert_array_equal(now, then)


@pytest.mark.parametrize("verb", [lx.apply_gradients, lx.apply_gradients_])
def test_python_float_gradients_are_named(verb):
    ts = _setup()
    grads = lx.tree.map(np.ones_like, ts.parameters)
    grads["layer_2"]["bias"] = 0.5
    with pytest.raises(ValueError, match=r"the gradient at 'layer_2/bias' is a float; expected an array of shape \(1,\)"):
        verb(ts, grads)


def test_another_optimizers_state_is_named_before_anything_is_written():
    ts = _setup(optimizer=lx.optim.sgd(0.1, momentum=0.9))
    grads, _, _, ts = lx.compute_gradients(AD, lx.losses.MSELoss(), _data(), ts)
    wrong = ts.replace(optimizer=lx.optim.adam(1e-2))
    before = [a.copy() for a in lx.tree.leaves(ts.parameters)]
    for verb in (lx.apply_gradients, lx.apply_gradients_):
        with pytest.raises(ValueError, match="expected an optimizer state of type ScaleByAdamState, got one of type Trace"):
            verb(wrong, grads)
    for now, then in zip(lx.tree.leaves(ts.parameters), before):
        np.testing.assert_array_equal(now, then)


def test_a_learning_rate_schedule_that_gives_nan_writes_nothing():
    ts = _setup(optimizer=lx.optim.adam(lambda count: float("nan")))
    before = [a.copy() for a in lx.tree.leaves(ts.parameters)]
    for verb in (lx.single_train_step, lx.single_train_step_):
        with pytest.raises(ValueError, match="the schedule gave nan at step 0; a schedule must give a finite number"):
            verb(AD, lx.losses.MSELoss(), _data(), ts)
    for now, then in zip(lx.tree.leaves(ts.parameters), before):
        np.testing.assert_array_equal(now, then)


# ---- tied parameters -------------------------------------------------------------------


def _tied(w):
    class Twice(lx.Layer):
        def init_params(self, rng):
            return {"a": w, "b": w}

        def __call__(self, x, ps, st):
            return x * ps["a"] + x * ps["b"], st

    return lx.TrainState(Twice(), {"a": w, "b": w}, {}, lx.optim.sgd(0.1), allocator_cache=None)


def test_parameters_that_share_memory_are_refused_by_the_in_place_verbs():
    x, y = np.ones((1, 3)), np.zeros((1, 3))
    loss = lambda model, ps, st, data: (lx.apply(model, data[0], ps, st)[0].sum(), st, {})  # noqa: E731
    _, _, _, pure = lx.single_train_step(AD, loss, (x, y), _tied(np.ones(3)))
    np.testing.assert_allclose(pure.parameters["a"], 0.9)  # each entry is a parameter of its own
    np.testing.assert_allclose(pure.parameters["b"], 0.9)
    for w in (np.ones(3), np.ones(4)):
        ts = _tied(w) if w.size == 3 else _tied(w).replace(parameters={"a": w[:3], "b": w[1:]})
        with pytest.raises(ValueError, match=r"the parameters at 'a' and 'b' share memory \(the same array, or "
                                             r"overlapping views of one\).*nothing was updated"):
            lx.single_train_step_(AD, loss, (x, y), ts)
        np.testing.assert_array_equal(w, 1.0)
        assert not ts.consumed


# ---- the step under MultiSteps ---------------------------------------------------------


def test_under_multi_steps_the_schedule_of_the_inner_count_is_the_learning_rate_in_use():
    schedule = lx.optim.linear_schedule(0.1, 0.01, 6)
    model = lx.Dense(4, 1, use_bias=False)
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.MultiSteps(lx.optim.sgd(schedule), 3), allocator_cache=None)
    x, y = _data(8)
    for _ in range(9):
        lr = float(schedule(ts.optimizer_state.gradient_step))
        before = ts.parameters["weight"].copy()
        grads, _, _, ts = lx.compute_gradients(AD, lx.losses.MSELoss(), (x, y), ts)
        accumulated = ts.optimizer_state.acc_grads["weight"] * ts.optimizer_state.mini_step
        accumulated = (accumulated + grads["weight"]) / (ts.optimizer_state.mini_step + 1)
        ts = lx.apply_gradients_(ts, grads)
        if ts.step % 3 == 0:
            np.testing.assert_allclose(ts.parameters["weight"], before - lr * accumulated, rtol=1e-5)
    assert ts.step == 9 and int(ts.optimizer_state.gradient_step) == 3
