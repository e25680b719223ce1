"""SkipConnection, Parallel and StatefulLayer."""

import numpy as np
import pytest

import luxnn as lx

torch = pytest.importorskip("torch")


def f64(tree):
    return lx.tree.map(lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) else a, tree)


def test_skip_connection_matches_torch_residual_block():
    rng = np.random.default_rng(0)
    model = lx.SkipConnection(lx.Chain(lx.Dense(5, 5, activation="relu"), lx.LayerNorm(5)))
    ps, st = f64(lx.setup(rng, model))
    assert sorted(ps) == ["layer_1", "layer_2"]  # the wrapped layer's own parameters
    ps = lx.tree.map(lambda a: rng.normal(size=a.shape), ps)
    x = rng.normal(size=(4, 5))
    r = rng.normal(size=(4, 5))
    value, (gx, gps) = lx.value_and_grad(lambda x, p: (model(x, p, st)[0] * r).sum(), argnums=(0, 1))(x, ps)

    t = {k: torch.tensor(v, requires_grad=True) for k, v in
         (("x", x), ("w", ps["layer_1"]["weight"]), ("b", ps["layer_1"]["bias"]),
          ("s", ps["layer_2"]["scale"]), ("c", ps["layer_2"]["bias"]))}  # fmt: skip
    h = torch.relu(t["x"] @ t["w"] + t["b"])
    ty = torch.nn.functional.layer_norm(h, (5,), t["s"], t["c"], 1e-5) + t["x"]
    tv = (ty * torch.tensor(r)).sum()
    tv.backward()
    np.testing.assert_allclose(value, tv.item(), rtol=1e-9)
    np.testing.assert_allclose(gx, t["x"].grad.numpy(), rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(gps["layer_1"]["weight"], t["w"].grad.numpy(), rtol=1e-7, atol=1e-12)
    np.testing.assert_allclose(gps["layer_2"]["scale"], t["s"].grad.numpy(), rtol=1e-7, atol=1e-12)


def test_skip_connection_custom_combine_and_state():
    rng = np.random.default_rng(0)
    model = lx.SkipConnection(lx.BatchNorm(3), lambda y, x: np.concatenate([y, x], axis=-1))
    ps, st = lx.setup(rng, model)
    assert sorted(st) == ["running_mean", "running_var", "training"]
    y, st2 = model(rng.normal(size=(4, 3)).astype(np.float32), ps, st)
    assert y.shape == (4, 6) and not np.array_equal(st2["running_mean"], st["running_mean"])


def test_parallel_same_input_tuple_input_and_names():
    rng = np.random.default_rng(0)
    model = lx.Parallel(lambda a, b: a * b, lx.Dense(3, 2), lx.Dense(3, 2))
    ps, st = lx.setup(rng, model)
    assert sorted(ps) == ["layer_1", "layer_2"]
    x = rng.normal(size=(4, 3)).astype(np.float32)
    y, _ = model(x, ps, st)
    a = x @ ps["layer_1"]["weight"] + ps["layer_1"]["bias"]
    b = x @ ps["layer_2"]["weight"] + ps["layer_2"]["bias"]
    np.testing.assert_allclose(y, a * b, rtol=1e-6)

    x2 = rng.normal(size=(4, 3)).astype(np.float32)
    y, _ = model((x, x2), ps, st)  # a tuple of N elements: one per layer
    b2 = x2 @ ps["layer_2"]["weight"] + ps["layer_2"]["bias"]
    np.testing.assert_allclose(y, a * b2, rtol=1e-6)

    named = lx.Parallel(None, left=lx.Dense(3, 1), right=lx.Dense(3, 2))
    ps, st = lx.setup(rng, named)
    outputs, _ = named(x, ps, st)  # no combine: the tuple of outputs
    assert sorted(ps) == ["left", "right"] and [o.shape for o in outputs] == [(4, 1), (4, 2)]


def test_parallel_gradients_and_state_threading():
    rng = np.random.default_rng(0)
    model = lx.Chain(lx.Parallel(lambda a, b: a + b, lx.Dense(3, 3), lx.Chain(lx.Dropout(0.5), lx.Dense(3, 3))), lx.Dense(3, 1))
    ps, st = f64(lx.setup(rng, model))
    x = rng.normal(size=(5, 3))
    (loss, new_st), g = lx.value_and_grad(lambda p: (lambda y, s: ((y * y).sum(), s))(*model(x, p, st)), has_aux=True)(ps)
    assert new_st["layer_1"]["layer_2"]["layer_1"]["rng"] is not st["layer_1"]["layer_2"]["layer_1"]["rng"]
    h = 1e-6
    w = ps["layer_1"]["layer_1"]["weight"]
    for idx in [(0, 0), (2, 1)]:
        d = np.zeros_like(w)
        d[idx] = h

        def at(wv):
            p = lx.tree.map(lambda a: a, ps)
            p["layer_1"]["layer_1"]["weight"] = wv
            return (model(x, p, st)[0] ** 2).sum()

        assert abs((at(w + d) - at(w - d)) / (2 * h) - g["layer_1"]["layer_1"]["weight"][idx]) < 1e-6


def test_container_errors_carry_the_path():
    rng = np.random.default_rng(0)
    model = lx.Chain(lx.Dense(3, 4), lx.Parallel(None, lx.Dense(4, 2), lx.Dense(5, 2)))
    ps, st = lx.setup(rng, model)
    with pytest.raises(lx.LayerError, match=r"^layer_2/layer_2: Dense\(5 => 2\): expected input of shape \(\.\.\., 5\), got \(2, 4\)"):
        model(np.ones((2, 3), np.float32), ps, st)
    with pytest.raises(TypeError, match="must be a luxnn Layer"):
        lx.SkipConnection(lambda x: x)
    with pytest.raises(ValueError, match="at least one layer"):
        lx.Parallel(None)


def test_stateful_layer_updates_its_state():
    rng = np.random.default_rng(0)
    model = lx.Chain(lx.Dense(3, 4), lx.BatchNorm(4))
    ps, st = lx.setup(rng, model)
    smodel = lx.StatefulLayer(model, ps, st)
    x = rng.normal(size=(8, 3)).astype(np.float32)
    y = smodel(x)
    np.testing.assert_array_equal(y, model(x, ps, st)[0])
    assert not np.array_equal(smodel.st["layer_2"]["running_mean"], st["layer_2"]["running_mean"])
    first = smodel.st
    smodel(x)
    assert smodel.st is not first
    smodel.st = lx.testmode(smodel.st)
    y_test = smodel(x)
    assert smodel.st["layer_2"]["training"] is False and y_test.shape == (8, 4)
    # Other (e.g. traced) parameters for one call.
    g = lx.grad(lambda p: smodel(x, ps=p).sum())(ps)
    assert g["layer_1"]["weight"].shape == (3, 4)
