"""Checkpoints: round trips of TrainStates and pytrees, and files that were tampered with
(written here with safetensors directly) raising `CheckpointError` before anything is built."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from typing import NamedTuple

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import luxnn as lx

AD = lx.AutoTape()
DROPOUT_RNG = "states/layer_2/rng"
DROPOUT_FLAG = "states/layer_2/training"


def _train_state(seed=0):
    model = lx.Chain(lx.Dense(4, 8), lx.Dropout(0.5), lx.Dense(8, 1))
    ps, st = lx.setup(np.random.default_rng(seed), model)
    return lx.TrainState(model, ps, st, lx.optim.adamw(1e-2), allocator_cache=None)


def _saved(tmp_path, obj=None):
    path = tmp_path / "ckpt.safetensors"
    lx.save(path, _train_state() if obj is None else obj)
    return path


def _read(path):
    with safe_open(path, framework="numpy") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def _tamper(path, *, arrays=None, metadata=None, others=None):
    """Rewrite the checkpoint at `path`: `arrays(dict)`, `metadata(dict)` and `others(dict)`
    edit its parts in place."""
    stored, meta = _read(path)
    entries = json.loads(meta["others"])
    for part, edit in ((stored, arrays), (entries, others)):
        if edit is not None:
            edit(part)
    meta["others"] = json.dumps(entries)
    if metadata is not None:
        metadata(meta)
    save_file(stored, path, metadata=meta)


def _state(generator):
    return json.dumps(generator.bit_generator.state, default=lambda a: a.tolist())


def _leaves_equal(a, b):
    la, lb = lx.tree.leaves(a), lx.tree.leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        if isinstance(x, np.random.Generator):
            assert _state(x) == _state(y)
        else:
            assert type(x) is type(y) and np.array_equal(x, y)
            assert getattr(x, "dtype", None) == getattr(y, "dtype", None)


# ---- round trips ----------------------------------------------------------------------------


class Pair(NamedTuple):
    first: object
    second: object


def test_any_pytree_round_trips_with_its_containers_and_leaf_types(tmp_path):
    rng = np.random.default_rng(3)
    params = lx.setup(rng, lx.Chain(lx.Dense(3, 4), lx.Dense(4, 2)))[0]
    mixed = {
        "params": params,
        "seq": [np.arange(3, dtype=np.int16), (np.float32(0.25), np.bool_(True))],
        "pair": Pair(np.zeros((), np.float64), {"n": 7, "lr": 1e-3, "name": "x", "none": None, "flag": False}),
        "generators": [np.random.Generator(cls(5)) for cls in (np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox, np.random.SFC64)],
    }
    for obj in (params, mixed, np.ones((2, 2), np.float32)):
        path = _saved(tmp_path, obj)
        loaded = lx.load(path, like=obj)
        assert lx.tree.structure(loaded) == lx.tree.structure(obj)
        _leaves_equal(loaded, obj)
    assert isinstance(lx.load(path := _saved(tmp_path, mixed), like=mixed)["pair"], Pair)
    # A loaded generator continues the saved stream, whatever its bit generator.
    for saved, loaded in zip(mixed["generators"], lx.load(path, like=mixed)["generators"]):
        assert loaded.random() == saved.random()


def test_a_train_state_resumes_exactly_and_loaded_arrays_train_in_place(tmp_path):
    ts = _train_state()
    data = (np.ones((8, 4), np.float32), np.zeros((8, 1), np.float32))
    for _ in range(2):
        _, _, _, ts = lx.single_train_step_(AD, lx.losses.MSELoss(), data, ts)
    loaded = lx.load(_saved(tmp_path, ts), like=_train_state(seed=9))
    assert loaded.step == 2
    for field in ("parameters", "states", "optimizer_state"):
        _leaves_equal(getattr(loaded, field), getattr(ts, field))
    _, loss_a, _, ts = lx.single_train_step_(AD, lx.losses.MSELoss(), data, ts)
    _, loss_b, _, loaded = lx.single_train_step_(AD, lx.losses.MSELoss(), data, loaded)
    assert float(loss_a) == float(loss_b)
    _leaves_equal(loaded.parameters, ts.parameters)


def test_save_refuses_what_it_cannot_store_before_writing(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    for bad, name in (({"w": np.ones(2), "f": lambda: 0}, "f of type function"), ({"c": np.complex64(1j)}, "c of type complex64")):
        with pytest.raises(TypeError, match=name):
            lx.save(path, bad)
    with pytest.raises(ValueError, match="two leaves have the path 'tree/a/b'"):
        lx.save(path, {"a/b": np.ones(1), "a": {"b": np.ones(1)}})
    with pytest.raises(IsADirectoryError):
        lx.save(tmp_path, {"w": np.ones(2)})
    assert os.listdir(tmp_path) == []


def test_a_consumed_train_state_is_refused_before_writing(tmp_path):
    # Its arrays hold the next step's parameters while its step and Adam count are the
    # last's: a checkpoint of it would resume with moments one step off.
    ts = _train_state()
    data = (np.ones((8, 4), np.float32), np.zeros((8, 1), np.float32))
    _, _, _, new = lx.single_train_step_(AD, lx.losses.MSELoss(), data, ts)
    with pytest.raises(ValueError, match="save: this TrainState was consumed .* save the TrainState that verb returned"):
        lx.save(tmp_path / "ckpt.safetensors", ts)
    assert os.listdir(tmp_path) == []
    lx.save(tmp_path / "ckpt.safetensors", new)
    assert lx.load(tmp_path / "ckpt.safetensors", like=new).step == 1


def test_a_train_state_file_and_a_pytree_do_not_load_as_each_other(tmp_path):
    ts = _train_state()
    with pytest.raises(lx.CheckpointError, match="holds a TrainState, but like= is a pytree"):
        lx.load(_saved(tmp_path, ts), like=ts.parameters)
    with pytest.raises(lx.CheckpointError, match="holds a pytree, but like= is a TrainState"):
        lx.load(_saved(tmp_path, ts.parameters), like=ts)
    path = _saved(tmp_path, ts.parameters)
    _tamper(path, metadata=lambda meta: meta.update(step="not a step"))  # a pytree has no step to read
    _leaves_equal(lx.load(path, like=ts.parameters), ts.parameters)


# ---- names read from a file select no code --------------------------------------------------


@pytest.mark.parametrize("name", ["seed", "default_rng", "RandomState", "BitGenerator", "__import__", 7, None, {"PCG64": 1}])
def test_a_bit_generator_name_outside_numpys_list_is_refused(tmp_path, name):
    path = _saved(tmp_path)
    _tamper(path, others=lambda o: o[DROPOUT_RNG]["state"].update(bit_generator=name))
    global_stream = np.random.get_state()
    with pytest.raises(lx.CheckpointError, match=r"states/layer_2/rng: expected a generator state naming one of NumPy's bit generators"):
        lx.load(path, like=_train_state())
    after = np.random.get_state()  # "seed" would have reseeded NumPy's global stream
    assert global_stream[0] == after[0] and np.array_equal(global_stream[1], after[1]) and global_stream[2:] == after[2:]


def test_a_bit_generator_of_another_type_than_like_is_refused(tmp_path):
    path = _saved(tmp_path)
    state = np.random.MT19937(0).state
    state["state"]["key"] = state["state"]["key"].tolist()
    _tamper(path, others=lambda o: o[DROPOUT_RNG].update(state=state))
    with pytest.raises(lx.CheckpointError, match="expected a generator of PCG64, got one of MT19937"):
        lx.load(path, like=_train_state())


# ---- every entry is checked against like= ---------------------------------------------------


def test_non_array_entries_are_checked_against_like_and_every_mismatch_is_named(tmp_path):
    path = _saved(tmp_path)

    def edit(others):
        others[DROPOUT_RNG] = {"kind": "value", "value": [1, 2, 3]}  # a generator replaced by a list
        others[DROPOUT_FLAG] = {"kind": "value", "value": "yes"}  # a bool replaced by a str

    _tamper(path, others=edit)
    like = _train_state(seed=4)
    before = lx.tree.map(lambda x: x.copy() if isinstance(x, np.ndarray) else x, like.parameters)
    with pytest.raises(lx.CheckpointError) as info:
        lx.load(path, like=like)
    message = str(info.value)
    assert str(path) in message
    assert f"{DROPOUT_RNG}: expected a generator of PCG64, got a value entry" in message
    assert f"{DROPOUT_FLAG}: expected a value of type bool, got 'yes'" in message
    _leaves_equal(like.parameters, before)


@pytest.mark.parametrize(
    "like, stored, expected",
    [
        (3, 3.0, "expected a value of type int, got 3.0"),
        (1.5, "1.5", "expected a value of type float, got '1.5'"),
        (True, 1, "expected a value of type bool, got 1"),
        (None, 0, "expected None, got 0"),
        (np.float32(1), {"kind": "scalar", "dtype": "<f8", "value": 1.0}, "expected a NumPy scalar of dtype float32, got a scalar of dtype '<f8'"),
        (np.int8(1), {"kind": "scalar", "dtype": "|i1", "value": 1000}, "expected a NumPy scalar of dtype int8, got 1000, which it cannot hold"),
        (np.int8(1), {"kind": "scalar", "dtype": "|i1", "value": 1.0}, "expected a NumPy scalar of dtype int8, got 1.0"),
        (np.ones(2), 1.0, r"expected an array float64\[2\], got a metadata entry"),
        (np.float32(1), {"kind": "code", "value": 1}, "expected a NumPy scalar of dtype float32, got a malformed entry"),
        (np.float32(1), [1], "expected a NumPy scalar of dtype float32, got a malformed entry"),
    ],
)
def test_a_leaf_of_another_kind_or_type_is_named(tmp_path, like, stored, expected):
    path = _saved(tmp_path, {"x": like})
    entry = stored if isinstance(stored, (dict, list)) else {"kind": "value", "value": stored}

    def edit(others):
        others["tree/x"] = entry

    _tamper(path, others=edit, arrays=lambda a: a.pop("tree/x", None))
    with pytest.raises(lx.CheckpointError, match="tree/x: " + expected):
        lx.load(path, like={"x": like})


def test_arrays_missing_extra_or_of_another_shape_or_dtype_are_named_together(tmp_path):
    path = _saved(tmp_path)

    def edit(arrays):
        arrays["parameters/layer_1/weight"] = arrays["parameters/layer_1/weight"].astype(np.float64)
        del arrays["parameters/layer_3/bias"]
        arrays["parameters/layer_9/weight"] = np.ones(1, np.float32)
        arrays[DROPOUT_FLAG] = np.ones(1, np.float32)

    _tamper(path, arrays=edit)
    with pytest.raises(lx.CheckpointError) as info:
        lx.load(path, like=_train_state())
    message = str(info.value)
    for part in (
        r"parameters/layer_1/weight: expected float32[4, 8], got float64[4, 8]",
        "missing array parameters/layer_3/bias",
        "unexpected entry parameters/layer_9/weight",
        "unexpected entry states/layer_2/training",  # it is a metadata entry, also stored as an array
    ):
        assert part in message


# ---- malformed files: one error naming the file --------------------------------------------


def _drop(key):
    return lambda meta: meta.pop(key)


def _set(key, value):
    return lambda meta: meta.update({key: value})


@pytest.mark.parametrize(
    "edit, expected",
    [
        (_drop("others"), "no 'others' entry"),  # was a KeyError
        (_set("others", "{not json"), "'others' is not valid JSON"),  # was a JSONDecodeError
        (_set("others", "[" * 100_000), r"'others' is not valid JSON \(RecursionError"),
        (_set("others", "[1, 2]"), "'others' must be a JSON object, got list"),  # was an AttributeError
        (_set("others", '{"x": ' + "1" * 5000 + "}"), "'others' is not valid JSON"),
        (_set("others", json.dumps({DROPOUT_RNG: 5, DROPOUT_FLAG: {"kind": "value", "value": True}})), "states/layer_2/rng: expected a generator of PCG64, got a malformed entry 5"),  # was a TypeError
        (_set("step", "-7"), "'step' must be a non-negative integer, got '-7'"),
        (_set("step", "seven"), "'step' must be a non-negative integer, got 'seven'"),  # was int()'s message
        (_set("step", "1" * 30), "'step' must be a non-negative integer"),
        (_drop("step"), "'step' must be a non-negative integer, got None"),  # was a KeyError
        (_set("format", "pickle"), "not a luxnn checkpoint \\(format 'pickle'"),
        (_drop("content"), "holds unknown content None"),
    ],
)
def test_malformed_metadata_raises_one_checkpoint_error_naming_the_file(tmp_path, edit, expected):
    path = _saved(tmp_path)
    _tamper(path, metadata=edit)
    with pytest.raises(lx.CheckpointError, match=expected) as info:
        lx.load(path, like=_train_state())
    assert str(path) in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "state, expected",
    [
        ({"bit_generator": "PCG64"}, r"malformed PCG64 state \(KeyError"),
        ({"bit_generator": "PCG64", "state": {"state": "x", "inc": 1}, "has_uint32": 0, "uinteger": 0}, r"malformed PCG64 state \(TypeError"),
        ({"bit_generator": "PCG64", "state": {"state": -1, "inc": 1}, "has_uint32": 0, "uinteger": 0}, r"malformed PCG64 state \(OverflowError"),
        ([1, 2], "expected a generator state naming one of NumPy's bit generators"),
    ],
)
def test_a_malformed_generator_state_is_named(tmp_path, state, expected):
    path = _saved(tmp_path)
    _tamper(path, others=lambda o: o[DROPOUT_RNG].update(state=state))
    with pytest.raises(lx.CheckpointError, match=f"{DROPOUT_RNG}: {expected}"):
        lx.load(path, like=_train_state())


def test_files_that_are_not_checkpoints(tmp_path):
    like = _train_state()
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(np.random.default_rng(0).bytes(300))
    no_metadata = tmp_path / "plain.safetensors"
    save_file({"w": np.ones(2)}, no_metadata)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(_saved(tmp_path).read_bytes()[:-10])
    empty = tmp_path / "empty.safetensors"
    empty.touch()
    npy = tmp_path / "weights.npy"
    np.save(npy, np.ones(3))
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)  # opening it would wait for a writer: refused without opening
    cases = [
        (tmp_path, "is a directory"),
        ("/dev/null", "is a character device, not a checkpoint file"),
        (fifo, "is a named pipe, not a checkpoint file"),
        (junk, "not a readable safetensors file"),
        (truncated, r"not a readable safetensors file \(.*not fully covered"),
        (empty, "is empty"),
        (npy, "not a readable safetensors file"),
        (npy / "x", r"cannot be read \(Not a directory\)"),
        (no_metadata, "not a luxnn checkpoint"),
    ]  # fmt: skip
    for path, expected in cases:
        with pytest.raises(lx.CheckpointError, match=expected) as info:
            lx.load(path, like=like)
        assert f"checkpoint {path}: " in str(info.value)
    with pytest.raises(FileNotFoundError):
        lx.load(tmp_path / "absent.safetensors", like=like)


def test_a_checkpoint_gets_the_mode_open_gives_under_the_umask(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    for umask in (0o022, 0o027, 0o002):
        previous = os.umask(umask)
        try:
            lx.save(path, {"w": np.ones(2)})
        finally:
            os.umask(previous)
        assert oct(os.stat(path).st_mode & 0o777) == oct(0o666 & ~umask)


# ---- saves killed mid-write -----------------------------------------------------------------

# Saves {"w": full(8, value)} to argv[1], held once the file is written (before its rename)
# until a line comes on stdin: the test kills it there or lets it go on.
HELD_SAVE = """
import sys, numpy as np, safetensors.numpy, luxnn as lx
real_save_file = safetensors.numpy.save_file
def held(arrays, filename, metadata=None):
    real_save_file(arrays, filename, metadata=metadata)
    print("written", flush=True)
    sys.stdin.readline()
