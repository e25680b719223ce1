"""The in-place update (`GradientTransformation.update_`, `update_and_apply_`, the verbs
`apply_gradients_` and `single_train_step_`) against optax's pure `update`: the same
numbers for every optimiser, building block and wrapper over 20 steps in float64, the
moments really written in place, and the pure path still never writing its inputs."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import luxnn as lx
import luxnn.optim as optim
from luxnn import tree

STEPS = 20
RTOL = 1e-12


def make_params(rng: np.random.Generator) -> dict:
    """Leaves of 0 to 4 axes in dicts and a list, float64 but for one float32 and one
    float16 leaf (whose moments are float32)."""
    return {
        "dense": {"weight": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,))},
        "conv": {"kernel": rng.normal(size=(2, 2, 3, 5))},
        "scale": rng.normal(size=()),
        "blocks": [rng.normal(size=(5, 3)).astype(np.float32), rng.normal(size=(6,)).astype(np.float16)],
    }


def make_grads(rng: np.random.Generator, params: dict, nan_steps: tuple = ()) -> list[dict]:
    grads = [tree.map(lambda p: rng.normal(size=np.shape(p)).astype(p.dtype), params) for _ in range(STEPS)]
    for step in nan_steps:
        grads[step]["dense"]["weight"][0, 0] = np.nan
    return grads


def weights_only(params):
    return tree.map(lambda p: np.ndim(p) > 1, params)


def by_hand_sgd(learning_rate: float) -> optim.GradientTransformation:
    """A user's transformation of two closures: no in-place update of its own."""

    def init(params):
        return optim.EmptyState()

    def update(grads, state, params=None):
        return tree.map(lambda g: -learning_rate * g, grads), state

    return optim.GradientTransformation(init, update)


LABELS = {"dense": {"weight": "adam", "bias": "sgd"}, "conv": "adam", "scale": "frozen", "blocks": ["sgd", "adam"]}

