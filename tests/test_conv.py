"""Conv and ConvTranspose against PyTorch in float64: outputs and the gradients of the
input, weight and bias, for seeded random configurations; and the bad-input errors."""

import math
import tracemalloc

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.conv import conv
from luxnn.ops.cpu.conv import _BLOCK_BYTES

RTOL = 1e-6


def f64(tree):
    return lx.tree.map(lambda a: a.astype(np.float64), tree)


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def to_channels_first(t, rank):
    return t.permute(0, rank + 1, *range(1, rank + 1))


def to_channels_last(t, rank):
    return t.permute(0, *range(2, rank + 2), 1)


def torch_kernel(w, rank):
    """HWIO (or HW,O/g,I for ConvTranspose) to PyTorch's OIHW (or I,O/g,HW): the same permutation."""
    return w.permute(rank + 1, rank, *range(rank)).contiguous()


def torch_activation(torch, name, y):
    return y if name is None else getattr(torch, name)(y)


def luxnn_grads(layer, x, ps, r):
    def loss(x, ps):
        y, _ = layer(x, ps, {})
        return (y * r).sum()

    return lx.value_and_grad(loss, argnums=(0, 1))(x, ps)[1]


def torch_run(torch, fn, x, ps, r):
    tx = torch.tensor(x, requires_grad=True)
    tw = torch.tensor(ps["weight"], requires_grad=True)
    tb = torch.tensor(ps["bias"], requires_grad=True) if "bias" in ps else None
    y = fn(tx, tw, tb)
    (y * torch.tensor(r)).sum().backward()
    grads = {"weight": tw.grad.numpy()}
    if tb is not None:
        grads["bias"] = tb.grad.numpy()
    return y.detach().numpy(), tx.grad.numpy(), grads


def check_against(torch, layer, x, torch_fn, seed):
    ps = f64(layer.init_params(np.random.default_rng(seed)))
    y, _ = layer(x, ps, {})
    r = np.random.default_rng(seed + 1).standard_normal(y.shape)
    gx, gps = luxnn_grads(layer, x, ps, r)
    ty, tgx, tgps = torch_run(torch, torch_fn, x, ps, r)
    assert rel_err(y, ty) < RTOL
    assert rel_err(gx, tgx) < RTOL
    for key in tgps:
        assert rel_err(gps[key], tgps[key]) < RTOL, key


