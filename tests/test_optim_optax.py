"""luxnn.optim against optax itself, in float64 (jax_enable_x64): every optimiser,
building block, wrapper and schedule, 20 steps on a random tree of several shapes, updates
equal to 1e-10 relative to each leaf's magnitude; schedules at every step of their range.

Eager JAX (no jit) on small trees keeps the file fast.
"""

from __future__ import annotations

import numpy as np
import pytest

import luxnn.optim as optim
from luxnn import tree

jax = pytest.importorskip("jax", reason="optax agreement tests need jax (pip install jax optax)")
optax = pytest.importorskip("optax", reason="optax agreement tests need optax (pip install optax)")
jnp = jax.numpy

STEPS = 20
RTOL = 1e-10


@pytest.fixture(autouse=True)
def float64_jax():
    with jax.enable_x64(True):
        yield


def make_params(rng: np.random.Generator) -> dict:
    """Leaves of 0 to 4 axes, in dicts and a list: a Dense layer, a conv kernel, a scalar, and an
    embedding table large enough for Adafactor's default factoring (both axes >= 128)."""
    return {
        "dense": {"weight": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,))},
        "conv": {"kernel": rng.normal(size=(2, 2, 3, 5))},
        "scale": rng.normal(size=()),
        "blocks": [rng.normal(size=(5, 3)), rng.normal(size=(6,))],
        "embedding": rng.normal(size=(160, 128)),
    }


def make_grads(rng: np.random.Generator, params: dict, nan_steps: tuple = ()) -> list[dict]:
    grads = [tree.map(lambda p: rng.normal(size=np.shape(p)), params) for _ in range(STEPS)]
    for step in nan_steps:
        grads[step]["dense"]["weight"][0, 0] = np.nan
    return grads


def weights_only(params):
    return tree.map(lambda p: np.ndim(p) > 1, params)


def weights_only_jax(params):
    return jax.tree.map(lambda p: p.ndim > 1, params)


LABELS = {"dense": {"weight": "adam", "bias": "sgd"}, "conv": "adam", "scale": "frozen", "blocks": ["sgd", "adam"],
          "embedding": "sgd"}


def run(opt, params: dict, grads: list[dict], *, to_array, apply, jit: bool = False) -> list[list[np.ndarray]]:
    """The updates of every step (as NumPy leaf lists), the parameters moving with them.
    `jit`: for optax's wrappers built on lax.cond, which eager JAX retraces at every call."""
    params = tree.map(to_array, params)
    state = opt.init(params)
    update = jax.jit(opt.update) if jit else opt.update
    out = []
    for g in grads:
        updates, state = update(tree.map(to_array, g), state, params)
        params = apply(params, updates)
        out.append([np.asarray(u) for u in jax.tree.leaves(updates)])
    return out


def assert_same_updates(ours: list, theirs: list, rtol: float = RTOL) -> None:
    for step, (a_leaves, e_leaves) in enumerate(zip(ours, theirs)):
        assert len(a_leaves) == len(e_leaves)
        for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
            scale = float(np.max(np.abs(e), initial=0.0))
            np.testing.assert_allclose(a, e, rtol=rtol, atol=rtol * scale, err_msg=f"step {step}, leaf {i}")


def compare(make_ours, make_theirs, *, seed: int = 0, nan_steps: tuple = (), rtol: float = RTOL,
            jit: bool = False) -> None:
    rng = np.random.default_rng(seed)
    params = make_params(rng)
    grads = make_grads(rng, params, nan_steps)
    ours = run(make_ours(), params, grads, to_array=np.array, apply=optim.apply_updates)
    theirs = run(make_theirs(), params, grads, to_array=jnp.asarray, apply=optax.apply_updates, jit=jit)
    assert_same_updates(ours, theirs, rtol)


