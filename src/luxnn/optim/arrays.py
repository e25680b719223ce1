"""The arrays of the optimisers' leaves: their module and compute dtype, step counts,
leaf-wise maps, and the scratch and ``out=`` buffers of the in-place updates.
"""

from __future__ import annotations

import operator
import weakref
from types import ModuleType
from typing import Any, Callable, Union

import numpy as np

from luxnn import capturing, tree
from luxnn.backend import module_of

Schedule = Callable[[Any], Any]
ScalarOrSchedule = Union[float, Schedule]
OptState = Any
Updates = Any
Params = Any


class Workspace:
    """The scratch of each leaf in turn, when each leaf's update is added into its
    parameter before the next is computed (``update_into``): one flat buffer per compute
    dtype, as large as the largest array of `like` (the parameters), made on first use."""

    def __init__(self, like: list) -> None:
        self.size = max((a.size for a in like), default=0)
        self.buffers: dict = {}
        self.views: dict = {}

    def __call__(self, like: Any) -> Any:
        """A scratch array of `like`'s shape and dtype (a view of the buffer: its contents
        are those of the previous leaf's scratch)."""
        key = (like.dtype, like.shape)
        view = self.views.get(key)
        if view is None:
            buffer = self.buffers.get(like.dtype)
            if buffer is None:
                buffer = self.buffers[like.dtype] = module_of(like).empty(self.size, like.dtype)
            view = self.views[key] = buffer[: like.size].reshape(like.shape)
        return view


def out_buffer(old: Any, in_place: bool, otherwise: Any = None) -> Any:
    """The ``out=`` of a new state leaf: `old` itself when an in-place update may overwrite
    it (a writable array: CuPy's flags have no ``writeable``), else `otherwise` (None: a
    new array)."""
    if in_place:
        flags = getattr(old, "flags", None)
        if flags is not None and getattr(flags, "writeable", True):
            return old
    return otherwise


def module_of_tree(t: Any) -> ModuleType:
    """The array module (NumPy or CuPy) of `t`'s first leaf; NumPy for an empty tree."""
    leaves = tree.leaves(t)
    return module_of(leaves[0]) if leaves else np


def zero_count(params: Params) -> Any:
    """A 0-d int64 step count of the parameters' array module."""
    count = module_of_tree(params).zeros((), dtype=np.int64)
    _remember(count, 0)
    return count


def next_count(count: Any) -> Any:
    """``count + 1`` as a 0-d array of the count's module (NumPy would return a scalar).
    The count never leaves its device: no Python int is made of it (`host_count` keeps
    its value on the host beside it)."""
    new = module_of(count).asarray(count + 1)
    counted(count, new)
    return new


def counted(count: Any, new: Any) -> None:
    """Note that the device count `new` is ``count + 1`` (made by `next_count`, or written
    by a fused kernel), for `host_count`."""
    value = _known(count)
    if value is not None:
        _remember(new, value + 1)


def host_count(count: Any) -> Any:
    """A step count to evaluate a schedule at on the host: a NumPy count itself; for a
    device count, a 0-d NumPy array of its value and dtype (as a schedule gets on the CPU,
    so that it computes alike on both devices), the value known without reading the
    device when the optimisers made the count (`zero_count`, `next_count`, `counted`),
    else read once (a state made elsewhere, e.g. loaded from a checkpoint). The optimisers never write a count in
    place; code that does (luxnn's collectives) calls `overwritten` first, a user writing
    into a count array too."""
    if module_of(count) is np:
        return count
    capturing.host_value("a schedule's value at the step count")
    value = _known(count)
    if value is None:
        value = int(count)
        _remember(count, value)
    return np.asarray(value, dtype=count.dtype)


def overwritten(arrays: Any) -> None:
    """Note that the arrays of tree `arrays` are about to be written in place by code other
    than the optimisers (e.g. ``luxnn.distributed.bcast_`` of an optimizer state): a step
    count among them is then read from the device at its next `host_count`, once.

    >>> overwritten(state)  # doctest: +SKIP
    >>> state.count[...] = 100  # doctest: +SKIP
    """
    for a in tree.leaves(arrays):
        _HOST_COUNTS.pop(id(a), None)


# id of a device count -> (a weak reference to it, its value): the entry of a count that
# is gone is dropped with it, so an id is never taken for another array's.
_HOST_COUNTS: dict = {}


def _known(count: Any) -> int | None:
    entry = _HOST_COUNTS.get(id(count))
    return entry[1] if entry is not None and entry[0]() is count else None


def _remember(count: Any, value: int) -> None:
    if module_of(count) is np:
        return
    key = id(count)
    try:
        reference = weakref.ref(count, lambda _: _HOST_COUNTS.pop(key, None))
    except TypeError:  # an array type without weak references: its count is read each time
        return
    _HOST_COUNTS[key] = (reference, value)


