"""Array-API primitives: each states its forward and its VJP side by side.

Forwards call NumPy's functions, which CuPy arrays also accept (``__array_ufunc__`` and
``__array_function__``), so one definition serves both backends. VJPs close over the
fewest values they need (shapes rather than inputs where that suffices).
"""

from __future__ import annotations

import builtins
import math
from typing import Any

import numpy as np

from .. import parallel
from ..backend import module_of
from .tape import primitive


def _shape(a: Any) -> tuple[int, ...]:
    return getattr(a, "shape", ())


def unbroadcast(g: Any, shape: tuple[int, ...]) -> Any:
    """Sum `g` over the axes that broadcasting added or stretched, to get back `shape`."""
    if g.shape == shape:
        return g
    if not hasattr(g, "ndim"):  # a Python or NumPy scalar cotangent
        return np.broadcast_to(g, shape)
    lead = g.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and g.shape[lead + i] != 1
    )
    g = g.sum(axis=axes) if axes else g
    return g if g.shape == shape else g.reshape(shape)


def _normalize_axis(axis: Any, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(a % ndim if ndim else 0 for a in axes)


def _keepdims_shape(shape: tuple[int, ...], axis: Any) -> tuple[int, ...]:
    axes = _normalize_axis(axis, len(shape))
    return tuple(1 if i in axes else n for i, n in enumerate(shape))


# -- elementwise binary -------------------------------------------------------------------


@primitive
def add(a, b):
    sa, sb = _shape(a), _shape(b)
    return np.add(a, b), lambda g, needs: (
        unbroadcast(g, sa) if needs[0] else None,
        unbroadcast(g, sb) if needs[1] else None,
    )


@primitive
def subtract(a, b):
    sa, sb = _shape(a), _shape(b)
    return np.subtract(a, b), lambda g, needs: (
        unbroadcast(g, sa) if needs[0] else None,
        unbroadcast(-g, sb) if needs[1] else None,
    )


@primitive
def multiply(a, b):
    return np.multiply(a, b), lambda g, needs: (
        unbroadcast(g * b, _shape(a)) if needs[0] else None,
        unbroadcast(g * a, _shape(b)) if needs[1] else None,
    )


@primitive
def divide(a, b):
    y = np.divide(a, b)
    sa, sb = _shape(a), _shape(b)  # not `a` itself: the numerator is not needed
    return y, lambda g, needs: (
        unbroadcast(g / b, sa) if needs[0] else None,
        unbroadcast(-g * y / b, sb) if needs[1] else None,
    )


@primitive
def power(a, b):
    y = np.power(a, b)

    def vjp(g, needs):
        ga = None
        if needs[0]:
            # where b == 0 the derivative is 0 even at a == 0 (as in PyTorch), not 0 * inf
            with np.errstate(divide="ignore", invalid="ignore"):
                ga = unbroadcast(g * np.where(np.equal(b, 0), 0, b * np.power(a, b - 1)), _shape(a))
        gb = unbroadcast(g * y * np.log(np.where(a > 0, a, 1)), _shape(b)) if needs[1] else None
        return ga, gb

    return y, vjp


@primitive
def maximum(a, b):
    return np.maximum(a, b), lambda g, needs: _select_vjp(g, needs, a, b, np.greater)


@primitive
def minimum(a, b):
    return np.minimum(a, b), lambda g, needs: _select_vjp(g, needs, a, b, np.less)


def _select_vjp(g, needs, a, b, wins):
    # Ties split the cotangent evenly, as PyTorch does. Built from g alone, so the
    # cotangent keeps g's dtype (a float64 share would promote float32 gradients).
    ga = np.where(np.equal(a, b), 0.5 * g, g * wins(a, b))
    return (
        unbroadcast(ga, _shape(a)) if needs[0] else None,
        unbroadcast(g - ga, _shape(b)) if needs[1] else None,
    )


@primitive
def where(condition, a, b):
    sa, sb = _shape(a), _shape(b)
    return np.where(condition, a, b), lambda g, needs: (
        None,
        unbroadcast(np.where(condition, g, 0), sa) if needs[1] else None,
        unbroadcast(np.where(condition, 0, g), sb) if needs[2] else None,
    )


# -- elementwise unary --------------------------------------------------------------------


@primitive
def negative(x):
    return np.negative(x), lambda g, needs: (-g,)


@primitive
def exp(x):
    y = np.exp(x)
    return y, lambda g, needs: (g * y,)


@primitive
def log(x):
    return np.log(x), lambda g, needs: (g / x,)


@primitive
def log1p(x):
    return np.log1p(x), lambda g, needs: (g / (1 + x),)


@primitive
def sqrt(x):
    y = np.sqrt(x)
    return y, lambda g, needs: (g * 0.5 / y,)


@primitive
def square(x):
    return np.square(x), lambda g, needs: (g * 2 * x,)


@primitive
def abs(x):  # noqa: A001 - the array-API name
    return np.abs(x), lambda g, needs: (g * np.sign(x),)


_ACTIVATIONS = None  # luxnn.ops.traits.Area("activations"), made at first use (luxnn.ops imports this module)


def _activations(x):
    """The device's module of the activations area for `x` (luxnn.ops.traits)."""
    global _ACTIVATIONS
    if _ACTIVATIONS is None:
        from ..ops.traits import Area

        _ACTIVATIONS = Area("activations")
    return _ACTIVATIONS[type(x)]


@primitive
def tanh(x):
    impl = _activations(x)
    y, _ = impl.tanh(x)
    return y, lambda g, needs: (impl.tanh_grad(g, y),)


@primitive
def sin(x):
    return np.sin(x), lambda g, needs: (g * np.cos(x),)


@primitive
def cos(x):
    return np.cos(x), lambda g, needs: (-g * np.sin(x),)


@primitive
def clip(x, min=None, max=None):  # noqa: A002 - the array-API names
    y = np.clip(x, min, max)
    return y, lambda g, needs: (np.where(np.equal(y, x), g, 0),)


@primitive
def tril(x, k=0):
    return np.tril(x, k), lambda g, needs: (np.tril(g, k),)


@primitive
def triu(x, k=0):
    return np.triu(x, k), lambda g, needs: (np.triu(g, k),)


@primitive
def astype(x, dtype, copy=True):
    source = x.dtype
    return x.astype(dtype, copy=copy), lambda g, needs: (g.astype(source, copy=False),)


# -- linear algebra -----------------------------------------------------------------------


def _reshaped(x, shape):
    # A reshape to the same shape still makes a view, which value_and_grad would then copy.
    return x if x.shape == shape else x.reshape(shape)


@primitive
def matmul(a, b):
    if b.ndim == 2 and a.ndim > 2:
        return rows_times_matrix(a, b)

    def vjp(g, needs):
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        # Restore the axes the 1-D operands dropped from g, the column's first: for
        # vector @ vector, g is 0-d and has no axis -2 until the column axis is back.
        g2 = g
        if b.ndim == 1:
            g2 = np.expand_dims(g2, -1)
        if a.ndim == 1:
            g2 = np.expand_dims(g2, -2)
        ga = gb = None
        if needs[0]:
            ga = _reshaped(unbroadcast(parallel.matmul(g2, np.swapaxes(b2, -1, -2)), a2.shape), a.shape)
        if needs[1]:
            gb = _reshaped(unbroadcast(parallel.matmul(np.swapaxes(a2, -1, -2), g2), b2.shape), b.shape)
        return ga, gb

    return parallel.matmul(a, b), vjp


def rows_times_matrix(x, w):
    """``(out, vjp)`` of ``x @ w`` for x ``(..., k)`` and w ``(k, m)``: one GEMM over the
    flattened leading axes (NumPy would run one per leading index), and one for each
    cotangent. The kernel of `matmul` by a matrix."""
    k, m = w.shape
    lead = x.shape[:-1]
    rows = x.reshape(-1, k)

    def vjp(g, needs):
        g_rows = g.reshape(-1, m)
        gx = parallel.matmul(g_rows, w.T).reshape(*lead, k) if needs[0] else None
        gw = parallel.matmul(rows.T, g_rows) if needs[1] else None
        return gx, gw

    return parallel.matmul(rows, w).reshape(*lead, m), vjp


# -- reductions ---------------------------------------------------------------------------


@primitive
def sum(x, axis=None, keepdims=False, dtype=None):  # noqa: A001
    shape = x.shape

    def vjp(g, needs):
        if not keepdims:
            g = g.reshape(_keepdims_shape(shape, axis))
        return (np.broadcast_to(g, shape),)

    return np.sum(x, axis=axis, keepdims=keepdims, dtype=dtype), vjp


@primitive
def mean(x, axis=None, keepdims=False):
    shape = x.shape
    count = math.prod(shape[a] for a in _normalize_axis(axis, x.ndim))

    def vjp(g, needs):
        if not keepdims:
            g = g.reshape(_keepdims_shape(shape, axis))
        return (np.broadcast_to(g / count, shape),)

    return np.mean(x, axis=axis, keepdims=keepdims), vjp


def _extremum(reduce):
    def fn(x, axis=None, keepdims=False):
        y = reduce(x, axis=axis, keepdims=True)

        def vjp(g, needs):
            if not keepdims:
                g = g.reshape(y.shape)
            # Ties share the cotangent evenly, as PyTorch's amax/amin do.
            hit = np.equal(x, y)
            return (hit * (g / hit.sum(axis=axis, keepdims=True, dtype=g.dtype)),)

        return (y if keepdims else y.reshape(_reduced_shape(x.shape, axis))), vjp

    fn.__name__ = reduce.__name__
    return primitive(fn)


def _reduced_shape(shape, axis):
    axes = _normalize_axis(axis, len(shape))
    return tuple(n for i, n in enumerate(shape) if i not in axes)


max = _extremum(np.max)  # noqa: A001
min = _extremum(np.min)  # noqa: A001


def var(x, axis=None, *, correction=0.0, keepdims=False, ddof=None):
    """Variance; `correction` (array API) or `ddof` (NumPy) subtracts from the count."""
    return _var(x, axis=axis, keepdims=keepdims, correction=correction if ddof is None else ddof)


@primitive
def _var(x, axis=None, keepdims=False, correction=0.0):
    m = np.mean(x, axis=axis, keepdims=True)
    centred = x - m
    dof = math.prod(x.shape[a] for a in _normalize_axis(axis, x.ndim)) - correction

    def vjp(g, needs):
        if not keepdims:
            g = g.reshape(m.shape)
        return (g * (2.0 / dof) * centred,)

    y = np.sum(centred * centred, axis=axis, keepdims=keepdims) / dof
    return y, vjp


# -- shapes -------------------------------------------------------------------------------


@primitive
def reshape(x, shape, copy=None):
    source = x.shape
    return np.reshape(x, shape), lambda g, needs: (g.reshape(source),)


@primitive
def permute_dims(x, axes):
    # Negative axes count from the end; argsort needs them normalised to invert the order.
    inverse = tuple(np.argsort([a % x.ndim for a in axes]))
    return np.transpose(x, axes), lambda g, needs: (np.transpose(g, inverse),)


def transpose(x, axes=None):
    """NumPy's transpose: reverse the axes unless `axes` is given."""
    return permute_dims(x, tuple(reversed(range(x.ndim))) if axes is None else tuple(axes))


def swapaxes(x, axis1, axis2):
    axes = list(range(x.ndim))
    axes[axis1], axes[axis2] = axes[axis2], axes[axis1]
    return permute_dims(x, tuple(axes))


def matrix_transpose(x):
    return swapaxes(x, -1, -2)


def moveaxis(x, source, destination):
    order = [a for a in range(x.ndim) if a != source % x.ndim]
    order.insert(destination % x.ndim, source % x.ndim)
    return permute_dims(x, tuple(order))


def expand_dims(x, axis=0):
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    ndim = x.ndim + len(axes)
    new = {a % ndim for a in axes}
    rest = iter(x.shape)
    return reshape(x, tuple(1 if i in new else next(rest) for i in range(ndim)))


def squeeze(x, axis=None):
    if axis is None:
        axes = {i for i, n in enumerate(x.shape) if n == 1}
    else:
        axes = set(_normalize_axis(axis, x.ndim))
        wide = [a for a in axes if x.shape[a] != 1]
        if wide:
            raise ValueError(f"squeeze: axis {wide[0]} has length {x.shape[wide[0]]}, expected 1 (shape {x.shape})")
    return reshape(x, tuple(n for i, n in enumerate(x.shape) if i not in axes))


@primitive
def broadcast_to(x, shape):
    source = _shape(x)
    return np.broadcast_to(x, shape), lambda g, needs: (unbroadcast(g, source),)


@primitive
def _concat(*arrays, axis=0):
    sizes = [a.shape[axis] for a in arrays]
    offsets = np.cumsum(sizes)[:-1].tolist()

    def vjp(g, needs):
        parts = np.split(g, offsets, axis=axis)
        return tuple(p if n else None for p, n in zip(parts, needs))

    return np.concatenate(arrays, axis=axis), vjp


def concat(arrays, axis=0):
    """Join `arrays` along an existing `axis` (``axis=None`` flattens them first)."""
    if axis is None:
        return _concat(*[reshape(a, (-1,)) for a in arrays], axis=0)
    return _concat(*arrays, axis=axis)


@primitive
def _stack(*arrays, axis=0):
    def vjp(g, needs):
        parts = np.moveaxis(g, axis, 0)
        return tuple(p if n else None for p, n in zip(parts, needs))

    return np.stack(arrays, axis=axis), vjp


def stack(arrays, axis=0):
    """Join `arrays` along a new `axis`."""
    return _stack(*arrays, axis=axis)


def split(x, indices_or_sections, axis=0):
    """NumPy's split: equal sections, or pieces cut at the given indices, as views."""
    n = x.shape[axis]
    if isinstance(indices_or_sections, int):
        if n % indices_or_sections:
            raise ValueError(f"split: axis {axis} of length {n} does not divide into {indices_or_sections} equal parts")
        step = n // indices_or_sections
        cuts = list(range(step, n, step))
    else:
        cuts = list(indices_or_sections)
    bounds = [0, *cuts, n]
    lead = (slice(None),) * (axis % x.ndim)
    return [getitem(x, lead + (slice(lo, hi),)) for lo, hi in zip(bounds[:-1], bounds[1:])]


# -- indexing -----------------------------------------------------------------------------


def _is_basic(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return builtins.all(i is None or i is Ellipsis or isinstance(i, (int, slice, np.integer)) for i in items)


@primitive
def getitem(x, index):
    xp, shape, dtype = module_of(x), x.shape, x.dtype

    def vjp(g, needs):
        gx = xp.zeros(shape, dtype)
        if _is_basic(index):
            gx[index] = g
        else:
            xp.add.at(gx, index, g)  # repeated indices accumulate (CuPy's is an atomic scatter)
        return (gx,)

    return x[index], vjp


@primitive
def take(x, indices, axis=None):
    xp, shape, dtype = module_of(x), x.shape, x.dtype

    def vjp(g, needs):
        gx = xp.zeros(shape, dtype)
        if axis is None:
            xp.add.at(gx.reshape(-1), indices, g)
        else:
            xp.add.at(gx, (slice(None),) * (axis % len(shape)) + (indices,), g)
        return (gx, None)

    return np.take(x, indices, axis=axis), vjp
