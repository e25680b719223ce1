"""The optimisers' fused GPU updates (`FusedUpdate`, `luxnn.optim.fused`): a chain of
elementwise stages (Adam, `trace`, Lion, decayed weights, a learning rate, a global-norm
clip) composed into one kernel over every leaf of a dtype, on the simulated device of
tests/sim_cupy.py (the kernel run by its NumPy twin, through the table's pointers,
launches counted) against the CPU path, and on a real GPU when one is present.

What the simulator cannot tell: whether the CUDA source computes what its twin does (the
`gpu` tests below, skipped without a GPU), nor whether it compiles (`test_..._compiles`,
with nvcc where it is installed).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn import memory, optim
from luxnn.optim import fused
from luxnn.optim.adam import ADAM_FRAGMENT
from luxnn.optim.arithmetic import times
from luxnn.optim.clipping import CLIP_FRAGMENT
from luxnn.optim.decay_noise import DECAY_FRAGMENT
from luxnn.optim.lion import LION_FRAGMENT
from luxnn.optim.momentum import TRACE_FRAGMENT

import sim_cupy
from test_memory_cuda import FakeDriver

LEAF_SHAPES = [(3, 4), (4,), (), (2, 3, 2, 2), (0,), (7, 5)]  # matrices, vectors, 0-d and empty leaves, a 4-d kernel


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


def _assert_close(got, want, dtype, rtol=None):
    # float64 to 1e-12; float32 (and the float32 moments of float16) to a few roundings
    rtol = rtol or {np.float64: 1e-12, np.float32: 4e-7, np.float16: 2e-3}[np.dtype(dtype).type]
    for (path, w), (_, g) in zip(lx.tree.paths(want), lx.tree.paths(got)):
        assert g.dtype == w.dtype and g.shape == w.shape, path
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * 1e-3, err_msg=path)


def fused_launches(counts, fragments, dtype):
    """The launches in `counts` (`sim_cupy.counting`) of the fused kernels of `fragments`
    (their names joined by "_") for leaves of `dtype`, whatever the hash of their source."""
    stem = f"luxnn_fused_{fragments}_{np.dtype(dtype).name}_"
    return sum(n for key, n in counts.items() if isinstance(key, tuple) and key[0] == "kernel"
               and key[1].startswith(stem) and len(key[1]) == len(stem) + 12)


def _halving(value):
    return optim.exponential_decay(value, 2, 0.5)


def _matrices(params):
    return lx.tree.map(lambda p: p.ndim > 1, params)


# name: (the optimiser, the fragments its fused kernel composes)
OPTIMISERS = {
    "adam": (lambda: optim.adam(1e-2), "adam"),
    "nadam": (lambda: optim.adam(1e-2, nesterov=True), "adam"),
    "adam_eps_root": (lambda: optim.adam(1e-2, eps_root=1e-6), "adam"),
    "adam_schedule": (lambda: optim.adam(_halving(1e-2)), "adam"),
    "scale_by_adam": (lambda: optim.scale_by_adam(), "adam"),
    "adamw": (lambda: optim.adamw(1e-2, weight_decay=0.1), "adam_decay_scale"),
    "adamw_masked": (lambda: optim.adamw(1e-2, weight_decay=0.1, mask=_matrices), "adam_decay_scale"),
    "nadamw_schedule": (lambda: optim.nadamw(_halving(1e-2), weight_decay=0.1), "adam_decay_scale"),
    "sgd": (lambda: optim.sgd(0.1), "scale"),
    "sgd_momentum": (lambda: optim.sgd(0.1, momentum=0.9), "trace_scale"),
    "sgd_nesterov": (lambda: optim.sgd(0.1, momentum=0.9, nesterov=True), "trace_scale"),
    "sgd_schedule": (lambda: optim.sgd(_halving(0.1), momentum=0.9), "trace_scale"),
    "sgd_weight_decay": (lambda: optim.chain(optim.add_decayed_weights(1e-2), optim.sgd(0.1, momentum=0.9)),
                         "decay_trace_scale"),
    "trace": (lambda: optim.trace(0.9), "trace"),
    "lion": (lambda: optim.lion(1e-3, weight_decay=0.1, mask=_matrices), "lion_decay_scale"),
    "lion_schedule": (
        lambda: optim.chain(optim.scale_by_lion(0.8, 0.95), optim.scale_by_learning_rate(_halving(1e-3))), "lion_scale"
    ),
    "scale_by_lion": (lambda: optim.scale_by_lion(), "lion"),
    "clip_adamw": (lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2)), "clip_adam_decay_scale"),
    # the norm of the selected leaves only, as `masked`'s inner transformation sees them
    "clip_masked_sgd": (lambda: optim.chain(optim.masked(optim.clip_by_global_norm(1.0), _matrices), optim.sgd(0.1)),
                        "clip_scale"),
}


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("name", OPTIMISERS)
def test_the_fused_update_gives_the_cpus_parameters_and_moments(name, dtype, sim_gpu):
    make, fragments = OPTIMISERS[name]
    cpu = _run_updates(make(), lx.cpu_device(), dtype)
    with sim_cupy.counting() as counts:
        gpu = _run_updates(make(), sim_gpu, dtype)
    assert fused_launches(counts, fragments, dtype) == 5  # one launch a step, every leaf
    # the global norm summed in double on the device, in float32 by BLAS on the CPU
    _assert_close(gpu, cpu, dtype, rtol=4e-6 if name.startswith("clip") and dtype == np.float32 else None)
    moment_dtypes = {m.dtype for m in lx.tree.leaves(gpu[1]) if m.dtype.kind == "f"}
    assert moment_dtypes <= {np.dtype(np.float32 if dtype == np.float16 else dtype)}  # float16: float32 moments


def test_leaves_longer_than_a_block_are_cut_into_chunks_that_cover_them(sim_gpu):
    shapes = [(fused.CHUNK * 2 + 5,), (3,), (fused.CHUNK,)]  # 3 + 1 + 1 blocks
    make = lambda: optim.chain(optim.clip_by_global_norm(50.0), optim.adamw(1e-2))  # noqa: E731
    cpu = _run_updates(make(), lx.cpu_device(), np.float64, steps=2, shapes=shapes)
    gpu = _run_updates(make(), sim_gpu, np.float64, steps=2, shapes=shapes)
    _assert_close(gpu, cpu, np.float64)


def test_a_pointer_table_in_use_outlives_any_number_of_tables_made_once(sim_gpu):
    place = (sim_cupy, 0, sim_cupy.cuda.get_current_stream().ptr)
    table, _ = fused._table(place, [[4, 1, 4096, 8192, 12288]])
    for k in range(2 * fused._KEPT_TABLES):  # a step's addresses moving for a while: one table each
        fused._table(place, [[4, 1, 4096 + 512 * (k + 1), 8192, 12288]])
        again, _ = fused._table(place, [[4, 1, 4096, 8192, 12288]])
        assert again is table  # not uploaded again


def test_single_train_step_with_adamw_trains_as_on_the_cpu(sim_gpu):
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
        ts = lx.TrainState(model, ps, st, optim.adamw(1e-2, weight_decay=0.1), allocator_cache=cache)
        for _ in range(5):
            _, _, _, ts = lx.single_train_step_(lx.AutoTape(), lx.losses.CrossEntropyLoss(), batch, ts)
        results.append(lx.cpu_device()((ts.parameters, ts.optimizer_state)))
    _assert_close(results[1], results[0], np.float64)


def _unchanged_after(update, params, state):
    """Run `update` (which must raise ValueError) and check nothing was launched or written."""
    before = lx.cpu_device()((params, state))
    with sim_cupy.counting() as counts, pytest.raises(ValueError) as raised:
        update()
    assert not any("luxnn_" in key[1] for key in counts if isinstance(key, tuple)), counts
    after = lx.cpu_device()((params, state))
    for (path, b), (_, a) in zip(lx.tree.paths(before), lx.tree.paths(after)):
        np.testing.assert_array_equal(a, b, err_msg=path)
    return str(raised.value)


@pytest.mark.parametrize("make", [lambda: optim.adamw(lambda count: float("nan")),
                                  lambda: optim.sgd(lambda count: float("inf"), momentum=0.9)])
def test_a_bad_learning_rate_raises_before_the_fused_kernel_writes_anything(make, sim_gpu):
    rng = np.random.default_rng(0)
    params, grads = sim_gpu(_tree(rng, np.float32)), sim_gpu(_tree(rng, np.float32))
    opt = make()
    state = opt.init(params)
    message = _unchanged_after(lambda: optim.update_and_apply_(opt, grads, state, params), params, state)
    assert "learning rate schedule" in message and "finite number" in message


def test_an_injected_hyperparameter_out_of_its_domain_raises_before_anything_is_written(sim_gpu):
    rng = np.random.default_rng(0)
    params, grads = sim_gpu(_tree(rng, np.float32)), sim_gpu(_tree(rng, np.float32))
    opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-2)
    state = optim.set_hyperparams(opt.init(params), b1=1.5)  # checked at the next update
    message = _unchanged_after(lambda: optim.update_and_apply_(opt, grads, state, params), params, state)
    assert "b1" in message


def test_gradients_that_do_not_match_the_parameters_change_nothing(sim_gpu):
    rng = np.random.default_rng(0)
    params = sim_gpu(_tree(rng, np.float32))
    opt = optim.adamw(1e-2)
    state = opt.init(params)
    wrong = sim_gpu(_tree(rng, np.float32, LEAF_SHAPES[:-1] + [(5, 7)]))
    message = _unchanged_after(lambda: optim.update_and_apply_(opt, wrong, state, params), params, state)
    assert "w5" in message
    other = sim_gpu(_tree(rng, np.float32, LEAF_SHAPES[:-1]))  # a state of another tree
    message = _unchanged_after(lambda: optim.update_and_apply_(opt, params, opt.init(other), params), params, state)
    assert "optimizer state" in message


def test_a_state_of_another_optimizer_is_refused_on_the_device(sim_gpu):
    params = sim_gpu(_tree(np.random.default_rng(0), np.float32))
    with pytest.raises(ValueError, match="ScaleByAdamState, got one of type TraceState"):
        optim.update_and_apply_(optim.scale_by_adam(), params, optim.trace(0.9).init(params), params)


def _negate_step_twin(*, dtype):
    return None


NEGATE = fused.Fragment("test_negate", "", "u = (P)(-(T)u);", _negate_step_twin, lambda constants, u, p: -u)


class _Negate(optim.Stateless, optim.FusedUpdate):
    """A user's stage declaring its fragment: it fuses with the built-in ones."""

    def update(self, grads, state, params=None):
        return lx.tree.map(lambda g: -g, grads), state

    def fused_step(self, grads, state, params, factor=1.0):
        return fused.FusedStep(NEGATE, (), ()), state


