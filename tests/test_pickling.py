"""Every exported layer pickles and deep-copies, and the copy computes what the original
does with the same parameters and state (issue 12, item 6)."""

from __future__ import annotations

import copy
import operator
import pickle

import numpy as np
import pytest

import luxnn as lx

R = np.random.default_rng(3)


def f32(*shape):
    return R.normal(size=shape).astype(np.float32)


# One construction per exported layer class, with an input it takes.
EXAMPLES = {
    "Chain": (lambda: lx.Chain(lx.Dense(3, 4, activation="gelu"), lx.Dense(4, 2)), f32(2, 3)),
    "Dense": (lambda: lx.Dense(3, 2, "relu"), f32(2, 3)),
    "MultiHeadAttention": (lambda: lx.MultiHeadAttention(8, num_heads=2, rotary=True), f32(2, 5, 8)),
    "Parallel": (lambda: lx.Parallel(operator.add, lx.Dense(3, 2), lx.Dense(3, 2)), f32(2, 3)),
    "SkipConnection": (lambda: lx.SkipConnection(lx.Dense(3, 3), operator.mul), f32(2, 3)),
    "Dropout": (lambda: lx.Dropout(0.5), f32(4, 6)),
    "Embedding": (lambda: lx.Embedding(10, 4), np.array([[1, 2], [3, 9]])),
    "BatchNorm": (lambda: lx.BatchNorm(3, "silu"), f32(4, 3)),
    "GroupNorm": (lambda: lx.GroupNorm(2, 4, "tanh"), f32(2, 3, 4)),
    "LayerNorm": (lambda: lx.LayerNorm(4, activation="sigmoid"), f32(2, 4)),
    "RMSNorm": (lambda: lx.RMSNorm(4), f32(2, 4)),
    "Conv": (lambda: lx.Conv(3, 2, 4, "relu", padding="same"), f32(1, 5, 5, 2)),
    "ConvTranspose": (lambda: lx.ConvTranspose(2, 2, 3, stride=2), f32(1, 3, 3, 2)),
    "MaxPool": (lambda: lx.MaxPool(2), f32(1, 4, 4, 2)),
    "AvgPool": (lambda: lx.AvgPool(3, stride=2, padding=1), f32(1, 4, 4, 2)),
    "GlobalMaxPool": (lambda: lx.GlobalMaxPool(), f32(1, 4, 4, 2)),
    "GlobalAvgPool": (lambda: lx.GlobalAvgPool(), f32(1, 4, 4, 2)),
    "Flatten": (lambda: lx.Flatten(), f32(2, 3, 4)),
    "Reshape": (lambda: lx.Reshape((4, 3)), f32(2, 12)),
    "WrappedFunction": (lambda: lx.WrappedFunction(lx.ops.softplus), f32(2, 3)),
    "NoOpLayer": (lambda: lx.NoOpLayer(), f32(2, 3)),
    "Scale": (lambda: lx.Scale((2, 3), activation="elu"), f32(4, 2, 3)),
    "Bilinear": (lambda: lx.Bilinear((3, 2), 4), (f32(5, 3), f32(5, 2))),
    "BranchLayer": (lambda: lx.BranchLayer(lx.Dense(3, 2), lx.NoOpLayer(), fusion=tuple), f32(2, 3)),
    "Maxout": (lambda: lx.Maxout(lx.Dense(3, 2), lx.Dense(3, 2)), f32(2, 3)),
    "PairwiseFusion": (lambda: lx.PairwiseFusion(operator.add, lx.Dense(3, 3), lx.Dense(3, 3)), f32(2, 3)),
    "RepeatedLayer": (lambda: lx.RepeatedLayer(lx.Dense(3, 3, "tanh"), 3), f32(2, 3)),
    "InstanceNorm": (lambda: lx.InstanceNorm(2, affine=True, track_stats=True), f32(2, 4, 4, 2)),
    "AlphaDropout": (lambda: lx.AlphaDropout(0.2), f32(4, 6)),
    "AdaptiveAvgPool": (lambda: lx.AdaptiveAvgPool((2, 3)), f32(1, 5, 7, 2)),
    "AdaptiveMaxPool": (lambda: lx.AdaptiveMaxPool(2), f32(1, 5, 7, 2)),
    "Upsample": (lambda: lx.Upsample(2, mode="bilinear"), f32(1, 3, 3, 2)),
    "PixelShuffle": (lambda: lx.PixelShuffle(2), f32(1, 2, 2, 8)),
    "RNNCell": (lambda: lx.RNNCell(3, 4, "relu"), f32(2, 3)),
    "LSTMCell": (lambda: lx.LSTMCell(3, 4), f32(2, 3)),
    "GRUCell": (lambda: lx.GRUCell(3, 4, init_carry="trainable"), f32(2, 3)),
    "Recurrence": (lambda: lx.Recurrence(lx.LSTMCell(3, 4), return_sequence=True), f32(2, 5, 3)),
    "Bidirectional": (lambda: lx.Bidirectional(lx.GRUCell(3, 4), lx.GRUCell(3, 4)), f32(2, 5, 3)),
    "Bidirectional-sum": (lambda: lx.Bidirectional(lx.GRUCell(3, 4), lx.GRUCell(3, 4), merge="sum"), f32(2, 5, 3)),
    "LSTM": (lambda: lx.LSTM(3, 4, num_layers=2, bidirectional=True, dropout=0.2, return_carry=True), f32(2, 5, 3)),
    "GRU": (lambda: lx.GRU(3, 4, return_sequence=False), f32(2, 5, 3)),
    "RNN": (lambda: lx.RNN(3, 4, activation="relu"), f32(2, 5, 3)),
    "SinusoidalPositionalEmbedding": (lambda: lx.SinusoidalPositionalEmbedding(8), f32(2, 5, 8)),
    "RotaryPositionalEmbedding": (lambda: lx.RotaryPositionalEmbedding(8), f32(2, 5, 8)),
}
# Bases and layers that run on sequences of steps rather than on an array.
NOT_CONSTRUCTED = {"Layer", "RecurrentCell", "Steps"}