def tf_same(n, k, s, d):
    out = -(-n // s)
    total = max((out - 1) * s + d * (k - 1) + 1 - n, 0)
    return total // 2, total - total // 2


def conv_configs(rank, count, seed, max_stride=3, max_padding=2):
    rng = np.random.default_rng(seed)
    for i in range(count):
        groups = int(rng.choice([1, 1, 2, 3]))
        cin, cout = groups * int(rng.integers(1, 4)), groups * int(rng.integers(1, 4))
        k = tuple(int(v) for v in rng.integers(1, 4, rank))
        stride = tuple(int(v) for v in rng.integers(1, max_stride + 1, rank))
        dilation = tuple(int(v) for v in rng.integers(1, 3, rank))
        kind = ["int", "per_axis", "per_side", "same", "valid"][i % 5]
        if kind == "int":
            padding = int(rng.integers(0, max_padding + 1))
        elif kind == "per_axis":
            padding = tuple(int(v) for v in rng.integers(0, max_padding + 1, rank))
        elif kind == "per_side":
            padding = tuple((int(a), int(b)) for a, b in rng.integers(0, max_padding + 1, (rank, 2)))
        else:
            padding = kind
        sizes = tuple(int(d * (kk - 1) + 1 + rng.integers(0, 6)) for kk, d in zip(k, dilation))
        yield dict(k=k, cin=cin, cout=cout, stride=stride, dilation=dilation, padding=padding, groups=groups,
                   sizes=sizes, use_bias=bool(rng.random() < 0.8), batch=int(rng.integers(1, 4)),
                   activation=[None, "relu", "tanh"][i % 3])


def pairs(padding, sizes, cfg):
    if padding == "valid":
        return ((0, 0),) * len(sizes)
    if padding == "same":
        return tuple(tf_same(n, k, s, d) for n, k, s, d in zip(sizes, cfg["k"], cfg["stride"], cfg["dilation"]))
    if isinstance(padding, int):
        return ((padding, padding),) * len(sizes)
    return tuple(p if isinstance(p, tuple) else (p, p) for p in padding)


# Stride 1 has an input gradient of its own (a correlation with the flipped kernel), whose
# padding goes negative where the forward's exceeds the dilated kernel's extent: those
# configurations get rows of their own, with paddings up to twice the largest extent.
@pytest.mark.parametrize(
    "rank,seed,count,max_stride,max_padding",
    [(2, 0, 25, 3, 2), (1, 1, 15, 3, 2), (1, 4, 15, 1, 8), (2, 5, 20, 1, 8), (3, 6, 8, 1, 8)],
)
def test_conv_matches_torch(torch, rank, seed, count, max_stride, max_padding):
    F = torch.nn.functional
    conv_nd = getattr(F, f"conv{rank}d")
    for i, cfg in enumerate(conv_configs(rank, count, seed, max_stride, max_padding)):
        layer = lx.Conv(cfg["k"], cfg["cin"], cfg["cout"], cfg["activation"], stride=cfg["stride"], padding=cfg["padding"],
                        dilation=cfg["dilation"], groups=cfg["groups"], use_bias=cfg["use_bias"])
        x = np.random.default_rng(i).standard_normal((cfg["batch"], *cfg["sizes"], cfg["cin"]))
        pads = pairs(cfg["padding"], cfg["sizes"], cfg)

        def torch_fn(tx, tw, tb, pads=pads, cfg=cfg):
            xt = to_channels_first(tx, rank)
            xt = F.pad(xt, [p for pair in reversed(pads) for p in pair])
            y = conv_nd(xt, torch_kernel(tw, rank), tb, stride=cfg["stride"], dilation=cfg["dilation"], groups=cfg["groups"])
            return to_channels_last(torch_activation(torch, cfg["activation"], y), rank)

        check_against(torch, layer, x, torch_fn, seed=100 * seed + i)


def test_conv_same_at_stride_one_is_torchs_same(torch):
    layer = lx.Conv((4, 3), 2, 3, padding="same", dilation=(2, 1))
    x = np.random.default_rng(0).standard_normal((2, 9, 6, 2))

    def torch_fn(tx, tw, tb):
        y = torch.nn.functional.conv2d(to_channels_first(tx, 2), torch_kernel(tw, 2), tb, padding="same", dilation=(2, 1))
        return to_channels_last(y, 2)

    check_against(torch, layer, x, torch_fn, seed=5)


@pytest.mark.parametrize("rank,seed", [(2, 2), (1, 3)])
def test_conv_transpose_matches_torch(torch, rank, seed):
    F = torch.nn.functional
    convt_nd = F.conv_transpose2d if rank == 2 else F.conv_transpose1d
    for i, cfg in enumerate(conv_configs(rank, 20 if rank == 2 else 12, seed)):
        stride, dilation, k = cfg["stride"], cfg["dilation"], cfg["k"]
        rng = np.random.default_rng(1000 + i)
        padding = cfg["padding"]
        if padding != "same":
            padding = pairs(padding, cfg["sizes"], cfg)
            # Keep at least one output element on each axis.
            padding = tuple((min(lo, d * (kk - 1)), min(hi, d * (kk - 1) - min(lo, d * (kk - 1))))
                            for (lo, hi), kk, d in zip(padding, k, dilation))
        output_padding = 0 if padding == "same" else tuple(int(rng.integers(0, max(s, d))) for s, d in zip(stride, dilation))
        sizes = tuple(int(v) for v in rng.integers(1, 5, rank))
        layer = lx.ConvTranspose(k, cfg["cin"], cfg["cout"], cfg["activation"], stride=stride, padding=padding, dilation=dilation,
                                 groups=cfg["groups"], output_padding=output_padding, use_bias=cfg["use_bias"])
        x = rng.standard_normal((cfg["batch"], *sizes, cfg["cin"]))
        if padding == "same":
            crops, extra = [], []
            for kk, s, d in zip(k, stride, dilation):
                total = d * (kk - 1) + 1 - s
                crops.append((max(total, 0) // 2, max(total, 0) - max(total, 0) // 2))
                extra.append(max(-total, 0))
        else:
            crops, extra = padding, output_padding

        def torch_fn(tx, tw, tb, crops=crops, extra=extra):
            y = convt_nd(to_channels_first(tx, rank), torch_kernel(tw, rank), tb, stride=stride, dilation=dilation,
                         groups=cfg["groups"], output_padding=extra)
            index = (slice(None), slice(None), *(slice(lo, y.shape[2 + a] - hi) for a, (lo, hi) in enumerate(crops)))
            return to_channels_last(torch_activation(torch, cfg["activation"], y[index]), rank)

        check_against(torch, layer, x, torch_fn, seed=200 * seed + i)
        if padding == "same":
            assert layer(x, f64(layer.init_params(rng)), {})[0].shape[1:-1] == tuple(n * s for n, s in zip(sizes, stride))


def test_conv_transpose_is_the_adjoint_of_conv():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 3, 2, 4))  # conv 2 -> 4; its transpose 4 -> 2
    x = rng.standard_normal((2, 9, 8, 2))
    cfg = dict(stride=(2, 2), padding=((1, 0), (1, 1)), dilation=(1, 2))
    y = conv(x, w, **cfg)
    u = rng.standard_normal(y.shape)
    xt = lx.ops.conv_transpose(u, w, output_padding=(1, 1), **cfg)
    assert xt.shape == x.shape
    assert abs(np.sum(y * u) - np.sum(x * xt)) < 1e-9 * abs(np.sum(y * u))


def test_defaults_dtype_and_init():
    layer = lx.Conv(3, 4, 8, activation="relu")
    ps, st = lx.setup(np.random.default_rng(0), layer)
    assert ps["weight"].shape == (3, 3, 4, 8) and ps["bias"].shape == (8,)
    assert ps["weight"].dtype == np.float32
    bound = 1 / math.sqrt(3 * 3 * 4)  # kaiming_uniform(a=sqrt 5) on fan_in, as PyTorch
    assert np.abs(ps["weight"]).max() <= bound and np.abs(ps["weight"]).max() > 0.9 * bound
    assert np.abs(ps["bias"]).max() <= bound
    y, _ = layer(np.ones((2, 5, 5, 4), np.float32), ps, st)
    assert y.dtype == np.float32 and y.shape == (2, 3, 3, 8) and (y >= 0).all()
    t = lx.ConvTranspose((3,), 4, 6, groups=2)
    assert t.init_params(np.random.default_rng(0))["weight"].shape == (3, 3, 4)


def test_parameters_only_gradient_skips_the_input():
    # The first layer of a model: x is data, not differentiated.
    layer = lx.Conv(3, 2, 4, padding=1)
    ps = f64(layer.init_params(np.random.default_rng(0)))
    x = np.random.default_rng(1).standard_normal((2, 6, 6, 2))
    g = lx.grad(lambda ps: layer(x, ps, {})[0].sum())(ps)
    g_both = lx.grad(lambda x, ps: layer(x, ps, {})[0].sum(), argnums=(0, 1))(x, ps)[1]
    assert rel_err(g["weight"], g_both["weight"]) < 1e-12


def test_one_im2col_block_at_a_time():
    layer = lx.Conv(3, 16, 32, padding=1)
    ps = layer.init_params(np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal((64, 20, 20, 16)).astype(np.float32)
    cols = 64 * 20 * 20 * 3 * 3 * 16 * 4  # the whole batch's im2col matrix: 14.7 MB
    inp, out = 64 * 20 * 20 * 16 * 4, 64 * 20 * 20 * 32 * 4
    # One block: its im2col matrix and its padded images, about a ninth of that.
    block = 1.25 * _BLOCK_BYTES
    x64 = x.astype(np.float64)
    ps64 = f64(ps)
    tracemalloc.start()
    layer(x, ps, {})
    forward_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # No padded copy of the whole input either: each block is padded on its own.
    assert forward_peak < out + block < out + cols
    tracemalloc.start()
    lx.grad(lambda x, ps: layer(x, ps, {})[0].sum(), argnums=(0, 1))(x64, ps64)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # Live in float64: the output (kept by the tape), the output gradient, the input gradient
    # and one block (of the input gradient's im2col matrix, at stride 1); the whole matrix
    # alone would be 2 * cols.
    assert peak < 2 * (2 * out + inp) + block < 2 * cols


BAD_CONV = [
    (lambda: lx.Conv(3, 4, 8), np.zeros((2, 5, 5, 3), np.float32), "expected input of shape (N, H, W, 4), got (2, 5, 5, 3)"),
    (lambda: lx.Conv(3, 4, 8), np.zeros((2, 5, 4), np.float32), "expected input of shape (N, H, W, 4), got (2, 5, 4)"),
    (lambda: lx.Conv((3,), 4, 8), np.zeros((2, 5, 5, 4), np.float32), "expected input of shape (N, L, 4)"),
    (lambda: lx.Conv(5, 1, 2, padding=(1, 0)), np.zeros((1, 6, 4, 1), np.float32), "larger than the padded input along axis 2: 4 + 0 + 0 = 4"),
    (lambda: lx.Conv(3, 1, 2, dilation=3), np.zeros((1, 6, 6, 1), np.float32), "kernel of extent 7"),
    (lambda: lx.ConvTranspose(3, 2, 2, padding=3), np.zeros((1, 1, 1, 2), np.float32), "crops the whole output"),
]


@pytest.mark.parametrize("make,x,message", BAD_CONV)
def test_bad_input_names_layer_expected_and_got(make, x, message):
    layer = make()
    ps, st = lx.setup(np.random.default_rng(0), layer)
    with pytest.raises(lx.LayerError) as err:
        layer(x, ps, st)
    assert str(err.value).startswith(repr(layer)) and message in str(err.value)


def test_bad_input_inside_a_chain_has_its_path():
    model = lx.Chain(lx.Conv(3, 1, 4), lx.Conv(3, 5, 4))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match=r"^layer_2: Conv\(\(3, 3\), 5 => 4\): expected input of shape \(N, H, W, 5\), got \(1, 6, 6, 4\)"):
        model(np.zeros((1, 8, 8, 1), np.float32), ps, st)


def test_wrong_parameters():
    layer = lx.Conv(3, 4, 8, groups=2)
    with pytest.raises(lx.LayerError, match=r"expected parameter 'weight' of shape \(3, 3, 2, 8\), got \(3, 3, 4, 8\)"):
        layer(np.zeros((1, 5, 5, 4)), {"weight": np.zeros((3, 3, 4, 8)), "bias": np.zeros(8)}, {})


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: lx.Conv(3, 4, 6, groups=4), "must both be divisible by groups"),
        (lambda: lx.ConvTranspose(3, 3, 4, groups=2), "must both be divisible by groups"),
        (lambda: lx.Conv(3, 4, 6, stride=0), "stride must be an integer >= 1"),
        (lambda: lx.Conv((3, 3), 4, 6, stride=(1, 2, 1)), "stride must be an integer >= 1 or a tuple of 2"),
        (lambda: lx.Conv(3, 4, 6, dilation=(1, 0)), "dilation must be"),
        (lambda: lx.Conv(3, 4, 6, padding=-1), "padding must be"),
        (lambda: lx.Conv(3, 4, 6, padding="full"), "padding must be"),
        (lambda: lx.Conv(3, 4, 6, padding=((1, 2, 3), (0, 0))), "padding must be"),
        (lambda: lx.Conv(0, 4, 6), "kernel_size must be"),
        (lambda: lx.Conv(3, 0, 6), "in_channels must be a positive integer"),
        (lambda: lx.ConvTranspose(3, 4, 6, stride=2, output_padding=2), "output_padding"),
        (lambda: lx.ConvTranspose(3, 4, 6, stride=2, padding="same", output_padding=1), "output_padding"),
    ],
)
def test_bad_configuration(make, message):
    with pytest.raises(ValueError, match=message):
        make()


