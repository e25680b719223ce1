"""The recurrent cells' passes on CUDA (CuPy arrays), for `luxnn.ops.recurrent`, in the
design of PyTorch's non-cuDNN fused cells (``_thnn_fused_lstm_cell``) and Chainer's
``lstm_fwd`` / ``lstm_bwd``:

- forward: one GEMM for the input projection of every step (the LSTM's; the RNN's and the
  GRU's come projected), then per step one GEMM ``h_{t-1} @ w_hh`` and one fused kernel
  that applies the gates' nonlinearities, makes the new cell and hidden state, and keeps
  the activated gates for the backward pass;
- backward: per step one fused kernel for the gates' cotangents (the step's output
  cotangent added in) and one GEMM for the hidden state's, ``d_t @ w_hh^T``; then the
  weights' gradients as one GEMM each over all steps.

Every step's h sits in one time-major buffer ``(seq + 1, batch, H)`` with h0 beside them
(`_states`), so the h each step started from is one slice: the next step's GEMM operand,
and the left operand of w_hh's gradient. The whole batch runs at once, whatever the host's
threads. float16 arrays compute in float32 (their gates and GEMMs), rounded back at the end.

Each kernel is declared with its NumPy twin, which computes the same in the same order.
"""

from __future__ import annotations

import numpy as np

from ...backend import module_of
from ...kernels import Elementwise
from . import gemm

__all__ = ["rnn_forward", "rnn_backward", "lstm_forward", "lstm_backward", "gru_forward", "gru_backward"]

# sigmoid(x) = (1 + tanh(x / 2)) / 2, which never overflows.
_SIGMOID = "template <typename T> __device__ T luxnn_sigmoid(T x) { return (T)0.5 * tanh((T)0.5 * x) + (T)0.5; }\n"


def _sigmoid(a):
    return 0.5 * np.tanh(0.5 * a) + 0.5


def _blocks(a, count):
    """The `count` gate blocks ``(batch, H)`` of `a` ``(batch, count * H)``."""
    H = a.shape[1] // count
    return [a[:, k * H : (k + 1) * H] for k in range(count)]


def _set_blocks(a, *values):
    """Writes `values`, one per gate block, into `a` ``(batch, len(values) * H)``."""
    for block, value in zip(_blocks(a, len(values)), values, strict=True):
        block[...] = value


# The kernels run over (batch, H): thread i takes row i / H, column i % H, and reads and
# writes that column of each gate block of the (batch, G * H) arrays, passed raw.


def _lstm_cell_twin(hidden, c_prev, gates, c, h, h_next):
    a = gates + hidden
    i, f, g, o = _blocks(a, 4)
    i, f, g, o = _sigmoid(i), _sigmoid(f), np.tanh(g), _sigmoid(o)
    _set_blocks(gates, i, f, g, o)
    c[...] = f * c_prev + i * g
    h[...] = o * np.tanh(c)
    h_next[...] = h


# An LSTM step: `gates` holds x_t @ w_ih + b, `hidden` h_{t-1} @ w_hh; writes the activated
# gates i, f, g, o over `gates`, c_t and h_t (into the output and into the next GEMM's rows).
LSTM_CELL = Elementwise(
    "luxnn_lstm_cell",
    "raw T hidden, T c_prev",
    "raw T gates, T c, T h, T h_next",
    """
    const ptrdiff_t H = gates.shape()[1] / 4, at = i + i / H * 3 * H;
    const T gi = luxnn_sigmoid(gates[at] + hidden[at]);
    const T gf = luxnn_sigmoid(gates[at + H] + hidden[at + H]);
    const T gg = tanh(gates[at + 2 * H] + hidden[at + 2 * H]);
    const T go = luxnn_sigmoid(gates[at + 3 * H] + hidden[at + 3 * H]);
    gates[at] = gi;
    gates[at + H] = gf;
    gates[at + 2 * H] = gg;
    gates[at + 3 * H] = go;
    c = gf * c_prev + gi * gg;
    h = go * tanh(c);
    h_next = h;
    """,
    twin=_lstm_cell_twin,
    preamble=_SIGMOID,
)