def test_a_users_stage_that_declares_a_fragment_fuses_with_the_built_in_ones(sim_gpu):
    negate = _Negate()
    make = lambda: optim.chain(optim.GradientTransformation(negate.init, negate.update), optim.adam(1e-2))  # noqa: E731
    cpu = _run_updates(make(), lx.cpu_device(), np.float32)
    with sim_cupy.counting() as counts:
        gpu = _run_updates(make(), sim_gpu, np.float32)
    assert fused_launches(counts, "test_negate_adam", np.float32) == 5
    _assert_close(gpu, cpu, np.float32)


# A user's fragment of the name of a built-in one (`fused.SCALE_FRAGMENT`), of other code.
NEGATED_SCALE = fused.Fragment("scale", fused.SCALE_FRAGMENT.params, "u = (P)(-mul((T)u, $t_factor));",
                               fused.SCALE_FRAGMENT.step_twin, lambda factor, u, p: -times(u, factor),
                               prologue=fused.SCALE_FRAGMENT.prologue)


class _NegatedScale(optim.Stateless, optim.FusedUpdate):
    def update(self, grads, state, params=None):
        return lx.tree.map(lambda g: -(g * 0.25), grads), state

    def fused_step(self, grads, state, params, factor=1.0):
        return fused.FusedStep(NEGATED_SCALE, (), fused.factor_arguments(0.25)), state


