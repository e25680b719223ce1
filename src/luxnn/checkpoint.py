"""Checkpoints: a whole `TrainState` (parameters, states, optimizer state, step) or any
pytree of arrays, in one safetensors file.

Arrays go into the file under their tree paths (``parameters/layer_1/weight``); everything
else in the trees (flags, counters, NumPy scalars, random generators) goes into the file's
metadata as JSON. Loading needs a template of the same structure (``like=``), which
supplies the containers' types (and for a `TrainState` the model and the optimizer); every
entry of the file is checked against it, kind and type, before anything is built. A file
is data, never code: the only names read from it that select anything are NumPy's bit
generators, from a fixed list.

`save` writes the file whole or not at all: into a staging directory of its own next to
the checkpoint (``<name>.<pid>-<hex>.tmp``), then renamed over it. The file gets the mode
``open`` would give it (0666 less the umask). A save killed mid-write (SIGKILL, a lost
node) leaves its staging directory behind; the next save to the same path removes it.
The stage's owner file is locked (``flock``) for the whole save and the lock dies with its
process, so a save removes only stages of saves that no longer run, whatever their pid
(reused or of another machine sharing the directory), and only those of its own target.
A stage whose lock was never taken is left alone: that of a save killed in the instant
before taking it (an empty directory), or of a save on a file system without locks.

>>> import numpy as np, luxnn as lx, tempfile, os
>>> model = lx.Dense(2, 2)
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3), allocator_cache=None)
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
>>> lx.save(path, ts)
>>> bool((lx.load(path, like=ts).parameters["weight"] == ps["weight"]).all())
True
>>> lx.save(path, ps)  # any pytree of arrays
>>> lx.load(path, like=ps)["bias"].shape
(2,)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import reprlib
import secrets
import shutil
import stat
from typing import Any

import numpy as np

from . import tree
from .backend import is_array
from .ops import device_checks
from .training import TrainState

__all__ = ["save", "load", "CheckpointError"]

_FORMAT = "luxnn-checkpoint-2"
_FORMAT_1 = "luxnn-checkpoint-1"  # TrainStates only, read as content "train_state"
_TRAIN_STATE_FIELDS = ("parameters", "states", "optimizer_state")
_TREE = "tree"  # the prefix of a plain pytree's paths
_OWNER = "owner"  # in a save's staging directory: locked while the save runs
# The bit generators a checkpoint may name; a name read from a file never reaches getattr.
_BIT_GENERATORS = {
    cls.__name__: cls for cls in (np.random.PCG64, np.random.PCG64DXSM, np.random.MT19937, np.random.Philox, np.random.SFC64)
}  # fmt: skip
_VALUE_TYPES = (type(None), bool, int, float, str)  # stored as JSON, restored as exactly these types
_SCALAR_KINDS = "biuf"  # NumPy scalars whose .item() JSON stores exactly
_STEP = re.compile(r"0|[1-9][0-9]{0,18}")  # a non-negative int64
_short = reprlib.Repr()
_short.maxstring, _short.maxother, _short.maxlist, _short.maxdict, _short.maxlevel = 40, 40, 4, 4, 2


class CheckpointError(ValueError):
    """A file that `load` cannot read into ``like``: not a luxnn checkpoint, malformed, or of
    another structure. The message names the file and everything that is wrong."""


def _sections(obj: Any) -> tuple[str, dict[str, Any]]:
    """What a checkpoint of `obj` holds: its content name and its trees by path prefix."""
    if isinstance(obj, TrainState):
        return "train_state", {field: getattr(obj, field) for field in _TRAIN_STATE_FIELDS}
    return _TREE, {_TREE: obj}


def _entries(sections: dict[str, Any]) -> list[tuple[str, Any]]:
    return [entry for prefix, t in sections.items() for entry in tree.paths(t, prefix)]


# ---- non-array leaves ---------------------------------------------------------------------


def _kind(leaf: Any) -> str | None:
    """How a non-array leaf is stored, or None if it cannot be."""
    if isinstance(leaf, np.random.Generator) and type(leaf.bit_generator) in _BIT_GENERATORS.values():
        return "generator"
    if type(leaf) in _VALUE_TYPES:
        return "value"
    if isinstance(leaf, np.generic) and leaf.dtype.kind in _SCALAR_KINDS:
        return "scalar"
    return None


def _describe(leaf: Any) -> str:
    if is_array(leaf):
        return f"an array {leaf.dtype}{list(leaf.shape)}"
    kind = _kind(leaf)
    if kind == "generator":
        return f"a generator of {type(leaf.bit_generator).__name__}"
    if kind == "scalar":
        return f"a NumPy scalar of dtype {leaf.dtype}"
    return "None" if leaf is None else f"a value of type {type(leaf).__name__}"


def _jsonable(state: Any) -> Any:
    """A bit generator's state with its arrays as lists (the state setters take either)."""
    if isinstance(state, dict):
        return {k: _jsonable(v) for k, v in state.items()}
    return state.tolist() if isinstance(state, np.ndarray) else state


