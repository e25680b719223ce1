"""Convolutions and pooling on the CUDA path, on the simulated device of tests/sim_cupy.py
(luxnn's kernels run by their NumPy twins, launches counted), against the CPU path:
outputs and gradients of each configuration, the launches per call, and the blocks a call
cuts its batch into above its memory budget.

What the simulator cannot tell: whether the CUDA sources compute what their twins do
(tests/test_conv.py's GPU tests), and the speed of anything.
"""

from __future__ import annotations

import importlib
import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.cuda import conv as cuda_conv

conv_ops = importlib.import_module("luxnn.ops.conv")  # `luxnn.ops.conv` is also the function
pool_ops = importlib.import_module("luxnn.ops.pool")

import sim_cupy


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


# name: (layer, input shape); odd sizes, strides, dilations, groups, paddings, ranks 1 to 3.
LAYERS = {
    "conv_relu_same": (lambda: lx.Conv(3, 3, 5, activation="relu", padding="same"), (2, 7, 6, 3)),
    "conv_strided_dilated_grouped": (
        lambda: lx.Conv((3, 2), 4, 6, stride=(2, 3), dilation=(2, 1), padding=((1, 0), (2, 1)), groups=2), (3, 11, 10, 4)
    ),
    "conv_same_stride_2": (lambda: lx.Conv(3, 2, 4, activation="tanh", stride=2, padding="same"), (2, 9, 8, 2)),
    "conv_depthwise_no_bias": (lambda: lx.Conv(3, 4, 4, groups=4, use_bias=False, padding=1), (2, 6, 5, 4)),
    "conv_1x1": (lambda: lx.Conv(1, 3, 2), (2, 4, 5, 3)),
    "conv_1d": (lambda: lx.Conv((3,), 2, 3, dilation=2, padding=3, activation="relu"), (3, 17, 2)),
    "conv_3d": (lambda: lx.Conv((2, 2, 2), 2, 3, stride=(1, 2, 1), activation="relu"), (2, 5, 6, 4, 2)),
    "conv_batch_1": (lambda: lx.Conv(3, 2, 3, padding=1), (1, 5, 5, 2)),
    "conv_batch_0": (lambda: lx.Conv(3, 2, 3, activation="relu", padding=1), (0, 5, 5, 2)),
    "conv_transpose": (lambda: lx.ConvTranspose(3, 4, 6, stride=2, padding=1, output_padding=1, groups=2), (2, 5, 4, 4)),
    "conv_transpose_relu_dilated": (
        lambda: lx.ConvTranspose((2, 3), 2, 3, activation="relu", stride=(2, 1), dilation=(1, 2)), (3, 4, 5, 2)
    ),
    "conv_transpose_same_1d": (lambda: lx.ConvTranspose((4,), 3, 2, stride=2, padding="same"), (2, 5, 3)),
    "conv_transpose_batch_0": (lambda: lx.ConvTranspose(3, 2, 3, stride=2), (0, 3, 3, 2)),
    "max_pool_overlapping_padded": (lambda: lx.MaxPool(3, stride=2, padding=1), (3, 9, 8, 4)),
    "max_pool_tiling": (lambda: lx.MaxPool(2), (2, 8, 6, 3)),
    "max_pool_same_1d": (lambda: lx.MaxPool((3,), stride=2, padding="same"), (2, 7, 3)),
    "max_pool_3d": (lambda: lx.MaxPool((2, 2, 3), stride=(1, 2, 2), padding=1), (2, 4, 5, 6, 3)),
    "avg_pool_without_padding_count": (lambda: lx.AvgPool(3, stride=2, padding=1, count_include_pad=False), (3, 9, 8, 4)),
    "avg_pool_counting_padding": (lambda: lx.AvgPool((2, 3), stride=1, padding=1), (2, 7, 8, 2)),
    "adaptive_avg_pool": (lambda: lx.AdaptiveAvgPool((3, 4)), (3, 9, 8, 4)),
    "adaptive_max_pool": (lambda: lx.AdaptiveMaxPool((4, 3)), (3, 9, 8, 4)),
    "adaptive_max_pool_1d": (lambda: lx.AdaptiveMaxPool((2,)), (2, 5, 3)),
    "pool_batch_1": (lambda: lx.MaxPool(2, stride=1), (1, 3, 3, 2)),
}


