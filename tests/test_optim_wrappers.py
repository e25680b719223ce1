"""luxnn.optim: wrappers (masked, multi_transform, MultiSteps, inject_hyperparams), float16
parameters, updates applied all or nothing, pickling, array step counts, bad input."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import luxnn as lx
import luxnn.optim as optim
from luxnn import tree


def make_params(rng: np.random.Generator, dtype=np.float64) -> dict:
    return {"layer_1": {"weight": rng.normal(size=(3, 4)).astype(dtype), "bias": rng.normal(size=(4,)).astype(dtype)},
            "layer_2": {"weight": rng.normal(size=(4, 2)).astype(dtype), "scale": np.asarray(rng.normal(), dtype)}}


def random_grads(rng: np.random.Generator, params: dict) -> dict:
    return tree.map(lambda p: rng.normal(size=p.shape).astype(p.dtype), params)


def weights_only(params):
    return tree.map(lambda p: p.ndim > 1, params)


# ---- float16 parameters ---------------------------------------------------------------


@pytest.mark.parametrize("make_opt", [lambda: optim.adam(1e-3), lambda: optim.rmsprop(1e-3),
                                      lambda: optim.adagrad(1e-2), lambda: optim.radam(1e-3),
                                      lambda: optim.adabelief(1e-3), lambda: optim.adamax(1e-3)],
                         ids=["adam", "rmsprop", "adagrad", "radam", "adabelief", "adamax"])
def test_float16_parameter_with_a_zero_gradient_stays_finite(make_opt):
    params = {"w": np.ones(4, np.float16)}
    opt = make_opt()
    state = opt.init(params)
    for grads in ({"w": np.zeros(4, np.float16)}, {"w": np.array([1e-4, 0, -1e-4, 3.0], np.float16)}):
        updates, state = opt.update(grads, state, params)
        assert updates["w"].dtype == np.float16 and np.isfinite(updates["w"]).all()
        params = optim.apply_updates_(params, updates)
    assert np.isfinite(params["w"]).all()
    moments = [leaf for leaf in tree.leaves(state) if leaf.dtype.kind == "f"]
    assert moments and all(m.dtype == np.float32 for m in moments)  # at least float32


@pytest.mark.parametrize("make_opt", [lambda: optim.adam(1e-2), lambda: optim.rmsprop(1e-2),
                                      lambda: optim.adagrad(1e-1)], ids=["adam", "rmsprop", "adagrad"])
def test_a_float16_mlp_trains_50_steps_without_nan(make_opt):
    model = lx.Chain(lx.Dense(4, 16, activation="tanh"), lx.Dense(16, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = tree.map(lambda p: p.astype(np.float16), ps)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 4)).astype(np.float16)
    y = (x[:, :1] * 0.5 - x[:, 1:2]).astype(np.float16)
    ts = lx.TrainState(model, ps, st, make_opt(), allocator_cache=None)
    losses = []
    for _ in range(50):
        _, loss, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.MSELoss(), (x, y), ts)
        losses.append(float(loss))
    assert all(np.isfinite(losses)), losses
    assert all(p.dtype == np.float16 and np.isfinite(p).all() for p in tree.leaves(ts.parameters))
    assert losses[-1] < losses[0]


# ---- apply_updates_: every leaf checked before the first write -------------------------


def read_only(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("params, updates, fragment", [
    ({"a": np.ones(2), "b": read_only(np.ones(2))}, {"a": np.ones(2), "b": np.ones(2)}, "'b' is read-only"),
    ({"a": np.ones(2), "b": np.ones(2, np.int64)}, {"a": np.ones(2), "b": np.ones(2)}, "'b' has dtype int64"),
    ({"a": np.ones(2), "b": np.ones(2)}, {"a": np.ones(2), "b": np.ones(2, np.complex128)}, "'b' has dtype float64"),
    ({"a": np.ones(2), "b": 1.0}, {"a": np.ones(2), "b": np.ones(())}, "'b' is a float"),
], ids=["read-only", "int param", "complex update", "python float param"])
def test_apply_updates_in_place_writes_nothing_when_a_leaf_cannot_be_written(params, updates, fragment):
    before = copy.deepcopy(params)
    with pytest.raises(ValueError, match=fragment):
        optim.apply_updates_(params, updates)
    np.testing.assert_array_equal(params["a"], before["a"])  # the leaf before the bad one is untouched


def test_apply_gradients_in_place_leaves_the_state_unchanged_on_a_failed_write():
    model = lx.Chain(lx.Dense(3, 4), lx.Dense(4, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, optim.adam(1e-2), allocator_cache=None)
    x, y = np.ones((5, 3), np.float32), np.zeros((5, 2), np.float32)
    grads, _, _, ts = lx.compute_gradients(lx.AutoTape(), lx.losses.MSELoss(), (x, y), ts)
    read_only(ts.parameters["layer_2"]["weight"])
    params_before, state_before = copy.deepcopy(ts.parameters), copy.deepcopy(ts.optimizer_state)
    with pytest.raises(ValueError, match="layer_2/weight' is read-only"):
        lx.apply_gradients_(ts, grads)
    assert ts.step == 0
    for a, b in zip(tree.leaves(ts.parameters), tree.leaves(params_before)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(tree.leaves(ts.optimizer_state), tree.leaves(state_before)):
        np.testing.assert_array_equal(a, b)


# ---- masked, multi_transform, freezing -------------------------------------------------


def test_masked_decay_skips_biases_exactly():
    rng = np.random.default_rng(0)
    params, grads = make_params(rng), None
    grads = random_grads(rng, params)
    decayed = optim.adamw(1e-2, weight_decay=0.5, mask=weights_only)
    plain, full = optim.adam(1e-2), optim.adamw(1e-2, weight_decay=0.5)
    u_masked, _ = decayed.update(grads, decayed.init(params), params)
    u_plain, _ = plain.update(grads, plain.init(params), params)
    u_full, _ = full.update(grads, full.init(params), params)
    # adam folds its learning rate into its last product; adamw multiplies after the decay
    np.testing.assert_allclose(u_masked["layer_1"]["bias"], u_plain["layer_1"]["bias"], rtol=1e-15)
    np.testing.assert_allclose(u_masked["layer_2"]["scale"], u_plain["layer_2"]["scale"], rtol=1e-15)
    np.testing.assert_array_equal(u_masked["layer_1"]["weight"], u_full["layer_1"]["weight"])
    assert not np.allclose(u_masked["layer_1"]["weight"], u_plain["layer_1"]["weight"], rtol=1e-6)


def test_freezing_by_multi_transform_is_bit_identical_over_50_steps():
    model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    labels = {"layer_1": "frozen", "layer_2": "train"}
    opt = optim.multi_transform({"train": optim.adam(1e-2), "frozen": optim.set_to_zero()}, labels)
    ts = lx.TrainState(model, ps, st, opt, allocator_cache=None)
    frozen = copy.deepcopy(ts.parameters["layer_1"])
    trained = copy.deepcopy(ts.parameters["layer_2"])
    rng = np.random.default_rng(1)
    for _ in range(50):
        x = rng.normal(size=(16, 4)).astype(np.float32)
        _, _, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.MSELoss(), (x, x[:, :1]), ts)
    for name, p in ts.parameters["layer_1"].items():
        assert p.tobytes() == frozen[name].tobytes(), name
    assert not np.array_equal(ts.parameters["layer_2"]["weight"], trained["weight"])
    assert ts.optimizer_state.inner_states["frozen"].inner_state == optim.EmptyState()


def test_multi_transform_labels_by_function_and_prefix():
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = random_grads(rng, params)
    by_prefix = optim.multi_transform({"a": optim.sgd(1.0), "b": optim.sgd(0.5)}, {"layer_1": "a", "layer_2": "b"})
    by_function = optim.multi_transform({"a": optim.sgd(1.0), "b": optim.sgd(0.5)},
                                        lambda ps: {k: tree.map(lambda _: "a" if k == "layer_1" else "b", v)
                                                    for k, v in ps.items()})
    for opt in (by_prefix, by_function):
        updates, _ = opt.update(grads, opt.init(params), params)
        np.testing.assert_array_equal(updates["layer_1"]["weight"], -grads["layer_1"]["weight"])
        np.testing.assert_array_equal(updates["layer_2"]["weight"], -0.5 * grads["layer_2"]["weight"])


def test_a_mask_that_does_not_match_names_the_first_mismatching_path():
    params = make_params(np.random.default_rng(0))
    bad_keys = {"layer_1": {"weight": True, "bais": False}, "layer_2": True}
    with pytest.raises(ValueError, match=r"masked: the mask does not match the parameters at 'layer_1'.*"
                                         r"missing \['bias'\].*not in the parameters \['bais'\]"):
        optim.masked(optim.adam(), bad_keys).init(params)
    with pytest.raises(ValueError, match="masked: the mask at 'layer_2/scale': expected a bool, got 'yes'"):
        optim.masked(optim.adam(), {"layer_1": True, "layer_2": {"weight": True, "scale": "yes"}}).init(params)
    with pytest.raises(ValueError, match="at 'layer_2/weight': a dict where the parameters have a ndarray"):
        optim.masked(optim.adam(), {"layer_1": True, "layer_2": {"weight": {"w": True}, "scale": True}}).init(params)


def test_multi_transform_names_an_unknown_label_and_the_known_ones():
    params = make_params(np.random.default_rng(0))
    opt = optim.multi_transform({"adam": optim.adam(), "frozen": optim.set_to_zero()},
                                {"layer_1": "adam", "layer_2": {"weight": "adma", "scale": "frozen"}})
    with pytest.raises(ValueError, match=r"at 'layer_2/weight': unknown label 'adma'; the transforms are labelled "
                                         r"\['adam', 'frozen'\]"):
        opt.init(params)
    mismatched = optim.multi_transform({"adam": optim.adam()}, {"layer_1": "adam"})
    with pytest.raises(ValueError, match=r"the labels does not match the parameters at the root: keys missing \['layer_2'\]"):
        mismatched.init(params)


# ---- MultiSteps ------------------------------------------------------------------------


def test_multi_steps_of_k_batches_equals_one_step_on_their_concatenation():
    model = lx.Chain(lx.Dense(3, 5, activation="tanh"), lx.Dense(5, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = tree.map(lambda p: p.astype(np.float64), ps)
    rng = np.random.default_rng(1)
    k, batch = 4, 6
    xs = [rng.normal(size=(batch, 3)) for _ in range(k)]
    ys = [rng.normal(size=(batch, 2)) for _ in range(k)]
    loss, ad = lx.losses.MSELoss(), lx.AutoTape()

    accumulated = lx.TrainState(model, copy.deepcopy(ps), st, optim.MultiSteps(optim.adam(1e-2), k), allocator_cache=None)
    for i, (x, y) in enumerate(zip(xs, ys)):
        before = copy.deepcopy(accumulated.parameters)
        _, _, _, accumulated = lx.single_train_step(ad, loss, (x, y), accumulated)
        if i < k - 1:  # zero updates while accumulating
            for a, b in zip(tree.leaves(accumulated.parameters), tree.leaves(before)):
                np.testing.assert_array_equal(a, b)
    assert accumulated.optimizer.has_updated(accumulated.optimizer_state)

    whole = lx.TrainState(model, copy.deepcopy(ps), st, optim.adam(1e-2), allocator_cache=None)
    _, _, _, whole = lx.single_train_step(ad, loss, (np.concatenate(xs), np.concatenate(ys)), whole)
    for (path, a), (_, b) in zip(tree.paths(accumulated.parameters), tree.paths(whole.parameters)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-14, err_msg=path)


# ---- inject_hyperparams and set_hyperparams --------------------------------------------


def test_set_hyperparams_changes_the_learning_rate_mid_run():
    model = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, optim.inject_hyperparams(optim.adam)(learning_rate=1e-2), allocator_cache=None)
    rng = np.random.default_rng(1)
    reference = optim.adam(1.0)  # the direction: Adam's moments do not depend on the learning rate
    ref_state = reference.init(ps)
    for step in range(6):
        if step == 3:
            optimizer_before = ts.optimizer
            ts = optim.set_hyperparams(ts, learning_rate=1e-3)
            assert ts.optimizer is optimizer_before  # nothing rebuilt
        x = rng.normal(size=(4, 3)).astype(np.float32)
        grads, _, _, ts = lx.compute_gradients(lx.AutoTape(), lx.losses.MSELoss(), (x, x[:, :2]), ts)
        updates, _ = ts.optimizer.update(grads, ts.optimizer_state, ts.parameters)
        direction, ref_state = reference.update(grads, ref_state, ts.parameters)
        lr = 1e-2 if step < 3 else 1e-3
        np.testing.assert_allclose(updates["weight"], lr * direction["weight"], rtol=1e-5)
        ts = lx.apply_gradients_(ts, grads)
    assert float(ts.optimizer_state.hyperparams["learning_rate"]) == 1e-3


def test_set_hyperparams_errors_name_the_hyperparameter():
    params = {"w": np.zeros(2)}
    plain = optim.adam(1e-3).init(params)
    with pytest.raises(ValueError, match=r"set_hyperparams\(learning_rate\): the optimizer was not made with inject_hyperparams"):
        optim.set_hyperparams(plain, learning_rate=1e-4)
    injected = optim.inject_hyperparams(optim.adam)(learning_rate=1e-3)
    state = injected.init(params)
    with pytest.raises(ValueError, match=r"no hyperparameter 'momentum'; it has \['b1', 'b2', 'eps', 'eps_root', 'learning_rate'\]"):
        optim.set_hyperparams(state, momentum=0.9)
    scheduled = optim.inject_hyperparams(optim.adam)(learning_rate=optim.linear_schedule(1e-3, 0.0, 10))
    with pytest.raises(ValueError, match="learning_rate comes from a schedule"):
        optim.set_hyperparams(scheduled.init(params), learning_rate=1e-4)
    model = lx.Dense(2, 1)
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, injected, allocator_cache=None)
    with pytest.raises(ValueError, match="learning_rate must be in"):
        optim.set_hyperparams(ts, learning_rate=-1.0)
    with pytest.raises(ValueError, match="b1 must be in"):
        optim.set_hyperparams(ts, b1=1.5)


def test_set_hyperparams_checks_an_injected_stage_nested_in_a_chain_before_the_state_changes():
    model = lx.Dense(2, 1)
    ps, st = lx.setup(np.random.default_rng(0), model)
    opt = optim.chain(optim.trace(0.9), optim.inject_hyperparams(optim.adam)(learning_rate=0.1))
    ts = lx.TrainState(model, ps, st, opt, allocator_cache=None)
    with pytest.raises(ValueError, match=r"b1 must be in \[0.0, 1.0\), got 5.0"):
        optim.set_hyperparams(ts, b1=5.0)
    assert float(ts.optimizer_state[1].hyperparams["b1"]) == 0.9
    ts = optim.set_hyperparams(ts, b1=0.5)
    assert float(ts.optimizer_state[1].hyperparams["b1"]) == 0.5


@pytest.mark.parametrize("every_k, given", [(lambda n: 0, "0"), (lambda n: -1, "-1"), (lambda n: 2.5, "2.5"),
                                            (lambda n: float("nan"), "nan")])
def test_multi_steps_refuses_a_schedule_value_below_one_or_not_whole(every_k, given):
    params = {"w": np.ones(2)}
    opt = optim.MultiSteps(optim.sgd(0.1), every_k)
    with pytest.raises(ValueError, match=f"MultiSteps: every_k_schedule gave {given} after 0 inner updates; "
                                         "it must give an integer >= 1"):
        opt.update({"w": np.ones(2)}, opt.init(params), params)


def test_multi_steps_takes_a_schedule_of_numpy_integers():
    params = {"w": np.ones(2)}
    opt = optim.MultiSteps(optim.sgd(1.0), lambda n: np.int64(2))
    state = opt.init(params)
    first, state = opt.update({"w": np.ones(2)}, state, params)
    second, state = opt.update({"w": np.full(2, 3.0)}, state, params)
    np.testing.assert_array_equal(first["w"], [-0.0, -0.0])
    np.testing.assert_array_equal(second["w"], [-2.0, -2.0])


def test_inject_hyperparams_keeps_a_mask_function_static_and_schedules_a_learning_rate():
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = random_grads(rng, params)
    schedule = optim.exponential_decay(1e-2, 1, 0.5)
    injected = optim.inject_hyperparams(optim.adamw)(learning_rate=schedule, weight_decay=0.1, mask=weights_only)
    plain = optim.adamw(schedule, weight_decay=0.1, mask=weights_only)
    s_injected, s_plain = injected.init(params), plain.init(params)
    for _ in range(3):
        u_injected, s_injected = injected.update(grads, s_injected, params)
        u_plain, s_plain = plain.update(grads, s_plain, params)
        for a, b in zip(tree.leaves(u_injected), tree.leaves(u_plain)):
            np.testing.assert_allclose(a, b, rtol=1e-15)
    assert set(s_injected.hyperparams) == {"b1", "b2", "eps", "eps_root", "weight_decay"}
    assert float(s_injected.scheduled["learning_rate"]) == 2.5e-3


def test_inject_hyperparams_rejects_bad_values_when_built():
    with pytest.raises(ValueError, match="learning_rate"):
        optim.inject_hyperparams(optim.adam)(learning_rate=-1.0)
    with pytest.raises(ValueError, match="static_args"):
        optim.inject_hyperparams(optim.adam, static_args="momentum")


# ---- pickling and copying --------------------------------------------------------------


PICKLABLE = [
    ("adam schedule", lambda: optim.adam(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10))),
    ("adamw mask", lambda: optim.adamw(1e-2, weight_decay=0.1, mask={"layer_1": {"weight": True, "bias": False},
                                                                   "layer_2": True})),
    ("chain", lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adaptive_grad_clip(0.1), optim.lion(1e-3))),
    ("multi_transform", lambda: optim.multi_transform({"a": optim.lamb(1e-2), "b": optim.set_to_zero()},
                                                      {"layer_1": "a", "layer_2": "b"})),
    ("MultiSteps", lambda: optim.MultiSteps(optim.nadamw(1e-2), 2)),
    ("apply_if_finite", lambda: optim.apply_if_finite(optim.radam(1e-2), 3)),
    ("inject_hyperparams", lambda: optim.inject_hyperparams(optim.adamw)(
        learning_rate=optim.sgdr_schedule([dict(init_value=0.0, peak_value=1e-2, warmup_steps=1, decay_steps=4)] * 2),
        weight_decay=0.1)),
    ("adafactor", lambda: optim.adafactor(optim.exponential_decay(1e-2, 2, 0.5), momentum=0.9)),
    ("others", lambda: optim.chain(optim.zero_nans(), optim.ema(0.9), optim.lars(0.1), optim.noisy_sgd(0.1, seed=3))),
    ("amsgrad adabelief adadelta adamax", lambda: optim.chain(optim.amsgrad(1e-2), optim.adabelief(1e-2),
                                                              optim.adadelta(), optim.adamaxw(1e-2))),
    ("schedules", lambda: optim.chain(*[optim.sgd(s) for s in (
        optim.piecewise_constant_schedule(1.0, {2: 0.5}), optim.cosine_onecycle_schedule(10, 1.0),
        optim.linear_onecycle_schedule(10, 1.0), optim.polynomial_schedule(1.0, 0.0, 2, 5),
        optim.warmup_exponential_decay_schedule(0.0, 1.0, 2, 2, 0.5),
        optim.join_schedules([optim.constant_schedule(1.0), optim.cosine_decay_schedule(1.0, 4)], [2]))])),
]


def run_updates(opt, params: dict, grads: list[dict], state=None) -> tuple[list, object]:
    state = opt.init(params) if state is None else state
    out = []
    for g in grads:
        updates, state = opt.update(g, state, params)
        out.append(tree.leaves(updates))
    return out, state


@pytest.mark.parametrize("name, make", PICKLABLE, ids=[c[0] for c in PICKLABLE])
def test_optimisers_pickle_and_deepcopy_with_identical_updates(name, make):
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = [random_grads(rng, params) for _ in range(6)]
    opt = make()
    expected, _ = run_updates(opt, params, grads)
    for copied in (pickle.loads(pickle.dumps(opt)), copy.deepcopy(opt)):
        got, _ = run_updates(copied, params, grads)
        for a_leaves, e_leaves in zip(got, expected):
            for a, e in zip(a_leaves, e_leaves):
                np.testing.assert_array_equal(a, e)
    # A state pickled mid-run resumes where it was.
    _, state = run_updates(opt, params, grads[:3])
    resumed, _ = run_updates(pickle.loads(pickle.dumps(opt)), params, grads[3:], pickle.loads(pickle.dumps(state)))
    for a_leaves, e_leaves in zip(resumed, expected[3:]):
        for a, e in zip(a_leaves, e_leaves):
            np.testing.assert_array_equal(a, e)


# ---- the step count stays an array ---------------------------------------------------


class NoHostCount(np.ndarray):
    """A 0-d count that refuses to become a Python number (a GPU count would sync)."""

    def __int__(self):
        raise AssertionError("the count was converted to a Python int")

    __index__ = __int__

    def __float__(self):
        raise AssertionError("the count was converted to a Python float")

    def __bool__(self):
        raise AssertionError("the count was read as a Python bool")


def with_host_free_counts(state):
    if isinstance(state, tuple) and hasattr(type(state), "_fields") and "count" in type(state)._fields:
        return state._replace(count=np.asarray(state.count).view(NoHostCount), **{
            f: with_host_free_counts(getattr(state, f)) for f in type(state)._fields if f != "count"})
    if isinstance(state, dict):
        return {k: with_host_free_counts(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        children = [with_host_free_counts(v) for v in state]
        return type(state)(*children) if hasattr(type(state), "_fields") else type(state)(children)
    return state


@pytest.mark.parametrize("make", [
    lambda: optim.adam(optim.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10), nesterov=True),
    lambda: optim.radam(optim.exponential_decay(1e-2, 2, 0.5, staircase=True, end_value=1e-3)),
    lambda: optim.amsgrad(optim.piecewise_constant_schedule(1e-2, {3: 0.1})),
    lambda: optim.adabelief(optim.cosine_onecycle_schedule(10, 1e-2)),
    lambda: optim.adamax(optim.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=1, decay_steps=3)] * 2)),
    lambda: optim.lion(optim.linear_onecycle_schedule(10, 1e-3)),
    lambda: optim.adafactor(optim.polynomial_schedule(1e-2, 0.0, 2, 8)),
    lambda: optim.chain(optim.ema(0.9), optim.sgd(optim.warmup_exponential_decay_schedule(0.0, 1.0, 2, 2, 0.5))),
], ids=["adam", "radam", "amsgrad", "adabelief", "adamax", "lion", "adafactor", "ema"])
def test_update_never_reads_the_step_count_on_the_host(make):
    rng = np.random.default_rng(0)
    params = make_params(rng)
    opt = make()
    state = opt.init(params)
    for _ in range(4):  # into every branch of the schedules and of radam's rectification
        state = with_host_free_counts(state)
        _, state = opt.update(random_grads(rng, params), state, params)


def test_numpy_scalars_from_the_count_do_not_promote_float32_arithmetic():
    # np.float64 is a Python float; under NEP 50 it would promote every float32 product.
    assert optim.arrays.scalar_as(np.float64(0.5), np.float32).dtype == np.float32
    assert optim.arrays.scalar_as(0.5, np.float32) == 0.5
