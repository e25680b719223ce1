"""Dropout: mask rate, scaling, test mode, and the generator kept in the state; `lx.draw`, the
way any layer draws from its state's generator."""

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


def test_draw_uses_a_copy_and_returns_it_advanced():
    rng = np.random.default_rng(3)
    before = rng.bit_generator.state
    a, after = lx.draw(rng, lambda g: g.normal(size=5))
    assert rng.bit_generator.state == before and after is not rng
    np.testing.assert_array_equal(a, np.random.default_rng(3).normal(size=5))
    b, _ = lx.draw(after, lambda g: g.normal(size=5))
    np.testing.assert_array_equal(np.concatenate([a, b]), np.random.default_rng(3).normal(size=10))


def test_dropout_draws_its_mask_with_draw():
    model = lx.Dropout(0.4)
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((30, 20), np.float32)
    y, new_st = model(x, ps, st)
    mask, rng = lx.draw(st["rng"], lambda g: lx.nn.dropout.dropout_mask(g, x.shape, x.dtype, 0.4))
    np.testing.assert_array_equal(y, mask)
    assert new_st["rng"].bit_generator.state == rng.bit_generator.state


class Noise(lx.Layer):
    """A user's layer drawing from its state's generator, as the README shows."""

    def init_state(self, rng):
        return {"rng": lx.child_generator(rng), "training": True}

    def __call__(self, x, ps, st):
        if not st["training"]:
            return x, st
        noise, rng = lx.draw(st["rng"], lambda g: g.standard_normal(x.shape))
        return x + noise.astype(x.dtype), {**st, "rng": rng}


def test_a_custom_layer_draws_fresh_noise_each_step_and_the_same_for_one_state():
    """Through training steps: each step's state gives new noise (the loss changes with the
    parameters fixed at lr 0), and replaying a state gives the same loss."""
    model = lx.Chain(Noise(), lx.Dense(3, 1))
    ps, st = lx.setup(np.random.default_rng(0), model)
    data = (np.zeros((8, 3), np.float32), np.zeros((8, 1), np.float32))
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.0))
    losses, states = [], []
    for _ in range(3):
        states.append(ts.states)
        _, loss, _, ts = lx.single_train_step(lx.AutoTape(), lx.losses.MSELoss(), data, ts)
        losses.append(float(loss))
    assert len(set(losses)) == 3
    replay = lx.losses.MSELoss()(model, ps, states[1], data)[0]
    np.testing.assert_allclose(float(replay), losses[1], rtol=1e-6)
    assert lx.testmode(st)["layer_1"]["training"] is False
    np.testing.assert_array_equal(model(data[0], ps, lx.testmode(st))[0], lx.Dense(3, 1)(data[0], ps["layer_2"], {})[0])
