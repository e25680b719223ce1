"""The 2-rank checks of luxnn.distributed, run by tests/test_distributed.py as
``mpiexec -n 2 python -m mpi4py checks.py TMPDIR``: one MPI start-up for all of them.

Each check prints ``rank R: PASS name`` (and what the test compares, such as error
messages); a failing check raises, and ``-m mpi4py`` then aborts the job.
"""

import hashlib
import os
import sys
import types

import numpy as np

import luxnn as lx
from luxnn import distributed as dist

tmpdir = sys.argv[1]


def say(message):
    sys.stdout.write(f"rank {backend.rank}: {message}\n")  # one write: the ranks' lines do not mix
    sys.stdout.flush()


def raises(kind, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except kind as err:
        return str(err)
    raise AssertionError(f"{fn.__name__} did not raise {kind.__name__}")


def digest(x):
    """A hash of every array's bytes, dtype and shape in tree `x`."""
    h = hashlib.sha256()
    for leaf in lx.tree.leaves(x):
        if isinstance(leaf, np.ndarray):
            h.update(f"{leaf.dtype}{leaf.shape}".encode())
            h.update(np.ascontiguousarray(leaf).tobytes())
    return h.hexdigest()


def scaled(x, k):
    return lx.tree.map(lambda a: np.asarray(a * k), x)  # 0-d arrays stay arrays


def same_on_every_rank(x):
    return len(set(backend.allgather_object(digest(x)))) == 1


# ---- before initialize -----------------------------------------------------------------------
assert not dist.is_initialized()
message = raises(RuntimeError, dist.allreduce_, None, np.ones(2))
assert "not initialized" in message and "initialize('mpi')" in message, message

backend = dist.initialize("mpi")
rank, size = dist.local_rank(backend), dist.total_workers(backend)
assert size == 2 and rank in (0, 1) and dist.initialize("mpi") is backend
say("PASS initialize")

# ---- errors -------------------------------------------------------------------------------------
say("twice: " + raises(RuntimeError, dist.initialize, "nccl"))
assert "already initialized with 'mpi'" in raises(RuntimeError, dist.initialize, "nccl")
assert "op in" in raises(ValueError, dist.allreduce_, backend, np.ones(2), op="mean")
assert "floating-point" in raises(TypeError, dist.allreduce_, backend, np.ones(2, np.int64), op="avg")
assert "root" in raises(ValueError, dist.bcast_, backend, np.ones(2), root=2)
assert "read-only" in raises(ValueError, dist.allreduce_, backend, np.broadcast_to(np.ones(1), (3,)))
assert "at 'b'" in raises(TypeError, dist.allreduce_, backend, {"a": np.ones(1), "b": 1.5})
untouched = {"a": np.ones(2), "b": np.ones(2, bool)}  # every array is checked before any travels
assert "needs numeric arrays, got bool" in raises(TypeError, dist.allreduce_, backend, untouched)
np.testing.assert_array_equal(untouched["a"], np.ones(2))
assert "op in" in raises(ValueError, backend.start_allreduce, np.ones(2), "mean")
for method in (backend.start_allreduce, backend.allreduce, backend.bcast):  # before any collective starts
    assert "expected a NumPy or CuPy array, got list" in raises(TypeError, method, [1.0, 2.0])
    assert "is read-only" in raises(ValueError, method, np.broadcast_to(np.ones(1), (3,)))
assert "C-contiguous" in raises(ValueError, backend.start_allreduce, np.ones((2, 2))[:, 0])
assert "floating-point" in raises(TypeError, backend.start_allreduce, np.ones(2, np.int64), "avg")
assert "overlap True or False" in raises(TypeError, dist.DistributedOptimizer, backend, lx.optim.sgd(0.1), overlap="yes")
assert "bucket_bytes an integer >= 1" in raises(ValueError, dist.DistributedOptimizer, backend, lx.optim.sgd(0.1), bucket_bytes=0)
say("PASS bad input")


class FakeGPUArray:
    """Enough of a CuPy array for luxnn to take it for one on GPU 0 (this machine has none)."""

    __module__ = "cupy.fake"
    shape, dtype, device = (2,), np.dtype(np.float32), types.SimpleNamespace(id=0)


opt = dist.DistributedOptimizer(backend, lx.optim.adam(1e-3))
message = raises(ValueError, opt.init, {"w": np.zeros(2, np.float32), "v": FakeGPUArray()})
assert "one device" in message and "CPUDevice()" in message and "CUDADevice(0)" in message, message
say("mixed: " + message)

# ---- threads --------------------------------------------------------------------------------------
# OPENBLAS_NUM_THREADS is set by the test, so only luxnn's threads are initialize's to share.
assert lx.num_threads() == backend.cores, (lx.num_threads(), backend.cores)
say(f"PASS threads {lx.num_threads()}")

# ---- collectives on float32 and float64 trees -------------------------------------------------------
expected_of = {  # rank r holds base * (r + 1)
    "sum": size * (size + 1) / 2, "avg": (size + 1) / 2, "max": float(size), "min": 1.0,
}  # fmt: skip
for dtype in (np.float32, np.float64):
    base = {"a": np.arange(1, 13, dtype=dtype).reshape(3, 4), "b": [np.full(5, 0.5, dtype), np.array(2.0, dtype)]}
    for op, factor in expected_of.items():
        x = scaled(base, rank + 1)
        strided = np.zeros((3, 8), dtype)
        strided[:, ::2] = base["a"] * (rank + 1)
        x["strided"] = strided[:, ::2]  # not contiguous: written back in place
        out = dist.allreduce_(backend, x, op=op)
        assert out is x
        for got, want in zip(lx.tree.leaves(x), lx.tree.leaves({**base, "strided": base["a"]})):
            assert got.dtype == dtype
            np.testing.assert_allclose(got, want * factor, rtol=1e-6)
        assert same_on_every_rank(x)
    x = scaled(base, rank + 1)
    dist.reduce_(backend, x, op="sum", root=1)
    for got, want in zip(lx.tree.leaves(x), lx.tree.leaves(base)):
        np.testing.assert_allclose(got, want * (3 if rank == 1 else 1), rtol=1e-6)
    x = scaled(base, rank + 1)
    dist.bcast_(backend, x, root=1)
    for got, want in zip(lx.tree.leaves(x), lx.tree.leaves(base)):
        np.testing.assert_array_equal(got, want * 2)
for op, factor in expected_of.items():  # non-blocking, both ranks' allreduces in flight at once
    arrays = [np.full(3, rank + 1.0), np.full(2, 2.0 * (rank + 1), np.float32)]
    pending = [backend.start_allreduce(a, op) for a in arrays]
    for p in reversed(pending):
        p.wait()
        p.wait()  # a second wait returns at once (and divides no second time)
    np.testing.assert_array_equal(arrays[0], np.full(3, factor))
    np.testing.assert_array_equal(arrays[1], np.full(2, 2.0 * factor, np.float32))
    assert all(p.test() for p in pending)
say("PASS collectives")

# ---- buckets: per dtype, at most bucket_bytes, a larger array alone ------------------------------------
grads = {
    "a": np.arange(4, dtype=np.float32),  # 16 bytes
    "b": np.arange(6, dtype=np.float64).reshape(2, 3),  # 48 bytes
    "c": np.arange(12, dtype=np.float32).reshape(3, 4),  # 48 bytes: a + c > 56, a new bucket
    "d": np.arange(20, dtype=np.float64),  # 160 bytes: more than a bucket, one of its own
    "e": np.array(3.0, np.float32),
}
buckets = dist.GradientBuckets(backend, bucket_bytes=56)
mine = scaled(grads, rank + 1)
averaged = buckets.average(mine)
# Filled from the last leaf to the first ("e", "d", ...), in the order their last leaf comes.
assert [(b.dtype, b.size) for b in buckets.buffers] == [(np.float64, 20), (np.float32, 13), (np.float64, 6), (np.float32, 4)]
for key, want in grads.items():
    assert averaged[key].dtype == want.dtype and averaged[key].shape == want.shape
    np.testing.assert_allclose(averaged[key], want * (size + 1) / 2, rtol=1e-6)
    assert not np.shares_memory(averaged[key], mine[key])  # new arrays; the gradients are left alone
np.testing.assert_array_equal(mine["a"], grads["a"] * (rank + 1))
# A round's receive takes each leaf once, and only while its round is open.
leaves, structure = lx.tree.flatten(mine)
receive = buckets.begin(leaves, structure)
receive(4, leaves[4])
assert "came twice" in raises(ValueError, receive, 4, leaves[4])
buckets.discard()
kept = [b.copy() for b in buckets.buffers]
assert "after its round ended" in raises(RuntimeError, receive, 0, leaves[0])
assert all(np.array_equal(b, k) for b, k in zip(buckets.buffers, kept)), "a stale receive wrote a bucket"
say("PASS buckets")

# ---- synchronize ------------------------------------------------------------------------------------
model = lx.Chain(lx.Dense(5, 16, activation="tanh"), lx.Dropout(0.1), lx.Dense(16, 3))
ps, st = lx.setup(np.random.default_rng(100 + rank), model)  # differently seeded replicas
ps = lx.tree.map(lambda a: a.astype(np.float64), ps)
assert not same_on_every_rank(ps)
rank0_ps = backend.bcast_object(ps, 0)
extras = {"step": 7 + rank, "lr": np.float32(0.1 * (rank + 1)), "name": f"rank{rank}", "fn": None}
ps, st, extras = dist.synchronize(backend, (ps, st, extras))
assert same_on_every_rank(ps) and digest(ps) == digest(rank0_ps)
assert extras["step"] == 7 and extras["lr"] == np.float32(0.1) and extras["name"] == f"rank{rank}"
generators = [leaf for leaf in lx.tree.leaves(st) if isinstance(leaf, np.random.Generator)]
assert generators and len(set(backend.allgather_object(tuple(g.random() for g in generators)))) == 1
say("PASS synchronize")

# ---- mismatched trees raise on every rank ------------------------------------------------------------
shape = (3, 4) if rank == 0 else (4, 4)
say("mismatch shape: " + raises(ValueError, dist.synchronize, backend, {"layer": {"w": np.zeros(shape)}}))
extra = {"w": np.zeros(2)} if rank == 0 else {"w": np.zeros(2), "b": np.zeros(2)}
say("mismatch keys: " + raises(ValueError, dist.synchronize, backend, extra))
dtype = np.float32 if rank == 0 else np.float64
say("mismatch dtype: " + raises(ValueError, dist.synchronize, backend, [np.zeros(2, dtype)]))
# Bad input on one rank only raises on every rank, naming it (not on that rank alone,
# leaving the other in the check's collective).
frozen = np.zeros(3) if rank == 0 else np.broadcast_to(np.zeros(1), (3,))
message = raises(ValueError, dist.synchronize, backend, {"w": frozen})
assert "synchronize: on rank 1: the array at 'w' is read-only" in message, message
grads = {"w": np.zeros(2)} if rank == 0 else {"w": 1.5}
message = raises(ValueError, dist.GradientBuckets(backend).average, grads)
assert "DistributedOptimizer: on rank 1: expected gradients as NumPy or CuPy arrays, got float at 'w'" in message, message

# ---- 2 ranks x 32 samples == 1 process x 64 samples, after 10 Adam steps -----------------------------------
data_rng = np.random.default_rng(5)  # the same data on every rank
x, y = data_rng.standard_normal((64, 5)), data_rng.standard_normal((64, 3))
model = lx.Chain(lx.Dense(5, 16, activation="tanh"), lx.Dense(16, 3))
ps, st = lx.setup(np.random.default_rng(rank), model)
ps, st = dist.synchronize(backend, (lx.tree.map(lambda a: a.astype(np.float64), ps), st))
start = lx.tree.map(np.copy, ps)
loss_fn, ad = lx.losses.MSELoss(), lx.AutoTape()
reference = lx.TrainState(model, lx.tree.map(np.copy, start), st, lx.optim.adam(1e-2))
for _ in range(10):
    _, _, _, reference = lx.single_train_step_(ad, loss_fn, (x, y), reference)
# overlap=True with one bucket per array (bucket_bytes=1): every allreduce starts in the backward pass.
for overlap, bucket_bytes, name in ((False, dist.DEFAULT_BUCKET_BYTES, ""), (True, 1, "overlap: ")):
    optimizer = dist.DistributedOptimizer(backend, lx.optim.adam(1e-2), bucket_bytes=bucket_bytes, overlap=overlap)
    ts = lx.TrainState(model, lx.tree.map(np.copy, start), st, optimizer)
    loader = dist.DistributedDataLoader(backend, (x, y), 32, seed=3)
    assert len(loader) == 1
    for _ in range(10):
        for batch in loader:
            assert batch[0].shape == (32, 5)
            _, loss, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
    assert ts.step == 10
    for got, want in zip(lx.tree.leaves(ts.parameters), lx.tree.leaves(reference.parameters)):
        error = np.abs(got - want).max() / np.abs(want).max()
        assert error < 1e-10, error
    assert not np.allclose(ts.parameters["layer_1"]["weight"], start["layer_1"]["weight"])  # it trained
    assert same_on_every_rank(ts.parameters) and same_on_every_rank(ts.optimizer_state)
    mu = ts.optimizer_state[0].mu["layer_1"]["weight"]
    _, _, _, ts = lx.single_train_step_(ad, loss_fn, next(iter(loader)), ts)
    assert ts.optimizer_state[0].mu["layer_1"]["weight"] is mu  # the inner Adam updates its moments in place
    say(f"PASS {name}training equals one process, replicas bit-identical")


# ---- overlap: the allreduces start in the backward pass; a backward pass that raises ------------------------
class Probe:
    """The identity as a primitive whose VJP runs `Probe.action()` when the backward pass reaches it."""

    action = staticmethod(lambda: None)


@lx.ad.primitive
def probe(a):
    def vjp(g, needs):
        Probe.action()
        return (g,)

    return a, vjp


model = lx.Chain(lx.Dense(5, 16, activation="tanh"), lx.WrappedFunction(probe), lx.Dense(16, 8, activation="tanh"), lx.Dense(8, 3))
ps, st = dist.synchronize(backend, lx.tree.map(lambda a: a.astype(np.float64), lx.setup(np.random.default_rng(0), model)))
batches = [(x[32 * rank : 32 * rank + 32] * k, y[32 * rank : 32 * rank + 32]) for k in (1.0, 0.5, 2.0, 1.5)]


def train(overlap, fail_at=None, failing=(0, 1)):
    """Four steps on `batches`; with `fail_at`, one more step before batch `fail_at`, whose
    backward pass raises at the probe on the ranks `failing` (and is caught); the other
    ranks take that step."""
    optimizer = dist.DistributedOptimizer(backend, lx.optim.adam(1e-2), bucket_bytes=1, overlap=overlap)
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, optimizer)
    started = []
    for i, batch in enumerate(batches):
        if i == fail_at:
            def fail():
                started.append(backend.stats.calls - before)
                raise ArithmeticError("the probe fails")

            Probe.action, before = fail, backend.stats.calls
            if rank in failing:
                assert "the probe fails" in raises(ArithmeticError, lx.single_train_step_, ad, loss_fn, batch, ts)
            else:  # its update learns that a rank abandoned the step, and applies nothing
                Probe.action = lambda: started.append(backend.stats.calls - before)
                assert "a rank abandoned this step's gradients" in raises(RuntimeError, lx.single_train_step_, ad, loss_fn, batch, ts)
        Probe.action, before = (lambda: started.append(backend.stats.calls - before)), backend.stats.calls
        _, _, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
    Probe.action = lambda: None
    return ts, started