_COMPUTE_DTYPES: dict = {}


def compute_dtype(dtype: Any) -> Any:
    """The dtype an optimiser computes and stores moments in for leaves of `dtype`: at
    least float32 (half-precision moments underflow and eps=1e-8 rounds to 0 in float16)."""
    found = _COMPUTE_DTYPES.get(dtype)
    if found is None:
        d = np.dtype(dtype)
        found = _COMPUTE_DTYPES[dtype] = np.dtype(np.float32) if d.kind == "f" and d.itemsize < 4 else d
    return found


def upcast(x: Any) -> Any:
    """`x` in its `compute_dtype` (`x` itself for float32 and float64)."""
    dtype = compute_dtype(x.dtype)
    return x if dtype is x.dtype or dtype == x.dtype else x.astype(dtype)


def cast_like(x: Any, like: Any) -> Any:
    """`x` in `like`'s dtype, without a copy when it already is."""
    return x if x.dtype == like.dtype else x.astype(like.dtype)


def zeros_for(p: Any) -> Any:
    """Zeros of `p`'s shape in its `compute_dtype`: a fresh moment buffer."""
    return module_of(p).zeros(p.shape, dtype=compute_dtype(p.dtype))


def zeros_like_tree(params: Params) -> Any:
    return tree.map(zeros_for, params)


def scalar_as(value: Any, dtype: Any) -> Any:
    """A scalar to multiply arrays of `dtype` by without promoting them: a Python number
    as it is (NEP 50 keeps the array's dtype), a NumPy scalar or 0-d array in `dtype`."""
    if isinstance(value, (int, float)) and not isinstance(value, np.generic):  # np.float64 is a float
        return value
    return value.astype(dtype)


def leafwise(fn: Callable[..., tuple], first: Any, *others: Any, outputs: int, into: list | None = None) -> tuple:
    """Apply `fn` to matching leaves of `first` and `others` (same structure, checked by the
    caller) and return its `outputs` results as trees shaped like `first`.

    With `into` (arrays, one per leaf), each leaf's first result, its update, is added into
    ``into[i]`` as soon as it is made and not kept: the first tree returned is then None.
    Result k (k >= 1) whose leaves are all those of ``others[k - 1]`` (a state written in
    place) comes back as that very tree, not rebuilt.

    0-d leaves are passed to `fn` as 1-element arrays and come back 0-d: NumPy turns the
    result of an operation on 0-d arrays into a scalar, which cannot be written into with
    ``out=`` and is no array to keep in a state.
    """
    leaves = tree.leaves(first)
    other_leaves = [tree.leaves(o) for o in others]
    results = []
    for i, args in enumerate(zip(leaves, *other_leaves)):
        if getattr(args[0], "ndim", None) == 0:
            views = tuple(a.reshape(1) if hasattr(a, "reshape") else a for a in args)
            result = tuple(_unviewed(r, views, args) for r in fn(*views))
        else:
            result = fn(*args)
        if into is not None:
            into[i] += result[0]
            result = (None, *result[1:])
        results.append(result)
    columns = list(zip(*results)) if results else [()] * outputs
    trees = [None if k == 0 and into is not None else _tree_of(first, column, others, other_leaves, k)
             for k, column in enumerate(columns)]
    return tuple(trees)


def _tree_of(template: Any, column: tuple, others: tuple, other_leaves: list, k: int) -> Any:
    """`leafwise`'s result k: ``others[k - 1]`` when `column` holds its very leaves, else a
    tree of `template`'s structure holding `column`."""
    if 0 < k <= len(others) and all(map(operator.is_, column, other_leaves[k - 1])):
        return others[k - 1]
    return shaped_like(template, column)


def _unviewed(result: Any, views: tuple, args: tuple) -> Any:
    """A 0-d result of `leafwise`: the argument itself when `result` is its 1-element view
    (written in place), else `result` reshaped to 0-d."""
    for view, arg in zip(views, args):
        if result is view:
            return arg
    return result.reshape(())


def shaped_like(template: Any, leaves: Any) -> Any:
    """A tree of `template`'s structure holding `leaves` (in `tree.leaves` order); one
    walk, cheaper than `tree.flatten` and `tree.unflatten` on every update."""
    it = iter(leaves)
    return tree.map(lambda _: next(it), template)


def map_arrays(fn: Callable[..., Any], first: Any, *others: Any, into: list | None = None) -> Any:
    """`tree.map` for leaf arithmetic: as `leafwise` with one result, arrays in and out
    (with `into`, added into its arrays: None)."""
    return leafwise(lambda *args: (fn(*args),), first, *others, outputs=1, into=into)[0]
