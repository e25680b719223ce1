"""A simulated CUDA device: the part of CuPy's array API that luxnn computes with, run by
NumPy over the memory of tests/fake_cupy.py's allocator interface, with every kernel
launch counted (in the spirit of PyTorch's FakeTensor mode, but computing the values).

Install it as ``cupy`` in ``sys.modules`` (tests/test_sim_gpu.py's fixture does): luxnn's
backend dispatch then sees CuPy arrays (`ndarray` is a type of its own, of module
``cupy``), `CUDADevice` moves data onto it, and a CUDA `AllocCache` serves its memory
through the same C hook as on a GPU. Each array's values live in the memory its allocation
returned (the cache's blocks included), so a block handed out while still in use corrupts
results here as it would on a device.

A launch is what a GPU would run for the call, counted in `launches` by kind and name:
``kernel`` (an elementwise ufunc, a reduction, a copy, an indexing gather or scatter, each
luxnn kernel run through its NumPy twin, from `luxnn.kernels.KERNELS`), ``fill`` (zeros, ones,
``fill``), ``cublas`` (a matrix product) and ``memcpy`` (host to device or back). Views
(reshape without a copy, transposes, broadcasts, basic slicing) launch nothing. Each launch
goes on the current stream, where a capture may record it instead of running it, for a CUDA
graph to replay (tests/sim_streams.py: streams, events, capture, graphs). As in CuPy,
a NumPy array is refused as an operand and an implicit conversion to NumPy raises; NumPy's
functions on these arrays go to this module's (``__array_ufunc__``, ``__array_function__``).
Anything of CuPy's not here is absent: code that needs more fails rather than passing on a
guess. A kernel takes its arguments as CuPy and CUDA take them: an ElementwiseKernel's type
letters are bound as CuPy binds them, a RawKernel's arguments must fit its C parameters
and it reads a strided array flat from its first element.

>>> import numpy as np, sim_cupy as cp
>>> with cp.counting() as counts:
...     y = cp.asarray(np.ones(3)) * 2.0
>>> y.get().tolist(), counts["memcpy"], counts["kernel"]
([2.0, 2.0, 2.0], 1, 1)
"""

from __future__ import annotations

import collections
import contextlib
import re
import types
from typing import Any, Callable, Iterator

import numpy as np

import fake_cupy
import sim_streams

# CuPy's allocator interface is the fake's; streams, events and graphs are sim_streams'.
cuda = types.SimpleNamespace(**vars(fake_cupy.cuda))
cuda.runtime = types.SimpleNamespace(
    getDevice=fake_cupy.runtime.getDevice, getDeviceCount=lambda: 1, deviceSynchronize=sim_streams.device_synchronize,
    streamIsCapturing=sim_streams.stream_is_capturing, CUDARuntimeError=sim_streams.CUDARuntimeError,
    **sim_streams.RUNTIME_CONSTANTS,
)  # fmt: skip
cuda.driver = types.SimpleNamespace(CUDADriverError=sim_streams.CUDADriverError)
cuda.Stream, cuda.Event, cuda.Graph = sim_streams.Stream, sim_streams.Event, sim_streams.Graph
cuda.get_current_stream = sim_streams.get_current_stream
cuda.stream = types.SimpleNamespace(**vars(fake_cupy.cuda.stream), Stream=cuda.Stream, Event=cuda.Event,
                                    get_current_stream=cuda.get_current_stream)
cuda.graph = types.SimpleNamespace(Graph=cuda.Graph)
get_default_memory_pool = fake_cupy.get_default_memory_pool
__version__ = "14.0.0-simulated"

launches = sim_streams.launches  # (kind, name) -> launches, since import


