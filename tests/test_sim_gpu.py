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


def _train(make, device, cache, steps: int = STEPS) -> tuple[list[float], Any, list[int], list[int]]:
    """`steps` Adam steps of the model from `make` on `device` in float64: the losses, the
    final parameters on the host, and per step the upstream allocations and launches."""
    model, shape = make()
    rng = np.random.default_rng(0)
    ps, st = device(lx.setup(np.random.default_rng(1), model))
    ps = lx.tree.map(lambda a: a.astype(np.float64) if a.dtype == np.float32 else a, ps)
    batch = device((rng.standard_normal(shape), rng.integers(0, 5, shape[0])))
    ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-2), allocator_cache=cache)
    ad, loss_fn = lx.AutoTape(), lx.losses.CrossEntropyLoss()
    losses, allocs, launches = [], [], []
    for _ in range(steps):
        before = cache.stats().upstream_allocs
        with sim_cupy.counting() as counts:
            _, loss, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
        losses.append(float(loss))
        allocs.append(cache.stats().upstream_allocs - before)
        launches.append(sum(counts[k] for k in ("kernel", "fill", "cublas")))
    return losses, lx.cpu_device()(ts.parameters), allocs, launches


def _device_cache() -> memory.AllocCache:
    cache = memory.AllocCache(lx.CUDADevice(0))
    cache.front_end.bind = FakeDriver().bind  # the C core's CUDA upstream over host memory
    return cache


def _run_both(name: str, sim_gpu) -> tuple:
    cpu = _train(MODELS[name], lx.cpu_device(), memory.AllocCache())
    gpu = _train(MODELS[name], sim_gpu, _device_cache())
    return cpu, gpu


@pytest.mark.parametrize("name", list(MODELS))
def test_the_cuda_path_trains_as_the_cpu_path_and_plans_its_memory(name, sim_gpu):
    (cpu_losses, cpu_ps, _, _), (gpu_losses, gpu_ps, gpu_allocs, _) = _run_both(name, sim_gpu)
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-10)
    for (path, want), (_, got) in zip(lx.tree.paths(cpu_ps), lx.tree.paths(gpu_ps)):
        assert type(got) is np.ndarray, path
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12, err_msg=path)
    assert gpu_allocs[3:] == [0] * (STEPS - 3), f"{name}: upstream allocations per step {gpu_allocs}"


# Launches per training step (kernels, fills and cuBLAS calls; host<->device copies apart)
# on the simulated device, with the models above, are a regression guard: today's counts
# plus a margin, NOT the goal. Issue 26's target is at most 1.5x PyTorch eager's CUDA
# kernels per step, which it measured on the bench's larger models (H200, torch.profiler):
# MLP 27, CNN 48, attention 73, LSTM 293 (luxnn's then: 101, 6327, 439, 21114; the CNN's
# and LSTM's grow with the batch and the host's threads, which these small models do not
# reach: see the test after this one). Lower the counts as the CUDA implementations land.
LAUNCHES = {"mlp": 127, "cnn": 246, "attention": 412, "lstm": 371}
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
    # float64 im2col rows of 16 * 16 * 9 * 32 * 8 bytes: ops/conv.py's _block_images cuts
    # the batch of 8 into 2 blocks on 1 thread and 8 on 4.
    model = lx.Chain(lx.Conv((3, 3), 32, 32, activation="relu", padding="same"), lx.Flatten(), lx.Dense(16 * 16 * 32, 5))
    return model, (8, 16, 16, 32)


def _wide_lstm():
    # 32 rows of 64 hidden units over 10 steps: ops/recurrent.py's _by_rows cuts 4 blocks of
    # rows on 4 threads, runs one on 1.
    return lx.Chain(lx.LSTM(8, 64), _LastStep(), lx.Dense(64, 5)), (32, 10, 8)


@pytest.mark.xfail(
    strict=True,
    reason="issue 26: on CuPy arrays ops/conv.py (_block_images, _ColumnBuffers) and ops/recurrent.py "
    "(_by_rows) still cut the batch by the host's thread count and run the blocks one after another",
)
@pytest.mark.parametrize("make", [_wide_cnn, _wide_lstm], ids=["cnn", "lstm"])
def test_launches_do_not_depend_on_the_hosts_threads(make, sim_gpu, threads):
    counts = {}
    for kernel_threads in (1, 4):
        threads(kernel_threads)
        counts[kernel_threads] = _train(make, sim_gpu, _device_cache(), steps=1)[3][0]
    print(f"{make.__name__}: launches per training step by kernel threads {counts}")
    assert counts[1] == counts[4]
