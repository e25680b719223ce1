"""Fused optimiser updates on CuPy arrays: each stage that declares `base.FusedUpdate`
gives its update of one element as a `Fragment` of CUDA code (with its NumPy twin), and
the fragments of a chain are composed into ONE kernel that updates every leaf of a dtype
(`launch`), its parameters and moments written in place.

Why fragments composed, not one kernel per named optimiser: a chain is any sequence of
stages (adamw is Adam, a masked decay and a learning rate; a user may put a clip in
front), and the CPU path's numbers depend on where each stage rounds to the update's
dtype. A fragment reproduces one stage's rounding, so any composition of them reproduces
the chain's, and a new elementwise stage fuses by declaring its fragment.

The kernel runs over a table of device pointers (PyTorch's ``multi_tensor_apply``): per
leaf ``[size, flags, g, p, moments...]``, then per block ``[leaf, start]``, a block
updating ``CHUNK`` elements of one leaf. Gradients arrive as separate arrays from the
backward pass; under the allocator's plans a warm step's arrays keep their addresses, so
the table is uploaded once per set of addresses and kept (`_table`); a set not among the
last few (gradients from the small-block pool move) is uploaded again: one small
host-to-device copy, no launch. Bit ``k`` of a
leaf's flags says whether step ``k`` applies to it (a `masked` stage).

In a fragment's CUDA code, ``$name`` is the fragment's own identifier (made unique per
position in the composed kernel); ``u`` is the running update (type ``P``, the leaf's
dtype), ``p`` the parameter before the update, ``$m0``, ``$m1``... its moments (``T``,
the compute dtype); the prologue runs in every thread before the loop, the epilogue in
one thread of the launch.
"""

from __future__ import annotations

import functools
import hashlib
import re
from typing import Any, Callable, NamedTuple

import numpy as np

from luxnn import capturing, memory, tree
from luxnn.backend import module_of
from luxnn.kernels import Raw

from .arithmetic import MUL_PREAMBLE, times
from .arrays import compute_dtype

__all__ = ["Fragment", "FusedStep", "launch", "factor_arguments", "scale_step"]

CHUNK = 1 << 16  # elements of a leaf per block
BLOCK = 256  # threads per block (SUM_OF_SQUARES's shared array is this size)
NULL = np.uint64(0)  # a null pointer argument


class Fragment(NamedTuple):
    """One stage's update of an element, as CUDA code and as its NumPy twin.

    `params`: the CUDA parameters of a launch (the step's scalars, ``$``-names);
    `prologue` / `body` / `epilogue`: see the module. `step_twin(*arguments, dtype=T)`
    does the epilogue's writes and returns the step's constants; `leaf_twin(constants, u,
    p, *moments)` returns the new update of a slice of a leaf, writing the moments in
    place, as `body` does. `sums_squares`: the launch first reduces the squares of the
    gradients of the leaves the step applies to into per-block partial sums, passed
    before the fragment's own arguments (``const double* $partials, int $blocks``); such
    a fragment comes first in its chain."""

    name: str
    params: str
    body: str
    step_twin: Callable[..., Any]
    leaf_twin: Callable[..., Any]
    prologue: str = ""
    epilogue: str = ""
    moments: int = 0
    sums_squares: bool = False


class FusedStep(NamedTuple):
    """A stage's part of one fused launch: its `fragment`, the trees of the state's arrays
    it updates in place (`moments`, shaped as the gradients), its `arguments` (Python
    floats and bools, device arrays), and the leaves it applies to (`active`, one bool per
    leaf; None: all)."""

    fragment: Fragment
    moments: tuple
    arguments: tuple
    active: list | None = None


def factor_arguments(factor: Any) -> tuple:
    """A factor (a Python float or a 0-d device array) as the two arguments
    ``double $factor_value, const double* $factor_array`` of a fragment."""
    if module_of(factor) is np:  # a number, or a NumPy value of a schedule
        return float(factor), NULL
    return 0.0, factor if factor.dtype == np.float64 else factor.astype(np.float64)


def factor_of(value: float, array: Any) -> Any:
    """The twin's reading of `factor_arguments`: a float64 value."""
    return array if isinstance(array, np.ndarray) else np.float64(value)


