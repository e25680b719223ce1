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


# -- the losses PyTorch has, with their options ------------------------------------------


def _nchw_scores(torch, y_hat):
    """(N, ..., K) scores as PyTorch's (N, K, ...) layout."""
    return torch.tensor(np.moveaxis(y_hat, -1, 1), requires_grad=True)


def _torch_class_pair(torch, fn, y_hat, y):
    t = _nchw_scores(torch, y_hat)
    out = fn(t, torch.tensor(y))
    out.sum().backward()
    return out.detach().numpy(), np.moveaxis(t.grad.numpy(), 1, -1)


def _assert_pair(ours, ref):
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-9, atol=1e-14)
    np.testing.assert_allclose(ours[1], ref[1], rtol=1e-9, atol=1e-14)


def _grad_any(loss, y_hat, y):
    value, g = lx.value_and_grad(lambda z: loss(z, y).sum())(y_hat)
    return loss(y_hat, y), g


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore", [None, 2])
def test_cross_entropy_weight_and_ignore_index_match_torch(torch, reduction, smoothing, weighted, ignore):
    y_hat, y = RNG.standard_normal((6, 3, 4)) * 2, RNG.integers(0, 4, (6, 3))
    weight = RNG.uniform(0.2, 2.0, 4) if weighted else None
    ours = _grad_any(lx.losses.CrossEntropyLoss(label_smoothing=smoothing, weight=weight, ignore_index=ignore, reduction=reduction), y_hat, y)
    ref = _torch_class_pair(torch, torch.nn.CrossEntropyLoss(
        weight=None if weight is None else torch.tensor(weight), ignore_index=-100 if ignore is None else ignore,
        label_smoothing=smoothing, reduction=reduction,
    ), y_hat, y)  # fmt: skip
    _assert_pair(ours, ref)


def test_cross_entropy_ignores_labels_outside_the_classes_and_weighs_probability_targets(torch):
    y_hat, y = RNG.standard_normal((5, 3)), np.array([0, -100, 2, -100, 1])
    ours = _grad_any(lx.losses.CrossEntropyLoss(ignore_index=-100), y_hat, y)
    _assert_pair(ours, _torch_class_pair(torch, torch.nn.CrossEntropyLoss(), y_hat, y))
    weight, probs = RNG.uniform(0.5, 2.0, 3), RNG.dirichlet(np.ones(3), 5)
    ours = _grad_any(lx.losses.CrossEntropyLoss(weight=weight, label_smoothing=0.1), y_hat, probs)
    ref = _torch_class_pair(torch, torch.nn.CrossEntropyLoss(weight=torch.tensor(weight), label_smoothing=0.1), y_hat, probs)
    _assert_pair(ours, ref)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted, ignore", [(False, None), (True, None), (True, 1), (False, 0)])
def test_nll_loss_matches_torch(torch, reduction, weighted, ignore):
    y_hat = np.log(RNG.dirichlet(np.ones(5), (7, 2)))
    y = RNG.integers(0, 5, (7, 2))
    weight = RNG.uniform(0.2, 2.0, 5) if weighted else None
    ours = _grad_any(lx.losses.NLLLoss(weight=weight, ignore_index=ignore, reduction=reduction), y_hat, y)
    ref = _torch_class_pair(torch, torch.nn.NLLLoss(
        weight=None if weight is None else torch.tensor(weight), ignore_index=-100 if ignore is None else ignore,
        reduction=reduction,
    ), y_hat, y)  # fmt: skip
    _assert_pair(ours, ref)


