"""The multi-tensor optimiser step on the simulated device (tests/sim_cupy.py): a few
launches per step whatever the number of leaves, leaves grouped by dtype, the pointer
table kept while the addresses stay, the wrappers (`inject_hyperparams`, `MultiSteps`,
`masked`) and the pure verbs giving the CPU's numbers, and the fallbacks.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

import luxnn as lx
from luxnn import optim

import sim_cupy
from test_distributed import needs_mpi, run_workers
from test_optim_fused import _assert_close, _run_updates, _tree, fused_launches

LAUNCHES = ("kernel", "fill", "cublas")
SCHEDULE = optim.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=50)


@pytest.fixture
def sim_gpu(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    yield lx.gpu_device(force=True)


def _shapes(leaves):
    return ([(8, 8), (8,), ()] * leaves)[:leaves]


def _launches_of_a_warm_step(make, leaves, device):
    """The launches of the second update of a model of `leaves` float32 leaves."""
    rng = np.random.default_rng(0)
    params, grads = device(_tree(rng, np.float32, _shapes(leaves))), device(_tree(rng, np.float32, _shapes(leaves)))
    opt = make()
    state = optim.update_and_apply_(opt, grads, opt.init(params), params)
    with sim_cupy.counting() as counts:
        optim.update_and_apply_(opt, grads, state, params)
    return counts


BUDGETED = {
    "adam": lambda: optim.adam(1e-3),
    "adamw": lambda: optim.adamw(1e-3, mask=lambda ps: lx.tree.map(lambda p: p.ndim > 1, ps)),
    "sgd_momentum": lambda: optim.sgd(0.1, momentum=0.9, nesterov=True),
    "lion": lambda: optim.lion(1e-4),
    "adam_schedule": lambda: optim.adam(SCHEDULE),
    "adamw_schedule": lambda: optim.adamw(SCHEDULE),
    "sgd_momentum_schedule": lambda: optim.sgd(SCHEDULE, momentum=0.9),
    "lion_schedule": lambda: optim.lion(SCHEDULE),
    "clip_adamw": lambda: optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3)),
}


@pytest.mark.parametrize("name", BUDGETED)
def test_an_optimiser_step_launches_at_most_7_kernels_for_any_number_of_leaves(name, sim_gpu):
    few, many = (_launches_of_a_warm_step(BUDGETED[name], leaves, sim_gpu) for leaves in (3, 20))
    total = sum(many[k] for k in LAUNCHES)
    print(f"{name}: {sum(few[k] for k in LAUNCHES)} launches per step with 3 leaves, {total} with 20")
    assert total == sum(few[k] for k in LAUNCHES) <= 7, (few, many)
    # the step's scalars (count, bias corrections, schedule) need no read of the device,
    # and the pointer table of the same arrays is not uploaded again
    assert many["memcpy"] == 0 and many["fill"] == 0, many


def test_the_step_launches_one_kernel_per_dtype_of_the_leaves(sim_gpu):
    dtypes = [np.float32, np.float64, np.float16, np.float32, np.float64]
    make = lambda: optim.adamw(1e-2, weight_decay=0.1)  # noqa: E731

    def run(device):
        rng = np.random.default_rng(1)
        def tree():
            return device({f"w{i}": rng.standard_normal((3, 2)).astype(d) for i, d in enumerate(dtypes)})

        params, opt = tree(), make()
        state = opt.init(params)
        with sim_cupy.counting() as counts:
            for _ in range(3):
                state = optim.update_and_apply_(opt, tree(), state, params)
        return lx.cpu_device()((params, state)), counts

    (cpu, _), (gpu, counts) = run(lx.cpu_device()), run(sim_gpu)
    for dtype in ("float16", "float32", "float64"):
        assert fused_launches(counts, "adam_decay_scale", dtype) == 3
    _assert_close(gpu, cpu, np.float16)  # each leaf to its own dtype's rounding at worst
    for (path, want), (_, got) in zip(lx.tree.paths(cpu), lx.tree.paths(gpu)):
        if want.dtype == np.float64:
            np.testing.assert_allclose(got, want, rtol=1e-12, err_msg=path)


def test_a_non_contiguous_gradient_takes_the_unfused_path_with_the_same_numbers(sim_gpu):
    def run(device):
        rng = np.random.default_rng(2)
        params = device({"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)})
        opt = optim.adamw(1e-2)
        state = opt.init(params)
        with sim_cupy.counting() as counts:
            for _ in range(3):
                grads = device({"w": rng.standard_normal((4, 3)), "b": rng.standard_normal(4)})
                grads["w"] = grads["w"].T  # a transposed view, as a backward pass may give
                state = optim.update_and_apply_(opt, grads, state, params)
        return lx.cpu_device()((params, state)), counts

    (cpu, _), (gpu, counts) = run(lx.cpu_device()), run(sim_gpu)
    assert fused_launches(counts, "adam_decay_scale", np.float64) == 0
    _assert_close(gpu, cpu, np.float64)


def test_set_hyperparams_changes_the_learning_rate_of_the_fused_step(sim_gpu):
    def run(device):
        rng = np.random.default_rng(3)
        params = device(_tree(rng, np.float32))
        opt = optim.inject_hyperparams(optim.adamw)(learning_rate=1e-2, weight_decay=0.1)
        state = opt.init(params)
        with sim_cupy.counting() as counts:
            for lr in (1e-2, 3e-3, 1e-1):
                state = optim.set_hyperparams(state, learning_rate=lr)
                state = optim.update_and_apply_(opt, device(_tree(rng, np.float32)), state, params)
        return lx.cpu_device()((params, state)), counts

    (cpu, _), (gpu, counts) = run(lx.cpu_device()), run(sim_gpu)
    assert fused_launches(counts, "adam_decay_scale", np.float32) == 3
    _assert_close(gpu, cpu, np.float32)


def test_multi_steps_runs_the_fused_step_every_k_gradients(sim_gpu):
    make = lambda: optim.MultiSteps(optim.sgd(_halving_schedule(), momentum=0.9), every_k_schedule=3)  # noqa: E731
    cpu = _run_updates(make(), lx.cpu_device(), np.float32, steps=7)
    with sim_cupy.counting() as counts:
        gpu = _run_updates(make(), sim_gpu, np.float32, steps=7)
    assert fused_launches(counts, "trace_scale", np.float32) == 2  # after gradients 3 and 6
    _assert_close(gpu, cpu, np.float32)


def _halving_schedule():
    return optim.exponential_decay(0.1, 1, 0.5)


@pytest.mark.parametrize("make", [lambda: optim.adamw(SCHEDULE), lambda: optim.sgd(0.1, momentum=0.9),
                                  lambda: optim.lion(1e-3)])
@pytest.mark.parametrize("verb", ["update", "update_"])
def test_the_pure_and_in_place_verbs_give_the_cpus_numbers_on_the_device(make, verb, sim_gpu):
    def run(device):
        rng = np.random.default_rng(4)
        params = device(_tree(rng, np.float32))
        opt = make()
        state = opt.init(params)
        for _ in range(3):
            updates, state = getattr(opt, verb)(device(_tree(rng, np.float32)), state, params)
            params = optim.apply_updates(params, updates)
        return lx.cpu_device()((params, state))

    _assert_close(run(sim_gpu), run(lx.cpu_device()), np.float32)


def test_a_state_made_elsewhere_reads_its_count_once_for_the_schedule(sim_gpu):
    """A copied state's counts are new arrays of unknown value: read once, then followed."""
    rng = np.random.default_rng(5)
    params = sim_gpu(_tree(rng, np.float32))
    opt = optim.adam(SCHEDULE)
    state = opt.init(params)
    grads = sim_gpu(_tree(rng, np.float32))
    for _ in range(3):
        state = optim.update_and_apply_(opt, grads, state, params)
    copied = lx.tree.map(lambda a: a.copy(), state)  # e.g. a loaded checkpoint
    reference = lx.tree.map(lambda a: a.copy(), params)
    with sim_cupy.counting() as counts:
        copied = optim.update_and_apply_(opt, grads, copied, params)
        optim.update_and_apply_(opt, grads, copied, params)
    assert counts["memcpy", "device_to_host"] == 1  # the schedule's count, read once
    # the same two updates from the original state
    state = optim.update_and_apply_(opt, grads, state, reference)
    optim.update_and_apply_(opt, grads, state, reference)
    _assert_close(lx.cpu_device()(params), lx.cpu_device()(reference), np.float32)


