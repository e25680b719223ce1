"""Leaf arithmetic the building blocks share: moving averages, bias corrections, norms and
products by a factor, on arrays in their compute dtype (`base.compute_dtype`).
"""

from __future__ import annotations

from typing import Any

from luxnn.backend import module_of

from .arrays import Updates, cast_like, compute_dtype, map_arrays, scalar_as, upcast


def moving_average(g: Any, m: Any, decay: float, scratch: Any = None, out: Any = None) -> Any:
    """``decay * m + (1 - decay) * g`` into `out` (None: a new array; it may be `m`);
    `scratch`, if given, is overwritten."""
    xp = module_of(m)
    out = xp.multiply(m, decay, out=out)
    out += xp.multiply(g, 1.0 - decay, out=scratch)
    return out


def moving_average_of_squares(g: Any, v: Any, decay: float, scratch: Any = None, out: Any = None) -> Any:
    """``decay * v + (1 - decay) * g**2`` into `out` (None: a new array; it may be `v`);
    `scratch`, if given, is overwritten."""
    xp = module_of(v)
    square = xp.multiply(g, g, out=scratch)
    square *= 1.0 - decay
    out = xp.multiply(v, decay, out=out)
    out += square
    return out


# The CUDA kernels' products, each rounded (no fused multiply-add), as NumPy's passes round them.
MUL_PREAMBLE = """
__device__ float mul(float x, float y) { return __fmul_rn(x, y); }
__device__ double mul(double x, double y) { return __dmul_rn(x, y); }
"""


def l2_norm(x: Any) -> Any:
    """The L2 norm of all of `x`, a 0-d value in `x`'s compute dtype."""
    x = upcast(x)
    return module_of(x).sqrt(module_of(x).vdot(x, x))


def at_least(value: Any, floor: float) -> Any:
    """`value`, or `floor` where ``value <= floor`` (optax's safe norms), on the device."""
    return module_of(value).where(value <= floor, floor, value)


class PerDtype(dict):
    """Scalars of an update (0-d values from the count) cast once per leaf dtype."""

    def __init__(self, *values: Any) -> None:
        super().__init__()
        self.values = values

    def __missing__(self, dtype: Any) -> tuple:
        cast = self[dtype] = tuple(None if v is None else scalar_as(v, dtype) for v in self.values)
        return cast


def corrected_mu_coefficients(b1: float, count: Any, c1: Any, nesterov: bool) -> tuple[Any, Any]:
    """(a, b) with ``m_hat = a m + b g``: Adam's bias correction ``m / (1 - b1**t)`` (b is
    None), or with Nesterov's momentum (optax's NAdam, Dozat 2016)
    ``b1 m / (1 - b1**(t+1)) + (1 - b1) g / (1 - b1**t)``."""
    if nesterov:
        return b1 * bias_correction(b1, count + 1), (1.0 - b1) * c1
    return c1, None


def corrected_mu(mu: Any, g: Any, a: Any, b: Any) -> Any:
    """``a mu + b g`` (``a mu`` for b None) as a new array."""
    out = module_of(mu).multiply(mu, a)
    if b is not None:
        out += module_of(g).multiply(g, b)
    return out


def no_buffer(like: Any) -> None:
    """The ``out=`` of a scratch array outside a `Workspace`: None, a new array."""
    return None


def bias_correction(decay: float, count: Any) -> Any:
    """``1 / (1 - decay**count)``: the bias correction of a moment after `count` steps."""
    return 1.0 / (1.0 - decay**count)


def times(g: Any, factor: Any) -> Any:
    """``g * factor`` computed in `g`'s compute dtype, returned in `g`'s dtype."""
    gc = upcast(g)
    return cast_like(gc * scalar_as(factor, gc.dtype), g)


def scaled(grads: Updates, factor: Any, into: list | None = None) -> Updates:
    """Every leaf times `factor` (`times`), as new arrays or added into `into`."""
    return map_arrays(lambda g: times(g, factor), grads, into=into)


def scale_in_place(updates: Updates, factor: Any) -> Updates:
    """`updates` multiplied by `factor`, written into them (half precision: a new array,
    the product taken in float32)."""

    def scale_leaf(u: Any) -> Any:
        if u.dtype != compute_dtype(u.dtype):
            return times(u, factor)
        u *= scalar_as(factor, u.dtype)
        return u

    return map_arrays(scale_leaf, updates)


def root_mean_square(x: Any) -> Any:
    x = upcast(x)
    return module_of(x).sqrt(module_of(x).vdot(x, x) / max(x.size, 1))


def divide_by_root_plus_eps(g: Any, accumulator: Any, eps: float) -> Any:
    """``g / (sqrt(accumulator) + eps)`` as a new array (PyTorch's eps outside the root)."""
    denominator = module_of(accumulator).sqrt(accumulator)
    denominator += eps
    module_of(g).divide(g, denominator, out=denominator)
    return denominator
