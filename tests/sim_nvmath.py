"""A simulated nvmath-python 1.0.1: the part of ``nvmath.linalg.advanced`` that luxnn's GEMMs
use (luxnn/ops/cuda/gemm.py), with nvmath's signatures and checks, computing with NumPy over
the memory of tests/sim_cupy.py's device, one launch ``("cublas", "cublasLt_matmul")`` per
``Matmul.execute``, whose reads and writes all happen inside the launch (`sim_cupy.launch`),
through NumPy views of the device's memory (a capture's replay then reads its inputs anew).

Install it as ``nvmath`` in ``sys.modules``, beside sim_cupy as ``cupy``. As the real
``Matmul`` does (``get_mm_traits``), it describes each operand to cuBLASLt by an order
(column-major when its first matrix axis has unit stride, else row-major when its second
has, else by its single row or column), a leading dimension (the larger of stride and
extent) and one batch stride (the smallest of its batch strides), and the launch reads and
writes the device's memory through that description: an operand that nvmath would
misdescribe gives wrong numbers here too, and an access outside an operand's allocation
fails. Its workspace is allocated at the first execution from CuPy's current allocator and
held until ``free``, as nvmath's ``Workspace`` does.

What luxnn's GEMMs must not do raises: ``NotImplementedError`` for what they do not use
(epilogs, narrow precision and quantization scales, chosen algorithms, host or 1-D operands,
a result that nvmath allocates, a blocking execution, releasing the workspace per call,
options other than the memory limit and the logger), ``AssertionError`` for what the real
one would not catch but compute wrongly (``reset_operands_unchecked`` to operands of another
layout, operands less aligned than those planned with, a workspace used on two streams).
Every ``Matmul`` made is listed in `made`, with its count of resets and executions.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import types
from typing import Any

import numpy as np

import sim_cupy

__version__ = "1.0.1-simulated"

SUPPORTED_TYPES = ("float16", "float32", "float64", "complex64", "complex128")
_SCALE_TYPE = {"float16": np.float32, "float32": np.float32, "float64": np.float64, "complex64": np.complex64,
               "complex128": np.complex128}  # fmt: skip
WORKSPACE_BYTES = 256 << 10  # what this device's heuristic asks for (within the memory limit)
DEVICE_BYTES = 80 << 30  # for a memory limit given as a percentage

made: list = []  # every Matmul constructed, in order


class InvalidMatmulState(Exception):
    pass


@dataclasses.dataclass
class MatmulOptions:
    """``nvmath.linalg.advanced.MatmulOptions``, its fields and defaults."""

    inplace: bool = False
    compute_type: int | None = None
    scale_type: int | None = None
    result_type: int | None = None
    result_amax: bool = False
    block_scaling: bool = False
    sm_count_target: int | None = 0
    fast_accumulation: bool | None = False
    device_id: int = 0
    handle: int | None = None
    logger: logging.Logger | None = None
    memory_limit: int | str | None = r"80%"
    blocking: Any = "auto"
    allocator: Any = None

    def __post_init__(self) -> None:
        if self.blocking not in (True, "auto"):
            raise ValueError("The value specified for blocking must be either True or 'auto'.")


@dataclasses.dataclass
class MatmulPlanPreferences:
    """``nvmath.linalg.advanced.MatmulPlanPreferences``, its fields and defaults (the masks
    as None: all of them)."""

    reduction_scheme_mask: Any = None
    max_waves_count: float | None = 0.0
    numerical_impl_mask: Any = None
    limit: int = 8
    epilog: Any = None


def _options(cls: type, value: Any) -> Any:
    """nvmath's ``check_or_create_options``: None, a dict of fields, or the object."""
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"The options must be provided as an object of type {cls.__name__} or as a dict.")
    return value


_LEFT_AS_THEY_ARE = {"compute_type": None, "scale_type": None, "result_type": None, "result_amax": False,
                     "block_scaling": False, "sm_count_target": 0, "fast_accumulation": False, "handle": None,
                     "allocator": None}  # fmt: skip


def _memory_limit(options: MatmulOptions) -> int:
    for name, default in _LEFT_AS_THEY_ARE.items():
        if getattr(options, name) != default:
            raise NotImplementedError(f"sim_nvmath: MatmulOptions.{name} (luxnn's GEMMs leave it {default!r})")
    if options.blocking is True:
        raise NotImplementedError("sim_nvmath: blocking=True, a host synchronisation per execution")
    limit = options.memory_limit
    if isinstance(limit, int):
        return limit
    if isinstance(limit, str) and limit.endswith("%"):
        return int(float(limit[:-1]) * DEVICE_BYTES / 100)
    raise NotImplementedError(f"sim_nvmath: a memory limit of {limit!r}")


