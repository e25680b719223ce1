"""Recurrent cells run over whole sequences: one primitive per cell, whose backward pass
is backpropagation through time in one loop.

Equations, gate order and bias placement are PyTorch's, so weights copy over from
``torch.nn.RNN/LSTM/GRU`` by a transpose. `rnn_sequence` and `gru_sequence` take the input
projection of every step (``x_t @ W_ih + b``, one GEMM over all steps made by the caller),
time-major ``(seq, batch, features)``; `lstm_sequence` takes the inputs themselves, batch
first, and makes their projection itself.

``reverse=True`` runs from the last step to the first; outputs stay aligned with the
inputs' positions (as the backward half of PyTorch's bidirectional RNNs). ``last_only=True``
returns only the output of the last step taken, ``(batch, P)``, whose cotangent then seeds
the backward pass (no cotangent of zeros for every other step). Padded sequences of
different lengths run forward as they are and in reverse through `reverse_padded`.

This module checks the arguments, settles the dtype and wires the VJPs; the passes
themselves are per device (`luxnn.ops.traits`): ``<cell>_forward(...) -> (outputs,
saved)`` and ``<cell>_backward(saved, g, last_only, needs) -> cotangents`` in
`luxnn.ops.cpu.recurrent` (the batch's rows on the kernel threads, the LSTM's cell in C)
and `luxnn.ops.cuda.recurrent` (per step one GEMM and one fused kernel each way).
"""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from .traits import Area, device_of_module

__all__ = ["rnn_sequence", "lstm_sequence", "gru_sequence", "reverse_padded"]

_RECURRENT = Area("recurrent")


def _check(who, xw, w_hh, gates, carries):
    """The hidden size, after checking xw ``(seq, batch, gates * H)``, w_hh ``(H, gates * H)``
    and each carry ``(batch, H)``."""
    hidden = w_hh.shape[0] if w_hh.ndim == 2 else 0
    ok = xw.ndim == 3 and xw.shape[0] >= 1 and w_hh.shape == (hidden, gates * hidden) and xw.shape[2] == gates * hidden
    if not ok or any(c.shape != (xw.shape[1], hidden) for c in carries):
        raise ValueError(
            f"{who}: expected xw (seq >= 1, batch, {gates} * H), w_hh (H, {gates} * H) and carries (batch, H), "
            f"got shapes {xw.shape}, {w_hh.shape} and {[c.shape for c in carries]}"
        )
    return hidden


def _cells(who, *arrays):
    """The passes for the device of `arrays` (None skipped), after checking it is one."""
    modules = {module_of(a) for a in arrays if a is not None}
    if len(modules) > 1:
        devices = " and ".join(sorted(device_of_module(m).upper() for m in modules))
        raise TypeError(f"{who}: expected the arrays on one device, got {devices} arrays")
    return _RECURRENT[type(next(a for a in arrays if a is not None))]


def _result(outputs, last_only, reverse):
    """A primitive's output: every step's `outputs`, or a copy of the last step taken's."""
    return outputs[0 if reverse else -1].copy() if last_only else outputs


@primitive
def rnn_sequence(xw, w_hh, h0, *, activation="tanh", reverse=False, last_only=False):
    """Elman RNN over a sequence: ``h_t = act(xw[t] + h_{t-1} @ w_hh)``, `act` tanh or relu.

    Shapes: xw ``(seq, batch, H)`` (``x_t @ W_ih + b_ih + b_hh``), w_hh ``(H, H)``, h0
    ``(batch, H)`` -> ``(seq, batch, H)``, every step's h (``(batch, H)`` with `last_only`).

    >>> hs = rnn_sequence(np.ones((3, 2, 4)), np.zeros((4, 4)), np.zeros((2, 4)))
    >>> hs.shape, round(float(hs[-1, 0, 0]), 4)
    ((3, 2, 4), 0.7616)
    """
    if activation not in ("tanh", "relu"):
        raise ValueError(f"rnn_sequence: activation must be 'tanh' or 'relu', got {activation!r}")
    _check("rnn_sequence", xw, w_hh, 1, (h0,))
    cells = _cells("rnn_sequence", xw, w_hh, h0)
    hs, saved = cells.rnn_forward(xw, w_hh, h0, np.result_type(xw, w_hh, h0), activation, reverse)

    def vjp(g, needs):
        return cells.rnn_backward(saved, g, last_only, needs)

    return _result(hs, last_only, reverse), vjp