OPTIMISERS = [
    ("sgd", lambda: optim.sgd(0.1), lambda: optax.sgd(0.1)),
    ("sgd momentum", lambda: optim.sgd(0.1, momentum=0.9), lambda: optax.sgd(0.1, momentum=0.9)),
    ("sgd nesterov", lambda: optim.sgd(0.1, 0.8, True), lambda: optax.sgd(0.1, 0.8, True)),
    ("adam", lambda: optim.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6), lambda: optax.adam(1e-2, b1=0.8, b2=0.95, eps=1e-6)),
    ("adam eps_root", lambda: optim.adam(1e-2, eps_root=1e-6), lambda: optax.adam(1e-2, eps_root=1e-6)),
    ("adamw", lambda: optim.adamw(1e-2, weight_decay=0.1), lambda: optax.adamw(1e-2, weight_decay=0.1)),
    ("adamw mask", lambda: optim.adamw(1e-2, weight_decay=0.1, mask=weights_only),
     lambda: optax.adamw(1e-2, weight_decay=0.1, mask=weights_only_jax)),
    ("nadam", lambda: optim.nadam(1e-2), lambda: optax.nadam(1e-2)),
    ("nadamw", lambda: optim.nadamw(1e-2, weight_decay=0.05), lambda: optax.nadamw(1e-2, weight_decay=0.05)),
    ("radam", lambda: optim.radam(1e-2), lambda: optax.radam(1e-2)),
    ("radam nesterov", lambda: optim.radam(1e-2, b2=0.9, nesterov=True), lambda: optax.radam(1e-2, b2=0.9, nesterov=True)),
    ("adamax", lambda: optim.adamax(1e-2), lambda: optax.adamax(1e-2)),
    ("adamaxw", lambda: optim.adamaxw(1e-2, weight_decay=0.1), lambda: optax.adamaxw(1e-2, weight_decay=0.1)),
    ("amsgrad", lambda: optim.amsgrad(1e-2, b2=0.9), lambda: optax.amsgrad(1e-2, b2=0.9)),
    ("amsgrad uncorrected", lambda: optim.amsgrad(1e-2, bias_correction_mu=False, bias_correction_nu=False),
     lambda: optax.amsgrad(1e-2, bias_correction_mu=False, bias_correction_nu=False)),
    ("adabelief", lambda: optim.adabelief(1e-2), lambda: optax.adabelief(1e-2)),
    ("adabelief nesterov", lambda: optim.adabelief(1e-2, nesterov=True), lambda: optax.adabelief(1e-2, nesterov=True)),
    ("adadelta", lambda: optim.adadelta(1.0, rho=0.8, weight_decay=0.01),
     lambda: optax.adadelta(1.0, rho=0.8, weight_decay=0.01)),
    ("lamb", lambda: optim.lamb(1e-2, weight_decay=0.01), lambda: optax.lamb(1e-2, weight_decay=0.01)),
    ("lars", lambda: optim.lars(0.1, weight_decay=1e-2), lambda: optax.lars(0.1, weight_decay=1e-2)),
    ("lars masks", lambda: optim.lars(0.1, 1e-2, weight_decay_mask=weights_only, trust_ratio_mask=weights_only, nesterov=True),
     lambda: optax.lars(0.1, 1e-2, weight_decay_mask=weights_only_jax, trust_ratio_mask=weights_only_jax, nesterov=True)),
    ("lion", lambda: optim.lion(1e-3, weight_decay=0.01), lambda: optax.lion(1e-3, weight_decay=0.01)),
    ("adafactor", lambda: optim.adafactor(1e-2), lambda: optax.adafactor(1e-2)),
    ("adafactor factored", lambda: optim.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=0.01),
     lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2, momentum=0.9, weight_decay_rate=0.01,
                             dtype_momentum=jnp.float64)),
    ("rmsprop", lambda: optim.rmsprop(1e-2, decay=0.9, eps=1e-3),
     lambda: optax.rmsprop(1e-2, decay=0.9, eps=1e-3, eps_in_sqrt=False)),
    ("rmsprop centered", lambda: optim.rmsprop(1e-2, decay=0.9, eps=1e-3, centered=True),
     lambda: optax.rmsprop(1e-2, decay=0.9, eps=1e-3, eps_in_sqrt=False, centered=True)),
    ("adagrad", lambda: optim.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-30),
     lambda: optax.adagrad(0.1, initial_accumulator_value=0.1, eps=1e-30)),
]


@pytest.mark.parametrize("name, ours, theirs", OPTIMISERS, ids=[c[0] for c in OPTIMISERS])
def test_optimiser_matches_optax(name, ours, theirs):
    compare(ours, theirs)