def _launch(kind: str, name: str, work: Callable[[], Any], replay: Callable[[], Any] | None = None,
            writes: Any = None, stream: Any = None) -> None:
    """One launch on `stream` (the current one by default): `work()` writes its results into
    device memory; while the stream captures, `replay` (by default `work`) is recorded to
    run at each launch of the graph instead (sim_streams). `writes`, the NumPy arrays that
    `work` writes, is given where NumPy checks the arguments as CuPy does at the call: in a
    capture `work` runs then, for its errors, and those arrays are put back."""
    if writes is not None and sim_streams.recording(stream):
        saved = [w.copy() for w in writes]
        try:
            with np.errstate(all="ignore"):
                work()
        except IndexError:
            pass  # an index read from memory the capture has not written yet: not the call's error
        finally:
            for w, before in zip(writes, saved):
                np.copyto(w, before)
    sim_streams.enqueue(kind, name, work, replay, stream)


def _inferring() -> Any:
    """Around a result computed for its shape and dtype: in a capture its values are thrown
    away, so what the memory holds then (anything) raises no warning."""
    return np.errstate(all="ignore") if sim_streams.recording() else contextlib.nullcontext()


def _transfer(direction: str, stream: Any = None) -> None:
    """A copy between host and device (`direction` ``"host_to_device"`` or
    ``"device_to_host"``) on `stream` (the current one by default), counted. CuPy refuses
    it while the stream captures, before calling CUDA (the capture goes on)."""
    which = "H2D" if direction == "host_to_device" else "D2H"
    sim_streams.refuse_if_capturing(stream, RuntimeError(f"the current stream is capturing, so {which} transfers "
                                                         "are disallowed"))
    _launch("memcpy", direction, lambda: None, stream=stream)


def launch(kind: str, name: str, work: Callable[[], None]) -> None:
    """One launch of `kind` and `name` (counted in `launches`) that computes `work()`: a
    function that writes its results into device memory already allocated (for the
    simulated libraries beside this module, e.g. a GEMM of another library's). While the
    current stream captures, `work` is recorded, not run, and runs at each launch of the
    graph: it must read its inputs when it runs."""
    _launch(kind, name, work)


@contextlib.contextmanager
def counting() -> Iterator[collections.Counter]:
    """The launches made inside the block, by kind (``counts["kernel"]``) and by
    ``(kind, name)``; filled in when the block ends. A launch recorded by a capture counts
    as ``("captured", name)``, a graph's launch as ``("graph", "launch")``."""
    before = launches.copy()
    counts: collections.Counter = collections.Counter()
    try:
        yield counts
    finally:
        by_name = launches - before
        counts.update(by_name)
        for (kind, _), n in by_name.items():
            counts[kind] += n


class _Memory:
    """Exposes device memory to NumPy (its ``__array_interface__``). It holds the bytes of a
    raw allocation, not CuPy's memory object, which its array holds: a graph's launches keep
    NumPy views of what they read and write, and on a GPU a graph keeps no memory from its
    allocator (the bytes stay valid, as they do in CuPy's pool)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype: np.dtype) -> None:
        self.raw = fake_cupy.host_buffer(ptr)
        self.__array_interface__ = {"data": (ptr, False), "shape": shape, "typestr": dtype.str, "version": 3}


def empty(shape, dtype=float) -> "ndarray":
    """Uninitialised device memory from the current allocator (no launch)."""
    shape, dtype = ((shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)), np.dtype(dtype)
    pointer = cuda.alloc(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
    values = np.asarray(_Memory(pointer.ptr, shape, dtype)) if pointer.ptr else np.empty(shape, dtype)
    return ndarray(values, pointer)


def _over(pointer: Any, shape: Any, dtype: np.dtype, strides: Any) -> np.ndarray:
    """The values of an array of `shape`, `dtype` and `strides` (C order if None) at device
    memory `pointer`, as CuPy's ``ndarray(..., memptr=pointer)`` sees them."""
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    strides = np.empty(shape, dtype).strides if strides is None else tuple(strides)
    span = 0 if 0 in shape else dtype.itemsize + int(np.dot([n - 1 for n in shape], np.abs(strides)))
    return np.ndarray(shape, dtype, buffer=np.asarray(_Memory(pointer.ptr, (span,), np.dtype(np.uint8))), strides=strides)