@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides the total loss:UserWarning")
@pytest.mark.parametrize("reduction", ["mean", "batchmean", "sum", "none"])
@pytest.mark.parametrize("from_logits", [False, True])
def test_kl_divergence_matches_torch(torch, reduction, from_logits):
    logits = RNG.standard_normal((4, 6))
    y = RNG.dirichlet(np.ones(6), 4)
    y[0, 2] = 0.0  # a zero target probability contributes nothing
    y_hat = logits if from_logits else scipy_log_softmax(logits)
    ours = _grad_any(lx.losses.KLDivergenceLoss(from_logits=from_logits, reduction=reduction), y_hat, y)
    t = torch.tensor(y_hat, requires_grad=True)
    inputs = torch.log_softmax(t, dim=-1) if from_logits else t
    out = torch.nn.KLDivLoss(reduction=reduction, log_target=False)(inputs, torch.tensor(y))
    out.sum().backward()
    _assert_pair(ours, (out.detach().numpy(), t.grad.numpy()))


def scipy_log_softmax(x):
    return x - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)) - x.max(-1, keepdims=True)


@pytest.mark.parametrize("delta", [0.5, 1.0, 2.5])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_huber_matches_torch(torch, delta, reduction):
    y_hat, y = RNG.standard_normal((5, 4)) * 3, RNG.standard_normal((5, 4))
    ours = _grad_any(lx.losses.HuberLoss(delta, reduction=reduction), y_hat, y)
    ref = _torch_pair_any(torch, torch.nn.HuberLoss(delta=delta, reduction=reduction), y_hat, y)
    _assert_pair(ours, ref)


def _torch_pair_any(torch, fn, y_hat, y):
    t = torch.tensor(y_hat, requires_grad=True)
    out = fn(t, torch.tensor(y))
    out.sum().backward()
    return out.detach().numpy(), t.grad.numpy()


@pytest.mark.parametrize("log_input", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_poisson_matches_torch(torch, log_input, reduction):
    y = RNG.poisson(3.0, (6, 3)).astype(float)
    y_hat = RNG.standard_normal((6, 3)) if log_input else RNG.uniform(0.1, 5.0, (6, 3))
    ours = _grad_any(lx.losses.PoissonLoss(log_input=log_input, reduction=reduction), y_hat, y)
    ref = _torch_pair_any(torch, torch.nn.PoissonNLLLoss(log_input=log_input, full=False, eps=1e-8, reduction=reduction), y_hat, y)
    _assert_pair(ours, ref)


def test_binary_focal_loss_matches_torchvisions_formula_and_lux(torch):
    y_hat, y = RNG.standard_normal((6, 5)) * 2, RNG.integers(0, 2, (6, 5)).astype(float)
    ours = _grad_any(lx.losses.BinaryFocalLoss(gamma=2.0), y_hat, y)

    def sigmoid_focal(t, target):  # torchvision.ops.sigmoid_focal_loss without alpha, mean
        p = torch.sigmoid(t)
        ce = torch.nn.functional.binary_cross_entropy_with_logits(t, target, reduction="none")
        p_t = p * target + (1 - p) * (1 - target)
        return (ce * (1 - p_t) ** 2).mean()

    _assert_pair(ours, _torch_pair_any(torch, sigmoid_focal, y_hat, y))
    p = 1 / (1 + np.exp(-y_hat))
    lux = lx.losses.BinaryFocalLoss(from_logits=False)(p, y)
    np.testing.assert_allclose(lux, ours[0], rtol=1e-9)


def test_focal_loss_is_cross_entropy_at_gamma_zero_and_lux_on_probabilities():
    y_hat, y = RNG.standard_normal((6, 4)), RNG.integers(0, 4, 6)
    np.testing.assert_allclose(lx.losses.FocalLoss(gamma=0.0)(y_hat, y), lx.losses.CrossEntropyLoss()(y_hat, y), rtol=1e-12)
    one_hot = np.eye(4)[y]
    np.testing.assert_allclose(lx.losses.FocalLoss()(y_hat, y), lx.losses.FocalLoss()(y_hat, one_hot), rtol=1e-12)
    # Lux's docstring example (columns are examples there): 1.1277556
    probs = np.exp(np.arange(-7.0, 8.0).reshape(5, 3))
    probs /= probs.sum(axis=1, keepdims=True)
    target = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0]], float)
    np.testing.assert_allclose(lx.losses.FocalLoss(from_logits=False)(probs, target), 1.1277556, rtol=1e-6)
    p = np.exp(scipy_log_softmax(y_hat))
    by_hand = -np.mean((1 - p[np.arange(6), y]) ** 2 * np.log(p[np.arange(6), y]))
    np.testing.assert_allclose(lx.losses.FocalLoss()(y_hat, y), by_hand, rtol=1e-12)