FACTOR_PROLOGUE = "const double $factor = $factor_array ? *$factor_array : $factor_value;"


def _scale_step_twin(factor_value: float, factor_array: Any, *, dtype: np.dtype) -> Any:
    return factor_of(factor_value, factor_array).astype(dtype)


def _scale_leaf_twin(factor: Any, u: Any, p: Any) -> Any:
    return times(u, factor)


# A `FoldedFactor` stage's update: the updates times its factor (`times`).
SCALE_FRAGMENT = Fragment(
    "scale",
    "const double $factor_value, const double* $factor_array",
    "u = (P)mul((T)u, $t_factor);",
    _scale_step_twin,
    _scale_leaf_twin,
    prologue=FACTOR_PROLOGUE + " const T $t_factor = (T)$factor;",
)


def scale_step(factor: Any) -> FusedStep:
    """The fused step of a `FoldedFactor` stage of this `factor`."""
    return FusedStep(SCALE_FRAGMENT, (), factor_arguments(factor))


def launch(steps: list[FusedStep], grads: Any, into: list) -> bool:
    """Add the updates of the fused `steps` of `grads` into `into` (the parameters' CuPy
    arrays), one kernel launch per dtype of the leaves (plus one reduction for a
    `sums_squares` fragment). Returns False, launching nothing, when the leaves are not
    what the kernel takes: not one array of `into` per leaf, a gradient of another dtype
    or shape than its parameter, moments of another than its compute dtype or of another
    shape, a dtype the kernels are not made for (not float16, float32 or float64), an
    array that is not C-contiguous, no element at all, several dtypes with a
    `sums_squares` fragment (its norm spans every leaf) or such a fragment not first, an
    array a fragment writes through that is not an array of the device of its declared
    dtype (the new step count of a NumPy count).

    Every group's table is uploaded and its kernels compiled before the first launch: a
    failure there (a fragment's CUDA source that does not compile) leaves every leaf and
    the state as they were, not the dtypes launched before it updated."""
    if not steps or any(s.fragment.sums_squares for s in steps[1:]):
        return False
    leaves = tree.leaves(grads)
    if len(leaves) != len(into):
        return False
    moments = [[tree.leaves(m) for m in s.moments] for s in steps]
    groups: dict = {}
    for i, (g, p) in enumerate(zip(leaves, into)):
        arrays = [g, p, *(m[i] for ms in moments for m in ms)]
        if g.dtype != p.dtype or any(a.shape != p.shape or not a.flags.c_contiguous for a in arrays):
            return False
        if any(m[i].dtype != compute_dtype(p.dtype) for ms in moments for m in ms):
            return False
        if p.size:
            groups.setdefault(p.dtype, []).append(i)
    if not groups or any(d not in _TYPES for d in groups) or (steps[0].fragment.sums_squares and len(groups) > 1):
        return False
    xp = module_of(into[0])
    place = (xp, xp.cuda.runtime.getDevice(), xp.cuda.get_current_stream().ptr)
    fragments = tuple(s.fragment for s in steps)
    launches = []
    for dtype, members in groups.items():
        rows = []
        for i in members:
            flags = sum(1 << k for k, s in enumerate(steps) if s.active is None or s.active[i])
            pointers = [a.data.ptr for a in (leaves[i], into[i], *(m[i] for ms in moments for m in ms))]
            rows.append([into[i].size, flags, *pointers])
        table, blocks = _table(place, rows)
        arguments = []
        for s in steps:
            if s.fragment.sums_squares:
                partials = xp.empty(blocks, np.float64)
                launches.append((SUM_OF_SQUARES[dtype], blocks, (table, np.int32(len(rows)), np.int32(len(rows[0])),
                                                                 np.int32(CHUNK), partials)))
                arguments += [partials, np.int32(blocks)]
            converted = _arguments(s, xp)
            if converted is None:
                return False
            arguments += converted
        launches.append((composed(fragments, dtype), blocks, (table, np.int32(len(rows)), np.int32(CHUNK), *arguments)))
    for kernel, _, _ in launches:
        _compile(kernel, place)
    for kernel, blocks, arguments in launches:
        kernel((blocks,), (BLOCK,), arguments)
    return True