def _to_device(compute: Callable[[], Any], kind: str, name: str, values: Any = None) -> "ndarray":
    """A launch computing `compute()` into new device memory (`values`: its result, when
    already computed): a graph computes it again when it replays the launch."""
    if values is None:
        with _inferring():
            values = compute()
    out = empty(np.shape(values), values.dtype)
    target = out._values
    _launch(kind, name, lambda: target.__setitem__(..., values), replay=lambda: target.__setitem__(..., compute()))
    return out


def _unwrap(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x._values
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")  # CuPy's words: no implicit host operands
    if isinstance(x, (list, tuple)):
        return type(x)(_unwrap(v) for v in x)
    return x


def _index(key: Any) -> Any:
    """An index for NumPy. CuPy copies NumPy arrays and lists in an index to the device
    (``_prepare_slice_list``), and reads a boolean mask's count back to the host (a sync);
    each counts as a copy here."""
    if isinstance(key, tuple):
        return tuple(_index(k) for k in key)
    if isinstance(key, (np.ndarray, list)):
        _transfer("host_to_device")
        return np.asarray(key)
    if isinstance(key, ndarray) and key.dtype == bool:
        _transfer("device_to_host")
    return _unwrap(key)


def _wrap(result: Any, inputs: tuple, kind: str, name: str, compute: Callable[[], Any]) -> Any:
    """A NumPy result (of `compute()`) as a device array: a view of an input's memory stays
    a view (no launch); anything else is what the launch computed, in fresh device memory."""
    if isinstance(result, (tuple, list)):  # several results (divmod) or views (split)
        return type(result)(_wrap(r, inputs, kind, name, lambda i=i: compute()[i]) for i, r in enumerate(result))
    if isinstance(result, np.generic):
        result = np.asarray(result)
    if not isinstance(result, np.ndarray):
        return result
    for x in _arrays(inputs):
        if np.may_share_memory(result, x._values):
            return x._view(result)
    return _to_device(compute, kind, name, values=result)


def _arrays(args: Any) -> Iterator["ndarray"]:
    for a in args:
        if isinstance(a, ndarray):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from _arrays(a)


def _run(function: Callable, kind: str, name: str, args: tuple, kwargs: dict) -> Any:
    if kind == "cublas":  # CuPy's cuBLAS handle takes the stream first, and refuses a capturing one
        sim_streams.refuse_if_capturing(None, NotImplementedError("calling cuBLAS API during stream capture is "
                                                                  "currently unsupported"))
    np_args, np_kwargs = _unwrap(args), {k: _unwrap(v) for k, v in kwargs.items()}

    def call() -> Any:
        return function(*np_args, **np_kwargs)

    out = kwargs.get("out")
    if out is not None:
        writes = [w for w in np_kwargs["out"] if w is not None] if isinstance(out, tuple) else [np_kwargs["out"]]
        _launch(kind, name, call, writes=writes)
        return out[0] if isinstance(out, tuple) and len(out) == 1 else out  # NumPy's protocol passes a tuple
    with _inferring():
        result = call()
    return _wrap(result, args, kind, name, call)


class ufunc:  # noqa: N801 - CuPy's name
    """A NumPy ufunc as CuPy's: one launch per call (a cuBLAS call for matmul), reduction or
    scatter (``at``)."""

    def __init__(self, np_ufunc: np.ufunc) -> None:
        self._ufunc, self.__name__ = np_ufunc, np_ufunc.__name__
        self._kind = _kind(self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self._ufunc, self._kind, self.__name__, args, kwargs)

    def reduce(self, *args: Any, **kwargs: Any) -> Any:
        return _run(self._ufunc.reduce, "kernel", f"{self.__name__}.reduce", args, kwargs)

    def at(self, a: "ndarray", indices: Any, b: Any = None) -> None:
        at, values, where, extra = self._ufunc.at, a._values, _index(indices), (() if b is None else (_unwrap(b),))
        _launch("kernel", f"{self.__name__}.at", lambda: at(values, where, *extra), writes=[values])


# NumPy functions by what a GPU launches for them. Views launch nothing; a reshape or a
# contiguous copy launches a copy only when NumPy had to copy.
_VIEWS = {
    "reshape", "permute_dims", "transpose", "swapaxes", "moveaxis", "expand_dims", "squeeze",
    "broadcast_to", "ravel", "ascontiguousarray", "atleast_2d", "split", "array_split",
}  # fmt: skip
_KERNELS = {
    "where", "clip", "concatenate", "stack", "tile", "tril", "triu", "take", "take_along_axis",
    "argmax", "argmin", "sum", "mean", "max", "min", "amax", "amin", "prod", "var", "std",
    "cumsum", "repeat", "pad", "flip", "isnan", "isfinite", "any", "all", "outer", "copy",
    "sort", "argsort", "diff", "count_nonzero",
}  # fmt: skip
_BLAS = {"matmul", "dot", "vdot", "tensordot", "einsum"}


def _kind(name: str) -> str:
    return "cublas" if name in _BLAS else "kernel"


def _function(name: str) -> Callable:
    np_function, kind = getattr(np, name), _kind(name)

    def call(*args: Any, **kwargs: Any) -> Any:
        return _run(np_function, kind, name, args, kwargs)

    call.__name__ = name
    return call


def _fill(name: str) -> tuple[Callable, Callable]:
    """CuPy's `name` and `name`_like (NumPy's signatures): a fill launch each."""
    filled, filled_like = getattr(np, name), getattr(np, f"{name}_like")

    def make(*args: Any, **kwargs: Any) -> "ndarray":
        values = filled(*args, **kwargs)
        return _to_device(lambda: values, "fill", name)

    def make_like(a: "ndarray", *args: Any, **kwargs: Any) -> "ndarray":
        values = filled_like(a._values, *args, **kwargs)
        return _to_device(lambda: values, "fill", name)

    make.__name__, make_like.__name__ = name, f"{name}_like"
    return make, make_like


zeros, zeros_like = _fill("zeros")
ones, ones_like = _fill("ones")
full, full_like = _fill("full")


def empty_like(a: "ndarray", dtype=None) -> "ndarray":
    return empty(a.shape, a.dtype if dtype is None else dtype)


def asarray(a: Any, dtype=None) -> "ndarray":
    """A device array of `a`: itself when already one of `dtype`; host data is copied over."""
    if isinstance(a, ndarray):
        return a if dtype is None or np.dtype(dtype) == a.dtype else a.astype(dtype)
    values = np.array(a, dtype)
    if values.ndim == 0:  # CuPy fills it in by a kernel, which a capture records
        return _to_device(lambda: values, "memcpy", "host_to_device")
    out = empty(values.shape, values.dtype)
    _transfer("host_to_device")
    out._values[...] = values
    return out


array = asarray


def arange(*args: Any, dtype=None) -> "ndarray":
    values = np.arange(*args, dtype=dtype)
    return _to_device(lambda: values, "kernel", "arange")


def copyto(dst: "ndarray", src: Any, casting: str = "same_kind", where: Any = True) -> None:
    target, source, mask = dst._values, _unwrap(src), _unwrap(where)
    _launch("kernel", "copyto", lambda: np.copyto(target, source, casting=casting, where=mask), writes=[target])


def result_type(*arrays_and_dtypes: Any) -> np.dtype:
    return np.result_type(*(a.dtype if isinstance(a, ndarray) else a for a in arrays_and_dtypes))


def asnumpy(a: Any) -> np.ndarray:
    return a.get() if isinstance(a, ndarray) else np.asarray(a)


def _as_strided(x: "ndarray", shape=None, strides=None) -> "ndarray":
    return x._view(np.lib.stride_tricks.as_strided(x._values, shape, strides))


lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=_as_strided))