# (name, make, how many arrays of its state an in-place update keeps: its moments)
LEAVES, WEIGHTS = 6, 3  # the leaves of make_params, and those of 2 axes or more
CASES = [
    ("sgd", lambda: optim.sgd(0.1), 0),
    ("sgd momentum", lambda: optim.sgd(0.1, momentum=0.9), 1 * LEAVES),
    ("sgd nesterov", lambda: optim.sgd(0.1, 0.8, True), 1 * LEAVES),
    ("sgd schedule", lambda: optim.sgd(optim.linear_schedule(0.1, 0.01, 10), momentum=0.5), 1 * LEAVES),
    ("adam", lambda: optim.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6), 2 * LEAVES),
    ("adam eps_root", lambda: optim.adam(1e-2, eps_root=1e-6), 2 * LEAVES),
    ("adam schedule", lambda: optim.adam(optim.cosine_decay_schedule(1e-2, 10)), 2 * LEAVES),
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1), 2 * LEAVES),
    ("adamw mask", lambda: optim.adamw(1e-2, weight_decay=0.1, mask=weights_only), 2 * LEAVES),
    ("nadam", lambda: optim.nadam(1e-2), 2 * LEAVES),
    ("nadamw", lambda: optim.nadamw(1e-2, weight_decay=0.05), 2 * LEAVES),
    ("radam", lambda: optim.radam(1e-2), 2 * LEAVES),
    ("radam nesterov", lambda: optim.radam(1e-2, b2=0.9, nesterov=True), 2 * LEAVES),
    ("adamax", lambda: optim.adamax(1e-2), 2 * LEAVES),
    ("adamaxw", lambda: optim.adamaxw(1e-2, weight_decay=0.1), 2 * LEAVES),
    ("amsgrad", lambda: optim.amsgrad(1e-2, b2=0.9), 3 * LEAVES),
    ("amsgrad uncorrected", lambda: optim.amsgrad(1e-2, bias_correction_mu=False, bias_correction_nu=False),
     3 * LEAVES),
    ("adabelief", lambda: optim.adabelief(1e-2), 2 * LEAVES),
    ("adabelief nesterov", lambda: optim.adabelief(1e-2, nesterov=True), 2 * LEAVES),
    ("adadelta", lambda: optim.adadelta(1.0, rho=0.8, weight_decay=0.01), 2 * LEAVES),
    ("lamb", lambda: optim.lamb(1e-2, weight_decay=0.01), 2 * LEAVES),
    ("lars", lambda: optim.lars(0.1, weight_decay=1e-2, nesterov=True), 1 * LEAVES),
    ("lion", lambda: optim.lion(1e-3, weight_decay=0.01), 1 * LEAVES),
    ("adafactor", lambda: optim.adafactor(1e-2), 1 * LEAVES),
    ("adafactor factored", lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9,
                                                   weight_decay_rate=0.01), 2 * LEAVES),
    ("rmsprop", lambda: optim.rmsprop(1e-2, decay=0.9, eps=1e-3), 1 * LEAVES),
    ("rmsprop centered momentum", lambda: optim.rmsprop(1e-2, decay=0.9, eps=1e-3, momentum=0.9, centered=True),
     3 * LEAVES),
    ("adagrad", lambda: optim.adagrad(0.1, initial_accumulator_value=0.1), 1 * LEAVES),
    ("noisy_sgd", lambda: optim.noisy_sgd(0.1, seed=3), 0),
    ("ema", lambda: optim.ema(0.9), 1 * LEAVES),
    ("ema not debiased", lambda: optim.ema(0.8, debias=False), 1 * LEAVES),
    ("clip, adam", lambda: optim.chain(optim.clip_by_global_norm(2.0), optim.clip(1.0), optim.adam(1e-2)), 2 * LEAVES),
    ("zero_nans, adam", lambda: optim.chain(optim.zero_nans(), optim.adam(1e-2)), 2 * LEAVES),
    ("agc, trust ratio", lambda: optim.chain(optim.adaptive_grad_clip(0.3), optim.scale_by_adam(),
                                             optim.scale_by_trust_ratio(min_norm=0.5), optim.scale(-0.1)), 2 * LEAVES),
    ("param block rms", lambda: optim.chain(optim.clip_by_block_rms(0.7), optim.scale_by_param_block_rms(0.5),
                                            optim.scale(-0.1)), 0),
    ("identity", optim.identity, 0),
    ("empty chain", optim.chain, 0),
    ("a user's transformation", lambda: by_hand_sgd(0.1), 0),
    ("a user's transformation in a chain", lambda: optim.chain(optim.trace(0.9), by_hand_sgd(0.1)), 1 * LEAVES),
    ("masked", lambda: optim.masked(optim.adam(1e-2), weights_only), 2 * WEIGHTS),
    ("masked prefix", lambda: optim.masked(optim.sgd(0.1, 0.9), {"dense": True, "conv": False, "scale": True,
                                                                 "blocks": False}), 3),
    ("masked user's", lambda: optim.masked(by_hand_sgd(0.1), weights_only), 0),
    ("multi_transform", lambda: optim.multi_transform(
        {"adam": optim.adam(1e-2), "sgd": optim.sgd(0.1, 0.5), "frozen": optim.set_to_zero()}, LABELS), 3 * 2 + 2),
    ("multi_transform of masked and a user's", lambda: optim.multi_transform(
        {"adam": optim.adamw(1e-2, weight_decay=0.1, mask=weights_only), "sgd": by_hand_sgd(0.1),
         "frozen": optim.set_to_zero()}, LABELS), 3 * 2),
    ("MultiSteps", lambda: optim.MultiSteps(optim.adam(1e-2), every_k_schedule=3), 3 * LEAVES),
    ("MultiSteps sum", lambda: optim.MultiSteps(optim.sgd(0.1, 0.9), 4, use_grad_mean=False), 2 * LEAVES),
    ("MultiSteps every step", lambda: optim.MultiSteps(optim.identity(), 1 * LEAVES), 0),
    ("apply_if_finite", lambda: optim.apply_if_finite(optim.adam(1e-2), max_consecutive_errors=2), 2 * LEAVES),
    ("inject_hyperparams", lambda: optim.inject_hyperparams(optim.adam)(learning_rate=1e-2, b1=0.8), 2 * LEAVES),
    ("inject_hyperparams schedule", lambda: optim.inject_hyperparams(optim.adamw)(
        learning_rate=optim.linear_schedule(0.5, 0.25, 8), weight_decay=0.1), 2 * LEAVES),
]
NAN_STEPS = {"zero_nans, adam": (3, 4), "apply_if_finite": (2, 5, 6)}


