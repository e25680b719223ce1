"""The recurrent layers' CUDA path (luxnn.ops.cuda.recurrent): on the simulated device of
tests/sim_cupy.py against the CPU path, forward and gradients, with its launches per time
step counted; and on a real GPU (skipped without one, with the reason), each of its CUDA
kernels against its NumPy twin and the layers against the CPU path.
"""

from __future__ import annotations

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.cuda import recurrent as cuda_recurrent

import sim_cupy
from test_gpu import needs_gpu
from test_sim_gpu import _device_cache, _train, sim_gpu  # noqa: F401 (sim_gpu: a fixture)

KINDS = ["lstm", "gru", "rnn_tanh", "rnn_relu"]


@pytest.fixture(params=["simulated", pytest.param("gpu", marks=needs_gpu)])
def device(request):
    """The simulated CUDA device, and a real GPU where there is one."""
    if request.param == "gpu":
        return lx.gpu_device(force=True)
    return request.getfixturevalue("sim_gpu")


def make_stack(kind, in_dims, hidden, **options):
    if kind.startswith("rnn"):
        return lx.RNN(in_dims, hidden, activation=kind.split("_")[1], **options)
    return {"lstm": lx.LSTM, "gru": lx.GRU}[kind](in_dims, hidden, **options)


def loss_and_grads(model, ps, x, start, weights):
    """``sum(y * w) + sum(carry * w)`` of the stack and its gradients with respect to
    (ps, x, start); `start` None: the stack starts from zeros."""
    st = lx.setup(np.random.default_rng(0), model)[1]

    def loss(ps, x, start):
        y, carry = model(x if start is None else (x, start), ps, st)[0]
        parts = [y, *lx.tree.leaves(carry)]
        return sum((p * w).sum() for p, w in zip(parts, weights, strict=True))

    return lx.value_and_grad(loss, argnums=(0, 1, 2) if start is not None else (0, 1))(ps, x, start)


# (bidirectional, num_layers, batch, seq, dtype, start given, return_sequence)
CONFIGS = [
    (False, 1, 1, 1, np.float64, True, True),
    (True, 2, 5, 4, np.float64, False, True),
    (True, 1, 3, 3, np.float64, True, False),
    (False, 2, 5, 3, np.float32, True, False),
    (True, 2, 0, 3, np.float32, True, True),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "bi{}-layers{}-batch{}-seq{}-{}-start{}-seq_out{}".format(
    c[0], c[1], c[2], c[3], np.dtype(c[4]).name, c[5], c[6]))
@pytest.mark.parametrize("kind", KINDS)
def test_stacks_on_the_device_match_the_cpu_path(kind, config, device):
    bidirectional, layers, batch, seq, dtype, with_start, return_sequence = config
    in_dims, hidden = 3, 4
    model = make_stack(kind, in_dims, hidden, num_layers=layers, bidirectional=bidirectional,
                       return_sequence=return_sequence, return_carry=True)
    rng = np.random.default_rng(10 * CONFIGS.index(config) + KINDS.index(kind))
    ps = lx.tree.map(lambda a: a.astype(dtype), lx.setup(np.random.default_rng(1), model)[0])
    x = rng.normal(size=(batch, seq, in_dims)).astype(dtype)
    carries = layers * (2 if bidirectional else 1)
    start = None
    if with_start:
        parts = [rng.normal(size=(carries, batch, hidden)).astype(dtype) for _ in range(2 if kind == "lstm" else 1)]
        start = tuple(parts) if kind == "lstm" else parts[0]
    y, carry = model(x if start is None else (x, start), ps, lx.setup(np.random.default_rng(0), model)[1])[0]
    weights = [rng.normal(size=p.shape).astype(dtype) for p in (y, *lx.tree.leaves(carry))]
    want_value, want_grads = loss_and_grads(model, ps, x, start, weights)
    got_value, got_grads = loss_and_grads(model, *device((ps, x, start, weights)))
    rtol = 1e-9 if dtype == np.float64 else 1e-4
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=rtol, atol=rtol)
    for (path, want), (_, got) in zip(lx.tree.paths(want_grads), lx.tree.paths(lx.cpu_device()(got_grads)), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, path
        np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * max(1.0, float(np.abs(want).max(initial=0))), err_msg=path)