class ElementwiseKernel:
    """``ElementwiseKernel(in_params, out_params, operation, name)``, run by the NumPy twin
    of luxnn's kernel `name` (`luxnn.kernels.KERNELS`), one launch per call; luxnn passes
    every output. The arguments' types are bound to the parameters as CuPy binds them."""

    def __init__(self, in_params: str, out_params: str, operation: str, name: str = "kernel", **_: Any) -> None:
        self.twin, self.name = _twin(name), name
        self._in, self._out = _elementwise_params(in_params), _elementwise_params(out_params)

    def __call__(self, *args: Any) -> Any:
        inputs, outputs = args[: len(self._in)], args[len(self._in) :]
        if len(outputs) != len(self._out):
            raise TypeError(f"sim_cupy: {self.name} takes its {len(self._out)} outputs as arguments, got {len(outputs)}")
        types = _bind_types(self._in, self._out, inputs, outputs)
        scalars = [a if isinstance(a, ndarray) else np.dtype(types[t] if len(t) == 1 else t).type(a)
                   for (t, _), a in zip(self._in, inputs)]  # CuPy casts a scalar to its parameter's type
        # Unlike a ufunc, CuPy's ElementwiseKernel copies no input that overlaps an output:
        # each thread reads what it reads where it lies.
        twin, np_inputs, np_outputs = self.twin, _unwrap(scalars), _unwrap(list(outputs))
        _launch("kernel", self.name, lambda: twin(*np_inputs, *np_outputs), writes=np_outputs)
        return outputs[0] if len(outputs) == 1 else tuple(outputs)


