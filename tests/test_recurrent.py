"""Recurrent layers: the cells, Recurrence and Bidirectional against torch.nn.RNN/LSTM/GRU in
float64 (weights copied over by a transpose), the fused primitives' VJPs against finite
differences, bad input, and a model that learns."""

from __future__ import annotations

import numpy as np
import pytest

import luxnn as lx
import luxnn.ops.cpu.recurrent as rec
from luxnn.ops import _recurrent
from luxnn.ops.recurrent import gru_sequence, lstm_sequence, rnn_sequence
from test_ad_primitives import check_grad  # the one finite-difference checker

KINDS = ["rnn_tanh", "rnn_relu", "lstm", "gru"]


def make_cell(kind, in_dims, hidden, **kw):
    if kind.startswith("rnn"):
        return lx.RNNCell(in_dims, hidden, kind.split("_")[1], **kw)
    return {"lstm": lx.LSTMCell, "gru": lx.GRUCell}[kind](in_dims, hidden, **kw)


def torch_module(torch, kind, in_dims, hidden, **kw):
    if kind.startswith("rnn"):
        return torch.nn.RNN(in_dims, hidden, nonlinearity=kind.split("_")[1], batch_first=True, dtype=torch.float64, **kw)
    return {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](in_dims, hidden, batch_first=True, dtype=torch.float64, **kw)


def copied(module, suffix="_l0"):
    """Our parameters of a torch RNN module's layer (its weights are (G * hidden, in))."""
    ps = {f"weight_{k}": getattr(module, f"weight_{k}{suffix}").detach().numpy().T.copy() for k in ("ih", "hh")}
    if module.bias:
        ps.update({f"bias_{k}": getattr(module, f"bias_{k}{suffix}").detach().numpy().copy() for k in ("ih", "hh")})
    return ps


def torch_grads(module, suffix="_l0"):
    grads = {f"weight_{k}": getattr(module, f"weight_{k}{suffix}").grad.numpy().T for k in ("ih", "hh")}
    if module.bias:
        grads.update({f"bias_{k}": getattr(module, f"bias_{k}{suffix}").grad.numpy() for k in ("ih", "hh")})
    return grads


def assert_close(got, want, what):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1e-12)
    assert float(np.abs(got - want).max()) / scale < 1e-6, what


def value_and_grads(model, ps, x, weights):
    """Our ``sum(model(x) * weights)`` and its gradients with respect to (ps, x)."""
    st = lx.setup(np.random.default_rng(0), model)[1]
    return lx.value_and_grad(lambda p, x: (model(x, p, st)[0] * weights).sum(), argnums=(0, 1))(ps, x)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", [0, 1])
def test_recurrence_matches_torch(torch, kind, seed):
    rng = np.random.default_rng(seed)
    batch, seq, in_dims, hidden = (int(n) for n in rng.integers(1, 7, 4))
    x = rng.normal(size=(batch, seq, in_dims))
    module = torch_module(torch, kind, in_dims, hidden)
    tx = torch.tensor(x, requires_grad=True)
    outputs = module(tx)[0]
    for return_sequence in (True, False):
        model = lx.Recurrence(make_cell(kind, in_dims, hidden), return_sequence=return_sequence)
        want = outputs if return_sequence else outputs[:, -1]
        weights = rng.normal(size=want.shape)
        module.zero_grad()
        tx.grad = None
        (want * torch.tensor(weights)).sum().backward(retain_graph=True)
        value, (grads, gx) = value_and_grads(model, {"cell": copied(module)}, x, weights)
        y = model(x, {"cell": copied(module)}, {"cell": {}})[0]
        assert_close(y, want.detach().numpy(), "output")
        assert_close(gx, tx.grad.numpy(), "input gradient")
        for name, g in torch_grads(module).items():
            assert_close(grads["cell"][name], g, name)


@pytest.mark.parametrize("kind", KINDS)
def test_reverse_is_the_backward_direction_of_torch_bidirectional(torch, kind):
    rng = np.random.default_rng(2)
    batch, seq, in_dims, hidden = 3, 6, 4, 5
    x = rng.normal(size=(batch, seq, in_dims))
    module = torch_module(torch, kind, in_dims, hidden, bidirectional=True)
    tx = torch.tensor(x, requires_grad=True)
    out = module(tx)[0]
    model = lx.Bidirectional(make_cell(kind, in_dims, hidden), make_cell(kind, in_dims, hidden))
    ps = {"forward": {"cell": copied(module)}, "backward": {"cell": copied(module, "_l0_reverse")}}
    weights = rng.normal(size=out.shape)
    (out * torch.tensor(weights)).sum().backward()
    _, (grads, gx) = value_and_grads(model, ps, x, weights)
    st = lx.setup(np.random.default_rng(0), model)[1]
    assert_close(model(x, ps, st)[0], out.detach().numpy(), "output")
    assert_close(gx, tx.grad.numpy(), "input gradient")
    for direction, suffix in (("forward", "_l0"), ("backward", "_l0_reverse")):
        for name, g in torch_grads(module, suffix).items():
            assert_close(grads[direction]["cell"][name], g, f"{direction} {name}")
    # the last outputs: forward at the end, backward at position 0 (torch's h_n)
    last = lx.Bidirectional(make_cell(kind, in_dims, hidden), make_cell(kind, in_dims, hidden), return_sequence=False)
    h_n = module(torch.tensor(x))[1]
    h_n = h_n[0] if kind == "lstm" else h_n
    y = last(x, ps, st)[0]
    assert_close(y, torch.cat([h_n[0], h_n[1]], dim=-1).detach().numpy(), "last outputs")


def test_bidirectional_merges():
    x = np.random.default_rng(3).normal(size=(2, 4, 3)).astype(np.float32)
    fwd, bwd = lx.Recurrence(lx.GRUCell(3, 5), return_sequence=True), lx.Recurrence(lx.GRUCell(3, 5), return_sequence=True, reverse=True)
    ps_f, ps_b = lx.setup(np.random.default_rng(0), fwd)[0], lx.setup(np.random.default_rng(1), bwd)[0]
    f, b = fwd(x, ps_f, {"cell": {}})[0], bwd(x, ps_b, {"cell": {}})[0]
    ps = {"forward": ps_f, "backward": ps_b}
    for merge, want in (("sum", f + b), ("mean", (f + b) / 2), ("mul", f * b), (lambda f, b: f - b, f - b)):
        model = lx.Bidirectional(lx.GRUCell(3, 5), lx.GRUCell(3, 5), merge=merge)
        np.testing.assert_allclose(model(x, ps, lx.setup(np.random.default_rng(0), model)[1])[0], want, rtol=1e-6)


