"""The CUDA path of the normalisation layers, the fused cross-entropies and the embedding
lookup (`luxnn.ops.cuda.norm`, `.cross_entropy`, `.embedding`) on the simulated CUDA
device of tests/sim_cupy.py, against the CPU path: forward, gradients and new state per
configuration, the launches per call, and bad labels or indices found on the device.

The kernels run here by their NumPy twins; tests/test_gpu_norm.py runs the CUDA sources
on a GPU against those twins.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn.kernels import KERNELS
from luxnn.ops import device_checks
from luxnn.ops.cuda import cross_entropy as cuda_cross_entropy  # noqa: F401 - declares its kernels
from luxnn.ops.cuda import embedding as cuda_embedding  # noqa: F401 - declares its kernels
from luxnn.ops.cuda import norm as cuda_norm  # noqa: F401 - declares its kernels

import cupy_source
import sim_cupy

DTYPES = [np.float32, np.float64]
PREFIXES = ("luxnn_norm_", "luxnn_affine_", "luxnn_scale_shift", "luxnn_frozen_", "luxnn_inverse_std",
            "luxnn_running_update", "luxnn_cross_entropy_", "luxnn_embedding_")


def kernels_here() -> list:
    """The kernels of the modules tested here."""
    return [k for k in KERNELS.values() if k.name.startswith(PREFIXES)]
TOLERANCE = {np.float32: 2e-5, np.float64: 1e-11}


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


def _assert_close(got, want, what, tolerance=TOLERANCE):
    """Equal trees, floating leaves to their dtype's tolerance of their scale."""
    for (path, a), (_, b) in zip(lx.tree.paths(got), lx.tree.paths(want)):
        if isinstance(b, np.ndarray) and b.dtype.kind == "f":
            assert a.dtype == b.dtype and a.shape == b.shape, f"{what} {path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
            tol = tolerance[b.dtype.type] * max(np.abs(b).max(initial=0.0, where=~np.isnan(b)), 1.0)
            np.testing.assert_allclose(a, b, rtol=0, atol=tol, err_msg=f"{what} {path}")
        else:
            assert np.array_equal(a, b), f"{what} {path}"


def _weights(y):
    """A fixed cotangent for y: every element weighed differently."""
    return np.cos(np.arange(y.size) * 0.7).reshape(y.shape).astype(y.dtype)


def _layer_run(device, layer, shape, dtype, train):
    """`layer` on `device`: output, gradients of (weights * output).sum() for (ps, x), and
    the new state, on the host."""
    rng = np.random.default_rng(3)
    ps, st = lx.setup(np.random.default_rng(1), layer)
    ps = lx.tree.map(lambda a: (a + rng.normal(0, 0.3, a.shape)).astype(dtype), ps)  # not ones and zeros
    if "running_mean" in st:
        st = {**st, "running_mean": st["running_mean"] + 0.2, "running_var": st["running_var"] * 1.5}
    if not train:
        st = lx.testmode(st)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dtype)
    ps, st, x = device((ps, st, x))

    def objective(px):
        y, new_st = layer(px[1], px[0], st)
        return (y * device(_weights(y))).sum(), (y, new_st)

    (_, (y, new_st)), grads = lx.value_and_grad(objective, has_aux=True)((ps, x))
    return lx.cpu_device()((y, grads, new_st))