_COMPILED: set = set()  # (kernel name, array module, device): CuPy's `compile` compiles again at each call


def _compile(kernel: Raw, place: tuple) -> None:
    """Compile `kernel` for the device of `place` (array module, device, stream) now,
    once, as CuPy does at its first launch."""
    key = (kernel.name, *place[:2])
    if key not in _COMPILED:
        kernel.compiled(place[0]).compile()
        _COMPILED.add(key)


# The C types a fragment's parameter may have, and the NumPy type CuPy passes each as (a
# scalar) or that the array of a pointer to it must hold.
_C_TYPES = {"double": np.float64, "float": np.float32, "int": np.int32, "long long": np.int64}
_PARAMETER = re.compile(r"(const\s+)?(double|float|int|long long)\s*(\*)?\s*\$\w+")


@functools.lru_cache(maxsize=None)
def _declared(fragment: Fragment) -> tuple[tuple[Any, bool, bool], ...]:
    """Per parameter of `fragment`: (its NumPy type, whether a pointer, whether const)."""
    declared = []
    for param in filter(None, (p.strip() for p in fragment.params.split(","))):
        match = _PARAMETER.fullmatch(param)
        if match is None:
            raise ValueError(f"fused fragment {fragment.name!r}: expected parameters of the types "
                             f"{', '.join(_C_TYPES)} (or pointers to them) named $name, got {param!r}")
        declared.append((_C_TYPES[match[2]], bool(match[3]), bool(match[1])))
    return tuple(declared)


def _arguments(step: FusedStep, xp: Any) -> list | None:
    """`step`'s arguments as CuPy passes them to the fragment's parameters: a scalar in
    its declared type; a pointer as a C-contiguous array of `xp` of its declared dtype (one
    read only, another array converted; `NULL` as it is). None where an array written
    through is not such an array (the launch falls back)."""
    declared = _declared(step.fragment)
    if len(declared) != len(step.arguments):
        raise ValueError(f"fused fragment {step.fragment.name!r}: {len(declared)} parameters, "
                         f"its step gave {len(step.arguments)} arguments")
    out = []
    for (kind, pointer, const), value in zip(declared, step.arguments):
        if not pointer:
            out.append(_scalar(step.fragment, kind, value))
        elif isinstance(value, np.uint64) and value == NULL:
            out.append(value)
        elif module_of(value) is xp and value.dtype == kind and value.flags.c_contiguous:
            out.append(value)
        elif const:
            converted = xp.asarray(value, dtype=kind)
            out.append(converted if converted.flags.c_contiguous else converted.copy())
        else:
            return None
    return out


def _scalar(fragment: Fragment, kind: Any, value: Any) -> Any:
    """`value` (a number, or a 0-d array) as a scalar argument of type `kind`."""
    number = value.item() if hasattr(value, "item") else value
    if not isinstance(number, (bool, int) if np.issubdtype(kind, np.integer) else (bool, int, float)):
        raise TypeError(f"fused fragment {fragment.name!r}: expected a {np.dtype(kind).name} argument, got {value!r}")
    return kind(number)


# (place, host table bytes) -> (device table, blocks), least recently used first: a warm
# step's addresses are those of a step two before (the plan's cycle), and a table in use
# outlives any number of tables made once (a step's addresses moved for a while).
_TABLES: dict = {}
_KEPT_TABLES = 16


def _table(place: tuple, rows: list) -> tuple[Any, int]:
    """The device table of `rows` (per leaf: size, flags, pointers) followed by the
    (leaf, start) of each block, and the number of blocks; uploaded once per content and
    `place` (array module, device, stream: a table lives on one device, and is ready
    when its stream's upload is)."""
    chunks = [(leaf, start) for leaf, row in enumerate(rows) for start in range(0, row[0], CHUNK)]
    host = np.array([x for row in rows for x in row] + [x for c in chunks for x in c], dtype=np.int64)
    key = (place, host.tobytes())
    xp = place[0]
    found = _TABLES.pop(key, None)  # another thread may be taking it too: then it is made again
    if found is not None:
        _TABLES[key] = found
    else:
        if len(_TABLES) >= _KEPT_TABLES:
            try:  # the oldest; another thread may be evicting too
                _TABLES.pop(next(iter(_TABLES)), None)
            except (StopIteration, RuntimeError):
                pass
        with memory.uncached():  # kept for as long as the addresses last, no part of a step
            found = _TABLES[key] = (xp.asarray(host), len(chunks))
    capturing.keep(found[0])  # a graph that launches the update reads it at each launch, evicted or not
    return found