blocking, started = train(overlap=False)
assert started == [0] * 4  # nothing travels before update
overlapped, started = train(overlap=True)
assert started == [4] * 4, started  # layers 3 and 4 (weights and biases, a bucket each) are on their way
for got, want in zip(lx.tree.leaves(overlapped.parameters), lx.tree.leaves(blocking.parameters)):
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
assert same_on_every_rank(overlapped.parameters)
say("PASS overlap: allreduces start in the backward pass, results as without overlap")

# The failed step had started 4 allreduces; the next step's start runs its 2 others (on
# whatever its buckets hold, so that every rank has started the same ones) and the
# verdict's, and waits for all 7: the steps after it neither hang nor see its buckets.
recovered, started = train(overlap=True, fail_at=2)
assert started == [4, 4, 4, 3 + 4, 4], started
for got, want in zip(lx.tree.leaves(recovered.parameters), lx.tree.leaves(blocking.parameters)):
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
assert same_on_every_rank(recovered.parameters)

# Rank 1 alone raises: rank 0's update waits for the 2 allreduces rank 1 had not started
# and the verdict, until rank 1's next step starts them, and raises. Nothing hangs, no
# rank applied the step (none used rank 1's unfinished buckets): the replicas stay equal.
survived, started = train(overlap=True, fail_at=2, failing=(1,))
assert started == ([4, 4, 4, 4, 4] if rank == 0 else [4, 4, 4, 3 + 4, 4]), started
for got, want in zip(lx.tree.leaves(survived.parameters), lx.tree.leaves(blocking.parameters)):
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=0)
assert same_on_every_rank(survived.parameters)
say("PASS overlap: a backward pass that raises leaves nothing pending")

