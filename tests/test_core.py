"""Trees, the layer base and its verbs (setup, apply, parameter_count, train/test mode), initialisers."""

from __future__ import annotations

import math
from collections import namedtuple

import numpy as np
import pytest

import luxnn as lx
from luxnn import init, tree

Pair = namedtuple("Pair", "first second")

TREES = {
    "leaf": 1.0,
    "dict": {"b": 1, "a": [2, (3, 4)], "c": {}},
    "nested": {"layer_1": {"weight": np.ones((2, 3)), "bias": np.zeros(3)}, "layer_2": {}},
    "namedtuple": {"opt": Pair(first=np.arange(2.0), second=[Pair(1, 2), ()]), "step": 3},
    "list": [[1], [], (2, [3, {"x": 4}])],
}


@pytest.mark.parametrize("t", TREES.values(), ids=TREES.keys())
def test_flatten_unflatten_round_trip(t):
    leaves, structure = tree.flatten(t)
    assert all(a is b for a, b in zip(leaves, tree.leaves(t), strict=True))
    rebuilt = tree.unflatten(structure, leaves)
    assert tree.structure(rebuilt) == structure
    assert _same(rebuilt, t)
    assert [p for p, _ in tree.paths(t)] == [p for p, _ in tree.paths(rebuilt)]


def _same(a, b):
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a is b


def test_leaves_paths_and_map_follow_insertion_order():
    t = TREES["namedtuple"]
    assert [p for p, _ in tree.paths(t)] == ["opt/0", "opt/1/0/0", "opt/1/0/1", "step"]
    assert tree.leaves({"b": 1, "a": 2}) == [1, 2]
    doubled = tree.map(lambda x: x * 2, t)
    assert isinstance(doubled["opt"], Pair) and isinstance(doubled["opt"].second[0], Pair)
    assert doubled["opt"].second[1] == () and doubled["step"] == 6
    np.testing.assert_array_equal(doubled["opt"].first, [0.0, 2.0])
    summed = tree.map(lambda x, y, z: x + y + z, {"a": 1, "b": (2,)}, {"a": 10, "b": [20]},
                      {"a": 100, "b": (200,)})
    assert summed == {"a": 111, "b": (222,)}


def test_map_and_unflatten_reject_mismatched_structures():
    with pytest.raises(ValueError, match=r"expected keys \['a', 'b'\], got \['a'\]"):
        tree.map(lambda x, y: x, {"a": 1, "b": 2}, {"a": 1})
    with pytest.raises(ValueError, match="expected a dict"):
        tree.map(lambda x, y: x, {"a": 1}, [1])
    with pytest.raises(ValueError, match="length 2, got list of length 1"):
        tree.map(lambda x, y: x, (1, 2), [1])
    with pytest.raises(ValueError, match="structure has 3 leaves, got 2"):
        tree.unflatten(tree.structure([1, (2, 3)]), [1, 2])


def test_structure_equality_tells_trees_apart():
    assert tree.structure({"a": 1, "b": [2]}) == tree.structure({"a": "x", "b": ["y"]})
    assert tree.structure({"a": 1, "b": [2]}) != tree.structure({"a": 1, "b": (2,)})
    assert tree.structure(Pair(1, 2)) != tree.structure((1, 2))
    assert tree.structure({"a": [1, 2]}).num_leaves == 2


# -- the layer base and its verbs -------------------------------------------------------------


class Scale(lx.Layer):
    """A custom layer with parameters and a state, written as the docs teach."""

    def __init__(self, dim):
        self.dim = dim

    def init_params(self, rng):
        return {"scale": rng.normal(size=self.dim).astype(np.float32)}

    def init_state(self, rng):
        return {"calls": 0, "training": True}

    def __call__(self, x, ps, st):
        return x * ps["scale"], {**st, "calls": st["calls"] + 1}


