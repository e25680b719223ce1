"""The CUDA source CuPy compiles for each of luxnn's kernels (`luxnn.kernels.KERNELS`), and a
compile of all of them with nvcc, without CuPy or a GPU.

What CuPy generates, after its sources (cupy/_core/_kernel.pyx,
``_get_simple_elementwise_kernel_code`` and ``_get_elementwise_kernel_code``;
cupy/_core/_reduction.pyx, ``_create_reduction_function_code``; cupy/_core/raw.pyx):

- an ElementwiseKernel: its type placeholders as typedefs (``typedef float T;``), then the
  preamble, then ``extern "C" __global__ void NAME(PARAMS)``, whose body loops over the
  elements (``CUPY_FOR(i, _ind.size())``), and in the loop binds each array parameter to
  its element (``const T &x = _raw_x[_ind.get()];``, without const for the outputs) before
  the operation. An array is a ``CArray<type, ndim, c_contiguous, 32-bit indexing>``
  named ``_raw_NAME`` (``raw`` ones keep their name), a scalar its C type by value;
- a ReductionKernel: the same typedefs (and ``IndexT``), the preamble, the ``REDUCE`` and
  ``POST_MAP`` macros, ``typedef REDUCE_TYPE _type_reduce;`` and the block reduction over
  ``CIndexer _in_ind, _out_ind``, an input read as ``const T x = _raw_x[_in_ind.get()];``;
- a RawKernel: its code as is, without CuPy's headers.

CuPy puts its headers (cupy/complex.cuh, carray.cuh, atomics.cuh, math_constants.h) ahead
of the first two; `PRELUDE` declares the part a kernel sees of them (CArray, CIndexer,
CUPY_FOR, with carray.cuh's signatures) and CUDA's math constants. CuPy compiles each
kernel (and each combination of dtypes) as a module of its own with NVRTC and
``--std=c++17 -ftz=true``; here every kernel and every float/double combination of its
placeholders goes into one translation unit for nvcc, each in a namespace of its own, its
function renamed ``NAME__N`` so that the C names stay distinct.

What this cannot tell: whether a kernel computes what its twin does (a GPU can), nor
NVRTC's differences from nvcc (NVRTC has no host headers, e.g. <cmath>).
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from luxnn.kernels import Elementwise, Raw, Reduction

PLACEHOLDER_TYPES = ("float", "double")
OPTIONS = ("-std=c++17", "-ftz=true", "-ptx", "-arch=sm_90")
DTYPES = {
    "float64": "double", "float32": "float", "float16": "float16", "int64": "long long", "int32": "int",
    "int16": "short", "int8": "signed char", "uint64": "unsigned long long", "uint32": "unsigned int",
    "uint16": "unsigned short", "uint8": "unsigned char", "bool": "bool",
}  # fmt: skip  (cupy/_core/_scalar.pyx's _typenames_base)

PRELUDE = r"""#include <cstddef>
#include <math_constants.h>

#define CUPY_FOR(i, n) \
    for (ptrdiff_t i = static_cast<ptrdiff_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
         i < (n); i += static_cast<ptrdiff_t>(blockDim.x) * gridDim.x)

template <typename T, int _ndim, bool _c_contiguous = false, bool _use_32bit_indexing = false>
class CArray {
 public:
  static const int ndim = _ndim;
  __device__ ptrdiff_t size() const { return size_; }
  __device__ T* data() { return data_; }
  __device__ const T* data() const { return data_; }
  __device__ const ptrdiff_t* shape() const { return shape_; }
  __device__ const ptrdiff_t* strides() const { return strides_; }
  template <typename Int>
  __device__ T& operator[](const Int (&idx)[ndim]) { return data_[idx[0]]; }
  template <typename Int>
  __device__ const T& operator[](const Int (&idx)[ndim]) const { return data_[idx[0]]; }
  __device__ T& operator[](ptrdiff_t i) { return data_[i]; }
  __device__ const T& operator[](ptrdiff_t i) const { return data_[i]; }
 private:
  T* data_;
  ptrdiff_t size_;
  ptrdiff_t shape_[ndim];
  ptrdiff_t strides_[ndim];
};