# -- CUDA kernels against their NumPy twins (on a GPU) ----------------------------------------

from luxnn.ops.cuda import conv as cuda_conv, pool as cuda_pool  # noqa: E402


def _conv_geometry(case):
    (n, sizes, c, groups), (kernel, stride, dilation, padding) = case
    out = tuple(
        (size + lo + hi - d * (k - 1) - 1) // s + 1 for size, k, s, d, (lo, hi) in zip(sizes, kernel, stride, dilation, padding)
    )  # fmt: skip
    return n, sizes, c, groups, out, cuda_conv._Geometry(c, groups, sizes, out, kernel, stride, dilation, padding)


# (images, spatial sizes, channels, groups), (kernel, stride, dilation, padding): odd sizes,
# ranks 1 to 3, strides, dilations, groups, asymmetric padding, one image.
CONV_CASES = [
    ((3, (7, 6), 4, 1), ((3, 3), (1, 1), (1, 1), ((1, 1), (1, 1)))),
    ((2, (11, 10), 6, 3), ((3, 2), (2, 3), (2, 1), ((1, 0), (2, 1)))),
    ((1, (17,), 2, 2), ((3,), (2,), (2,), ((3, 3),))),
    ((2, (5, 6, 4), 3, 1), ((2, 2, 2), (1, 2, 1), (1, 1, 1), ((0, 1), (1, 1), (0, 0)))),
]


