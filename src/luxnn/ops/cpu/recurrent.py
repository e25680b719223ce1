"""The recurrent cells' passes on the CPU (NumPy arrays), for `luxnn.ops.recurrent`.

A pass runs one GEMM per step into a preallocated buffer and applies the gate
nonlinearities and the cell update in place on it; the backward pass walks the steps in
reverse with one GEMM per step for the hidden state's cotangent and forms the weights'
gradients afterwards as GEMMs over all steps.

The LSTM makes each step's input and hidden projections one GEMM, ``[h_{t-1} | x_t | 1]
@ [w_hh; w_ih; b]``, whose left rows the pass lays out for every step beforehand (the
previous step's h lands in them), so that the backward pass forms the gradients of w_hh,
w_ih and b together as one GEMM over all steps. Its cell's pointwise work is one C pass
per step on float32 and float64 (`luxnn.ops._recurrent`), and its passes run on the
kernel threads, each taking rows of the batch for the whole sequence (see `_by_rows`).

Each ``*_forward`` returns the outputs and what its ``*_backward`` reads; see
`luxnn.ops.recurrent` for the arguments.
"""

from __future__ import annotations

import functools
import operator

import numpy as np

from ...parallel import for_blocks, matmul, num_threads
from .. import _recurrent

__all__ = ["rnn_forward", "rnn_backward", "lstm_forward", "lstm_backward", "gru_forward", "gru_backward"]


def _operand(a, dtype):
    """`a` in `dtype`, contiguous along its last axis (as the C passes read arrays)."""
    a = a.astype(dtype, copy=False)
    return np.ascontiguousarray(a) if a.ndim and a.shape[-1] > 1 and a.strides[-1] != a.itemsize else a


# A pass runs the whole sequence on each thread's own rows of the batch: no row depends on
# another, so the threads never wait for one another inside the pass (cutting each step's
# GEMM instead would make them meet at every step, a hundred times in the benchmark's).
_ROWS_PER_THREAD = 8  # at least: with fewer, a thread's GEMMs run far below the BLAS's speed
_CUT_MADDS = 1 << 22  # a pass's hidden-projection work below which one thread is faster


