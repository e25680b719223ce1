"""The small layers: against PyTorch in float64 (outputs and input gradients), their
primitives' VJPs against finite differences, Lux's container semantics, and bad input."""

from __future__ import annotations

import operator

import numpy as np
import pytest
from test_ad_primitives import check_grad

import luxnn as lx
from luxnn.ops import pool, upsample

R = np.random.default_rng(7)


def nchw(x):
    return np.moveaxis(x, -1, 1)


def nhwc(x):
    return np.moveaxis(x, 1, -1)


def assert_close(got, want):
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-12 * max(1.0, float(np.abs(want).max())))


def run_both(torch, layer, ps, st, x, torch_fn, weights=None):
    """Our output and input gradient of ``sum(y * weights)`` against torch_fn's on the
    channel-first copy of x."""
    y, _ = layer(x, ps, st)
    w = R.normal(size=y.shape) if weights is None else weights
    g = lx.grad(lambda v: (layer(v, ps, st)[0] * w).sum())(x)
    t = torch.tensor(nchw(x), requires_grad=True)
    ty = torch_fn(t)
    (ty * torch.tensor(nchw(w))).sum().backward()
    assert_close(y, nhwc(ty.detach().numpy()))
    assert_close(g, nhwc(t.grad.numpy()))


# -- Upsample, PixelShuffle, adaptive pooling against PyTorch -----------------------------


@pytest.mark.parametrize("shape, scale", [((2, 5, 3), (3,)), ((2, 4, 5, 3), (2, 3)), ((1, 3, 2, 4, 2), (2, 1, 3))])
@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upsample_matches_torch(torch, shape, scale, mode):
    x = R.normal(size=shape)
    torch_mode = mode if mode == "nearest" else {1: "linear", 2: "bilinear", 3: "trilinear"}[len(scale)]
    extra = {} if mode == "nearest" else {"align_corners": False}
    fn = lambda t: torch.nn.functional.interpolate(t, scale_factor=scale, mode=torch_mode, **extra)  # noqa: E731
    run_both(torch, lx.Upsample(scale, mode=mode), {}, {}, x, fn)


@pytest.mark.parametrize("shape, r", [((2, 3, 4, 12), 2), ((1, 2, 2, 18), 3)])
def test_pixel_shuffle_matches_torch(torch, shape, r):
    x = R.normal(size=shape)
    run_both(torch, lx.PixelShuffle(r), {}, {}, x, lambda t: torch.nn.functional.pixel_shuffle(t, r))


@pytest.mark.parametrize(
    "shape, out", [((2, 10, 3), (4,)), ((2, 7, 9, 3), (3, 4)), ((2, 5, 5, 2), (5, 2)), ((1, 5, 6, 7, 2), (2, 4, 3))]
)
@pytest.mark.parametrize("kind", ["avg", "max"])
def test_adaptive_pools_match_torch(torch, shape, out, kind):
    x = R.normal(size=shape)
    layer = (lx.AdaptiveAvgPool if kind == "avg" else lx.AdaptiveMaxPool)(out)
    fn = getattr(torch.nn.functional, f"adaptive_{kind}_pool{len(out)}d")
    run_both(torch, layer, {}, {}, x, lambda t: fn(t, out))


def test_adaptive_max_pool_sends_ties_to_the_first_maximum_in_row_major_order(torch):
    # Equal maxima at (0, 1) and (1, 0) of one 2x2 window: PyTorch picks (0, 1).
    x = np.zeros((1, 2, 2, 1))
    x[0, 0, 1, 0] = x[0, 1, 0, 0] = 1.0
    run_both(torch, lx.AdaptiveMaxPool(1), {}, {}, x, lambda t: torch.nn.functional.adaptive_max_pool2d(t, 1), np.ones((1, 1, 1, 1)))


# -- InstanceNorm, Bilinear, AlphaDropout against PyTorch ---------------------------------


@pytest.mark.parametrize("affine, track", [(False, False), (True, False), (True, True)])
def test_instance_norm_matches_torch(torch, affine, track):
    x = R.normal(size=(3, 5, 6, 4)) * 2 + 1
    layer = lx.InstanceNorm(4, affine=affine, track_stats=track, momentum=0.3)
    ps, st = lx.setup(R, layer)
    ps = {k: R.normal(size=v.shape) for k, v in ps.items()}
    st = {k: (v.astype(np.float64) if hasattr(v, "astype") else v) for k, v in st.items()}
    ref = torch.nn.InstanceNorm2d(4, affine=affine, track_running_stats=track, momentum=0.3).double()
    if affine:
        ref.weight.data, ref.bias.data = torch.tensor(ps["scale"]), torch.tensor(ps["bias"])
    run_both(torch, layer, ps, st, x, ref)
    if track:
        _, new_st = layer(x, ps, st)
        assert_close(new_st["running_mean"], ref.running_mean.numpy())
        assert_close(new_st["running_var"], ref.running_var.numpy())
        ref.eval()
        run_both(torch, layer, ps, lx.testmode(new_st), x, ref)