def test_a_users_fragment_named_as_a_built_in_one_runs_its_own_kernel(sim_gpu):
    _run_updates(optim.sgd(0.5), sim_gpu, np.float32, steps=1)  # the built-in kernel of that name made
    stage = _NegatedScale()
    make = lambda: optim.GradientTransformation(stage.init, stage.update)  # noqa: E731
    cpu = _run_updates(make(), lx.cpu_device(), np.float32, steps=2)
    with sim_cupy.counting() as counts:
        gpu = _run_updates(make(), sim_gpu, np.float32, steps=2)
    _assert_close(gpu, cpu, np.float32)
    assert fused_launches(counts, "scale", np.float32) == 2


def _times_k_step_twin(k, *, dtype):
    TIMES_K_ARGUMENTS.append(k)
    return k


TIMES_K_ARGUMENTS = []  # what the kernel was given for its `const int $k`
TIMES_K = fused.Fragment("test_times_k", "const int $k", "u = (P)((T)u * (T)$k);", _times_k_step_twin,
                         lambda k, u, p: u * u.dtype.type(k))


class _TimesK(optim.Stateless, optim.FusedUpdate):
    def update(self, grads, state, params=None):
        return lx.tree.map(lambda g: g * g.dtype.type(3), grads), state

    def fused_step(self, grads, state, params, factor=1.0):
        return fused.FusedStep(TIMES_K, (), (3,)), state


