"""luxnn's CUDA path on the simulated CUDA device of tests/sim_cupy.py (no GPU needed):
training steps of small models of each kind the bench runs (Dense MLP, CNN, attention
block, LSTM) with `single_train_step_` under a CUDA `AllocCache` (its C hook and a fake
driver as upstream), compared with the CPU path in float64, with the device's memory
plans checked and the kernel launches per training step counted.

What the simulator cannot tell: the speed of anything, and whether a real CUDA kernel
computes what its NumPy twin does (tests/test_gpu.py, on a GPU).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory

import sim_cupy
from test_memory_cuda import FakeDriver

STEPS = 5  # plans are made on step 2 and followed from step 3 on; step 4 must allocate nothing


@pytest.fixture
def sim_gpu(monkeypatch):
    """CuPy simulated on the CPU, installed as ``cupy``; yields the CUDADevice."""
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


# -- the simulator ---------------------------------------------------------------------------


def test_simulated_arrays_are_cupys_to_luxnn_and_refuse_numpy_operands(sim_gpu):
    x = sim_gpu(np.arange(6.0).reshape(2, 3))
    assert lx.backend.module_of(x) is sim_cupy and lx.get_device(x) == lx.CUDADevice(0)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(x)
    assert np.exp(x).get().tolist() == np.exp(np.arange(6.0).reshape(2, 3)).tolist()  # __array_ufunc__


def test_launches_are_counted_by_kind_and_views_launch_nothing(sim_gpu):
    x = sim_gpu(np.ones((4, 3)))
    with sim_cupy.counting() as counts:
        view = x.T.reshape(-1, 4)[1:]  # transposed, reshaped without a copy, sliced
        copied = x.T.reshape(-1)  # a transposed array flattened: a copy
        product = x @ x.T
        total = product.sum()
        zeros = sim_cupy.zeros(3)
    assert view.base is x and copied.base is None
    assert counts["kernel"] == 2 and counts["cublas"] == 1 and counts["fill"] == 1 and counts["memcpy"] == 0
    assert counts["kernel", "sum"] == 1 and float(total) == 48.0 and zeros.get().tolist() == [0.0] * 3


def test_arrays_in_a_cached_scope_live_in_the_caches_blocks(sim_gpu):
    cache, driver = memory.AllocCache(lx.CUDADevice(0)), FakeDriver()
    cache.front_end.bind = driver.bind
    with memory.cached(cache):
        a = sim_cupy.arange(5.0) * 2.0
    assert any(base <= a.data.ptr < base + len(segment) for base, segment in driver.buffers.items())
    assert a.get().tolist() == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_dropout_draws_its_mask_on_the_device_by_the_kernels_numpy_twin(sim_gpu):
    model = lx.Dropout(0.25)
    ps, st = sim_gpu(lx.setup(np.random.default_rng(0), model))
    with sim_cupy.counting() as counts:
        y, _ = model(sim_gpu(np.ones((200, 50))), ps, st)
    values = y.get()
    assert counts["kernel", "luxnn_dropout_mask"] == 1
    assert set(np.unique(values)) == {0.0, 1 / 0.75} and abs((values == 0).mean() - 0.25) < 0.02


# -- training steps ----------------------------------------------------------------------------


class _TakeFirst(lx.Layer):
    def __call__(self, x: Any, ps: Any, st: Any) -> Any:
        return x[0], st


class _LastStep(lx.Layer):
    def __call__(self, x: Any, ps: Any, st: Any) -> Any:
        return x[:, -1], st


def _mlp():
    return lx.Chain(lx.Dense(20, 32, activation="relu"), lx.Dense(32, 32, activation="relu"), lx.Dense(32, 5)), (16, 20)


def _cnn():
    model = lx.Chain(
        lx.Conv((3, 3), 1, 4, activation="relu", padding="same"),
        lx.Conv((3, 3), 4, 8, activation="relu", padding="same"),
        lx.MaxPool((2, 2)),
        lx.Flatten(),
        lx.Dense(4 * 4 * 8, 16, activation="relu"),
        lx.Dense(16, 5),
    )
    return model, (8, 8, 8, 1)


def _attention():
    dim, seq = 16, 6
    block = lx.Chain(
        lx.SkipConnection(lx.Chain(lx.MultiHeadAttention(dim, num_heads=2, is_causal=True), _TakeFirst())),
        lx.LayerNorm(dim),
        lx.SkipConnection(lx.Chain(lx.Dense(dim, 2 * dim, activation="gelu"), lx.Dense(2 * dim, dim))),
        lx.LayerNorm(dim),
        lx.Flatten(),
        lx.Dense(seq * dim, 5),
    )
    return block, (4, seq, dim)


def _lstm():
    return lx.Chain(lx.LSTM(6, 12), _LastStep(), lx.Dense(12, 5)), (8, 7, 6)


MODELS = {"mlp": _mlp, "cnn": _cnn, "attention": _attention, "lstm": _lstm}

# More layers, each in a small model; an input shape, or the input itself (integers).
_IMAGES = (4, 8, 8, 2)
LAYERS = {
    "batchnorm": lambda: (lx.Chain(lx.Dense(6, 8), lx.BatchNorm(8), lx.Dense(8, 5)), (16, 6)),
    "groupnorm": lambda: (lx.Chain(lx.Conv((3, 3), 2, 4), lx.GroupNorm(2, 4), lx.Flatten(), lx.Dense(144, 5)), _IMAGES),
    "instancenorm": lambda: (lx.Chain(lx.Conv((3, 3), 2, 4), lx.InstanceNorm(4), lx.Flatten(), lx.Dense(144, 5)), _IMAGES),
    "rmsnorm": lambda: (lx.Chain(lx.Dense(6, 8), lx.RMSNorm(8), lx.Dense(8, 5)), (16, 6)),
    "gru": lambda: (lx.Chain(lx.GRU(6, 12), _LastStep(), lx.Dense(12, 5)), (8, 7, 6)),
    "rnn": lambda: (lx.Chain(lx.RNN(6, 12), _LastStep(), lx.Dense(12, 5)), (8, 7, 6)),
    "bidirectional_lstm": lambda: (
        lx.Chain(lx.LSTM(6, 12, num_layers=2, bidirectional=True), _LastStep(), lx.Dense(24, 5)), (8, 7, 6)
    ),
    "avgpool": lambda: (lx.Chain(lx.Conv((3, 3), 2, 4), lx.AvgPool((2, 2)), lx.Flatten(), lx.Dense(36, 5)), _IMAGES),
    "globalmaxpool": lambda: (lx.Chain(lx.Conv((3, 3), 2, 4), lx.GlobalMaxPool(), lx.Flatten(), lx.Dense(4, 5)), _IMAGES),
    "adaptiveavgpool": lambda: (lx.Chain(lx.AdaptiveAvgPool((3, 3)), lx.Flatten(), lx.Dense(18, 5)), _IMAGES),
    "conv_transpose": lambda: (lx.Chain(lx.ConvTranspose((3, 3), 2, 4, stride=2), lx.Flatten(), lx.Dense(4 * 17 * 17, 5)), _IMAGES),
    "conv_strided_grouped": lambda: (lx.Chain(lx.Conv((3, 3), 2, 4, stride=2, groups=2), lx.Flatten(), lx.Dense(36, 5)), _IMAGES),
    "upsample": lambda: (lx.Chain(lx.Upsample(2, mode="bilinear"), lx.Flatten(), lx.Dense(512, 5)), _IMAGES),
    "pixelshuffle": lambda: (lx.Chain(lx.PixelShuffle(2), lx.Flatten(), lx.Dense(16, 5)), (4, 2, 2, 4)),
    "activations": lambda: (
        lx.Chain(lx.Dense(6, 8, activation="tanh"), lx.Dense(8, 8, activation="sigmoid"), lx.Dense(8, 5, activation="swish")), (16, 6)
    ),
    "rotary": lambda: (lx.Chain(lx.RotaryPositionalEmbedding(8), lx.Flatten(), lx.Dense(40, 5)), (4, 5, 8)),
    "sinusoidal": lambda: (lx.Chain(lx.SinusoidalPositionalEmbedding(8), lx.Flatten(), lx.Dense(40, 5)), (4, 5, 8)),
    "bilinear": lambda: (lx.Chain(lx.BranchLayer(lx.Dense(6, 4), lx.Dense(6, 3)), lx.Bilinear((4, 3), 5)), (16, 6)),
    "maxout": lambda: (lx.Maxout(lx.Dense(6, 5), lx.Dense(6, 5)), (16, 6)),
    "embedding": lambda: (
        lx.Chain(lx.Embedding(10, 6), lx.Flatten(), lx.Dense(18, 5)), np.random.default_rng(2).integers(0, 10, (16, 3))
    ),
}


def _train(make, device, cache, steps: int = STEPS) -> tuple[list[float], Any, list[int], list[int]]:
    """`steps` Adam steps of the model from `make` on `device` in float64: the losses, the
    final parameters on the host, and per step the upstream allocations and launches."""
    model, x = make()
    rng = np.random.default_rng(0)
    ps, st = device(lx.setup(np.random.default_rng(1), model))
    ps = lx.tree.map(lambda a: a.astype(np.float64) if a.dtype == np.float32 else a, ps)
    x = rng.standard_normal(x) if isinstance(x, tuple) else x
    batch = device((x, rng.integers(0, 5, x.shape[0])))
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-2), allocator_cache=cache, graphs=False)  # eager launches
    ad, loss_fn = lx.AutoTape(), lx.losses.CrossEntropyLoss()
    losses, allocs, launches = [], [], []
    for _ in range(steps):
        before = cache.stats().upstream_allocs
        with sim_cupy.counting() as counts:
            _, loss, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
        losses.append(float(loss))
        allocs.append(cache.stats().upstream_allocs - before)
        launches.append(sum(counts[k] for k in ("kernel", "fill", "cublas")))
    assert lx.get_device(ts.parameters) == device
    return losses, lx.cpu_device()(ts.parameters), allocs, launches


def _device_cache() -> memory.AllocCache:
    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = FakeDriver().bind  # the C core's CUDA upstream over host memory
    return cache


def _run_both(make, sim_gpu, steps: int = STEPS) -> tuple:
    cpu = _train(make, lx.cpu_device(), memory.AllocCache(), steps)
    gpu = _train(make, sim_gpu, _device_cache(), steps)
    return cpu, gpu


def _assert_same_training(cpu, gpu) -> None:
    (cpu_losses, cpu_ps, _, _), (gpu_losses, gpu_ps, _, _) = cpu, gpu
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-10)
    for (path, want), (_, got) in zip(lx.tree.paths(cpu_ps), lx.tree.paths(gpu_ps)):
        assert type(got) is np.ndarray, path
        # atol: a parameter whose gradient is 0 in exact arithmetic (an attention key's
        # bias, a conv's bias before an InstanceNorm) moves by rounding noise alone, which
        # Adam scales up to ~1e-10 a step and which differs where a kernel sums in another order.
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9, err_msg=path)


@pytest.mark.parametrize("name", list(MODELS))
def test_the_cuda_path_trains_as_the_cpu_path_and_plans_its_memory(name, sim_gpu):
    cpu, gpu = _run_both(MODELS[name], sim_gpu)
    _assert_same_training(cpu, gpu)
    assert gpu[2][3:] == [0] * (STEPS - 3), f"{name}: upstream allocations per step {gpu[2]}"


def test_a_step_of_blocks_of_tens_of_kib_only_is_planned_on_the_device(sim_gpu):
    # Every block of this step is at most 64 KiB (a slab's), many above MATCH_ABOVE: the
    # slabs alone, placing online, took a new one on its fourth step, over the budget.
    cache = _device_cache()
    allocs = _train(LAYERS["bidirectional_lstm"], sim_gpu, cache, steps=8)[2]
    s = cache.stats()
    assert allocs[3:] == [0] * 5, f"upstream allocations per step {allocs}"
    assert s.plans == 1 and s.peak_reserved <= memory.plan.BUDGET * s.peak_live, s
    cache._core.audit()


@pytest.mark.parametrize("name", list(LAYERS))
def test_each_layer_trains_on_the_cuda_path_as_on_the_cpu_path(name, sim_gpu):
    _assert_same_training(*_run_both(LAYERS[name], sim_gpu))


# Launches per training step (kernels, fills and cuBLAS calls; host<->device copies apart)
# on the simulated device, with the models above: today's counts plus a margin, a
# regression guard (the targets are checked on the bench's own models, in
# tests/test_sim_bench.py). Before the CUDA implementations of ops/cuda and the fused
# optimiser these models launched 127, 246, 412 and 371.
LAUNCHES = {"mlp": 22, "cnn": 37, "attention": 65, "lstm": 53}
MARGIN = 1.1


@pytest.mark.parametrize("kernel_threads", [1, 4])
@pytest.mark.parametrize("name", list(MODELS))
def test_launches_per_training_step_stay_under_todays_counts(name, kernel_threads, sim_gpu, threads):
    threads(kernel_threads)
    launches = _train(MODELS[name], sim_gpu, _device_cache())[3]
    per_step = launches[-1]
    print(f"{name}: {per_step} launches per training step with {kernel_threads} kernel threads ({launches})")
    assert launches == [per_step] * STEPS  # the same work every step
    assert per_step <= LAUNCHES[name] * MARGIN


def _wide_cnn():
    # float64 im2col rows of 16 * 16 * 9 * 32 * 8 bytes: on NumPy arrays ops/cpu/conv.py cuts the
    # batch of 8 into 2 blocks on 1 thread and 8 on 4.
    model = lx.Chain(lx.Conv((3, 3), 32, 32, activation="relu", padding="same"), lx.Flatten(), lx.Dense(16 * 16 * 32, 5))
    return model, (8, 16, 16, 32)


def _wide_lstm():
    # 32 rows of 64 hidden units over 10 steps: on NumPy arrays ops/cpu/recurrent.py cuts 4
    # blocks of rows on 4 threads, runs one on 1.
    return lx.Chain(lx.LSTM(8, 64), _LastStep(), lx.Dense(64, 5)), (32, 10, 8)


@pytest.mark.parametrize("make", [_wide_cnn, _wide_lstm], ids=["cnn", "lstm"])
def test_launches_do_not_depend_on_the_hosts_threads(make, sim_gpu, threads):
    counts = {}
    for kernel_threads in (1, 4):
        threads(kernel_threads)
        cpu, gpu = _run_both(make, sim_gpu, steps=2)
        _assert_same_training(cpu, gpu)
        counts[kernel_threads] = gpu[3][-1]
    print(f"{make.__name__}: launches per training step by kernel threads {counts}")
    assert counts[1] == counts[4]
