"""Recurrent cells run over whole sequences: one primitive per cell, whose backward pass
is backpropagation through time in one loop.

Each takes the input projection of every step at once (``x_t @ W_ih + b``, computed by
the caller as one GEMM over all steps, time-major), makes one GEMM per step for the hidden
projection into a preallocated gate buffer, and applies the gate nonlinearities and the
cell update in place on it. The backward pass walks the steps in reverse with one GEMM per
step for the hidden state's cotangent, and forms the hidden weight's gradient afterwards
as one GEMM over all steps. Equations, gate order and bias placement are PyTorch's, so
weights copy over from ``torch.nn.RNN/LSTM/GRU`` by a transpose.

Shapes are time-major, ``(seq, batch, features)``, so that each step's rows are one
contiguous block. ``reverse=True`` runs from the last step to the first; outputs stay
aligned with the inputs' positions (as the backward half of PyTorch's bidirectional RNNs).
``last_only=True`` returns only the output of the last step taken, ``(batch, P)``, whose
cotangent then seeds the backward pass (no cotangent of zeros for every other step).
"""

from __future__ import annotations

import numpy as np

from ..ad.tape import primitive
from ..backend import module_of
from ..parallel import matmul

__all__ = ["rnn_sequence", "lstm_sequence", "gru_sequence"]


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


def _order(seq, reverse):
    """The steps in the order the forward pass takes them."""
    return range(seq - 1, -1, -1) if reverse else range(seq)


def _previous(hs, h0, t, seq, reverse):
    """The hidden state step t started from: h0 at the first step taken."""
    p = t + 1 if reverse else t - 1
    return h0 if p < 0 or p == seq else hs[p]


def _result(outputs, last_only, reverse):
    """A primitive's output: every step's `outputs`, or a copy of the last step taken's."""
    return outputs[0 if reverse else -1].copy() if last_only else outputs


def _carried(g, shape, dtype, last_only, xp):
    """The cotangent carried back from step to step, before the last step taken: that
    step's output cotangent for `last_only`, else zeros (each step then adds its own)."""
    return g.astype(dtype, copy=True) if last_only else xp.zeros(shape, dtype)


def _hidden_weight_grad(hs, h0, d, reverse):
    """``sum_t h_prev(t)^T @ d[t]``: the gradient of w_hh from every step's gate cotangent
    `d` ``(seq, batch, G)``, as two GEMMs (the first step taken, from h0, and all the
    others from the outputs `hs` ``(seq, batch, H)``, a view whose steps are stacked rows)."""
    seq, batch, hidden = hs.shape
    rows_h = hs.reshape(seq * batch, hidden)  # no copy: the steps of `hs` are evenly spaced
    rows_d = d.reshape(seq * batch, d.shape[2])
    first = d[-1] if reverse else d[0]
    grad = matmul(h0.T, first)
    if seq > 1:
        later = rows_d[: (seq - 1) * batch] if reverse else rows_d[batch:]
        before = rows_h[batch:] if reverse else rows_h[: (seq - 1) * batch]
        grad += matmul(before.T, later)
    return grad


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
    xp = module_of(xw)
    seq = xw.shape[0]
    hs = xp.empty(xw.shape, np.result_type(xw, w_hh, h0))
    for t in _order(seq, reverse):
        h = hs[t]
        np.matmul(_previous(hs, h0, t, seq, reverse), w_hh, out=h)
        h += xw[t]
        if activation == "tanh":
            np.tanh(h, out=h)
        else:
            np.maximum(h, 0, out=h)

    def vjp(g, needs):
        d = xp.empty_like(hs)  # the cotangent of each step's pre-activation
        dh = _carried(g, hs[0].shape, hs.dtype, last_only, xp)
        for t in reversed(_order(seq, reverse)):
            y, dt = hs[t], d[t]
            if not last_only:
                dh += g[t]
            if activation == "tanh":
                np.multiply(y, y, out=dt)
                np.subtract(1, dt, out=dt)
                dt *= dh
            else:
                np.multiply(dh, y > 0, out=dt)
            np.matmul(dt, w_hh.T, out=dh)
        gw = _hidden_weight_grad(hs, h0, d, reverse) if needs[1] else None
        return d, gw, dh

    return _result(hs, last_only, reverse), vjp