# Gradients replaced between compute_gradients and apply_gradients are averaged as they come.
for overlap in (False, True):
    optimizer = dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=1, overlap=overlap)
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, optimizer)
    grads, _, _, ts = lx.compute_gradients(ad, loss_fn, batches[0], ts)
    ts = lx.apply_gradients(ts, lx.tree.map(lambda g: 2.0 * g, grads))
    if overlap:
        np.testing.assert_allclose(ts.parameters["layer_1"]["weight"], doubled, rtol=1e-13, atol=0)
    doubled = ts.parameters["layer_1"]["weight"]
# compute_gradients then apply_gradients_ (two verbs, one step): the round is collected.
for overlap in (False, True):
    optimizer = dist.DistributedOptimizer(backend, lx.optim.sgd(0.1), bucket_bytes=1, overlap=overlap)
    ts = lx.TrainState(model, lx.tree.map(np.copy, ps), st, optimizer)
    before = backend.stats.calls
    grads, _, _, ts = lx.compute_gradients(ad, loss_fn, batches[0], ts)
    assert backend.stats.calls - before == (6 if overlap else 0)  # with overlap, every bucket is on its way
    ts = lx.apply_gradients_(ts, grads)
    assert backend.stats.calls - before == (7 if overlap else 6)  # no bucket travels twice (with overlap: and the verdict)
    if overlap:
        np.testing.assert_allclose(ts.parameters["layer_1"]["weight"], two_verbs, rtol=1e-13, atol=0)
    two_verbs = ts.parameters["layer_1"]["weight"]