BLOCKS = [
    ("scale", lambda: optim.scale(-0.3), lambda: optax.scale(-0.3)),
    ("trace nesterov", lambda: optim.trace(0.9, nesterov=True), lambda: optax.trace(0.9, nesterov=True)),
    ("ema", lambda: optim.ema(0.9), lambda: optax.ema(0.9, accumulator_dtype=jnp.float64)),
    ("ema not debiased", lambda: optim.ema(0.8, debias=False), lambda: optax.ema(0.8, debias=False)),
    ("scale_by_adam", lambda: optim.scale_by_adam(), lambda: optax.scale_by_adam()),
    ("scale_by_amsgrad", lambda: optim.scale_by_amsgrad(), lambda: optax.scale_by_amsgrad()),
    ("scale_by_adamax", lambda: optim.scale_by_adamax(), lambda: optax.scale_by_adamax()),
    ("scale_by_lion", lambda: optim.scale_by_lion(0.8, 0.95), lambda: optax.scale_by_lion(0.8, 0.95)),
    ("scale_by_radam", lambda: optim.scale_by_radam(threshold=4.0), lambda: optax.scale_by_radam(threshold=4.0)),
    ("scale_by_belief", lambda: optim.scale_by_belief(eps_root=1e-8), lambda: optax.scale_by_belief(eps_root=1e-8)),
    ("scale_by_adadelta", lambda: optim.scale_by_adadelta(0.95, 1e-4), lambda: optax.scale_by_adadelta(0.95, 1e-4)),
    ("scale_by_trust_ratio", lambda: optim.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.1, eps=1e-3),
     lambda: optax.scale_by_trust_ratio(min_norm=0.5, trust_coefficient=0.1, eps=1e-3)),
    # Adafactor's decay 1 - t**-decay_rate is a float32 computation in optax: the same float32 here.
    ("scale_by_factored_rms", optim.scale_by_factored_rms, optax.scale_by_factored_rms),
    ("scale_by_factored_rms small", lambda: optim.scale_by_factored_rms(min_dim_size_to_factor=3, decay_rate=0.65),
     lambda: optax.scale_by_factored_rms(min_dim_size_to_factor=3, decay_rate=0.65)),
    ("scale_by_param_block_rms", lambda: optim.scale_by_param_block_rms(0.5), lambda: optax.scale_by_param_block_rms(0.5)),
    # Schedules of dyadic values: optax evaluates a schedule of its int32 count in float32.
    ("scale_by_schedule", lambda: optim.scale_by_schedule(optim.exponential_decay(1.0, 3, 0.5, staircase=True)),
     lambda: optax.scale_by_schedule(optax.exponential_decay(1.0, 3, 0.5, staircase=True))),
    ("clip", lambda: optim.clip(0.5), lambda: optax.clip(0.5)),
    ("clip_by_global_norm", lambda: optim.clip_by_global_norm(2.0), lambda: optax.clip_by_global_norm(2.0)),
    ("clip_by_block_rms", lambda: optim.clip_by_block_rms(0.7), lambda: optax.clip_by_block_rms(0.7)),
    ("adaptive_grad_clip", lambda: optim.adaptive_grad_clip(0.3, eps=0.05), lambda: optax.adaptive_grad_clip(0.3, eps=0.05)),
    ("add_decayed_weights mask", lambda: optim.add_decayed_weights(0.1, weights_only),
     lambda: optax.add_decayed_weights(0.1, weights_only_jax)),
    ("set_to_zero", optim.set_to_zero, optax.set_to_zero),
    ("identity", optim.identity, optax.identity),
]


@pytest.mark.parametrize("name, ours, theirs", BLOCKS, ids=[c[0] for c in BLOCKS])
def test_building_block_matches_optax(name, ours, theirs):
    compare(ours, theirs)


def test_zero_nans_matches_optax():
    compare(lambda: optim.chain(optim.zero_nans(), optim.adam(1e-2)),
            lambda: optax.chain(optax.zero_nans(), optax.adam(1e-2)), nan_steps=(3, 4))