def _encode(path: str, leaf: Any) -> dict[str, Any]:
    kind = _kind(leaf)
    if kind == "generator":
        return {"kind": kind, "state": _jsonable(leaf.bit_generator.state)}
    if kind == "value":
        return {"kind": kind, "value": leaf}
    if kind == "scalar":
        return {"kind": kind, "dtype": leaf.dtype.str, "value": leaf.item()}
    raise TypeError(
        f"save: cannot store {path} of type {type(leaf).__name__}; a checkpoint holds NumPy and CuPy arrays, "
        f"None, bool, int, float, str, NumPy bool/int/float scalars and generators of {sorted(_BIT_GENERATORS)}"
    )


class _Mismatch(Exception):
    """One entry of the file that does not fit `like` (collected, then raised together)."""


def _decode(entry: Any, like: Any) -> Any:
    """The value of a metadata entry, checked against the template's leaf `like`."""
    expected = _kind(like)
    if expected is None:
        raise TypeError(f"load: like= holds a leaf of type {type(like).__name__}, which a checkpoint cannot hold")
    if not isinstance(entry, dict) or entry.get("kind") not in ("generator", "value", "scalar"):
        raise _Mismatch(f"expected {_describe(like)}, got a malformed entry {_short.repr(entry)}")
    if entry["kind"] != expected:
        raise _Mismatch(f"expected {_describe(like)}, got a {entry['kind']} entry")
    if expected == "generator":
        return _decode_generator(entry.get("state"), type(like.bit_generator))
    value = entry.get("value")
    if expected == "value":
        if type(value) is not type(like):
            raise _Mismatch(f"expected {_describe(like)}, got {_short.repr(value)}")
        return value
    if entry.get("dtype") != like.dtype.str:
        raise _Mismatch(f"expected {_describe(like)}, got a scalar of dtype {_short.repr(entry.get('dtype'))}")
    python_type = {"b": bool, "f": float}.get(like.dtype.kind, int)
    if type(value) is not python_type:
        raise _Mismatch(f"expected {_describe(like)}, got {_short.repr(value)}")
    with np.errstate(over="ignore"):
        try:
            scalar = like.dtype.type(value)
        except OverflowError:
            scalar = None
    if scalar is None or not (scalar.item() == value or value != value):  # value != value: NaN
        raise _Mismatch(f"expected {_describe(like)}, got {_short.repr(value)}, which it cannot hold")
    return scalar


def _decode_generator(state: Any, bit_generator: type) -> np.random.Generator:
    name = state.get("bit_generator") if isinstance(state, dict) else None
    if not isinstance(name, str) or name not in _BIT_GENERATORS:
        raise _Mismatch(f"expected a generator state naming one of NumPy's bit generators {sorted(_BIT_GENERATORS)}, got {_short.repr(name)}")
    if _BIT_GENERATORS[name] is not bit_generator:
        raise _Mismatch(f"expected a generator of {bit_generator.__name__}, got one of {name}")
    bits = bit_generator(0)
    try:
        bits.state = state
    except (ValueError, TypeError, KeyError, IndexError, OverflowError) as e:
        raise _Mismatch(f"malformed {name} state ({type(e).__name__}: {e})") from None
    return np.random.Generator(bits)


# ---- save ---------------------------------------------------------------------------------