def _output_and_grads(layer, device, x, ps, r):
    x, ps, r = device(x), device(ps), device(r)
    y, _ = layer(x, ps, {})
    grads = lx.value_and_grad(lambda x, ps: (layer(x, ps, {})[0] * r).sum(), argnums=(0, 1))(x, ps)[1]
    return lx.cpu_device()((y, grads))


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_the_cuda_path_gives_the_cpu_paths_outputs_and_gradients(name, dtype, sim_gpu):
    make, shape = LAYERS[name]
    layer = make()
    rng = np.random.default_rng(0)
    ps = lx.tree.map(lambda p: p.astype(dtype), layer.init_params(rng))
    x = rng.standard_normal(shape).astype(dtype)
    r = rng.standard_normal(layer(x, ps, {})[0].shape).astype(dtype)
    (y_cpu, g_cpu), (y_gpu, g_gpu) = (_output_and_grads(layer, device, x, ps, r) for device in (lx.cpu_device(), sim_gpu))
    tol = 1e-12 if dtype == np.float64 else 1e-5
    for (path, want), (_, got) in zip(lx.tree.paths((y_cpu, g_cpu)), lx.tree.paths((y_gpu, g_gpu))):
        assert got.shape == want.shape and got.dtype == want.dtype, path
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max(initial=0))), err_msg=path)


def _launches(fn):
    with sim_cupy.counting() as counts:
        result = fn()
    return result, sum(counts[k] for k in ("kernel", "fill", "cublas")), counts


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_a_convolution_launches_a_few_kernels_whatever_the_batch(batch, sim_gpu):
    rng = np.random.default_rng(0)
    x, w, b = (sim_gpu(rng.standard_normal(s)) for s in ((batch, 12, 12, 8), (3, 3, 8, 16), (16,)))
    config = dict(stride=(1, 1), padding=((1, 1), (1, 1)), dilation=(1, 1), groups=1, relu=True)
    (y, vjp), forward, counts = _launches(lambda: conv_ops._conv.raw(x, w, b, **config))
    assert forward == 3 and counts["kernel", "luxnn_im2col"] == 1 and counts["cublas"] == 1  # im2col, GEMM, epilogue
    _, backward, counts = _launches(lambda: vjp(sim_gpu(rng.standard_normal(y.shape)), (True, True, True)))
    # mask, bias GEMV (and its ones), data GEMM, col2im, im2col, weight GEMM
    assert backward == 7 and counts["kernel", "luxnn_col2im"] == 1 and counts["cublas"] == 3


FIXED_WINDOWS = ((3, 3), (2, 2), ((1, 1), (1, 1)))
POOLS = {
    "max_pool": FIXED_WINDOWS, "avg_pool": (*FIXED_WINDOWS, False), "adaptive_avg_pool": ((4, 3),),
    "adaptive_max_pool": ((4, 3),),
}  # fmt: skip


@pytest.mark.parametrize("pool", list(POOLS))
def test_a_pool_launches_one_kernel_each_way(pool, sim_gpu):
    x = sim_gpu(np.random.default_rng(0).standard_normal((8, 9, 9, 4)))
    (y, vjp), forward, _ = _launches(lambda: pool_ops._pool.raw(x, kind=pool, config=POOLS[pool]))
    _, backward, _ = _launches(lambda: vjp(y, (True,)))
    assert forward == backward == 1


def test_above_the_budget_the_batch_is_cut_into_as_few_blocks_as_fit(sim_gpu, monkeypatch):
    layer = lx.Conv(3, 4, 6, activation="relu", padding=1, groups=2)
    rng = np.random.default_rng(0)
    ps = lx.tree.map(lambda p: p.astype(np.float64), layer.init_params(rng))
    x = rng.standard_normal((10, 6, 6, 4))
    r = rng.standard_normal((10, 6, 6, 6))
    whole = _output_and_grads(layer, sim_gpu, x, ps, r)
    cols_per_image = 6 * 6 * 3 * 3 * 4 * 8  # float64 column bytes of one image
    monkeypatch.setattr(cuda_conv, "COLUMN_BYTES", 3 * cols_per_image)  # 3 images a block: 4 blocks of 10
    with sim_cupy.counting() as counts:
        blocked = _output_and_grads(layer, sim_gpu, x, ps, r)
    assert counts["kernel", "luxnn_im2col"] == 4 * 3  # forward, its repeat under the gradient, backward
    for (path, want), (_, got) in zip(lx.tree.paths(whole), lx.tree.paths(blocked)):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=path)


def test_more_than_three_spatial_axes_are_refused_on_the_device(sim_gpu):
    x, w = sim_gpu(np.ones((1, 3, 3, 3, 3, 1))), sim_gpu(np.ones((2, 2, 2, 2, 1, 1)))
    with pytest.raises(NotImplementedError, match="1 to 3 spatial axes .* got 4"):
        conv_ops.conv(x, w)
    with pytest.raises(NotImplementedError, match="1 to 3 spatial axes, got 4"):
        pool_ops.max_pool(x, 2)
