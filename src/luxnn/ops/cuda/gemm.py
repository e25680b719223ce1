"""Every GEMM of luxnn's CUDA ops: `matmul`, cuBLASLt's matmul through nvmath-python where
it is installed, else CuPy's ``matmul``.

CuPy refuses its own cuBLAS while a stream is being captured into a CUDA graph; cuBLASLt
called through nvmath-python's stateful ``nvmath.linalg.advanced.Matmul`` is captured like
any launch. So with nvmath importable, each product of floating arrays runs through a
``Matmul`` planned once per layout (the shapes, strides and pointer alignments of the
operands and the result, the dtype, the device and the current stream) and kept, the
least recently used dropped past `PLANS`. A call rebinds the kept object to its operands
(``reset_operands_unchecked``: the layout it was found by is all that ``reset_operands``
would check), launches it on the current stream without waiting for it (nvmath's
``blocking="auto"`` with device operands), and releases the operands, so that a kept plan
never holds a step's arrays alive. Eager and captured steps take this same path, with the
same plan and algorithm, so they compute the same bits. While a step is being captured
(`luxnn.capturing`), a product of a layout not planned yet raises
``capturing.NotCapturable`` (planning waits for the device: see below), and the graph
keeps a token of each plan it launches: a plan dropped from the kept ones is freed only
once no graph launches it, since its workspace's address is in the graph.

Each product is written in place (nvmath's ``inplace`` with ``beta = 0``: cuBLASLt writes
``A @ B`` into C) into the caller's `out`, or a fresh C-ordered array from CuPy's current
allocator, as CuPy's own result (nvmath's would follow A's order). Operands, and `out`,
go as they are where cuBLASLt can address them as nvmath describes them (a matrix with
unit stride along one axis; a stack that is C-ordered, or is so with its last two axes
swapped, as one strided batch), else through a contiguous copy, as CuPy copies them.

nvmath allocates a plan's workspace (at most `WORKSPACE_BYTES`, what cuBLASLt's heuristic
asks for its best algorithm) at the plan's first execution, through ``cupy.cuda.alloc`` on
the execution's stream, that is from CuPy's current allocator (luxnn's cache inside a
step), and keeps it until the plan is dropped. Planning a new layout waits for the stream
(nvmath makes the heuristic query blocking): one host synchronisation per layout, the
first time it comes, which a stream being captured cannot take.
"""

from __future__ import annotations

import atexit
import collections
import logging
import math
import os
import sys
import threading
import warnings
import weakref
from typing import Any

import numpy as np

from ... import capturing
from ...backend import module_of

__all__ = ["matmul", "clear", "PLANS", "WORKSPACE_BYTES"]

PLANS = 64  # planned products kept, each with its workspace
WORKSPACE_BYTES = 4 << 20  # the most workspace one plan may take

# What cuBLASLt multiplies; CuPy multiplies integers with a kernel of its own, not cuBLAS.
_BLAS_DTYPES = frozenset(np.dtype(name) for name in ("float16", "float32", "float64", "complex64", "complex128"))

# nvmath logs each plan's and execution's steps at INFO to the logger it is given: this
# one, quiet unless its level is set lower.
_LOGGER = logging.getLogger(__name__)
if _LOGGER.level == logging.NOTSET:
    _LOGGER.setLevel(logging.WARNING)

_missing = False  # nvmath was looked for and could not be imported


def matmul(a: Any, b: Any, out: Any = None) -> Any:
    """``a @ b`` of CuPy arrays as ``cupy.matmul`` computes it (written into `out` if given,
    which is returned), through cuBLASLt where nvmath-python is installed.

    Shapes: a ``(..., m, k)`` or ``(k,)``, b ``(..., k, n)`` or ``(k,)`` -> ``(..., m, n)``
    (an axis of a vector operand dropped); with nvmath the leading axes of a and b are equal
    or one operand has none (a ``ValueError`` otherwise), and `out` has the product's shape
    and dtype.

    >>> y = matmul(cupy.ones((2, 3)), cupy.ones((3, 4)))  # doctest: +SKIP
    """
    nvmath = _nvmath()
    if nvmath is None or a.dtype not in _BLAS_DTYPES or b.dtype not in _BLAS_DTYPES:
        if nvmath is None and a.dtype in _BLAS_DTYPES and capturing.active() is not None:
            raise capturing.NotCapturable("a GEMM through CuPy's cuBLAS, which CuPy refuses while capturing "
                                          "(with nvmath-python installed, GEMMs go through cuBLASLt, which it can)")
        return module_of(a).matmul(a, b, out=out)
    return _product(nvmath, a, b, out)


