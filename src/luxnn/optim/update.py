"""Applying updates to parameters, new arrays or in place (every leaf checked before any
is written), and the helpers of target networks (`incremental_update`, `periodic_update`)
and of clipping (`global_norm`).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from luxnn import tree
from luxnn.backend import module_of

from .arrays import Params, Updates, cast_like, upcast
from .checks import check_float, check_match, check_steps

__all__ = [
    "apply_updates", "apply_updates_", "incremental_update", "periodic_update", "global_norm",
]  # fmt: skip


def apply_updates(params: Params, updates: Updates) -> Params:
    """New parameters ``params + updates``; each result keeps its parameter's dtype.

    >>> import numpy as np
    >>> apply_updates({"w": np.ones(2, np.float32)}, {"w": np.full(2, -0.5)})["w"]
    array([0.5, 0.5], dtype=float32)
    """
    check_match(params, "params", updates, "updates")
    return tree.map(lambda p, u: (p + u).astype(p.dtype, copy=False), params, updates)


def apply_updates_(params: Params, updates: Updates) -> Params:
    """Add `updates` to `params` in place (``p += u``) and return the same `params` tree.

    Every array keeps its identity and dtype. Every leaf is checked before the first is
    written (same structure and shapes, a writable array, an update dtype that casts into
    the parameter's), so a bad update raises `ValueError` and leaves every parameter as it was.

    >>> import numpy as np
    >>> w = np.ones(2, np.float32)
    >>> apply_updates_({"w": w}, {"w": np.full(2, -0.5)})["w"] is w
    True
    """
    targets = tree.leaves(params)
    pairs = in_place_pairs("apply_updates_", params, targets, updates, "updates")
    check_separate("apply_updates_", params, targets)
    for p, u in pairs:
        p += u
    return params


def in_place_pairs(who: str, params: Params, targets: list, updates: Updates, updates_name: str) -> list:
    """The (target, update) leaf pairs (`targets`: the arrays of `params`, or of a tree
    shaped as them), once every target is checked to take its update in place; else a
    ValueError naming `who` and the first path that cannot."""
    check_match(params, "params", updates, updates_name)
    pairs = list(zip(targets, tree.leaves(updates)))
    for i, (p, u) in enumerate(pairs):
        problem = _in_place_problem(p, u)
        if problem:
            raise ValueError(f"{who}: the parameter at '{tree.paths(params)[i][0]}' {problem}; nothing was updated")
    return pairs


def add_into(into: list, updates: Updates, like: Any) -> None:
    """``into[i] += leaf i of updates``, once every leaf is checked (`updates` shaped as
    `like`, each array of `into` able to take its update in place)."""
    for target, u in in_place_pairs("update_into", like, into, updates, "updates"):
        target += u


def check_separate(who: str, params: Params, targets: list) -> None:
    """A ValueError naming `who` and two paths of `params` whose arrays (`targets`, its
    leaves) share memory, the same array twice or overlapping views: an in-place update
    would change that memory once for each, where `apply_updates` gives each its own
    new array. Arrays that own their memory are told apart by identity alone; views are
    compared by their memory once, and the verdict kept for the same arrays."""
    if len(set(map(id, targets))) == len(targets) and all(getattr(t, "base", None) is None for t in targets):
        return
    last = _SEPARATE[0]
    if len(last) == len(targets) and all(ref() is t for ref, t in zip(last, targets)):
        return
    pair = _sharing_pair(targets)
    if pair is not None:
        paths = tree.paths(params)
        raise ValueError(
            f"{who}: the parameters at '{paths[pair[0]][0]}' and '{paths[pair[1]][0]}' share memory (the same array, "
            "or overlapping views of one), so an in-place update would change it once for each; give each "
            "parameter its own array (e.g. lx.tree.map(np.copy, ps)); nothing was updated"
        )
    _SEPARATE[0] = [weakref.ref(t) for t in targets]  # weak: the check keeps no parameter alive


_SEPARATE: list = [[]]  # the last parameter arrays found to share no memory


def _sharing_pair(arrays: list) -> tuple[int, int] | None:
    """The positions of two of `arrays` that share memory, or None. Only views of one
    owner can; within each owner's views, those whose byte spans overlap are compared."""
    by_owner: dict[int, list] = {}
    for i, a in enumerate(arrays):
        owner = a
        while getattr(owner, "base", None) is not None:
            owner = owner.base
        by_owner.setdefault(id(owner), []).append(i)
    for members in by_owner.values():
        spans = sorted((_byte_span(arrays[i]), i) for i in members)
        for k, ((_, high), i) in enumerate(spans):
            for (low, _), j in spans[k + 1:]:
                if low >= high:
                    break
                if module_of(arrays[i]).shares_memory(arrays[i], arrays[j]):
                    return min(i, j), max(i, j)
    return None


def _byte_span(a: Any) -> tuple[int, int]:
    """The addresses ``[low, high)`` that array `a` may touch."""
    interface = getattr(a, "__cuda_array_interface__", None) or a.__array_interface__
    low = high = interface["data"][0]
    if a.size == 0:
        return low, high
    for n, stride in zip(a.shape, a.strides):
        if stride < 0:
            low += stride * (n - 1)
        else:
            high += stride * (n - 1)
    return low, high + a.itemsize


def _in_place_problem(p: Any, u: Any) -> str | None:
    if type(p) is np.ndarray and p.flags.writeable and getattr(u, "dtype", None) == p.dtype:
        return None  # the common case, decided without the checks below
    if not hasattr(p, "dtype") or not hasattr(p, "shape") or isinstance(p, np.generic):
        return f"is a {type(p).__name__}, not an array that can be updated in place"
    flags = getattr(p, "flags", None)
    if flags is not None and not getattr(flags, "writeable", True):
        return "is read-only"
    u_dtype = u.dtype if hasattr(u, "dtype") else np.result_type(u)
    if u_dtype != p.dtype and not np.can_cast(u_dtype, p.dtype, casting="same_kind"):
        return f"has dtype {p.dtype}, which an update of dtype {u_dtype} cannot be cast into"
    return None


def incremental_update(new_tensors: Params, old_tensors: Params, step_size: float) -> Params:
    """Polyak averaging: ``step_size * new + (1 - step_size) * old`` leaf by leaf (optax),
    in the dtype of `old_tensors`; e.g. a target network tracking the online one.

    >>> import numpy as np
    >>> incremental_update({"w": np.ones(2)}, {"w": np.zeros(2)}, 0.25)["w"]
    array([0.25, 0.25])
    """
    step_size = check_float("incremental_update: step_size", step_size, high=1.0)
    check_match(old_tensors, "old_tensors", new_tensors, "new_tensors")

    def average(new: Any, old: Any) -> Any:
        out = new * step_size
        out += old * (1.0 - step_size)
        return cast_like(out, old)

    return tree.map(average, new_tensors, old_tensors)


def periodic_update(new_tensors: Params, old_tensors: Params, steps: Any, update_period: int) -> Params:
    """`new_tensors` when ``steps`` is a multiple of `update_period`, else `old_tensors`
    (optax): a target network copied every `update_period` steps.

    >>> periodic_update({"w": 1.0}, {"w": 0.0}, steps=10, update_period=5)
    {'w': 1.0}
    """
    update_period = check_steps("periodic_update: update_period", update_period, positive=True)
    check_match(old_tensors, "old_tensors", new_tensors, "new_tensors")
    return new_tensors if steps % update_period == 0 else old_tensors


def global_norm(updates: Updates) -> Any:
    """The L2 norm of all leaves of `updates` taken together: a NumPy scalar, or a 0-d
    CuPy array that stays on the device (no host synchronisation). Half-precision leaves
    are summed in float32 so that their squares do not overflow.

    >>> import numpy as np
    >>> float(global_norm({"a": np.array([3.0]), "b": np.array([4.0])}))
    5.0
    """
    leaves = tree.leaves(updates)
    if not leaves:
        return np.zeros(())
    squares = [module_of(g).vdot(g, g) for g in (upcast(g) for g in leaves)]
    return module_of(leaves[0]).sqrt(sum(squares[1:], squares[0]))