LAYER_CASES = {
    "layernorm": (lambda: lx.LayerNorm(7), (5, 3, 7), True),
    "layernorm_two_axes": (lambda: lx.LayerNorm((3, 7), "relu"), (5, 3, 7), True),
    "layernorm_no_affine_eps": (lambda: lx.LayerNorm(7, affine=False, epsilon=0.1), (5, 7), True),
    "layernorm_batch_1": (lambda: lx.LayerNorm(7), (1, 7), True),
    "layernorm_batch_0": (lambda: lx.LayerNorm(7), (0, 7), True),
    "rmsnorm": (lambda: lx.RMSNorm(7), (5, 3, 7), True),
    "rmsnorm_no_affine_eps": (lambda: lx.RMSNorm(7, affine=False, epsilon=1e-2), (4, 7), True),
    "groupnorm": (lambda: lx.GroupNorm(3, 6, "relu"), (2, 5, 3, 6), True),
    "groupnorm_no_affine_batch_1": (lambda: lx.GroupNorm(2, 6, affine=False), (1, 4, 6), True),
    "instancenorm": (lambda: lx.InstanceNorm(5), (2, 7, 5), True),
    "instancenorm_affine_tracked": (lambda: lx.InstanceNorm(5, affine=True, track_stats=True), (3, 4, 3, 5), True),
    "instancenorm_tracked_eval": (lambda: lx.InstanceNorm(5, affine=True, track_stats=True), (3, 4, 5), False),
    "batchnorm": (lambda: lx.BatchNorm(5), (9, 5), True),
    "batchnorm_images_eps": (lambda: lx.BatchNorm(3, "relu", epsilon=1e-3, momentum=0.3), (2, 5, 3, 3), True),
    "batchnorm_no_affine": (lambda: lx.BatchNorm(5, affine=False), (6, 5), True),
    "batchnorm_batch_1": (lambda: lx.BatchNorm(5), (1, 4, 5), True),
    "batchnorm_untracked": (lambda: lx.BatchNorm(5, track_stats=False), (6, 2, 5), True),
    "batchnorm_eval": (lambda: lx.BatchNorm(5, "relu"), (7, 5), False),
    "batchnorm_no_affine_eval": (lambda: lx.BatchNorm(5, affine=False), (3, 2, 5), False),
    "batchnorm_eval_batch_0": (lambda: lx.BatchNorm(5), (0, 5), False),
    "scale": (lambda: lx.Scale(5), (4, 3, 5), True),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_each_normalisation_computes_on_the_device_what_it_computes_on_the_cpu(name, dtype, sim_gpu):
    make, shape, train = LAYER_CASES[name]
    want = _layer_run(lx.cpu_device(), make(), shape, dtype, train)
    got = _layer_run(sim_gpu, make(), shape, dtype, train)
    _assert_close(got, want, name)


@pytest.mark.parametrize("axis", [(1, 3), (0, 2), -1, ()], ids=["moved_axes", "two_runs", "last", "none"])
def test_normalize_and_moments_over_any_axes_match_the_cpu(axis, sim_gpu):
    x = np.random.default_rng(0).standard_normal((3, 4, 2, 5, 2))

    def run(device):
        xd = device(x)
        y, vjp = lx.ops.normalize.raw(xd, axis=axis, epsilon=1e-5)
        return lx.cpu_device()((y, vjp(device(_weights(x)), (True,))[0], lx.ops.moments(xd, axis)))

    _assert_close(run(sim_gpu), run(lx.cpu_device()), str(axis))


def test_a_layernorm_is_one_launch_forward_and_two_backward(sim_gpu):
    layer = lx.LayerNorm(16)
    ps, st = sim_gpu(lx.setup(np.random.default_rng(0), layer))
    x = sim_gpu(np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32))
    with sim_cupy.counting() as forward:
        y, vjp = lx.ops.normalize_affine.raw(x, ps["scale"], ps["bias"], axis=-1, epsilon=1e-5)
    with sim_cupy.counting() as backward:
        vjp(y, (True, True, True))
    assert (forward["kernel"], forward["fill"]) == (1, 0) and (backward["kernel"], backward["fill"]) == (2, 0)


# -- cross-entropies -------------------------------------------------------------------------