def _lstm_cell_backward_twin(gates, c_prev, c, dh, dc, g_h, g_c, d, dc_prev):
    i, f, g, o = _blocks(gates, 4)
    dh_t = dh + g_h
    tc = np.tanh(c)
    dc_t = dc + g_c + dh_t * o * (1 - tc * tc)
    _set_blocks(d, dc_t * g * i * (1 - i), dc_t * c_prev * f * (1 - f), dc_t * i * (1 - g * g), dh_t * tc * o * (1 - o))
    dc_prev[...] = dc_t * f


# An LSTM step backward: from the activated gates, c_{t-1} and c_t, the cotangents carried
# into the step (dh, dc) and the step's output cotangent (g_h, g_c), writes the gates'
# pre-activation cotangents d and the cotangent of c_{t-1}.
LSTM_CELL_BACKWARD = Elementwise(
    "luxnn_lstm_cell_backward",
    "raw T gates, T c_prev, T c, T dh, T dc, T g_h, T g_c",
    "raw T d, T dc_prev",
    """
    const ptrdiff_t H = gates.shape()[1] / 4, at = i + i / H * 3 * H;
    const T gi = gates[at], gf = gates[at + H], gg = gates[at + 2 * H], go = gates[at + 3 * H];
    const T dh_t = dh + g_h;
    const T tc = tanh(c);
    const T dc_t = dc + g_c + dh_t * go * ((T)1 - tc * tc);
    d[at] = dc_t * gg * gi * ((T)1 - gi);
    d[at + H] = dc_t * c_prev * gf * ((T)1 - gf);
    d[at + 2 * H] = dc_t * gi * ((T)1 - gg * gg);
    d[at + 3 * H] = dh_t * tc * go * ((T)1 - go);
    dc_prev = dc_t * gf;
    """,
    twin=_lstm_cell_backward_twin,
)


def _gru_cell_twin(xw, b_hh, h_prev, hidden, gates, h):
    hidden += b_hh
    x_r, x_z, x_n = _blocks(xw, 3)
    h_r, h_z, h_n = _blocks(hidden, 3)
    r, z = _sigmoid(x_r + h_r), _sigmoid(x_z + h_z)
    n = np.tanh(r * h_n + x_n)
    _set_blocks(gates, r, z, n)
    h[...] = (h_prev - n) * z + n


# A GRU step: `xw` holds x_t @ w_ih + b_ih, `hidden` h_{t-1} @ w_hh, to which it adds b_hh;
# writes the gates r, z, n and h_t.
GRU_CELL = Elementwise(
    "luxnn_gru_cell",
    "raw T xw, raw T b_hh, T h_prev",
    "raw T hidden, raw T gates, T h",
    """
    const ptrdiff_t H = gates.shape()[1] / 3, col = i % H, at = i + i / H * 2 * H;
    const T hr = hidden[at] + b_hh[col], hz = hidden[at + H] + b_hh[col + H], hn = hidden[at + 2 * H] + b_hh[col + 2 * H];
    hidden[at] = hr;
    hidden[at + H] = hz;
    hidden[at + 2 * H] = hn;
    const T r = luxnn_sigmoid(xw[at] + hr), z = luxnn_sigmoid(xw[at + H] + hz);
    const T n = tanh(r * hn + xw[at + 2 * H]);
    gates[at] = r;
    gates[at + H] = z;
    gates[at + 2 * H] = n;
    h = (h_prev - n) * z + n;
    """,
    twin=_gru_cell_twin,
    preamble=_SIGMOID,
)


def _gru_cell_backward_twin(gates, hidden, h_prev, dh_direct, dh_hidden, g, d_in, d_hid, dh_direct_prev):
    r, z, n = _blocks(gates, 3)
    dh = dh_direct + dh_hidden + g
    dn = (1 - z) * dh * (1 - n * n)
    dz = (h_prev - n) * dh * z * (1 - z)
    dr = dn * _blocks(hidden, 3)[2] * r * (1 - r)
    _set_blocks(d_in, dr, dz, dn)
    _set_blocks(d_hid, dr, dz, dn * r)
    dh_direct_prev[...] = dh * z


