"""Checkpoints of a `TrainState`: parameters, states, optimizer state and step.

Arrays go into a safetensors file under their tree paths (``parameters/layer_1/weight``);
everything else in the trees (flags, counters, random generators) goes into the file's
metadata as JSON. Loading needs a `TrainState` of the same structure (``like=``), which
supplies the model, the optimizer and the containers' types.

>>> import numpy as np, luxnn as lx, tempfile, os
>>> model = lx.Dense(2, 2)
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3), allocator_cache=None)
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt.safetensors")
>>> lx.save(path, ts)
>>> bool((lx.load(path, like=ts).parameters["weight"] == ps["weight"]).all())
True
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from . import tree
from .backend import is_array

__all__ = ["save", "load"]

_FIELDS = ("parameters", "states", "optimizer_state")
_FORMAT = "luxnn-checkpoint-1"


def _encode(leaf: Any) -> dict[str, Any]:
    if isinstance(leaf, np.random.Generator):
        return {"kind": "generator", "state": leaf.bit_generator.state}
    if leaf is None or isinstance(leaf, (bool, int, float, str)):
        return {"kind": "value", "value": leaf}
    if isinstance(leaf, np.generic):
        return {"kind": "scalar", "dtype": leaf.dtype.str, "value": leaf.item()}
    raise TypeError(f"save: cannot store a leaf of type {type(leaf).__name__}")


def _decode(entry: dict[str, Any]) -> Any:
    if entry["kind"] == "generator":
        state = entry["state"]
        bit_generator = getattr(np.random, state["bit_generator"])()
        bit_generator.state = state
        return np.random.Generator(bit_generator)
    if entry["kind"] == "scalar":
        return np.dtype(entry["dtype"]).type(entry["value"])
    return entry["value"]


def save(path: str | os.PathLike, ts: Any) -> None:
    """Write `ts`'s parameters, states, optimizer state and step to `path` (safetensors)."""
    from safetensors.numpy import save_file

    arrays: dict[str, np.ndarray] = {}
    others: dict[str, Any] = {}
    for field in _FIELDS:
        for path_, leaf in tree.paths(getattr(ts, field), field):
            if is_array(leaf):
                host = leaf if isinstance(leaf, np.ndarray) else leaf.get()
                arrays[path_] = np.ascontiguousarray(host)
            else:
                others[path_] = _encode(leaf)
    metadata = {"format": _FORMAT, "step": str(ts.step), "others": json.dumps(others)}
    tmp = f"{os.fspath(path)}.tmp"
    save_file(arrays, tmp, metadata=metadata)
    os.replace(tmp, path)  # a crash mid-write never leaves a truncated checkpoint behind


def load(path: str | os.PathLike, *, like: Any) -> Any:
    """Read a checkpoint written by `save` into a copy of `like` (a `TrainState` of the same
    model and optimizer). Raises `ValueError` naming every mismatch (missing or extra
    entries, shapes, dtypes) before anything is built; `like` is never modified."""
    from safetensors import safe_open

    with safe_open(os.fspath(path), framework="numpy") as f:
        metadata = f.metadata() or {}
        if metadata.get("format") != _FORMAT:
            raise ValueError(f"load: {path} is not a luxnn checkpoint (format {metadata.get('format')!r})")
        arrays = {key: f.get_tensor(key) for key in f.keys()}
    others = json.loads(metadata["others"])

    problems: list[str] = []
    expected: set[str] = set()
    for field in _FIELDS:
        for path_, leaf in tree.paths(getattr(like, field), field):
            expected.add(path_)
            if is_array(leaf):
                got = arrays.get(path_)
                if got is not None and leaf.shape == () and got.shape == (1,):
                    got = arrays[path_] = got.reshape(())  # safetensors stores 0-d arrays as (1,)
                if got is None:
                    problems.append(f"missing array {path_}")
                elif got.shape != leaf.shape or got.dtype != leaf.dtype:
                    problems.append(f"{path_}: expected {leaf.dtype}{list(leaf.shape)}, got {got.dtype}{list(got.shape)}")
            elif path_ not in others:
                problems.append(f"missing entry {path_}")
    problems += [f"unexpected entry {p}" for p in sorted((arrays.keys() | others.keys()) - expected)]
    if problems:
        raise ValueError(f"load: checkpoint {path} does not match the train state: " + "; ".join(problems))

    def restore(field: str) -> Any:
        template = getattr(like, field)
        values = [
            _on_device_of(arrays[path_], leaf) if is_array(leaf) else _decode(others[path_])
            for path_, leaf in tree.paths(template, field)
        ]
        return tree.unflatten(tree.structure(template), values)

    return like.replace(**{field: restore(field) for field in _FIELDS}, step=int(metadata["step"]))


def _on_device_of(host: np.ndarray, like: Any) -> Any:
    if isinstance(like, np.ndarray):
        return host
    import cupy

    with cupy.cuda.Device(like.device.id):
        return cupy.asarray(host)
