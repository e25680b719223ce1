"""Blocked, multi-threaded NumPy kernels (luxnn.parallel) and the kernels that use them."""

import ctypes
import functools
import sys
import threading
import time
import weakref

import numpy as np
import pytest
import threadpoolctl

import luxnn as lx
from luxnn import memory, ops
from luxnn import _blas, _contention, parallel
from luxnn.ops.attention import attention_combine, attention_weights
from luxnn.ops.recurrent import gru_sequence, rnn_sequence

MiB = 1 << 20


def test_blocks_cover_the_leading_axis_once_and_run_on_several_threads(threads):
    threads(3)
    like = np.empty((1000, 1024), np.float32)  # 4 MiB: four blocks of 1 MiB
    seen, names = [], set()
    lock = threading.Lock()

    def kernel(lo, hi):
        with lock:
            seen.append((lo, hi))
            names.add(threading.current_thread().name)

    parallel.for_blocks(kernel, like)
    covered = sorted(seen)
    assert covered[0][0] == 0 and covered[-1][1] == 1000
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
    assert len(covered) > 1
    assert len(names) > 1
    seen.clear()
    parallel.for_blocks(kernel, like, rows=300)  # four blocks of 250 rows, not 300, 300, 300 and 100
    assert sorted(seen) == [(0, 250), (250, 500), (500, 750), (750, 1000)]


def test_an_empty_leading_axis_is_one_empty_block(threads):
    threads(3)
    calls = []
    parallel.for_blocks(lambda lo, hi: calls.append((lo, hi)), np.empty((0, 4)), rows=2, blas=True)
    parallel.for_blocks(lambda lo, hi: calls.append((lo, hi)), np.empty((0, 4)))
    assert calls == [(0, 0), (0, 0)]