def test_instance_norm_works_on_1d_and_3d_input():
    layer = lx.InstanceNorm(2)
    for shape in [(2, 9, 2), (2, 3, 4, 5, 2)]:
        y, _ = layer(R.normal(size=shape), {}, {"training": True})
        np.testing.assert_allclose(y.mean(axis=tuple(range(1, len(shape) - 1))), 0, atol=1e-12)


def test_bilinear_matches_torch(torch):
    layer = lx.Bilinear((3, 4), 5)
    ps, st = lx.setup(R, layer)
    ps = {k: v.astype(np.float64) for k, v in ps.items()}
    ref = torch.nn.Bilinear(3, 4, 5).double()
    ref.weight.data = torch.tensor(np.transpose(ps["weight"], (2, 0, 1)).copy())
    ref.bias.data = torch.tensor(ps["bias"])
    x1, x2 = R.normal(size=(2, 6, 3)), R.normal(size=(2, 6, 4))
    w = R.normal(size=(2, 6, 5))
    (g1, g2), gp = lx.grad(lambda xs, p: (layer(xs, p, st)[0] * w).sum(), argnums=(0, 1))((x1, x2), ps)
    t1, t2 = torch.tensor(x1, requires_grad=True), torch.tensor(x2, requires_grad=True)
    ty = ref(t1, t2)
    (ty * torch.tensor(w)).sum().backward()
    assert_close(layer((x1, x2), ps, st)[0], ty.detach().numpy())
    assert_close(g1, t1.grad.numpy())
    assert_close(g2, t2.grad.numpy())
    assert_close(gp["weight"], np.transpose(ref.weight.grad.numpy(), (1, 2, 0)))
    assert_close(gp["bias"], ref.bias.grad.numpy())


def test_bilinear_initialises_as_torch_and_takes_one_array_for_both():
    layer = lx.Bilinear((16, 16), 3)
    ps, st = lx.setup(R, layer)
    assert np.abs(ps["weight"]).max() <= 0.25 and np.abs(ps["weight"]).max() > 0.2  # U(±1/sqrt(16))
    x = R.normal(size=(4, 16)).astype(np.float32)
    np.testing.assert_allclose(layer(x, ps, st)[0], layer((x, x), ps, st)[0])


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_alpha_dropout_statistics_match_torch(torch, p):
    x = R.standard_normal((400, 500))
    layer = lx.AlphaDropout(p)
    _, st = lx.setup(np.random.default_rng(1), layer)
    y, _ = layer(x, {}, st)
    torch.manual_seed(0)
    ref = torch.nn.functional.alpha_dropout(torch.tensor(x), p, training=True).numpy()
    # Both keep zero mean and unit variance of standard normal input (200,000 draws: the
    # standard error of the mean is 0.0022 and of the variance 0.0032; 0.02 is 6 or more).
    for out in (y, ref):
        assert abs(out.mean()) < 0.02 and abs(out.var() - 1) < 0.02
    # Each entry is a * x + b (kept) or the dropped value, as PyTorch's, with rate p.
    alpha = 1.7580993408473766
    a = 1 / np.sqrt((alpha**2 * p + 1) * (1 - p))
    dropped_value = a * alpha * (p - 1)
    dropped = np.isclose(y, dropped_value, rtol=0, atol=1e-12)
    kept = np.isclose(y, a * x + a * alpha * p, rtol=0, atol=1e-12)
    assert (dropped | kept).all()
    assert abs(dropped.mean() - p) < 0.01
    np.testing.assert_allclose(np.sort(np.unique(np.round(ref[np.isclose(ref, dropped_value)], 12))), [round(dropped_value, 12)])


def test_alpha_dropout_is_the_identity_in_test_mode_and_reproducible_from_its_state():
    layer = lx.AlphaDropout(0.3)
    _, st = lx.setup(np.random.default_rng(0), layer)
    x = R.normal(size=(5, 7))
    assert layer(x, {}, lx.testmode(st))[0] is x
    y1, st1 = layer(x, {}, st)
    y2, _ = layer(x, {}, st)
    np.testing.assert_array_equal(y1, y2)
    assert not np.array_equal(layer(x, {}, st1)[0], y1)


# -- primitives' VJPs against finite differences ------------------------------------------


