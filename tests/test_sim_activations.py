"""The CUDA kernels of the activations, the softmax family, the dense layer and attention
(ops/cuda/activations.py, softmax.py, dense.py, attention.py): on the simulated device of
tests/sim_cupy.py against the CPU path (values and gradients, float32 and float64, odd
and empty shapes, extreme values, NaN), with the launches each makes; on a GPU (skipped
without one) each kernel against the CPU's code, its NumPy twin. (tests/test_kernels.py
compiles their CUDA sources.)
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn import ops
from luxnn.ad import primitives as P
from luxnn.ad.tape import Tape
from luxnn.ops.cpu import activations as cpu_activations
from luxnn.ops.attention import attention_combine, attention_weights

import sim_cupy

DTYPES = [np.float32, np.float64]

# Kernel name -> the primitive, with parameters other than the defaults where it has them.
ACTIVATIONS = {
    "relu": ops.relu,
    "leaky_relu": lambda x: ops.leaky_relu(x, negative_slope=0.2),
    "elu": lambda x: ops.elu(x, alpha=0.7),
    "sigmoid": ops.sigmoid,
    "tanh": P.tanh,
    "silu": ops.silu,
    "softplus": ops.softplus,
    "gelu_tanh": ops.gelu,
    "gelu_erf": lambda x: ops.gelu(x, approximate="none"),
}
SHAPES = [(3, 7), (2, 3, 5), (1,), (0, 5)]
EXTREMES = [0.0, -0.0, 1e-8, 40.0, -40.0, 1e4, -1e4, np.inf, -np.inf, np.nan]


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


def _values(shape, dtype, seed=0):
    """Normal values times 3, the first ones replaced by `EXTREMES`."""
    x = np.random.default_rng(seed).standard_normal(shape) * 3
    flat = x.reshape(-1)
    n = min(flat.size, len(EXTREMES))
    flat[:n] = EXTREMES[:n]
    return x.astype(dtype)


def _forward_and_grad(fn, args, g, device):
    """``fn(*args)`` on `device` and its cotangents for `g`, on the host, with the
    launches of the forward and of the backward pass."""
    tape = Tape()
    leaves = [tape.leaf(device(a)) for a in args]
    with sim_cupy.counting() as forward:
        out = fn(*leaves)
    with sim_cupy.counting() as backward:
        grads = tape.backward(out, device(g))
    host = lx.cpu_device()
    return host(out.value), [host(grads[leaf.index]) for leaf in leaves], forward, backward


def _launches(counts):
    return sum(counts[kind] for kind in ("kernel", "fill", "cublas"))


def _both(fn, args, g, sim_gpu):
    with np.errstate(all="ignore"):
        cpu_result = _forward_and_grad(fn, args, g, lx.cpu_device())
        gpu_result = _forward_and_grad(fn, args, g, sim_gpu)
    return cpu_result, gpu_result


# -- activations -----------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_each_activation_is_one_kernel_each_way_and_computes_as_the_cpu(name, dtype, shape, sim_gpu):
    x, g = _values(shape, dtype), _values(shape, dtype, seed=1)[::-1].copy()
    (y, (gx,), _, _), (y_gpu, (gx_gpu,), forward, backward) = _both(ACTIVATIONS[name], [x], g, sim_gpu)
    assert y_gpu.dtype == y.dtype == dtype and gx_gpu.dtype == dtype
    np.testing.assert_array_equal(y_gpu, y)  # NaN where the CPU has NaN
    np.testing.assert_array_equal(gx_gpu, gx)
    assert _launches(forward) == forward["kernel", f"luxnn_{name}"] == 1
    assert _launches(backward) == backward["kernel", f"luxnn_{name}_grad"] == 1


def test_an_activation_of_integers_computes_in_numpys_promotion(sim_gpu):
    x = np.arange(-3, 4, dtype=np.int32)
    y = ops.sigmoid(sim_gpu(x))
    assert y.dtype == ops.sigmoid(x).dtype == np.float64
    np.testing.assert_allclose(y.get(), ops.sigmoid(x))


HALF_CASES = {
    "silu": ops.silu, "gelu": ops.gelu, "relu": ops.relu, "softmax": ops.softmax, "log_softmax": ops.log_softmax,
    "logsumexp": ops.logsumexp, "dense_gelu": lambda x: ops.dense(x, x.T[:, :3] * 0.5, x[0, :3], activation=ops.gelu),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HALF_CASES))
def test_float16_is_computed_in_float32_and_kept_in_float16_forward_and_backward(name, sim_gpu):
    f, x = HALF_CASES[name], np.random.default_rng(0).standard_normal((4, 5)).astype(np.float16)
    g = np.random.default_rng(1).standard_normal(np.shape(f(x))).astype(np.float16)
    (y, (gx,), _, _), (y_gpu, (gx_gpu,), _, _) = _both(f, [x], g, sim_gpu)
    assert y.dtype == y_gpu.dtype == gx.dtype == gx_gpu.dtype == np.float16
    # The CPU computes in float16 throughout, the kernels in float32: a few float16 roundings apart.
    for got, want in ((y_gpu, y), (gx_gpu, gx)):
        np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=1e-2, atol=1e-2)


def test_a_cotangent_of_another_dtype_is_promoted_as_on_the_cpu(sim_gpu):
    x, g = _values((4, 5), np.float32), _values((4, 5), np.float64, seed=3)
    (_, (gx,), _, _), (_, (gx_gpu,), _, _) = _both(ops.sigmoid, [x], g, sim_gpu)
    assert gx.dtype == gx_gpu.dtype == np.float64
    np.testing.assert_allclose(gx_gpu, gx, rtol=1e-6)


# -- the softmax family ------------------------------------------------------------------------

SOFTMAX_CASES = {
    "softmax_last": (lambda x: ops.softmax(x), (5, 7)),
    "softmax_first": (lambda x: ops.softmax(x, axis=0), (5, 3)),
    "softmax_middle": (lambda x: ops.softmax(x, axis=1), (2, 5, 3)),
    "log_softmax_last": (lambda x: ops.log_softmax(x), (5, 7)),
    "log_softmax_middle": (lambda x: ops.log_softmax(x, axis=-2), (2, 5, 3)),
    "logsumexp_last": (lambda x: ops.logsumexp(x), (5, 7)),
    "logsumexp_first_kept": (lambda x: ops.logsumexp(x, axis=0, keepdims=True), (5, 3)),
    "masked_softmax": (lambda x: ops.masked_softmax(x, scale=0.5, mask=_beside(x, MASK)), (2, 4, 6)),
    "masked_softmax_causal": (lambda x: ops.masked_softmax(x, mask=_beside(x, MASK), is_causal=True), (2, 4, 6)),
    "causal_softmax": (lambda x: ops.masked_softmax(x, scale=2.0, is_causal=True), (2, 4, 6)),
    "scaled_softmax": (lambda x: ops.masked_softmax(x, scale=0.3), (5, 33)),
}
MASK = np.random.default_rng(5).random((4, 6)) < 0.6
MASK[2] = False  # a query that may see no key: zero weights


def _beside(x, a):
    """The NumPy array `a` on the device of `x` (a traced value or an array)."""
    return lx.get_device(getattr(x, "value", x))(a)


def _rows_with_extremes(shape, dtype):
    """Normal values times 3 where, along the last axis, row 0 holds +inf, row 1 is all
    -inf, row 2 holds NaN and row 3 is a thousand times larger."""
    x = np.random.default_rng(0).standard_normal(shape) * 3
    rows = x.reshape(-1, shape[-1])
    rows[0, 1] = np.inf
    rows[1] = -np.inf
    rows[2, 0] = np.nan
    rows[3] *= 1e3
    return x.astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_the_softmax_family_is_one_row_kernel_each_way_and_computes_as_the_cpu(case, dtype, sim_gpu):
    fn, shape = SOFTMAX_CASES[case]
    x = _rows_with_extremes(shape, dtype)
    with np.errstate(all="ignore"):
        g = np.random.default_rng(1).standard_normal(np.shape(fn(x))).astype(dtype)
    (y, (gx,), _, _), (y_gpu, (gx_gpu,), forward, backward) = _both(fn, [x], g, sim_gpu)
    assert y_gpu.dtype == y.dtype == dtype and y_gpu.shape == y.shape
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y_gpu, y, rtol=rtol, atol=0)
    np.testing.assert_allclose(gx_gpu, gx, rtol=rtol, atol=0)
    assert _launches(forward) == 1 and _launches(backward) == 1, (forward, backward)


@pytest.mark.parametrize("mask_shape, copied", [
    ((6,), False), ((2, 1, 1, 6), False), ((1, 3, 4, 1), False), ((4, 6), False), ("transposed", False),
    ((2, 1, 2, 1, 4, 6), True),  # five leading axes that do not merge into three: copied
], ids=str)
def test_a_mask_is_read_where_it_lies_broadcast_or_strided(mask_shape, copied, sim_gpu):
    rng = np.random.default_rng(4)
    scores_shape = (2, 2, 2, 3, 4, 6) if copied else (2, 3, 4, 6)
    mask = rng.random((6, 4)).T < 0.6 if mask_shape == "transposed" else rng.random(mask_shape) < 0.6
    scores = rng.standard_normal(scores_shape)
    want = ops.masked_softmax(scores, scale=0.7, mask=mask, is_causal=True)
    on_device = sim_gpu(mask.T).T if mask_shape == "transposed" else sim_gpu(mask)  # strides (1, 4)
    with sim_cupy.counting() as counts:
        got = ops.masked_softmax(sim_gpu(scores), scale=0.7, mask=on_device, is_causal=True)
    np.testing.assert_allclose(got.get(), want, rtol=1e-12, atol=0)
    assert _launches(counts) == 1 + copied


def test_fully_masked_rows_are_zeros_and_unmasked_inf_rows_nan_as_on_the_cpu(sim_gpu):
    x = np.zeros((3, 4))
    x[1] = -np.inf
    mask = np.ones((3, 4), bool)
    mask[0] = False
    with np.errstate(all="ignore"):
        masked = ops.masked_softmax(sim_gpu(x), mask=sim_gpu(mask)).get()
        plain = ops.softmax(sim_gpu(x)).get()
    np.testing.assert_array_equal(masked, [[0] * 4, [0] * 4, [0.25] * 4])  # -inf scores: no key
    assert np.isnan(plain[1]).all() and (plain[[0, 2]] == 0.25).all()


def test_several_axes_and_empty_inputs_compute_as_the_cpu(sim_gpu):
    x = _values((3, 4, 5), np.float64)[..., ::-1]  # not contiguous either
    for fn in (lambda x: ops.logsumexp(x, axis=(0, 2)), lambda x: ops.softmax(x, axis=None),
               lambda x: ops.log_softmax(x, axis=(1, 2))):
        with np.errstate(all="ignore"):
            np.testing.assert_allclose(fn(sim_gpu(x)).get(), fn(x), rtol=1e-12)
    empty = np.zeros((0, 4))
    assert ops.softmax(sim_gpu(empty)).shape == (0, 4) and ops.logsumexp(sim_gpu(empty)).shape == (0,)
    for device in (lx.cpu_device(), sim_gpu):
        with pytest.raises(ValueError, match="zero-size array"):
            ops.softmax(device(np.zeros((3, 0))))
        with pytest.raises(np.exceptions.AxisError, match="axis 2 is out of bounds for array of dimension 2"):
            ops.log_softmax(device(np.zeros((3, 4))), axis=2)


# -- dense ---------------------------------------------------------------------------------------

DENSE_ACTIVATIONS = {"none": None, "relu": ops.relu, "gelu": ops.gelu, "tanh": P.tanh, "sigmoid": ops.sigmoid,
                     "silu": ops.silu, "softplus": ops.softplus, "elu": ops.elu, "leaky_relu": ops.leaky_relu}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("act", list(DENSE_ACTIVATIONS))
def test_dense_is_a_gemm_and_one_kernel_forward_and_computes_as_the_cpu(act, dtype, bias, sim_gpu):
    rng = np.random.default_rng(2)
    x, w, b = (rng.standard_normal(s).astype(dtype) for s in ((2, 3, 5), (5, 7), (7,)))
    g = rng.standard_normal((2, 3, 7)).astype(dtype)
    activation = DENSE_ACTIVATIONS[act]
    args = [x, w, b] if bias else [x, w]
    fn = lambda x, w, b=None: ops.dense(x, w, b, activation=activation)  # noqa: E731
    (y, grads, _, _), (y_gpu, grads_gpu, forward, backward) = _both(fn, args, g, sim_gpu)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(y_gpu, y, rtol=rtol, atol=rtol)
    for got, want in zip(grads_gpu, grads):
        assert got.dtype == dtype
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    passes = int(bias or activation is not None)
    assert forward["cublas"] == 1 and _launches(forward) == 1 + passes
    # The activation's gradient, the bias's sum, then dx and dW.
    assert backward["cublas"] == 2 and _launches(backward) == 2 + (activation is not None) + bias, backward


def test_dense_with_another_callable_applies_it_after(sim_gpu):
    x, w, b = np.ones((4, 3)), np.full((3, 2), 0.5), np.array([-1.0, 2.0])
    for device in (lx.cpu_device(), sim_gpu):
        y = lx.cpu_device()(ops.dense(device(x), device(w), device(b), activation=lambda y: y * 3))
        np.testing.assert_array_equal(y, [[1.5, 10.5]] * 4)


def test_an_empty_batch_goes_through_dense(sim_gpu):
    x, w, b = np.zeros((0, 5)), np.ones((5, 3)), np.ones(3)
    (y, grads, _, _), (y_gpu, grads_gpu, _, _) = _both(lambda x, w, b: ops.dense(x, w, b, activation=ops.gelu),
                                                       [x, w, b], np.zeros((0, 3)), sim_gpu)
    assert y_gpu.shape == (0, 3) and [g.shape for g in grads_gpu] == [(0, 5), (5, 3), (3,)]
    for got, want in zip(grads_gpu, grads):
        np.testing.assert_array_equal(got, want)


# -- attention -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("heads", [1, 3])
def test_attention_is_batched_gemms_and_the_row_kernel(heads, dtype, sim_gpu):
    rng = np.random.default_rng(heads)
    q, k, v = (rng.standard_normal((2, n, 2 * heads)).astype(dtype) for n in (4, 5, 5))
    mask = rng.random((1, 1, 4, 5)) < 0.7
    gw, gout = rng.standard_normal((2, heads, 4, 5)).astype(dtype), rng.standard_normal((2, 4, 2 * heads)).astype(dtype)

    def weights(q, k):
        return attention_weights(q, k, num_heads=heads, scale=0.4, mask=_beside(q, mask), is_causal=True)

    rtol = 1e-5 if dtype == np.float32 else 1e-12
    (w, gqk, _, _), (w_gpu, gqk_gpu, forward, backward) = _both(weights, [q, k], gw, sim_gpu)
    np.testing.assert_allclose(w_gpu, w, rtol=rtol, atol=rtol)
    for got, want in zip(gqk_gpu, gqk):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    # q scaled and k laid out by head, one GEMM and the softmax (the mask read where it is);
    # back: the softmax's gradient, a GEMM and a merge of the heads for each of q and k, q by
    # head again. (With one head, laying out by head or merging is a view.)
    copies = 1 if heads > 1 else 0
    assert (_launches(forward), forward["cublas"]) == (3 + copies, 1)
    assert (_launches(backward), backward["cublas"]) == (3 + 3 * copies, 2)

    combine = lambda w, v: attention_combine(w, v, num_heads=heads)  # noqa: E731
    (out, gwv, _, _), (out_gpu, gwv_gpu, forward, backward) = _both(combine, [w, v], gout, sim_gpu)
    np.testing.assert_allclose(out_gpu, out, rtol=rtol, atol=rtol)
    for got, want in zip(gwv_gpu, gwv):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol)
    assert (_launches(forward), forward["cublas"]) == (1 + 2 * copies, 1)  # v by head, the GEMM, the merge
    assert (_launches(backward), backward["cublas"]) == (2 + 2 * copies, 2)  # g by head, two GEMMs, a merge


# -- each kernel on a GPU against its twin (tests taking `gpu` skip without one) ---------------


TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}  # of the largest magnitude expected (issue 26's)


def _close(got, want, dtype):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(got[np.isinf(want)], want[np.isinf(want)])
    finite = np.isfinite(want)
    scale = max(float(np.max(np.abs(want[finite]), initial=0.0)), 1e-30)
    assert np.max(np.abs(got[finite] - want[finite]), initial=0.0) <= TOLERANCE[dtype] * scale


@pytest.mark.parametrize("shape", [(257, 33), (2, 3, 1029), (0, 4)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation_kernels_on_the_gpu_match_the_cpu(name, dtype, shape, gpu):
    import cupy

    from luxnn.ops.cuda import activations as on_gpu
    from luxnn.ops.cuda import dense as dense_on_gpu

    x, g = _values(shape, dtype), _values(shape, dtype, seed=1)
    with np.errstate(all="ignore"):
        y, saved = getattr(on_gpu, name)(cupy.asarray(x))
        _close(y.get(), getattr(cpu_activations, name)(x)[0], dtype)
        residual = on_gpu.cpu_residual(name, saved.get())
        _close(getattr(on_gpu, f"{name}_grad")(cupy.asarray(g), saved).get(), getattr(cpu_activations, f"{name}_grad")(g, residual), dtype)
        rows = x.reshape(-1, shape[-1])
        b = _values(shape[-1:], dtype, seed=2)
        fused, _ = dense_on_gpu.bias_activation(cupy.asarray(rows), cupy.asarray(b), name)
        _close(fused.get(), getattr(cpu_activations, name)(rows + b)[0], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(SOFTMAX_CASES))
def test_row_kernels_on_the_gpu_match_the_cpu(case, dtype, gpu):
    fn, shape = SOFTMAX_CASES[case]
    for size in (shape, shape[:-1] + (1500,)):  # rows longer than a block of threads
        if "mask" in case and size != shape:
            continue
        x = _rows_with_extremes(size, dtype)
        with np.errstate(all="ignore"):
            g = np.random.default_rng(1).standard_normal(np.shape(fn(x))).astype(dtype)
            (y, (gx,), _, _) = _forward_and_grad(fn, [x], g, lx.cpu_device())
            (y_gpu, (gx_gpu,), _, _) = _forward_and_grad(fn, [x], g, gpu)
        _close(y_gpu, y, dtype)
        _close(gx_gpu, gx, dtype)


def test_a_float16_dense_layer_with_a_float32_bias_stays_float16_as_on_the_cpu(sim_gpu):
    x, w, b = np.ones((2, 3), np.float16), np.ones((3, 4), np.float16), np.full(4, 0.5, np.float32)
    for activation in (None, ops.relu, ops.gelu):
        want = ops.dense(x, w, b, activation=activation)
        got = ops.dense(sim_gpu(x), sim_gpu(w), sim_gpu(b), activation=activation)
        assert want.dtype == got.dtype == np.float16
        np.testing.assert_allclose(got.get(), want, rtol=1e-3)