def test_parameters_that_are_views_of_one_flat_buffer_are_updated_through_their_own_pointers(sim_gpu):
    def run(device):
        rng = np.random.default_rng(6)
        flat = device(rng.standard_normal(30))
        params = {"w": flat[:12].reshape(3, 4), "b": flat[12:16], "c": flat[16:30].reshape(2, 7)}
        opt = optim.adamw(1e-2, weight_decay=0.1)
        state = opt.init(params)
        with sim_cupy.counting() as counts:
            for _ in range(3):
                grads = device({"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4),
                                "c": rng.standard_normal((2, 7))})
                state = optim.update_and_apply_(opt, grads, state, params)
        return lx.cpu_device()((flat, state)), counts

    (cpu, _), (gpu, counts) = run(lx.cpu_device()), run(sim_gpu)
    assert fused_launches(counts, "adam_decay_scale", np.float64) == 3
    _assert_close(gpu, cpu, np.float64)


@needs_mpi
def test_a_count_overwritten_by_a_collective_is_not_taken_at_its_old_value_by_a_schedule():
    """Rank 1's state replaced by rank 0's (`bcast_`, `synchronize`) on the simulated
    device: its schedule runs at rank 0's count (the worker compares the ranks' steps)."""
    done = run_workers("count_mirror.py", timeout=120)
    assert done.returncode == 0, done.stdout[-4000:]
    for case in ("sgd after bcast_", "sgd after synchronize", "adamw after bcast_", "adamw after synchronize"):
        assert all(f"rank {r}: PASS {case}" in done.stdout for r in (0, 1)), done.stdout[-4000:]