def save(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` to `path` (safetensors): a `TrainState` (parameters, states, optimizer
    state and step) or any pytree whose leaves are arrays or the values listed in the module
    docstring. Every leaf is checked before the file is written; the file appears whole or
    not at all (written under a name of its own in the same directory, then renamed), so
    concurrent saves to one path never mix, and with the umask's mode. Leftovers of saves
    to `path` that were killed are removed (see the module docstring). A `TrainState`
    consumed by an in-place verb is refused (`ValueError`): its arrays hold the next
    step's parameters, its step and optimizer count the last's. A bad input that a GPU's
    kernels found and no call has reported yet (`luxnn.ops.device_checks`) raises here,
    before anything is written."""
    device_checks.check_now()
    if isinstance(obj, TrainState) and obj.consumed:
        raise ValueError("save: this TrainState was consumed by an in-place verb (its arrays were updated since); "
                         "save the TrainState that verb returned")
    content, sections = _sections(obj)
    arrays: dict[str, np.ndarray] = {}
    others: dict[str, Any] = {}
    for path_, leaf in _entries(sections):
        if path_ in arrays or path_ in others:
            raise ValueError(f"save: two leaves have the path {path_!r} (a dict key contains '/'); rename one")
        if is_array(leaf):
            arrays[path_] = np.ascontiguousarray(leaf if isinstance(leaf, np.ndarray) else leaf.get())
        else:
            others[path_] = _encode(path_, leaf)
    metadata = {"format": _FORMAT, "content": content, "others": json.dumps(others)}
    if isinstance(obj, TrainState):
        metadata["step"] = str(obj.step)
    _write_atomically(os.fspath(path), arrays, metadata)


def _write_atomically(path: str, arrays: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    from safetensors.numpy import save_file

    if os.path.isdir(path):
        raise IsADirectoryError(f"save: {path} is a directory; give a file name")
    directory, name = os.path.split(os.path.abspath(path))
    _remove_abandoned_stages(directory, name)
    # The file is written in a staging directory of this save's own (safetensors writes a
    # temporary file of its own next to its target), in the same directory so that the
    # rename is atomic; its locked owner file says the save is alive (see the module docstring).
    stage = os.path.join(directory, f"{name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")
    os.mkdir(stage, 0o777)
    try:
        with open(os.path.join(stage, _OWNER), "w") as owner:
            try:
                fcntl.flock(owner, fcntl.LOCK_EX)
            except OSError:  # a file system without locks: no cleaner will take this stage
                pass
            else:
                owner.write(f"{os.getpid()}\n")
                owner.flush()  # a written owner file tells a cleaner that the lock was taken
            staged = os.path.join(stage, name)
            save_file(arrays, staged, metadata=metadata)
            # safetensors creates its file 0600; give it the mode open() gives under the
            # umask, which the staging directory got (0777 less the umask) without the x bits.
            os.chmod(staged, stat.S_IMODE(os.stat(stage).st_mode) & 0o666)
            fd = os.open(staged, os.O_RDONLY)
            try:
                os.fsync(fd)  # the data is on disk before the rename makes it the checkpoint
            finally:
                os.close(fd)
            os.replace(staged, path)
            shutil.rmtree(stage)  # still under the lock: no cleaner ever sees it half removed
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _remove_abandoned_stages(directory: str, name: str) -> None:
    """Remove the staging directories of earlier saves to ``directory/name`` whose process
    is gone (killed mid-save): those whose owner file was written and is no longer locked.
    The lock, not the pid in the name, tells: a pid may be reused, or belong to another
    machine sharing the directory. A stage that cannot be opened or locked is left alone."""
    pattern = re.compile(re.escape(name) + r"\.[0-9]+-[0-9a-f]{12}\.tmp")
    try:
        entries = os.listdir(directory)
    except OSError:
        return
    for entry in filter(pattern.fullmatch, entries):
        stage = os.path.join(directory, entry)
        try:
            with open(os.path.join(stage, _OWNER), "r+") as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
                # Empty: its save is between creating the file and locking it (or was killed
                # there, leaving no data); locked by us now, so its owner is gone otherwise.
                if owner.read():
                    shutil.rmtree(stage, ignore_errors=True)
        except OSError:  # gone, locked by a live save, or not ours to open
            continue


# ---- load ---------------------------------------------------------------------------------


def load(path: str | os.PathLike, *, like: Any) -> Any:
    """Read a checkpoint written by `save` into a copy of `like`: a `TrainState` of the same
    model and optimizer, or a pytree of the same structure. Raises `CheckpointError` naming
    the file and every problem (not a checkpoint, malformed metadata, missing, extra or
    mismatched entries: shapes, dtypes, kinds, types) before anything is built; `like` is
    never modified. Every file it cannot read raises `CheckpointError` naming the file and
    why (a directory, a device, truncated or corrupt, not safetensors, not luxnn's); a
    missing or forbidden one raises `FileNotFoundError` or `PermissionError`, as ``open``."""
    path = os.fspath(path)
    content, sections = _sections(like)
    metadata, arrays = _read(path)
    step, others = _parse_metadata(path, metadata, content)

    entries = _entries(sections)
    problems: list[str] = []
    values = [_check_entry(path_, leaf, arrays, others, problems) for path_, leaf in entries]
    array_paths = {p for p, leaf in entries if is_array(leaf)}
    other_paths = {p for p, _ in entries} - array_paths
    # An entry of the wrong kind where like has none of the right kind was named above.
    named = (array_paths - arrays.keys()) | (other_paths - others.keys())
    stray = ((arrays.keys() - array_paths) | (others.keys() - other_paths)) - named
    problems += [f"unexpected entry {p}" for p in sorted(stray)]
    if problems:
        raise _error(path, "does not match like=: " + "; ".join(problems))

    it = (_on_device_of(value, leaf) if is_array(leaf) else value for value, (_, leaf) in zip(values, entries))
    restored = {}
    for prefix, t in sections.items():
        struct = tree.structure(t)  # paths and leaves come in one order
        restored[prefix] = tree.unflatten(struct, [next(it) for _ in range(struct.num_leaves)])
    if content == _TREE:
        return restored[_TREE]
    return like.replace(**restored, step=step)


def _error(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"load: checkpoint {path}: {what}")


_NOT_FILES = (
    (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"),
)  # fmt: skip


def _read(path: str) -> tuple[dict[str, str], dict[str, np.ndarray]]:
    """The metadata and the arrays of a safetensors file."""
    from safetensors import SafetensorError, safe_open

    try:
        info = os.stat(path)
    except (FileNotFoundError, PermissionError):
        raise
    except OSError as e:  # a path through a file, a loop of links, a name too long, an I/O error
        raise _error(path, f"cannot be read ({e.strerror or e})") from None
    if stat.S_ISDIR(info.st_mode):
        raise _error(path, "is a directory, not a file")
    if not stat.S_ISREG(info.st_mode):  # never opened: reading a pipe would wait for a writer
        kind = next((what for test, what in _NOT_FILES if test(info.st_mode)), "neither a file nor a directory")
        raise _error(path, f"is {kind}, not a checkpoint file")
    if info.st_size == 0:
        raise _error(path, "is empty")
    try:
        with safe_open(path, framework="numpy") as f:
            return f.metadata() or {}, {key: f.get_tensor(key) for key in f.keys()}
    except (FileNotFoundError, PermissionError):  # removed or its rights changed since stat
        raise
    except (SafetensorError, OSError, TypeError, ValueError) as e:  # a tensor NumPy cannot hold is a TypeError
        raise _error(path, f"not a readable safetensors file ({e})") from None


def _parse_metadata(path: str, metadata: dict[str, str], content: str) -> tuple[int | None, dict[str, Any]]:
    """The step (None for a pytree) and the non-array entries, checked."""
    fmt = metadata.get("format")
    if fmt not in (_FORMAT, _FORMAT_1):
        raise _error(path, f"not a luxnn checkpoint (format {_short.repr(fmt)}, expected {_FORMAT!r})")
    stored = metadata.get("content") if fmt == _FORMAT else "train_state"
    if stored != content:
        expected = "a TrainState" if content == "train_state" else "a pytree"
        got = {"train_state": "a TrainState", _TREE: "a pytree"}.get(stored, f"unknown content {_short.repr(stored)}")
        raise _error(path, f"holds {got}, but like= is {expected}")
    step = metadata.get("step")
    if content == "train_state" and not (isinstance(step, str) and _STEP.fullmatch(step)):
        raise _error(path, f"'step' must be a non-negative integer, got {_short.repr(step)}")
    if "others" not in metadata:
        raise _error(path, "no 'others' entry (the non-array leaves) in its metadata")
    try:
        others = json.loads(metadata["others"])
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, as are over-long ints
        raise _error(path, f"'others' is not valid JSON ({type(e).__name__}: {_short.repr(str(e))})") from None
    if not isinstance(others, dict):
        raise _error(path, f"'others' must be a JSON object, got {type(others).__name__}")
    return (int(step) if content == "train_state" else None), others


def _check_entry(path: str, leaf: Any, arrays: dict[str, np.ndarray], others: dict[str, Any], problems: list[str]) -> Any:
    """The restored value for the template leaf `leaf` at `path`; a problem is appended to
    `problems` (and None returned) where the file's entry does not fit."""
    if is_array(leaf):
        got = arrays.get(path)
        if got is None:
            problems.append(f"{path}: expected {_describe(leaf)}, got a metadata entry" if path in others else f"missing array {path}")
            return None
        if leaf.shape == () and got.shape == (1,):
            got = got.reshape(())  # older safetensors stored 0-d arrays as (1,)
        if got.shape != leaf.shape or got.dtype != leaf.dtype:
            problems.append(f"{path}: expected {leaf.dtype}{list(leaf.shape)}, got {got.dtype}{list(got.shape)}")
            return None
        return got
    if path not in others:
        problems.append(f"{path}: expected {_describe(leaf)}, got an array" if path in arrays else f"missing entry {path}")
        return None
    try:
        return _decode(others[path], leaf)
    except _Mismatch as e:
        problems.append(f"{path}: {e}")
        return None


def _on_device_of(host: np.ndarray, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return host
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(host)