def _conv_kernel_args(kernel, case, rng, dtype):
    """Host arguments of one launch of a conv kernel (outputs last, zero-filled)."""
    n, sizes, c, groups, out, geometry = _conv_geometry(case)
    rows, width = n * math.prod(out), geometry.width
    normal = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    if kernel is cuda_conv.IM2COL:
        return [normal(n, *sizes, c), *geometry.args(n), True, np.zeros((groups, width, rows), dtype)]
    if kernel is cuda_conv.COL2IM:
        return [normal(groups, rows, width), normal(c), *geometry.args(n), True, True, np.zeros((n, *sizes, c), dtype)]
    o = 2 * groups
    if kernel is cuda_conv.EPILOGUE:
        return [normal(groups, rows, 2), normal(o), o, groups, rows, True, True, np.zeros((rows, o), dtype), np.zeros((rows, o), bool)]
    return [normal(rows, o), normal(rows, o) > 0, o, groups, rows, True, np.zeros((groups, rows, 2), dtype)]  # BY_GROUP


# (input shape, output sizes, window, stride, padding); window None: adaptive.
POOL_CASES = [
    ((3, 9, 8, 4), (5, 4), (3, 3), (2, 2), ((1, 1), (1, 1))),
    ((2, 7, 3), (4,), (3,), (2,), ((1, 1),)),
    ((2, 4, 5, 6, 3), (5, 3, 4), (2, 2, 3), (1, 2, 2), ((1, 1), (1, 1), (1, 1))),
    ((3, 9, 8, 4), (4, 3), None, None, None),
]


