"""The dense layer on CuPy arrays: one GEMM, then the bias and the activation in one kernel
(``luxnn_bias_<activation>``, the activation's CUDA operation of ops/cuda/activations.py
after the add); backward, the activation's gradient in one kernel, one GEMM per
cotangent and the bias's gradient one reduction."""

from __future__ import annotations

import inspect

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from ..cpu import activations as cpu
from . import activations, gemm
from .activations import ACTIVATIONS, PREAMBLE, floating, half_kept

__all__ = ["forward", "backward"]


def _in_place_twin(name):
    def twin(b, *params_and_y):
        *params, y = params_and_y
        y += b
        np.copyto(y, getattr(cpu, name)(y, *params)[0])

    return twin


def _beside_twin(name):
    def twin(b, *params_and_outputs):
        *params, z, y = params_and_outputs
        z += b
        np.copyto(y, getattr(cpu, name)(z, *params)[0])

    return twin


def _bias_kernel(name, a):
    """An activation that saves its output runs in place on the GEMM's output ``y``; one
    that saves its input adds the bias in place (``z``) and writes ``y`` beside it."""
    if a.saves == "y":
        return Elementwise(f"luxnn_bias_{name}", f"T b{a.params}", "T y", f"T x = y + b; {a.forward}",
                           twin=_in_place_twin(name), preamble=PREAMBLE)
    return Elementwise(f"luxnn_bias_{name}", f"T b{a.params}", "T z, T y", f"z = z + b; T x = z; {a.forward}",
                       twin=_beside_twin(name), preamble=PREAMBLE)


BIAS_ACTIVATION = {name: _bias_kernel(name, a) for name, a in ACTIVATIONS.items()}


def _defaults(name):
    """The activation's parameters: its defaults (those of the activations that dense fuses)."""
    parameters = inspect.signature(getattr(activations, name)).parameters.values()
    return tuple(p.default for p in parameters if p.default is not p.empty)


@half_kept
def bias_activation(y, b, activation):
    """``(activation(y + b), residual)`` of the GEMM's fresh output `y` ``(rows, m)``
    (updated in place) and `b` ``(m,)`` or None; `activation` a kernel name or None."""
    if activation is None:
        if b is not None:
            y += b
        return y, y
    y, params = floating(y), _defaults(activation)
    saves_output = ACTIVATIONS[activation].saves == "y"
    if b is None:
        return activations.activation_forward(activation, y, *params, out=y if saves_output else None)
    b = b.astype(y.dtype, copy=False)
    if saves_output:
        BIAS_ACTIVATION[activation](b, *params, y)
        return y, y
    z, out = BIAS_ACTIVATION[activation](b, *params, y, module_of(y).empty(y.shape, y.dtype))
    return out, z


def forward(rows, w, b, activation):
    """``(activation(rows @ w + b), residual)`` for rows ``(n, k)``, w ``(k, m)``, b
    ``(m,)`` or None: one GEMM, then `bias_activation`; in the GEMM's dtype, as the CPU
    adds the bias in place."""
    y = gemm.matmul(rows, w)
    return bias_activation(y, None if b is None else b.astype(y.dtype, copy=False), activation)


def backward(g, rows, w, residual, activation, need_x, need_w, need_b):
    """``(gx_rows, gw, gb)`` from the output's cotangent `g` ``(n, m)``: the activation's
    gradient one kernel, one GEMM per cotangent, the bias's one row sum."""
    if activation is not None:
        g = getattr(activations, f"{activation}_grad")(g, residual)
    gx = gemm.matmul(g, w.T) if need_x else None
    gw = gemm.matmul(rows.T, g) if need_w else None
    return gx, gw, g.sum(axis=0) if need_b else None
