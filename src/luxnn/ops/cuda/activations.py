"""The activations on CuPy arrays: one kernel per activation each way.

Each activation's forward is one `Elementwise` kernel ``luxnn_<name>`` and its gradient one
``luxnn_<name>_grad``; the gradient recomputes what it needs from the saved input or
output (`ACTIVATIONS` says which), so a forward keeps no temporaries. The twins are the
CPU's functions (ops/cpu/activations.py). The kernels' source is written for float and
double: arrays of other dtypes (integers, float16) are computed in NumPy's promotion of
their dtype with float32, and float16 results are returned in float16, as on the CPU.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..cpu import activations as cpu

__all__ = [
    "relu", "relu_grad", "leaky_relu", "leaky_relu_grad", "elu", "elu_grad", "sigmoid", "sigmoid_grad",
    "tanh", "tanh_grad", "silu", "silu_grad", "softplus", "softplus_grad", "gelu_tanh", "gelu_tanh_grad",
    "gelu_erf", "gelu_erf_grad",
]  # fmt: skip


class Activation(NamedTuple):
    """An activation's CUDA operations: `forward` sets ``y`` from ``x``, `grad` sets
    ``gx`` from ``g`` and ``r``, the saved ``"x"`` or ``"y"`` (`saves`); `params` are
    the scalar parameters after x (``, T name`` each)."""

    params: str
    forward: str
    grad: str
    saves: str


PREAMBLE = """
template <typename T> __device__ T luxnn_sigmoid(T x) {
    T e = exp(-fabs(x));  // exp of a non-positive number never overflows
    return (x >= (T)0 ? (T)1 : e) / ((T)1 + e);
}
"""
_TANH_ARGUMENT = f"((x * x * (T){cpu.GELU_CUBIC!r} + (T)1) * x * (T){cpu.SQRT_2_OVER_PI!r})"

# In the order of operations of the CPU's code (NumPy's maximum: NaN wins, and -0.0 gives 0).
ACTIVATIONS = {
    "relu": Activation("", "y = (x > (T)0 || x != x) ? x : (T)0", "gx = g * (T)(r > (T)0)", "y"),
    "leaky_relu": Activation(", T negative_slope", "y = x > (T)0 ? x : x * negative_slope",
                             "gx = r > (T)0 ? g : g * negative_slope", "x"),
    "elu": Activation(", T alpha", "y = x > (T)0 ? x : alpha * expm1(x)",
                      "gx = r > (T)0 ? g : g * (alpha * expm1(r) + alpha)", "x"),
    "sigmoid": Activation("", "y = luxnn_sigmoid(x)", "gx = g * r * ((T)1 - r)", "y"),
    "tanh": Activation("", "y = tanh(x)", "gx = g * ((T)1 - r * r)", "y"),
    "silu": Activation("", "y = x * luxnn_sigmoid(x)",
                       "T s = luxnn_sigmoid(r); gx = g * s * ((T)1 + r * ((T)1 - s))", "x"),
    "softplus": Activation("", "y = log1p(exp(-fabs(x))) + ((x > (T)0 || x != x) ? x : (T)0)",
                           "gx = g * luxnn_sigmoid(r)", "x"),
    "gelu_tanh": Activation(
        "",
        f"y = (tanh({_TANH_ARGUMENT}) + (T)1) * x * (T)0.5",
        f"""T x = r; T t = tanh({_TANH_ARGUMENT});
        T d = (x * x * (T){3 * cpu.GELU_CUBIC!r} + (T)1) * x * (T){0.5 * cpu.SQRT_2_OVER_PI!r};
        gx = (d * ((T)1 - t * t) + (T)0.5 + t * (T)0.5) * g""",
        "x",
    ),
    "gelu_erf": Activation(
        "",
        f"y = x * ((T)0.5 * ((T)1 + erf(x * (T){cpu.INV_SQRT_2!r})))",
        f"""T cdf = (T)0.5 * ((T)1 + erf(r * (T){cpu.INV_SQRT_2!r}));
        gx = g * (cdf + r * exp((T)-0.5 * r * r) * (T){cpu.INV_SQRT_2PI!r})""",
        "x",
    ),
}  # fmt: skip


def cpu_residual(name: str, saved, *params):
    """The residual of the CPU's `name` from what the CUDA kernels save of it."""
    return saved if ACTIVATIONS[name].saves == "y" else getattr(cpu, name)(saved, *params)[1]