# A GRU step backward: the cotangent of h_t is dh_direct (the part of the next step's that
# went through z) + dh_hidden (through the next step's GEMM) + g (the step's output's);
# writes the cotangents of xw's pre-activations (d_in) and of the hidden projection
# (d_hid), and the part of h_{t-1}'s that goes through z.
GRU_CELL_BACKWARD = Elementwise(
    "luxnn_gru_cell_backward",
    "raw T gates, raw T hidden, T h_prev, T dh_direct, T dh_hidden, T g",
    "raw T d_in, raw T d_hid, T dh_direct_prev",
    """
    const ptrdiff_t H = gates.shape()[1] / 3, at = i + i / H * 2 * H;
    const T r = gates[at], z = gates[at + H], n = gates[at + 2 * H];
    const T dh = dh_direct + dh_hidden + g;
    const T dn = ((T)1 - z) * dh * ((T)1 - n * n);
    const T dz = (h_prev - n) * dh * z * ((T)1 - z);
    const T dr = dn * hidden[at + 2 * H] * r * ((T)1 - r);
    d_in[at] = dr;
    d_in[at + H] = dz;
    d_in[at + 2 * H] = dn;
    d_hid[at] = dr;
    d_hid[at + H] = dz;
    d_hid[at + 2 * H] = dn * r;
    dh_direct_prev = dh * z;
    """,
    twin=_gru_cell_backward_twin,
)


def _rnn_cell_twin(xw, relu, h):
    a = h + xw
    h[...] = np.where(a < 0, 0, a) if relu else np.tanh(a)


# An Elman step: h holds h_{t-1} @ w_hh; h_t = act(h + x_t @ w_ih + b), act relu or tanh.
RNN_CELL = Elementwise(
    "luxnn_rnn_cell",
    "T xw, bool relu",
    "T h",
    """
    const T a = h + xw;
    h = relu ? (a < (T)0 ? (T)0 : a) : tanh(a);
    """,
    twin=_rnn_cell_twin,
)


def _rnn_cell_backward_twin(y, dh, g, relu, d):
    dh_t = dh + g
    d[...] = dh_t * (y > 0) if relu else (1 - y * y) * dh_t


# An Elman step backward: the cotangent of the pre-activation from h_t (y) and h_t's
# cotangent, carried (dh) and the step's output's (g).
RNN_CELL_BACKWARD = Elementwise(
    "luxnn_rnn_cell_backward",
    "T y, T dh, T g, bool relu",
    "T d",
    """
    const T dh_t = dh + g;
    d = relu ? dh_t * (T)(y > (T)0) : ((T)1 - y * y) * dh_t;
    """,
    twin=_rnn_cell_backward_twin,
)


# -- the passes ----------------------------------------------------------------------------


def _order(seq, reverse):
    """The steps in the order the forward pass takes them."""
    return range(seq - 1, -1, -1) if reverse else range(seq)


def _working(dtype):
    """The dtype the passes compute in: float16's is float32."""
    return np.promote_types(dtype, np.float32)


def _states(h0, seq, reverse):
    """The buffer ``(seq + 1, batch, H)`` of every step's h, h0 stored in it, and `shift`:
    step t's h sits at ``t + shift``, the h it started from at ``t + 1 - shift`` (h0 first,
    or last in reverse), so that ``hs[shift : shift + seq]`` are the outputs and
    ``hs[1 - shift : 1 - shift + seq]`` the states each step started from."""
    batch, H = h0.shape
    hs = module_of(h0).empty((seq + 1, batch, H), h0.dtype)
    hs[seq if reverse else 0] = h0
    return hs, 0 if reverse else 1


def _weight_grad(hs, shift, d):
    """``sum_t h_{t-1}^T @ d[t]``, w_hh's gradient from every step's cotangent `d` ``(seq,
    batch, G)``: one GEMM over all steps."""
    seq, batch, G = d.shape
    before = hs[1 - shift : 1 - shift + seq].reshape(seq * batch, hs.shape[2])
    return gemm.matmul(before.T, d.reshape(seq * batch, G))


