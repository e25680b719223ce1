"""The optimisers' fused GPU updates (`KernelUpdate`): Adam's and momentum's (`trace`, SGD)
whole update of a leaf in one CUDA kernel, on the simulated device of tests/sim_cupy.py (the kernel run by its NumPy
twin, launches counted) against the CPU path, and on a real GPU when one is present.

What the simulator cannot tell: whether the CUDA source computes what its twin does (the
`gpu` tests below, skipped without a GPU).
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory, optim

import sim_cupy
from test_memory_cuda import FakeDriver

LEAF_SHAPES = [(3, 4), (4,), (), (2, 3, 2, 2), (7, 5)]  # matrices, vectors, a 0-d leaf, a 4-d kernel


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


def _tree(rng, dtype, shapes=LEAF_SHAPES):
    return {f"w{i}": np.asarray(rng.standard_normal(shape), dtype) for i, shape in enumerate(shapes)}


def _run_updates(opt, device, dtype, steps=5, shapes=LEAF_SHAPES):
    """`steps` updates by `update_and_apply_` of a tree of `dtype` on `device`, the same
    gradients on every device: (parameters, state), both on the host."""
    rng = np.random.default_rng(7)
    params = device(_tree(rng, dtype, shapes))
    state = opt.init(params)
    for _ in range(steps):
        state = optim.update_and_apply_(opt, device(_tree(rng, dtype, shapes)), state, params)
    to_host = lx.cpu_device()
    return to_host(params), to_host(state)


def _assert_close(got, want, dtype):
    # float64 to 1e-12; float32 (and the float32 moments of float16) to a few roundings
    rtol = {np.float64: 1e-12, np.float32: 4e-7, np.float16: 2e-3}[np.dtype(dtype).type]
    for (path, w), (_, g) in zip(lx.tree.paths(want), lx.tree.paths(got)):
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * 1e-3, err_msg=path)


def _halving(value):
    return optim.exponential_decay(value, 2, 0.5)


# name: (the optimiser, the kernel that updates each leaf)
OPTIMISERS = {
    "adam": (lambda: optim.adam(1e-2), "luxnn_adam"),
    "nadam": (lambda: optim.adam(1e-2, nesterov=True), "luxnn_adam"),
    "adam_eps_root": (lambda: optim.adam(1e-2, eps_root=1e-6), "luxnn_adam"),
    "adam_schedule": (lambda: optim.adam(_halving(1e-2)), "luxnn_adam"),
    "scale_by_adam": (lambda: optim.scale_by_adam(), "luxnn_adam"),
    "sgd_momentum": (lambda: optim.sgd(0.1, momentum=0.9), "luxnn_trace"),
    "sgd_nesterov": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True), "luxnn_trace"),
    "sgd_schedule": (lambda: optim.sgd(_halving(0.1), momentum=0.9), "luxnn_trace"),
    "trace": (lambda: optim.trace(0.9), "luxnn_trace"),
    "lion": (lambda: optim.chain(optim.scale_by_lion(), optim.scale_by_learning_rate(1e-3)), "luxnn_lion"),
    "lion_schedule": (
        lambda: optim.chain(optim.scale_by_lion(0.8, 0.95), optim.scale_by_learning_rate(_halving(1e-3))), "luxnn_lion"
    ),
    "scale_by_lion": (lambda: optim.scale_by_lion(), "luxnn_lion"),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("name", OPTIMISERS)
def test_the_fused_update_gives_the_cpus_parameters_and_moments(name, dtype, sim_gpu):
    make, kernel = OPTIMISERS[name]
    cpu = _run_updates(make(), lx.cpu_device(), dtype)
    with sim_cupy.counting() as counts:
        gpu = _run_updates(make(), sim_gpu, dtype)
    assert counts["kernel", kernel] == 5 * len(LEAF_SHAPES)  # the fused kernel ran, once per leaf
    _assert_close(gpu, cpu, dtype)
    moment_dtypes = {m.dtype for m in lx.tree.leaves(gpu[1]) if m.dtype.kind == "f"}
    assert moment_dtypes == {np.dtype(np.float32 if dtype == np.float16 else dtype)}  # float16: float32 moments


def _launches_of_one_update(make, leaves, device):
    shapes = [(8, 8), (8,)] * (leaves // 2)
    rng = np.random.default_rng(0)
    params, grads = device(_tree(rng, np.float32, shapes)), device(_tree(rng, np.float32, shapes))
    opt = make()
    state = optim.update_and_apply_(opt, grads, opt.init(params), params)  # the first update: kernels compiled
    with sim_cupy.counting() as counts:
        optim.update_and_apply_(opt, grads, state, params)
    return counts


@pytest.mark.parametrize("name", ["adam", "adam_schedule", "sgd_momentum", "sgd_schedule", "lion", "lion_schedule"])
def test_one_update_of_a_20_leaf_model_launches_one_kernel_per_leaf(name, sim_gpu):
    make, kernel = OPTIMISERS[name]
    few, many = (_launches_of_one_update(make, leaves, sim_gpu) for leaves in (2, 20))
    assert few["kernel", kernel] == 2 and many["kernel", kernel] == 20
    # besides the fused kernels, only the step's scalars (count, bias corrections, schedule): none per leaf
    assert many["kernel"] - 20 == few["kernel"] - 2 <= 30, (few, many)
    assert many["fill"] == many["memcpy"] == 0


def test_single_train_step_with_adam_trains_as_on_the_cpu(sim_gpu):
    model = lx.Chain(lx.Dense(6, 8, activation="tanh"), lx.Dense(8, 3))
    results = []
    for device in (lx.cpu_device(), sim_gpu):
        rng = np.random.default_rng(3)
        ps, st = device(lx.setup(np.random.default_rng(1), model))
        ps = lx.tree.map(lambda a: a.astype(np.float64), ps)
        batch = device((rng.standard_normal((10, 6)), rng.integers(0, 3, 10)))
        cache = memory.AllocCache(lx.get_device(ps))
        if device is sim_gpu:
            cache.front_end.bind = FakeDriver().bind  # the C core's CUDA upstream over host memory
        ts = lx.TrainState(model, ps, st, optim.adam(1e-2), allocator_cache=cache)
        for _ in range(5):
            _, _, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.CrossEntropyLoss(), batch, ts)
        results.append(lx.cpu_device()((ts.parameters, ts.optimizer_state)))
    _assert_close(results[1], results[0], np.float64)


def test_a_bad_learning_rate_raises_before_the_fused_kernel_writes_anything(sim_gpu):
    rng = np.random.default_rng(0)
    params, grads = sim_gpu(_tree(rng, np.float32)), sim_gpu(_tree(rng, np.float32))
    opt = optim.adam(lambda count: float("nan"))
    state = opt.init(params)
    before = lx.cpu_device()((params, state))
    with sim_cupy.counting() as counts, pytest.raises(ValueError, match="learning rate schedule"):
        optim.update_and_apply_(opt, grads, state, params)
    assert counts["kernel", "luxnn_adam"] == 0
    after = lx.cpu_device()((params, state))
    for (path, b), (_, a) in zip(lx.tree.paths(before), lx.tree.paths(after)):
        np.testing.assert_array_equal(a, b, err_msg=path)


def test_a_state_of_another_optimizer_is_refused_on_the_device(sim_gpu):
    params = sim_gpu(_tree(np.random.default_rng(0), np.float32))
    with pytest.raises(ValueError, match="ScaleByAdamState, got one of type TraceState"):
        optim.update_and_apply_(optim.scale_by_adam(), params, optim.trace(0.9).init(params), params)


class _Doubling(optim.Stateless, optim.UpdateInto, optim.KernelUpdate):
    """Adds twice the gradient; records which path ran."""

    def __init__(self):
        self.ran = []

    def update(self, grads, state, params=None):
        return lx.tree.map(lambda g: 2 * g, grads), state

    def update_into(self, grads, state, params, into):
        self.ran.append("update_into")
        for p, g in zip(into, lx.tree.leaves(grads)):
            p += 2 * g
        return state

    def kernel_update_into(self, grads, state, params, into, factor=1.0):
        self.ran.append(("kernel", factor))
        for p, g in zip(into, lx.tree.leaves(grads)):
            p += (2 * factor) * g
        return state


@pytest.mark.parametrize("chained", [False, True])
def test_a_stage_that_declares_a_kernel_update_is_fused_on_the_gpu_only(chained, sim_gpu):
    stage = _Doubling()
    opt = optim.GradientTransformation(stage.init, stage.update)
    if chained:
        opt = optim.chain(optim.identity(), opt)  # the last stage adds its updates
    for device in (lx.cpu_device(), sim_gpu):
        params = device({"w": np.ones(3)})
        optim.update_and_apply_(opt, device({"w": np.ones(3)}), opt.init(params), params)
        assert lx.cpu_device()(params)["w"].tolist() == [3.0] * 3
    assert stage.ran == ["update_into", ("kernel", 1.0)]


def test_the_fused_kernels_on_a_gpu_give_the_cpus_numbers(gpu):
    """On a real GPU: the CUDA source against the CPU path (float32 to a few roundings)."""
    for make, _ in OPTIMISERS.values():
        for dtype in (np.float64, np.float32, np.float16):
            cpu = _run_updates(make(), lx.cpu_device(), dtype)
            _assert_close(_run_updates(make(), gpu, dtype), cpu, dtype)