template <int _ndim, bool _use_32bit_indexing = false>
class CIndexer {
 public:
  static const int ndim = _ndim;
  typedef ptrdiff_t index_t[ndim];
  __device__ ptrdiff_t size() const { return size_; }
  __device__ const index_t& get() const { return index_; }
  __device__ void set(ptrdiff_t i) { index_[0] = i; }
 private:
  ptrdiff_t size_;
  ptrdiff_t shape_[ndim];
  ptrdiff_t index_[ndim];
};"""

# A typical launch: contiguous arrays reduced to one dimension, 32-bit indices.
ARRAY, INDEXER = "CArray<{t}, 1, true, true>", "CIndexer<1, true>"
BLOCK_SIZE = 512


@dataclass(frozen=True)
class Param:
    """One of a kernel's parameters (CuPy's ParameterInfo): ``[raw] TYPE NAME``."""

    ctype: str  # a placeholder (one letter) or a C type
    name: str
    raw: bool
    non_const: bool = False  # ``_non_const``: an input the kernel may write

    @staticmethod
    def parse(params: str) -> list["Param"]:
        out = []
        for text in filter(None, (p.strip() for p in params.split(","))):
            *keywords, typ, name = text.split()
            ctype = typ if len(typ) == 1 else DTYPES[typ]
            out.append(Param(ctype, name, "raw" in keywords, "_non_const" in keywords))
        return out


def _placeholders(params: list[Param]) -> list[str]:
    return list(dict.fromkeys(p.ctype for p in params if len(p.ctype) == 1))


def _c_type(ctype: str, types: dict[str, str]) -> str:
    return types.get(ctype, ctype)


def _signature(params: list[Param], const: int, types: dict[str, str]) -> str:
    """The kernel's parameters, every one an array (a scalar argument reads the same way
    in the operation, by value); the first `const` of them inputs."""
    out = []
    for k, p in enumerate(params):
        array = ARRAY.format(t=_c_type(p.ctype, types))
        out.append(f"{'const ' if k < const and not p.non_const else ''}{array} {p.name if p.raw else '_raw_' + p.name}")
    return ", ".join(out)


def _typedefs(types: dict[str, str]) -> str:
    return "".join(f"typedef {c} {p};\n" for p, c in sorted(types.items()))


def elementwise_source(kernel: Elementwise, types: dict[str, str], name: str) -> str:
    ins, outs = Param.parse(kernel.in_params), Param.parse(kernel.out_params)
    params = _signature(ins + outs, len(ins), types) + f", {INDEXER} _ind"
    binds = [f"{'const ' if k < len(ins) and not p.non_const else ''}{p.ctype} &{p.name} = _raw_{p.name}[_ind.get()];"
             for k, p in enumerate(ins + outs) if not p.raw]  # fmt: skip
    operation = "\n".join([*binds, kernel.operation])
    return f"""{_typedefs(types)}
{kernel.preamble}
extern "C" __global__ void {name}({params}) {{
  ;
  #pragma unroll 1
  CUPY_FOR(i, _ind.size()) {{
    _ind.set(i);
    {operation};
  }}
  ;
}}
"""


def reduction_source(kernel: Reduction, types: dict[str, str], name: str) -> str:
    ins, outs = Param.parse(kernel.in_params), Param.parse(kernel.out_params)
    params = (_signature(ins + outs, len(ins), types)
              + f", {INDEXER} _in_ind, {INDEXER} _out_ind, const int _block_stride")  # fmt: skip
    reads = "\n".join(f"const {p.ctype} {p.name} = _raw_{p.name}[_in_ind.get()];" for p in ins if not p.raw)
    writes = "\n".join(f"{p.ctype} &{p.name} = _raw_{p.name}[_out_ind.get()];" for p in outs if not p.raw)
    reduce_type = kernel.reduce_type or outs[0].ctype
    return f"""{_typedefs({**types, "IndexT": "int"})}
{kernel.preamble}
#define REDUCE(a, b) ({kernel.reduce_expr})
#define POST_MAP(a) ({kernel.post_map_expr})
#define _REDUCE(_offset) if (_tid < _offset) {{ \\
  _type_reduce _a = _sdata[_tid], _b = _sdata[(_tid + _offset)]; \\
  _sdata[_tid] = REDUCE(_a, _b); \\
}}
typedef {reduce_type} _type_reduce;
extern "C" __global__ void {name}({params}) {{
  __shared__ char _sdata_raw[{BLOCK_SIZE} * sizeof(_type_reduce)];
  _type_reduce *_sdata = reinterpret_cast<_type_reduce*>(_sdata_raw);
  unsigned int _tid = threadIdx.x;
  IndexT _J_offset = _tid >> __popc(_block_stride - 1);
  ptrdiff_t _j_offset = (ptrdiff_t)_J_offset * _out_ind.size();
  IndexT _J_stride = {BLOCK_SIZE} >> __popc(_block_stride - 1);
  ptrdiff_t _j_stride = (ptrdiff_t)_J_stride * _out_ind.size();
  for (ptrdiff_t _i_base = (ptrdiff_t)blockIdx.x * _block_stride; _i_base < _out_ind.size();
       _i_base += (ptrdiff_t)gridDim.x * _block_stride) {{
    _type_reduce _s = _type_reduce({kernel.identity});
    ptrdiff_t _i = _i_base + (_tid & (_block_stride - 1));
    IndexT _J = _J_offset;
    for (ptrdiff_t _j = _i + _j_offset; _j < _in_ind.size(); _j += _j_stride, _J += _J_stride) {{
      _in_ind.set(_j);
      {reads}
      _type_reduce _a = static_cast<_type_reduce>({kernel.map_expr});
      _s = REDUCE(_s, _a);
    }}
    _sdata[_tid] = _s;
    __syncthreads();
    for (unsigned int _block = {BLOCK_SIZE} / 2; _block >= _block_stride; _block >>= 1) {{
      if (_tid < _block) {{
        _REDUCE(_block);
      }}
      __syncthreads();
    }}
    if (_tid < _block_stride) {{
      _s = _sdata[_tid];
    }}
    if (_tid < _block_stride && _i < _out_ind.size()) {{
      _out_ind.set(static_cast<ptrdiff_t>(_i));
      {writes}
      POST_MAP(_s);
    }}
  }}
}}
#undef REDUCE
#undef POST_MAP
#undef _REDUCE
"""


@dataclass(frozen=True)
class Instance:
    """One kernel at one combination of its placeholders' types: its source as CuPy makes it,
    whether CuPy puts its headers ahead (`prelude`: not for a raw kernel) and the options."""

    kernel: str
    types: dict
    source: str
    prelude: bool = True
    options: tuple = ()


def instances(kernels: list) -> list[Instance]:
    """Every kernel of `kernels` at every float/double combination of its placeholders."""
    out: list[Instance] = []
    for kernel in kernels:
        if isinstance(kernel, Raw):
            out.append(Instance(kernel.name, {}, kernel.code, prelude=False, options=tuple(kernel.options)))
            continue
        params = Param.parse(kernel.in_params) + Param.parse(kernel.out_params)
        make = elementwise_source if isinstance(kernel, Elementwise) else reduction_source
        letters = _placeholders(params)
        for combination in itertools.product(PLACEHOLDER_TYPES, repeat=len(letters)):
            types = dict(zip(letters, combination))
            out.append(Instance(kernel.name, types, make(kernel, types, f"{kernel.name}__{len(out)}")))
    return out


def translation_unit(group: list[Instance], prelude: str) -> tuple[str, list[tuple[int, Instance]]]:
    """The source of `group` after `prelude`, each instance in a namespace of its own
    (``#include`` lines moved ahead, out of the namespaces), and the line where each
    instance starts."""
    includes, bodies = [], []
    for k, instance in enumerate(group):
        body = []
        for text in instance.source.splitlines():
            (includes if text.lstrip().startswith("#include") else body).append(text)
        bodies.append(f"namespace luxnn_check_{k} {{\n" + "\n".join(body) + "\n}\n")
    source = "\n".join([prelude, *includes]) + "\n"
    starts = []
    for instance, body in zip(group, bodies):
        starts.append((source.count("\n") + 1, instance))
        source += body
    return source, starts


def nvcc() -> str | None:
    """The CUDA compiler driver on this machine, if any."""
    found = shutil.which("nvcc")
    for candidate in (found, "/usr/local/bin/nvcc", "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def compile_errors(kernels: list, compiler: str, timeout: float = 120) -> dict[str, list[str]]:
    """Compile every instance of `kernels` with `compiler` (nvcc); returns the error lines by
    kernel name (empty: every one compiled). Instances with the same options share a unit."""
    units: dict[tuple, list[Instance]] = {}  # (CuPy's headers or not, options) -> instances
    for instance in instances(kernels):
        units.setdefault((instance.prelude, instance.options), []).append(instance)
    errors: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        jobs = []
        for k, ((prelude, options), group) in enumerate(units.items()):
            source, starts = translation_unit(group, PRELUDE if prelude else "")
            path = os.path.join(tmp, f"luxnn_kernels_{k}.cu")
            with open(path, "w") as f:
                f.write(source)
            command = [compiler, *OPTIONS, *options, path, "-o", os.path.join(tmp, f"{k}.ptx")]
            jobs.append((subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), path, starts))
        for process, path, starts in jobs:
            output, _ = process.communicate(timeout=timeout)
            if process.returncode == 0:
                continue
            found = [(re.match(re.escape(path) + r"\((\d+)\): (?:catastrophic )?error: (.*)", text), text) for text in output.splitlines()]
            for match, _ in filter(lambda f: f[0], found):
                instance = _owner(int(match.group(1)), starts)
                types = ", ".join(f"{p}={c}" for p, c in instance.types.items())
                errors.setdefault(instance.kernel, []).append(f"{types + ': ' if types else ''}{match.group(2)}")
            if not any(match for match, _ in found):
                errors["(a translation unit)"] = output.splitlines()[-20:]
    return errors


def _owner(line: int, starts: list[tuple[int, Instance]]) -> Instance:
    owner = starts[0][1]
    for start, instance in starts:
        if start > line:
            break
        owner = instance
    return owner