def _seeds(g, last_only, work):
    """(the cotangent carried into the last step taken, step t's output cotangent): g and
    zeros for `last_only`, else zeros and ``g[t]``. `g` is time-major."""
    g = g.astype(work, copy=False)
    zero = module_of(g).zeros((), work)
    if last_only:
        return g, lambda t: zero
    return zero, lambda t: g[t]


def _halves(a, H):
    """The parts of h and of c of an LSTM's cotangent ``[dh | dc]`` (a scalar's: itself twice)."""
    return (a, a) if a.ndim == 0 else (a[:, :H], a[:, H:])


def _cast(a, dtype):
    return None if a is None else a.astype(dtype, copy=False)


def rnn_forward(xw, w_hh, h0, dtype, activation, reverse):
    """`rnn_sequence`'s forward pass: every step's h ``(seq, batch, H)``, and what the
    backward pass reads."""
    work, seq = _working(dtype), xw.shape[0]
    xw, w_hh, h0 = (_cast(a, work) for a in (xw, w_hh, h0))
    hs, shift = _states(h0, seq, reverse)
    relu = activation == "relu"
    for t in _order(seq, reverse):
        h = hs[t + shift]
        gemm.matmul(hs[t + 1 - shift], w_hh, out=h)
        RNN_CELL(xw[t], relu, h)
    return _cast(hs[shift : shift + seq], dtype), (hs, shift, w_hh, relu, reverse, dtype)


def rnn_backward(saved, g, last_only, needs):
    """`rnn_sequence`'s VJP: the cotangents of (xw, w_hh, h0)."""
    hs, shift, w_hh, relu, reverse, dtype = saved
    xp, seq = module_of(hs), hs.shape[0] - 1
    d = xp.empty((seq, *hs.shape[1:]), hs.dtype)  # the cotangent of each step's pre-activation
    dh = xp.empty(hs.shape[1:], hs.dtype)
    carried, step_g = _seeds(g, last_only, hs.dtype)
    for k, t in enumerate(reversed(_order(seq, reverse))):
        RNN_CELL_BACKWARD(hs[t + shift], carried, step_g(t), relu, d[t])
        if k + 1 < seq or needs[2]:
            gemm.matmul(d[t], w_hh.T, out=dh)
            carried = dh
    gw = _weight_grad(hs, shift, d) if needs[1] else None
    return _cast(d, dtype), _cast(gw, dtype), _cast(dh, dtype) if needs[2] else None


def lstm_forward(x, w_ih, b, w_hh, h0, c0, dtype, reverse):
    """`lstm_sequence`'s forward pass: ``[h_t | c_t]`` ``(batch, seq, 2H)``, and what the
    backward pass reads."""
    xp, work = module_of(x), _working(dtype)
    x, w_ih, b, w_hh, h0, c0 = (_cast(a, work) for a in (x, w_ih, b, w_hh, h0, c0))
    batch, seq, n_in = x.shape
    H = w_hh.shape[0]
    # every step's input projection, time-major: the GEMM's rows are w_ih's gradient's too
    x_rows = xp.ascontiguousarray(x.transpose(1, 0, 2)).reshape(seq * batch, n_in)
    gates = gemm.matmul(x_rows, w_ih).reshape(seq, batch, 4 * H)
    if b is not None:
        gates += b
    hs, shift = _states(h0, seq, reverse)
    out = xp.empty((seq, batch, 2 * H), work)  # [h_t | c_t]
    hidden = xp.empty((batch, 4 * H), work)
    order = _order(seq, reverse)
    for k, t in enumerate(order):
        gemm.matmul(hs[t + 1 - shift], w_hh, out=hidden)
        c_prev = out[order[k - 1], :, H:] if k else c0
        LSTM_CELL(hidden, c_prev, gates[t], out[t, :, H:], out[t, :, :H], hs[t + shift])
    saved = (gates, out, hs, shift, x_rows, c0, w_ih, w_hh, b is not None, reverse, dtype)
    return _cast(out.transpose(1, 0, 2), dtype), saved