WRAPPERS = [
    ("masked", lambda: optim.masked(optim.adam(1e-2), weights_only), lambda: optax.masked(optax.adam(1e-2), weights_only_jax)),
    ("masked prefix", lambda: optim.masked(optim.sgd(0.1, 0.9), {"dense": True, "conv": False, "scale": True, "blocks": False, "embedding": True}),
     lambda: optax.masked(optax.sgd(0.1, 0.9), {"dense": True, "conv": False, "scale": True, "blocks": False, "embedding": True})),
    ("multi_transform", lambda: optim.multi_transform(
        {"adam": optim.adam(1e-2), "sgd": optim.sgd(0.1, 0.5), "frozen": optim.set_to_zero()}, LABELS),
     lambda: optax.multi_transform(
        {"adam": optax.adam(1e-2), "sgd": optax.sgd(0.1, 0.5), "frozen": optax.set_to_zero()}, LABELS)),
    ("multi_transform of masked", lambda: optim.multi_transform(
        {"adam": optim.adamw(1e-2, weight_decay=0.1, mask=weights_only), "sgd": optim.sgd(0.1), "frozen": optim.set_to_zero()},
        LABELS),
     lambda: optax.multi_transform(
        {"adam": optax.adamw(1e-2, weight_decay=0.1, mask=weights_only_jax), "sgd": optax.sgd(0.1),
         "frozen": optax.set_to_zero()}, LABELS)),
    ("MultiSteps", lambda: optim.MultiSteps(optim.adam(1e-2), every_k_schedule=3),
     lambda: optax.MultiSteps(optax.adam(1e-2), every_k_schedule=3, accumulator_dtype=jnp.float64)),
    ("MultiSteps sum", lambda: optim.MultiSteps(optim.sgd(0.1, 0.9), 4, use_grad_mean=False),
     lambda: optax.MultiSteps(optax.sgd(0.1, 0.9), 4, use_grad_mean=False, accumulator_dtype=jnp.float64)),
    ("inject_hyperparams", lambda: optim.inject_hyperparams(optim.adam)(learning_rate=1e-2, b1=0.8),
     lambda: optax.inject_hyperparams(optax.adam)(learning_rate=1e-2, b1=0.8)),
    ("inject_hyperparams schedule", lambda: optim.inject_hyperparams(optim.adamw)(
        learning_rate=optim.linear_schedule(0.5, 0.25, 8), weight_decay=0.1),
     lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(0.5, 0.25, 8), weight_decay=0.1)),
]


@pytest.mark.parametrize("name, ours, theirs", WRAPPERS, ids=[c[0] for c in WRAPPERS])
def test_wrapper_matches_optax(name, ours, theirs):
    compare(ours, theirs, jit=name.startswith("MultiSteps"))


def test_apply_if_finite_matches_optax():
    make_ours = lambda: optim.apply_if_finite(optim.adam(1e-2), max_consecutive_errors=2)  # noqa: E731
    make_theirs = lambda: optax.apply_if_finite(optax.adam(1e-2), max_consecutive_errors=2)  # noqa: E731
    # Steps 5-7 hold a NaN: two are skipped, the third in a row is applied (NaN) as optax does.
    rng = np.random.default_rng(3)
    params = make_params(rng)
    grads = make_grads(rng, params, nan_steps=(2, 5, 6, 7))
    ours = run(make_ours(), params, grads[:7], to_array=np.array, apply=optim.apply_updates)
    theirs = run(make_theirs(), params, grads[:7], to_array=jnp.asarray, apply=optax.apply_updates, jit=True)
    assert_same_updates(ours, theirs)
    opt = make_ours()
    state = opt.init(params)
    for g in grads[:8]:
        _, state = opt.update(g, state, params)
    assert int(state.total_notfinite) == 4 and int(state.notfinite_count) == 3 and not bool(state.last_finite)