def test_stacked_recurrences_match_torch_two_layers(torch):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(3, 7, 4))
    module = torch.nn.LSTM(4, 6, num_layers=2, batch_first=True, dtype=torch.float64)
    model = lx.Chain(lx.Recurrence(lx.LSTMCell(4, 6), return_sequence=True), lx.Recurrence(lx.LSTMCell(6, 6), return_sequence=True))
    ps = {"layer_1": {"cell": copied(module, "_l0")}, "layer_2": {"cell": copied(module, "_l1")}}
    st = lx.setup(np.random.default_rng(0), model)[1]
    assert_close(model(x, ps, st)[0], module(torch.tensor(x))[0].detach().numpy(), "output")


@pytest.mark.parametrize("kind", KINDS)
def test_cell_steps_match_torch_cells(torch, kind):
    rng = np.random.default_rng(5)
    batch, in_dims, hidden = 4, 3, 5
    torch_cell = {"lstm": torch.nn.LSTMCell, "gru": torch.nn.GRUCell}.get(kind)
    if torch_cell is None:
        torch_cell = lambda i, h, **kw: torch.nn.RNNCell(i, h, nonlinearity=kind.split("_")[1], **kw)  # noqa: E731
    module = torch_cell(in_dims, hidden, dtype=torch.float64)
    ps = {"weight_ih": module.weight_ih.detach().numpy().T.copy(), "weight_hh": module.weight_hh.detach().numpy().T.copy(),
          "bias_ih": module.bias_ih.detach().numpy().copy(), "bias_hh": module.bias_hh.detach().numpy().copy()}  # fmt: skip
    cell = make_cell(kind, in_dims, hidden)
    xs = rng.normal(size=(3, batch, in_dims))
    carry, state = None, None
    for x_t in xs:
        (h, carry), _ = cell(x_t if carry is None else (x_t, carry), ps, {})
        tx = torch.tensor(x_t)
        state = module(tx) if state is None else module(tx, state)
        want = state[0] if kind == "lstm" else state
        assert_close(h, want.detach().numpy(), "h")
    if kind == "lstm":
        assert_close(carry[1], state[1].detach().numpy(), "c")


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_no_bias_and_trainable_initial_carry_match_torch(torch, kind):
    rng = np.random.default_rng(6)
    batch, seq, in_dims, hidden = 3, 4, 2, 5
    x = rng.normal(size=(batch, seq, in_dims))
    module = torch_module(torch, kind, in_dims, hidden, bias=False)
    model = lx.Recurrence(make_cell(kind, in_dims, hidden, use_bias=False, init_carry="trainable"), return_sequence=True)
    ps = lx.setup(np.random.default_rng(0), model)[0]
    assert sorted(ps["cell"]) == sorted(["weight_ih", "weight_hh", "h0"] + (["c0"] if kind == "lstm" else []))
    ps = {"cell": {**copied(module), **{k: rng.normal(size=hidden) for k in ps["cell"] if k in ("h0", "c0")}}}
    carry = [torch.tensor(ps["cell"][k], requires_grad=True) for k in ("h0", "c0") if k in ps["cell"]]
    expanded = tuple(c.expand(1, batch, hidden) for c in carry)
    out = module(torch.tensor(x), expanded if kind == "lstm" else expanded[0])[0]
    weights = rng.normal(size=out.shape)
    (out * torch.tensor(weights)).sum().backward()
    _, (grads, _) = value_and_grads(model, ps, x, weights)
    assert_close(model(x, ps, {"cell": {}})[0], out.detach().numpy(), "output")
    for name, c in zip(("h0", "c0"), carry):
        assert_close(grads["cell"][name], c.grad.numpy(), name)
    for name, g in torch_grads(module).items():
        assert_close(grads["cell"][name], g, name)


# -- the primitives' VJPs against finite differences ---------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_primitive_vjps_match_finite_differences(reverse, batch):
    r = np.random.default_rng(7)
    seq, hidden = 3, 2
    h0, c0 = r.normal(size=(batch, hidden)), r.normal(size=(batch, hidden))
    for activation in ("tanh", "relu"):
        xw = r.normal(size=(seq, batch, hidden))
        xw = np.sign(xw) * (0.2 + np.abs(xw))  # away from relu's kink
        check_grad(lambda xw, w, h0: rnn_sequence(xw, w, h0, activation=activation, reverse=reverse, last_only=activation == "relu"), xw, r.normal(size=(hidden, hidden)) * 0.3, h0)
    for last_only in (False, True):
        x, w_ih, b = r.normal(size=(batch, seq, 3)), r.normal(size=(3, 4 * hidden)), r.normal(size=4 * hidden)
        check_grad(lambda *a: lstm_sequence(*a, reverse=reverse, last_only=last_only), x, w_ih, b, r.normal(size=(hidden, 4 * hidden)), h0, c0)
    check_grad(lambda x, w_ih, w_hh, h0, c0: lstm_sequence(x, w_ih, None, w_hh, h0, c0, reverse=reverse), x, w_ih, r.normal(size=(hidden, 4 * hidden)), h0, c0)
    check_grad(lambda *a: gru_sequence(*a, reverse=reverse), r.normal(size=(seq, batch, 3 * hidden)), r.normal(size=(hidden, 3 * hidden)), r.normal(size=3 * hidden), h0)
    check_grad(lambda xw, w, h0: gru_sequence(xw, w, None, h0, reverse=reverse, last_only=True), r.normal(size=(seq, batch, 3 * hidden)), r.normal(size=(hidden, 3 * hidden)), h0)


def test_primitives_reject_mismatched_shapes():
    with pytest.raises(ValueError, match=r"lstm_sequence: expected x \(batch, seq >= 1, in\), w_ih \(in, 4 \* H\).*got shapes \[\(2, 3, 5\), \(5, 6\), None, \(2, 8\)"):
        lstm_sequence(np.ones((2, 3, 5)), np.ones((5, 6)), None, np.ones((2, 8)), np.ones((2, 2)), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"got shapes .*\(7,\), \(2, 8\), \(2, 2\), \(3, 2\)\]"):
        lstm_sequence(np.ones((2, 3, 5)), np.ones((5, 8)), np.ones(7), np.ones((2, 8)), np.ones((2, 2)), np.ones((3, 2)))
    with pytest.raises(ValueError, match="activation must be 'tanh' or 'relu'"):
        rnn_sequence(np.ones((1, 2, 2)), np.ones((2, 2)), np.ones((2, 2)), activation="gelu")
    with pytest.raises(ValueError, match=r"expected b_hh of shape \(6,\), got \(5,\)"):
        gru_sequence(np.ones((1, 2, 6)), np.ones((2, 6)), np.ones(5), np.ones((2, 2)))


