"""Losses against PyTorch (float64, values and gradients) and their bad-input errors."""

import numpy as np
import pytest

import luxnn as lx

RNG = np.random.default_rng(0)


def _grad_pair(loss, y_hat, y):
    value, g = lx.value_and_grad(lambda z: loss(z, y))(y_hat)
    return float(value), g


def _torch_pair(torch, fn, y_hat, y):
    t = torch.tensor(y_hat, requires_grad=True)
    out = fn(t, torch.tensor(y))
    out.backward()
    return float(out.detach()), t.grad.numpy()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_with_labels_matches_torch(torch, reduction, smoothing):
    y_hat, y = RNG.standard_normal((7, 5)) * 3, RNG.integers(0, 5, 7)
    ours = _grad_pair(lx.losses.CrossEntropyLoss(label_smoothing=smoothing, reduction=reduction), y_hat, y)
    ref = _torch_pair(torch, torch.nn.CrossEntropyLoss(label_smoothing=smoothing, reduction=reduction), y_hat, y)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(ours[1], ref[1], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_with_probabilities_matches_torch(torch, smoothing):
    y_hat = RNG.standard_normal((6, 4))
    y = RNG.dirichlet(np.ones(4), 6)
    ours = _grad_pair(lx.losses.CrossEntropyLoss(label_smoothing=smoothing), y_hat, y)
    ref = _torch_pair(torch, torch.nn.CrossEntropyLoss(label_smoothing=smoothing), y_hat, y)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-10)
    np.testing.assert_allclose(ours[1], ref[1], rtol=1e-10, atol=1e-14)


def test_cross_entropy_is_stable_for_huge_logits():
    y_hat = np.array([[1e4, -1e4, 0.0]])
    value, g = _grad_pair(lx.losses.CrossEntropyLoss(), y_hat, np.array([1]))
    assert np.isfinite(value) and np.isfinite(g).all()
    np.testing.assert_allclose(value, 2e4)


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (lx.losses.MSELoss(), "MSELoss"),
        (lx.losses.L1Loss(), "L1Loss"),
        (lx.losses.BinaryCrossEntropyLoss(), "BCEWithLogitsLoss"),
        (lx.losses.MSELoss(reduction="sum"), "MSELoss"),
    ],
)
def test_elementwise_losses_match_torch(torch, ours, theirs):
    y_hat, y = RNG.standard_normal((5, 3)) * 4, RNG.uniform(0, 1, (5, 3))
    ref = _torch_pair(torch, getattr(torch.nn, theirs)(reduction=ours.reduction), y_hat, y)
    value, g = _grad_pair(ours, y_hat, y)
    np.testing.assert_allclose(value, ref[0], rtol=1e-10)
    np.testing.assert_allclose(g, ref[1], rtol=1e-10, atol=1e-14)


def test_binary_cross_entropy_label_smoothing():
    y_hat, y = RNG.standard_normal(6), RNG.integers(0, 2, 6).astype(float)
    smoothed = y * 0.8 + 0.1
    expected = np.mean(np.logaddexp(0, y_hat) - y_hat * smoothed)
    np.testing.assert_allclose(lx.losses.BinaryCrossEntropyLoss(label_smoothing=0.2)(y_hat, y), expected)


def test_loss_as_objective_returns_loss_state_stats():
    model = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    x, y = RNG.standard_normal((4, 3)).astype(np.float32), RNG.integers(0, 2, 4)
    loss, new_st, stats = lx.losses.CrossEntropyLoss()(model, ps, st, (x, y))
    assert new_st == st and stats == {}
    np.testing.assert_allclose(loss, lx.losses.CrossEntropyLoss()(model(x, ps, st)[0], y))


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: lx.losses.MSELoss()(np.zeros((3, 1)), np.zeros(3)), r"expected targets of shape \(3, 1\)"),
        (lambda: lx.losses.CrossEntropyLoss()(np.zeros((3, 4)), np.zeros(2, int)), r"labels of shape \(3,\), got \(2,\)"),
        (lambda: lx.losses.CrossEntropyLoss()(np.zeros((2, 4)), np.array([0, 4])), r"\[0, 4\), got values in \[0, 4\]"),
        (lambda: lx.losses.MSELoss(reduction="avg"), "reduction must be one of"),
        (lambda: lx.losses.CrossEntropyLoss(label_smoothing=1.5), "label_smoothing must be in"),
        (lambda: lx.losses.MSELoss()(1, 2, 3), "takes \\(y_hat, y\\)"),
    ],
)
def test_bad_input_is_named(call, message):
    with pytest.raises((ValueError, TypeError), match=message):
        call()