def assert_trees_close(actual, expected, what: str) -> None:
    actual_leaves, expected_leaves = tree.leaves(actual), tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), what
    for i, (a, e) in enumerate(zip(actual_leaves, expected_leaves)):
        a, e = np.asarray(a), np.asarray(e)
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}, leaf {i}"
        if e.dtype.kind != "f":
            np.testing.assert_array_equal(a, e, err_msg=f"{what}, leaf {i}")
            continue
        scale = float(np.max(np.abs(e[np.isfinite(e)]), initial=0.0))
        np.testing.assert_allclose(a, e, rtol=RTOL, atol=RTOL * scale, err_msg=f"{what}, leaf {i}")


@pytest.mark.parametrize("name, make, kept_arrays", CASES, ids=[c[0] for c in CASES])
def test_in_place_updates_equal_the_pure_ones_over_20_steps(name, make, kept_arrays):
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = make_grads(rng, params, NAN_STEPS.get(name, ()))
    opt = make()
    pure_params, pure_state = params, opt.init(params)
    twin_params, twin_state = params, opt.init(params)  # update_, then apply_updates
    added = tree.map(np.copy, params)  # update_and_apply_, in place
    added_state = opt.init(added)
    for step, g in enumerate(grads):
        updates, pure_state = opt.update(g, pure_state, pure_params)
        twin_updates, twin_state = opt.update_(g, twin_state, twin_params)
        assert_trees_close(twin_updates, updates, f"{name}: updates at step {step}")
        pure_params = optim.apply_updates(pure_params, updates)
        twin_params = optim.apply_updates(twin_params, twin_updates)
        added_state = optim.update_and_apply_(opt, g, added_state, added)
        assert_trees_close(added, pure_params, f"{name}: parameters at step {step}")
        assert_trees_close(twin_state, pure_state, f"{name}: state at step {step}")
        assert_trees_close(added_state, pure_state, f"{name}: state of update_and_apply_ at step {step}")


@pytest.mark.parametrize("name, make, kept_arrays", CASES, ids=[c[0] for c in CASES])
def test_in_place_updates_keep_the_moment_arrays(name, make, kept_arrays):
    params = make_params(np.random.default_rng(1))
    g = make_grads(np.random.default_rng(2), params)[0]
    opt = make()
    for run in ("update_", "update_and_apply_"):
        state = opt.init(params)
        old = {id(a) for a in tree.leaves(state) if np.ndim(a) > 0 or a.dtype.kind == "f"}
        if run == "update_":
            _, new_state = opt.update_(g, state, params)
        else:
            new_state = optim.update_and_apply_(opt, g, state, tree.map(np.copy, params))
        kept = sum(id(a) in old for a in tree.leaves(new_state))
        assert kept >= kept_arrays, (run, kept)


@pytest.mark.parametrize("name, make, kept_arrays", CASES, ids=[c[0] for c in CASES])
def test_the_pure_update_never_writes_its_inputs(name, make, kept_arrays):
    rng = np.random.default_rng(3)
    params = make_params(rng)
    opt = make()
    state = opt.init(params)
    for g in make_grads(rng, params, NAN_STEPS.get(name, ()))[:6]:
        before = copy.deepcopy((g, state, params))
        updates, new_state = opt.update(g, state, params)
        for now, then in zip(tree.leaves((g, state, params)), tree.leaves(before)):
            np.testing.assert_array_equal(now, then)
        state, params = new_state, optim.apply_updates(params, updates)


def test_update_in_place_also_never_writes_grads_or_params():
    rng = np.random.default_rng(4)
    params = make_params(rng)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1))
    state = opt.init(params)
    for g in make_grads(rng, params)[:4]:
        before = copy.deepcopy((g, params))
        _, state = opt.update_(g, state, params)
        for now, then in zip(tree.leaves((g, params)), tree.leaves(before)):
            np.testing.assert_array_equal(now, then)


