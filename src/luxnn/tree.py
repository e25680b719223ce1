"""Pytrees: nested dicts, lists and tuples whose leaves are arrays (or anything else).

Parameters, states, gradients and optimiser states are all pytrees. Dicts are walked
in insertion order, so a tree and the tree built from it by `map` flatten the same way.

>>> from luxnn import tree
>>> tree.map(lambda a: a * 2, {"w": 1.0, "b": (2.0, 3.0)})
{'w': 2.0, 'b': (4.0, 6.0)}
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

__all__ = ["map", "map_with_path", "leaves", "flatten", "unflatten", "structure", "paths", "Structure"]

_CONTAINERS = (dict, list, tuple)


def _is_namedtuple(node: Any) -> bool:
    return isinstance(node, tuple) and hasattr(type(node), "_fields")


def map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:  # noqa: A001 - tree.map reads well
    """Apply `fn` to every leaf of `tree` (and the matching leaves of `rest`).

    >>> map(lambda a, b: a + b, {"x": 1}, {"x": 2})
    {'x': 3}
    """
    # One and two trees are the common cases (every optimizer step): walked without
    # packing the other trees' children into tuples at every node.
    if not rest:
        return _map1(fn, tree)
    if len(rest) == 1:
        return _map2(fn, tree, rest[0])
    return _map_with_path(lambda _, *leaves_: fn(*leaves_), "", tree, rest)


def map_with_path(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Apply ``fn(path, leaf, *others)`` to every leaf of `tree` (and the matching leaves
    of `rest`), as JAX's ``tree_util.tree_map_with_path``. The path is the leaf's keys
    joined with "/" (``"layer_1/bias"``, list and tuple positions as numbers, ``""`` for a
    tree that is a leaf): the names of `paths`, of checkpoint entries, of `lx.summary` and
    of error messages, where JAX passes a tuple of key objects.

    For optax-style masks by name, e.g. weight decay on every parameter but the biases:

    >>> import numpy as np
    >>> from luxnn import optim
    >>> params = {"layer_1": {"weight": np.ones((3, 2)), "bias": np.zeros(2)}, "layer_2": {"scale": np.ones(2)}}
    >>> decay = lambda ps: map_with_path(lambda path, p: path.split("/")[-1] != "bias", ps)
    >>> decay(params)
    {'layer_1': {'weight': True, 'bias': False}, 'layer_2': {'scale': True}}
    >>> opt = optim.adamw(1e-3, weight_decay=1e-2, mask=decay)
    """
    return _map_with_path(fn, "", tree, rest)