LOSS_CASES = {
    "mean": (lambda: lx.losses.CrossEntropyLoss(), (9, 5)),
    "sum_smoothing": (lambda: lx.losses.CrossEntropyLoss(label_smoothing=0.2, reduction="sum"), (9, 5)),
    "none_sequence": (lambda: lx.losses.CrossEntropyLoss(reduction="none"), (3, 4, 5)),
    "weighted_ignored_smoothed": (
        lambda: lx.losses.CrossEntropyLoss(weight=np.linspace(0.5, 2, 5), ignore_index=-100, label_smoothing=0.1), (9, 5)
    ),
    "one_row": (lambda: lx.losses.CrossEntropyLoss(weight=np.linspace(0.5, 2, 5)), (1, 5)),
    "nll_mean": (lambda: lx.losses.NLLLoss(), (9, 5)),
    "nll_weighted_ignored_sum": (lambda: lx.losses.NLLLoss(weight=np.linspace(0.5, 2, 5), ignore_index=2, reduction="sum"), (9, 5)),
    "nll_none": (lambda: lx.losses.NLLLoss(ignore_index=-100, reduction="none"), (3, 4, 5)),
}


def _loss_run(device, loss, shape, dtype):
    rng = np.random.default_rng(4)
    logits = (rng.standard_normal(shape) * 3).astype(dtype)
    if isinstance(loss, lx.losses.NLLLoss):
        logits = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    labels = rng.integers(0, shape[-1], shape[:-1])
    labels.reshape(-1)[::4] = getattr(loss, "ignore_index", None) or 0
    z, y = device((logits, labels))
    value, grad = lx.value_and_grad(lambda z: (loss(z, y) * device(_weights(loss(z, y)))).sum())(z)
    return lx.cpu_device()((value, grad))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(LOSS_CASES))
def test_each_cross_entropy_computes_on_the_device_what_it_computes_on_the_cpu(name, dtype, sim_gpu):
    make, shape = LOSS_CASES[name]
    _assert_close(_loss_run(sim_gpu, make(), shape, dtype), _loss_run(lx.cpu_device(), make(), shape, dtype), name)


def test_the_cross_entropy_takes_three_launches_forward_one_backward_and_no_host_copy(sim_gpu):
    logits = sim_gpu(np.random.default_rng(0).standard_normal((32, 10)))
    labels = sim_gpu(np.arange(32) % 10)
    device_checks.check_now()  # earlier calls' flags read
    with sim_cupy.counting() as forward:
        loss, vjp = lx.ops.softmax_cross_entropy.raw(logits, labels, 0.1, "mean")
    with sim_cupy.counting() as backward:
        vjp(sim_gpu(np.ones(())), (True, False))
    assert forward["kernel"] + forward["fill"] == 3 and forward["memcpy"] == 0, forward
    assert backward["kernel"] + backward["fill"] == 1, backward


@pytest.mark.parametrize("loss", [lx.losses.CrossEntropyLoss(), lx.losses.NLLLoss(reduction="sum")], ids=["ce", "nll"])
def test_bad_labels_on_the_device_give_nan_then_raise_the_host_checks_error(loss, sim_gpu):
    logits = sim_gpu(np.zeros((4, 5)))
    first = loss(logits, sim_gpu(np.array([0, 7, 9, 1])))
    assert np.isnan(float(first))  # never a finite wrong loss
    with pytest.raises(ValueError, match=rf"^{type(loss).__name__}: labels must lie in \[0, 5\), got 2 outside it \(as high as 9\)"):
        loss(logits, sim_gpu(np.array([0, 1, 2, 3])))
    loss(logits, sim_gpu(np.array([0, -1, 2, 3])))
    with pytest.raises(ValueError, match=r"got 1 outside it \(as low as -1\)"):
        loss(logits, sim_gpu(np.array([0, 1, 2, 3])))
    assert np.isfinite(float(loss(logits, sim_gpu(np.array([0, 1, 2, 3])))))  # reported once; good labels go on


