"""Recurrent cells: RNN, LSTM and GRU, with PyTorch's equations, gate order and parameters
(transposed); one step at a time, or every step of a sequence as one fused primitive (see
`luxnn.nn.recurrence` for the layers over sequences)."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import numpy as np

from .. import ops
from ..ad.namespace import array_namespace
from ..ad.tape import stop_gradient
from ..backend import module_of
from ..core import Layer, LayerError, check_params
from ..dtypes import match_eltype
from ..ops.recurrent import gru_sequence, lstm_sequence, rnn_sequence

__all__ = ["Steps", "RecurrentCell", "RNNCell", "LSTMCell", "GRUCell"]

_INIT_CARRY = ("zeros", "trainable")


class Steps(NamedTuple):
    """Every step of a sequence, as one input of a `RecurrentCell`: `xs` time-major ``(seq,
    batch, in_dims)``, the carry to start from (None: the cell's initial carry), and
    `reverse` (last step first; outputs stay aligned with the input positions). The cell
    returns every step's output packed in one array ``(seq, batch, P)``: h_t in its first
    `hidden` columns (for the LSTM, c_t in the next `hidden`); with `last_only`, only the
    last step taken's, ``(batch, P)``. `Recurrence` calls cells so.

    >>> import luxnn as lx
    >>> cell = lx.LSTMCell(3, 5)
    >>> ps, st = lx.setup(np.random.default_rng(0), cell)
    >>> cell(Steps(np.ones((7, 2, 3), np.float32)), ps, st)[0].shape
    (7, 2, 10)
    """

    xs: Any
    carry: Any = None
    reverse: bool = False
    last_only: bool = False


class RecurrentCell(Layer):
    """The base of `RNNCell`, `LSTMCell` and `GRUCell`: one step ``(x_t, carry) -> ((h_t,
    carry), state)``, or every step of a sequence at once given `Steps`, as one fused
    primitive.

    Input ``x_t`` ``(batch, in_dims)``, alone (the carry starts at zeros, or at the
    trainable initial carry) or as ``(x_t, carry)``. Parameters ``{"weight_ih": (in_dims,
    G * hidden), "weight_hh": (hidden, G * hidden), "bias_ih": (G * hidden,), "bias_hh": (G *
    hidden,)}`` (no biases with ``use_bias=False``; with ``init_carry="trainable"`` also
    the initial carry, ``"h0"`` and for the LSTM ``"c0"``, each ``(hidden,)``, zeros at
    first), so ``weight_ih = torch_cell.weight_ih.T`` copies a PyTorch cell over. Weights
    and biases start uniform in ±1/sqrt(hidden), as PyTorch's.
    """

    gates: int  # G: the gate blocks of the projections
    carry_names: tuple[str, ...] = ("h0",)  # the trainable initial carry's parameters

    def __init__(self, in_dims: int, hidden: int, *, use_bias: bool = True, init_carry: str = "zeros") -> None:
        name = type(self).__name__
        for arg, n in (("in_dims", in_dims), ("hidden", hidden)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"{name}: {arg} must be a positive integer, got {n!r}")
        if init_carry not in _INIT_CARRY:
            raise ValueError(f"{name}: init_carry must be one of {_INIT_CARRY}, got {init_carry!r}")
        self.in_dims = int(in_dims)
        self.hidden = int(hidden)
        self.use_bias = bool(use_bias)
        self.init_carry = init_carry
        width = self.gates * self.hidden
        self._shapes = {"weight_ih": (self.in_dims, width), "weight_hh": (self.hidden, width)}
        if self.use_bias:
            self._shapes.update(bias_ih=(width,), bias_hh=(width,))
        if init_carry == "trainable":
            self._shapes.update({c: (self.hidden,) for c in self.carry_names})

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        bound = 1.0 / math.sqrt(self.hidden)
        ps = {}
        for key, shape in self._shapes.items():
            if key in self.carry_names:
                ps[key] = np.zeros(shape, np.float32)
            else:
                ps[key] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
        return ps

    # -- what each cell defines ---------------------------------------------------------

    def _scan(self, xs: Any, ps: dict[str, Any], carry: tuple, reverse: bool, last_only: bool) -> Any:
        """The cell's primitive over time-major `xs` ``(seq, batch, in_dims)`` from the
        checked `carry` (see `Steps`)."""
        raise NotImplementedError

    def _carry_of(self, packed: Any) -> Any:
        """The carry in packed outputs ``(..., P)``: h itself by default."""
        return packed

    def unpack(self, packed: Any) -> tuple[Any, Any]:
        """``(h, carry)`` of packed outputs ``(..., P)`` (see `Steps`): h ``(..., hidden)``,
        and the carry to go on from (h, or ``(h, c)`` for the LSTM)."""
        h = packed if packed.shape[-1] == self.hidden else packed[..., : self.hidden]
        return h, self._carry_of(packed)

    # -- shared ------------------------------------------------------------------------

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if isinstance(x, Steps):
            shape = getattr(x.xs, "shape", None)
            if shape is None or len(shape) != 3 or shape[0] < 1 or shape[2] != self.in_dims:
                raise LayerError(f"{self}: expected Steps of shape (seq >= 1, batch, {self.in_dims}), got {shape}")
            return self._steps(x.xs, ps, x.carry, x.reverse, x.last_only), st
        if isinstance(x, tuple) and len(x) != 2:
            raise LayerError(f"{self}: expected x_t or (x_t, carry), got a tuple of {len(x)}")
        x_t, carry = x if isinstance(x, tuple) else (x, None)
        shape = getattr(x_t, "shape", None)
        if shape is None or len(shape) != 2 or shape[1] != self.in_dims:
            raise LayerError(f"{self}: expected x_t of shape (batch, {self.in_dims}) or (x_t, carry), got {shape}")
        packed = self._steps(array_namespace(x_t).expand_dims(x_t, 0), ps, carry, False, True)
        return self.unpack(packed), st

    def _steps(self, xs: Any, ps: dict[str, Any], carry: Any, reverse: bool, last_only: bool) -> Any:
        check_params(self, ps, self._shapes)
        weight = ps["weight_ih"]
        xs = match_eltype(self, xs, weight)
        batch = xs.shape[1]
        if carry is None:
            carry = self._initial_carry(ps, batch)
        else:
            carry = tuple(match_eltype(self, c, weight) for c in self._checked_carry(carry, batch))
        return self._scan(xs, ps, carry, reverse, last_only)

    def _initial_carry(self, ps: dict[str, Any], batch: int) -> tuple:
        if self.init_carry == "trainable":
            xp = array_namespace(ps[self.carry_names[0]])
            return tuple(xp.broadcast_to(ps[c], (batch, self.hidden)) for c in self.carry_names)
        weight = stop_gradient(ps["weight_hh"])
        zeros = module_of(weight).zeros((batch, self.hidden), weight.dtype)
        return (zeros,) * len(self.carry_names)

    def _checked_carry(self, carry: Any, batch: int) -> tuple:
        parts = carry if isinstance(carry, tuple) else (carry,)
        want = (batch, self.hidden)
        if len(parts) != len(self.carry_names) or any(getattr(p, "shape", None) != want for p in parts):
            kind = "(h, c), each" if len(self.carry_names) == 2 else "h"
            got = [getattr(p, "shape", type(p).__name__) for p in parts]
            raise LayerError(f"{self}: expected carry {kind} of shape {want}, got {got}")
        return parts

    def _input_projection(self, xs: Any, ps: dict[str, Any], bias: Any) -> Any:
        """``xs @ weight_ih + bias`` for every step: one GEMM."""
        return ops.dense(xs, ps["weight_ih"], bias)

    def _both_biases(self, ps: dict[str, Any]) -> Any:
        return ps["bias_ih"] + ps["bias_hh"] if self.use_bias else None

    def __repr__(self) -> str:
        extra = "" if self.use_bias else ", use_bias=False"
        extra += "" if self.init_carry == "zeros" else f", init_carry={self.init_carry!r}"
        return f"{type(self).__name__}({self.in_dims} => {self.hidden}{self._repr_extra()}{extra})"

    def _repr_extra(self) -> str:
        return ""


class RNNCell(RecurrentCell):
    """Elman RNN cell, as ``torch.nn.RNNCell``: ``h_t = act(x_t @ W_ih + b_ih + h @ W_hh +
    b_hh)``, `activation` "tanh" or "relu"; the carry is h. See `RecurrentCell`.

    >>> import luxnn as lx
    >>> cell = lx.RNNCell(3, 5)
    >>> ps, st = lx.setup(np.random.default_rng(0), cell)
    >>> (h, carry), st = cell(np.ones((2, 3), np.float32), ps, st)
    >>> (h, carry), st = cell((np.ones((2, 3), np.float32), carry), ps, st)
    >>> h.shape
    (2, 5)
    """

    gates = 1

    def __init__(self, in_dims: int, hidden: int, activation: str = "tanh", *, use_bias: bool = True, init_carry: str = "zeros") -> None:
        if activation not in ("tanh", "relu"):
            raise ValueError(f"RNNCell: activation must be 'tanh' or 'relu', got {activation!r}")
        self.activation = activation
        super().__init__(in_dims, hidden, use_bias=use_bias, init_carry=init_carry)

    def _scan(self, xs, ps, carry, reverse, last_only):
        xw = self._input_projection(xs, ps, self._both_biases(ps))
        return rnn_sequence(xw, ps["weight_hh"], carry[0], activation=self.activation, reverse=reverse, last_only=last_only)

    def _repr_extra(self) -> str:
        return "" if self.activation == "tanh" else ", relu"


class LSTMCell(RecurrentCell):
    """LSTM cell, as ``torch.nn.LSTMCell``: gates i, f, g, o from ``x_t @ W_ih + b_ih + h @
    W_hh + b_hh``; ``c' = f * c + i * g``, ``h' = o * tanh(c')``. The carry is ``(h, c)``.
    See `RecurrentCell`.

    >>> import luxnn as lx
    >>> cell = lx.LSTMCell(3, 5)
    >>> ps, st = lx.setup(np.random.default_rng(0), cell)
    >>> (h, (h, c)), st = cell(np.ones((2, 3), np.float32), ps, st)
    >>> ps["weight_hh"].shape, c.shape
    ((5, 20), (2, 5))
    """

    gates = 4
    carry_names = ("h0", "c0")

    def _scan(self, xs, ps, carry, reverse, last_only):
        # The primitive is batch first and makes the input projection itself (into each step's GEMM).
        xp = array_namespace(xs)
        x = xp.permute_dims(xs, (1, 0, 2))
        out = lstm_sequence(x, ps["weight_ih"], self._both_biases(ps), ps["weight_hh"], *carry, reverse=reverse, last_only=last_only)
        return out if last_only else xp.permute_dims(out, (1, 0, 2))

    def _carry_of(self, packed):
        return packed[..., : self.hidden], packed[..., self.hidden :]


class GRUCell(RecurrentCell):
    """GRU cell, as ``torch.nn.GRUCell``: gates r, z, n; ``n = tanh(x_t @ W_in + b_in + r *
    (h @ W_hn + b_hn))``, ``h' = (1 - z) * n + z * h``. The carry is h. See `RecurrentCell`.

    >>> import luxnn as lx
    >>> cell = lx.GRUCell(3, 5)
    >>> ps, st = lx.setup(np.random.default_rng(0), cell)
    >>> (h, carry), st = cell(np.ones((2, 3), np.float32), ps, st)
    >>> ps["weight_ih"].shape, h.shape
    ((3, 15), (2, 5))
    """

    gates = 3

    def _scan(self, xs, ps, carry, reverse, last_only):
        xw = self._input_projection(xs, ps, ps["bias_ih"] if self.use_bias else None)
        return gru_sequence(xw, ps["weight_hh"], ps.get("bias_hh"), carry[0], reverse=reverse, last_only=last_only)