safetensors.numpy.save_file = held
lx.save(sys.argv[1], {"w": np.full(8, float(sys.argv[2]))})
"""


def _held_save(path, value):
    proc = subprocess.Popen([sys.executable, "-c", HELD_SAVE, str(path), str(value)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdout.readline() == "written\n", proc.communicate(timeout=60)[1]
    return proc


def _stages(directory, name="ckpt.safetensors"):
    return sorted(p for p in os.listdir(directory) if p.startswith(name + ".") and p.endswith(".tmp"))


def test_the_next_save_removes_what_a_killed_save_left_and_nothing_of_live_saves_or_other_files(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    killed = _held_save(path, 1)
    killed.kill()  # SIGKILL: no handler, no cleanup
    assert killed.wait(timeout=60) == -9
    [left] = _stages(tmp_path)
    assert os.path.getsize(tmp_path / left / "ckpt.safetensors") > 0  # a whole file's data
    # The pid in a name says nothing: here it is a live process's (this one), as after reuse.
    reused = f"ckpt.safetensors.{os.getpid()}-{left.rsplit('-', 1)[1]}"
    os.rename(tmp_path / left, tmp_path / reused)
    other_target = "other.safetensors" + left[len("ckpt.safetensors"):]
    shutil.copytree(tmp_path / reused, tmp_path / other_target)
    # A stage whose owner file is empty never held the lock (a save about to take it): kept.
    unlocked = f"ckpt.safetensors.{os.getpid()}-{'0' * 12}.tmp"
    os.mkdir(tmp_path / unlocked)
    (tmp_path / unlocked / "owner").touch()
    live = _held_save(path, 2)
    [live_stage] = set(_stages(tmp_path)) - {reused, unlocked}
    try:
        lx.save(path, {"w": np.zeros(8)})
        assert _stages(tmp_path) == sorted([live_stage, unlocked]) and _stages(tmp_path, "other.safetensors") == [other_target]
    finally:
        _, err = live.communicate("go on\n", timeout=60)
    assert live.returncode == 0, err
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt.safetensors", other_target, unlocked])
    assert lx.load(path, like={"w": np.zeros(8)})["w"][0] == 2.0


# ---- concurrent saves -----------------------------------------------------------------------


def test_concurrent_saves_to_one_path_never_write_into_each_others_file(tmp_path, monkeypatch):
    """Two saves held mid-write at once (a barrier inside safetensors' writer): each wrote
    a file of its own, both renames succeed, and the checkpoint is one of the two whole."""
    import safetensors.numpy

    barrier = threading.Barrier(2, timeout=30)
    written = []
    real_save_file = safetensors.numpy.save_file

    def held(arrays, filename, metadata=None):
        real_save_file(arrays, filename, metadata=metadata)
        written.append(filename)
        barrier.wait()

    monkeypatch.setattr(safetensors.numpy, "save_file", held)
    path = tmp_path / "ckpt.safetensors"
    states = [_train_state().replace(step=i) for i in range(2)]
    errors = []

    def save(t):
        try:
            lx.save(path, t)
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(ts,)) for ts in states]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and len(set(written)) == 2
    assert lx.load(path, like=states[0]).step in (0, 1)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_processes_saving_to_one_path_all_succeed_and_leave_one_whole_checkpoint(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    script = textwrap.dedent(
        """
        import sys, numpy as np, luxnn as lx
        model = lx.Dense(100, 100)
        ps, st = lx.setup(np.random.default_rng(0), model)
        ts = lx.TrainState(model, ps, st, lx.optim.sgd(0.1), allocator_cache=None)
        writer = int(sys.argv[2])
        for i in range(40):
            ps["bias"][:] = writer
            lx.save(sys.argv[1], ts.replace(step=i))
        """
    )
    procs = [subprocess.Popen([sys.executable, "-c", script, str(path), str(w)], stderr=subprocess.PIPE, text=True) for w in range(4)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
    model = lx.Dense(100, 100)
    like = lx.TrainState(model, *lx.setup(np.random.default_rng(0), model), lx.optim.sgd(0.1), allocator_cache=None)
    loaded = lx.load(path, like=like)
    bias = loaded.parameters["bias"]
    assert loaded.step == 39 and np.all(bias == bias[0]) and bias[0] in range(4)
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]


def test_a_gpu_train_state_loads_onto_the_device_of_like(tmp_path, gpu):
    import cupy

    ts = _train_state().to_device(gpu)
    loaded = lx.load(_saved(tmp_path, ts), like=_train_state(seed=7).to_device(gpu))
    for a, b in zip(lx.tree.leaves(ts.parameters), lx.tree.leaves(loaded.parameters)):
        assert isinstance(b, cupy.ndarray) and b.device.id == a.device.id
        cupy.testing.assert_array_equal(a, b)