# -- the LSTM's C cell kernels and its passes split over threads -----------------------------


def pass_operands(r, rows, seq, hidden, K, dtype):
    """Random operands of the passes over a block of rows, each a view into a larger
    buffer (strides as a block of a batch has)."""
    def block(*shape, scale=1.0):
        return (r.normal(size=(rows + 2, *shape)) * scale).astype(dtype)[1:-1]

    return {
        "inputs": block(seq, K), "weights": (r.normal(size=(K, 4 * hidden)) * 0.5).astype(dtype),
        "c0": np.broadcast_to(r.normal(size=hidden).astype(dtype), (rows, hidden)), "g": block(seq, 2 * hidden),
        "dhc": block(2 * hidden),
    }  # fmt: skip


def run_passes(forward, backward, ops, reverse, with_g):
    """Both passes on copies of `ops`; every array they write."""
    inputs, dhc = ops["inputs"].copy(), ops["dhc"].copy()
    rows, seq, _ = inputs.shape
    hidden, dtype = ops["weights"].shape[1] // 4, inputs.dtype
    gates, out, tanh_c = (np.empty((rows, seq, n), dtype) for n in (4 * hidden, 2 * hidden, hidden))
    forward(inputs, ops["weights"], gates, out, tanh_c, ops["c0"], reverse)
    d = np.empty_like(gates)
    backward(gates, tanh_c, out, ops["c0"], ops["g"] if with_g else None, dhc, d, ops["weights"], reverse, True)
    return {"inputs": inputs, "gates": gates, "out": out, "tanh_c": tanh_c, "d": d, "dhc": dhc}


@pytest.mark.parametrize("rows, seq, hidden, K", [(1, 1, 1, 2), (5, 3, 3, 7), (4, 6, 17, 20), (3, 2, 64, 64)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_g", [False, True])
def test_c_passes_match_the_array_passes(rows, seq, hidden, K, reverse, with_g):
    """The C passes against the NumPy ones: float64 to rounding, and
    float32 (its own tanh) against float64 within float32's precision."""
    ops64 = pass_operands(np.random.default_rng(rows * 100 + hidden), rows, seq, hidden, K, np.float64)
    want = run_passes(rec._lstm_forward_steps, rec._lstm_backward_steps, ops64, reverse, with_g)
    got = run_passes(_recurrent.lstm_forward_pass, _recurrent.lstm_backward_pass, ops64, reverse, with_g)
    ops32 = {k: v.astype(np.float32) for k, v in ops64.items()}
    ops32["c0"] = np.broadcast_to(ops64["c0"][0].astype(np.float32), ops64["c0"].shape)  # broadcast, as float64's
    got32 = run_passes(_recurrent.lstm_forward_pass, _recurrent.lstm_backward_pass, ops32, reverse, with_g)
    for name, w in want.items():
        scale = max(float(np.abs(w).max()), 1.0)
        assert np.abs(got[name] - w).max() <= 1e-12 * scale, name
        assert got32[name].dtype == np.float32
        assert np.abs(got32[name] - w).max() <= 1e-5 * scale, name


def test_float32_gates_are_within_a_few_ulp_and_saturate():
    """The float32 pass's tanh and sigmoids on a dense grid of pre-activations (made exact
    by identity weights), beyond saturation, against float64's; never beyond [-1, 1] or
    [0, 1]."""
    hidden = 1 << 12
    pre = np.tile(np.linspace(-30, 30, hidden, dtype=np.float32), 4)
    pre[:hidden] = np.geomspace(1e-8, 0.5, hidden, dtype=np.float32)  # tiny pre-activations
    # rows [h_prev | x] = [0 | pre] and weights [0; I]: the GEMM gives `pre` exactly
    inputs = np.concatenate([np.zeros(hidden, np.float32), pre]).reshape(1, 1, -1)
    weights = np.concatenate([np.zeros((hidden, 4 * hidden), np.float32), np.eye(4 * hidden, dtype=np.float32)])
    gates, out, tanh_c = (np.empty((1, 1, n), np.float32) for n in (4 * hidden, 2 * hidden, hidden))
    _recurrent.lstm_forward_pass(inputs, weights, gates, out, tanh_c, np.zeros((1, hidden), np.float32), False)
    gates, x = gates[0, 0], pre.astype(np.float64)
    want = np.concatenate([1 / (1 + np.exp(-x[: 2 * hidden])), np.tanh(x[2 * hidden : 3 * hidden]), 1 / (1 + np.exp(-x[3 * hidden :]))])
    eps = float(np.finfo(np.float32).eps)
    assert np.abs(gates - want).max() <= 4 * eps  # absolute: the sigmoids near 0 and 1
    g = slice(2 * hidden, 3 * hidden)
    assert (np.abs(gates[g] - want[g]) <= 4 * eps * np.abs(want[g])).all()  # tanh: relative
    assert np.abs(gates[g]).max() <= 1 and gates.min() >= -1
    sig = np.concatenate([gates[: 2 * hidden], gates[3 * hidden :]])
    assert sig.min() >= 0 and sig.max() <= 1


def test_c_passes_reject_bad_arrays():
    rows, seq, hidden, K = 2, 3, 4, 6
    ok = pass_operands(np.random.default_rng(0), rows, seq, hidden, K, np.float64)
    gates, out, tanh_c = (np.empty((rows, seq, n)) for n in (4 * hidden, 2 * hidden, hidden))

    def forward(**change):
        a = {"inputs": ok["inputs"].copy(), "weights": ok["weights"], "gates": gates, "out": out, "tanh_c": tanh_c, "c0": ok["c0"], **change}
        _recurrent.lstm_forward_pass(*a.values(), False)

    with pytest.raises(TypeError, match="c0: expected dtype float64, got .*float32"):
        forward(c0=np.zeros((rows, hidden), np.float32))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 3, 8\) \(-1: any\), got \(2, 3, 7\)"):
        forward(out=np.empty((rows, seq, 7)))
    with pytest.raises(ValueError, match=r"weights: expected shape \(6, 16\) \(-1: any\), got \(5, 16\)"):
        forward(weights=np.zeros((5, 4 * hidden)))
    with pytest.raises(ValueError, match="tanh_c: expected contiguous elements along the last axis"):
        forward(tanh_c=np.empty((rows, seq, 2 * hidden))[:, :, ::2])
    frozen = gates.copy()
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="gates: expected a writable array"):
        forward(gates=frozen)
    with pytest.raises(ValueError, match=r"gates: expected a 3-d NumPy array of shape \(rows, seq >= 1, 4 \* H\)"):
        forward(gates=np.empty((rows, seq, 5)))
    with pytest.raises(ValueError, match=r"inputs: expected at least H = 4 columns, got 3"):
        forward(inputs=np.zeros((rows, seq, 3)), weights=np.zeros((3, 4 * hidden)))
    with pytest.raises(TypeError, match="g: expected a NumPy array, got list"):
        _recurrent.lstm_backward_pass(gates, tanh_c, out, ok["c0"], [1.0], ok["dhc"].copy(), np.empty_like(gates), ok["weights"], False, True)


