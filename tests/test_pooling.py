"""Pooling and shape layers against PyTorch in float64 (outputs and input gradients), and
their bad-input errors."""

import numpy as np
import pytest

import luxnn as lx

RTOL = 1e-6


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def check_against(torch, layer, x, torch_fn, seed):
    y, _ = layer(x, {}, {})
    r = np.random.default_rng(seed).standard_normal(y.shape)
    gx = lx.grad(lambda x: (layer(x, {}, {})[0] * r).sum())(x)
    tx = torch.tensor(x, requires_grad=True)
    ty = torch_fn(tx)
    (ty * torch.tensor(r)).sum().backward()
    assert rel_err(y, ty.detach().numpy()) < RTOL
    assert rel_err(gx, tx.grad.numpy()) < RTOL


def channels_first(t, rank):
    return t.permute(0, rank + 1, *range(1, rank + 1))


def channels_last(t, rank):
    return t.permute(0, *range(2, rank + 2), 1)


def tf_same(n, k, s):
    total = max((-(-n // s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


def pool_configs(rank, count, seed):
    rng = np.random.default_rng(seed)
    for i in range(count):
        window = tuple(int(v) for v in rng.integers(1, 4, rank))
        stride = None if i % 3 == 0 else tuple(int(v) for v in rng.integers(1, 4, rank))
        strides = window if stride is None else stride
        kind = ["zero", "int", "per_side", "same"][i % 4]
        if kind == "zero":
            padding, pads = 0, ((0, 0),) * rank
        elif kind == "int":
            p = int(min(window) // 2)
            padding, pads = p, ((p, p),) * rank
        elif kind == "per_side":
            pads = tuple((int(rng.integers(0, k // 2 + 1)), int(rng.integers(0, k // 2 + 1))) for k in window)
            padding = pads
        sizes = tuple(int(k + rng.integers(0, 6)) for k in window)
        if kind == "same":
            padding, pads = "same", tuple(tf_same(n, k, s) for n, k, s in zip(sizes, window, strides))
        yield window, stride, strides, padding, pads, sizes


@pytest.mark.parametrize("rank,seed", [(2, 0), (1, 1)])
def test_max_pool_matches_torch(torch, rank, seed):
    F = torch.nn.functional
    pool_nd = F.max_pool2d if rank == 2 else F.max_pool1d
    for i, (window, stride, strides, padding, pads, sizes) in enumerate(pool_configs(rank, 16, seed)):
        layer = lx.MaxPool(window, stride, padding)
        x = np.random.default_rng(i).standard_normal((2, *sizes, 3))

        def torch_fn(tx, window=window, strides=strides, pads=pads):
            xt = F.pad(channels_first(tx, rank), [p for pair in reversed(pads) for p in pair], value=-np.inf)
            return channels_last(pool_nd(xt, window, strides), rank)

        check_against(torch, layer, x, torch_fn, seed=i)


@pytest.mark.parametrize("rank,seed,include", [(2, 2, True), (2, 3, False), (1, 4, True), (1, 5, False)])
def test_avg_pool_matches_torch(torch, rank, seed, include):
    F = torch.nn.functional
    pool_nd = F.avg_pool2d if rank == 2 else F.avg_pool1d
    for i, (window, stride, strides, padding, pads, sizes) in enumerate(pool_configs(rank, 12, seed)):
        layer = lx.AvgPool(window, stride, padding, count_include_pad=include)
        x = np.random.default_rng(i).standard_normal((2, *sizes, 3))

        def torch_fn(tx, window=window, strides=strides, pads=pads):
            flat = [p for pair in reversed(pads) for p in pair]
            xt = F.pad(channels_first(tx, rank), flat)
            y = pool_nd(xt, window, strides)
            if not include:  # PyTorch has no asymmetric padding: divide by the real counts directly
                ones = F.pad(torch.ones_like(channels_first(tx, rank)[:1, :1]), flat)
                y = y / pool_nd(ones, window, strides)
            return channels_last(y, rank)

        check_against(torch, layer, x, torch_fn, seed=i)


def test_symmetric_padding_is_torchs(torch):
    F = torch.nn.functional
    x = np.random.default_rng(0).standard_normal((2, 7, 8, 3))
    check_against(torch, lx.MaxPool(3, 2, 1), x, lambda t: channels_last(F.max_pool2d(channels_first(t, 2), 3, 2, 1), 2), seed=0)
    for include in (True, False):
        layer = lx.AvgPool((3, 2), (2, 1), 1, count_include_pad=include)
        fn = lambda t: channels_last(F.avg_pool2d(channels_first(t, 2), (3, 2), (2, 1), 1, count_include_pad=include), 2)  # noqa: E731
        check_against(torch, layer, x, fn, seed=1)


def test_max_pool_ties_send_the_gradient_to_the_first_maximum(torch):
    x = np.zeros((1, 4, 4, 1))
    x[0, 2:, 2:, 0] = 1.0
    g = lx.grad(lambda x: lx.MaxPool(2)(x, {}, {})[0].sum())(x)
    tx = torch.tensor(x, requires_grad=True)
    torch.nn.functional.max_pool2d(channels_first(tx, 2), 2).sum().backward()
    np.testing.assert_array_equal(g, tx.grad.numpy())
    overlapping = lx.grad(lambda x: lx.MaxPool(2, 1)(x, {}, {})[0].sum())(x)
    tx.grad = None
    torch.nn.functional.max_pool2d(channels_first(tx, 2), 2, 1).sum().backward()
    np.testing.assert_array_equal(overlapping, tx.grad.numpy())


def test_global_pools_keep_singleton_spatial_axes(torch):
    x = np.random.default_rng(0).standard_normal((2, 5, 4, 3))
    check_against(torch, lx.GlobalAvgPool(), x, lambda t: t.mean(dim=(1, 2), keepdim=True), seed=0)
    check_against(torch, lx.GlobalMaxPool(), x, lambda t: t.amax(dim=(1, 2), keepdim=True), seed=1)
    assert lx.GlobalAvgPool()(np.ones((2, 7, 3)), {}, {})[0].shape == (2, 1, 3)


def test_flatten_and_reshape():
    x = np.arange(2 * 3 * 4 * 5, dtype=np.float64).reshape(2, 3, 4, 5)
    y, _ = lx.Flatten()(x, {}, {})
    np.testing.assert_array_equal(y, x.reshape(2, 60))
    z, _ = lx.Reshape((4, -1))(y, {}, {})
    assert z.shape == (2, 4, 15)
    g = lx.grad(lambda x: (lx.Reshape((5, 12))(lx.Flatten()(x, {}, {})[0], {}, {})[0] ** 2).sum())(x)
    np.testing.assert_allclose(g, 2 * x)


def test_cnn_pipeline_shapes_and_dtype():
    model = lx.Chain(lx.Conv(3, 1, 4, "relu", padding="same"), lx.MaxPool(2), lx.AvgPool(2), lx.Flatten(), lx.Dense(7 * 7 * 4, 10))
    ps, st = lx.setup(np.random.default_rng(0), model)
    y, _ = model(np.ones((3, 28, 28, 1), np.float32), ps, st)
    assert y.shape == (3, 10) and y.dtype == np.float32


@pytest.mark.parametrize(
    "layer,x,message",
    [
        (lx.MaxPool(2), np.zeros((2, 8, 8)), "expected input of shape (N, H, W, C), got (2, 8, 8)"),
        (lx.AvgPool((2,)), np.zeros((2, 8, 8, 1)), "expected input of shape (N, L, C), got (2, 8, 8, 1)"),
        (lx.MaxPool(5), np.zeros((2, 8, 4, 1)), "window 5 is larger than the padded input along axis 2: 4 + 0 + 0 = 4"),
        (lx.AvgPool(3, padding=((1, 1), (0, 0))), np.zeros((1, 4, 2, 1)), "window 3 is larger than the padded input along axis 2"),
        (lx.GlobalMaxPool(), np.zeros((2, 8)), "expected input of shape (N, *spatial, C)"),
        (lx.Flatten(), np.float64(1.0), "expected an input with a batch axis"),
        (lx.Reshape((7, 7)), np.zeros((2, 50)), "cannot reshape samples of shape (50,) (50 elements) to (7, 7)"),
        (lx.Reshape((-1, 7)), np.zeros((2, 50)), "cannot reshape samples"),
    ],
)
def test_bad_input_names_layer_expected_and_got(layer, x, message):
    with pytest.raises(lx.LayerError) as err:
        layer(x, {}, {})
    assert str(err.value).startswith(repr(layer)) and message in str(err.value)


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: lx.MaxPool(0), "window must be"),
        (lambda: lx.MaxPool(2, stride=0), "stride must be"),
        (lambda: lx.MaxPool(2, padding=2), "padding must be smaller than the window"),
        (lambda: lx.AvgPool((3, 3), padding=((0, 3), (0, 0))), "padding must be smaller than the window"),
        (lambda: lx.AvgPool(2, padding="full"), "padding must be"),
        (lambda: lx.Reshape((2, -1, -1)), "at most one -1"),
    ],
)
def test_bad_configuration(make, message):
    with pytest.raises(ValueError, match=message):
        make()