def _elementwise_params(params: str) -> list[tuple[str, str]]:
    """(type, name) of each parameter of an ElementwiseKernel's list (``"raw T x, int64 n"``):
    a type of one letter is a placeholder, any other a dtype's name."""
    return [tuple(p.split()[-2:]) for p in params.split(",") if p.strip()]


def _bind_types(in_params: list, out_params: list, inputs: tuple, outputs: tuple) -> dict[str, np.dtype]:
    """The dtype of each placeholder, as CuPy decides them (cupy/_core/_kernel.pyx,
    ``_decide_params_type_core``): the outputs first, then the input arrays, each array of
    a placeholder already bound, or of a named dtype, of exactly that dtype; scalars bind
    nothing (they are cast)."""
    if not all(isinstance(a, ndarray) for a in outputs):
        raise TypeError("Output arguments must be cupy.ndarray")
    types: dict[str, np.dtype] = {}
    for (ctype, name), a in [*zip(out_params, outputs), *zip(in_params, inputs)]:
        if not isinstance(a, ndarray):
            continue
        want = types.setdefault(ctype, a.dtype) if len(ctype) == 1 else np.dtype(ctype)
        if a.dtype != want:
            raise TypeError(f"Type is mismatched. {name} {a.dtype.type} {want.type} {ctype}")
    unbound = {t for t, _ in in_params if len(t) == 1 and t not in types}
    if unbound:  # CuPy fails here too (a KeyError), naming no parameter
        raise TypeError(f"sim_cupy: no array argument decides the type of {', '.join(sorted(unbound))}")
    return types


class ReductionKernel:
    """``ReductionKernel(in_params, out_params, map_expr, reduce_expr, post_map_expr,
    identity, name)``, run by the NumPy twin of luxnn's kernel `name`, one launch per call."""

    def __init__(self, in_params: str, out_params: str, map_expr: str, reduce_expr: str, post_map_expr: str,
                 identity: str, name: str = "reduce", **_: Any) -> None:
        self.twin, self.name = _twin(name), name

    def __call__(self, *args: Any, axis: Any = None, keepdims: bool = False) -> "ndarray":
        twin, np_args = self.twin, _unwrap(args)
        return _to_device(lambda: np.asarray(twin(*np_args, axis=axis, keepdims=keepdims)), "kernel", self.name)