def exported_layer_classes():
    names = set(lx.__all__) | set(lx.nn.__all__)
    return {n for n in names if isinstance(getattr(lx, n, None), type) and issubclass(getattr(lx, n), lx.Layer)}


def test_every_exported_layer_class_has_an_example():
    missing = exported_layer_classes() - {name.split("-")[0] for name in EXAMPLES} - NOT_CONSTRUCTED
    assert not missing, f"add an example to EXAMPLES for {sorted(missing)}"


def _outputs(y):
    return [np.asarray(leaf) for leaf in lx.tree.leaves(y)]


# Bidirectional keeps its merge function, a lambda of luxnn/nn/recurrent.py's table for the
# named merges: pickle cannot find it by name (recurrent.py belongs to the recurrent work).
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_layers_pickle_and_deep_copy_and_compute_the_same(name):
    make, x = EXAMPLES[name]
    model = make()
    ps, st = lx.setup(np.random.default_rng(0), model)
    want = _outputs(model(x, ps, st)[0])
    for copied in (pickle.loads(pickle.dumps(model)), copy.deepcopy(model)):
        assert type(copied) is type(model) and copied is not model
        assert repr(copied) == repr(model)
        got = _outputs(copied(x, ps, st)[0])
        assert len(got) == len(want)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        # The copy sets up the same parameters from the same generator.
        ps2, _ = lx.setup(np.random.default_rng(0), copied)
        for a, b in zip(lx.tree.leaves(ps2), lx.tree.leaves(ps)):
            np.testing.assert_array_equal(a, b)


def test_activations_given_by_name_or_function_pickle():
    for activation in [*sorted(k for k in lx.ACTIVATIONS if k != "identity"), lx.ops.gelu, np.tanh]:
        layer = lx.Dense(2, 2, activation)
        assert pickle.loads(pickle.dumps(layer)).activation is layer.activation


def test_a_stateful_layer_pickles_with_its_parameters_and_state():
    model = lx.Chain(lx.Dense(3, 3), lx.BatchNorm(3))
    smodel = lx.StatefulLayer(model, *lx.setup(np.random.default_rng(0), model))
    x = f32(4, 3)
    copied = pickle.loads(pickle.dumps(smodel))
    np.testing.assert_array_equal(copied(x), smodel(x))
    np.testing.assert_array_equal(copied.st["layer_2"]["running_mean"], smodel.st["layer_2"]["running_mean"])