def lstm_backward(saved, g, last_only, needs):
    """`lstm_sequence`'s VJP: the cotangents of (x, w_ih, b, w_hh, h0, c0)."""
    gates, out, hs, shift, x_rows, c0, w_ih, w_hh, has_bias, reverse, dtype = saved
    xp, (seq, batch, G), H = module_of(gates), gates.shape, w_hh.shape[0]
    work = gates.dtype
    d = xp.empty_like(gates)  # the cotangent of each step's pre-activation
    dh, dc = xp.empty((batch, H), work), xp.empty((batch, H), work)
    carried, step_g = _seeds(g if last_only else g.transpose(1, 0, 2), last_only, work)
    carried_h, carried_c = _halves(carried, H)
    order = _order(seq, reverse)
    for k in range(seq - 1, -1, -1):
        t = order[k]
        g_h, g_c = _halves(step_g(t), H)
        c_prev = out[order[k - 1], :, H:] if k else c0
        LSTM_CELL_BACKWARD(gates[t], c_prev, out[t, :, H:], carried_h, carried_c, g_h, g_c, d[t], dc)
        carried_c = dc
        if k or needs[4]:
            gemm.matmul(d[t], w_hh.T, out=dh)
            carried_h = dh
    rows = d.reshape(seq * batch, G)
    gx = gemm.matmul(rows, w_ih.T).reshape(seq, batch, x_rows.shape[1]).transpose(1, 0, 2) if needs[0] else None
    gw_ih = gemm.matmul(x_rows.T, rows) if needs[1] else None
    gb = rows.sum(axis=0) if has_bias and needs[2] else None
    gw_hh = _weight_grad(hs, shift, d) if needs[3] else None
    dh0, dc0 = (dh if needs[4] else None), (dc if needs[5] else None)
    return tuple(_cast(a, dtype) for a in (gx, gw_ih, gb, gw_hh, dh0, dc0))


def gru_forward(xw, w_hh, b_hh, h0, dtype, reverse):
    """`gru_sequence`'s forward pass: every step's h ``(seq, batch, H)``, and what the
    backward pass reads."""
    xp, work, seq = module_of(xw), _working(dtype), xw.shape[0]
    xw, w_hh, b_hh, h0 = (_cast(a, work) for a in (xw, w_hh, b_hh, h0))
    bias = xp.zeros(xw.shape[2], work) if b_hh is None else b_hh
    hs, shift = _states(h0, seq, reverse)
    hidden = xp.empty(xw.shape, work)  # h_{t-1} @ w_hh + b_hh
    gates = xp.empty(xw.shape, work)  # r, z, n
    for t in _order(seq, reverse):
        h_prev = hs[t + 1 - shift]
        gemm.matmul(h_prev, w_hh, out=hidden[t])
        GRU_CELL(xw[t], bias, h_prev, hidden[t], gates[t], hs[t + shift])
    return _cast(hs[shift : shift + seq], dtype), (hs, shift, hidden, gates, w_hh, b_hh is not None, reverse, dtype)


def gru_backward(saved, g, last_only, needs):
    """`gru_sequence`'s VJP: the cotangents of (xw, w_hh, b_hh, h0)."""
    hs, shift, hidden, gates, w_hh, has_bias, reverse, dtype = saved
    xp, (seq, batch, G), work = module_of(hs), gates.shape, hs.dtype
    d_in, d_hid = xp.empty_like(gates), xp.empty_like(gates)
    direct, through = xp.empty((batch, G // 3), work), xp.empty((batch, G // 3), work)
    carried_direct, step_g = _seeds(g, last_only, work)
    carried_through = xp.zeros((), work)
    for k, t in enumerate(reversed(_order(seq, reverse))):
        GRU_CELL_BACKWARD(gates[t], hidden[t], hs[t + 1 - shift], carried_direct, carried_through, step_g(t),
                          d_in[t], d_hid[t], direct)
        carried_direct = direct
        if k + 1 < seq or needs[3]:
            gemm.matmul(d_hid[t], w_hh.T, out=through)
            carried_through = through
    gw = _weight_grad(hs, shift, d_hid) if needs[1] else None
    gb = d_hid.reshape(seq * batch, G).sum(axis=0) if has_bias and needs[2] else None
    dh0 = direct + through if needs[3] else None
    return tuple(_cast(a, dtype) for a in (d_in, gw, gb, dh0))