class RawKernel:
    """``RawKernel(code, name)``, run by the NumPy twin of luxnn's kernel `name`, one launch
    per call whatever the grid. Each argument is checked against the C parameter it lands
    in, which CUDA reads with the parameter's size whatever was passed."""

    def __init__(self, code: str, name: str, **_: Any) -> None:
        self.twin, self.name = _twin(name), name
        self._params = _c_params(code, name)

    def compile(self, log_stream: Any = None) -> None:
        """CuPy's: compiles the source now instead of at the first launch (here the twin
        runs: nothing to compile; a test may replace this to fail as a compiler would)."""

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        self.compile()  # CuPy compiles the source at the first launch
        if self._params is not None:
            _check_raw_args(self.name, self._params, args)
        # In a capture it is not run for its errors: through a table of pointers it may write
        # memory that no argument names.
        twin, np_args = self.twin, [_as_pointed_to(a) if isinstance(a, ndarray) else a for a in args]
        _launch("kernel", self.name, lambda: twin(*np_args))


def _as_pointed_to(a: "ndarray") -> np.ndarray:
    """An array as a raw kernel gets it: a pointer to its first element. A strided view is
    then its memory from there to the end of its allocation, flat: the kernel reads it by
    strides only where it is given them."""
    if a.flags.c_contiguous:
        return a._values
    memory = (a if a.base is None else a.base)._values.reshape(-1).view(np.uint8)
    start = a._values.__array_interface__["data"][0] - memory.__array_interface__["data"][0]
    return memory[start : start + (memory.size - start) // a.itemsize * a.itemsize].view(a.dtype)


_C_TYPES = {
    "double": "float64", "float": "float32", "long long": "int64", "int": "int32", "short": "int16",
    "signed char": "int8", "unsigned long long": "uint64", "unsigned int": "uint32", "unsigned short": "uint16",
    "unsigned char": "uint8", "bool": "bool",
}  # fmt: skip


def _c_params(code: str, name: str) -> list[tuple[str, bool, str]] | None:
    """(declaration, is a pointer, the dtype of the value or pointee, or "" if unknown) of each
    parameter of the ``extern "C"`` function `name` in `code`; None where it is not found."""
    found = re.search(rf'extern\s+"C"\s+__global__\s+void\s+{name}\s*\(([^)]*)\)', code)
    if found is None:
        return None
    params = []
    for declaration in (p.strip() for p in found.group(1).split(",") if p.strip()):
        words = declaration.replace("*", " * ").split()[:-1]  # without the name
        ctype = " ".join(w for w in words if w not in ("const", "*", "__restrict__"))
        params.append((declaration, "*" in words, _C_TYPES.get(ctype, "")))
    return params


def _check_raw_args(kernel: str, params: list, args: tuple) -> None:
    """Each argument as the parameter it lands in takes it: a device array (of the pointee's
    dtype), None or an 8-byte integer (an address) for a pointer, a NumPy scalar of the
    value's dtype else. CuPy passes a Python bool as a bool, an int as an int64, a float as
    a float64 (cupy/cuda/function.pyx ``_pointer``, cupy/_core/_scalar.pyx)."""
    if len(args) != len(params):
        raise TypeError(f"sim_cupy: {kernel} takes {len(params)} arguments, got {len(args)}")
    for (declaration, pointer, dtype), a in zip(params, args):
        what = f"sim_cupy: {kernel}'s parameter `{declaration}`"
        got = np.dtype(np.bool_ if isinstance(a, bool) else np.int64 if isinstance(a, int) else
                       np.float64 if isinstance(a, float) else a.dtype if isinstance(a, (np.generic, ndarray)) else object)
        if pointer:
            if isinstance(a, ndarray):
                if dtype and got != dtype:
                    raise TypeError(f"{what} takes a {dtype} array, got {got}")
            elif not (a is None or (got.kind in "iu" and got.itemsize == 8)):  # None or an address: a pointer
                raise TypeError(f"{what} takes a device array, got {type(a).__name__}")
            continue
        if isinstance(a, ndarray):
            raise TypeError(f"{what} takes a value, got a device array")
        if dtype and got != dtype:
            raise TypeError(f"{what} takes a {dtype}, got {type(a).__name__} ({got}), which CUDA would misread")


def _twin(name: str) -> Callable:
    from luxnn.kernels import KERNELS

    if name not in KERNELS:
        raise NotImplementedError(f"sim_cupy: {name!r} is not a kernel of luxnn's (luxnn.kernels.KERNELS), "
                                  "which this device runs by their NumPy twins")
    return KERNELS[name].twin


class _DeviceOf:
    """An array's ``device``: luxnn reads its ``id``."""

    def __init__(self, device_id: int) -> None:
        self.id = device_id


def _api(name: str) -> Any:
    """This module's function `name` (module attributes made on first use included)."""
    return globals()[name] if name in globals() else __getattr__(name)


def _operator(name: str, swap: bool = False) -> Callable:
    def method(self: "ndarray", other: Any) -> Any:
        return _api(name)(other, self) if swap else _api(name)(self, other)

    return method


def _in_place(name: str) -> Callable:
    def method(self: "ndarray", other: Any) -> "ndarray":
        _api(name)(self, other, out=self)
        return self

    return method


class ndarray(fake_cupy.ndarray):  # noqa: N801 - CuPy's name
    """A device array: its values (a NumPy array over its device memory) and the memory
    pointer that holds them (views share it)."""

    __module__ = "cupy"

    def __init__(self, values: Any, data: Any = float, base: "ndarray | None" = None, *, memptr: Any = None,
                 strides: Any = None) -> None:
        if not isinstance(values, np.ndarray):  # CuPy's ndarray(shape, dtype=float, memptr=None, strides=None)
            values = _over(memptr, values, np.dtype(data), strides)
            data = memptr
        super().__init__(values, data)  # the fake's metadata view is here the values themselves
        self.base = base  # the array whose memory a view shares, as in CuPy

    def _view(self, values: np.ndarray) -> "ndarray":
        # As CuPy's, a view's ``data`` points at its first element, in the same memory.
        offset = values.__array_interface__["data"][0] - self._meta.__array_interface__["data"][0]
        data = cuda.MemoryPointer(self.data.mem, self.data.ptr - self.data.mem.ptr + offset) if offset else self.data
        return ndarray(values, data, self if self.base is None else self.base)

    _values = property(lambda self: self._meta)
    ndim = property(lambda self: self._meta.ndim)
    size = property(lambda self: self._meta.size)
    itemsize = property(lambda self: self._meta.itemsize)
    strides = property(lambda self: self._meta.strides)
    flags = property(lambda self: self._meta.flags)
    T = property(lambda self: _api("transpose")(self))
    mT = property(lambda self: _api("swapaxes")(self, -1, -2))
    device = property(lambda self: _DeviceOf(self.data.device_id))

    @property
    def __cuda_array_interface__(self) -> dict:
        """CuPy's (version 3): the device address of the first element, shape and strides."""
        meta = self._meta
        strides = None if meta.flags.c_contiguous else meta.strides
        return {"shape": meta.shape, "typestr": meta.dtype.str, "data": (meta.__array_interface__["data"][0], False),
                "strides": strides, "version": 3}

    def __repr__(self) -> str:
        return f"sim_cupy.ndarray({self._meta!r})"

    def __len__(self) -> int:
        return len(self._meta)

    def __iter__(self) -> Iterator["ndarray"]:
        return (self[i] for i in range(len(self)))

    def __array__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, np_ufunc: np.ufunc, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(_api(np_ufunc.__name__), method)(*args, **kwargs)

    def __array_function__(self, function: Callable, types: Any, args: tuple, kwargs: dict) -> Any:
        try:
            ours = _api(function.__name__)
        except AttributeError:
            return NotImplemented
        return ours(*args, **kwargs)

    def get(self, stream: Any = None) -> np.ndarray:
        _transfer("device_to_host", stream)
        return self._meta.copy()

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        """CuPy's: host array `arr`, of this array's dtype and shape, copied into it."""
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"Only numpy.ndarray can be set to cupy.ndarray, got {type(arr)}")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError("Shape mismatch")
        if not self.flags.c_contiguous:
            raise RuntimeError("Cannot set to non-contiguous array")
        _transfer("host_to_device", stream)
        self._meta[...] = arr

    def item(self) -> Any:
        return self.get().item()

    def tolist(self) -> Any:
        return self.get().tolist()

    __float__ = lambda self: float(self.item())  # noqa: E731
    __int__ = lambda self: int(self.item())  # noqa: E731
    __bool__ = lambda self: bool(self.item())  # noqa: E731

    def __getitem__(self, key: Any) -> "ndarray":
        values, where = self._meta, _index(key)
        return _wrap(values[where], (self,), "kernel", "gather", lambda: values[where])

    def __setitem__(self, key: Any, value: Any) -> None:
        values, where, new = self._meta, _index(key), _unwrap(value)
        _launch("fill" if np.isscalar(value) else "kernel", "setitem", lambda: values.__setitem__(where, new),
                writes=[values])

    def fill(self, value: Any) -> None:
        values = self._meta
        _launch("fill", "fill", lambda: values.fill(value), writes=[values])

    def astype(self, dtype: Any, copy: bool = True) -> "ndarray":
        if not copy and np.dtype(dtype) == self.dtype:
            return self
        values = self._meta
        return _to_device(lambda: values.astype(dtype), "kernel", "astype")

    def copy(self) -> "ndarray":
        values = self._meta
        return _to_device(lambda: values, "kernel", "copy")

    def view(self, dtype: Any = None) -> "ndarray":
        return self._view(self._meta.view() if dtype is None else self._meta.view(dtype))

    def reshape(self, *shape: Any) -> "ndarray":
        return _api("reshape")(self, shape[0] if len(shape) == 1 else shape)

    def transpose(self, *axes: Any) -> "ndarray":
        return _api("transpose")(self, axes[0] if len(axes) == 1 else (axes or None))

    def ravel(self) -> "ndarray":
        return _api("ravel")(self)

    def swapaxes(self, a: int, b: int) -> "ndarray":
        return _api("swapaxes")(self, a, b)

    def squeeze(self, axis: Any = None) -> "ndarray":
        return _api("squeeze")(self, axis)

    def __neg__(self) -> "ndarray":
        return _api("negative")(self)

    def __invert__(self) -> "ndarray":
        return _api("invert")(self)

    def __abs__(self) -> "ndarray":
        return _api("absolute")(self)


