"""The reverse-mode core: traced values, the tape, primitives and the backward pass.

A `Traced` wraps a backend array (NumPy or CuPy) and the index of the tape node that made
it. A primitive is a function of raw arrays that returns its output and its VJP:

    @primitive
    def exp(x):
        y = np.exp(x)
        return y, lambda g, needs: (g * y,)

Called with any `Traced` argument, the primitive runs on the raw values and records one
node; called with raw arrays only, it just computes. `needs[i]` says whether positional
argument `i` wants a cotangent, so a VJP skips work for constants (data, labels). The
backward pass drops each node once it has run, so the values a VJP closed over are freed
as soon as nothing later in the backward pass needs them.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import numpy as np

from .. import parallel, tree

__all__ = ["Traced", "Tape", "primitive", "value_and_grad", "grad", "stop_gradient"]


class Tape:
    """The nodes recorded while differentiating one function: ``(vjp, parents, needs)``.

    Leaves (the inputs being differentiated) are nodes whose vjp is None.
    """

    __slots__ = ("nodes",)

    def __init__(self) -> None:
        self.nodes: list[Any] = []

    def leaf(self, value: Any) -> "Traced":
        return _record(self, value, None, (), ())

    def backward(self, out: "Traced", seed: Any, on_gradient: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
        """Run the VJPs from `out` back to the leaves; returns ``{leaf index: cotangent}``.

        With `on_gradient`, ``on_gradient(leaf index, cotangent)`` is called for each leaf
        that gets a cotangent as soon as no node still to run contributes to it, that is
        right after its last consumer's VJP, while the rest of the backward pass is still
        to come (the gradients of a network's last layers before those of its first).
        """
        nodes = self.nodes
        # {node: [leaves whose gradient is final once it has run]}; empty without reports.
        finishing = {} if on_gradient is None else _last_consumers(nodes, out.index)
        pending: list[Any] = [None] * (out.index + 1)
        pending[out.index] = seed
        leaf_grads: dict[int, Any] = {}
        for i in range(out.index, -1, -1):
            g = pending[i]
            node = nodes[i]
            nodes[i] = pending[i] = None  # frees the values this node's VJP closed over
            if g is not None:
                vjp, parents, needs = node
                if vjp is None:  # a leaf not yet reported (with reports: only `out` itself)
                    leaf_grads[i] = g
                    if on_gradient is not None:
                        on_gradient(i, g)
                else:
                    for p, ct in zip(parents, vjp(g, needs)):
                        if ct is not None and p >= 0:
                            prev = pending[p]
                            pending[p] = ct if prev is None else prev + ct
            if finishing:
                for leaf in finishing.get(i, ()):  # also when node i had no cotangent
                    g = pending[leaf]
                    if g is not None:
                        pending[leaf] = None
                        leaf_grads[leaf] = g
                        on_gradient(leaf, g)
        self.nodes = []
        return leaf_grads


def _last_consumers(nodes: list[Any], top: int) -> dict[int, list[int]]:
    """``{node index: [leaves it is the last consumer of]}`` over nodes ``0..top``: the
    backward pass runs nodes from `top` down, so a leaf's last consumer is its lowest."""
    last: dict[int, int] = {}
    for j in range(top, -1, -1):
        vjp, parents, _ = nodes[j]
        if vjp is not None:
            for p in parents:
                if p >= 0 and nodes[p][0] is None:
                    last[p] = j
    finishing: dict[int, list[int]] = {}
    for leaf, j in last.items():
        finishing.setdefault(j, []).append(leaf)
    return finishing


class Traced:
    """A value recorded on a tape. Supports Python operators, NumPy ufuncs and functions,
    and ``__array_namespace__``, so array code runs on it unchanged."""

    __slots__ = ("value", "tape", "index")
    __array_priority__ = 1000.0

    value: Any
    tape: Tape
    index: int

    # -- array attributes -------------------------------------------------------------
    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    ndim = property(lambda self: self.value.ndim)
    size = property(lambda self: self.value.size)
    device = property(lambda self: getattr(self.value, "device", "cpu"))

    def __len__(self) -> int:
        return len(self.value)

    def __repr__(self) -> str:
        return f"Traced({self.value!r})"

    def __float__(self) -> float:
        return float(self.value)

    def __bool__(self) -> bool:
        return bool(self.value)

    def item(self) -> Any:
        return self.value.item()

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        raise TypeError(
            "a traced value cannot be converted to a plain array: the conversion would lose "
            "its derivative (use luxnn.ad.stop_gradient(x) to take its value on purpose)"
        )

    def __array_namespace__(self, api_version: str | None = None) -> Any:
        from .namespace import traced_namespace

        return traced_namespace(self.value)

    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        from .namespace import apply_ufunc

        return apply_ufunc(ufunc, method, inputs, kwargs)

    def __array_function__(self, func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        from .namespace import apply_function

        return apply_function(func, args, kwargs)


_new_traced = object.__new__


def _stop(x: Any) -> Any:
    return x.value if type(x) is Traced else x


def stop_gradient(x: Any) -> Any:
    """The raw value(s) of a traced value or tree, treated as constants from here on."""
    return tree.map(_stop, x)


def primitive(fn: Callable[..., tuple[Any, Callable]]) -> Callable[..., Any]:
    """Make `fn(*arrays, **static) -> (out, vjp)` a differentiable function.

    The positional parameters without defaults are the array arguments (traced or not);
    ``vjp(g, needs)`` returns one cotangent (or None) per array argument, and `needs` says
    which of them are traced. Other arguments are static configuration.
    """
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        wrapper = _variadic(fn)
    else:
        arity = sum(p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        wrapper = {1: _unary, 2: _binary}.get(arity, _variadic)(fn)
    wrapper = functools.wraps(fn)(wrapper)
    wrapper.raw = fn  # the undecorated (out, vjp) function, for tests and fused kernels
    return wrapper


# Specialised wrappers for one and two array arguments: recording is most of the cost of a
# primitive on small arrays, so the common cases avoid packing and looping over arguments.
_NEEDS_1 = (True,)
_NEEDS_2 = {(True, True): (True, True), (True, False): (True, False), (False, True): (False, True)}


def _record(tape: Tape, out: Any, vjp: Callable, parents: tuple, needs: tuple) -> Any:
    if out.dtype.kind != "f":  # only floating values carry derivatives
        return out
    nodes = tape.nodes
    t = _new_traced(Traced)
    t.value = out
    t.tape = tape
    t.index = len(nodes)
    nodes.append((vjp, parents, needs))
    return t


def _unary(fn: Callable) -> Callable:
    def wrapper(x: Any, *static: Any, **kwargs: Any) -> Any:
        if type(x) is not Traced:
            return fn(x, *static, **kwargs)[0]
        out, vjp = fn(x.value, *static, **kwargs)
        return _record(x.tape, out, vjp, (x.index,), _NEEDS_1)

    return wrapper


def _binary(fn: Callable) -> Callable:
    def wrapper(a: Any, b: Any, *static: Any, **kwargs: Any) -> Any:
        ta, tb = type(a) is Traced, type(b) is Traced
        if ta:
            tape = a.tape
            if tb and b.tape is not tape:
                raise _two_tapes(fn)
        elif tb:
            tape = b.tape
        else:
            return fn(a, b, *static, **kwargs)[0]
        out, vjp = fn(a.value if ta else a, b.value if tb else b, *static, **kwargs)
        parents = (a.index if ta else -1, b.index if tb else -1)
        return _record(tape, out, vjp, parents, _NEEDS_2[ta, tb])

    return wrapper


def _variadic(fn: Callable) -> Callable:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        tape = next((a.tape for a in args if type(a) is Traced), None)
        if tape is None:
            return fn(*args, **kwargs)[0]
        if any(type(a) is Traced and a.tape is not tape for a in args):
            raise _two_tapes(fn)
        needs = tuple(type(a) is Traced for a in args)
        raw = [a.value if n else a for a, n in zip(args, needs)]
        parents = tuple(a.index if n else -1 for a, n in zip(args, needs))
        out, vjp = fn(*raw, **kwargs)
        return _record(tape, out, vjp, parents, needs)

    return wrapper


def _two_tapes(fn: Callable) -> ValueError:
    return ValueError(
        f"{fn.__name__}: arguments traced by two different value_and_grad calls; "
        "nested differentiation is not supported"
    )


def _check_differentiable(leaf: Any, path_of: Callable[[], str]) -> None:
    # `path_of` formats the leaf's path: only needed for the error, and this runs every step.
    dtype = getattr(leaf, "dtype", None)
    if dtype is not None and dtype.kind == "f" and hasattr(leaf, "shape"):
        return
    where = path_of() or "the argument"
    if dtype is None or not hasattr(leaf, "shape"):
        raise TypeError(f"value_and_grad: expected a floating array at {where}, got {type(leaf).__name__}")
    raise TypeError(f"value_and_grad: can only differentiate with respect to floating arrays; {where} has dtype {dtype}")


def _owned(g: Any, like: Any, seen: set[int]) -> Any:
    # A cotangent may be a broadcast view, or the same array as another leaf's cotangent
    # (add passes g through to both inputs): hand out arrays the caller can own.
    if isinstance(g, np.generic):  # NumPy returns 0-d results as scalars, not arrays
        g = np.asarray(g)
    if g.shape != like.shape:
        g = np.broadcast_to(g, like.shape)
    if g.dtype != like.dtype:
        g = g.astype(like.dtype)
    elif g.base is not None or not g.flags.c_contiguous or id(g) in seen:
        g = g.copy()
    seen.add(id(g))
    return g


def value_and_grad(
    f: Callable[..., Any],
    argnums: int | tuple[int, ...] = 0,
    has_aux: bool = False,
    on_gradient: Callable[[int, Any], None] | None = None,
) -> Callable[..., Any]:
    """Return a function computing ``f(*args)`` and its gradient with respect to
    ``args[argnums]`` (pytrees of floating arrays; a tuple of trees for a tuple of argnums).

    `f` must return a scalar, or ``(scalar, aux)`` with ``has_aux=True``; the value is
    then ``(scalar, aux)``.

    `on_gradient(position, gradient)`, if given, is called once for every leaf of the
    differentiated trees (`position` counts their leaves in `luxnn.tree.leaves` order, one
    argument after the other) as soon as the backward pass has finished that leaf's
    gradient, with the very array the result will hold (which must not be written to):
    the last layers' gradients come while the first layers' are still being computed (a
    data-parallel optimizer starts averaging them then). Leaves that get no cotangent
    are reported, with their zeros, after the backward pass.

    >>> import numpy as np
    >>> value, g = value_and_grad(lambda w: (w * w).sum())(np.array([1.0, 2.0]))
    >>> float(value), g.tolist()
    (5.0, [2.0, 4.0])
    >>> finished = []
    >>> _ = value_and_grad(lambda p: (p["a"] * 2.0 * p["b"]).sum(), on_gradient=lambda i, g: finished.append(i))(
    ...     {"a": np.ones(2), "b": np.ones(2)})
    >>> finished  # "b" (position 1) is last used by the last product, so it is finished first
    [1, 0]
    """
    single = isinstance(argnums, int)
    nums = (argnums,) if single else tuple(argnums)

    def wrapped(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        with parallel.step():  # the BLAS's idle threads kept from spinning against luxnn's
            return evaluate(*args, **kwargs)

    def evaluate(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
        for n in nums:
            if not -len(args) <= n < len(args):
                raise ValueError(f"value_and_grad: argnums {n} out of range for {len(args)} arguments")
        tape = Tape()
        args = list(args)
        traced_args = []
        for n in nums:
            leaves, struct = tree.flatten(args[n])
            for i, leaf in enumerate(leaves):
                _check_differentiable(leaf, lambda: tree.paths(args[n])[i][0])  # noqa: B023 - called at once
            traced = [tape.leaf(leaf) for leaf in leaves]
            traced_args.append((struct, traced))
            args[n] = tree.unflatten(struct, traced)
        out = f(*args, **kwargs)
        aux = None
        if has_aux:
            if not (isinstance(out, tuple) and len(out) == 2):
                raise TypeError("value_and_grad(has_aux=True): f must return a pair (scalar, aux)")
            out, aux = out
            aux = stop_gradient(aux)
        raw = _stop(out)
        if not isinstance(raw, (int, float)) and getattr(raw, "size", None) != 1:
            raise TypeError(f"value_and_grad: f must return a scalar, got {type(raw).__name__} of shape {getattr(raw, 'shape', None)}")
        seen: set[int] = set()
        if on_gradient is None:
            if type(out) is Traced and out.tape is tape:
                leaf_grads = tape.backward(out, np.ones_like(raw))
            else:
                leaf_grads = {}

            def grad_of(t: Any) -> Any:
                g = leaf_grads.get(t.index)
                return np.zeros_like(t.value) if g is None else _owned(g, t.value, seen)

        else:
            grad_of = _reported_gradients(tape, out, raw, [t for _, traced in traced_args for t in traced], seen, on_gradient)
        grads = tuple(tree.unflatten(struct, [grad_of(t) for t in traced]) for struct, traced in traced_args)
        value = (raw, aux) if has_aux else raw
        return value, grads[0] if single else grads

    return wrapped


def _reported_gradients(
    tape: Tape, out: Any, raw: Any, leaves: list[Traced], seen: set[int], on_gradient: Callable[[int, Any], None]
) -> Callable[[Traced], Any]:
    """Run the backward pass reporting each leaf's final gradient to `on_gradient` (the
    leaves are the tape's first nodes, so a leaf's node index is its position), then the
    leaves it gave none; returns the gradient of each leaf, as `value_and_grad` hands out."""
    owned: dict[int, Any] = {}

    def finished(index: int, g: Any) -> None:
        owned[index] = g = _owned(g, leaves[index].value, seen)
        on_gradient(index, g)

    if type(out) is Traced and out.tape is tape:
        tape.backward(out, np.ones_like(raw), finished)
    for t in leaves:
        if t.index not in owned:
            owned[t.index] = g = np.zeros_like(t.value)
            on_gradient(t.index, g)
    return lambda t: owned[t.index]


def grad(f: Callable[..., Any], argnums: int | tuple[int, ...] = 0, has_aux: bool = False) -> Callable[..., Any]:
    """Like `value_and_grad`, returning only the gradient (and aux with ``has_aux``)."""
    vg = value_and_grad(f, argnums, has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, g = vg(*args, **kwargs)
        return (g, value[1]) if has_aux else g

    return wrapped