def test_read_only_state_arrays_get_new_arrays_with_the_same_numbers():
    rng = np.random.default_rng(5)
    params = make_params(rng)
    g = make_grads(rng, params)[0]
    opt = optim.adam(1e-2)
    state = opt.init(params)
    for a in tree.leaves(state):
        a.flags.writeable = False  # as a loaded checkpoint's arrays may be
    frozen = copy.deepcopy(state)
    expected_updates, expected_state = opt.update(g, frozen, params)
    updates, new_state = opt.update_(g, state, params)
    assert_trees_close(updates, expected_updates, "updates")
    assert_trees_close(new_state, expected_state, "state")
    for now, then in zip(tree.leaves(state), tree.leaves(frozen)):
        np.testing.assert_array_equal(now, then)


@pytest.mark.parametrize("bad, fragment", [
    ("mismatched", r"grads do not match params at 'dense'"),
    ("read-only", r"update_and_apply_: the parameter at 'blocks/1' is read-only; nothing was updated"),
])  # fmt: skip
def test_update_and_apply_checks_before_writing_anything(bad, fragment):
    rng = np.random.default_rng(6)
    params = make_params(rng)
    g = make_grads(rng, params)[0]
    opt = optim.multi_transform({"adam": optim.adam(1e-2), "sgd": optim.sgd(0.1, 0.5),
                                 "frozen": optim.set_to_zero()}, LABELS)
    state = opt.init(params)
    if bad == "mismatched":
        g["dense"] = {"weight": g["dense"]["weight"]}
    else:
        params["blocks"][1].flags.writeable = False
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match=fragment):
        optim.update_and_apply_(opt, g, state, params)
    for now, then in zip(tree.leaves((params, state)), tree.leaves(before)):
        np.testing.assert_array_equal(now, then)


def test_the_in_place_verbs_train_as_the_pure_ones():
    model = lx.Chain(lx.Dense(6, 16, np.tanh), lx.Dense(16, 3))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = tree.map(lambda p: p.astype(np.float64), ps)
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.1, mask=weights_only))
    pure = lx.TrainState(model, ps, st, opt)
    in_place = lx.TrainState(model, tree.map(np.copy, ps), st, opt)
    moments = tree.leaves(in_place.optimizer_state[1][0].mu)
    rng = np.random.default_rng(1)
    loss = lx.losses.MSELoss()
    for step in range(20):
        batch = rng.normal(size=(8, 6)), rng.normal(size=(8, 3))
        _, _, _, pure = lx.single_train_step(lx.AutoTape(), loss, batch, pure)
        if step % 2:
            _, _, _, in_place = lx.single_train_step_(lx.AutoTape(), loss, batch, in_place)
        else:
            grads, _, _, in_place = lx.compute_gradients(lx.AutoTape(), loss, batch, in_place)
            in_place = lx.apply_gradients_(in_place, grads)
    assert in_place.step == pure.step == 20
    # The two runs make the same BLAS calls on the same values; 1e-10 leaves room for a
    # BLAS whose results depend on the buffers' alignment.
    for a, e in zip(tree.leaves((in_place.parameters, in_place.optimizer_state)),
                    tree.leaves((pure.parameters, pure.optimizer_state))):
        np.testing.assert_allclose(a, e, rtol=1e-10, atol=1e-12)
    assert all(a is b for a, b in zip(tree.leaves(in_place.optimizer_state[1][0].mu), moments))


@pytest.mark.parametrize("make, name", [
    (lambda: optim.adam(float("inf")), "adam: learning_rate"),
    (lambda: optim.adam(float("nan")), "adam: learning_rate"),
    (lambda: optim.adam(1e-3, eps=float("inf")), "eps"),
    (lambda: optim.sgd(float("inf")), "sgd: learning_rate"),
    (lambda: optim.sgd(0.1, momentum=float("inf")), "sgd: momentum"),
    (lambda: optim.adamw(1e-3, weight_decay=float("inf")), "adamw: weight_decay"),
    (lambda: optim.rmsprop(float("-inf")), "rmsprop: learning_rate"),
    (lambda: optim.clip_by_global_norm(float("inf")), "clip_by_global_norm: max_norm"),
    (lambda: optim.scale(float("-inf")), "scale: factor"),
    (lambda: optim.constant_schedule(float("inf")), "constant_schedule: value"),
    (lambda: optim.linear_schedule(1.0, float("-inf"), 10), "linear_schedule: end_value"),
    (lambda: optim.exponential_decay(1.0, 10, float("inf")), "exponential_decay: decay_rate"),
    (lambda: optim.piecewise_constant_schedule(1.0, {5: float("inf")}), "piecewise_constant_schedule: scale at step 5"),
    (lambda: optim.cosine_onecycle_schedule(100, float("inf")), "cosine_onecycle_schedule: peak_value"),
    (lambda: optim.inject_hyperparams(optim.adam)(learning_rate=float("inf")), "adam: learning_rate"),
    (lambda: optim.scale_by_factored_rms(min_dim_size_to_factor=2.5), "min_dim_size_to_factor"),
])  # fmt: skip
def test_hyperparameters_must_be_finite(make, name):
    with pytest.raises(ValueError, match=f"^{name} must be"):
        make()


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_set_hyperparams_refuses_a_value_that_is_not_finite(value):
    opt = optim.inject_hyperparams(optim.adam)(learning_rate=1e-3)
    state = opt.init({"w": np.zeros(2)})
    with pytest.raises(ValueError, match="set_hyperparams: learning_rate must be a finite number"):
        optim.set_hyperparams(state, learning_rate=value)