def clear() -> None:
    """Drops every planned product (the next product of each layout is planned again) and
    frees its workspace, or, for a product that a kept CUDA graph launches, frees it once no
    graph does (at a later planning or `clear`).

    >>> clear()
    """
    _PLANS.clear()


def _nvmath() -> Any:
    """The nvmath module, imported on the first product; None where it cannot be, or where
    ``sys.modules["nvmath"]`` is None (Python's mark of a module kept from being imported)."""
    global _missing
    if "nvmath" in sys.modules or _missing:
        return sys.modules.get("nvmath")
    try:
        import nvmath
    except Exception as err:  # noqa: BLE001 - a broken install falls back too, with a warning
        _missing = True
        if not (isinstance(err, ModuleNotFoundError) and err.name == "nvmath"):
            warnings.warn(f"luxnn: nvmath-python did not import ({err!r}); GEMMs run through CuPy's cuBLAS, "
                          "which CUDA graph capture refuses", RuntimeWarning, stacklevel=3)
        return None
    return nvmath


def _product_shape(a: Any, b: Any) -> tuple[int, ...]:
    if a.ndim == 0 or b.ndim == 0:
        raise ValueError(f"matmul: a scalar operand (shapes {a.shape} and {b.shape}); use multiply")
    k_b = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if a.shape[-1] != k_b:
        raise ValueError(f"matmul: a {a.shape} has {a.shape[-1]} columns, b {b.shape} has {k_b} rows")
    lead_a, lead_b = a.shape[:-2], b.shape[:-2]
    if lead_a and lead_b and lead_a != lead_b:
        raise ValueError(f"matmul: the leading axes of a {a.shape} and b {b.shape} differ; luxnn's GEMMs "
                         "broadcast a matrix over a stack, not stacks over each other")
    return (*(lead_a or lead_b), *a.shape[-2:-1], *(b.shape[-1:] if b.ndim > 1 else ()))


def _product(nvmath: Any, a: Any, b: Any, out: Any) -> Any:
    xp = module_of(a)
    dtype, shape = np.promote_types(a.dtype, b.dtype), _product_shape(a, b)
    if out is None:
        out = xp.empty(shape, dtype)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"matmul: out is {out.dtype} {out.shape}, the product of a {a.shape} and b {b.shape} "
                         f"is {dtype} {shape}")
    a, b = a.astype(dtype, copy=False), b.astype(dtype, copy=False)
    if out.size == 0 or a.shape[-1] == 0:
        if out.size:
            out.fill(0)
        return out
    # A vector operand as a matrix of one row (a) or column (b), out with that axis.
    d = out
    if b.ndim == 1:
        b, d = xp.expand_dims(b, -1), xp.expand_dims(d, -1)
    if a.ndim == 1:
        a, d = xp.expand_dims(a, 0), xp.expand_dims(d, -2)
    a, b = _readable(xp, a), _readable(xp, b)
    target = _readable(None, d)
    if target is None:  # an `out` cuBLASLt cannot write as it is: the product, then a copy
        product = xp.empty(d.shape, dtype)
        _PLANS.run(nvmath, xp, a, b, _readable(None, product))
        xp.copyto(d, product)
    else:
        _PLANS.run(nvmath, xp, a, b, target)
    return out


def _readable(xp: Any, x: Any) -> Any:
    """`x` as cuBLASLt reads it: a matrix as it is, a stack as one strided batch ``(count, r,
    c)`` (a view); when it cannot be, a contiguous copy (with `xp`) or None (`xp` None)."""
    if x.ndim == 2:
        if _addressable(x):
            return x
    else:
        *lead, r, c = x.shape
        count = math.prod(lead)
        if x.flags.c_contiguous:
            return x.reshape(count, r, c)
        swapped = x.swapaxes(-1, -2)
        if swapped.flags.c_contiguous:
            return swapped.reshape(count, c, r).swapaxes(-1, -2)
    if xp is None:
        return None
    return _readable(xp, xp.ascontiguousarray(x))


def _addressable(x: Any) -> bool:
    """Whether the matrix `x` as nvmath describes it to cuBLASLt (column-major when its first
    axis has unit stride, else row-major when its second has, else by its single row or
    column; the leading dimension the larger of the stride and the extent) addresses
    exactly x's elements."""
    (r, c), (s0, s1), size = x.shape, x.strides, x.itemsize
    if s0 % size or s1 % size:
        return False
    s0, s1 = s0 // size, s1 // size
    if s0 == 1:
        return c == 1 or s1 >= r
    if s1 == 1:
        return r == 1 or s0 >= c
    if r == 1:
        return c == 1 or s1 > 0
    return c == 1 and s0 > 0