say("PASS overlap: compute_gradients then apply_gradients, replaced gradients")


# ---- shards: disjoint, covering ------------------------------------------------------------------------
samples = np.arange(70)
for drop_last, steps, covered in ((True, 4, 64), (False, 5, 70)):
    for shuffle in (True, False):
        loader = dist.DistributedDataLoader(backend, {"i": samples}, 8, shuffle=shuffle, seed=1, drop_last=drop_last)
        assert len(loader) == steps
        epochs = []
        for _ in range(2):
            mine = [batch["i"] for batch in loader]
            assert len(mine) == steps and len({len(b) for b in mine[:-1]} | {8}) == 1
            everyone = np.concatenate(backend.allgather_object(np.concatenate(mine)))
            assert len(np.unique(everyone)) == covered
            if drop_last:
                assert len(everyone) == covered  # disjoint
            epochs.append(everyone)
        assert shuffle != np.array_equal(*epochs)  # a new order each epoch when shuffled
say("PASS shards disjoint and covering")
disagree = raises(ValueError, dist.DistributedDataLoader, backend, samples, 4 + rank)
assert "disagree" in disagree, disagree
# Too few samples on rank 1 only: both ranks say that they disagree (rank 1 alone raising
# "would yield no batch" would leave rank 0 in the loader's collective).
disagree = raises(ValueError, dist.DistributedDataLoader, backend, samples[: 70 if rank == 0 else 10], 8)
assert "disagree" in disagree and "rank 1: (10, 8," in disagree, disagree
assert "would yield no batch" in raises(ValueError, dist.DistributedDataLoader, backend, samples, 40)
loader = dist.DistributedDataLoader(backend, samples, 8, seed=2)
first = [b.tolist() for b in loader]
loader.set_epoch(0)
assert [b.tolist() for b in loader] == first and loader.epoch == 1
say("PASS loader settings")