def test_setup_apply_and_parameter_count():
    model = lx.Chain(lx.Dense(4, 8, activation="relu"), Scale(8), lx.Dense(8, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    assert lx.parameter_count(ps) == 4 * 8 + 8 + 8 + 8 * 2 + 2
    assert st == {"layer_1": {}, "layer_2": {"calls": 0, "training": True}, "layer_3": {}}
    again, _ = lx.setup(np.random.default_rng(0), model)
    other, _ = lx.setup(np.random.default_rng(1), model)
    assert all(np.array_equal(a, b) for a, b in zip(tree.leaves(ps), tree.leaves(again)))
    assert not np.array_equal(ps["layer_1"]["weight"], other["layer_1"]["weight"])
    x = np.ones((3, 4), np.float32)
    y, st2 = lx.apply(model, x, ps, st)
    y2, _ = model(x, ps, st)
    np.testing.assert_array_equal(y, y2)
    assert st2["layer_2"]["calls"] == 1 and st["layer_2"]["calls"] == 0  # a new state, the old one intact
    assert lx.parameter_count({}) == 0
    with pytest.raises(TypeError, match="expected a luxnn Layer, got function"):
        lx.setup(np.random.default_rng(0), lambda x: x)


def test_layer_defaults():
    layer = lx.Layer()
    assert lx.setup(np.random.default_rng(0), layer) == ({}, {})
    assert repr(layer) == "Layer()"
    with pytest.raises(NotImplementedError, match="Layer does not define __call__"):
        layer(np.ones(2), {}, {})


def test_trainmode_and_testmode_return_new_states_at_every_depth():
    st = {"bn": {"training": True, "running_mean": np.zeros(2)}, "blocks": [{"drop": {"training": True}}],
          "pair": ({"training": True}, 3), "plain": {}}
    test = lx.testmode(st)
    assert test["bn"]["training"] is False and test["blocks"][0]["drop"]["training"] is False
    assert test["pair"][0]["training"] is False and test["pair"][1] == 3 and test["plain"] == {}
    assert st["bn"]["training"] is True and st["blocks"][0]["drop"]["training"] is True  # unchanged
    assert test["bn"]["running_mean"] is st["bn"]["running_mean"]
    train = lx.trainmode(test)
    trained = [p for p, v in tree.paths(train) if v is True]
    assert trained == ["bn/training", "blocks/0/drop/training", "pair/0/training"]


def test_testmode_and_trainmode_of_a_train_state_set_its_states():
    model = lx.Chain(lx.Dense(2, 2), lx.Dropout(0.5))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None)
    evaluated = lx.testmode(ts)
    assert isinstance(evaluated, lx.TrainState) and evaluated.states["layer_2"]["training"] is False
    assert ts.states["layer_2"]["training"] is True and evaluated.parameters is ts.parameters
    x = np.ones((3, 2), np.float32)
    np.testing.assert_array_equal(lx.apply(model, x, evaluated.parameters, evaluated.states)[0],
                                  lx.apply(model, x, ps, lx.testmode(st))[0])  # dropout off
    assert lx.trainmode(evaluated).states["layer_2"]["training"] is True


@pytest.mark.parametrize("fn", [lx.testmode, lx.trainmode])
def test_testmode_and_trainmode_refuse_what_is_no_state(fn):
    with pytest.raises(TypeError, match=f"{fn.__name__}: expected a model state .* or a TrainState, got Chain"):
        fn(lx.Chain(lx.Dense(2, 2)))


def test_layer_error_paths_compose():
    err = lx.LayerError("Dense(2 => 3): bad").within("layer_2").within("encoder")
    assert isinstance(err, ValueError) and err.path == ("encoder", "layer_2")
    assert str(err) == "encoder/layer_2: Dense(2 => 3): bad"


# -- initialisers ---------------------------------------------------------------------------------

SHAPE = (256, 128)  # fan_in 256, fan_out 128
CONV = (3, 3, 16, 32)  # fan_in 3 * 3 * 16, fan_out 3 * 3 * 32

UNIFORM = {
    "kaiming_uniform-default": (init.kaiming_uniform(), lambda fi, fo: 1 / math.sqrt(fi)),
    "kaiming_uniform-relu": (init.kaiming_uniform(nonlinearity="relu"), lambda fi, fo: math.sqrt(6 / fi)),
    "glorot_uniform": (init.glorot_uniform(), lambda fi, fo: math.sqrt(6 / (fi + fo))),
    "glorot_uniform-gain": (init.glorot_uniform(gain=2.0), lambda fi, fo: 2 * math.sqrt(6 / (fi + fo))),
}


@pytest.mark.parametrize("shape, fans", [(SHAPE, (256, 128)), (CONV, (144, 288))], ids=["dense", "conv"])
@pytest.mark.parametrize("name", UNIFORM)
def test_uniform_initialisers_fill_their_bounds(name, shape, fans):
    fn, bound_of = UNIFORM[name]
    assert init.fans(shape) == fans
    w = fn(np.random.default_rng(0), shape)
    bound = bound_of(*fans)
    assert w.shape == shape and w.dtype == np.float32
    assert np.abs(w).max() <= bound * (1 + 1e-6) and np.abs(w).max() > 0.99 * bound
    assert abs(w.mean()) < 0.02 * bound and abs(w.std() - bound / math.sqrt(3)) < 0.02 * bound


NORMAL = {
    "kaiming_normal": (init.kaiming_normal(), 0.0, lambda fi, fo: math.sqrt(2 / fi)),
    "kaiming_normal-linear": (init.kaiming_normal(nonlinearity="linear"), 0.0,
                              lambda fi, fo: 1 / math.sqrt(fi)),
    "glorot_normal": (init.glorot_normal(), 0.0, lambda fi, fo: math.sqrt(2 / (fi + fo))),
    "normal": (init.normal(std=0.1, mean=2.0), 2.0, lambda fi, fo: 0.1),
}


@pytest.mark.parametrize("shape", [SHAPE, CONV], ids=["dense", "conv"])
@pytest.mark.parametrize("name", NORMAL)
def test_normal_initialisers_have_their_std(name, shape):
    fn, mean, std_of = NORMAL[name]
    w = fn(np.random.default_rng(0), shape, np.float64)
    std = std_of(*init.fans(shape))
    assert w.shape == shape and w.dtype == np.float64
    assert abs(w.mean() - mean) < 0.03 * std and abs(w.std() - std) < 0.03 * std


def test_constant_and_uniform_initialisers():
    rng = np.random.default_rng(0)
    assert init.zeros(rng, (2, 3)).dtype == np.float32 and not init.zeros(rng, (2, 3)).any()
    np.testing.assert_array_equal(init.ones(rng, (4,), np.float64), np.ones(4))
    np.testing.assert_array_equal(init.constant(0.5)(rng, (2,)), [0.5, 0.5])
    u = init.uniform(-3.0, -1.0)(rng, (1000,))
    assert u.min() >= -3.0 and u.max() <= -1.0 and u.max() - u.min() > 1.95
    a = init.kaiming_uniform()(np.random.default_rng(5), (3, 4))
    np.testing.assert_array_equal(a, init.kaiming_uniform()(np.random.default_rng(5), (3, 4)))


def test_initialiser_arguments_are_checked():
    with pytest.raises(ValueError, match="unknown nonlinearity 'selu'"):
        init.kaiming_uniform(nonlinearity="selu")
    with pytest.raises(ValueError, match="low <= high"):
        init.uniform(1.0, 0.0)