def _elements(x: Any) -> tuple[int, ...]:
    return tuple(s // x.itemsize for s in x.strides)  # nvmath's CupyTensor.strides


def _alignment(x: Any) -> int:
    ptr = x.data.ptr
    return min(256, ptr & -ptr)  # what plan() sets as the preference's minimum alignment


def _axis_order(strides: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(i for _, i in sorted(zip(strides, range(len(strides)))))


def _tileable(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """nvmath's ``check_batch_tileable``: evenly spaced tiles in some axis order, or one tile."""
    dims = sorted((s, n) for n, s in zip(shape, strides) if n != 1)
    if not dims or all(s == 0 for s, _ in dims):
        return True
    return dims[0][0] > 0 and all(dims[i + 1][0] == dims[i][0] * dims[i][1] for i in range(len(dims) - 1))


def _unique(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    offsets = np.zeros(1, np.int64)
    for n, s in zip(shape, strides):
        offsets = (offsets[:, None] + np.arange(n) * s).ravel()
    return np.unique(offsets).size == offsets.size


def _describe(x: Any) -> tuple[str, int, int]:
    """nvmath's ``get_matrix_layout_traits`` for a matrix or stack: (order, ld, batch offset)."""
    (r, c), strides = x.shape[-2:], _elements(x)
    s0, s1 = strides[-2:]
    if s0 == 1:
        order = "col"
    elif s1 == 1:
        order = "row"
    elif r == 1:
        order = "col"
    elif c == 1:
        order = "row"
    else:
        raise ValueError("Unsupported layout.")
    batch = strides[:-2]
    return order, max(r, s1) if order == "col" else max(c, s0), min(batch) if batch else 0


def _traits(a: Any, b: Any, c: Any) -> types.SimpleNamespace:
    """nvmath's ``get_mm_traits`` for matrices or stacks a and b and the in-place C."""
    (m, k), (k_b, n) = a.shape[-2:], b.shape[-2:]
    if k != k_b:
        raise ValueError(f"The 'K' extent must match for the operands: K={k} in operand A is not equal to K={k_b} "
                         "in operand B.")
    batch, order = (), ()
    for name, x in (("A", a), ("B", b)):
        shape, strides = x.shape[:-2], _elements(x)[:-2]
        if shape:
            if not _tileable(shape, strides):
                raise ValueError(f"The batch layout for {name} corresponding to shape = {list(shape)} and strides = "
                                 f"{list(strides)} is currently not supported because it is not tileable.")
            if batch and (batch != shape or order != _axis_order(strides)):
                raise ValueError(f"The batch dimensions or order of operands A {a.shape} and B {b.shape} must match.")
            batch, order = shape, _axis_order(strides)
    if c.shape[-2:] != (m, n):
        raise ValueError(f"The M and N dimensions of the C matrix {c.shape} must match those of A and B. This is "
                         "required for inplace operations.")
    c_strides = _elements(c)
    if c.shape[:-2] != batch or (batch and _axis_order(c_strides[:-2]) != order):
        raise ValueError(f"The batch dimension of operand C {c.shape[:-2]} must match with that of the other operands "
                         f"{batch}. This is required for inplace operations.")
    if batch and not _tileable(c.shape[:-2], c_strides[:-2]):
        raise ValueError("The batch layout for C is currently not supported because it is not tileable.")
    if not _unique(c.shape, c_strides):
        raise ValueError("The layout for C is not supported for inplace operations: the index-to-memory mapping is "
                         "not injective, which would cause overlapping writes into the same memory.")
    return types.SimpleNamespace(m=m, n=n, k=k, count=math.prod(batch), layouts=[_describe(x) for x in (a, b, c)])


def _matrices(x: Any, layout: tuple[str, int, int], count: int, rows: int, cols: int, name: str) -> np.ndarray:
    """The `count` matrices ``(rows, cols)`` that cuBLASLt reads or writes for operand `x`
    described by `layout`: a NumPy view of the device's memory from x's first element."""
    order, ld, offset = layout
    strides = (offset, 1, ld) if order == "col" else (offset, ld, 1)
    span = ((count - 1) * strides[0] + (rows - 1) * strides[1] + (cols - 1) * strides[2] + 1) * x.itemsize
    memory = x.data.mem
    room = memory.ptr + memory.size - x.data.ptr
    assert span <= room, f"sim_nvmath: cuBLASLt would access {span} bytes of operand {name}, which has {room}"
    return np.lib.stride_tricks.as_strided(x._values, (count, rows, cols), tuple(s * x.itemsize for s in strides))


class Matmul:
    """``nvmath.linalg.advanced.Matmul``: ``alpha * a @ b + beta * c`` written in place into
    c, planned once and executed on device operands rebound by ``reset_operands``."""

    def __init__(self, a, b, /, c=None, *, alpha=None, beta=None, qualifiers=None, quantization_scales=None,
                 options=None, stream=None):
        options = _options(MatmulOptions, options)
        if c is None and options.inplace:
            raise ValueError("The operation cannot be inplace if operand C is not provided.")
        self.memory_limit = _memory_limit(options)
        if qualifiers is not None or quantization_scales is not None:
            raise NotImplementedError("sim_nvmath: qualifiers and quantization scales")
        for name, x in (("A", a), ("B", b), ("C", c)):
            if x is not None and not isinstance(x, sim_cupy.ndarray):
                raise NotImplementedError(f"sim_nvmath: operand {name} of {type(x)}: only device operands")
            if x is not None and x.dtype.name not in SUPPORTED_TYPES:
                raise ValueError(f"The dtype of operand {name} ({x.dtype.name}) is not supported.")
        if c is None or not options.inplace:
            raise NotImplementedError("sim_nvmath: a result other than C written in place (nvmath would allocate "
                                      "it, in A's order)")
        if c.ndim < 2:
            raise ValueError("In order to avoid broadcasting behavior ambiguity, `c` must be at least 2-D. Use a "
                             "singleton dimension to convert your input array to 2-D.")
        if beta is None:
            raise ValueError("A value for beta must be provided if operand C is provided.")
        if a.dtype != b.dtype:
            raise ValueError(f"Unsupported combination of dtypes for operands A {a.dtype.name} and B {b.dtype.name}.")
        if c.dtype != a.dtype:
            raise NotImplementedError("sim_nvmath: C of another dtype than A and B")
        for name, x in (("a", a), ("b", b), ("c", c)):
            if any(e <= 0 for e in x.shape):
                raise ValueError(f"The specified extents {x.shape} for operand {name} are not valid. The extents must "
                                 "be strictly positive. ")
        if a.ndim < 2 or b.ndim < 2:
            raise NotImplementedError("sim_nvmath: 1-D operands")
        if len({x.device.id for x in (a, b, c)}) > 1:
            raise ValueError("All operands must be on the same device.")
        scale = _SCALE_TYPE[a.dtype.name]
        self.alpha, self.beta = np.array([1 if alpha is None else alpha], scale), np.array([beta], scale)
        self.traits = _traits(a, b, c)
        self.planned_layout = [(x.dtype, x.shape, x.strides, x.device.id) for x in (a, b, c)]
        self.operands: list = [a, b, c]
        self.released = False
        self.planned_alignment: tuple | None = None
        self.workspace: Any = None
        self.workspace_bytes = 0
        self.workspace_stream: int | None = None
        self.valid = True
        self.resets = self.executes = 0
        made.append(self)

    def __enter__(self) -> "Matmul":
        return self

    def __exit__(self, *exc) -> None:
        self.free()

    def _check_valid(self) -> None:
        if not self.valid:
            raise InvalidMatmulState("The Matmul object cannot be used after resources are free'd")

    def plan(self, *, preferences=None, algorithms=None, epilog=None, epilog_inputs=None, stream=None):
        self._check_valid()
        if algorithms is not None or epilog is not None or epilog_inputs is not None:
            raise NotImplementedError("sim_nvmath: chosen algorithms and epilogs")
        preferences = _options(MatmulPlanPreferences, preferences)
        if preferences.limit < 1:
            raise ValueError("The limit must be at least 1.")
        assert not self.released, "sim_nvmath: plan() reads the operands' pointers, which were released"
        self.planned_alignment = tuple(_alignment(x) for x in self.operands)
        self.workspace_bytes = min(WORKSPACE_BYTES, self.memory_limit)
        return (types.SimpleNamespace(algorithm_id=0),)

    def _mismatch(self, index: int, x: Any) -> str | None:
        if not isinstance(x, sim_cupy.ndarray):
            return f"Library package mismatch: 'cupy' => {type(x).__module__!r}"
        dtype, shape, strides, device = self.planned_layout[index]
        for what, want, got in (("data type", dtype, x.dtype), ("extents", shape, x.shape),
                                ("strides", strides, x.strides), ("device", device, x.device.id)):  # fmt: skip
            if want != got:
                return f"The {what} of operand {'ABC'[index]} ({got}) differs from the planned one's ({want})."
        return None

    def _reset(self, operands: tuple, alpha: Any, beta: Any, failure: type[Exception]) -> None:
        if self.released and any(x is None for x in operands):
            raise ValueError("After release_operands(), all required operands must be provided to reset_operands(). "
                             "Required: a, b, c")
        if all(x is None for x in (*operands, alpha, beta)):
            raise ValueError("reset_operands() requires at least one operand to be provided.")
        for index, x in enumerate(operands):
            problem = None if x is None else self._mismatch(index, x)
            if problem:
                raise failure(problem)
        for index, x in enumerate(operands):
            if x is not None:
                self.operands[index] = x
        if alpha is not None:
            self.alpha[0] = alpha
        if beta is not None:
            self.beta[0] = beta
        self.released = False
        self.resets += 1

    def reset_operands(self, *, a=None, b=None, c=None, alpha=None, beta=None, quantization_scales=None,
                       epilog_inputs=None, stream=None):
        self._check_valid()
        if quantization_scales is not None or epilog_inputs is not None:
            raise NotImplementedError("sim_nvmath: quantization scales and epilog inputs")
        self._reset((a, b, c), alpha, beta, ValueError)

    def reset_operands_unchecked(self, *, a=None, b=None, c=None, alpha=None, beta=None, quantization_scales=None,
                                 epilog_inputs=None, stream=None):
        # The real one checks nothing: operands of another layout are computed on as planned.
        if quantization_scales is not None or epilog_inputs is not None:
            raise NotImplementedError("sim_nvmath: quantization scales and epilog inputs")
        self._reset((a, b, c), alpha, beta, AssertionError)

    def release_operands(self):
        self._check_valid()
        self.operands = [None, None, None]
        self.released = True

    def execute(self, *, algorithm=None, release_workspace=False, stream=None):
        self._check_valid()
        if self.planned_alignment is None:
            raise RuntimeError("Execution cannot be performed before plan() has been called.")
        if self.released:
            raise RuntimeError("Execution cannot be performed after the operands have been released. Use "
                               "reset_operands() to provide new operands before performing the execution.")
        if algorithm is not None or release_workspace:
            raise NotImplementedError("sim_nvmath: a chosen algorithm, or the workspace released per execution")
        current = sim_cupy.cuda.get_current_stream().ptr
        on = current if stream is None else stream if isinstance(stream, int) else stream.ptr
        if on != current:
            raise NotImplementedError("sim_nvmath: an execution on a stream that is not the current one")
        a, b, c = self.operands
        for name, x, planned in zip("ABC", self.operands, self.planned_alignment):
            assert _alignment(x) >= planned, (f"sim_nvmath: operand {name} is aligned to {_alignment(x)} bytes, the "
                                              f"algorithm was chosen for {planned}")
        if self.workspace is None:
            self.workspace, self.workspace_stream = sim_cupy.cuda.alloc(self.workspace_bytes), on
        assert on == self.workspace_stream, (f"sim_nvmath: the workspace of stream {self.workspace_stream} used on "
                                             f"stream {on}, unordered")
        t, alpha, beta, scale = self.traits, self.alpha[0], self.beta[0], self.alpha.dtype
        # NumPy views of the memory that cuBLASLt addresses, read and written when the launch
        # runs (a capture's replay included), holding no memory object as a graph holds none.
        (layout_a, layout_b, layout_c) = t.layouts
        a_, b_, d = (_matrices(a, layout_a, t.count, t.m, t.k, "A"), _matrices(b, layout_b, t.count, t.k, t.n, "B"),
                     _matrices(c, layout_c, t.count, t.m, t.n, "C"))  # fmt: skip

        def work() -> None:
            product = np.matmul(a_.astype(scale), b_.astype(scale))
            if beta != 0:  # cuBLASLt reads C only then
                product = alpha * product + beta * d
            elif alpha != 1:
                product = alpha * product
            d[...] = product

        sim_cupy.launch("cublas", "cublasLt_matmul", work)
        self.executes += 1
        return c

    def free(self):
        self.workspace, self.operands, self.valid = None, [None, None, None], False


linalg = types.SimpleNamespace(
    advanced=types.SimpleNamespace(Matmul=Matmul, MatmulOptions=MatmulOptions,
                                   MatmulPlanPreferences=MatmulPlanPreferences),  # fmt: skip
)
