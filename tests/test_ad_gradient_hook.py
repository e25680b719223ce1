"""The gradient-ready hook: `value_and_grad(..., on_gradient=)` reports each leaf's final
gradient while the backward pass goes on, and the training verbs pass it for optimizers
that `listen` (luxnn.distributed's overlapped averaging is built on it)."""

import numpy as np
import pytest

import luxnn as lx
from luxnn import ad
from luxnn.distributed import ListeningTransformation


@ad.primitive
def _probe(x):
    """The identity, whose VJP calls `_probe.seen()` when the backward pass reaches it."""

    def vjp(g, needs):
        _probe.seen()
        return (g,)

    return x, vjp


def _mlp():
    model = lx.Chain(lx.Dense(3, 5, activation="tanh"), lx.WrappedFunction(_probe), lx.Dense(5, 4, activation="tanh"), lx.Dense(4, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = lx.tree.map(lambda a: a.astype(np.float64), ps)
    x = np.random.default_rng(1).standard_normal((6, 3))
    return model, ps, st, x


def _loss(model, st, x):
    return lambda ps: (model(x, ps, st)[0] ** 2).sum()


def test_every_leaf_is_reported_once_with_the_array_returned():
    model, ps, st, x = _mlp()
    _probe.seen = lambda: None
    reports = []
    _, grads = ad.value_and_grad(_loss(model, st, x), on_gradient=lambda i, g: reports.append((i, g)))(ps)
    _, plain = ad.value_and_grad(_loss(model, st, x))(ps)
    leaves = lx.tree.leaves(grads)
    assert sorted(i for i, _ in reports) == list(range(len(leaves)))
    for i, g in reports:
        assert g is leaves[i]
    for got, want in zip(leaves, lx.tree.leaves(plain)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_the_last_layers_are_reported_before_the_backward_pass_reaches_the_first():
    model, ps, st, x = _mlp()
    paths = [path for path, _ in lx.tree.paths(ps)]
    reported, at_probe = [], []
    _probe.seen = lambda: at_probe.append([paths[i] for i in reported])
    ad.value_and_grad(_loss(model, st, x), on_gradient=lambda i, g: reported.append(i))(ps)
    # The probe sits between layer_1 and layer_3: when the backward pass reaches it,
    # layers 3 and 4 are done and layer 1 is still to come.
    assert sorted(at_probe[0]) == ["layer_3/bias", "layer_3/weight", "layer_4/bias", "layer_4/weight"]
    assert [paths[i] for i in reported[-2:]] in (["layer_1/bias", "layer_1/weight"], ["layer_1/weight", "layer_1/bias"])


def test_a_leaf_used_twice_is_reported_after_its_last_use():
    w = np.array([0.5, -1.0, 2.0])
    order = []
    _probe.seen = lambda: order.append("probe")

    def f(p):  # p["w"] is used at the bottom of the graph (before the probe) and at its top
        return (_probe(p["w"] * 2.0) * p["v"] * p["w"]).sum()

    _, grads = ad.value_and_grad(f, on_gradient=lambda i, g: order.append(i))({"w": w, "v": 3.0 * w})
    assert order == [1, "probe", 0]  # "v" before the probe; "w" only after its use below it
    np.testing.assert_allclose(grads["w"], 4 * w * 3.0 * w)
    np.testing.assert_allclose(grads["v"], 2 * w * w)


def test_leaves_without_a_cotangent_are_reported_last_with_zeros():
    reports = []
    params = {"used": np.ones(2), "unused": np.ones(3)}
    _, grads = ad.value_and_grad(lambda p: p["used"].sum(), on_gradient=lambda i, g: reports.append((i, g)))(params)
    assert [i for i, _ in reports] == [0, 1]
    assert reports[1][1] is grads["unused"] and not grads["unused"].any()

    reports.clear()
    _, grads = ad.value_and_grad(lambda p: 1.0, on_gradient=lambda i, g: reports.append(i))(params)  # nothing traced
    assert reports == [0, 1]


def test_positions_count_the_leaves_of_every_differentiated_argument():
    reports = {}
    f = lambda a, b: (a["x"] * b[0] * b[1]).sum()  # noqa: E731
    args = ({"x": np.full(2, 2.0)}, [np.full(2, 3.0), np.full(2, 5.0)])
    _, (ga, gb) = ad.value_and_grad(f, argnums=(0, 1), on_gradient=lambda i, g: reports.setdefault(i, g))(*args)
    assert sorted(reports) == [0, 1, 2]
    assert reports[0] is ga["x"] and reports[1] is gb[0] and reports[2] is gb[1]


def test_the_output_itself_a_leaf_is_reported():
    reports = []
    _, g = ad.value_and_grad(lambda w: w, on_gradient=lambda i, g: reports.append((i, float(g))))(np.array(2.0))
    assert reports == [(0, 1.0)] and float(g) == 1.0


def test_an_error_in_the_hook_propagates():
    def hook(i, g):
        raise RuntimeError("hook fails")

    with pytest.raises(RuntimeError, match="hook fails"):
        ad.value_and_grad(lambda w: (w * w).sum(), on_gradient=hook)(np.ones(2))


# ---- the training verbs ----------------------------------------------------------------------


def test_the_verbs_hand_a_listening_optimizer_each_gradient_and_update_the_same_arrays():
    model = lx.Chain(lx.Dense(3, 4, activation="tanh"), lx.Dense(4, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    sgd = lx.optim.sgd(0.1)
    seen = {"listen": 0, "reports": {}, "updated": None}

    def listen(params):
        assert params is ts_holder[0].parameters
        seen["listen"] += 1
        seen["reports"] = {}
        return lambda i, g: seen["reports"].__setitem__(i, g)

    def update(grads, state, params=None):
        seen["updated"] = lx.tree.leaves(grads)
        return sgd.update(grads, state, params)

    optimizer = ListeningTransformation(sgd.init, update, listen)
    assert isinstance(optimizer, lx.optim.GradientTransformation)
    ts = lx.TrainState(model, ps, st, optimizer, allocator_cache=None)
    ts_holder = [ts]
    data = (np.ones((5, 3), np.float32), np.zeros((5, 2), np.float32))
    grads, _, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.MSELoss(), data, ts)
    leaves = lx.tree.leaves(grads)
    assert seen["listen"] == 1 and len(seen["reports"]) == len(leaves) == 4
    assert all(seen["reports"][i] is g for i, g in enumerate(leaves))
    assert all(a is b for a, b in zip(seen["updated"], leaves))

    ts_holder[0] = ts
    grads, _, _, ts = lx.compute_gradients(lx.AutoTape(), lx.losses.MSELoss(), data, ts)
    assert seen["listen"] == 2 and all(seen["reports"][i] is g for i, g in enumerate(lx.tree.leaves(grads)))


def test_leaves_given_one_cotangent_get_arrays_of_their_own():
    reports = {}
    f = lambda p: ((p["a"] + p["b"]) * 3.0).sum()  # noqa: E731 - add hands both leaves one cotangent
    _, grads = ad.value_and_grad(f, on_gradient=lambda i, g: reports.setdefault(i, g))({"a": np.ones(3), "b": np.ones(3)})
    assert reports[0] is grads["a"] and reports[1] is grads["b"]
    assert not np.shares_memory(grads["a"], grads["b"])
    np.testing.assert_array_equal(grads["a"], np.full(3, 3.0))


@pytest.mark.parametrize("seed", range(40))
def test_each_report_is_final_on_random_graphs(seed):
    # Random programs over a few leaves: products, sums, stop_gradient, leaves used at
    # several depths, a dead branch now and then (nodes the backward pass gives no
    # cotangent). A copy taken when a leaf is reported must equal its final gradient.
    rng = np.random.default_rng(seed)
    params = {f"p{i}": rng.standard_normal(3) for i in range(rng.integers(1, 5))}
    program = [tuple(rng.integers(0, 100, 3)) for _ in range(rng.integers(2, 10))]

    def f(p):
        values = list(p.values())
        for op, a, b in program:  # `y` a leaf: each leaf is used at several depths
            x, y = values[a % len(values)], values[b % len(params)]
            ops = (lambda: x * y, lambda: x + y, lambda: ad.stop_gradient(x) * y, lambda: np.tanh(x) - y)
            values.append(ops[op % 4]())
            if op % 5 == 0:
                np.exp(y)  # dead: recorded, never used
        return (values[-1] * values[-1]).sum()

    reported = {}

    def on_gradient(i, g):
        assert i not in reported
        reported[i] = g.copy()

    _, hooked = ad.value_and_grad(f, on_gradient=on_gradient)(params)
    _, plain = ad.value_and_grad(f)(params)
    assert sorted(reported) == list(range(len(params)))
    for i, name in enumerate(params):
        np.testing.assert_array_equal(reported[i], hooked[name])
        np.testing.assert_allclose(hooked[name], plain[name], rtol=1e-12, atol=1e-300)
