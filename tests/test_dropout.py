"""Dropout: mask rate, scaling, test mode, and the generator kept in the state."""

import numpy as np
import pytest

import luxnn as lx


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_rate_and_scaling(p):
    model = lx.Dropout(p)
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((400, 500), np.float32)
    y, _ = model(x, ps, st)
    assert y.dtype == np.float32
    kept = y != 0
    n = x.size
    # Within 5 standard deviations of the binomial count.
    assert abs(kept.sum() - (1 - p) * n) < 5 * np.sqrt(n * p * (1 - p))
    np.testing.assert_allclose(y[kept], 1 / (1 - p), rtol=1e-6)
    assert abs(y.mean() - 1) < 0.02  # inverted dropout keeps the expectation


def test_same_state_same_mask_and_the_state_advances():
    model = lx.Dropout(0.5)
    ps, st = lx.setup(np.random.default_rng(0), model)
    before = st["rng"].bit_generator.state
    x = np.ones((50, 40))
    y1, st1 = model(x, ps, st)
    y2, st2 = model(x, ps, st)
    np.testing.assert_array_equal(y1, y2)
    assert st["rng"].bit_generator.state == before  # never advanced in place
    assert st1["rng"] is not st["rng"] and st1["rng"].bit_generator.state != before
    y3, _ = model(x, ps, st1)
    assert not np.array_equal(y1, y3)
    assert st1["training"] is True


def test_identity_in_test_mode_and_p_zero():
    x = np.random.default_rng(0).normal(size=(3, 4))
    model = lx.Dropout(0.3)
    ps, st = lx.setup(np.random.default_rng(0), model)
    y, st_out = model(x, ps, lx.testmode(st))
    assert y is x and st_out["training"] is False
    ps, st = lx.setup(np.random.default_rng(0), lx.Dropout(0.0))
    assert lx.Dropout(0.0)(x, ps, st)[0] is x


def test_layers_set_up_from_one_generator_get_different_streams():
    model = lx.Chain(lx.Dropout(0.5), lx.Dropout(0.5))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((20, 20))
    a, _ = model[0](x, {}, st["layer_1"])
    b, _ = model[1](x, {}, st["layer_2"])
    assert not np.array_equal(a, b)
    # Same setup seed, same masks.
    _, st_again = lx.setup(np.random.default_rng(0), model)
    np.testing.assert_array_equal(model[0](x, {}, st_again["layer_1"])[0], a)


def test_gradient_is_the_mask():
    model = lx.Dropout(0.25)
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.random.default_rng(1).normal(size=(6, 7))
    y, _ = model(x, ps, st)
    g = lx.grad(lambda x: model(x, ps, st)[0].sum())(x)
    np.testing.assert_allclose(g, np.where(y != 0, 1 / 0.75, 0.0))


def test_bad_arguments():
    for p in (-0.1, 1.0, 1.5, "0.5"):
        with pytest.raises(ValueError, match=r"p must be a probability in \[0, 1\)"):
            lx.Dropout(p)
    with pytest.raises(lx.LayerError, match=r"Dropout\(0.5\): expected state keys \['rng', 'training'\]"):
        lx.Dropout(0.5)(np.ones(3), {}, {})