# The LSTM's gates i, f, g, o are sigmoid, sigmoid, tanh, sigmoid. sigmoid(x) =
# (1 + tanh(x / 2)) / 2, so all four are one tanh over the step's gate buffer between two
# per-column affine maps, tanh(x * half) * half + shift, which never overflows. Their
# derivatives come from the gates themselves (s * (1 - s), 1 - g^2): the pre-activations
# are not kept, which halves what the forward pass writes for the backward one to read.
def _lstm_constants(hidden, dtype, xp):
    """(half, shift), each ``(4H,)``: 0.5 and 0.5 in the sigmoid gates' columns, 1 and 0 in g's."""
    half = xp.full(4 * hidden, 0.5, dtype)
    half[2 * hidden : 3 * hidden] = 1.0
    shift = half.copy()
    shift[2 * hidden : 3 * hidden] = 0.0
    return half, shift


@primitive
def lstm_sequence(xw, w_hh, h0, c0, *, reverse=False, last_only=False):
    """LSTM over a sequence, as PyTorch (gates i, f, g, o)::

        i, f, g, o = sigmoid, sigmoid, tanh, sigmoid of (xw[t] + h_{t-1} @ w_hh)
        c_t = f * c_{t-1} + i * g
        h_t = o * tanh(c_t)

    Shapes: xw ``(seq, batch, 4H)`` (``x_t @ W_ih + b_ih + b_hh``), w_hh ``(H, 4H)``, h0 and
    c0 ``(batch, H)`` -> ``(seq, batch, 2H)``: ``[h_t | c_t]`` at every step (``(batch,
    2H)`` with `last_only`; the carry is part of the output, so a cell step is the
    one-step sequence).

    >>> out = lstm_sequence(np.ones((3, 2, 8)), np.zeros((2, 8)), np.zeros((2, 2)), np.zeros((2, 2)))
    >>> out.shape
    (3, 2, 4)
    """
    H = _check("lstm_sequence", xw, w_hh, 4, (h0, c0))
    xp = module_of(xw)
    seq, batch, _ = xw.shape
    dtype = np.result_type(xw, w_hh, h0, c0)
    half, shift = _lstm_constants(H, dtype, xp)
    gates = xp.empty(xw.shape, dtype)  # i, f, g, o
    out = xp.empty((seq, batch, 2 * H), dtype)
    tanh_c = xp.empty((seq, batch, H), dtype)
    hs, cs = out[:, :, :H], out[:, :, H:]
    for t in _order(seq, reverse):
        a, h, c = gates[t], hs[t], cs[t]
        np.matmul(_previous(hs, h0, t, seq, reverse), w_hh, out=a)
        a += xw[t]
        a *= half
        np.tanh(a, out=a)
        a *= half
        a += shift
        np.multiply(a[:, H : 2 * H], _previous(cs, c0, t, seq, reverse), out=c)
        np.multiply(a[:, :H], a[:, 2 * H : 3 * H], out=h)  # i * g, with h_t as scratch
        c += h
        np.tanh(c, out=tanh_c[t])
        np.multiply(a[:, 3 * H :], tanh_c[t], out=h)

    def vjp(g, needs):
        d = xp.empty(xw.shape, dtype)  # the cotangent of each step's pre-activation
        dhc = _carried(g, (batch, 2 * H), dtype, last_only, xp)  # [dh | dc]
        dh, dc = dhc[:, :H], dhc[:, H:]
        scratch = xp.empty((batch, H), dtype)
        slopes = xp.empty((batch, 4 * H), dtype)  # each gate's derivative
        for t in reversed(_order(seq, reverse)):
            a, tc, dt = gates[t], tanh_c[t], d[t]
            if not last_only:
                dhc += g[t]
            # dc += dh * o * (1 - tanh(c)^2), and o * (1 - tanh(c)^2) = o - h * tanh(c)
            np.multiply(hs[t], tc, out=scratch)
            np.subtract(a[:, 3 * H :], scratch, out=scratch)
            scratch *= dh
            dc += scratch
            np.multiply(dh, tc, out=dt[:, 3 * H :])  # do
            np.multiply(dc, a[:, 2 * H : 3 * H], out=dt[:, :H])  # di
            np.multiply(dc, _previous(cs, c0, t, seq, reverse), out=dt[:, H : 2 * H])  # df
            np.multiply(dc, a[:, :H], out=dt[:, 2 * H : 3 * H])  # dg
            dc *= a[:, H : 2 * H]
            np.subtract(1, a, out=slopes)  # s * (1 - s), then 1 - g^2 in g's columns
            slopes *= a
            g_slope = slopes[:, 2 * H : 3 * H]
            np.multiply(a[:, 2 * H : 3 * H], a[:, 2 * H : 3 * H], out=g_slope)
            np.subtract(1, g_slope, out=g_slope)
            dt *= slopes
            np.matmul(dt, w_hh.T, out=dh)
        gw = _hidden_weight_grad(hs, h0, d, reverse) if needs[1] else None
        return d, gw, dh, dc

    return _result(out, last_only, reverse), vjp


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
    xp = module_of(xw)
    seq, batch, _ = xw.shape
    dtype = np.result_type(xw, w_hh, h0, *(() if b_hh is None else (b_hh,)))
    hidden_proj = xp.empty(xw.shape, dtype)  # h_{t-1} @ w_hh + b_hh
    gates = xp.empty(xw.shape, dtype)  # r, z, n
    hs = xp.empty((seq, batch, H), dtype)
    for t in _order(seq, reverse):
        gh, a, h, x_t, h_prev = hidden_proj[t], gates[t], hs[t], xw[t], _previous(hs, h0, t, seq, reverse)
        np.matmul(h_prev, w_hh, out=gh)
        if b_hh is not None:
            gh += b_hh
        rz = a[:, : 2 * H]
        np.add(x_t[:, : 2 * H], gh[:, : 2 * H], out=rz)
        rz *= 0.5  # sigmoid(x) = (1 + tanh(x / 2)) / 2, which never overflows
        np.tanh(rz, out=rz)
        rz += 1
        rz *= 0.5
        n = a[:, 2 * H :]
        np.multiply(a[:, :H], gh[:, 2 * H :], out=n)
        n += x_t[:, 2 * H :]
        np.tanh(n, out=n)
        np.subtract(h_prev, n, out=h)  # h_t = n + z * (h_prev - n)
        h *= a[:, H : 2 * H]
        h += n

    def vjp(g, needs):
        d_in = xp.empty(xw.shape, dtype)  # the cotangent of xw's pre-activations
        d_hid = xp.empty(xw.shape, dtype)  # the cotangent of the hidden projection
        dh = _carried(g, (batch, H), dtype, last_only, xp)
        scratch = xp.empty((batch, H), dtype)
        for t in reversed(_order(seq, reverse)):
            a, gh, di, dhid = gates[t], hidden_proj[t], d_in[t], d_hid[t]
            r, z, n = a[:, :H], a[:, H : 2 * H], a[:, 2 * H :]
            dr, dz, dn = di[:, :H], di[:, H : 2 * H], di[:, 2 * H :]
            h_prev = _previous(hs, h0, t, seq, reverse)
            if not last_only:
                dh += g[t]
            # dn_pre = dh * (1 - z) * (1 - n^2)
            np.subtract(1, z, out=dn)
            dn *= dh
            np.multiply(n, n, out=scratch)
            np.subtract(1, scratch, out=scratch)
            dn *= scratch
            # dz_pre = dh * (h_prev - n) * z * (1 - z)
            np.subtract(h_prev, n, out=dz)
            dz *= dh
            dz *= z
            np.subtract(1, z, out=scratch)
            dz *= scratch
            # dr_pre = dn_pre * gh_n * r * (1 - r)
            np.multiply(dn, gh[:, 2 * H :], out=dr)
            dr *= r
            np.subtract(1, r, out=scratch)
            dr *= scratch
            dhid[:, : 2 * H] = di[:, : 2 * H]
            np.multiply(dn, r, out=dhid[:, 2 * H :])
            dh *= z
            dh += np.matmul(dhid, w_hh.T, out=scratch)
        gw = _hidden_weight_grad(hs, h0, d_hid, reverse) if needs[1] else None
        gb = d_hid.reshape(-1, 3 * H).sum(axis=0) if b_hh is not None and needs[2] else None
        return d_in, gw, gb, dh

    return _result(hs, last_only, reverse), vjp