def test_no_thread_keeps_a_kernel_or_its_arrays_alive_once_the_blocks_are_done(threads):
    threads(2)
    like = np.zeros((4, MiB // 4), np.float32)  # four blocks: some run on the worker
    alive = weakref.ref(like)

    def add_one(a, lo, hi):
        a[lo:hi] += 1

    kernel = functools.partial(add_one, like)  # holds the array itself, as a closure's cell would
    parallel.for_blocks(kernel, like)
    assert like.min() == 1
    del kernel, like
    assert alive() is None  # the worker waiting for its next task holds nothing of this one


def test_small_arrays_and_a_single_thread_run_on_the_caller(threads):
    caller = {threading.current_thread().name}
    for count, like in ((4, np.empty((100, 10))), (1, np.empty((4 * MiB // 8, 1)))):
        threads(count)
        names = set()
        parallel.for_blocks(lambda lo, hi: names.add(threading.current_thread().name), like)
        assert names == caller


def test_an_exception_in_any_block_is_raised_after_every_block_finished(threads):
    threads(2)
    like = np.empty((8, MiB // 4), np.float32)  # 8 blocks of 1 MiB
    done = []

    def kernel(lo, hi):
        if lo == 7:
            raise ValueError("block 7")
        done.append(lo)

    with pytest.raises(ValueError, match="block 7"):
        parallel.for_blocks(kernel, like)
    assert sorted(done) == list(range(7))


def test_a_kernel_inside_a_kernel_runs_serially_instead_of_waiting_on_the_pool(threads):
    threads(2)
    outer, inner = np.empty((8, MiB // 4), np.float32), np.empty((4, MiB // 4), np.float32)
    count = []
    parallel.for_blocks(lambda lo, hi: parallel.for_blocks(lambda a, b: count.append(1), inner), outer)
    assert len(count) == 8 * 4


def test_a_product_in_any_share_of_a_kernel_is_not_cut_again(threads, monkeypatch):
    threads(2)
    monkeypatch.setattr(parallel, "_CUT_MADDS", 1)  # a product the caller alone would cut
    submitted = []
    submit = parallel._Workers.submit
    monkeypatch.setattr(parallel._Workers, "submit", lambda self, run: submitted.append(1) or submit(self, run))
    a, b = np.ones((2, 64, 64)), np.ones((64, 64))
    out = np.empty_like(a)

    def products(lo, hi):
        parallel.matmul(a[lo:hi], b, out=out[lo:hi])

    parallel.for_blocks(products, a, rows=1)
    assert len(submitted) == 1  # the second share, and nothing from within either share
    assert (out == 64).all()


def test_blocks_allocate_from_the_callers_cache(threads):
    threads(2)
    cache = memory.AllocCache()
    like = np.empty((8, MiB // 4), np.float32)
    handlers = []
    lock = threading.Lock()

    def kernel(lo, hi):
        np.ones(1000)
        with lock:
            handlers.append(np._core.multiarray.get_handler_name())

    with memory.cached(cache):
        parallel.for_blocks(kernel, like)
    assert handlers == ["luxnn_cache"] * 8
    parallel.for_blocks(kernel, like)
    assert handlers[8:] == ["default_allocator"] * 8


def test_changing_the_thread_count_retires_the_old_threads(threads):
    like = np.empty((8, MiB // 4), np.float32)
    for count in (4, 2, 3):
        threads(count)
        parallel.for_blocks(lambda lo, hi: None, like)
    threads(2)
    parallel.for_blocks(lambda lo, hi: None, like)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(kernel_threads()) != 1:
        time.sleep(0.01)
    assert len(kernel_threads()) == 1  # the caller and one worker: two threads


def kernel_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("luxnn-kernel")]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_set_num_threads_rejects_anything_but_a_positive_int(bad, threads):
    before = parallel.num_threads()
    with pytest.raises(ValueError, match="positive int"):
        parallel.set_num_threads(bad)
    assert parallel.num_threads() == before


# ---- matmul cut across threads ------------------------------------------------------------

def blas_threads() -> list[int]:
    """NumPy's BLAS threads (PyTorch, once imported, brings a BLAS of its own)."""
    return [p["num_threads"] for p in threadpoolctl.threadpool_info() if p["user_api"] == "blas" and "numpy" in p["filepath"]]


def assert_product_close(got, a, b):
    """`got` is ``a @ b`` up to rounding in any summation order: each element within twice
    the bound of a dot product's error in floating point, ``k * eps * (|a| @ |b|)``
    (Higham, Accuracy and Stability of Numerical Algorithms, 3.1), so that no BLAS kernel
    or thread split can fail it and a wrong element cannot pass it."""
    want = np.matmul(a, b)
    bound = 2 * a.shape[-1] * np.finfo(want.dtype).eps * np.matmul(np.abs(a), np.abs(b))
    assert got.shape == want.shape and got.dtype == want.dtype
    excess = np.abs(got - want) - bound
    assert (excess <= 0).all(), f"{(excess > 0).sum()} elements off by up to {excess.max()} beyond the bound"


MATMUL_SHAPES = [
    ((512, 300), (300, 200)),  # rows of a
    ((300, 4096), (4096, 64)),  # a weight gradient: few rows, a long reduction
    ((32, 8, 128, 32), (32, 8, 32, 128)),  # stacked: the leading axis
    ((1, 4096, 288), (1, 288, 64)),  # a stack of one: rows again
    ((64, 96, 80), (80, 70)),  # a stack times one matrix
]


@pytest.mark.parametrize("shapes", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matmul_agrees_with_numpy_and_leaves_blas_threads_as_they_were(shapes, dtype, threads, monkeypatch):
    threads(3)
    monkeypatch.setattr(parallel, "_CUT_MADDS", 1)  # cut these small products too
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal(s).astype(dtype) for s in shapes)
    assert parallel._cuttable(a, b) or parallel._set_blas_threads is None  # the threaded path
    before = blas_threads()
    got = parallel.matmul(a, b)
    assert blas_threads() == before
    assert_product_close(got, a, b)


def test_matmul_writes_into_a_strided_out_and_falls_back_for_what_it_cannot_cut(threads, monkeypatch):
    threads(2)
    monkeypatch.setattr(parallel, "_CUT_MADDS", 1)
    rng = np.random.default_rng(1)
    a, b = rng.standard_normal((1, 2048, 300)), rng.standard_normal((1, 300, 40))
    whole = np.zeros((2048, 80))
    out = whole[None, :, 20:60]
    assert parallel.matmul(a, b, out=out) is out
    assert_product_close(whole[None, :, 20:60], a, b)
    assert not whole[:, :20].any() and not whole[:, 60:].any()
    # Broadcast stacks, vectors and small products: np.matmul itself.
    broadcast = rng.standard_normal((4, 1, 600, 300)), rng.standard_normal((3, 300, 300))
    vector = rng.standard_normal(300), rng.standard_normal((300, 3))
    for x, y in (broadcast, vector):
        assert_product_close(parallel.matmul(x, y), x, y)


def test_products_cut_or_held_in_several_threads_at_once_restore_the_blas_threads(machine, threads, monkeypatch):
    threads(2)
    monkeypatch.setattr(parallel, "_CUT_MADDS", 1)
    before = blas_threads()
    a, b = np.ones((256, 64)), np.ones((64, 64))
    v, m = np.ones(1024), np.ones((1024, 512))  # a vector: not cut, held to one thread
    errors = []

    def products():
        try:
            for _ in range(200):
                assert parallel.matmul(a, b)[0, 0] == 64
                assert parallel.matmul(v, m)[0] == 1024
        except AssertionError as e:
            errors.append(e)

    workers = [threading.Thread(target=products) for _ in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors
    assert blas_threads() == before and _blas.holds() == 0


def test_a_step_holds_the_blas_to_one_thread_from_its_first_threaded_kernel_to_its_end(threads):
    if parallel._set_blas_threads is None:
        pytest.skip("NumPy's BLAS is not an OpenBLAS whose threads luxnn can set")
    threads(2)
    before = blas_threads()
    like = np.empty((4, MiB // 4), np.float32)  # 4 blocks
    with parallel.step():
        assert blas_threads() == before  # nothing threaded yet: the BLAS as it was
        parallel.for_blocks(lambda lo, hi: None, like)
        assert blas_threads() == [1] * len(before)
        parallel.for_blocks(lambda lo, hi: None, like)
    assert blas_threads() == before
    with parallel.step():
        parallel.for_blocks(lambda lo, hi: None, np.empty(10))  # one block, on the caller
        assert blas_threads() == before


def test_attention_on_one_sequence_shares_its_heads_out(threads, monkeypatch):
    from luxnn.ops.cpu import attention

    threads(2)
    names = set()
    softmax_rows = attention.softmax_rows

    def recording(*args):
        names.add(threading.current_thread().name)
        softmax_rows(*args)

    monkeypatch.setattr(attention, "softmax_rows", recording)
    x = np.random.default_rng(0).standard_normal((1, 512, 256)).astype(np.float32)  # 8 MiB of weights
    w = attention_weights(x, x, num_heads=8)
    assert len(names) == 2
    np.testing.assert_allclose(w.sum(-1), 1, rtol=1e-5)


def test_single_threaded_blas_nests_and_is_a_no_op_where_the_threads_cannot_be_set():
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # from one thread it would prove nothing
        before = blas_threads()
        with parallel.single_threaded_blas():
            inside = blas_threads()
            with parallel.single_threaded_blas():
                assert blas_threads() == inside
            assert blas_threads() == inside  # the inner exit left it to the outer one
        assert blas_threads() == before
        if parallel._set_blas_threads is not None:
            assert before != inside == [1] * len(before)
        address = parallel._set_blas_threads and ctypes.cast(parallel._set_blas_threads, ctypes.c_void_p).value
        _blas.use(0)  # as where NumPy's BLAS is not an OpenBLAS that can be set
        try:
            with parallel.single_threaded_blas():
                assert blas_threads() == before and _blas.holds() == 0
        finally:
            _blas.use(address or 0)


def test_a_kernel_that_calls_the_blas_runs_its_blocks_in_order_when_the_blas_cannot_be_held(threads, monkeypatch):
    threads(2)
    monkeypatch.setattr(parallel, "_set_blas_threads", None)
    order = []
    parallel.for_blocks(lambda lo, hi: order.append((lo, threading.current_thread().name)), np.empty((8, 4)), rows=2, blas=True)
    assert [lo for lo, _ in order] == [0, 2, 4, 6]
    assert {name for _, name in order} == {threading.current_thread().name}


# ---- small products on one BLAS thread ----------------------------------------------------

SETTER = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)


@pytest.fixture
def blas_sets(monkeypatch):
    """The thread counts luxnn sets NumPy's BLAS to, in order, recorded by a stand-in for
    OpenBLAS's setter that reports 4 threads before the first set (the BLAS itself untouched)."""
    sets, count = [], [4]

    def setter(n):
        sets.append(n)
        count[0], before = n, count[0]
        return before

    stand_in = SETTER(setter)
    real = parallel._set_blas_threads
    _blas.use(ctypes.cast(stand_in, ctypes.c_void_p).value)
    monkeypatch.setattr(parallel, "_set_blas_threads", stand_in)
    try:
        yield sets
    finally:
        _blas.use(ctypes.cast(real, ctypes.c_void_p).value if real is not None else 0)


class FreeCores:
    """A stand-in for `parallel._contention`: `free` of `cores` cores free, as set."""

    def __init__(self, free, cores=4):
        self.free, self.cores = free, cores

    def free_cores(self):
        return self.free


@pytest.fixture
def machine(monkeypatch):
    """The machine as `parallel.matmul` sees it: ``machine(free=0)`` (busy) by default,
    its load followed (the tests' own setting, `conftest`, holds every product)."""
    stand_in = FreeCores(0)
    monkeypatch.setattr(parallel, "_contention", stand_in)
    parallel.set_follow_load(True)
    return stand_in


def test_a_small_product_runs_on_one_blas_thread_and_a_large_one_on_the_threads_set(blas_sets, machine, threads):
    threads(1)  # nothing cut: each product is one BLAS call
    rng = np.random.default_rng(0)
    large = parallel._ONE_THREAD_MADDS // (512 * 256)  # rows of a product of exactly that many multiply-adds
    own = parallel._BLAS_ONE_THREAD_MADDS // (512 * 256)  # rows of a product the BLAS runs on one thread itself
    for rows, want in ((64, [1, 4]), (large - 1, [1, 4]), (large, []), (own + 1, [1, 4]), (own, [])):
        a, b = rng.standard_normal((rows, 512)), rng.standard_normal((512, 256))
        blas_sets.clear()
        assert_product_close(parallel.matmul(a, b), a, b)
        assert blas_sets == want, f"{rows} x 512 x 256"
    stack = rng.standard_normal((8, 64, 512)), rng.standard_normal((8, 512, 64))  # each 2 M multiply-adds
    blas_sets.clear()
    out = np.empty((8, 64, 64))
    assert parallel.matmul(*stack, out=out) is out
    assert_product_close(out, *stack)
    assert blas_sets == [1, 4]


def test_small_products_inside_a_hold_set_no_threads_again(blas_sets, machine, threads):
    threads(1)
    a, b = np.ones((64, 512)), np.ones((512, 256))
    with parallel.single_threaded_blas():
        for _ in range(3):
            parallel.matmul(a, b)
    assert blas_sets == [1, 4]


def test_a_small_models_gradient_runs_every_product_on_one_blas_thread(blas_sets, machine, threads):
    threads(2)
    model = lx.Chain(lx.Dense(256, 128, activation="relu"), lx.Dense(128, 64))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)
    lx.value_and_grad(lambda ps: model(x, ps, st)[0].sum())(ps)
    assert blas_sets == [1, 4] * 5  # two forward, then three backward (x needs no gradient)


def test_a_small_product_keeps_the_blas_threads_while_the_cores_they_need_are_free(blas_sets, machine, threads):
    threads(1)
    rng = np.random.default_rng(0)
    two = 2 * parallel._BLAS_ONE_THREAD_MADDS // 512  # rows of a product OpenBLAS runs on two threads
    for free, rows, columns, want in (
        (4, 64, 512, []),  # 16 M multiply-adds, on all 4 threads: all 4 cores free
        (3.6, 64, 512, []),  # within the spare share of a core
        (3, 64, 512, [1, 4]),  # a core taken: held
        (3, two, 1, []),  # two threads, and three cores free
        (1, two, 1, [1, 4]),
        (0, two, 1, [1, 4]),
    ):
        machine.free = free
        a, b = rng.standard_normal((rows, 512)), rng.standard_normal((512, columns))
        blas_sets.clear()
        assert_product_close(parallel.matmul(a, b), a, b)
        assert blas_sets == want, f"{free} cores free, {rows} x 512 x {columns}"


def test_a_small_product_not_following_the_load_runs_on_one_blas_thread_on_a_quiet_machine_too(blas_sets, machine, threads):
    threads(1)
    machine.free = 4
    a, b = np.ones((64, 512)), np.ones((512, 512))  # 16 M multiply-adds: the BLAS's threads while quiet
    parallel.set_follow_load(False)
    assert_product_close(parallel.matmul(a, b), a, b)
    assert blas_sets == [1, 4]  # the same bits as on a busy machine
    blas_sets.clear()
    parallel.set_follow_load(True)
    parallel.matmul(a, b)
    assert blas_sets == []


def test_a_product_the_blas_runs_on_one_thread_itself_asks_nothing_of_the_machine(machine, threads, monkeypatch):
    threads(1)
    asked = []
    monkeypatch.setattr(machine, "free_cores", lambda: asked.append(1) or 0.0)
    own = parallel._BLAS_ONE_THREAD_MADDS // 512  # rows of a product of exactly that many multiply-adds
    for a, b in ((np.ones((2, 2)), np.ones((2, 2))), (np.ones((own, 512)), np.ones((512, 1)))):
        parallel.matmul(a, b)
    assert asked == []
    parallel.matmul(np.ones((own + 1, 512)), np.ones((512, 1)))
    assert asked == [1]


LAYER_PRODUCTS = {  # the layer, its shapes, and its products in a forward and backward pass
    "conv": (lambda x, w: ops.conv(x, w, padding=1), (2, 14, 14, 16), (3, 3, 16, 32), 3),
    "conv transpose": (lambda x, w: ops.conv_transpose(x, w, stride=2), (2, 14, 14, 16), (3, 3, 32, 16), 3),
    "rnn": (lambda x, w: rnn_sequence(x, w, x[0]), (3, 64, 256), (256, 256), 3 + 3 + 2),
    "gru": (lambda x, w: gru_sequence(x, w, None, x[0, :, :256]), (3, 64, 768), (256, 768), 3 + 3 + 2),
}


@pytest.mark.parametrize("name", LAYER_PRODUCTS)
def test_convolutions_and_recurrent_layers_hold_their_small_products_on_a_busy_machine(name, blas_sets, machine, threads):
    threads(2)
    f, x_shape, w_shape, products = LAYER_PRODUCTS[name]
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(x_shape) * 0.1, rng.standard_normal(w_shape) * 0.1

    def run():
        return lx.value_and_grad(lambda x, w: (f(x, w) ** 2).sum(), argnums=(0, 1))(x, w)

    machine.free = 4  # quiet: the BLAS's threads
    quiet = run()
    assert blas_sets == []
    machine.free = 0
    busy = run()
    assert blas_sets == [1, 4] * products  # each between the bounds (a block of rows: one)
    for a, b in zip(lx.tree.leaves(quiet), lx.tree.leaves(busy)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_contention_is_the_cores_less_what_other_processes_ran_over_the_last_window():
    clock, reads = Clock(), []
    cpu = {"busy": 50.0, "own": 5.0}

    def read():
        reads.append(clock.now)
        return cpu["busy"], cpu["own"]

    contention = _contention.Contention(clock=clock, read=read, cores=2)
    assert contention.free_cores() == 0.0  # no window yet: as if busy
    clock.now += 0.2
    cpu["busy"] += 0.4  # both cores for 0.2 s, all of it this process's
    cpu["own"] += 0.4
    assert contention.free_cores() == pytest.approx(2.0)
    clock.now += 0.05  # within the window: the last figure, nothing read
    cpu["busy"] += 0.1
    assert contention.free_cores() == pytest.approx(2.0) and len(reads) == 2
    clock.now += 0.15
    cpu["busy"] += 0.2  # 0.3 s of the cores' time in the 0.2 s since the last read, 0.1 s this process's
    cpu["own"] += 0.1
    assert contention.free_cores() == pytest.approx(1.0)
    clock.now += 0.2
    cpu["busy"] += 0.4  # others all the while: none free, whatever this process did
    assert contention.free_cores() == pytest.approx(0.0, abs=1e-9)
    contention.reset()  # as after a fork
    clock.now += 0.2
    assert contention.free_cores() == 0.0


def test_contention_where_the_cpu_times_cannot_be_read_is_a_busy_machine():
    clock = Clock()

    def unreadable():
        raise OSError("no /proc/stat")

    contention = _contention.Contention(clock=clock, read=unreadable, cores=2)
    for _ in range(3):
        clock.now += 1
        assert contention.free_cores() == 0.0


def test_the_cpu_seconds_are_read_for_the_processs_cpus_only(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  900 0 900 900 9 0 0 0 0 0\n"
        "cpu0 100 1 20 1000 50 2 3 4 0 0\n"
        "cpu1 500 0 400 10 10 0 0 0 0 0\n"
        "cpu2 30 0 10 2000 0 0 0 6 0 0\n"
        "intr 1 2 3\n"
    )
    busy, own = _contention.read_cpu_seconds({0, 2}, str(stat))
    assert busy == pytest.approx((100 + 1 + 20 + 2 + 3 + 4 + 30 + 10 + 6) / _contention._TICKS_PER_S)
    assert 0 <= own <= time.process_time()


# ---- the blocked kernels give the same bits on one thread and on several ---------------


WEIGHT = np.random.default_rng(1).standard_normal(4 * MiB).astype(np.float32)


def value_and_grad(f, x):
    def objective(x):
        y = f(x)
        return (y * WEIGHT[: y.size].reshape(y.shape)).sum()

    return lx.value_and_grad(objective)(x)


KERNELS = {
    "gelu": (lambda x: ops.gelu(x), (64, 128, 512)),
    "softmax": (lambda s: ops.masked_softmax(s, scale=0.5), (16, 4, 64, 128)),
    "causal softmax": (lambda s: ops.masked_softmax(s, is_causal=True), (32, 4, 64, 64)),
    "attention": (
        lambda x: attention_combine(attention_weights(x, x, num_heads=4, scale=0.1, is_causal=True), x, num_heads=4),
        (16, 128, 256),
    ),
    "attention, one sequence": (
        lambda x: attention_combine(attention_weights(x, x, num_heads=8, scale=0.05), x, num_heads=8),
        (1, 1024, 512),
    ),
    "layernorm": (lambda x: ops.normalize(x, axis=-1, epsilon=1e-5), (64, 64, 256)),
    "scale and shift": (lambda x: ops.scale_shift(x, x[0, 0] + 1, x[1, 1]), (64, 64, 256)),
    "max pool": (lambda x: ops.max_pool(x, 2), (64, 28, 28, 32)),
    "overlapping max pool": (lambda x: ops.max_pool(x, 3, 2, 1), (32, 28, 28, 32)),
    "avg pool": (lambda x: ops.avg_pool(x, 3, 2, 1), (32, 28, 28, 32)),
}


@pytest.mark.parametrize("name", KERNELS)
def test_kernels_give_the_same_bits_on_one_thread_and_on_several(name, threads):
    f, shape = KERNELS[name]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    assert x.nbytes >= 2 * MiB  # large enough to be cut into blocks and shared out
    # The blocks compute the same products on any thread count (attention groups its heads
    # otherwise, each head's product the same); the BLAS is pinned to one thread in both
    # runs, so that its own threading (left as it is on one luxnn thread) cannot change
    # the order in which it sums.
    with threadpoolctl.threadpool_limits(limits=1, user_api="blas"):
        threads(1)
        value_one, grad_one = value_and_grad(f, x)
        threads(3)
        value_several, grad_several = value_and_grad(f, x)
    assert value_one == value_several
    np.testing.assert_array_equal(grad_one, grad_several)


# ---- interrupts: the BLAS's threads are restored whatever is interrupted ------------------


running = 0  # shares of _blocks_and_products' kernel running now
running_lock = threading.Lock()


def _blocks_and_products():
    """A step with a cut product, a small one and a BLAS kernel on threads, then a hold of
    its own."""
    a, b = np.ones((64, 32)), np.ones((32, 16))
    like = np.empty((8, MiB // 8))

    def kernel(lo, hi):
        global running
        with running_lock:
            running += 1
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.01)  # the worker's share is the slow one: the caller waits for it
        np.matmul(a, b)
        with running_lock:
            running -= 1

    with parallel.step():
        parallel.matmul(a, b)
        parallel.matmul(np.ones(1024), np.ones((1024, 512)))  # not cut: held to one thread
        parallel.for_blocks(kernel, like, rows=2, blas=True)
    with parallel.single_threaded_blas():
        np.matmul(a, b)


# The functions between a hold of the BLAS and its release, and the caller's wait for the
# workers (single_threaded_blas and step are C's, with no point inside to land on). The
# pool's hand-over (submit, _workers) is left out: a trace event there can fall before a
# with-statement's exit, where CPython delivers no signal.
HOLDING = {"for_blocks", "matmul", "part", "_share_out", "_run_blocks", "_cuttable", "_product_madds", "cut", "_wait_for_all",
           "wait", "_poll"}


def _interrupt_at(event_number):
    """A tracer that raises KeyboardInterrupt at the `event_number`-th trace event (call,
    line, return) in the functions of luxnn.parallel that run while the BLAS is held, as
    a Ctrl-C landing there would."""
    seen, landed = 0, []

    def tracer(frame, event, arg):
        nonlocal seen
        if frame.f_code.co_filename != parallel.__file__ or frame.f_code.co_name not in HOLDING:
            return None
        if frame.f_code.co_name in ("wait", "_poll") and event != "call":
            return None  # how long they wait, and so their lines, depend on the workers: entries count
        seen += 1
        if seen == event_number:
            landed.append(frame.f_code.co_name)
            raise KeyboardInterrupt(f"at trace event {event_number}: {frame.f_code.co_name}:{frame.f_lineno}")
        return None if frame.f_code.co_name in ("wait", "_poll") else tracer

    return tracer, lambda: seen, landed


@pytest.mark.skipif(parallel._set_blas_threads is None, reason="NumPy's BLAS is not an OpenBLAS whose threads can be set")
def test_an_interrupt_at_any_point_of_a_step_leaves_the_blas_threads_as_they_were(threads, monkeypatch):
    import gc
    import sys

    threads(2)
    monkeypatch.setattr(parallel, "_CUT_MADDS", 1)
    with threadpoolctl.threadpool_limits(limits=2, user_api="blas"):  # from one thread it would prove nothing
        before = blas_threads()
        count, events, _ = _interrupt_at(0)
        sys.settrace(count)
        try:
            _blocks_and_products()
        finally:
            sys.settrace(None)
        total = events()
        assert total > 50  # the points an interrupt can land on
        interrupted = 0
        for k in range(1, total + 1):
            tracer, _, landed = _interrupt_at(k)
            sys.settrace(tracer)
            try:
                _blocks_and_products()
            except KeyboardInterrupt:
                interrupted += 1
                still_running = running  # as the interrupt reaches the caller
            finally:
                sys.settrace(None)
            gc.collect()  # a hold whose release an interrupt skipped goes with its owner
            assert blas_threads() == before and _blas.holds() == 0, f"interrupted at event {k}"
            if landed[0] in ("wait", "_poll"):  # the caller waits for every share before it leaves
                assert still_running == 0, f"a share still ran after an interrupt at event {k}"
            _blocks_and_products()  # and later holds restore what they found, not 1
            assert blas_threads() == before, f"after an interrupt at event {k}"
        assert interrupted == total


def test_for_blocks_refuses_arrays_of_another_device(monkeypatch):
    import sim_cupy

    monkeypatch.setitem(sys.modules, "cupy", sim_cupy)
    calls = []
    with pytest.raises(TypeError, match="cuts NumPy arrays for the CPU's threads, got cupy.ndarray"):
        parallel.for_blocks(lambda lo, hi: calls.append((lo, hi)), sim_cupy.zeros((4, 3)))
    assert calls == []