SCHEDULES = [
    ("constant", 5, lambda m: m.constant_schedule(0.3)),
    ("linear", 12, lambda m: m.linear_schedule(1.0, 0.2, transition_steps=8, transition_begin=2)),
    ("polynomial", 12, lambda m: m.polynomial_schedule(1.0, 0.1, power=2.5, transition_steps=9, transition_begin=1)),
    ("cosine_decay", 14, lambda m: m.cosine_decay_schedule(2.0, decay_steps=10, alpha=0.1, exponent=2.0)),
    ("warmup_cosine_decay", 20, lambda m: m.warmup_cosine_decay_schedule(0.1, 1.0, 4, 14, end_value=0.05)),
    ("exponential_decay", 30, lambda m: m.exponential_decay(1.0, 4, 0.7, transition_begin=3)),
    ("exponential_decay staircase end", 30, lambda m: m.exponential_decay(1.0, 4, 0.5, staircase=True, end_value=0.1)),
    ("exponential_growth end", 30, lambda m: m.exponential_decay(0.1, 3, 1.5, end_value=0.5)),
    ("warmup_exponential_decay", 30, lambda m: m.warmup_exponential_decay_schedule(0.0, 1.0, 5, 3, 0.8, 2, True, 0.2)),
    ("piecewise_constant", 12, lambda m: m.piecewise_constant_schedule(1.0, {3: 0.5, 7: 0.1, 9: 2.0})),
    ("piecewise_interpolate cosine", 15, lambda m: m.piecewise_interpolate_schedule("cosine", 1.0, {4: 0.5, 10: 3.0})),
    ("linear_onecycle", 110, lambda m: m.linear_onecycle_schedule(100, 0.5)),
    ("cosine_onecycle", 110, lambda m: m.cosine_onecycle_schedule(100, 0.5, pct_start=0.25)),
    ("join_schedules", 20, lambda m: m.join_schedules([m.constant_schedule(1.0), m.linear_schedule(1.0, 0.0, 5),
                                                       m.cosine_decay_schedule(0.5, 6)], [3, 10])),
    ("sgdr", 40, lambda m: m.sgdr_schedule([dict(init_value=0.0, peak_value=1.0, warmup_steps=2, decay_steps=10),
                                            dict(init_value=0.1, peak_value=0.5, warmup_steps=0, decay_steps=20,
                                                 end_value=0.01)])),
]


@pytest.mark.parametrize("name, steps, make", SCHEDULES, ids=[c[0] for c in SCHEDULES])
def test_schedule_matches_optax_at_every_step(name, steps, make):
    ours, theirs = make(optim), make(optax)
    for step in range(steps + 1):
        expected = float(theirs(jnp.asarray(step)))
        for given in (step, np.asarray(step, dtype=np.int64)):  # a Python int and a 0-d count
            np.testing.assert_allclose(float(ours(given)), expected, rtol=RTOL, atol=1e-14, err_msg=f"step {step}")
    assert isinstance(ours(3), float)


FLOAT32 = [
    ("adam", lambda: optim.adam(1e-2), lambda: optax.adam(1e-2)),
    ("nadamw", lambda: optim.nadamw(1e-2, weight_decay=0.1), lambda: optax.nadamw(1e-2, weight_decay=0.1)),
    ("radam", lambda: optim.radam(1e-2, b2=0.9), lambda: optax.radam(1e-2, b2=0.9)),
    ("lamb", lambda: optim.lamb(1e-2, weight_decay=0.01), lambda: optax.lamb(1e-2, weight_decay=0.01)),
    ("adabelief", lambda: optim.adabelief(1e-2), lambda: optax.adabelief(1e-2)),
]


@pytest.mark.parametrize("name, ours, theirs", FLOAT32, ids=[c[0] for c in FLOAT32])
def test_float32_trees_match_optax_to_float32_precision(name, ours, theirs):
    rng = np.random.default_rng(5)
    params = tree.map(lambda p: np.asarray(p, np.float32), make_params(rng))
    grads = [tree.map(lambda p: np.asarray(p, np.float32), g) for g in make_grads(rng, params)]
    ours_updates = run(ours(), params, grads, to_array=np.array, apply=optim.apply_updates)
    assert all(u.dtype == np.float32 for step in ours_updates for u in step)
    assert_same_updates(ours_updates, run(theirs(), params, grads, to_array=jnp.asarray, apply=optax.apply_updates),
                        rtol=2e-5)


def test_incremental_and_periodic_updates_match_optax():
    rng = np.random.default_rng(4)
    new, old = make_params(rng), make_params(rng)
    ours = jax.tree.leaves(optim.incremental_update(new, old, 0.3))  # jax's order (sorted keys) on both
    theirs = jax.tree.leaves(optax.incremental_update(tree.map(jnp.asarray, new), tree.map(jnp.asarray, old), 0.3))
    assert_same_updates([ours], [[np.asarray(t) for t in theirs]])
    for steps in range(7):
        ours = optim.periodic_update(new, old, steps, 3)
        theirs = optax.periodic_update(tree.map(jnp.asarray, new), tree.map(jnp.asarray, old), jnp.asarray(steps), 3)
        assert_same_updates([jax.tree.leaves(ours)], [[np.asarray(t) for t in jax.tree.leaves(theirs)]])
