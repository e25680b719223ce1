"""luxnn on a CUDA GPU (CuPy arrays), parametrised over devices where the same check means
something on the CPU too.

Everything that needs a GPU skips, with the reason, without CuPy or without a working
device; `scripts/gpu_check.sh` runs this file on a machine that has one. What runs on
any machine: `gpu_device()` without a GPU, the devices' moves on the CPU, and the check
script's refusal without a GPU. The CuPy front end's bookkeeping without a device is in
tests/test_memory_cuda.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

import luxnn as lx
from luxnn import devices, memory, ops
from luxnn.ad import primitives as P
from luxnn.ops.attention import attention_combine, attention_weights


def _no_gpu_reason() -> str | None:
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'luxnn[cuda12]')"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device"
    except Exception as err:  # CUDARuntimeError without a driver
        return f"no usable CUDA GPU ({err})"
    return None


NO_GPU = _no_gpu_reason()
GPUS = 0 if NO_GPU else __import__("cupy").cuda.runtime.getDeviceCount()
needs_gpu = pytest.mark.skipif(NO_GPU is not None, reason=NO_GPU or "")
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("gpu", id="gpu", marks=needs_gpu)]
ROOT = Path(__file__).resolve().parents[1]

if NO_GPU is None:
    import cupy


def _device(name: str) -> devices.Device:
    return lx.cpu_device() if name == "cpu" else lx.CUDADevice(0)


def _host(x):
    return lx.cpu_device()(x)


def _relative_error(got, want, scale: float | None = None) -> float:
    """The largest difference relative to `scale` (default: `want`'s largest magnitude)."""
    got, want = np.asarray(_host(got), np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape
    scale = np.max(np.abs(want), initial=0.0) if scale is None else scale
    return float(np.max(np.abs(got - want), initial=0.0) / max(scale, 1e-30))


TOLERANCE = {np.float64: 1e-10, np.float32: 1e-4}


# -- devices --------------------------------------------------------------------------------


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present: gpu_device() returns it")
def test_gpu_device_without_a_gpu_warns_once_and_returns_the_cpu(monkeypatch):
    monkeypatch.setattr(devices, "_warned_no_gpu", False)
    with pytest.warns(UserWarning, match="no usable CUDA GPU") as caught:
        assert lx.gpu_device() == lx.cpu_device()
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lx.gpu_device(0) == lx.cpu_device()  # no second warning
    with pytest.raises(RuntimeError, match="no usable CUDA GPU"):
        lx.gpu_device(force=True)


@pytest.mark.skipif(NO_GPU is None, reason="a GPU is present")
def test_gpu_check_script_refuses_clearly_without_a_gpu():
    script = ROOT / "scripts" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    run = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHON": sys.executable})
    assert run.returncode == 2, run.stdout + run.stderr
    assert "no usable NVIDIA GPU" in run.stdout + run.stderr


@needs_gpu
def test_gpu_device_with_a_gpu():
    assert lx.gpu_device() == lx.CUDADevice(cupy.cuda.runtime.getDevice())
    assert lx.gpu_device(0, force=True) == lx.CUDADevice(0)
    with pytest.raises(RuntimeError, match="requested"):
        lx.gpu_device(cupy.cuda.runtime.getDeviceCount(), force=True)


@pytest.mark.parametrize("name", DEVICES)
def test_devices_move_trees_train_states_and_batches(name):
    dev = _device(name)
    rng = np.random.default_rng(0)
    model = lx.Chain(lx.Dense(3, 4, activation="relu"), lx.Dropout(0.5), lx.Dense(4, 2))
    ps, st = lx.setup(rng, model)
    ts = dev(lx.TrainState(model, ps, st, lx.optim.adam(1e-3)))
    assert lx.get_device(ts) == dev and lx.get_device(ts.optimizer_state) == dev
    assert isinstance(ts.states["layer_2"]["rng"], np.random.Generator)  # stays on the host
    assert (ts.allocator_cache.device or lx.cpu_device()) == dev  # a fresh cache for the device
    back = lx.cpu_device()(ts.parameters)
    np.testing.assert_array_equal(back["layer_1"]["weight"], ps["layer_1"]["weight"])
    x = dev(rng.standard_normal((4, 3)).astype(np.float32))
    assert lx.get_device(x) == dev
    loader = lx.DataLoader((np.zeros((10, 3)), np.arange(10)), 4, shuffle=True, rng=rng, device=dev)
    assert all(lx.get_device(batch) == dev for batch in loader)


@needs_gpu
def test_mixed_devices_are_refused_naming_both():
    model = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), model)
    gpu = lx.CUDADevice(0)
    ts = gpu(lx.TrainState(model, ps, st, lx.optim.sgd(0.1)))
    data = (np.ones((4, 3), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match=r"parameters are on CUDADevice\(0\) but the data on CPUDevice\(\)"):
        lx.single_train_step(lx.AutoTape(), lx.losses.MSELoss(), data, ts)
    with pytest.raises(ValueError, match=r"CUDADevice\(0\) and CPUDevice\(\)"):
        lx.get_device({"a": gpu(data[0]), "b": data[1]})


# -- primitives and layers on the device against the CPU ------------------------------------

# Functions of (a, b, index) covering the primitives whose CuPy path differs from NumPy's:
# scatter-add VJPs, put_along_axis, erf, the attention kernels, reductions. index(...)
# makes an integer index array on the inputs' device.
PRIMITIVE_CASES = {
    "arithmetic": lambda a, b, i: (a * b + a / (1.5 + b * b) - P.power(1.5 + a * a, b)).sum(),
    "matmul": lambda a, b, i: (a @ b.T).sum(),
    "reductions": lambda a, b, i: P.max(a, axis=1).sum() + P.var(b) + P.mean(a * b, axis=0).sum(),
    "getitem_repeated": lambda a, b, i: (a[i(0, 2, 2)] * b[:3]).sum(),
    "take": lambda a, b, i: P.take(a, i(1, 1, 3), axis=1).sum() + (b * b).sum(),
    "concat_stack_split": lambda a, b, i: sum(p.sum() for p in P.split(P.concat([a, b], axis=0), 2)) + P.stack([a, b]).max(),
    "where_clip": lambda a, b, i: P.where(a > 0, a, b).sum() + P.clip(b, -0.5, 0.5).sum(),
    "activations": lambda a, b, i: (ops.gelu(a, approximate="none") + ops.softplus(b) + ops.elu(a) + ops.silu(b)).sum(),
    "softmax_family": lambda a, b, i: (ops.softmax(a) * ops.log_softmax(b)).sum() + ops.logsumexp(a, axis=-1).sum(),
    "cross_entropy": lambda a, b, i: ops.softmax_cross_entropy(a + b, i(0, 3, 1, 2), label_smoothing=0.1).sum(),
    "normalize": lambda a, b, i: (ops.normalize(a, axis=-1, epsilon=1e-5) * b).sum(),
    "embedding": lambda a, b, i: (ops.lookup_rows(a, i(0, 3, 3, 3).reshape(2, 2)) ** 2).sum() + b.sum(),
    "attention": lambda a, b, i: attention_combine(
        attention_weights(a[None], b[None], num_heads=5, is_causal=True), a[None], num_heads=5
    ).sum() + ops.masked_softmax(a * b, mask=a > 0).sum(),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(PRIMITIVE_CASES))
@needs_gpu
def test_primitives_on_the_gpu_match_the_cpu(case):
    fn = PRIMITIVE_CASES[case]
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((4, 5)), rng.standard_normal((4, 5))

    def on(dev):
        index = lambda *values: dev(np.array(values))  # noqa: E731
        return lx.value_and_grad(lambda a, b: fn(a, b, index), argnums=(0, 1))(dev(a), dev(b))

    (v_cpu, g_cpu), (v_gpu, g_gpu) = on(lx.cpu_device()), on(lx.CUDADevice(0))
    assert _relative_error(v_gpu, v_cpu) < 1e-10
    for got, want in zip(g_gpu, g_cpu):
        assert lx.get_device(got) == lx.CUDADevice(0)
        assert _relative_error(got, want) < 1e-10


class TakeFirst(lx.Layer):
    """Keeps y of the attention's (y, weights)."""

    def __call__(self, x, ps, st):
        return x[0], st


MODELS = {
    "mlp": (lambda: lx.Chain(lx.Dense(12, 32, activation="relu"), lx.Dense(32, 32, activation="gelu"), lx.Dense(32, 5)), (16, 12)),
    "cnn": (
        lambda: lx.Chain(
            lx.Conv((3, 3), 3, 8, activation="relu", padding="same"), lx.BatchNorm(8), lx.MaxPool((2, 2)),
            lx.Conv((3, 3), 8, 8, activation="relu"), lx.Flatten(), lx.Dense(2 * 2 * 8, 5),
        ),
        (6, 8, 8, 3),
    ),
    "attention": (
        lambda: lx.Chain(
            lx.Dense(6, 16),
            lx.SkipConnection(lx.Chain(lx.MultiHeadAttention(16, num_heads=4, is_causal=True), TakeFirst())),
            lx.LayerNorm(16), lx.Flatten(), lx.Dense(7 * 16, 5),
        ),
        (4, 7, 6),
    ),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [np.float64, np.float32], ids=["float64", "float32"])
@pytest.mark.parametrize("model_name", sorted(MODELS))
@needs_gpu
def test_models_on_the_gpu_match_the_cpu(model_name, dtype):
    """Outputs and gradients of the same model and inputs: float64 to 1e-10, float32 to
    1e-4; the output and the loss relative to their largest magnitude, each gradient
    relative to the largest magnitude in the whole gradient tree. (Not to the gradient's
    own: a gradient that is zero in exact arithmetic, as an attention key's bias is since
    softmax ignores a shift shared by every score, holds rounding noise on both devices,
    and noise relative to noise cannot match.)"""
    make, shape = MODELS[model_name]
    model = make()
    rng = np.random.default_rng(2)
    ps, st = lx.setup(rng, model)
    ps = lx.tree.map(lambda p: p.astype(dtype), ps)
    x, y = rng.standard_normal(shape).astype(dtype), rng.integers(0, 5, shape[0])
    loss_fn = lx.losses.CrossEntropyLoss()

    def run(dev):
        p, s, data = dev(ps), dev(st), dev((x, y))
        out, _ = model(data[0], p, s)
        (loss, _), grads = lx.value_and_grad(lambda p: loss_fn(model, p, s, data)[:2], has_aux=True)(p)
        return out, loss, grads

    out_cpu, loss_cpu, g_cpu = run(lx.cpu_device())
    out_gpu, loss_gpu, g_gpu = run(lx.CUDADevice(0))
    tol = TOLERANCE[dtype]
    assert _relative_error(out_gpu, out_cpu) < tol
    assert _relative_error(loss_gpu, loss_cpu) < tol
    scale = max(float(np.max(np.abs(g))) for g in lx.tree.leaves(g_cpu))
    for (path, got), (_, want) in zip(lx.tree.paths(g_gpu), lx.tree.paths(g_cpu)):
        assert got.dtype == want.dtype, path
        assert _relative_error(got, want, scale) < tol, path


@needs_gpu
def test_dropout_masks_on_the_device():
    drop = lx.Dropout(0.25)
    _, st = lx.setup(np.random.default_rng(0), drop)
    x = cupy.ones((256, 256), cupy.float32)
    y1, st1 = drop(x, {}, st)
    y2, _ = drop(x, {}, st)
    y3, _ = drop(x, {}, st1)
    assert isinstance(y1, cupy.ndarray) and isinstance(st1["rng"], np.random.Generator)
    assert bool((y1 == y2).all()) and not bool((y1 == y3).all())  # same state, same mask
    values = set(cupy.unique(y1).get().tolist())
    assert values == {0.0, np.float32(1 / 0.75)}
    assert abs(float((y1 == 0).mean()) - 0.25) < 0.01
    g = lx.grad(lambda x: (drop(x, {}, st)[0] * 2).sum())(x)
    assert bool((g == 2 * y1).all())


# -- training with the cache on the device --------------------------------------------------


def _gpu_train_state(cache="default"):
    model = lx.Chain(lx.Dense(32, 64, activation="relu"), lx.Dropout(0.1), lx.Dense(64, 10))
    ps, st = lx.setup(np.random.default_rng(0), model)
    gpu = lx.CUDADevice(0)
    kwargs = {} if cache == "default" else {"allocator_cache": cache}
    return lx.TrainState(model, gpu(ps), gpu(st), lx.optim.adam(1e-3), **kwargs)


def _gpu_batch(seed):
    rng = np.random.default_rng(seed)
    return lx.CUDADevice(0)((rng.standard_normal((16, 32)).astype(np.float32), rng.integers(0, 10, 16)))


@needs_gpu
def test_train_state_on_the_gpu_gets_a_device_cache_and_steps_stop_reaching_the_driver():
    ts = _gpu_train_state()
    cache = ts.allocator_cache
    assert isinstance(cache, memory.AllocCache) and cache.device == lx.CUDADevice(0)
    batch = _gpu_batch(0)
    loss_fn = lx.losses.CrossEntropyLoss()
    for step in range(6):
        before = cache.stats()
        grads, loss, _, ts = lx.single_train_step_(lx.AutoTape(), loss_fn, batch, ts)
        after = cache.stats()
        assert lx.get_device(grads) == lx.CUDADevice(0) and isinstance(loss, cupy.ndarray)
        # From the fourth step (docs/design.md's budget). This model's requests are all of 64 KiB
        # or less, so no plan is made for it (nor on the CPU); its slabs may still grow once
        # in the third step, where the blocks kept from the second sit elsewhere.
        if step >= 3:
            assert after.upstream_allocs == before.upstream_allocs, step
    assert cache.stats().peak_reserved <= 1.1 * cache.stats().peak_live
    cache._core.audit()


@pytest.mark.parametrize("name", DEVICES)
def test_a_planned_training_loop_stops_reaching_the_system_from_step_4(name):
    # Requests above 64 KiB, which step plans place: on either device the plan is made
    # and served, no step from the fourth on reaches the system (the driver on a GPU), and
    # peak reserved stays at the step's working set once planned.
    dev = _device(name)
    model = lx.Chain(lx.Dense(128, 512, activation="relu"), lx.Dense(512, 512, activation="relu"), lx.Dense(512, 10))
    rng = np.random.default_rng(0)
    ps, st = lx.setup(rng, model)
    ts = dev(lx.TrainState(model, ps, st, lx.optim.adam(1e-3)))
    cache = ts.allocator_cache
    batch = dev((rng.standard_normal((128, 128)).astype(np.float32), rng.integers(0, 10, 128)))
    loss_fn = lx.losses.CrossEntropyLoss()
    for step in range(10):
        if step == 3:
            cache.reset_peaks()
        before = cache.stats().upstream_allocs
        _, _, _, ts = lx.single_train_step_(lx.AutoTape(), loss_fn, batch, ts)
        if step >= 3:
            assert cache.stats().upstream_allocs == before, step
    stats = cache.stats()
    assert stats.plans >= 1 and stats.plan_hits > 0 and stats.plan_misses == 0
    assert stats.peak_reserved <= 1.05 * stats.peak_live
    cache._core.audit()


@pytest.mark.parametrize("verb", [lx.single_train_step, lx.single_train_step_])
@needs_gpu
def test_gradients_and_parameters_kept_from_a_step_keep_their_values_on_the_device(verb):
    ts = _gpu_train_state()
    loss_fn = lx.losses.CrossEntropyLoss()
    grads, _, _, ts = verb(lx.AutoTape(), loss_fn, _gpu_batch(0), ts)
    kept_grads = grads
    kept_params = ts.parameters if verb is lx.single_train_step else lx.tree.map(lambda a: a.copy(), ts.parameters)
    snapshot = _host((kept_grads, kept_params))
    for step in range(50):
        _, _, _, ts = verb(lx.AutoTape(), loss_fn, _gpu_batch(step + 1), ts)
    for got, want in zip(lx.tree.leaves(_host((kept_grads, kept_params))), lx.tree.leaves(snapshot)):
        np.testing.assert_array_equal(got, want)


@needs_gpu
def test_cached_device_memory_is_real_and_from_the_driver():
    cache = memory.AllocCache(lx.CUDADevice(0))
    with memory.cached(cache) as scope:
        a = cupy.arange(1 << 20, dtype=cupy.float32)
        b = a * 2
    assert scope.stats.upstream_allocs == 2 and cache.stats().bytes_live == 2 * (4 << 20)
    assert float(b[-1]) == 2 * ((1 << 20) - 1)
    assert cupy.cuda.runtime.pointerGetAttributes(b.data.ptr).device == 0
    del a, b
    assert cache.trim() == 2 * (4 << 20) and cache.stats().bytes_reserved == 0


@needs_gpu
def test_out_of_device_memory_trims_retries_and_raises_cupys_error():
    cache = memory.AllocCache(lx.CUDADevice(0))
    # Twice the device's memory: the driver refuses it, so the cache trims and retries. (A
    # request above 128 TiB, which no device has, is refused without the trim: it would
    # throw the cache away for nothing.)
    too_much = 2 * cupy.cuda.runtime.memGetInfo()[1]
    with memory.cached(cache):
        keep = cupy.ones(1 << 20)
        dropped = cupy.ones(1 << 20)
        del dropped
        assert cache.stats().bytes_cached == 8 << 20
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError) as info:
            cupy.empty(too_much, cupy.uint8)
        with pytest.raises(cupy.cuda.memory.OutOfMemoryError):
            cupy.empty(1 << 50, cupy.uint8)  # 1 PiB
    assert isinstance(info.value, memory.CacheMemoryError)
    assert f"Out of memory allocating {too_much:,} bytes" in str(info.value)
    assert "Cache figures: live 8.0 MiB" in str(info.value) and "out of memory" in str(info.value)
    assert cache.stats().bytes_cached == 0 and cache.stats().bytes_live == 8 << 20  # trimmed, nothing leaked
    with memory.cached(cache):  # the next request is served
        assert float(cupy.ones(10).sum()) == 10
    limited = memory.AllocCache(lx.CUDADevice(0), limit=1 << 20)
    with memory.cached(limited), pytest.raises(cupy.cuda.memory.OutOfMemoryError, match="limit"):
        cupy.empty(2 << 20, cupy.uint8)
    del keep