def _map_with_path(fn: Callable[..., Any], path: str, tree: Any, rest: tuple[Any, ...]) -> Any:
    if isinstance(tree, dict):
        for other in rest:
            _check_same_keys(tree, other)
        return {k: _map_with_path(fn, _join(path, k), v, tuple(o[k] for o in rest)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        for other in rest:
            _check_same_length(tree, other)
        children = [_map_with_path(fn, _join(path, i), v, tuple(o[i] for o in rest)) for i, v in enumerate(tree)]
        return _rebuild(tree, children)
    return fn(path, tree, *rest)


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _map1(fn: Callable[..., Any], tree: Any) -> Any:
    if isinstance(tree, dict):
        return {k: _map1(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return _rebuild(tree, [_map1(fn, v) for v in tree])
    return fn(tree)


def _map2(fn: Callable[..., Any], tree: Any, other: Any) -> Any:
    if isinstance(tree, dict):
        _check_same_keys(tree, other)
        return {k: _map2(fn, v, other[k]) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        _check_same_length(tree, other)
        return _rebuild(tree, [_map2(fn, v, o) for v, o in zip(tree, other)])
    return fn(tree, other)


def _rebuild(node: tuple | list, children: list[Any]) -> Any:
    if _is_namedtuple(node):
        return type(node)(*children)
    return type(node)(children)


def _check_same_length(a: tuple | list, b: Any) -> None:
    if not isinstance(b, (list, tuple)) or len(b) != len(a):
        size = f" of length {len(b)}" if isinstance(b, (list, tuple)) else ""
        raise ValueError(f"tree structures differ: expected a sequence of length {len(a)}, got {type(b).__name__}{size}")


def _check_same_keys(a: dict, b: Any) -> None:
    if not isinstance(b, dict):
        raise ValueError(f"tree structures differ: expected a dict with keys {list(a)}, got {type(b).__name__}")
    if a.keys() != b.keys():
        raise ValueError(f"tree structures differ: expected keys {sorted(a)}, got {sorted(b)}")


def leaves(tree: Any) -> list[Any]:
    """The leaves of `tree`, depth first, dicts in insertion order.

    >>> leaves({"a": 1, "b": [2, (3,)]})
    [1, 2, 3]
    """
    out: list[Any] = []
    _collect(tree, out)
    return out


def _collect(tree: Any, out: list[Any]) -> None:
    if isinstance(tree, dict):
        for v in tree.values():
            _collect(v, out)
    elif isinstance(tree, _CONTAINERS):
        for v in tree:
            _collect(v, out)
    else:
        out.append(tree)


class Structure(NamedTuple):
    """The shape of a tree without its leaves; `unflatten` rebuilds a tree from it."""

    kind: type | None  # None for a leaf
    keys: tuple  # dict keys, or () for sequences and leaves
    children: tuple  # child Structures

    @property
    def num_leaves(self) -> int:
        if self.kind is None:
            return 1
        return sum(c.num_leaves for c in self.children)

    def __repr__(self) -> str:
        if self.kind is None:
            return "*"
        if self.kind is dict:
            inner = ", ".join(f"{k!r}: {c!r}" for k, c in zip(self.keys, self.children))
            return "{" + inner + "}"
        inner = ", ".join(repr(c) for c in self.children)
        return f"{self.kind.__name__}({inner})"


_LEAF = Structure(None, (), ())


def structure(tree: Any) -> Structure:
    """The `Structure` of `tree`: two trees with equal structures flatten alike."""
    if isinstance(tree, dict):
        return Structure(dict, tuple(tree), tuple(structure(v) for v in tree.values()))
    if isinstance(tree, _CONTAINERS):
        return Structure(type(tree), (), tuple(structure(v) for v in tree))
    return _LEAF


def flatten(tree: Any) -> tuple[list[Any], Structure]:
    """Split `tree` into its leaves and its structure (one pass).

    >>> leaves_, s = flatten({"a": 1, "b": (2, 3)})
    >>> unflatten(s, [x * 10 for x in leaves_])
    {'a': 10, 'b': (20, 30)}
    """
    out: list[Any] = []
    return out, _flatten_into(tree, out)


def _flatten_into(tree: Any, out: list[Any]) -> Structure:
    if isinstance(tree, dict):
        return Structure(dict, tuple(tree), tuple([_flatten_into(v, out) for v in tree.values()]))
    if isinstance(tree, _CONTAINERS):
        return Structure(type(tree), (), tuple([_flatten_into(v, out) for v in tree]))
    out.append(tree)
    return _LEAF


_END = object()


def unflatten(struct: Structure, leaves_: list[Any]) -> Any:
    """Rebuild a tree of structure `struct` from `leaves_` (inverse of `flatten`)."""
    it = iter(leaves_)
    try:
        tree = _build(struct, it)
    except StopIteration:
        tree = _END
    if tree is _END or next(it, _END) is not _END:
        raise ValueError(f"structure has {struct.num_leaves} leaves, got {len(leaves_)}")
    return tree


def _build(struct: Structure, it: Any) -> Any:
    if struct.kind is None:
        return next(it)
    children = [_build(c, it) for c in struct.children]
    if struct.kind is dict:
        return dict(zip(struct.keys, children))
    if issubclass(struct.kind, tuple) and hasattr(struct.kind, "_fields"):
        return struct.kind(*children)
    return struct.kind(children)


def paths(tree: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """(path, leaf) pairs, paths joined with "/", e.g. ``"layer_1/weight"``.

    >>> paths({"layer_1": {"weight": 1}, "opt": (2,)})
    [('layer_1/weight', 1), ('opt/0', 2)]
    """
    if isinstance(tree, dict):
        items = list(tree.items())
    elif isinstance(tree, _CONTAINERS):
        items = list(enumerate(tree))
    else:
        return [(prefix, tree)]
    out: list[tuple[str, Any]] = []
    for k, v in items:
        out.extend(paths(v, _join(prefix, k)))
    return out
