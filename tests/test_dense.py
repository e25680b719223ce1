"""Dense and Chain: forward values, gradients (finite differences and PyTorch), errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special

import luxnn as lx
from luxnn import tree

from test_ad_primitives import check_grad  # the one finite-difference checker


def f64(t):
    return tree.map(lambda a: a.astype(np.float64), t)


def mlp():
    return lx.Chain(lx.Dense(4, 8, activation="tanh"), lx.Dense(8, 6, activation="gelu"), lx.Dense(6, 3))


# -- forward ---------------------------------------------------------------------------------

ACTIVATIONS = {
    "identity": lambda z: z,
    "relu": lambda z: np.maximum(z, 0),
    "gelu": lambda z: 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3))),
    "tanh": np.tanh,
    "sigmoid": scipy.special.expit,
    "softplus": lambda z: np.logaddexp(0, z),
    "swish": lambda z: z * scipy.special.expit(z),
    "silu": lambda z: z * scipy.special.expit(z),
    "leaky_relu": lambda z: np.where(z > 0, z, 0.01 * z),
    "elu": lambda z: np.where(z > 0, z, np.expm1(z)),
}


@pytest.mark.parametrize("name", ACTIVATIONS)
def test_dense_forward_with_each_activation(name):
    rng = np.random.default_rng(0)
    layer = lx.Dense(5, 3, activation=name)
    ps, st = f64(lx.setup(rng, layer))
    x = rng.normal(size=(2, 4, 5)) * 2  # any leading axes
    y, new_st = layer(x, ps, st)
    assert y.shape == (2, 4, 3) and new_st == st
    np.testing.assert_allclose(y, ACTIVATIONS[name](x @ ps["weight"] + ps["bias"]), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("use_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("name", [n for n in ACTIVATIONS if n != "identity"])
def test_dense_fuses_each_activation_into_one_primitive_with_its_gradient(name, use_bias):
    from luxnn.ad.tape import Tape

    activation = lx.nn.activations.get_activation(name)
    assert lx.ops.activations.fused_name(activation) is not None
    rng = np.random.default_rng(1)
    x, w, b = rng.normal(size=(2, 3, 5)) * 2, rng.normal(size=(5, 4)), rng.normal(size=4) if use_bias else None
    tape = Tape()
    lx.ops.dense(tape.leaf(x), tape.leaf(w), b, activation=activation)
    assert len(tape.nodes) == 3  # the two leaves and the dense layer: no node for the bias or the activation
    check_grad(lambda x, w, *b: lx.ops.dense(x, w, *(b or [None]), activation=activation), x, w, *([b] if use_bias else []),
               ref=lambda x, w, *b: ACTIVATIONS[name](x @ w + (b[0] if b else 0)))


def test_dense_callable_activation_no_bias_and_float32():
    rng = np.random.default_rng(0)
    layer = lx.Dense(3, 2, activation=lambda z: z * z, use_bias=False)
    ps, st = lx.setup(rng, layer)
    assert list(ps) == ["weight"] and ps["weight"].dtype == np.float32 and st == {}
    x = rng.normal(size=(4, 3)).astype(np.float32)
    y, _ = layer(x, ps, st)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, (x @ ps["weight"]) ** 2, rtol=1e-6)


def test_dense_default_initialisation_is_pytorchs():
    layer = lx.Dense(400, 300)
    ps, _ = lx.setup(np.random.default_rng(0), layer)
    bound = 1 / math.sqrt(400)
    for name, shape in [("weight", (400, 300)), ("bias", (300,))]:
        p = ps[name]
        assert p.shape == shape and p.dtype == np.float32
        assert np.abs(p).max() <= bound and np.abs(p).max() > 0.98 * bound
    assert abs(ps["weight"].std() - bound / math.sqrt(3)) < 0.02 * bound
    custom = lx.Dense(3, 2, init_weight=lx.init.ones, init_bias=lx.init.constant(0.5))
    ps, _ = lx.setup(np.random.default_rng(0), custom)
    np.testing.assert_array_equal(ps["weight"], np.ones((3, 2)))
    np.testing.assert_array_equal(ps["bias"], np.full(2, 0.5))


def test_chain_names_nests_and_indexes_children():
    inner = lx.Chain(lx.Dense(3, 3), lx.Dense(3, 3, activation="relu"))
    model = lx.Chain(lx.Dense(2, 3), inner, lx.Dense(3, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    assert list(ps) == ["layer_1", "layer_2", "layer_3"] and list(ps["layer_2"]) == ["layer_1", "layer_2"]
    assert len(model) == 3 and model[1] is inner and model["layer_3"] is model[-1]
    x = np.ones((5, 2), np.float32)
    h = x @ ps["layer_1"]["weight"] + ps["layer_1"]["bias"]
    h, _ = inner(h, ps["layer_2"], st["layer_2"])
    y, _ = model(x, ps, st)
    np.testing.assert_allclose(y, h @ ps["layer_3"]["weight"] + ps["layer_3"]["bias"], rtol=1e-6)
    named = lx.Chain(encoder=lx.Dense(2, 3), head=lx.Dense(3, 1))
    assert list(lx.setup(np.random.default_rng(0), named)[0]) == ["encoder", "head"]
    assert "layer_2 = Chain(" in repr(model) and "Dense(3 => 3, relu)" in repr(model)


# -- gradients ---------------------------------------------------------------------------------


def test_mlp_gradient_matches_finite_differences():
    rng = np.random.default_rng(1)
    model = mlp()
    ps, st = f64(lx.setup(rng, model))
    leaves, structure = tree.flatten(ps)
    x = rng.normal(size=(5, 4))

    def f(x, *leaves):
        return model(x, tree.unflatten(structure, list(leaves)), st)[0]

    check_grad(f, x, *leaves)


def torch_linear(torch, ps):
    layer = torch.nn.Linear(*ps["weight"].shape, dtype=torch.float64)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(ps["weight"].T))  # torch stores (out, in)
        layer.bias.copy_(torch.tensor(ps["bias"]))
    return layer


def assert_rel_close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape
    assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), (a, b)


def test_dense_matches_torch_linear(torch):
    rng = np.random.default_rng(2)
    layer = lx.Dense(5, 3)
    ps, st = f64(lx.setup(rng, layer))
    x, w = rng.normal(size=(2, 4, 5)), rng.normal(size=(2, 4, 3))
    value, (gx, gps) = lx.value_and_grad(lambda x, ps: (layer(x, ps, st)[0] * w).sum(), argnums=(0, 1))(x, ps)

    ref = torch_linear(torch, ps)
    tx = torch.tensor(x, requires_grad=True)
    tv = (ref(tx) * torch.tensor(w)).sum()
    tv.backward()
    assert_rel_close(value, tv.item())
    assert_rel_close(gx, tx.grad.numpy())
    assert_rel_close(gps["weight"], ref.weight.grad.numpy().T)
    assert_rel_close(gps["bias"], ref.bias.grad.numpy())


def test_chain_matches_torch_sequential(torch):
    rng = np.random.default_rng(3)
    model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 6, activation="tanh"), lx.Dense(6, 3))
    ps, st = f64(lx.setup(rng, model))
    x, w = rng.normal(size=(7, 4)), rng.normal(size=(7, 3))
    value, (gx, gps) = lx.value_and_grad(lambda x, ps: (model(x, ps, st)[0] * w).sum(), argnums=(0, 1))(x, ps)
    y, _ = model(x, ps, st)

    linears = [torch_linear(torch, ps[f"layer_{i}"]) for i in (1, 2, 3)]
    ref = torch.nn.Sequential(linears[0], torch.nn.ReLU(), linears[1], torch.nn.Tanh(), linears[2])
    tx = torch.tensor(x, requires_grad=True)
    ty = ref(tx)
    (ty * torch.tensor(w)).sum().backward()
    assert_rel_close(y, ty.detach().numpy())
    assert_rel_close(value, (ty * torch.tensor(w)).sum().item())
    assert_rel_close(gx, tx.grad.numpy())
    for i, lin in enumerate(linears, 1):
        assert_rel_close(gps[f"layer_{i}"]["weight"], lin.weight.grad.numpy().T)
        assert_rel_close(gps[f"layer_{i}"]["bias"], lin.bias.grad.numpy())


# -- errors ------------------------------------------------------------------------------------


def test_shape_mismatch_names_the_layer_path_and_both_shapes():
    model = lx.Chain(lx.Dense(4, 8), lx.Dense(5, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((3, 4), np.float32)
    message = r"^layer_2: Dense\(5 => 2\): expected input of shape \(\.\.\., 5\), got \(3, 8\)"
    with pytest.raises(ValueError, match=message):
        model(x, ps, st)
    with pytest.raises(lx.LayerError, match=message):  # the same while differentiating
        lx.grad(lambda ps: model(x, ps, st)[0].sum())(ps)
    nested = lx.Chain(lx.Dense(4, 4), lx.Chain(lx.Dense(4, 4), lx.Dense(3, 1)))
    ps, st = lx.setup(np.random.default_rng(0), nested)
    with pytest.raises(lx.LayerError, match=r"^layer_2/layer_2: Dense\(3 => 1\)") as info:
        nested(x, ps, st)
    assert info.value.path == ("layer_2", "layer_2")
    with pytest.raises(lx.LayerError, match=r"expected input of shape \(\.\.\., 4\), got \(\)"):
        lx.Dense(4, 1)(np.float32(1), *lx.setup(np.random.default_rng(0), lx.Dense(4, 1)))


def test_parameter_tree_that_does_not_match_the_model():
    model = lx.Chain(lx.Dense(4, 8), lx.Dense(8, 2, use_bias=False))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((3, 4), np.float32)
    with pytest.raises(lx.LayerError, match=r"expected an entry 'layer_2'.*\['layer_1'\]"):
        model(x, {"layer_1": ps["layer_1"]}, st)
    wrong = {**ps, "layer_1": {**ps["layer_1"], "weight": ps["layer_1"]["weight"].T}}
    with pytest.raises(lx.LayerError, match=r"^layer_1: Dense\(4 => 8\): expected parameter 'weight' "
                                            r"of shape \(4, 8\), got \(8, 4\)"):
        model(x, wrong, st)
    extra = {**ps, "layer_2": {**ps["layer_2"], "bias": np.zeros(2, np.float32)}}
    with pytest.raises(lx.LayerError, match=r"^layer_2: .*expected parameters \['weight'\], "
                                            r"got \['bias', 'weight'\]"):
        model(x, extra, st)
    with pytest.raises(lx.LayerError, match="expected parameters"):
        lx.Dense(4, 8)(x, [ps["layer_1"]["weight"]], {})


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match=r"unknown activation 'relux'.*'relu'"):
        lx.Dense(2, 2, activation="relux")
    with pytest.raises(ValueError, match="in_features must be a positive integer"):
        lx.Dense(0, 2)
    with pytest.raises(TypeError, match="layer_2 must be a luxnn Layer"):
        lx.Chain(lx.Dense(2, 2), lambda x: x)


def test_an_input_that_is_not_an_array_is_named_in_the_error():
    model = lx.Chain(lx.LSTM(3, 4), lx.Dense(4, 2))  # the LSTM passes a Padded batch on
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match=r"layer_2: Dense\(4 => 2\): expected input of shape \(\.\.\., 4\), got a Padded of 2"):
        model(lx.Padded(np.ones((2, 5, 3), np.float32), [5, 3]), ps, st)


def test_an_activation_changed_after_construction_is_the_one_applied():
    layer = lx.Dense(3, 2, activation="relu")
    ps, st = lx.setup(np.random.default_rng(0), layer)
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    layer.activation = lx.ops.sigmoid
    np.testing.assert_allclose(layer(x, ps, st)[0], scipy.special.expit(x @ ps["weight"] + ps["bias"]), rtol=1e-5)