@pytest.mark.parametrize("shape, scale", [((2, 3, 2), (3,)), ((1, 3, 2, 2), (2, 3))])
def test_upsample_primitives_vjp(shape, scale):
    x = R.normal(size=shape)
    check_grad(lambda v: upsample.upsample_nearest(v, scale), x)
    check_grad(lambda v: upsample.upsample_linear(v, scale), x)


@pytest.mark.parametrize("shape, out", [((2, 5, 2), (3,)), ((1, 4, 5, 2), (3, 2))])
def test_adaptive_pool_primitives_vjp(shape, out):
    x = R.normal(size=shape)
    check_grad(lambda v: pool.adaptive_avg_pool(v, out), x)
    check_grad(lambda v: pool.adaptive_max_pool(v, out), x)


def test_bilinear_and_scale_vjp():
    bil = lx.Bilinear((3, 2), 4)
    ps = {k: v.astype(np.float64) for k, v in lx.setup(R, bil)[0].items()}
    check_grad(lambda a, b, w, c: bil((a, b), {"weight": w, "bias": c}, {})[0], R.normal(size=(5, 3)), R.normal(size=(5, 2)), ps["weight"], ps["bias"])
    scale = lx.Scale((2, 3), activation="tanh")
    check_grad(lambda v, w, b: scale(v, {"weight": w, "bias": b}, {})[0], R.normal(size=(4, 2, 3)), R.normal(size=(2, 3)), R.normal(size=(2, 3)))


# -- the rest of the small layers -------------------------------------------------------


def test_wrapped_function_noop_and_scale():
    x = R.normal(size=(3, 4))
    np.testing.assert_array_equal(lx.WrappedFunction(lx.ops.relu)(x, {}, {})[0], np.maximum(x, 0))
    assert lx.NoOpLayer()(x, {}, {"a": 1}) == (x, {"a": 1})
    layer = lx.Scale(4, use_bias=False)
    ps, st = lx.setup(R, layer)
    assert sorted(ps) == ["weight"] and ps["weight"].dtype == np.float32
    ps = {"weight": np.arange(4.0)}
    np.testing.assert_allclose(layer(x, ps, st)[0], x * np.arange(4.0))


def test_norm_activations_follow_the_affine_map():
    x = R.normal(size=(6, 3, 3, 4))
    for plain, activated in [
        (lx.BatchNorm(4), lx.BatchNorm(4, "relu")),
        (lx.GroupNorm(2, 4), lx.GroupNorm(2, 4, "relu")),
        (lx.LayerNorm(4), lx.LayerNorm(4, activation="relu")),
        (lx.InstanceNorm(4, affine=True), lx.InstanceNorm(4, "relu", affine=True)),
    ]:
        ps, st = lx.setup(R, plain)
        ps = {k: R.normal(size=v.shape) for k, v in ps.items()}
        for state in (st, lx.testmode(st)):
            np.testing.assert_allclose(activated(x, ps, state)[0], np.maximum(plain(x, ps, state)[0], 0))
        assert "activation=relu" in repr(activated)


def test_norms_convert_inputs_to_their_parameters_dtype():
    lx.set_dtype_policy("convert")
    try:
        for layer in (lx.BatchNorm(3), lx.InstanceNorm(3, affine=True), lx.Scale(3), lx.Bilinear((3, 3), 2)):
            ps, st = lx.setup(R, layer)
            assert layer(R.normal(size=(2, 4, 3)), ps, st)[0].dtype == np.float32, layer
    finally:
        lx.set_dtype_policy("warn")


def test_branch_layer_maxout_pairwise_fusion_and_repeated_layer_as_lux():
    d1, d2 = lx.Dense(3, 3), lx.Dense(3, 3)
    x = R.normal(size=(4, 3)).astype(np.float32)
    branch = lx.BranchLayer(d1, d2)
    ps, st = lx.setup(np.random.default_rng(0), branch)
    y1, y2 = d1(x, ps["layer_1"], {})[0], d2(x, ps["layer_2"], {})[0]
    out, _ = branch(x, ps, st)
    np.testing.assert_allclose(out[0], y1) and np.testing.assert_allclose(out[1], y2)
    fused, _ = lx.BranchLayer(d1, d2, fusion=lambda ys: ys[0] - ys[1])(x, ps, st)
    np.testing.assert_allclose(fused, y1 - y2)
    np.testing.assert_allclose(lx.Maxout(d1, d2)(x, ps, st)[0], np.maximum(y1, y2))

    fusion = lx.PairwiseFusion(operator.sub, d1, d2)
    x2, x3 = R.normal(size=(4, 3)).astype(np.float32), R.normal(size=(4, 3)).astype(np.float32)
    step1 = d1(x, ps["layer_1"], {})[0] - x2  # connection(layer_1(x1), x2), as Lux's code
    expected = d2(step1, ps["layer_2"], {})[0] - x3
    np.testing.assert_allclose(fusion((x, x2, x3), ps, st)[0], expected, rtol=1e-6)
    single = d2(d1(x, ps["layer_1"], {})[0] - x, ps["layer_2"], {})[0] - x
    np.testing.assert_allclose(fusion(x, ps, st)[0], single, rtol=1e-6)

    repeated = lx.RepeatedLayer(d1, 3)
    rps, rst = lx.setup(np.random.default_rng(0), repeated)
    w = rps["layer"]
    np.testing.assert_allclose(repeated(x, rps, rst)[0], d1(d1(d1(x, w, {})[0], w, {})[0], w, {})[0], rtol=1e-6)
    injected = lx.RepeatedLayer(lx.WrappedFunction(lambda xs: xs[0] * 0.5 + xs[1]), 2, input_injection=True)
    np.testing.assert_allclose(injected(x, {"layer": {}}, {"layer": {}})[0], (x * 0.5 + x) * 0.5 + x)