def _trace_then_injected_adam_with_b1_5():
    opt = optim.chain(optim.trace(0.9), optim.inject_hyperparams(optim.adam)(learning_rate=0.1))
    return opt, lambda params: optim.set_hyperparams(opt.init(params), b1=5.0)  # a bare state: checked at its update


def _trace_then_adam_given_two_traces():
    opt = optim.chain(optim.trace(0.9), optim.scale_by_adam())
    return opt, lambda params: (optim.trace(0.9).init(params),) * 2


def _with_init(opt):
    return opt, opt.init


@pytest.mark.parametrize("make, params_of, grads_of, fragment", [
    (_trace_then_injected_adam_with_b1_5, None, None, r"b1 must be in \[0.0, 1.0\), got 5.0"),
    (lambda: _with_init(optim.sgd(lambda count: float("nan"), momentum=0.9)), None, None,
     r"the schedule gave nan at step 0; a schedule must give a finite number"),
    (lambda: _with_init(optim.chain(optim.trace(0.9), optim.MultiSteps(optim.sgd(0.1), lambda n: 0))), None, None,
     r"MultiSteps: every_k_schedule gave 0 after 0 inner updates; it must give an integer >= 1"),
    (_trace_then_adam_given_two_traces, None, None,
     r"expected an optimizer state of type ScaleByAdamState, got one of type TraceState"),
    (lambda: _with_init(optim.sgd(0.1)), None, lambda g: {**g, "a": 0.5},
     r"update_and_apply_: the gradient at 'a' is a float; expected an array of shape \(3,\)"),
    (lambda: _with_init(optim.sgd(0.1)), lambda p: {"a": p["a"], "b": p["a"]}, None,
     r"the parameters at 'a' and 'b' share memory"),
    (lambda: _with_init(optim.sgd(0.1)), lambda p: {"a": p["b"][:3], "b": p["b"][2:]}, None,
     r"the parameters at 'a' and 'b' share memory"),
])  # fmt: skip
def test_update_and_apply_refuses_bad_input_of_a_later_stage_before_the_first_writes(make, params_of, grads_of, fragment):
    opt, init = make()
    params = {"a": np.ones(3), "b": np.full(5, 2.0)}
    params = params_of(params) if params_of else params
    grads = tree.map(np.ones_like, params)
    grads = grads_of(grads) if grads_of else grads
    state = init(params)
    before = copy.deepcopy((params, state))
    with pytest.raises(ValueError, match=fragment):
        optim.update_and_apply_(opt, grads, state, params)
    for now, then in zip(tree.leaves((params, state)), tree.leaves(before)):
        np.testing.assert_array_equal(now, then)


def test_views_that_share_no_memory_are_updated_as_the_pure_update_does():
    w = np.arange(6.0)
    params = {"even": w[::2], "odd": w[1::2]}  # interleaved: their spans overlap, their elements do not
    grads = {"even": np.ones(3), "odd": np.full(3, 2.0)}
    opt = optim.sgd(0.1)
    expected = optim.apply_updates(params, opt.update(grads, opt.init(params), params)[0])
    optim.update_and_apply_(opt, grads, opt.init(params), params)
    np.testing.assert_allclose(w, np.ravel(np.column_stack([expected["even"], expected["odd"]])))