@pytest.mark.parametrize("kind", KINDS)
def test_cells_without_bias_and_with_a_trainable_initial_carry_match_the_cpu_path(kind, sim_gpu):
    """No biases (the LSTM's b and the GRU's b_hh None) and the initial carry a parameter
    broadcast over the batch, in both directions."""
    def cell():
        if kind.startswith("rnn"):
            return lx.RNNCell(3, 4, kind.split("_")[1], use_bias=False, init_carry="trainable")
        return {"lstm": lx.LSTMCell, "gru": lx.GRUCell}[kind](3, 4, use_bias=False, init_carry="trainable")

    model = lx.Bidirectional(cell(), cell())
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = lx.tree.map(lambda a: a + np.float32(0.3), ps)  # initial carries away from zero
    x = np.random.default_rng(1).normal(size=(3, 5, 3))
    weights = np.random.default_rng(2).normal(size=(3, 5, 8))

    def value_and_grads(ps, x, st, weights):
        return lx.value_and_grad(lambda p: (model(x, p, st)[0] * weights).sum())(lx.tree.map(lambda a: a.astype(np.float64), ps))

    want_value, want = value_and_grads(ps, x, st, weights)
    got_value, got = value_and_grads(*sim_gpu((ps, x, st, weights)))
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=1e-10)
    for (path, a), (_, b) in zip(lx.tree.paths(lx.cpu_device()(got)), lx.tree.paths(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-9, atol=1e-12, err_msg=path)


@pytest.mark.parametrize("kind", KINDS)
def test_float16_stacks_compute_in_float32_on_the_device(kind, device):
    """float16 parameters and inputs: float16 outputs and gradients, within float16's
    rounding of the CPU path's float32 results (the device's gates and GEMMs run in float32)."""
    model = make_stack(kind, 3, 4, bidirectional=True)
    ps32, st = lx.setup(np.random.default_rng(0), model)
    x32 = np.random.default_rng(1).normal(size=(2, 6, 3)).astype(np.float32)
    ps16, x16 = lx.tree.map(lambda a: a.astype(np.float16), ps32), x32.astype(np.float16)

    def run(ps, x, st):
        return lx.value_and_grad(lambda p, x: (model(x, p, st)[0] ** 2).sum(), argnums=(0, 1))(ps, x)

    want_value, want = run(*lx.tree.map(lambda a: a.astype(np.float32), (ps16, x16)), st)
    got_value, got = run(*device((ps16, x16, st)))
    assert abs(float(got_value) - float(want_value)) <= 1e-2 * abs(float(want_value))
    for a, b in zip(lx.tree.leaves(lx.cpu_device()(got)), lx.tree.leaves(want), strict=True):
        assert a.dtype == np.float16
        assert np.abs(a.astype(np.float32) - b).max() <= 1e-2 * max(1.0, float(np.abs(b).max()))


@pytest.mark.parametrize("kind", KINDS)
def test_padded_sequences_on_the_device_match_the_cpu_path(kind, sim_gpu):
    model = make_stack(kind, 3, 4, bidirectional=True, return_carry=True)
    ps, st = lx.setup(np.random.default_rng(1), model)
    x = lx.Padded(np.random.default_rng(2).normal(size=(3, 5, 3)).astype(np.float32), np.array([5, 2, 4]))
    (want, want_carry), _ = model(x, ps, st)
    (got, got_carry), _ = model(sim_gpu(x), sim_gpu(ps), sim_gpu(st))
    for a, b in zip(lx.tree.leaves((want.x, want_carry)), lx.tree.leaves(lx.cpu_device()((got.x, got_carry))), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)


def test_primitives_refuse_arrays_of_two_devices(sim_gpu):
    from luxnn.ops.recurrent import gru_sequence, lstm_sequence, rnn_sequence

    with pytest.raises(TypeError, match="^rnn_sequence: expected the arrays on one device, got CPU and CUDA arrays"):
        rnn_sequence(sim_gpu(np.ones((3, 2, 2))), sim_gpu(np.ones((2, 2))), np.ones((2, 2)))
    with pytest.raises(TypeError, match="^lstm_sequence: expected the arrays on one device"):
        lstm_sequence(np.ones((2, 3, 4)), np.ones((4, 8)), None, np.ones((2, 8)), sim_gpu(np.ones((2, 2))), np.ones((2, 2)))
    with pytest.raises(TypeError, match="^gru_sequence: expected the arrays on one device"):
        gru_sequence(np.ones((3, 2, 6)), np.ones((2, 6)), sim_gpu(np.ones(6)), np.ones((2, 2)))


def _launches(model, x, sim_gpu):
    """Launches (kernels, fills, cuBLAS calls) of one gradient of ``sum(model(x))``."""
    ps, st = sim_gpu(lx.setup(np.random.default_rng(1), model))
    x = sim_gpu(x)
    with sim_cupy.counting() as counts:
        lx.grad(lambda p: model(x, p, st)[0].sum())(ps)
    return sum(counts[k] for k in ("kernel", "fill", "cublas")), counts


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bidirectional, layers", [(False, 1), (True, 2)])
def test_each_time_step_costs_one_gemm_and_one_fused_kernel_each_way(kind, bidirectional, layers, sim_gpu):
    """One more time step adds, for each direction of each layer, the step's GEMM and gate
    kernel forward and its gate-gradient kernel and GEMM backward: 4 launches, whatever
    the host's threads."""
    model = make_stack(kind, 3, 8, num_layers=layers, bidirectional=bidirectional)
    rng = np.random.default_rng(0)
    short, short_counts = _launches(model, rng.normal(size=(16, 5, 3)).astype(np.float32), sim_gpu)
    long, long_counts = _launches(model, rng.normal(size=(16, 6, 3)).astype(np.float32), sim_gpu)
    runs = layers * (2 if bidirectional else 1)
    assert long - short == 4 * runs
    cell = "luxnn_" + kind.split("_")[0] + "_cell"
    assert long_counts["kernel", cell] - short_counts["kernel", cell] == runs
    assert long_counts["kernel", cell + "_backward"] == 6 * runs


def test_the_bench_lstm_step_stays_within_the_launch_budget(sim_gpu):
    """An LSTM of 64 hidden units over 64 steps and a Dense classifier (the bench's model,
    smaller), one Adam training step: at most 4 launches per time step and 60 others."""
    def make():
        return lx.Chain(lx.Recurrence(lx.LSTMCell(8, 64)), lx.Dense(64, 5)), (16, 64, 8)

    launches = _train(make, sim_gpu, _device_cache(), steps=2)[3]
    assert launches[-1] <= 4 * 64 + 60, launches


# -- on a real GPU: each kernel against its NumPy twin ----------------------------------------


def _kernel_cases(rng, batch, H, dtype):
    """Each kernel's arguments (inputs, then outputs): a raw input a column slice of a wider
    array (rows strided), a carry broadcast from one row, and zeros broadcast from a scalar."""

    def normal(*shape):
        return rng.normal(size=shape).astype(dtype)

    def strided(width):
        return normal(batch, width + 3)[:, 1 : width + 1]

    carry = np.broadcast_to(normal(1, H), (batch, H))
    zero = np.zeros((), dtype)
    relu = bool(rng.integers(2))
    empty = lambda *shape: np.empty(shape, dtype)  # noqa: E731
    return {
        "luxnn_lstm_cell": [strided(4 * H), carry, normal(batch, 4 * H), empty(batch, H), empty(batch, H), empty(batch, H)],
        "luxnn_lstm_cell_backward": [normal(batch, 4 * H), carry, normal(batch, H), normal(batch, H), zero, normal(batch, H),
                                     normal(batch, H), empty(batch, 4 * H), empty(batch, H)],
        "luxnn_gru_cell": [strided(3 * H), normal(3 * H), normal(batch, H), normal(batch, 3 * H), empty(batch, 3 * H),
                           empty(batch, H)],
        "luxnn_gru_cell_backward": [normal(batch, 3 * H), strided(3 * H), normal(batch, H), normal(batch, H), normal(batch, H), zero,
                                    empty(batch, 3 * H), empty(batch, 3 * H), empty(batch, H)],
        "luxnn_rnn_cell": [carry, relu, normal(batch, H)],
        "luxnn_rnn_cell_backward": [np.tanh(normal(batch, H)), normal(batch, H), zero, relu, empty(batch, H)],
    }


KERNELS = {k.name: k for k in vars(cuda_recurrent).values() if isinstance(k, lx.kernels.Elementwise)}


def test_every_kernel_of_the_module_has_a_case():
    assert sorted(KERNELS) == sorted(_kernel_cases(np.random.default_rng(0), 1, 1, np.float64))


def _on_device(a):
    """A CuPy array laid out as `a` (strides and broadcasts kept), or `a` itself (scalars)."""
    import cupy

    if not isinstance(a, np.ndarray):
        return a
    if a.ndim and 0 in a.strides:  # a broadcast: of its first row
        return cupy.broadcast_to(cupy.asarray(a[:1]), a.shape)
    if a.ndim == 2 and not a.flags.c_contiguous:  # a column slice: of a wider array
        wide = cupy.zeros((a.shape[0], a.shape[1] + 3), a.dtype)
        wide[:, 1 : a.shape[1] + 1] = cupy.asarray(a)
        return wide[:, 1 : a.shape[1] + 1]
    return cupy.asarray(a)


@needs_gpu
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("batch, H", [(0, 3), (1, 1), (7, 5), (64, 129)])
@pytest.mark.parametrize("name", sorted(KERNELS))
def test_each_cuda_kernel_computes_what_its_twin_does(name, batch, H, dtype):
    kernel = KERNELS[name]
    args = _kernel_cases(np.random.default_rng(batch * 1000 + H), batch, H, dtype)[name]
    outputs = len(kernel.out_params.split(","))
    on_host = [a.copy() if isinstance(a, np.ndarray) and a.flags.writeable else a for a in args]
    on_device = [_on_device(a) for a in args]
    kernel.twin(*on_host)
    kernel(*on_device)
    tolerance = {np.float32: 1e-4, np.float64: 1e-10}[dtype]
    for k in range(len(args) - outputs, len(args)):
        want, got = on_host[k], on_device[k].get()
        scale = max(1.0, float(np.abs(want).max(initial=0)))
        assert got.dtype == want.dtype and np.abs(got - want).max(initial=0) <= tolerance * scale, (name, k)