def test_losses_torch_lacks_follow_luxs_definitions():
    # Lux's docstring examples
    np.testing.assert_allclose(lx.losses.MSLELoss()(np.array([1.1, 2.2, 3.3], np.float32), np.array([1.0, 2, 3], np.float32)), 0.009084041, rtol=1e-5)
    np.testing.assert_allclose(lx.losses.PoissonLoss()(np.array([1.0, 3, 3]), np.array([1.0, 2, 3])), 0.502312852219817, rtol=1e-7)
    np.testing.assert_allclose(lx.losses.DiceCoeffLoss()(np.array([1.1, 2.1, 3.1]), np.array([1.0, 2, 3])), 0.000992391663909964, rtol=1e-9)
    y_hat, y = RNG.standard_normal((8, 3)), np.sign(RNG.standard_normal((8, 3)))
    np.testing.assert_allclose(lx.losses.HingeLoss()(y_hat, y), np.maximum(0, 1 - y_hat * y).mean())
    np.testing.assert_allclose(lx.losses.SquaredHingeLoss(reduction="sum")(y_hat, y), (np.maximum(0, 1 - y_hat * y) ** 2).sum())
    # Dice per example over all axes but the batch axis, then the mean
    a, b = RNG.uniform(size=(3, 4, 5)), RNG.uniform(size=(3, 4, 5))
    per = 1 - (2 * (a * b).sum((1, 2)) + 1) / ((a * a).sum((1, 2)) + (b * b).sum((1, 2)) + 1)
    np.testing.assert_allclose(lx.losses.DiceCoeffLoss(reduction="none")(a, b), per)


@pytest.mark.parametrize(
    "loss, y_hat, y",
    [
        (lx.losses.DiceCoeffLoss(), RNG.uniform(size=(3, 4)), RNG.uniform(size=(3, 4))),
        (lx.losses.MSLELoss(), RNG.uniform(0.5, 2, (3, 4)), RNG.uniform(0.5, 2, (3, 4))),
        (lx.losses.HingeLoss(), RNG.standard_normal((3, 4)), np.sign(RNG.standard_normal((3, 4)))),
        (lx.losses.SquaredHingeLoss(), RNG.standard_normal((3, 4)), np.sign(RNG.standard_normal((3, 4)))),
        (lx.losses.FocalLoss(gamma=1.5), RNG.standard_normal((3, 4)), RNG.integers(0, 4, 3)),
        (lx.losses.BinaryFocalLoss(gamma=1.5, from_logits=False), RNG.uniform(0.1, 0.9, (3, 4)), RNG.integers(0, 2, (3, 4)).astype(float)),
    ],
)
def test_gradients_of_the_losses_torch_lacks_agree_with_finite_differences(loss, y_hat, y):
    from test_ad_primitives import check_grad

    check_grad(lambda z: loss(z, y), y_hat, argnums=(0,))


ALL_LOSSES = [
    lx.losses.MSELoss(), lx.losses.L1Loss(), lx.losses.HuberLoss(), lx.losses.MSLELoss(), lx.losses.PoissonLoss(),
    lx.losses.HingeLoss(), lx.losses.SquaredHingeLoss(), lx.losses.CrossEntropyLoss(), lx.losses.NLLLoss(),
    lx.losses.KLDivergenceLoss(), lx.losses.BinaryCrossEntropyLoss(), lx.losses.FocalLoss(),
    lx.losses.BinaryFocalLoss(), lx.losses.DiceCoeffLoss(),
]  # fmt: skip


def test_every_loss_is_tested_here():
    assert {type(loss).__name__ for loss in ALL_LOSSES} == set(lx.losses.__all__) - {"Loss"}


