"""Collectives on trees of arrays, and `synchronize`, which checks the trees first.

`bcast_`, `allreduce_` and `reduce_` write into the arrays of the tree they are given, one
collective per array (after the call's agreement, `Backend.call`), and return the tree; every rank must pass a tree of the same
structure, shapes and dtypes (`synchronize` checks that; these do not, as they run every
step). `check_same_layout` is the check: a digest of each rank's layout is gathered, and
only when the digests differ the layouts themselves, so that every rank raises the same
error naming the first difference, instead of one rank hanging in a collective the
others never enter or receiving a buffer of another shape.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from .. import tree
from ..backend import is_array
from .backend import OPS, Backend, check_backend, check_root, describe

__all__ = ["bcast_", "allreduce_", "reduce_", "synchronize", "check_same_layout", "layout"]


def _where(path: str) -> str:
    return f"'{path}'" if path else "the top of the tree"


def _arrays(what: str, x: Any) -> list[Any]:
    """The arrays of `x`, which must all be writeable arrays, about to be written."""
    out = []
    for path, leaf in tree.paths(x):
        if not is_array(leaf):
            raise TypeError(f"{what}: expected a tree of NumPy or CuPy arrays, got {type(leaf).__name__} at {_where(path)}")
        if isinstance(leaf, np.ndarray) and not leaf.flags.writeable:
            raise ValueError(f"{what}: the array at {_where(path)} is read-only, and {what} writes into it")
        out.append(leaf)
    return out


def _check_op(backend: Backend, what: str, op: str, arrays: list[Any]) -> None:
    """Every array checked before any travels, so that bad input leaves the tree as it was."""
    if op not in OPS:
        raise ValueError(f"{what}: expected op in {OPS}, got {op!r}")
    for a in arrays:
        if op == "avg" and not np.issubdtype(a.dtype, np.inexact):
            raise TypeError(f"{what}: op='avg' needs floating-point arrays, got {a.dtype}")
        if a.dtype == np.bool_:  # MPI and NCCL define sum, max and min on numbers only
            raise TypeError(f"{what}: op={op!r} needs numeric arrays, got bool")
        backend.check_reducible(what, a)


def bcast_(backend: Backend, x: Any, root: int = 0) -> Any:
    """Overwrite every array of tree `x` with `root`'s; returns `x`.

    >>> dist.bcast_(backend, {"w": np.arange(3.0) * dist.local_rank(backend)})  # doctest: +SKIP
    {'w': array([0., 0., 0.])}
    """
    backend = check_backend(backend, "bcast_")
    check_root(backend, "bcast_", root)
    arrays = _arrays("bcast_", x)
    with backend.call("bcast_", layout=describe(arrays, root=root)):
        for a in arrays:
            backend.bcast(a, root)
    return x


def allreduce_(backend: Backend, x: Any, op: str = "sum") -> Any:
    """Reduce every array of tree `x` over the ranks with `op` ("sum", "avg", "max",
    "min"), in place on every rank; returns `x`.

    >>> dist.allreduce_(backend, np.ones(2), op="sum")  # doctest: +SKIP
    array([2., 2.])
    """
    backend = check_backend(backend, "allreduce_")
    arrays = _arrays("allreduce_", x)
    _check_op(backend, "allreduce_", op, arrays)
    with backend.call("allreduce_", layout=describe(arrays, op)):
        for a in arrays:
            backend.allreduce(a, op)
    return x


def reduce_(backend: Backend, x: Any, op: str = "sum", root: int = 0) -> Any:
    """Reduce every array of tree `x` over the ranks into `root`'s arrays (the other ranks'
    are left as they were); returns `x`.

    >>> dist.reduce_(backend, np.ones(2), op="max", root=0)  # doctest: +SKIP
    array([1., 1.])
    """
    backend = check_backend(backend, "reduce_")
    check_root(backend, "reduce_", root)
    arrays = _arrays("reduce_", x)
    _check_op(backend, "reduce_", op, arrays)
    with backend.call("reduce_", layout=describe(arrays, op, root)):
        for a in arrays:
            backend.reduce(a, op, root)
    return x


# ---- layouts ----------------------------------------------------------------------------------


def _describe(leaf: Any) -> tuple:
    if is_array(leaf):
        return ("array", leaf.dtype.str, tuple(leaf.shape), "cpu" if isinstance(leaf, np.ndarray) else "gpu")
    if isinstance(leaf, np.random.Generator):
        return ("generator", type(leaf.bit_generator).__name__)
    return ("value" if _is_value(leaf) else "other", type(leaf).__name__)


def _is_value(leaf: Any) -> bool:
    """Scalars and generators: the leaves `synchronize` sends as Python objects."""
    return isinstance(leaf, (bool, int, float, complex, np.generic, np.random.Generator))


def _show(description: tuple, device: bool) -> str:
    if description[0] == "array":
        _, dtype, shape, where = description
        return f"{np.dtype(dtype)}{list(shape)}" + (f" on the {where.upper()}" if device else "")
    return f"a {description[1]}" if description[0] != "generator" else f"a Generator({description[1]})"


def layout(x: Any) -> tuple[list[tuple[str, tuple]], str]:
    """``([(path, description)], containers)``: every leaf of `x` (arrays: dtype, shape,
    device; other leaves: their type) and the structure of its containers."""
    return [(path, _describe(leaf)) for path, leaf in tree.paths(x)], repr(tree.structure(x))


def _first_difference(a: tuple, b: tuple, rank_a: int, rank_b: int) -> str:
    (leaves_a, containers_a), (leaves_b, containers_b) = a, b
    for (path_a, desc_a), (path_b, desc_b) in zip(leaves_a, leaves_b):
        if path_a != path_b:
            return f"leaf {_where(path_a)} on rank {rank_a} where rank {rank_b} has {_where(path_b)}"
        if desc_a != desc_b:
            device = desc_a[0] == desc_b[0] == "array" and desc_a[3] != desc_b[3]
            return f"{_where(path_a)} is {_show(desc_a, device)} on rank {rank_a} but {_show(desc_b, device)} on rank {rank_b}"
    if len(leaves_a) != len(leaves_b):
        (longer, rank), (shorter, other) = sorted([(leaves_a, rank_a), (leaves_b, rank_b)], key=lambda p: -len(p[0]))
        return f"leaf {_where(longer[len(shorter)][0])} on rank {rank} is missing on rank {other}"
    return f"the containers differ: {containers_a[:200]} on rank {rank_a}, {containers_b[:200]} on rank {rank_b}"


def check_same_layout(backend: Backend, what: str, x: Any, root: int = 0, problem: str | None = None) -> None:
    """Raise `ValueError` on every rank, naming the first difference with `root`'s tree,
    unless every rank's tree `x` has the same layout (see `layout`). One small collective
    when the trees agree. `problem`, a rank's own objection to its `x` (found before),
    is raised on every rank too, naming the rank, instead of on that rank alone (which
    would leave the others in this collective).

    >>> check_same_layout(backend, "synchronize", {"w": np.zeros(3)})  # doctest: +SKIP
    """
    mine = layout(x)
    digest = hashlib.sha256(repr(mine).encode()).hexdigest()
    gathered = backend.allgather_object((digest, problem))
    objections = [(rank, said) for rank, (_, said) in enumerate(gathered) if said is not None]
    if objections:
        rank, said = objections[0]
        raise ValueError(f"{what}: on rank {rank}: {said}" if backend.size > 1 else f"{what}: {said}")
    digests = [d for d, _ in gathered]
    if len(set(digests)) == 1:
        return
    layouts = backend.allgather_object(mine)  # every rank takes this branch: the digests are shared
    other = next(r for r, d in enumerate(digests) if d != digests[root])
    raise ValueError(
        f"{what}: the trees differ between ranks: {_first_difference(layouts[root], layouts[other], root, other)}; "
        f"every rank must hold the same structure, shapes and dtypes"
    )


def synchronize(backend: Backend, x: Any, root: int = 0) -> Any:
    """Every rank's copy of tree `x` made equal to `root`'s: arrays are overwritten in place,
    scalars and random generators replaced by `root`'s, other leaves left as they are.
    Returns the tree. Trees that differ between ranks (structure, shapes, dtypes) raise a
    `ValueError` on every rank naming the first difference, before anything is sent.

    >>> ps, st = dist.synchronize(backend, lx.setup(np.random.default_rng(rank), model))  # doctest: +SKIP
    """
    backend = check_backend(backend, "synchronize")
    check_root(backend, "synchronize", root)
    pairs = tree.paths(x)
    read_only = next((path for path, leaf in pairs if isinstance(leaf, np.ndarray) and not leaf.flags.writeable), None)
    problem = None if read_only is None else f"the array at {_where(read_only)} is read-only, and synchronize writes into it"
    with backend.call("synchronize"):
        check_same_layout(backend, "synchronize", x, root, problem)
        values = backend.bcast_object({i: leaf for i, (_, leaf) in enumerate(pairs) if _is_value(leaf)}, root)
        leaves = []
        for i, (_, leaf) in enumerate(pairs):
            if is_array(leaf):
                backend.bcast(leaf, root)
            leaves.append(values.get(i, leaf))
    return tree.unflatten(tree.structure(x), leaves)