# ---- BatchNorm: the replicas' states stay equal; sync=True computes what one process does on the whole batch ----
def in_float64(tree_):
    return lx.tree.map(lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a, tree_)


def norm_model(sync):
    return lx.Chain(lx.Dense(5, 8), lx.BatchNorm(8, "tanh", sync=sync), lx.Dense(8, 3))


bn_ps, bn_st = in_float64(lx.setup(np.random.default_rng(0), norm_model(False)))
share = (x[32 * rank : 32 * rank + 32] * (1 + 3 * rank), y[32 * rank : 32 * rank + 32])  # the ranks' statistics differ
whole = (np.concatenate(backend.allgather_object(share[0])), np.concatenate(backend.allgather_object(share[1])))
one_process = [lx.TrainState(norm_model(False), lx.tree.map(np.copy, bn_ps), bn_st, lx.optim.sgd(0.1))]
for _ in range(3):  # every rank the whole batch: what one process computes
    one_process.append(lx.single_train_step(ad, loss_fn, whole, one_process[-1])[3])
for sync in (False, True):
    ts = lx.TrainState(norm_model(sync), lx.tree.map(np.copy, bn_ps), bn_st, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1)))
    for step in range(1, 4):
        ts = lx.single_train_step(ad, loss_fn, share, ts)[3]
        assert same_on_every_rank(ts.states), f"sync={sync}: the running statistics differ between ranks at step {step}"
        want = one_process[step].states["layer_2"]
        if sync or step == 1:  # the first step's running mean is the global batch's either way
            np.testing.assert_allclose(ts.states["layer_2"]["running_mean"], want["running_mean"], rtol=1e-10, atol=1e-12)
        if sync:
            np.testing.assert_allclose(ts.states["layer_2"]["running_var"], want["running_var"], rtol=1e-10, atol=1e-12)
            for got, expected in zip(lx.tree.leaves(ts.parameters), lx.tree.leaves(one_process[step].parameters)):
                np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)
    if not sync:  # the ranks normalise with their own statistics: not one process's gradients
        assert not np.allclose(ts.parameters["layer_1"]["weight"], one_process[3].parameters["layer_1"]["weight"], rtol=1e-6)
