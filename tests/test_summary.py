"""Seeing a model: lx.summary's rows and table, lx.outputsize, that neither changes any
state, the call interceptor they rest on, and the default Layer repr."""

from __future__ import annotations

import io

import numpy as np
import pytest

import luxnn as lx
from luxnn.core import intercept_calls


def cnn():
    return lx.Chain(
        lx.Conv(3, 1, 8, padding=1), lx.BatchNorm(8, "relu"), lx.Dropout(0.5),
        lx.SkipConnection(lx.Conv(3, 8, 8, padding=1)), lx.AdaptiveAvgPool(2), lx.Flatten(),
        lx.RepeatedLayer(lx.Dense(32, 32, "tanh"), 2), lx.Dense(32, 10),
    )  # fmt: skip


def test_summary_lists_every_call_with_its_path_class_shape_and_parameters():
    model = cnn()
    ps, st = lx.setup(np.random.default_rng(0), model)
    out = io.StringIO()
    table = lx.summary(model, (2, 6, 6, 1), ps, st, file=out)
    rows = [(r.path, r.layer, r.output_shape, r.parameters, r.depth) for r in table.rows]
    assert rows == [
        ("", "Chain", (2, 10), lx.parameter_count(ps), 0),
        ("layer_1", "Conv", (2, 6, 6, 8), 80, 1),
        ("layer_2", "BatchNorm", (2, 6, 6, 8), 16, 1),
        ("layer_3", "Dropout", (2, 6, 6, 8), 0, 1),
        ("layer_4", "SkipConnection", (2, 6, 6, 8), 584, 1),
        ("layer_4", "Conv", (2, 6, 6, 8), 584, 2),  # shares its wrapper's parameters
        ("layer_5", "AdaptiveAvgPool", (2, 2, 2, 8), 0, 1),
        ("layer_6", "Flatten", (2, 32), 0, 1),
        ("layer_7", "RepeatedLayer", (2, 32), 1056, 1),
        ("layer_7/layer", "Dense", (2, 32), 1056, 2),
        ("layer_7/layer", "Dense", (2, 32), 1056, 2),
        ("layer_8", "Dense", (2, 10), 330, 1),
    ]
    assert table.total_parameters == lx.parameter_count(ps) == 80 + 16 + 584 + 1056 + 330
    assert table.total_bytes == 4 * table.total_parameters
    text = out.getvalue()
    assert text == str(table) + "\n"
    assert "Total parameters: 2,066 (8.1 KiB)" in text and "  layer_7" in text and "SkipConnection" in text


def test_summary_and_outputsize_change_no_state():
    model = cnn()
    ps, st = lx.setup(np.random.default_rng(0), model)
    before = [np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf for leaf in lx.tree.leaves(st)]
    rng_state = st["layer_3"]["rng"].bit_generator.state
    lx.summary(model, np.ones((2, 6, 6, 1), np.float32), ps, st, show=False)
    assert lx.outputsize(model, (2, 6, 6, 1), ps, st) == (2, 10)
    for a, b in zip(lx.tree.leaves(st), before):
        np.testing.assert_array_equal(a, b)
    assert st["layer_2"]["training"] and st["layer_3"]["rng"].bit_generator.state == rng_state


def test_outputsize_sets_the_model_up_when_not_given_parameters_and_takes_tuples():
    assert lx.outputsize(lx.Dense(4, 3), (5, 4)) == (5, 3)
    assert lx.outputsize(lx.Bilinear((2, 3), 4), (np.ones((5, 2), np.float32), np.ones((5, 3), np.float32))) == (5, 4)
    assert lx.outputsize(lx.BranchLayer(lx.Dense(4, 3), lx.NoOpLayer()), (5, 4)) == ((5, 3), (5, 4))
    with pytest.raises(TypeError, match="expected a luxnn Layer"):
        lx.outputsize(np.tanh, (2, 3))
    with pytest.raises(lx.LayerError, match=r"layer_2: Dense\(3 => 1\): expected input of shape \(\.\.\., 3\)"):
        lx.summary(lx.Chain(lx.Dense(4, 2), lx.Dense(3, 1)), (5, 4), show=False)


def test_the_interceptor_sees_every_call_and_is_gone_after_its_block_even_on_error():
    model = lx.Chain(lx.Dense(2, 2), lx.SkipConnection(lx.Dense(2, 2)))
    ps, st = lx.setup(np.random.default_rng(0), model)
    seen = []

    def note(layer, x, ps, st):
        seen.append((lx.core.layer_path(), type(layer).__name__))
        return layer(x, ps, st)

    x = np.ones((1, 2), np.float32)
    with pytest.raises(RuntimeError):
        with intercept_calls(note):
            lx.apply(model, x, ps, st)
            raise RuntimeError
    assert seen == [((), "Chain"), (("layer_1",), "Dense"), (("layer_2",), "SkipConnection"), (("layer_2",), "Dense")]
    lx.apply(model, x, ps, st)
    assert len(seen) == 4


def test_default_repr_shows_the_constructor_arguments_that_differ_from_their_defaults():
    class Block(lx.Layer):
        def __init__(self, dim, *, activation=None, scale=1.0, name="block"):
            self.dim, self.activation, self.scale, self.name = dim, activation, scale, name

    assert repr(Block(3)) == "Block(3)"
    assert repr(Block(3, activation=np.tanh, scale=2.0)) == "Block(3, activation=tanh, scale=2.0)"
    assert repr(lx.NoOpLayer()) == "NoOpLayer()"
    assert repr(lx.RepeatedLayer(lx.Dense(2, 2), 3)) == "RepeatedLayer(repeats=3,\n  layer = Dense(2 => 2)\n)"
    assert repr(lx.Upsample((2, 3), mode="bilinear")) == "Upsample((2, 3), mode='bilinear')"
    assert repr(lx.Dense(2, 3, "relu")) == "Dense(2 => 3, relu)"  # the custom repr stays


def test_outputsize_feeds_tokens_to_a_model_that_starts_with_an_embedding_and_floats_otherwise():
    lm = lx.Chain(lx.Embedding(100, 16), lx.Dense(16, 16, "relu"), lx.Dense(16, 100))
    assert lx.outputsize(lm, (2, 64)) == (2, 64, 100)
    assert lx.outputsize(lx.Chain(lx.Chain(lx.Embedding(10, 4), lx.Dense(4, 4)), lx.Dense(4, 2)), (3, 5)) == (3, 5, 2)
    assert lx.summary(lm, (2, 64), show=False).rows[1].output_shape == (2, 64, 16)
    mlp = lx.Chain(lx.Dense(64, 8, "relu"), lx.Dense(8, 3))
    assert lx.outputsize(mlp, (2, 64)) == (2, 3)
    # dtype= picks the zeros' dtype; it has no meaning for an input given as an array.
    with pytest.warns(lx.DtypeWarning, match="got an input of dtype float64"):
        assert lx.outputsize(lx.Chain(lx.Dense(4, 2)), (1, 4), dtype=np.float64) == (1, 2)
    with pytest.raises(lx.LayerError, match="expected integer indices in \\[0, 100\\), got an array of dtype float32"):
        lx.outputsize(lm, (2, 64), dtype=np.float32)
    with pytest.raises(TypeError, match="dtype= is for an input given as a shape, got an input of type ndarray"):
        lx.outputsize(mlp, np.zeros((2, 64), np.float32), dtype=np.int64)