def test_a_count_said_to_be_overwritten_is_read_again_for_the_schedule(sim_gpu):
    rng = np.random.default_rng(8)
    params, grads = sim_gpu(_tree(rng, np.float32)), sim_gpu(_tree(rng, np.float32))
    opt = optim.sgd(_halving_schedule())
    state = opt.init(params)
    optim.arrays.overwritten(state)
    lx.tree.leaves(state)[0][...] = 3  # the count of `scale_by_schedule`, written in place
    before = lx.cpu_device()(params)
    optim.update_and_apply_(opt, grads, state, params)
    for key, p in lx.cpu_device()(params).items():  # the learning rate of step 3: 0.1 / 8
        _assert_close(p, before[key] - np.float32(0.1 / 8) * lx.cpu_device()(grads)[key], np.float32)


def test_leaves_of_a_dtype_the_kernels_do_not_take_fall_back_for_every_leaf(sim_gpu):
    """A complex leaf beside a float32 one: the per-operation path updates both, as on the CPU."""
    def run(device):
        rng = np.random.default_rng(9)
        def tree():
            return device({"w": rng.standard_normal((3, 2)).astype(np.float32),
                           "z": (rng.standard_normal(2) + 1j * rng.standard_normal(2)).astype(np.complex64)})

        params, opt = tree(), optim.sgd(0.1, momentum=0.9)
        state = opt.init(params)
        for _ in range(3):
            state = optim.update_and_apply_(opt, tree(), state, params)
        return lx.cpu_device()((params, state))

    _assert_close(run(sim_gpu), run(lx.cpu_device()), np.float32)


def test_a_kernel_that_does_not_compile_leaves_every_leaf_and_the_count_as_they_were(sim_gpu, monkeypatch):
    """The float64 leaves' kernel fails to compile: the float32 leaves, launched first
    otherwise, are not updated either."""
    def compile_float64_fails(kernel, log_stream=None):
        if "float64" in kernel.name:
            raise RuntimeError(f"simulated compile error in {kernel.name}")

    monkeypatch.setattr(sim_cupy.RawKernel, "compile", compile_float64_fails)
    monkeypatch.setattr(optim.fused, "_COMPILED", set(), raising=False)  # compiled again
    rng = np.random.default_rng(10)
    def tree():
        return sim_gpu({"a": rng.standard_normal(3).astype(np.float32), "b": rng.standard_normal(3)})

    params, opt = tree(), optim.adamw(optim.exponential_decay(1e-2, 1, 0.5))
    state = opt.init(params)
    before = lx.cpu_device()((params, state))
    with pytest.raises(RuntimeError, match="simulated compile error"):
        optim.update_and_apply_(opt, tree(), state, params)
    for (path, want), (_, got) in zip(lx.tree.paths(before), lx.tree.paths(lx.cpu_device()((params, state)))):
        np.testing.assert_array_equal(got, want, err_msg=path)