def _by_rows(kernel, like, madds_per_row):
    """Run ``kernel(lo, hi)`` over the rows of `like` ``(batch, ...)``: one block per
    thread, each with the BLAS on one thread, when each gets enough rows and the pass's
    GEMMs are large enough (their multiply-adds per batch row given); else one block on
    this thread."""
    batch = like.shape[0]
    parts = min(num_threads(), batch // _ROWS_PER_THREAD)
    split = parts > 1 and batch * madds_per_row >= _CUT_MADDS
    for_blocks(kernel, like, rows=-(-batch // parts) if split else max(batch, 1), blas=True)


def _order(seq, reverse):
    """The steps in the order the forward pass takes them."""
    return range(seq - 1, -1, -1) if reverse else range(seq)


def _previous(hs, h0, t, seq, reverse):
    """The hidden state step t started from: h0 at the first step taken."""
    p = t + 1 if reverse else t - 1
    return h0 if p < 0 or p == seq else hs[p]


def _carried(g, shape, dtype, last_only):
    """The cotangent carried back from step to step, before the last step taken: that
    step's output cotangent for `last_only`, else zeros (each step then adds its own)."""
    return g.astype(dtype, copy=True) if last_only else np.zeros(shape, dtype)


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


def rnn_forward(xw, w_hh, h0, dtype, activation, reverse):
    """`rnn_sequence`'s forward pass: every step's h ``(seq, batch, H)``, and what the
    backward pass reads."""
    seq = xw.shape[0]
    hs = np.empty(xw.shape, dtype)
    for t in _order(seq, reverse):
        h = hs[t]
        matmul(_previous(hs, h0, t, seq, reverse), w_hh, out=h)
        h += xw[t]
        if activation == "tanh":
            np.tanh(h, out=h)
        else:
            np.maximum(h, 0, out=h)
    return hs, (hs, w_hh, h0, activation, reverse)


def rnn_backward(saved, g, last_only, needs):
    """`rnn_sequence`'s VJP: the cotangents of (xw, w_hh, h0)."""
    hs, w_hh, h0, activation, reverse = saved
    d = np.empty_like(hs)  # the cotangent of each step's pre-activation
    dh = _carried(g, hs[0].shape, hs.dtype, last_only)
    for t in reversed(_order(hs.shape[0], reverse)):
        y, dt = hs[t], d[t]
        if not last_only:
            dh += g[t]
        if activation == "tanh":
            np.multiply(y, y, out=dt)
            np.subtract(1, dt, out=dt)
            dt *= dh
        else:
            np.multiply(dh, y > 0, out=dt)
        matmul(dt, w_hh.T, out=dh)
    gw = _hidden_weight_grad(hs, h0, d, reverse) if needs[1] else None
    return d, gw, dh


# The LSTM's passes over a block of batch rows: `_recurrent`'s, in C, step after step with
# the GIL released once, where NumPy's BLAS was found; otherwise these, the same with NumPy.
# sigmoid(x) = (1 + tanh(x / 2)) / 2, which never overflows. The derivatives come from the
# activated gates themselves (s * (1 - s), 1 - g^2): the pre-activations are not kept,
# which halves what the forward pass writes for the backward one to read.
def _lstm_forward_steps(inputs, weights, gates, out, tanh_c, c0, reverse):
    """As `_recurrent.lstm_forward_pass`: the forward pass over a block of rows. inputs
    ``(rows, seq, K)``: each step's GEMM rows ``[h_prev | x_t | 1]`` (h_prev given at the
    first step taken), weights ``(K, 4H)``; writes the activated gates ``(rows, seq, 4H)``,
    out ``(rows, seq, 2H)`` = ``[h_t | c_t]`` and tanh_c ``(rows, seq, H)``, from c0."""
    seq, H = gates.shape[1], tanh_c.shape[2]
    order = _order(seq, reverse)
    c_prev = c0
    for k, t in enumerate(order):
        a, h, c = gates[:, t], out[:, t, :H], out[:, t, H:]
        matmul(inputs[:, t], weights, out=a)
        for sig in (a[:, : 2 * H], a[:, 3 * H :]):
            sig *= 0.5
            np.tanh(sig, out=sig)
            sig += 1
            sig *= 0.5
        i, f, g, o = a[:, :H], a[:, H : 2 * H], a[:, 2 * H : 3 * H], a[:, 3 * H :]
        np.tanh(g, out=g)
        np.multiply(f, c_prev, out=c)
        np.multiply(i, g, out=h)  # i * g, with h as scratch
        c += h
        np.tanh(c, out=tanh_c[:, t])
        np.multiply(o, tanh_c[:, t], out=h)
        if k + 1 < seq:
            inputs[:, order[k + 1], :H] = h
        c_prev = c


def _lstm_backward_steps(gates, tanh_c, out, c0, g, dhc, d, weights, reverse, need_h0):
    """As `_recurrent.lstm_backward_pass`: the backward pass over a forward pass's block of
    rows. g ``(rows, seq, 2H)``, every step's output cotangent, or None; dhc ``(rows, 2H)``
    = ``[dh | dc]`` carried into the last step taken, left as (h0, c0)'s (dh only if
    `need_h0`); writes d ``(rows, seq, 4H)``, each step's pre-activation cotangent."""
    seq, H = gates.shape[1], tanh_c.shape[2]
    order = _order(seq, reverse)
    dh, dc = dhc[:, :H], dhc[:, H:]
    for k in range(seq - 1, -1, -1):
        t = order[k]
        a, tc, dt = gates[:, t], tanh_c[:, t], d[:, t]
        c_prev = c0 if k == 0 else out[:, order[k - 1], H:]
        if g is not None:
            dh += g[:, t, :H]
            dc += g[:, t, H:]
        i, f, gg, o = a[:, :H], a[:, H : 2 * H], a[:, 2 * H : 3 * H], a[:, 3 * H :]
        di, df, dg, do = dt[:, :H], dt[:, H : 2 * H], dt[:, 2 * H : 3 * H], dt[:, 3 * H :]
        np.multiply(tc, tc, out=do)  # dc += dh * o * (1 - tanh(c)^2), with do as scratch
        np.subtract(1, do, out=do)
        do *= o
        do *= dh
        dc += do
        np.multiply(dh, tc, out=do)
        np.multiply(dc, gg, out=di)
        np.multiply(dc, c_prev, out=df)
        np.multiply(dc, i, out=dg)
        dc *= f
        slopes = (1 - a) * a  # s * (1 - s), then 1 - g^2 in g's columns
        slopes[:, 2 * H : 3 * H] = 1 - gg * gg
        dt *= slopes
        if k > 0 or need_h0:
            matmul(dt, weights[:H].T, out=dh)


def _lstm_passes(dtype):
    """The (forward, backward) passes for arrays of `dtype`: C's for float32 and float64
    (with NumPy's BLAS found), NumPy's otherwise (float16 then computes in float16, as the
    RNN's and the GRU's passes do)."""
    if _recurrent.HAS_GEMM and dtype in (np.float32, np.float64):
        return _recurrent.lstm_forward_pass, _recurrent.lstm_backward_pass
    return _lstm_forward_steps, _lstm_backward_steps


def lstm_forward(x, w_ih, b, w_hh, h0, c0, dtype, reverse):
    """`lstm_sequence`'s forward pass: ``[h_t | c_t]`` ``(batch, seq, 2H)``, and what the
    backward pass reads."""
    H = w_hh.shape[0]
    batch, seq, n_in = x.shape
    h0, c0 = (_operand(a, dtype) for a in (h0, c0))
    forward_pass, _ = _lstm_passes(dtype)
    # each step's GEMM rows [h_prev | x_t | 1] (the 1 only with a bias), and the stacked weights
    width = H + n_in + (b is not None)
    inputs = np.empty((batch, seq, width), dtype)
    weights = np.concatenate([w_hh, w_ih] + ([] if b is None else [b.reshape(1, -1)])).astype(dtype, copy=False)
    gates = np.empty((batch, seq, 4 * H), dtype)  # i, f, g, o
    out = np.empty((batch, seq, 2 * H), dtype)
    tanh_c = np.empty((batch, seq, H), dtype)
    first = seq - 1 if reverse else 0

    def forward(lo, hi):
        rows = inputs[lo:hi]
        rows[:, :, H : H + n_in] = x[lo:hi]
        if b is not None:
            rows[:, :, -1] = 1
        rows[:, first, :H] = h0[lo:hi]
        forward_pass(rows, weights, gates[lo:hi], out[lo:hi], tanh_c[lo:hi], c0[lo:hi], reverse)

    _by_rows(forward, h0, seq * weights.size)
    return out, (inputs, weights, gates, out, tanh_c, c0, b is not None, reverse)


def lstm_backward(saved, g, last_only, needs):
    """`lstm_sequence`'s VJP: the cotangents of (x, w_ih, b, w_hh, h0, c0)."""
    inputs, weights, gates, out, tanh_c, c0, has_bias, reverse = saved
    batch, seq, width = inputs.shape
    H = tanh_c.shape[2]
    n_in = width - H - has_bias
    dtype = gates.dtype
    _, backward_pass = _lstm_passes(dtype)
    g = _operand(g, dtype)
    d = np.empty((batch, seq, 4 * H), dtype)  # the cotangent of each step's pre-activation
    dhc = _carried(g, (batch, 2 * H), dtype, last_only)  # [dh | dc]
    gx = np.empty((batch, seq, n_in), dtype) if needs[0] else None
    weight_grads = {}  # each block's sum over its rows and steps, by its first row

    def backward(lo, hi):
        g_block = None if last_only else g[lo:hi]
        backward_pass(gates[lo:hi], tanh_c[lo:hi], out[lo:hi], c0[lo:hi], g_block, dhc[lo:hi], d[lo:hi], weights, reverse, needs[4])
        # Then, over all of the block's steps at once (its rows are contiguous):
        d_rows = d[lo:hi].reshape(-1, 4 * H)
        if needs[0]:
            matmul(d_rows, weights[H : H + n_in].T, out=gx[lo:hi].reshape(-1, n_in))
        if any(needs[1:4]):
            weight_grads[lo] = matmul(inputs[lo:hi].reshape(-1, width).T, d_rows)  # [w_hh; w_ih; b]'s

    _by_rows(backward, c0, seq * (H * 4 * H + weights.size))
    gw_ih = gb = gw_hh = None
    if weight_grads:
        grads = functools.reduce(operator.add, (weight_grads[lo] for lo in sorted(weight_grads)))
        gw_hh, gw_ih, gb = grads[:H], grads[H : H + n_in], grads[-1] if has_bias else None
    return gx, gw_ih, gb, gw_hh, dhc[:, :H], dhc[:, H:]


def gru_forward(xw, w_hh, b_hh, h0, dtype, reverse):
    """`gru_sequence`'s forward pass: every step's h ``(seq, batch, H)``, and what the
    backward pass reads."""
    seq, batch, _ = xw.shape
    H = w_hh.shape[0]
    hidden_proj = np.empty(xw.shape, dtype)  # h_{t-1} @ w_hh + b_hh
    gates = np.empty(xw.shape, dtype)  # r, z, n
    hs = np.empty((seq, batch, H), dtype)
    for t in _order(seq, reverse):
        gh, a, h, x_t, h_prev = hidden_proj[t], gates[t], hs[t], xw[t], _previous(hs, h0, t, seq, reverse)
        matmul(h_prev, w_hh, out=gh)
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
    return hs, (hs, hidden_proj, gates, w_hh, h0, b_hh is not None, reverse)


def gru_backward(saved, g, last_only, needs):
    """`gru_sequence`'s VJP: the cotangents of (xw, w_hh, b_hh, h0)."""
    hs, hidden_proj, gates, w_hh, h0, has_bias, reverse = saved
    seq, batch, H = hs.shape
    dtype = hs.dtype
    d_in = np.empty(gates.shape, dtype)  # the cotangent of xw's pre-activations
    d_hid = np.empty(gates.shape, dtype)  # the cotangent of the hidden projection
    dh = _carried(g, (batch, H), dtype, last_only)
    scratch = np.empty((batch, H), dtype)
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
        dh += matmul(dhid, w_hh.T, out=scratch)
    gw = _hidden_weight_grad(hs, h0, d_hid, reverse) if needs[1] else None
    gb = d_hid.reshape(-1, 3 * H).sum(axis=0) if has_bias and needs[2] else None
    return d_in, gw, gb, dh