def test_a_mean_over_only_ignored_labels_on_the_device_raises_at_the_next_call(sim_gpu):
    loss = lx.losses.CrossEntropyLoss(ignore_index=-100)
    logits = sim_gpu(np.zeros((2, 3)))
    assert np.isnan(float(loss(logits, sim_gpu(np.array([-100, -100])))))
    with pytest.raises(ValueError, match="no target counts towards the mean"):
        loss(logits, sim_gpu(np.array([0, 1])))


# -- embedding -------------------------------------------------------------------------------


@pytest.mark.parametrize("rows", [7, 1500])  # more rows than the scatter-add's blocks
def test_the_embedding_lookup_and_its_gradient_match_the_cpu_in_one_launch_each(rows, sim_gpu):
    rng = np.random.default_rng(0)
    table, indices = rng.standard_normal((rows, 6)), rng.integers(0, 5, (4, 9))  # repeated indices
    indices[0, 0] = rows - 1

    def run(device):
        t, i = device((table, indices))
        with sim_cupy.counting() as forward:
            y, vjp = lx.ops.lookup_rows.raw(t, i)
        with sim_cupy.counting() as backward:
            g = vjp(device(_weights(y)), (True, False))[0]
        return lx.cpu_device()((y, g)), forward, backward

    (got, forward, backward), (want, _, _) = run(sim_gpu), run(lx.cpu_device())
    _assert_close(got, want, "embedding")
    assert forward["kernel"] == 1 and forward["memcpy"] <= 1 and backward["kernel"] == 1 and backward["fill"] == 0


def test_embedding_indices_out_of_range_on_the_device_give_nan_then_raise_the_layers_error(sim_gpu):
    layer = lx.Embedding(10, 4)
    ps, st = sim_gpu(lx.setup(np.random.default_rng(0), layer))
    y, _ = layer(sim_gpu(np.array([[1, 12], [3, 4]])), ps, st)
    assert np.isnan(y.get()[0, 1]).all() and not np.isnan(y.get()[1]).any()
    with pytest.raises(lx.LayerError, match=r"^Embedding\(10 => 4\): expected indices in \[0, 10\), got 1 outside it \(as high as 12\)"):
        layer(sim_gpu(np.array([1, 2])), ps, st)
    device_checks.check_now()  # nothing left


@pytest.mark.skipif(cupy_source.nvcc() is None, reason="needs nvcc (the CUDA toolkit) to compile the kernels' CUDA sources")
def test_these_kernels_cuda_sources_compile_as_cupy_would_compile_them():
    mine = kernels_here()
    assert len(mine) == 19 and cupy_source.compile_errors(mine, cupy_source.nvcc()) == {}


def test_a_strided_class_weight_on_the_device_weighs_each_class_as_on_the_cpu(sim_gpu):
    rng = np.random.default_rng(5)
    logits, labels, every_other = rng.standard_normal((6, 4)), np.array([0, 1, 2, 3, 1, 2]), np.linspace(0.5, 4, 8)

    def run(device):
        z, y, w = device((logits, labels, every_other))
        return lx.cpu_device()(lx.ops.softmax_cross_entropy(z, y, reduction="none", weight=w[::2]))

    _assert_close(run(sim_gpu), run(lx.cpu_device()), "strided weight")


def test_the_embedding_gradient_on_the_device_skips_indices_out_of_range_as_its_kernel(sim_gpu):
    table, indices = np.arange(12.0).reshape(4, 3), np.array([1, -1, 4, 1, 3])
    t, i = sim_gpu((table, indices))
    _, vjp = lx.ops.lookup_rows.raw(t, i)
    g = vjp(sim_gpu(np.ones((5, 3))), (True, False))[0].get()
    np.testing.assert_array_equal(g, [[0, 0, 0], [2, 2, 2], [0, 0, 0], [1, 1, 1]])  # -1 and 4 add nowhere
    with pytest.raises(IndexError, match="got 2 outside it"):
        device_checks.check_now()