def test_repeated_layer_threads_the_state_through_the_repeats():
    repeated = lx.RepeatedLayer(lx.Dropout(0.5), 2)
    ps, st = lx.setup(np.random.default_rng(0), repeated)
    y, new_st = repeated(np.ones((1, 1000)), ps, st)
    # Two independent masks: a quarter of the entries survive both (at scale 4).
    assert 0.2 < (y == 4).mean() < 0.3
    assert new_st["layer"]["rng"] is not st["layer"]["rng"]


@pytest.mark.parametrize(
    "make, x, message",
    [
        (lambda: lx.Scale(3), np.ones((2, 4)), r"Scale\(3\): expected input of shape \(\.\.\., 3\), got \(2, 4\)"),
        (lambda: lx.Bilinear((3, 4), 2), (np.ones((2, 3)), np.ones((5, 4))), r"same leading axes, got \(2, 3\) and \(5, 4\)"),
        (lambda: lx.Upsample(2), np.ones((2, 4, 3)), r"Upsample\(\(2, 2\)\): expected input of shape \(N, H, W, C\), got \(2, 4, 3\)"),
        (lambda: lx.PixelShuffle(2), np.ones((1, 2, 2, 6)), r"C \* 2\*\*2"),
        (lambda: lx.AdaptiveAvgPool((2, 2)), np.ones((2, 4)), r"expected input of shape \(N, H, W, C\)"),
        (lambda: lx.InstanceNorm(3), np.ones((2, 3)), r"with a spatial axis, got \(2, 3\)"),
        (lambda: lx.Maxout(lx.Dense(2, 2), lx.Dense(2, 3)), np.ones((1, 2), np.float32), r"outputs of one shape"),
        (lambda: lx.PairwiseFusion(operator.add, lx.NoOpLayer()), (np.ones(2),) * 3, r"tuple of 2 inputs for 1 layers, got 3"),
    ],
)
def test_bad_input_raises_layer_error_naming_the_layer(make, x, message):
    layer = make()
    ps, st = lx.setup(R, layer)
    with pytest.raises(lx.LayerError, match=message):
        layer(x, ps, st)


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: lx.Scale(0), "dims must be a positive integer"),
        (lambda: lx.Bilinear((3,), 2), r"in_dims must be a pair"),
        (lambda: lx.Upsample(2, mode="cubic"), "mode must be one of"),
        (lambda: lx.Upsample(0), "scale must be an integer >= 1"),
        (lambda: lx.PixelShuffle(0), "r must be a positive integer"),
        (lambda: lx.AdaptiveMaxPool((2, 0)), "out_size must be"),
        (lambda: lx.AlphaDropout(1.0), r"p must be a probability in \[0, 1\)"),
        (lambda: lx.RepeatedLayer(lx.NoOpLayer(), 0), "repeats must be a positive integer"),
        (lambda: lx.InstanceNorm(3, momentum=2.0), r"momentum must be in \[0, 1\]"),
        (lambda: lx.BatchNorm(3, "nope"), "unknown activation"),
    ],
)
def test_bad_configuration_raises_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_wrapped_function_and_containers_refuse_what_is_not_callable_or_a_layer():
    with pytest.raises(TypeError, match="fn must be callable"):
        lx.WrappedFunction(3)
    with pytest.raises(TypeError, match="layer_2 must be a luxnn Layer"):
        lx.BranchLayer(lx.NoOpLayer(), 3)
    with pytest.raises(TypeError, match="combine must be callable"):
        lx.PairwiseFusion(None, lx.NoOpLayer())