instance = lx.Chain(lx.InstanceNorm(3, track_stats=True), lx.Dense(3, 2))  # its running statistics are averaged too
instance_ts = lx.TrainState(instance, *in_float64(lx.setup(np.random.default_rng(0), instance)), dist.DistributedOptimizer(backend, lx.optim.sgd(0.1)))
instance_data = (np.random.default_rng(rank).standard_normal((2 + rank, 4, 3)), np.zeros((2 + rank, 4, 2)))
assert same_on_every_rank(lx.single_train_step(ad, loss_fn, instance_data, instance_ts)[3].states)
say("PASS batchnorm: states equal on every rank, sync=True equals one process on the whole batch")

# ---- checks before writing: the inner optimizer's; the DistributedOptimizer outermost only -----------------
injected = lx.optim.chain(lx.optim.trace(0.9), lx.optim.inject_hyperparams(lx.optim.adam)(learning_rate=0.1))
checked = lx.TrainState(model, lx.tree.map(np.copy, ps), st, dist.DistributedOptimizer(backend, injected))
checked = lx.single_train_step_(ad, loss_fn, batches[0], checked)[3]
before = digest(checked.optimizer_state)
assert "b1 must be in [0.0, 1.0)" in raises(ValueError, lx.optim.set_hyperparams, checked, b1=5.0)
assert digest(checked.optimizer_state) == before  # trace's momentum untouched: nothing was written
message = raises(ValueError, lx.optim.MultiSteps, dist.DistributedOptimizer(backend, lx.optim.sgd(0.1)), 2)
assert "must be the outermost optimizer" in message, message
say("PASS checks before writing, the DistributedOptimizer outermost")

# ---- a checkpoint written by rank 0 loads on both ----------------------------------------------------------
path = os.path.join(tmpdir, "ckpt.safetensors")
dist.save(backend, path, ts)
loaded = lx.load(path, like=ts)
assert loaded.step == ts.step and digest(loaded.parameters) == digest(ts.parameters)
assert digest(loaded.optimizer_state) == digest(ts.optimizer_state)
message = raises(RuntimeError, dist.save, backend, os.path.join(tmpdir, "no-such-dir", "ckpt.safetensors"), ts)
assert "rank 0 could not write" in message, message
say("PASS checkpoint")

say(f"collectives: {backend.stats.calls} calls, {backend.stats.bytes} bytes")
say("done")