def _pool_kernel_args(kernel, case, rng, dtype):
    shape, out, window, stride, padding = case
    geometry = cuda_pool._Geometry(shape, out, window, stride, padding)
    y_shape = (shape[0], *out, shape[-1])
    x, g = rng.standard_normal(shape).astype(dtype), rng.standard_normal(y_shape).astype(dtype)
    if kernel is cuda_pool.MAX_POOL:
        return [x, *geometry.args, np.zeros(y_shape, dtype), np.zeros(y_shape, np.int32)]
    if kernel is cuda_pool.AVG_POOL:
        return [x, *geometry.args, False, np.zeros(y_shape, dtype)]
    if kernel is cuda_pool.AVG_POOL_GRAD:
        return [g, *geometry.args, False, np.zeros(shape, dtype)]
    arg = np.zeros(y_shape, np.int32)
    cuda_pool.MAX_POOL.twin(x, *geometry.args, np.zeros(y_shape, dtype), arg)
    return [g, arg, *geometry.args, np.zeros(shape, dtype)]  # MAX_POOL_GRAD


KERNEL_CASES = [
    *((k, case, _conv_kernel_args) for k in (cuda_conv.IM2COL, cuda_conv.COL2IM, cuda_conv.EPILOGUE, cuda_conv.BY_GROUP)
      for case in CONV_CASES),
    *((k, case, _pool_kernel_args) for k in (cuda_pool.MAX_POOL, cuda_pool.MAX_POOL_GRAD, cuda_pool.AVG_POOL,
                                              cuda_pool.AVG_POOL_GRAD) for case in POOL_CASES),
]  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("kernel,case,make", KERNEL_CASES, ids=lambda v: getattr(v, "name", None))
def test_each_cuda_kernel_computes_its_numpy_twin(kernel, case, make, dtype, gpu):
    """On a GPU: float64 to 1e-10, float32 to 1e-4 of the output's scale; integer and
    boolean outputs exactly."""
    import cupy

    host = make(kernel, case, np.random.default_rng(0), dtype)
    device = [cupy.asarray(a) if isinstance(a, np.ndarray) else a for a in host]
    kernel(*device)
    kernel.twin(*host)
    for got, want in zip(device, host):
        if isinstance(want, np.ndarray):
            got = cupy.asnumpy(got)
            if want.dtype.kind == "f":
                scale = max(float(np.abs(want).max(initial=0)), 1e-30)
                assert float(np.abs(got - want).max(initial=0)) <= (1e-10 if dtype == np.float64 else 1e-4) * scale
            else:
                np.testing.assert_array_equal(got, want)