@pytest.mark.parametrize("loss", ALL_LOSSES, ids=lambda loss: type(loss).__name__)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_loss_refuses_an_empty_batch(loss, reduction):
    loss = type(loss)(reduction=reduction)
    labels = isinstance(loss, (lx.losses.CrossEntropyLoss, lx.losses.NLLLoss, lx.losses.FocalLoss))
    y = np.zeros(0, int) if labels else np.zeros((0, 3))
    with pytest.raises(ValueError, match="empty batch"):
        loss(np.zeros((0, 3)), y)
    model = lx.Dense(2, 3)
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(ValueError, match="empty batch"):
        loss(model, ps, st, (np.zeros((0, 2), np.float32), y))


def test_a_mean_over_no_counted_target_raises():
    with pytest.raises(ValueError, match="no target counts towards the mean"):
        lx.losses.CrossEntropyLoss(ignore_index=1)(np.zeros((2, 3)), np.array([1, 1]))
    with pytest.raises(ValueError, match="no target counts towards the mean"):
        lx.losses.NLLLoss(weight=np.array([0.0, 1.0]))(np.zeros((2, 2)), np.array([0, 0]))
    assert float(lx.losses.CrossEntropyLoss(ignore_index=1, reduction="sum")(np.zeros((2, 3)), np.array([1, 1]))) == 0.0


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: lx.losses.CrossEntropyLoss(weight=np.ones(3))(np.zeros((2, 4)), np.array([0, 1])), r"a weight per class \(4,\), got \(3,\)"),
        (lambda: lx.losses.CrossEntropyLoss(weight=-np.ones(3)), "non-negative class weights"),
        (lambda: lx.losses.CrossEntropyLoss(ignore_index=0)(np.zeros((2, 3)), np.full((2, 3), 1 / 3)), "ignore_index applies to integer labels"),
        (lambda: lx.losses.NLLLoss()(np.zeros((2, 3)), np.zeros((2, 3))), "expected integer labels"),
        (lambda: lx.losses.NLLLoss(ignore_index=-1)(np.zeros((2, 3)), np.array([-1, 3])), r"labels must lie in \[0, 3\), got values in \[3, 3\]"),
        (lambda: lx.losses.HuberLoss(delta=0), "delta must be positive"),
        (lambda: lx.losses.KLDivergenceLoss(reduction="batch"), "reduction must be one of"),
        (lambda: lx.losses.FocalLoss(gamma=-1), "gamma must be a number >= 0"),
        (lambda: lx.losses.FocalLoss()(np.zeros((2, 3)), np.array([0, 3])), r"integer labels in \[0, 3\)"),
        (lambda: lx.losses.DiceCoeffLoss()(np.zeros((2, 3)), np.zeros((3, 2))), r"expected targets of shape \(2, 3\)"),
        (lambda: lx.losses.CrossEntropyLoss()(np.zeros((4, 10)), np.array([1.0, 2, 3, 4])), r"^CrossEntropyLoss: expected integer class labels of shape \(4,\) or class probabilities of shape \(4, 10\), got targets of shape \(4,\) and dtype float64; class labels must be integers \(e.g. y.astype\(np.int64\)\)$"),
        (lambda: lx.losses.CrossEntropyLoss(reduction="none")(np.zeros((4, 10)), np.zeros((4, 9))), r"probabilities of shape \(4, 10\), got targets of shape \(4, 9\) and dtype float64$"),
    ],
)
def test_bad_options_and_targets_are_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_fused_cross_entropy_vjp_with_weights_ignored_labels_and_smoothing(reduction):
    from test_ad_primitives import check_grad

    labels = np.array([[0, 3, -1], [2, -1, 1]])
    weight = RNG.uniform(0.5, 2.0, 4)
    check_grad(
        lambda z: lx.ops.softmax_cross_entropy(z, labels, 0.2, reduction, weight=weight, ignore_index=-1),
        RNG.standard_normal((2, 3, 4)), argnums=(0,),
    )  # fmt: skip