@pytest.fixture
def split_passes(monkeypatch):
    """Every LSTM pass cut into blocks of the batch on three threads, however small; yields
    the list of the block counts of the passes run."""
    monkeypatch.setattr(rec, "_CUT_MADDS", 0)
    monkeypatch.setattr(rec, "_ROWS_PER_THREAD", 1)
    counts = []

    def counted(kernel, like, *, rows, blas):
        counts.append(len(lx.parallel.cut(like.shape[0], rows)))
        lx.parallel.for_blocks(kernel, like, rows=rows, blas=blas)

    monkeypatch.setattr(rec, "for_blocks", counted)
    threads = lx.parallel.num_threads()
    lx.parallel.set_num_threads(3)
    yield counts
    lx.parallel.set_num_threads(threads)


def lstm_args(r, batch, seq, n_in, hidden, dtype=np.float64):
    return [a.astype(dtype) for a in (r.normal(size=(batch, seq, n_in)), r.normal(size=(n_in, 4 * hidden)) * 0.5,
            r.normal(size=4 * hidden) * 0.5, r.normal(size=(hidden, 4 * hidden)) * 0.5, r.normal(size=(batch, hidden)),
            r.normal(size=(batch, hidden)))]  # fmt: skip


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("last_only", [False, True])
def test_lstm_passes_split_over_threads_agree_with_one_block(split_passes, monkeypatch, reverse, last_only):
    """An odd batch cut into three blocks of rows (2, 2, 3): the gradients against finite
    differences, and outputs and gradients as in one block."""
    args = lstm_args(np.random.default_rng(9), 7, 5, 3, 4)
    f = lambda *a: lstm_sequence(*a, reverse=reverse, last_only=last_only)  # noqa: E731
    check_grad(f, *args)
    weights = np.random.default_rng(10).normal(size=f(*args).shape)
    loss = lx.value_and_grad(lambda *a: (f(*a) * weights).sum(), argnums=tuple(range(6)))
    split_counts = len(split_passes)
    (split_value, split_grads), split_y = loss(*args), f(*args)
    assert split_passes[split_counts:] == [3, 3, 3]  # forward and backward, then forward
    monkeypatch.setattr(rec, "_CUT_MADDS", 1 << 62)
    (value, grads), y = loss(*args), f(*args)
    assert split_passes[-3:] == [1, 1, 1]
    np.testing.assert_allclose(split_y, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(split_value, value, rtol=1e-12)
    for g_split, g in zip(split_grads, grads, strict=True):
        np.testing.assert_allclose(g_split, g, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reverse", [False, True])
def test_lstm_without_the_blas_runs_the_array_passes(monkeypatch, reverse):
    """Where NumPy's BLAS is not found (HAS_GEMM False), the primitive runs the NumPy
    passes: the same outputs and gradients, and these against finite differences."""
    args = lstm_args(np.random.default_rng(12), 3, 4, 2, 3)
    f = lambda *a: lstm_sequence(*a, reverse=reverse)  # noqa: E731
    weights = np.random.default_rng(13).normal(size=f(*args).shape)
    loss = lx.value_and_grad(lambda *a: (f(*a) * weights).sum(), argnums=tuple(range(6)))
    (value, grads), y = loss(*args), f(*args)
    monkeypatch.setattr(_recurrent, "HAS_GEMM", False)
    assert rec._lstm_passes(np.float64) == (rec._lstm_forward_steps, rec._lstm_backward_steps)
    check_grad(f, *args)
    (value_arrays, grads_arrays), y_arrays = loss(*args), f(*args)
    np.testing.assert_allclose(y_arrays, y, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(value_arrays, value, rtol=1e-12)
    for a, b in zip(grads_arrays, grads, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)


def test_float32_lstm_agrees_with_float64():
    """The whole primitive, forward and backward, in float32 (the C kernel's own tanh)
    against float64, within float32's precision over a 30-step recurrence."""
    r = np.random.default_rng(10)
    args64 = [a * 0.5 for a in lstm_args(r, 9, 30, 5, 16)]
    args32 = [a.astype(np.float32) for a in args64]
    weights = r.normal(size=(9, 30, 32))

    def value_and_grads(args):
        return lx.value_and_grad(lambda *a: (lstm_sequence(*a) * weights.astype(a[0].dtype)).sum(), argnums=tuple(range(6)))(*args)

    (v64, g64), (v32, g32) = value_and_grads(args64), value_and_grads(args32)
    assert abs(float(v32) - float(v64)) <= 1e-4 * max(1.0, abs(float(v64)))
    for a, b in zip(g32, g64):
        assert a.dtype == np.float32
        assert np.abs(a - b).max() <= 1e-4 * max(1.0, float(np.abs(b).max()))


def test_lstm_takes_mixed_dtypes_and_strided_inputs():
    """Arguments of different floating dtypes compute in their result type; inputs whose
    rows are not contiguous (a column-strided x, a broadcast carry) give the same result
    as contiguous copies."""
    r = np.random.default_rng(11)
    x, w_ih, b, w_hh, h0, c0 = lstm_args(r, 3, 4, 2, 5)
    wide = np.repeat(x, 2, axis=2)[:, :, ::2]  # equal to x, column stride 2
    carry = np.broadcast_to(h0[:1], h0.shape)
    want = lstm_sequence(x, w_ih, b, w_hh, carry.copy(), c0)
    np.testing.assert_allclose(lstm_sequence(wide, w_ih, b, w_hh, carry, c0), want, rtol=1e-12, atol=1e-12)
    mixed = lstm_sequence(x.astype(np.float32), w_ih, b, w_hh.astype(np.float32), carry.copy(), c0)
    assert mixed.dtype == np.float64
    np.testing.assert_allclose(mixed, lstm_sequence(x.astype(np.float32).astype(np.float64), w_ih, b, w_hh.astype(np.float32).astype(np.float64), carry.copy(), c0), rtol=1e-12, atol=1e-12)


# -- layers: initialisation, dtypes, errors, a custom cell, training -------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_initialisation_as_pytorch(kind):
    cell = make_cell(kind, 6, 100)
    ps = lx.setup(np.random.default_rng(0), cell)[0]
    gates = {"lstm": 4, "gru": 3}.get(kind, 1)
    assert {k: v.shape for k, v in ps.items()} == {
        "weight_ih": (6, gates * 100), "weight_hh": (100, gates * 100), "bias_ih": (gates * 100,), "bias_hh": (gates * 100,),
    }  # fmt: skip
    for v in ps.values():
        assert v.dtype == np.float32 and np.abs(v).max() <= 0.1 and np.abs(v).max() > 0.09
        assert abs(float(v.std()) - 0.1 / np.sqrt(3)) < 0.01  # uniform in ±1/sqrt(hidden)


def test_float32_model_trains_in_float32():
    model = lx.Chain(lx.Recurrence(lx.LSTMCell(3, 4)), lx.Dense(4, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.random.default_rng(1).normal(size=(2, 5, 3)).astype(np.float32)
    y, _ = model(x, ps, st)
    grads = lx.grad(lambda p: (model(x, p, st)[0] ** 2).sum())(ps)
    assert y.dtype == np.float32
    assert all(g.dtype == np.float32 for g in lx.tree.leaves(grads))


def test_inputs_and_carries_follow_the_dtype_policy():
    model = lx.Chain(lx.Recurrence(lx.GRUCell(3, 4)))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.warns(lx.DtypeWarning, match=r"layer_1/cell \(GRUCell\) got an input of dtype float64"):
        y, _ = model(np.ones((2, 5, 3)), ps, st)
    assert y.dtype == np.float32
    cell = lx.LSTMCell(3, 4)
    cps = lx.setup(np.random.default_rng(0), cell)[0]
    lx.set_dtype_policy("convert")
    try:
        (h, (h, c)), _ = cell((np.ones((2, 3)), (np.zeros((2, 4)), np.zeros((2, 4)))), cps, {})
    finally:
        lx.set_dtype_policy("warn")
    assert h.dtype == c.dtype == np.float32


def test_bad_input_names_what_was_expected_and_received():
    model = lx.Chain(lx.Recurrence(lx.LSTMCell(3, 4)))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match=r"^layer_1: Recurrence\(LSTMCell\(3 => 4\)\): expected input of shape \(batch, seq >= 1, 3\), got \(2, 5, 2\)"):
        model(np.ones((2, 5, 2), np.float32), ps, st)
    with pytest.raises(lx.LayerError, match=r"got \(2, 0, 3\)"):
        model(np.ones((2, 0, 3), np.float32), ps, st)
    with pytest.raises(lx.LayerError, match=r"got \(5, 3\)"):
        model(np.ones((5, 3), np.float32), ps, st)
    bad = {"layer_1": {"cell": {**ps["layer_1"]["cell"], "weight_hh": np.ones((4, 4), np.float32)}}}
    with pytest.raises(lx.LayerError, match=r"^layer_1/cell: LSTMCell\(3 => 4\): expected parameter 'weight_hh' of shape \(4, 16\), got \(4, 4\)"):
        model(np.ones((2, 5, 3), np.float32), bad, st)
    cell = lx.LSTMCell(3, 4)
    cps = lx.setup(np.random.default_rng(0), cell)[0]
    with pytest.raises(lx.LayerError, match=r"expected carry \(h, c\), each of shape \(2, 4\), got \[\(2, 4\)\]"):
        cell((np.ones((2, 3), np.float32), (np.zeros((2, 4), np.float32),)), cps, {})
    with pytest.raises(lx.LayerError, match=r"expected x_t of shape \(batch, 3\) or \(x_t, carry\), got \(2, 1, 3\)"):
        cell(np.ones((2, 1, 3), np.float32), cps, {})
    with pytest.raises(lx.LayerError, match="expected x_t or \\(x_t, carry\\), got a tuple of 3"):
        cell((1, 2, 3), cps, {})
    with pytest.raises(lx.LayerError, match=r"expected Steps of shape \(seq >= 1, batch, 3\), got \(0, 2, 3\)"):
        cell(lx.Steps(np.ones((0, 2, 3), np.float32)), cps, {})


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="RNNCell: activation must be 'tanh' or 'relu', got 'gelu'"):
        lx.RNNCell(2, 3, "gelu")
    with pytest.raises(ValueError, match="LSTMCell: hidden must be a positive integer, got 0"):
        lx.LSTMCell(2, 0)
    with pytest.raises(ValueError, match="GRUCell: init_carry must be one of"):
        lx.GRUCell(2, 3, init_carry="ones")
    with pytest.raises(ValueError, match="Bidirectional: merge must be one of"):
        lx.Bidirectional(lx.GRUCell(2, 3), lx.GRUCell(2, 3), merge="max")
    with pytest.raises(TypeError, match="Recurrence: cell must be a luxnn Layer, got function"):
        lx.Recurrence(lambda x: x)


class ElmanCell(lx.Layer):
    """A cell written by hand, as a user would: Recurrence runs it step by step."""

    def __init__(self, in_dims, hidden):
        self.in_dims, self.hidden = in_dims, hidden
        self.dense = lx.Dense(in_dims + hidden, hidden, activation="tanh")

    def children(self):
        return iter((("dense", self.dense),))

    def __call__(self, x, ps, st):
        x_t, h = x if isinstance(x, tuple) else (x, np.zeros((x.shape[0], self.hidden)))
        h, _ = self.dense(lx.array_namespace(x_t, h).concat([x_t, h], axis=-1), ps["dense"], st["dense"])
        return (h, h), st


def test_recurrence_runs_a_custom_cell_step_by_step():
    cell = ElmanCell(3, 4)
    ps = lx.setup(np.random.default_rng(0), cell)[0]
    w = ps["dense"]["weight"]
    ours = {"weight_ih": w[:3].astype(np.float64), "weight_hh": w[3:].astype(np.float64), "bias_ih": ps["dense"]["bias"].astype(np.float64), "bias_hh": np.zeros(4)}
    x = np.random.default_rng(1).normal(size=(2, 5, 3))
    ps64 = lx.tree.map(lambda a: a.astype(np.float64), ps)
    for reverse in (False, True):
        custom = lx.Recurrence(cell, return_sequence=True, reverse=reverse)
        fused = lx.Recurrence(lx.RNNCell(3, 4), return_sequence=True, reverse=reverse)
        np.testing.assert_allclose(custom(x, {"cell": ps64}, {"cell": {"dense": {}}})[0], fused(x, {"cell": ours}, {"cell": {}})[0], rtol=1e-12)
        last = lx.Recurrence(cell, reverse=reverse)(x, {"cell": ps64}, {"cell": {"dense": {}}})[0]
        np.testing.assert_allclose(last, fused(x, {"cell": ours}, {"cell": {}})[0][:, 0 if reverse else -1], rtol=1e-12)


def test_repr_shows_the_configuration():
    assert repr(lx.Recurrence(lx.RNNCell(2, 3, "relu", use_bias=False), return_sequence=True)) == (
        "Recurrence(RNNCell(2 => 3, relu, use_bias=False), return_sequence=True)"
    )
    assert repr(lx.Bidirectional(lx.LSTMCell(2, 3), lx.LSTMCell(2, 3), merge="sum")) == (
        "Bidirectional(LSTMCell(2 => 3), LSTMCell(2 => 3), merge='sum')"
    )


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn_tanh"])
def test_a_recurrent_classifier_learns(kind):
    """Is the first element of the sequence positive? Only a carry that remembers it can
    tell, since it is read at the end."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(128, 8, 2)).astype(np.float32)
    y = (x[:, 0, 0] > 0).astype(np.int64)
    model = lx.Chain(lx.Recurrence(make_cell(kind, 2, 16)), lx.Dense(16, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(0.02))
    loss = lx.losses.CrossEntropyLoss()
    losses = []
    for _ in range(60):
        _, value, _, ts = lx.single_train_step_(lx.AutoTape(), loss, (x, y), ts)
        losses.append(float(value))
    assert losses[-1] < 0.5 * losses[0], losses[::10]


# -- padded sequences, the final carry and the stacks, against torch -------------------------


def make_stack(kind, in_dims, hidden, **kw):
    if kind.startswith("rnn"):
        return lx.RNN(in_dims, hidden, activation=kind.split("_")[1], **kw)
    return {"lstm": lx.LSTM, "gru": lx.GRU}[kind](in_dims, hidden, **kw)


def stack_tree(module, num_layers, bidirectional, of=copied):
    """`of(module, suffix)` for each of a torch stack's cells, laid out as our stack's parameters."""
    def layer(k):
        if bidirectional:
            return {"forward": {"cell": of(module, f"_l{k}")}, "backward": {"cell": of(module, f"_l{k}_reverse")}}
        return {"cell": of(module, f"_l{k}")}

    return {f"layer_{k + 1}": layer(k) for k in range(num_layers)}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("lengths, start", [([6, 3, 1, 5], False), ([6, 3, 1, 5], True), (None, False)])
def test_stacks_with_lengths_match_torch_packed_sequences(torch, kind, lengths, start):
    """A 2-layer bidirectional stack over padded sequences against torch's over packed ones
    (same weights, float64), from the initial carry or a given one (h_0, c_0): outputs (zero
    past each length), h_n and c_n, and the gradients of all of them with respect to every
    weight, the input and the carry given."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    rng = np.random.default_rng(20)
    batch, seq, in_dims, hidden = 4, 6, 3, 5
    x = rng.normal(size=(batch, seq, in_dims))
    h0 = [rng.normal(size=(4, batch, hidden)) for _ in range(2 if kind == "lstm" else 1)] if start else []
    module = torch_module(torch, kind, in_dims, hidden, num_layers=2, bidirectional=True)
    tx, th0 = torch.tensor(x, requires_grad=True), [torch.tensor(h, requires_grad=True) for h in h0]
    inputs = tx if lengths is None else pack_padded_sequence(tx, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    out, carry = module(inputs, (tuple(th0) if kind == "lstm" else th0[0]) if start else None)
    if lengths is not None:
        out = pad_packed_sequence(out, batch_first=True, total_length=seq)[0]
    carry = carry if kind == "lstm" else (carry,)
    weights = [rng.normal(size=a.shape) for a in (out, *carry)]
    sum(((a * torch.tensor(w)).sum() for a, w in zip((out, *carry), weights))).backward()

    model = make_stack(kind, in_dims, hidden, num_layers=2, bidirectional=True, return_carry=True)
    ps, st = stack_tree(module, 2, True), lx.setup(np.random.default_rng(0), model)[1]

    def inputs(x, h0):
        x = x if lengths is None else lx.Padded(x, np.array(lengths))
        return (x, tuple(h0) if kind == "lstm" else h0[0]) if start else x

    def objective(ps, x, *h0):
        y, carry = model(inputs(x, h0), ps, st)[0]
        y = y if lengths is None else y.x
        return sum((a * w).sum() for a, w in zip((y, *(carry if kind == "lstm" else (carry,))), weights))

    (y, got_carry), _ = model(inputs(x, h0), ps, st)
    assert_close(y if lengths is None else y.x, out.detach().numpy(), "output")
    for got, want in zip(got_carry if kind == "lstm" else (got_carry,), carry, strict=True):
        assert_close(got, want.detach().numpy(), "final carry")
    _, (grads, gx, *gh0) = lx.value_and_grad(objective, argnums=tuple(range(2 + len(h0))))(ps, x, *h0)
    assert_close(gx, tx.grad.numpy(), "input gradient")
    for got, want in zip(gh0, th0, strict=True):
        assert_close(got, want.grad.numpy(), "carry gradient")
    want_grads = stack_tree(module, 2, True, torch_grads)
    for layer in want_grads:
        for direction in ("forward", "backward"):
            for name, g in want_grads[layer][direction]["cell"].items():
                assert_close(grads[layer][direction]["cell"][name], g, f"{layer} {direction} {name}")
    # the last outputs alone: forward at each last step, backward at position 0 (torch's h_n)
    last = make_stack(kind, in_dims, hidden, num_layers=2, bidirectional=True, return_sequence=False)(inputs(x, h0), ps, st)[0]
    h_n = carry[0].detach().numpy()
    assert_close(last, np.concatenate([h_n[-2], h_n[-1]], axis=-1), "last output")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("reverse", [False, True])
def test_recurrence_returns_the_carry_as_torch_h_n(torch, kind, reverse):
    """return_carry on one direction, without lengths: the carry after the last step taken
    is torch's h_n (and c_n) of that direction; the outputs are unchanged."""
    rng = np.random.default_rng(21)
    x = rng.normal(size=(3, 5, 2))
    module = torch_module(torch, kind, 2, 4, bidirectional=True)
    out, carry = module(torch.tensor(x))
    carry = carry if kind == "lstm" else (carry,)
    direction = 1 if reverse else 0
    ps = {"cell": copied(module, "_l0_reverse" if reverse else "_l0")}
    for return_sequence in (False, True):
        model = lx.Recurrence(make_cell(kind, 2, 4), return_sequence=return_sequence, reverse=reverse, return_carry=True)
        y, got = model(x, ps, {"cell": {}})[0]
        assert_close(y, model.__class__(model.cell, return_sequence=return_sequence, reverse=reverse)(x, ps, {"cell": {}})[0], "output")
        for g, want in zip(got if kind == "lstm" else (got,), carry, strict=True):
            assert_close(g, want[direction].detach().numpy(), "carry")


@pytest.mark.parametrize("reverse", [False, True])
def test_a_custom_cell_runs_padded_sequences_as_the_fused_one(reverse):
    """The step-by-step path over Padded input: the same outputs, last outputs and carries as
    the fused RNN, and both as each sequence run alone over its own length."""
    cell = ElmanCell(3, 4)
    ps = lx.tree.map(lambda a: a.astype(np.float64), lx.setup(np.random.default_rng(0), cell)[0])
    w = ps["dense"]["weight"]
    ours = {"weight_ih": w[:3], "weight_hh": w[3:], "bias_ih": ps["dense"]["bias"], "bias_hh": np.zeros(4)}
    x, lengths = np.random.default_rng(1).normal(size=(3, 5, 3)), np.array([2, 5, 4])
    h0 = np.random.default_rng(2).normal(size=(3, 4))
    for return_sequence, start in ((True, None), (False, None), (True, h0)):
        options = {"return_sequence": return_sequence, "reverse": reverse, "return_carry": True}
        padded = lx.Padded(x, lengths) if start is None else (lx.Padded(x, lengths), start)
        custom = lx.Recurrence(cell, **options)(padded, {"cell": ps}, {"cell": {"dense": {}}})[0]
        fused = lx.Recurrence(lx.RNNCell(3, 4), **options)(padded, {"cell": ours}, {"cell": {}})[0]
        for got, want in zip(lx.tree.leaves(custom), lx.tree.leaves(fused), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        for b, n in enumerate(lengths):
            one = x[b : b + 1, :n] if start is None else (x[b : b + 1, :n], start[b : b + 1])
            alone = lx.Recurrence(lx.RNNCell(3, 4), **options)(one, {"cell": ours}, {"cell": {}})[0]
            y, carry = fused
            y = y.x[b] if return_sequence else y[b]
            np.testing.assert_allclose(y[:n] if return_sequence else y, alone[0][0], rtol=1e-12)
            np.testing.assert_allclose(carry[b], alone[1][0], rtol=1e-12)
            if return_sequence:
                assert not y[n:].any()


def test_padded_outputs_stack_in_a_chain():
    """A Chain of Recurrences passes the lengths on: the same as each sequence alone."""
    model = lx.Chain(lx.Bidirectional(lx.LSTMCell(2, 3), lx.LSTMCell(2, 3)), lx.Recurrence(lx.GRUCell(6, 4), reverse=True))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x, lengths = np.random.default_rng(2).normal(size=(3, 6, 2)).astype(np.float32), [6, 1, 4]
    y, _ = model(lx.Padded(x, lengths), ps, st)
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(y[b], model(x[b : b + 1, :n], ps, st)[0][0], rtol=1e-5, atol=1e-6)


def test_stack_dropout_applies_between_layers_in_training_only():
    """LSTM(num_layers=3, dropout=p) is its layers with Dropout(p) on the outputs of the
    first two, drawing from the state's generator in turn; in test mode no dropout."""
    model = lx.LSTM(2, 3, num_layers=3, dropout=0.5, return_carry=True)
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.random.default_rng(1).normal(size=(4, 5, 2)).astype(np.float32)
    (y, (h_n, c_n)), new_st = model(x, ps, st)
    drop, rng_st = lx.Dropout(0.5), st["dropout"]
    want, carries = x, []
    for k in range(3):
        if k:
            want, rng_st = drop(want, {}, rng_st)
        (want, carry), _ = model.layers[k](want, ps[f"layer_{k + 1}"], st[f"layer_{k + 1}"])
        carries.append(carry)
    np.testing.assert_allclose(y, want, rtol=1e-6)
    np.testing.assert_allclose(h_n, np.stack([c[0] for c in carries]), rtol=1e-6)
    assert new_st["dropout"]["rng"].bit_generator.state == rng_st["rng"].bit_generator.state
    test_st = lx.testmode(st)
    undropped = lx.LSTM(2, 3, num_layers=3)(x, ps, {k: v for k, v in test_st.items() if k != "dropout"})[0]
    np.testing.assert_allclose(model(x, ps, test_st)[0][0], undropped, rtol=1e-6)
    assert not np.allclose(y, undropped)


def test_stack_repr_and_bad_configuration():
    assert repr(lx.LSTM(3, 8)) == "LSTM(3 => 8)"
    assert repr(lx.GRU(3, 8, 2, bidirectional=True, dropout=0.1)) == "GRU(3 => 8, num_layers=2, bidirectional=True, dropout=0.1)"
    assert repr(lx.RNN(3, 8, activation="relu", return_carry=True)) == "RNN(3 => 8, relu, return_carry=True)"
    with pytest.raises(ValueError, match="LSTM: num_layers must be a positive integer, got 0"):
        lx.LSTM(3, 8, num_layers=0)
    with pytest.raises(ValueError, match=r"GRU: dropout must be a probability in \[0, 1\), got 1.0"):
        lx.GRU(3, 8, dropout=1.0)
    with pytest.raises(ValueError, match="RNN: activation must be 'tanh' or 'relu', got 'gelu'"):
        lx.RNN(3, 8, activation="gelu")


def test_bad_carries_are_named():
    x = np.ones((2, 5, 3), np.float32)
    lstm = lx.LSTM(3, 4, num_layers=2)
    ps, st = lx.setup(np.random.default_rng(0), lstm)
    h = np.zeros((2, 2, 4), np.float32)
    with pytest.raises(lx.LayerError, match=r"^LSTM\(3 => 4, num_layers=2\): expected the carry \(h_0, c_0\), each of shape \(2, batch, 4\), got \[\(2, 2, 4\)\]"):
        lstm((x, (h,)), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected the carry h_0 of shape \(4, batch, 4\), got \[\(2, 2, 4\)\]"):
        gru = lx.GRU(3, 4, num_layers=2, bidirectional=True)
        gru((x, h), *lx.setup(np.random.default_rng(0), gru))
    with pytest.raises(lx.LayerError, match=r"^layer_1/cell: LSTMCell\(3 => 4\): expected carry \(h, c\), each of shape \(2, 4\), got \[\(3, 4\), \(3, 4\)\]"):
        lstm((x, (np.zeros((2, 3, 4), np.float32),) * 2), ps, st)
    model = lx.Bidirectional(lx.GRUCell(3, 4), lx.GRUCell(3, 4))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match=r"expected the carry as \(forward_carry, backward_carry\), got ndarray"):
        model((x, h[0]), ps, st)
    with pytest.raises(lx.LayerError, match=r"^Recurrence\(GRUCell\(3 => 4\), return_sequence=True\): expected x or \(x, carry\), got a tuple of 3"):
        model.forward((x, h[0], h[0]), ps["forward"], st["forward"])


def test_bad_lengths_are_named():
    model = lx.Chain(lx.Recurrence(lx.GRUCell(3, 4)))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((2, 5, 3), np.float32)
    with pytest.raises(lx.LayerError, match=r"^layer_1: Recurrence\(GRUCell\(3 => 4\)\): expected lengths in \[1, 5\], got values in \[0, 5\]"):
        model(lx.Padded(x, [5, 0]), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected lengths in \[1, 5\], got values in \[2, 6\]"):
        model(lx.Padded(x, [6, 2]), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected lengths of shape \(2,\), integers in \[1, 5\], got float64 of shape \(2,\)"):
        model(lx.Padded(x, [5.0, 2.0]), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected lengths of shape \(2,\), integers in \[1, 5\], got int64 of shape \(3,\)"):
        model(lx.Padded(x, np.array([5, 2, 1])), ps, st)


@pytest.mark.parametrize("kind", KINDS)
def test_an_empty_batch_gives_empty_outputs(kind):
    """Batch 0: empty outputs, carries and input gradient, zero weight gradients, for every
    cell, direction and output (the LSTM's C passes run no rows)."""
    x = np.ones((0, 5, 3), np.float32)
    for return_sequence in (True, False):
        model = lx.Bidirectional(make_cell(kind, 3, 4), make_cell(kind, 3, 4), return_sequence=return_sequence)
        y, _ = model(x, *lx.setup(np.random.default_rng(0), model))
        assert y.shape == ((0, 5, 8) if return_sequence else (0, 8))
    model = make_stack(kind, 3, 4, num_layers=2, bidirectional=True, return_carry=True)
    ps, st = lx.setup(np.random.default_rng(0), model)
    for inputs in (x, lx.Padded(x, np.zeros(0, np.int64))):
        (y, carry), _ = model(inputs, ps, st)
        assert (y.x if isinstance(y, lx.Padded) else y).shape == (0, 5, 8)
        assert all(c.shape == (4, 0, 4) for c in lx.tree.leaves(carry))
    last = make_stack(kind, 3, 4, return_sequence=False)
    assert last(x, *lx.setup(np.random.default_rng(0), last))[0].shape == (0, 4)
    grads, gx = lx.grad(lambda p, x: model(x, p, st)[0][0].sum(), argnums=(0, 1))(ps, x)
    assert gx.shape == x.shape
    assert all(g.shape == p.shape and not g.any() for g, p in zip(lx.tree.leaves(grads), lx.tree.leaves(ps)))


@pytest.mark.parametrize("kind", KINDS)
def test_float16_parameters_compute_in_float16(kind):
    """float16 parameters and inputs: float16 outputs and gradients (every cell computes in
    float16), within float16's precision of the float32 results."""
    model = lx.Bidirectional(make_cell(kind, 3, 4), make_cell(kind, 3, 4))
    ps32, st = lx.setup(np.random.default_rng(0), model)
    x32 = np.random.default_rng(1).normal(size=(2, 6, 3)).astype(np.float32)
    ps16, x16 = lx.tree.map(lambda a: a.astype(np.float16), ps32), x32.astype(np.float16)

    def run(ps, x):
        return lx.value_and_grad(lambda p, x: (model(x, p, st)[0] ** 2).sum(), argnums=(0, 1))(ps, x), model(x, ps, st)[0]

    (v16, (g16, gx16)), y16 = run(ps16, x16)
    (v32, (g32, gx32)), y32 = run(lx.tree.map(lambda a: a.astype(np.float32), ps16), x16.astype(np.float32))
    assert y16.dtype == gx16.dtype == np.float16 and all(g.dtype == np.float16 for g in lx.tree.leaves(g16))
    np.testing.assert_allclose(y16, y32, atol=1e-2)
    for a, b in zip([gx16, *lx.tree.leaves(g16)], [gx32, *lx.tree.leaves(g32)], strict=True):
        assert np.abs(a.astype(np.float32) - b).max() <= 2e-2 * max(1.0, float(np.abs(b).max()))


def test_bidirectional_refuses_cells_its_merge_cannot_combine():
    with pytest.raises(ValueError, match=r"^Bidirectional: merge='sum' combines the outputs elementwise and needs one hidden size, got 4 \(LSTMCell\(3 => 4\)\) and 5 \(LSTMCell\(3 => 5\)\); use merge='concat'"):
        lx.Bidirectional(lx.LSTMCell(3, 4), lx.LSTMCell(3, 5), merge="sum")
    with pytest.raises(ValueError, match=r"^Bidirectional: both cells read the same input, got in_dims 3 \(GRUCell\(3 => 4\)\) and 2"):
        lx.Bidirectional(lx.GRUCell(3, 4), lx.GRUCell(2, 4))
    model = lx.Bidirectional(lx.LSTMCell(3, 4), lx.LSTMCell(3, 5))  # concat takes different sizes
    ps, st = lx.setup(np.random.default_rng(0), model)
    assert model(np.ones((2, 5, 3), np.float32), ps, st)[0].shape == (2, 5, 9)