@pytest.mark.skipif(GPUS < 2, reason=NO_GPU or f"needs two GPUs, {GPUS} present")
def test_a_cache_on_device_0_never_hands_a_block_to_device_1():
    cache = memory.AllocCache(lx.CUDADevice(0))
    with memory.cached(cache):
        on_0 = cupy.ones(1 << 16)
        del on_0  # a free block of device 0
        with cupy.cuda.Device(1):
            on_1 = cupy.ones(1 << 16)
    assert on_1.device.id == 1 and float(on_1.sum()) == 1 << 16
    assert cache.stats().hits == 0 and cache.stats().bytes_live == 0


@pytest.mark.parametrize("name", ["mlp", "cnn", "attention", "lstm"])
@needs_gpu
def test_each_bench_models_ten_adam_steps_on_the_gpu_follow_the_cpus(name):
    """The GPU rows' models (`luxnn bench --device gpu`, a batch of 8), in float64: the
    losses of 10 `single_train_step_` Adam steps to 1e-8, and after them each parameter
    whose gradient is not rounding noise to 1e-6 of the largest parameter (Adam moves a
    leaf whose gradient is zero in exact arithmetic, such as an attention key's bias, by
    the learning rate in the direction of its noise, on each device its own)."""
    from luxnn.bench import gpu_models

    row = gpu_models.TRAINING[name]
    x, y = row.data(batch=8)
    model = row.model()
    ps, st = lx.setup(np.random.default_rng(0), model)
    ps = lx.tree.map(lambda p: p.astype(np.float64), ps)
    ad, loss_fn = lx.AutoTape(), lx.losses.CrossEntropyLoss()

    def train(dev):
        ts = lx.TrainState(model, dev(lx.tree.map(np.copy, ps)), dev(st), lx.optim.adam(1e-3))  # trained in place
        data, losses = dev((x.astype(np.float64), y)), []
        grads, _, _, ts = lx.compute_gradients(ad, loss_fn, data, ts)
        for _ in range(10):
            _, loss, _, ts = lx.single_train_step_(ad, loss_fn, data, ts)
            losses.append(float(loss))
        return losses, _host(ts.parameters), _host(grads)

    cpu_losses, cpu_ps, cpu_grads = train(lx.cpu_device())
    gpu_losses, gpu_ps, _ = train(lx.CUDADevice(0))
    np.testing.assert_allclose(gpu_losses, cpu_losses, rtol=1e-8)
    scale = max(float(np.max(np.abs(p))) for p in lx.tree.leaves(cpu_ps))
    grad_scale = max(float(np.max(np.abs(g))) for g in lx.tree.leaves(cpu_grads))
    for (path, got), (_, want), (_, g) in zip(lx.tree.paths(gpu_ps), lx.tree.paths(cpu_ps), lx.tree.paths(cpu_grads)):
        if np.max(np.abs(g)) > 1e-8 * grad_scale:
            assert _relative_error(got, want, scale) < 1e-6, path