def _forward_twin(name: str):
    def twin(x, *params_and_y):
        *params, y = params_and_y
        np.copyto(y, getattr(cpu, name)(x, *params)[0])

    return twin


def _grad_twin(name: str):
    def twin(g, saved, *params_and_gx):
        *params, gx = params_and_gx
        np.copyto(gx, getattr(cpu, f"{name}_grad")(g, cpu_residual(name, saved, *params), *params))

    return twin


FORWARD = {name: Elementwise(f"luxnn_{name}", f"T x{a.params}", "T y", a.forward, twin=_forward_twin(name),
                             preamble=PREAMBLE) for name, a in ACTIVATIONS.items()}
GRAD = {name: Elementwise(f"luxnn_{name}_grad", f"T g, T r{a.params}", "T gx", a.grad, twin=_grad_twin(name),
                          preamble=PREAMBLE) for name, a in ACTIVATIONS.items()}


def floating(x):
    """`x` itself if float32 or float64, else cast to NumPy's promotion of its dtype with
    float32 (the kernels' source is written for float and double)."""
    return x if x.dtype in (np.float32, np.float64) else x.astype(np.result_type(x.dtype, np.float32))


def half_kept(compute):
    """`compute` (arrays in; an array or a tuple of them out), its float32 results returned
    in float16 where its arrays' dtypes promote to float16, as on the CPU: the kernels
    compute float16 in float32 (`floating`)."""

    @functools.wraps(compute)
    def kept(*args, **kwargs):
        results = compute(*args, **kwargs)
        # A dtype comparison per argument on every launch; NumPy's promotion only for float16.
        if not any(getattr(a, "dtype", None) == _HALF for a in args):
            return results
        if np.result_type(*(a.dtype for a in args if hasattr(a, "dtype") and hasattr(a, "shape"))) != _HALF:
            return results
        if isinstance(results, tuple):
            return tuple(_half(r) for r in results)
        return _half(results)

    return kept


_HALF = np.dtype(np.float16)


def _half(result):
    return result.astype(np.float16) if getattr(result, "dtype", None) == np.float32 else result


def _alike(g, saved):
    """The cotangent and the saved array in one dtype, NumPy's promotion of theirs."""
    if g.dtype == saved.dtype:
        return g, saved
    dtype = np.result_type(g, saved)
    return g.astype(dtype, copy=False), saved.astype(dtype, copy=False)


@half_kept
def activation_forward(name: str, x, *params, out=None):
    """``(y, saved)`` of the activation `name` of `x`: one launch of its kernel, into
    `out` if given (which may be `x`; not for float16, computed in float32), else a new
    array."""
    x = floating(x)
    if out is None or out.dtype != x.dtype:
        out = module_of(x).empty(x.shape, x.dtype)
    y = FORWARD[name](x, *params, out)
    return y, (y if ACTIVATIONS[name].saves == "y" else x)


@half_kept
def _grad(name: str, g, saved, *params):
    g, saved = _alike(floating(g), floating(saved))
    return GRAD[name](g, saved, *params, module_of(g).empty(g.shape, g.dtype))


def relu(x):
    return activation_forward("relu", x)


def relu_grad(g, residual):
    return _grad("relu", g, residual)


def leaky_relu(x, negative_slope=0.01):
    return activation_forward("leaky_relu", x, negative_slope)


def leaky_relu_grad(g, residual, negative_slope=0.01):
    return _grad("leaky_relu", g, residual, negative_slope)


def elu(x, alpha=1.0):
    return activation_forward("elu", x, alpha)


def elu_grad(g, residual, alpha=1.0):
    return _grad("elu", g, residual, alpha)


def sigmoid(x):
    return activation_forward("sigmoid", x)


def sigmoid_grad(g, residual):
    return _grad("sigmoid", g, residual)


def tanh(x):
    return activation_forward("tanh", x)


def tanh_grad(g, residual):
    return _grad("tanh", g, residual)


def silu(x):
    return activation_forward("silu", x)


def silu_grad(g, residual):
    return _grad("silu", g, residual)


def softplus(x):
    return activation_forward("softplus", x)


def softplus_grad(g, residual):
    return _grad("softplus", g, residual)


def gelu_tanh(x):
    return activation_forward("gelu_tanh", x)


def gelu_tanh_grad(g, residual):
    return _grad("gelu_tanh", g, residual)


def gelu_erf(x):
    return activation_forward("gelu_erf", x)


def gelu_erf_grad(g, residual):
    return _grad("gelu_erf", g, residual)