@primitive
def lstm_sequence(x, w_ih, b, w_hh, h0, c0, *, reverse=False, last_only=False):
    """LSTM over a batch of sequences, as PyTorch (gates i, f, g, o)::

        i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of (x_t @ w_ih + b + h_{t-1} @ w_hh)
        c_t = f * c_{t-1} + i * g
        h_t = o * tanh(c_t)

    Shapes, batch first: x ``(batch, seq, in)``, w_ih ``(in, 4H)``, b ``(4H,)`` (``b_ih +
    b_hh``, or None), w_hh ``(H, 4H)``, h0 and c0 ``(batch, H)`` -> ``(batch, seq, 2H)``:
    ``[h_t | c_t]`` at every step (``(batch, 2H)`` with `last_only`; the carry is part of
    the output, so a cell step is the one-step sequence).

    >>> out = lstm_sequence(np.ones((2, 3, 5)), np.zeros((5, 8)), None, np.zeros((2, 8)), np.zeros((2, 2)), np.zeros((2, 2)))
    >>> out.shape
    (2, 3, 4)
    """
    _check_lstm(x, w_ih, b, w_hh, h0, c0)
    cells = _cells("lstm_sequence", x, w_ih, b, w_hh, h0, c0)
    dtype = np.result_type(*(a for a in (x, w_ih, b, w_hh, h0, c0) if a is not None))
    out, saved = cells.lstm_forward(x, w_ih, b, w_hh, h0, c0, dtype, reverse)

    def vjp(g, needs):
        return cells.lstm_backward(saved, g, last_only, needs)

    return (out[:, 0 if reverse else -1].copy() if last_only else out), vjp


def _check_lstm(x, w_ih, b, w_hh, h0, c0):
    """Checks the shapes `lstm_sequence` takes."""
    hidden = w_hh.shape[0] if w_hh.ndim == 2 else 0
    batch, n_in = (x.shape[0], x.shape[2]) if x.ndim == 3 else (0, 0)
    ok = x.ndim == 3 and x.shape[1] >= 1 and w_hh.shape == (hidden, 4 * hidden) and w_ih.shape == (n_in, 4 * hidden)
    if not ok or (b is not None and b.shape != (4 * hidden,)) or any(c.shape != (batch, hidden) for c in (h0, c0)):
        raise ValueError(
            "lstm_sequence: expected x (batch, seq >= 1, in), w_ih (in, 4 * H), b (4 * H,) or None, w_hh (H, 4 * H) "
            f"and h0, c0 (batch, H), got shapes {[None if a is None else a.shape for a in (x, w_ih, b, w_hh, h0, c0)]}"
        )


@primitive
def gru_sequence(xw, w_hh, b_hh, h0, *, reverse=False, last_only=False):
    """GRU over a sequence, as PyTorch (gates r, z, n; the reset gate scales the hidden
    projection with its bias)::

        r, z = sigmoid(xw[t, r|z] + h_{t-1} @ w_hh[:, r|z] + b_hh[r|z])
        n = tanh(xw[t, n] + r * (h_{t-1} @ w_hh[:, n] + b_hh[n]))
        h_t = (1 - z) * n + z * h_{t-1}

    Shapes: xw ``(seq, batch, 3H)`` (``x_t @ W_ih + b_ih``), w_hh ``(H, 3H)``, b_hh
    ``(3H,)`` (or None: no hidden bias), h0 ``(batch, H)`` -> ``(seq, batch, H)``
    (``(batch, H)`` with `last_only`).

    >>> gru_sequence(np.ones((3, 2, 6)), np.zeros((2, 6)), np.zeros(6), np.zeros((2, 2))).shape
    (3, 2, 2)
    """
    H = _check("gru_sequence", xw, w_hh, 3, (h0,))
    if b_hh is not None and b_hh.shape != (3 * H,):
        raise ValueError(f"gru_sequence: expected b_hh of shape ({3 * H},), got {b_hh.shape}")
    cells = _cells("gru_sequence", xw, w_hh, b_hh, h0)
    dtype = np.result_type(xw, w_hh, h0, *(() if b_hh is None else (b_hh,)))
    hs, saved = cells.gru_forward(xw, w_hh, b_hh, h0, dtype, reverse)

    def vjp(g, needs):
        return cells.gru_backward(saved, g, last_only, needs)

    return _result(hs, last_only, reverse), vjp


@primitive
def reverse_padded(x, lengths):
    """Each sequence of `x` ``(batch, seq, ...)`` with its first ``lengths[b]`` steps in
    reverse order and the steps after them in place: a padded sequence read from its own
    last step. Its own inverse, and so its own VJP. `lengths` ``(batch,)`` integers in
    ``[0, seq]``, of `x`'s backend.

    >>> reverse_padded(np.arange(8.0).reshape(2, 4), np.array([4, 2])).tolist()
    [[3.0, 2.0, 1.0, 0.0], [5.0, 4.0, 6.0, 7.0]]
    """
    xp = module_of(x)
    steps = xp.arange(x.shape[1])
    ends = lengths.reshape(-1, 1)
    index = (xp.arange(x.shape[0]).reshape(-1, 1), xp.where(steps < ends, ends - 1 - steps, steps))

    def vjp(g, needs):
        return g[index], None

    return x[index], vjp
