"""luxnn's own CUDA kernels, each declared once with its CUDA source beside its NumPy twin.

A kernel is a module-level constant of the module that launches it:

    SCALE = Elementwise("luxnn_scale", "T x, T a", "T y", "y = x * a",
                        twin=lambda x, a, y: np.multiply(x, a, out=y))

and runs on CuPy arrays as ``SCALE(x, a, y)``: CuPy compiles the source once per array
module (and per combination of dtypes, at its first launch with them). The twin computes
the same with NumPy on the host. It is the kernel's reference in the GPU tests, and the
tests' simulated CUDA device (tests/sim_cupy.py) runs it in the kernel's place, finding
it by name in `KERNELS`, so the whole CUDA path runs and is checked on a machine without a
GPU. What no twin can tell is whether the CUDA source computes what the twin does: only a
GPU can (tests/test_gpu.py).

Three kinds, as CuPy's:
- `Elementwise` (``cupy.ElementwiseKernel``): twin ``f(*inputs, *outputs)`` fills the
  outputs; luxnn passes every output (the launch never allocates).
- `Reduction` (``cupy.ReductionKernel``): twin ``f(*inputs, axis=, keepdims=)`` returns
  the reduced array.
- `Raw` (``cupy.RawKernel``, launched as ``kernel(grid, block, args)``): twin ``f(*args)``
  writes into the arrays of `args`, whatever the grid.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from .backend import module_of

__all__ = ["KERNELS", "Elementwise", "Reduction", "Raw"]

KERNELS: dict[str, "_Kernel"] = {}  # name -> every kernel luxnn declares


class _Kernel:
    """A CUDA kernel's name, its NumPy twin, and CuPy's kernel object per array module."""

    def __init__(self, name: str, twin: Callable[..., Any], source: tuple) -> None:
        if not name.startswith("luxnn_"):
            raise ValueError(f"a luxnn kernel's name starts with 'luxnn_', got {name!r}")
        known = KERNELS.get(name)
        if known is not None and known.source != source:  # the same declaration again: a reload
            raise ValueError(f"two CUDA kernels named {name!r}")
        self.name, self.twin, self.source = name, twin, source
        self._compiled: dict[ModuleType, Any] = {}
        KERNELS[name] = self

    def compiled(self, xp: ModuleType) -> Any:
        """CuPy's kernel object of this source for the array module `xp`, made once."""
        found = self._compiled.get(xp)
        if found is None:
            found = self._compiled[xp] = self._make(xp)
        return found

    def _make(self, xp: ModuleType) -> Any:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class Elementwise(_Kernel):
    """``cupy.ElementwiseKernel(in_params, out_params, operation, name, preamble=...)``."""

    def __init__(self, name: str, in_params: str, out_params: str, operation: str, *, twin: Callable[..., Any],
                 preamble: str = "") -> None:
        super().__init__(name, twin, (in_params, out_params, operation, preamble))
        self.in_params, self.out_params, self.operation, self.preamble = self.source

    def _make(self, xp: ModuleType) -> Any:
        return xp.ElementwiseKernel(self.in_params, self.out_params, self.operation, self.name,
                                    preamble=self.preamble)

    def __call__(self, *args: Any) -> Any:
        """Launches the kernel on `args` (inputs, then every output): CuPy arrays, and
        scalars for the scalar parameters. Returns the output (a tuple for several)."""
        return self.compiled(_module_of_arrays(args))(*args)


class Reduction(_Kernel):
    """``cupy.ReductionKernel(in_params, out_params, map_expr, reduce_expr, post_map_expr,
    identity, name, reduce_type=..., preamble=...)``."""

    def __init__(self, name: str, in_params: str, out_params: str, map_expr: str, reduce_expr: str,
                 post_map_expr: str, identity: str, *, twin: Callable[..., Any], reduce_type: str | None = None,
                 preamble: str = "") -> None:
        super().__init__(name, twin, (in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                                      reduce_type, preamble))
        (self.in_params, self.out_params, self.map_expr, self.reduce_expr, self.post_map_expr, self.identity,
         self.reduce_type, self.preamble) = self.source

    def _make(self, xp: ModuleType) -> Any:
        return xp.ReductionKernel(self.in_params, self.out_params, self.map_expr, self.reduce_expr,
                                  self.post_map_expr, self.identity, self.name, reduce_type=self.reduce_type,
                                  preamble=self.preamble)

    def __call__(self, *args: Any, axis: Any = None, keepdims: bool = False) -> Any:
        """Reduces `args` (the inputs) over `axis`; returns the new reduced array."""
        return self.compiled(_module_of_arrays(args))(*args, axis=axis, keepdims=keepdims)


class Raw(_Kernel):
    """``cupy.RawKernel(code, name, options=...)``: `code` defines the ``extern "C"``
    function `name`."""

    def __init__(self, name: str, code: str, *, twin: Callable[..., Any], options: tuple = ()) -> None:
        super().__init__(name, twin, (code, options))
        self.code, self.options = self.source

    def _make(self, xp: ModuleType) -> Any:
        return xp.RawKernel(self.code, self.name, options=self.options)

    def __call__(self, grid: tuple, block: tuple, args: tuple, shared_mem: int = 0) -> None:
        """Launches ``grid x block`` threads on `args` (CuPy arrays and NumPy scalars)."""
        self.compiled(_module_of_arrays(args))(grid, block, args, shared_mem=shared_mem)


def _module_of_arrays(args: tuple) -> ModuleType:
    for a in args:
        if type(a).__module__.startswith("cupy"):
            return module_of(a)
    raise TypeError(f"a luxnn CUDA kernel runs on CuPy arrays, got {', '.join(type(a).__name__ for a in args)}")
