"""luxnn.optim: optimisers against torch.optim, building blocks and schedules by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

import luxnn.optim as optim
from luxnn import tree

STEPS = 5


def make_params(rng: np.random.Generator) -> dict:
    return {"layer_1": {"weight": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,))},
            "layer_2": {"weight": rng.normal(size=(4, 2))}}


def make_grads(rng: np.random.Generator, params: dict) -> list[dict]:
    """A different gradient per step, so that moments and momentum really matter."""
    return [tree.map(lambda p: rng.normal(size=p.shape), params) for _ in range(STEPS)]


def run_luxnn(opt: optim.GradientTransformation, params: dict, grads_per_step: list[dict]) -> dict:
    params = tree.map(np.copy, params)
    state = opt.init(params)
    for grads in grads_per_step:
        updates, state = opt.update(grads, state, params)
        params = optim.apply_updates(params, updates)
    return params


def run_torch(make_optimizer, params: dict, grads_per_step: list[dict], make_scheduler=None) -> dict:
    torch = pytest.importorskip("torch")
    paths = [path for path, _ in tree.paths(params)]
    tensors = {path: torch.tensor(leaf, dtype=torch.float64, requires_grad=True)
               for path, leaf in tree.paths(params)}
    optimizer = make_optimizer(list(tensors.values()))
    scheduler = make_scheduler(optimizer) if make_scheduler else None
    for grads in grads_per_step:
        for path, g in tree.paths(grads):
            tensors[path].grad = torch.tensor(g, dtype=torch.float64)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
    flat = [tensors[path].detach().numpy() for path in paths]
    return tree.unflatten(tree.structure(params), flat)


def assert_trees_close(actual: dict, expected: dict, rtol: float = 1e-10) -> None:
    for (path, a), (_, e) in zip(tree.paths(actual), tree.paths(expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-13, err_msg=path)


CASES = [
    ("sgd", lambda: optim.sgd(0.1), lambda t, ps: t.optim.SGD(ps, lr=0.1)),
    ("sgd momentum", lambda: optim.sgd(0.1, momentum=0.9),
     lambda t, ps: t.optim.SGD(ps, lr=0.1, momentum=0.9)),
    ("sgd nesterov", lambda: optim.sgd(0.05, momentum=0.8, nesterov=True),
     lambda t, ps: t.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True)),
    ("adam", lambda: optim.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6),
     lambda t, ps: t.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.95), eps=1e-6)),
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1),
     lambda t, ps: t.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)),
    ("rmsprop", lambda: optim.rmsprop(1e-2, decay=0.9),
     lambda t, ps: t.optim.RMSprop(ps, lr=1e-2, alpha=0.9, eps=1e-8)),
    ("rmsprop momentum", lambda: optim.rmsprop(1e-2, decay=0.95, eps=1e-3, momentum=0.7),
     lambda t, ps: t.optim.RMSprop(ps, lr=1e-2, alpha=0.95, eps=1e-3, momentum=0.7)),
    ("rmsprop centered", lambda: optim.rmsprop(1e-2, decay=0.9, eps=1e-3, momentum=0.5, centered=True),
     lambda t, ps: t.optim.RMSprop(ps, lr=1e-2, alpha=0.9, eps=1e-3, momentum=0.5, centered=True)),
    ("adagrad", lambda: optim.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-6),
     lambda t, ps: t.optim.Adagrad(ps, lr=0.1, initial_accumulator_value=0.1, eps=1e-6)),
]


@pytest.mark.parametrize("name, make_ours, make_theirs", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_optim(name, make_ours, make_theirs):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    params = make_params(rng)
    grads = make_grads(rng, params)
    expected = run_torch(lambda ps: make_theirs(torch, ps), params, grads)
    assert_trees_close(run_luxnn(make_ours(), params, grads), expected)


def test_schedule_learning_rate_matches_torch_lambda_lr():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    params = make_params(rng)
    grads = make_grads(rng, params)
    schedule = optim.warmup_cosine_decay_schedule(0.0, 0.1, warmup_steps=2, decay_steps=STEPS)

    expected = run_torch(lambda ps: torch.optim.Adam(ps, lr=1.0), params, grads,
                         make_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule))
    assert_trees_close(run_luxnn(optim.adam(schedule), params, grads), expected)


def test_chain_clip_and_decay_by_hand():
    params = {"a": np.array([1.0, -2.0]), "b": np.array([[0.5]])}
    grads = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]])}  # global norm 5
    opt = optim.chain(optim.clip_by_global_norm(2.5), optim.add_decayed_weights(0.1),
                      optim.scale_by_learning_rate(0.5))
    updates, state = opt.update(grads, opt.init(params), params)
    # clipped: g * 2.5 / 5; decayed: + 0.1 p; scaled: * -0.5
    np.testing.assert_allclose(updates["a"], -0.5 * (np.array([1.5, 0.0]) + 0.1 * np.array([1.0, -2.0])), rtol=1e-15)
    np.testing.assert_allclose(updates["b"], -0.5 * (np.array([[2.0]]) + 0.1 * np.array([[0.5]])), rtol=1e-15)
    assert state == (optim.EmptyState(),) * 3


def test_clip_by_global_norm_leaves_small_updates_unchanged():
    grads = {"a": np.array([0.3, 0.4], np.float32)}
    updates, _ = optim.clip_by_global_norm(1.0).update(grads, optim.EmptyState())
    np.testing.assert_array_equal(updates["a"], grads["a"])
    assert updates["a"].dtype == np.float32


def test_global_norm():
    assert float(optim.global_norm({"a": np.array([3.0]), "b": [np.array([[4.0, 12.0]])]})) == 13.0
    assert float(optim.global_norm({"h": np.full(4, 300.0, np.float16)})) == 600.0  # no float16 overflow


def test_adam_state_counts_steps_as_0d_int64_arrays():
    params = {"w": np.zeros(2)}
    opt = optim.adam(1e-3)
    state = opt.init(params)
    for _ in range(3):
        _, state = opt.update({"w": np.ones(2)}, state, params)
    adam_state = state[0]
    assert isinstance(adam_state.count, np.ndarray) and adam_state.count.shape == ()
    assert adam_state.count.dtype == np.int64 and int(adam_state.count) == 3
    assert all(isinstance(leaf, np.ndarray) for leaf in tree.leaves(state))


def test_update_is_pure():
    params = {"w": np.ones(3)}
    grads = {"w": np.full(3, 0.5)}
    opt = optim.sgd(0.1, momentum=0.9)
    state = opt.init(params)
    _, new_state = opt.update(grads, state, params)
    np.testing.assert_array_equal(state[0].trace["w"], np.zeros(3))
    assert new_state[0].trace["w"] is not state[0].trace["w"]
    np.testing.assert_array_equal(grads["w"], np.full(3, 0.5))


@pytest.mark.parametrize("make_opt", [lambda: optim.sgd(0.1, momentum=0.9), lambda: optim.adam(1e-2),
                                      lambda: optim.adamw(1e-2), lambda: optim.rmsprop(1e-2, centered=True),
                                      lambda: optim.adagrad(1e-2),
                                      lambda: optim.sgd(optim.linear_schedule(0.1, 0.0, 10))])
def test_float32_stays_float32(make_opt):
    params = {"w": np.ones((2, 2), np.float32)}
    opt = make_opt()
    state = opt.init(params)
    updates, state = opt.update({"w": np.full((2, 2), 0.5, np.float32)}, state, params)
    assert updates["w"].dtype == np.float32
    assert all(leaf.dtype in (np.float32, np.int64) for leaf in tree.leaves(state))


def test_schedule_returning_numpy_float64_keeps_float32():
    params = {"w": np.ones(2, np.float32)}
    opt = optim.sgd(lambda step: np.float64(0.1))
    updates, _ = opt.update({"w": np.ones(2, np.float32)}, opt.init(params), params)
    assert updates["w"].dtype == np.float32


def test_apply_updates_returns_new_arrays_with_param_dtype():
    w = np.ones(3, np.float32)
    new = optim.apply_updates({"w": w}, {"w": np.full(3, -0.25)})  # float64 updates
    assert new["w"] is not w and new["w"].dtype == np.float32
    np.testing.assert_array_equal(new["w"], np.full(3, 0.75, np.float32))
    np.testing.assert_array_equal(w, np.ones(3, np.float32))


def test_apply_updates_in_place():
    w, b = np.ones((2, 3), np.float32), np.zeros(3, np.float32)
    params = {"w": w, "b": b}
    out = optim.apply_updates_(params, {"w": np.full((2, 3), -0.5), "b": np.full(3, 0.25, np.float32)})
    assert out is params and out["w"] is w and out["b"] is b
    assert w.dtype == np.float32 and b.dtype == np.float32
    np.testing.assert_array_equal(w, np.full((2, 3), 0.5, np.float32))
    np.testing.assert_array_equal(b, np.full(3, 0.25, np.float32))


def test_apply_updates_in_place_checks_before_touching_anything():
    w = np.ones(2)
    with pytest.raises(ValueError, match="updates do not match params"):
        optim.apply_updates_({"a": w, "b": np.ones(2)}, {"a": np.ones(2), "c": np.ones(2)})
    np.testing.assert_array_equal(w, np.ones(2))


@pytest.mark.parametrize("grads, fragment", [
    ({"w": np.ones(2)}, "expected keys"),
    ({"w": np.ones(2), "b": np.ones(3), "extra": np.ones(1)}, "expected keys"),
    ({"w": np.ones(3), "b": np.ones(3)}, "at 'w': expected shape (2,), got (3,)"),
    ({"w": [np.ones(2)], "b": np.ones(3)}, "at 'w': expected an array, got a list"),
])
def test_mismatched_grads_raise_naming_both(grads, fragment):
    params = {"w": np.ones(2), "b": np.ones(3)}
    for opt in (optim.adam(), optim.sgd(0.1, momentum=0.5), optim.rmsprop(0.1), optim.adagrad(0.1)):
        with pytest.raises(ValueError, match="grads do not match the optimizer state") as info:
            opt.update(grads, opt.init(params), params)
        assert fragment in str(info.value)
    with pytest.raises(ValueError, match="grads do not match params"):
        optim.add_decayed_weights(0.1).update(grads, optim.EmptyState(), params)
    with pytest.raises(ValueError, match="updates do not match params"):
        optim.apply_updates(params, grads)


def test_state_of_another_optimizer_is_rejected():
    params = {"w": np.ones(2)}
    with pytest.raises(ValueError, match="chain of 2 transformations"):
        optim.adam().update(params, optim.sgd(0.1).init(params), params)
    momentum = optim.sgd(0.1, momentum=0.9).init(params)
    for update, state in [(optim.adam().update, momentum), (optim.adam().update_, momentum),
                          (optim.scale_by_adam().update, momentum[0])]:
        with pytest.raises(ValueError, match=r"expected an optimizer state of type ScaleByAdamState, got one of type "
                                             r"TraceState: it was made by another optimizer"):
            update(params, state, params)


@pytest.mark.parametrize("make", [lambda lr: optim.adam(lr), lambda lr: optim.sgd(lr, momentum=0.9),
                                  lambda lr: optim.scale_by_learning_rate(lr)])
def test_a_schedule_that_gives_a_value_that_is_not_finite_is_refused(make):
    params = {"w": np.ones(2)}
    opt = make(lambda count: float("nan") if count >= 1 else 0.1)
    state = opt.init(params)
    _, state = opt.update({"w": np.ones(2)}, state, params)
    with pytest.raises(ValueError, match=r"the schedule gave nan at step 1; a schedule must give a finite number"):
        opt.update({"w": np.ones(2)}, state, params)


def test_a_hyperparameter_given_as_a_string_is_refused():
    with pytest.raises(ValueError, match=r"adam: learning_rate must be a real number, got '0.1'"):
        optim.adam("0.1")
    with pytest.raises(ValueError, match=r"sgd: momentum must be a real number, got '0.9'"):
        optim.sgd(0.1, momentum="0.9")


def test_add_decayed_weights_needs_params():
    with pytest.raises(ValueError, match="needs the parameters"):
        optim.adamw().update({"w": np.ones(1)}, optim.adamw().init({"w": np.ones(1)}))


@pytest.mark.parametrize("make, name", [
    (lambda: optim.sgd(-0.1), "learning_rate"),
    (lambda: optim.adam(-1e-3), "learning_rate"),
    (lambda: optim.adamw(weight_decay=-1.0), "weight_decay"),
    (lambda: optim.adam(b1=1.0), "b1"),
    (lambda: optim.adam(b2=-0.1), "b2"),
    (lambda: optim.adam(eps=float("nan")), "eps"),
    (lambda: optim.sgd(0.1, momentum=-0.9), "momentum"),
    (lambda: optim.sgd(0.1, nesterov=True), "nesterov"),
    (lambda: optim.rmsprop(0.1, decay=1.5), "decay"),
    (lambda: optim.adagrad(0.1, initial_accumulator_value=-1.0), "initial_accumulator_value"),
    (lambda: optim.clip_by_global_norm(0.0), "max_norm"),
    (lambda: optim.sgd("fast"), "learning_rate"),
    (lambda: optim.linear_schedule(1.0, 0.0, transition_steps=0), "transition_steps"),
    (lambda: optim.cosine_decay_schedule(1.0, decay_steps=0), "decay_steps"),
    (lambda: optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=10, decay_steps=10), "decay_steps"),
])
def test_invalid_hyperparameters_raise_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_constant_schedule():
    schedule = optim.constant_schedule(0.3)
    assert [schedule(step) for step in (0, 1, 10**6)] == [0.3, 0.3, 0.3]


def test_linear_schedule():
    schedule = optim.linear_schedule(1.0, 0.2, transition_steps=8, transition_begin=4)
    assert schedule(0) == 1.0 and schedule(4) == 1.0
    assert schedule(6) == pytest.approx(1.0 - 0.8 * 2 / 8, abs=1e-15)
    assert schedule(12) == pytest.approx(0.2, abs=1e-15) and schedule(1000) == pytest.approx(0.2, abs=1e-15)


def test_cosine_decay_schedule():
    schedule = optim.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1)
    for step in (0, 3, 5, 10, 50):
        cosine = 0.5 * (1 + math.cos(math.pi * min(step, 10) / 10))
        assert schedule(step) == pytest.approx(2.0 * (0.9 * cosine + 0.1), abs=1e-15)
    assert schedule(0) == 2.0 and schedule(5) == pytest.approx(1.1) and schedule(50) == pytest.approx(0.2)


def test_warmup_cosine_decay_schedule():
    schedule = optim.warmup_cosine_decay_schedule(0.1, 1.0, warmup_steps=4, decay_steps=14, end_value=0.05)
    assert schedule(0) == pytest.approx(0.1) and schedule(2) == pytest.approx(0.55) and schedule(4) == 1.0
    # optax: cosine decay from 1.0 over 14 - 4 steps with alpha = end / peak
    assert schedule(9) == pytest.approx(0.05 + 0.95 * 0.5) and schedule(14) == pytest.approx(0.05)
    assert schedule(100) == pytest.approx(0.05)
    no_warmup = optim.warmup_cosine_decay_schedule(0.0, 1.0, warmup_steps=0, decay_steps=10)
    assert no_warmup(0) == 1.0 and no_warmup(5) == pytest.approx(0.5)


def test_schedule_sees_zero_based_step():
    seen = []
    opt = optim.sgd(lambda step: seen.append(step) or 0.1)
    params = {"w": np.zeros(1)}
    state = opt.init(params)
    for _ in range(3):
        _, state = opt.update({"w": np.ones(1)}, state, params)
    assert seen == [0, 1, 2]


def test_training_a_quadratic_converges():
    target = np.array([1.0, -2.0, 3.0])
    params = {"x": np.zeros(3)}
    opt = optim.chain(optim.clip_by_global_norm(10.0), optim.adam(0.1))
    state = opt.init(params)
    for _ in range(300):
        updates, state = opt.update({"x": 2 * (params["x"] - target)}, state, params)
        params = optim.apply_updates_(params, updates)
    np.testing.assert_allclose(params["x"], target, atol=1e-3)


LONG_CASES = [  # 12 steps: radam's rectification starts at step 6 with b2=0.9
    ("radam", lambda: optim.radam(1e-2, b2=0.9, eps=0.0),  # torch scales eps by sqrt(1 - b2**t): alike at 0
     lambda t, ps: t.optim.RAdam(ps, lr=1e-2, betas=(0.9, 0.9), eps=0.0)),
    ("nadam", lambda: optim.nadam(1e-2, b1=0.8),  # torch's momentum schedule is constant b1 once 0.96**(t*psi) is 0
     lambda t, ps: t.optim.NAdam(ps, lr=1e-2, betas=(0.8, 0.999), momentum_decay=1e9)),
    ("adamax", lambda: optim.adamax(1e-2, b1=0.8, b2=0.95),
     lambda t, ps: t.optim.Adamax(ps, lr=1e-2, betas=(0.8, 0.95))),
    ("adadelta", lambda: optim.adadelta(1.0, rho=0.8, eps=1e-4, weight_decay=0.1),
     lambda t, ps: t.optim.Adadelta(ps, lr=1.0, rho=0.8, eps=1e-4, weight_decay=0.1)),
]


@pytest.mark.parametrize("name, make_ours, make_theirs", LONG_CASES, ids=[c[0] for c in LONG_CASES])
def test_matches_torch_optim_over_12_steps(name, make_ours, make_theirs):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    params = make_params(rng)
    grads = [tree.map(lambda p: rng.normal(size=p.shape), params) for _ in range(12)]
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # NAdam keeps its momentum product in the default dtype
    try:
        expected = run_torch(lambda ps: make_theirs(torch, ps), params, grads)
    finally:
        torch.set_default_dtype(default)
    assert_trees_close(run_luxnn(make_ours(), params, grads), expected)


SCHEDULERS = [
    ("StepLR", lambda: optim.exponential_decay(0.1, transition_steps=3, decay_rate=0.5, staircase=True),
     lambda t, opt: t.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)),
    ("ExponentialLR", lambda: optim.exponential_decay(0.1, transition_steps=1, decay_rate=0.9),
     lambda t, opt: t.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)),
    ("MultiStepLR", lambda: optim.piecewise_constant_schedule(0.1, {4: 0.1, 9: 0.1}),
     lambda t, opt: t.optim.lr_scheduler.MultiStepLR(opt, milestones=[4, 9], gamma=0.1)),
    ("CosineAnnealingLR", lambda: optim.cosine_decay_schedule(0.1, decay_steps=12, alpha=0.05),
     lambda t, opt: t.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=12, eta_min=0.005)),
    ("LinearLR", lambda: optim.linear_schedule(0.05, 0.1, transition_steps=6),
     lambda t, opt: t.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, end_factor=1.0, total_iters=6)),
    ("PolynomialLR", lambda: optim.polynomial_schedule(0.1, 0.0, power=2.0, transition_steps=10),
     lambda t, opt: t.optim.lr_scheduler.PolynomialLR(opt, total_iters=10, power=2.0)),
]


@pytest.mark.parametrize("name, make_ours, make_theirs", SCHEDULERS, ids=[c[0] for c in SCHEDULERS])
def test_schedules_match_torch_lr_schedulers(name, make_ours, make_theirs):
    torch = pytest.importorskip("torch")
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    scheduler = make_theirs(torch, optimizer)
    ours = make_ours()
    for step in range(13):  # CosineAnnealingLR climbs again after T_max
        assert ours(step) == pytest.approx(scheduler.get_last_lr()[0], rel=1e-12, abs=1e-15), step
        optimizer.step()
        scheduler.step()


def test_noisy_sgd_noise_is_seeded_and_annealed():
    params = {"w": np.zeros(20000)}
    zero = {"w": np.zeros(20000)}
    opt = optim.noisy_sgd(1.0, eta=0.04, gamma=0.55, seed=7)
    state = opt.init(params)
    for step in range(1, 4):
        updates, state = opt.update(zero, state, params)
        assert np.std(updates["w"]) == pytest.approx(np.sqrt(0.04 / step**0.55), rel=0.03)
    again = optim.noisy_sgd(1.0, eta=0.04, gamma=0.55, seed=7)
    np.testing.assert_array_equal(again.update(zero, again.init(params), params)[0]["w"],
                                  opt.update(zero, opt.init(params), params)[0]["w"])
    other = optim.noisy_sgd(1.0, eta=0.04, seed=8)
    assert not np.array_equal(other.update(zero, other.init(params), params)[0]["w"],
                              opt.update(zero, opt.init(params), params)[0]["w"])


@pytest.mark.parametrize("make, name", [
    (lambda: optim.lion(1e-3, b1=1.0), "b1"),
    (lambda: optim.radam(1e-3, b2=-0.1), "b2"),
    (lambda: optim.lamb(-1.0), "learning_rate"),
    (lambda: optim.lars(0.1, momentum=-1.0), "momentum"),
    (lambda: optim.adafactor(decay_rate=float("nan")), "decay_rate"),
    (lambda: optim.adamaxw(1e-3, weight_decay=-1e-2), "weight_decay"),
    (lambda: optim.nadamw(1e-3, eps=-1.0), "eps"),
    (lambda: optim.adadelta(rho=1.0), "rho"),
    (lambda: optim.amsgrad(1e-3, eps_root=-1.0), "eps_root"),
    (lambda: optim.adabelief(1e-3, b1=2.0), "b1"),
    (lambda: optim.noisy_sgd(0.1, eta=-1.0), "eta"),
    (lambda: optim.ema(1.5), "decay"),
    (lambda: optim.clip(-1.0), "max_delta"),
    (lambda: optim.adaptive_grad_clip(-0.1), "clipping"),
    (lambda: optim.MultiSteps(optim.sgd(0.1), 0), "every_k_schedule"),
    (lambda: optim.apply_if_finite(optim.sgd(0.1), -1), "max_consecutive_errors"),
    (lambda: optim.masked("adam", True), "masked: inner"),
    (lambda: optim.multi_transform({}, {}), "transforms"),
    (lambda: optim.exponential_decay(1.0, transition_steps=0, decay_rate=0.5), "transition_steps"),
    (lambda: optim.exponential_decay(1.0, transition_steps=2, decay_rate=0.0), "decay_rate"),
    (lambda: optim.piecewise_constant_schedule(1.0, {3: -0.5}), "scale at step 3"),
    (lambda: optim.polynomial_schedule(1.0, 0.0, 1.0, transition_steps=-1), "transition_steps"),
    (lambda: optim.join_schedules([optim.constant_schedule(1.0)], [3]), "boundaries"),
    (lambda: optim.cosine_onecycle_schedule(0, 1.0), "transition_steps"),
    (lambda: optim.linear_onecycle_schedule(10, 1.0, div_factor=0.0), "div_factor"),
    (lambda: optim.sgdr_schedule([]), "cosine_kwargs"),
    (lambda: optim.piecewise_interpolate_schedule("cubic", 1.0), "interpolate_type"),
    (lambda: optim.incremental_update({"w": np.ones(1)}, {"w": np.ones(1)}, 1.5), "step_size"),
])
def test_invalid_arguments_of_the_new_optimisers_raise_naming_them(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_incremental_and_periodic_updates():
    online, target = {"w": np.full(2, 4.0, np.float32)}, {"w": np.zeros(2, np.float32)}
    averaged = optim.incremental_update(online, target, 0.25)
    assert averaged["w"].dtype == np.float32
    np.testing.assert_array_equal(averaged["w"], np.full(2, 1.0, np.float32))
    assert optim.periodic_update(online, target, steps=np.asarray(6), update_period=3) is online
    assert optim.periodic_update(online, target, steps=7, update_period=3) is target