def _layout(x: Any) -> tuple:
    ptr = x.data.ptr
    return x.shape, x.strides, min(256, ptr & -ptr)  # nvmath plans for the pointers' alignment


class _InGraph:
    """Kept by every captured CUDA graph that launches a plan: while one lives, the plan's
    workspace must not be freed, its address being in the graph."""

    __slots__ = ("__weakref__",)


class _Plan:
    """A planned ``Matmul`` and a weak reference to its `_InGraph`, once a graph launches it."""

    __slots__ = ("matmul", "in_graph")

    def __init__(self, matmul: Any) -> None:
        self.matmul, self.in_graph = matmul, None

    def launched_by_a_graph(self) -> bool:
        return self.in_graph is not None and self.in_graph() is not None

    def captured(self) -> None:
        """The graph being captured launches this plan: it keeps the plan's `_InGraph`."""
        token = None if self.in_graph is None else self.in_graph()
        if token is None:
            token = _InGraph()
            self.in_graph = weakref.ref(token)
        capturing.keep(token)


class _Plans:
    """The planned products by layout, least recently used first, and those dropped that a
    kept graph still launches (freed once no graph does). One lock: a plan holds one call's
    operands between its rebinding and its release."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.nvmath: Any = None  # the module the plans were made with
        self.by_layout: collections.OrderedDict = collections.OrderedDict()
        self.retired: list[_Plan] = []

    def run(self, nvmath: Any, xp: Any, a: Any, b: Any, d: Any) -> None:
        """``d = a @ b`` (2-D or 3-D operands, `d` C-ordered or a transposed stack)."""
        stream = xp.cuda.get_current_stream()  # the object, as nvmath takes the current one itself
        key = (stream.ptr, d.device.id, d.dtype, *_layout(a), *_layout(b), *_layout(d))
        recorded = capturing.active()
        with self.lock:
            plan = self._planned(nvmath, key, a, b, d, stream, recorded)
            matmul = plan.matmul
            try:
                matmul.reset_operands_unchecked(a=a, b=b, c=d)
                matmul.execute(stream=stream)
            finally:
                matmul.release_operands()
            if recorded is not None:
                plan.captured()

    def _planned(self, nvmath: Any, key: tuple, a: Any, b: Any, d: Any, stream: Any, recorded: Any) -> _Plan:
        plan = self.by_layout.get(key) if nvmath is self.nvmath else None
        if plan is not None:
            self.by_layout.move_to_end(key)
            return plan
        if recorded is not None:
            raise capturing.NotCapturable(f"a GEMM of a layout not planned before ({a.shape} @ {b.shape}), whose "
                                          "planning waits for the device")
        if nvmath is not self.nvmath:
            self._retire_all()
            self.nvmath = nvmath
        advanced = nvmath.linalg.advanced
        options = advanced.MatmulOptions(inplace=True, memory_limit=WORKSPACE_BYTES, logger=_LOGGER)
        matmul = advanced.Matmul(a, b, d, beta=0.0, options=options, stream=stream)
        try:
            matmul.plan(preferences=advanced.MatmulPlanPreferences(limit=1), stream=stream)
        except BaseException:
            matmul.free()
            raise
        plan = self.by_layout[key] = _Plan(matmul)
        while len(self.by_layout) > PLANS:
            self.retired.append(self.by_layout.popitem(last=False)[1])
        self._free_retired()
        return plan

    def _free_retired(self) -> None:
        kept = []
        for plan in self.retired:
            if plan.launched_by_a_graph():
                kept.append(plan)
            else:
                plan.matmul.free()
        self.retired = kept

    def _retire_all(self) -> None:
        self.retired.extend(self.by_layout.values())
        self.by_layout = collections.OrderedDict()
        self._free_retired()

    def clear(self) -> None:
        with self.lock:
            self._retire_all()

    def free_at_exit(self) -> None:
        # Every workspace, while its allocator and the CUDA context live: no graph is
        # launched after this.
        with self.lock:
            plans, self.retired = [*self.retired, *self.by_layout.values()], []
            self.by_layout = collections.OrderedDict()
            for plan in plans:
                plan.matmul.free()

    def forget(self) -> None:
        """In a forked child: the parent's CUDA objects are not this process's, and another
        thread may have held the lock at the fork."""
        self.lock, self.by_layout, self.retired = threading.Lock(), collections.OrderedDict(), []


_PLANS = _Plans()


def _free_at_exit() -> None:
    try:
        _PLANS.free_at_exit()
    except Exception:  # noqa: BLE001 - the CUDA context may be gone at exit
        pass


atexit.register(_free_at_exit)
os.register_at_fork(after_in_child=_PLANS.forget)