def test_a_fragments_arguments_are_passed_as_its_parameters_declare(sim_gpu):
    stage = _TimesK()
    make = lambda: optim.GradientTransformation(stage.init, stage.update)  # noqa: E731
    cpu = _run_updates(make(), lx.cpu_device(), np.float32, steps=2)
    TIMES_K_ARGUMENTS.clear()
    gpu = _run_updates(make(), sim_gpu, np.float32, steps=2)
    _assert_close(gpu, cpu, np.float32)
    assert [type(k) for k in TIMES_K_ARGUMENTS] == [np.int32, np.int32]  # an int, not a double, in an int's place


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
def test_a_stage_that_declares_a_kernel_update_is_used_on_the_gpu_only(chained, sim_gpu):
    stage = _Doubling()
    opt = optim.GradientTransformation(stage.init, stage.update)
    if chained:
        opt = optim.chain(optim.identity(), opt)  # the last stage adds its updates
    for device in (lx.cpu_device(), sim_gpu):
        params = device({"w": np.ones(3)})
        optim.update_and_apply_(opt, device({"w": np.ones(3)}), opt.init(params), params)
        assert lx.cpu_device()(params)["w"].tolist() == [3.0] * 3
    assert stage.ran == ["update_into", ("kernel", 1.0)]


FRAGMENTS = {f.name: f for f in (ADAM_FRAGMENT, LION_FRAGMENT, TRACE_FRAGMENT, DECAY_FRAGMENT, CLIP_FRAGMENT,
                                  fused.SCALE_FRAGMENT)}


def _sources():
    """The CUDA source of each fused kernel of OPTIMISERS and of the reduction, one
    translation unit per dtype (the kernels of a dtype share their header)."""
    kernels = [fused.composed(tuple(FRAGMENTS[n] for n in names.split("_")), dtype)
               for _, names in OPTIMISERS.values() for dtype in (np.float16, np.float32, np.float64)]
    units: dict = {}
    for kernel in {k.name: k for k in [*kernels, *fused.SUM_OF_SQUARES.values()]}.values():
        header, body = kernel.code.split('extern "C"', 1)
        unit = units.setdefault(header, [header])
        unit.append('extern "C"' + body)
    return ["".join(unit) for unit in units.values()]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc, the CUDA compiler, to compile the kernels")
def test_every_fused_kernel_compiles(tmp_path):
    files = []
    for i, code in enumerate(_sources()):
        files.append(tmp_path / f"unit{i}.cu")
        files[-1].write_text(code)
    done = subprocess.run(["nvcc", "-ptx", "-arch=sm_90", *map(str, files)], cwd=tmp_path, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert len(files) == 3  # float16, float32, float64


def test_the_fused_kernels_on_a_gpu_give_the_cpus_numbers(gpu):
    """On a real GPU: the CUDA source against the CPU path (float32 to a few roundings)."""
    for name, (make, _) in OPTIMISERS.items():
        for dtype in (np.float64, np.float32, np.float16):
            cpu = _run_updates(make(), lx.cpu_device(), dtype)
            rtol = 4e-6 if name.startswith("clip") and dtype == np.float32 else None
            _assert_close(_run_updates(make(), gpu, dtype), cpu, dtype, rtol=rtol)


def test_one_adam_step_of_a_20_leaf_model_launches_one_kernel_on_a_gpu(gpu):
    """On a real GPU, counted by torch.profiler (CUPTI sees CuPy's kernels too)."""
    torch = pytest.importorskip("torch", reason="needs torch to count the GPU's kernels with its profiler")
    if not torch.cuda.is_available():
        pytest.skip("needs torch built with CUDA to count the GPU's kernels with its profiler")
    import cupy

    rng = np.random.default_rng(0)
    shapes = [(64, 64), (64,)] * 10
    params, grads = gpu(_tree(rng, np.float32, shapes)), gpu(_tree(rng, np.float32, shapes))
    opt = optim.adam(1e-3)
    state = optim.update_and_apply_(opt, grads, opt.init(params), params)  # compiled, the table uploaded
    cupy.cuda.Device().synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        optim.update_and_apply_(opt, grads, state, params)
        cupy.cuda.Device().synchronize()
    kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA and "emcpy" not in e.name]
    assert len(kernels) == 1, [e.name for e in kernels]