@pytest.mark.parametrize("make", [optim.scale_by_adam, optim.scale_by_lion])
@pytest.mark.parametrize("count", ["numpy", "int32"])
def test_a_count_of_another_module_or_dtype_gives_the_cpus_numbers(make, count, sim_gpu):
    """A state whose count is a NumPy array, or an int32 one (made by hand, loaded)."""
    def run(device):
        rng = np.random.default_rng(11)
        params = device(_tree(rng, np.float32))
        opt = make()
        state = opt.init(params)
        state = state._replace(count=np.zeros((), np.int64) if count == "numpy" else device(np.zeros((), np.int32)))
        for _ in range(3):
            state = optim.update_and_apply_(opt, device(_tree(rng, np.float32)), state, params)
        return lx.cpu_device()((params, state.mu, int(state.count)))

    gpu, cpu = run(sim_gpu), run(lx.cpu_device())
    _assert_close(gpu[:2], cpu[:2], np.float32)
    assert gpu[2] == cpu[2] == 3


@pytest.mark.parametrize("case", ["one more", "shapes swapped"])
def test_into_of_another_length_or_shapes_than_the_gradients_raises_as_on_the_cpu(case, sim_gpu):
    for device in (lx.cpu_device(), sim_gpu):
        rng = np.random.default_rng(12)
        params, grads = device(_tree(rng, np.float32, [(3,), (2, 2)])), device(_tree(rng, np.float32, [(3,), (2, 2)]))
        opt = optim.sgd(0.1, momentum=0.9)
        into = lx.tree.leaves(params)
        into, error = (into + into[:1], "one array per leaf of grads") if case == "one more" else (into[::-1], "broadcast")
        with pytest.raises(ValueError, match=error):
            optim.update_into(opt, grads, opt.init(params), params, into)


def test_a_schedule_gets_the_count_as_on_the_cpu(sim_gpu):
    """A 0-d int64 NumPy array on both devices: ``1 / count`` at step 0 is inf (then
    refused as a learning rate) on both, not a ZeroDivisionError on one."""
    seen = []

    def inverse(count):
        seen.append((type(count), count.dtype, count.shape))
        with np.errstate(divide="ignore"):
            return 1.0 / count

    errors = []
    for device in (lx.cpu_device(), sim_gpu):
        params = device({"w": np.ones(3)})
        opt = optim.sgd(inverse)
        with pytest.raises(Exception) as raised:
            optim.update_and_apply_(opt, device({"w": np.ones(3)}), opt.init(params), params)
        errors.append((type(raised.value), str(raised.value)))
    assert errors[0] == errors[1] and errors[0][0] is ValueError, errors
    assert seen and all(s == (np.ndarray, np.dtype(np.int64), ()) for s in seen), seen


@pytest.mark.parametrize("make", [lambda f: optim.MultiSteps(optim.sgd(0.1), every_k_schedule=lambda c: f(c) or 2),
                                  lambda f: optim.inject_hyperparams(optim.sgd)(learning_rate=lambda c: f(c) or 0.1)])
def test_the_schedules_of_the_wrappers_get_the_count_as_on_the_cpu(make, sim_gpu):
    seen = {}
    for device in (lx.cpu_device(), sim_gpu):
        params = device({"w": np.ones(3)})
        opt = make(lambda count: seen.setdefault(device, []).append((type(count), count.dtype, count.shape)))
        state = opt.init(params)
        for _ in range(2):
            state = optim.update_and_apply_(opt, device({"w": np.ones(3)}), state, params)
    assert seen[sim_gpu] == seen[lx.cpu_device()] and seen[sim_gpu][0] == (np.ndarray, np.dtype(np.int64), ()), seen


def test_the_pointer_table_is_uploaded_again_on_another_stream(sim_gpu):
    """A table uploaded on one stream is not ready on another before that stream's copy."""
    rng = np.random.default_rng(13)
    params, grads = sim_gpu(_tree(rng, np.float32)), sim_gpu(_tree(rng, np.float32))
    opt = optim.sgd(0.1, momentum=0.9)
    state = optim.update_and_apply_(opt, grads, opt.init(params), params)
    with sim_cupy.counting() as same_stream:
        state = optim.update_and_apply_(opt, grads, state, params)
    with sim_cupy.cuda.Stream(), sim_cupy.counting() as other_stream:
        optim.update_and_apply_(opt, grads, state, params)
    assert same_stream["memcpy"] == 0 and other_stream["memcpy", "host_to_device"] == 1, (same_stream, other_stream)