_TYPES = {np.dtype(np.float16): "__half", np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def _header(dtype: np.dtype) -> str:
    """The start of a kernel's source for leaves of `dtype`: ``P`` their type, ``T`` their
    compute dtype's, and the rounded products (`MUL_PREAMBLE`)."""
    types = f"typedef {_TYPES[compute_dtype(dtype)]} T;\ntypedef {_TYPES[np.dtype(dtype)]} P;\n"
    return "#include <cuda_fp16.h>\n" + types + MUL_PREAMBLE


_COMPOSED: dict = {}  # (fragments, dtype) -> kernel


def composed(fragments: tuple[Fragment, ...], dtype: Any) -> Raw:
    """The kernel of `fragments` one after the other, for leaves of `dtype`: declared
    (`luxnn.kernels.Raw`) on first use, under a name that says what it composes and ends
    in a hash of its source, so that fragments of the same names and other code (a user's
    fragment named as a built-in one) never run each other's kernel."""
    dtype = np.dtype(dtype)
    kernel = _COMPOSED.get((fragments, dtype))
    if kernel is None:
        stem = f"luxnn_fused_{'_'.join(f.name for f in fragments)}_{dtype.name}"
        digest = hashlib.sha256(composed_source(stem, fragments, dtype).encode()).hexdigest()[:12]
        name = f"{stem}_{digest}"
        kernel = Raw(name, composed_source(name, fragments, dtype), twin=_composed_twin(fragments, dtype))
        _COMPOSED[fragments, dtype] = kernel
    return kernel


def _own(code: str, k: int) -> str:
    return re.sub(r"\$(\w+)", rf"f{k}_\1", code)


def composed_source(name: str, fragments: tuple[Fragment, ...], dtype: Any) -> str:
    """The CUDA source of `composed`."""
    width = 4 + sum(f.moments for f in fragments)
    params, prologues, bodies, epilogues, pointers = [], [], [], [], []
    column = 4
    for k, f in enumerate(fragments):
        if f.sums_squares:
            params.append(_own("const double* $partials, const int $blocks", k))
        if f.params:
            params.append(_own(f.params, k))
        prologues.append(_own(f.prologue, k))
        epilogues.append(_own(f.epilogue, k))
        moments = []
        for j in range(f.moments):
            pointers.append(f"T* const f{k}_moment{j} = (T*)leaf[{column}];")
            moments.append(f"T& f{k}_m{j} = f{k}_moment{j}[i];")
            column += 1
        bodies.append(f"if ((flags >> {k}) & 1) {{\n{' '.join(moments)}\n{_own(f.body, k)}\n}}")
    nl = "\n"
    return _header(dtype) + f"""
extern "C" __global__ void {name}(const long long* table, const int n_leaves, const int chunk, {", ".join(params)}) {{
    const long long* chunk_of = table + (long long)n_leaves * {width} + 2LL * blockIdx.x;
    const long long* leaf = table + chunk_of[0] * {width};
    const long long start = chunk_of[1], end = min(leaf[0], start + chunk), flags = leaf[1];
    const P* const g = (const P*)leaf[2];
    P* const param = (P*)leaf[3];
    {nl.join(pointers)}
    {nl.join(prologues)}
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {{
        const P p = param[i];
        P u = g[i];
        {nl.join(bodies)}
        param[i] = (P)((T)p + (T)u);
    }}
    if (blockIdx.x == 0 && threadIdx.x == 0) {{
        {nl.join(epilogues)}
    }}
}}
"""


class _HostMemory:
    """`n` elements of `dtype` at the address `pointer`, for NumPy: the twins run on the
    simulated device, whose arrays live in host memory."""

    def __init__(self, pointer: int, n: int, dtype: np.dtype) -> None:
        self.__array_interface__ = {"data": (int(pointer), False), "shape": (int(n),), "typestr": dtype.str,
                                    "version": 3}


def _at(pointer: int, n: int, dtype: np.dtype) -> np.ndarray:
    return np.asarray(_HostMemory(pointer, n, dtype))


def _rows_and_chunks(table: np.ndarray, n_leaves: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    table = np.asarray(table)
    return table[: n_leaves * width].reshape(n_leaves, width), table[n_leaves * width :].reshape(-1, 2)


def _composed_twin(fragments: tuple[Fragment, ...], dtype: Any) -> Callable[..., None]:
    """`composed`'s kernel in NumPy, block by block through the table's pointers."""
    p_dtype, t_dtype = np.dtype(dtype), compute_dtype(dtype)
    width = 4 + sum(f.moments for f in fragments)
    counts = [len(_declared(f)) + 2 * f.sums_squares for f in fragments]

    def twin(table: np.ndarray, n_leaves: int, chunk: int, *arguments: Any) -> None:
        rows, chunks = _rows_and_chunks(table, n_leaves, width)
        constants, at = [], 0
        for f, n in zip(fragments, counts):
            constants.append(f.step_twin(*arguments[at : at + n], dtype=t_dtype))
            at += n
        for leaf, start in chunks:
            n, flags, g, p, *moments = (int(x) for x in rows[leaf])
            window = slice(start, min(n, start + chunk))
            u, param = _at(g, n, p_dtype)[window], _at(p, n, p_dtype)[window]
            column = 0
            for k, (f, c) in enumerate(zip(fragments, constants)):
                ms = [_at(m, n, t_dtype)[window] for m in moments[column : column + f.moments]]
                column += f.moments
                if (flags >> k) & 1:
                    u = f.leaf_twin(c, u, param, *ms)
            param += u

    return twin


# The squares of the gradients summed per block, in double, each block's threads striding
# over its chunk and then halving (the twin sums in the same order: bit for bit). The sum
# is the first step's (a `sums_squares` fragment comes first): a leaf whose flag bit 0 is
# clear (a `masked` clip that does not select it) adds nothing, as the CPU's inner
# transformation does not see it.
def _sum_of_squares_source(dtype: np.dtype) -> str:
    return _header(dtype) + f"""
extern "C" __global__ void luxnn_sum_of_squares_{dtype.name}(const long long* table, const int n_leaves,
                                                const int width, const int chunk, double* partials) {{
    __shared__ double sums[{BLOCK}];
    const long long* chunk_of = table + (long long)n_leaves * width + 2LL * blockIdx.x;
    const long long* leaf = table + chunk_of[0] * width;
    const long long start = chunk_of[1], end = (leaf[1] & 1) ? min(leaf[0], start + chunk) : start;
    const P* const g = (const P*)leaf[2];
    double s = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {{
        const double x = (double)(T)g[i];
        s += mul(x, x);
    }}
    sums[threadIdx.x] = s;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w >>= 1) {{
        if (threadIdx.x < w) sums[threadIdx.x] += sums[threadIdx.x + w];
        __syncthreads();
    }}
    if (threadIdx.x == 0) partials[blockIdx.x] = sums[0];
}}
"""


def _sum_of_squares_twin(dtype: np.dtype) -> Callable[..., None]:
    def twin(table: np.ndarray, n_leaves: int, width: int, chunk: int, partials: np.ndarray) -> None:
        rows, chunks = _rows_and_chunks(table, n_leaves, width)
        for block, (leaf, start) in enumerate(chunks):
            n, flags, g = (int(x) for x in rows[leaf][:3])
            end = min(n, start + chunk) if flags & 1 else start
            x = _at(g, n, dtype)[start:end].astype(compute_dtype(dtype)).astype(np.float64)
            threads = np.zeros(-(-x.size // BLOCK) * BLOCK)
            threads[: x.size] = x * x
            sums = np.add.reduce(threads.reshape(-1, BLOCK), axis=0) if x.size else np.zeros(BLOCK)
            w = BLOCK // 2
            while w:
                sums[:w] += sums[w : 2 * w]
                w //= 2
            partials[block] = sums[0]

    return twin


SUM_OF_SQUARES = {
    dtype: Raw(f"luxnn_sum_of_squares_{dtype.name}", _sum_of_squares_source(dtype), twin=_sum_of_squares_twin(dtype))
    for dtype in _TYPES
}