for _name in ("sum", "mean", "max", "min", "argmax", "argmin", "prod", "var", "std", "any", "all", "cumsum", "clip", "dot"):
    setattr(ndarray, _name, (lambda n: lambda self, *a, **k: _api(n)(self, *a, **k))(_name))
for _op, _ufunc in {
    "add": "add", "sub": "subtract", "mul": "multiply", "truediv": "divide", "floordiv": "floor_divide",
    "pow": "power", "matmul": "matmul", "mod": "remainder", "lt": "less", "le": "less_equal", "gt": "greater",
    "ge": "greater_equal", "eq": "equal", "ne": "not_equal", "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
}.items():  # fmt: skip
    setattr(ndarray, f"__{_op}__", _operator(_ufunc))
    setattr(ndarray, f"__r{_op}__", _operator(_ufunc, swap=True))
    setattr(ndarray, f"__i{_op}__", _in_place(_ufunc))


def __getattr__(name: str) -> Any:
    """CuPy's ufuncs, functions and dtypes, made on first use."""
    target = getattr(np, name, None)
    if isinstance(target, np.ufunc):
        made = ufunc(target)
    elif name in _VIEWS or name in _KERNELS or name in _BLAS:
        made = _function(name)
    elif isinstance(target, (type, float)) or name in ("dtype", "finfo", "iinfo", "newaxis", "promote_types"):
        made = target  # dtypes, constants and dtype helpers are NumPy's in CuPy too
    else:
        raise AttributeError(f"module 'cupy' (simulated by tests/sim_cupy.py) has no attribute {name!r}")
    globals()[name] = made
    return made
