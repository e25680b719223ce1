"""MultiHeadAttention against torch.nn.MultiheadAttention (batch_first) in float64."""

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.attention import masked_softmax

torch = pytest.importorskip("torch")


def f64(tree):
    return lx.tree.map(lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) else a, tree)


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def torch_mha(ps, dim, heads, kv_dim, use_bias):
    """A torch MultiheadAttention holding our parameters (torch Linear weights are (out, in))."""
    mha = torch.nn.MultiheadAttention(dim, heads, bias=use_bias, kdim=kv_dim, vdim=kv_dim, batch_first=True, dtype=torch.float64)
    w = {name: torch.tensor(ps[name]["weight"].T.copy()) for name in ("q_proj", "k_proj", "v_proj", "out_proj")}
    with torch.no_grad():
        if kv_dim == dim:
            mha.in_proj_weight.copy_(torch.cat([w["q_proj"], w["k_proj"], w["v_proj"]]))
        else:
            mha.q_proj_weight.copy_(w["q_proj"])
            mha.k_proj_weight.copy_(w["k_proj"])
            mha.v_proj_weight.copy_(w["v_proj"])
        mha.out_proj.weight.copy_(w["out_proj"])
        if use_bias:
            mha.in_proj_bias.copy_(torch.tensor(np.concatenate([ps[n]["bias"] for n in ("q_proj", "k_proj", "v_proj")])))
            mha.out_proj.bias.copy_(torch.tensor(ps["out_proj"]["bias"]))
    return mha


def torch_param_grads(mha, dim, kv_dim, use_bias):
    """Our parameter layout of torch's gradients."""
    if kv_dim == dim:
        wq, wk, wv = mha.in_proj_weight.grad.split(dim)
    else:
        wq, wk, wv = mha.q_proj_weight.grad, mha.k_proj_weight.grad, mha.v_proj_weight.grad
    grads = {name: {"weight": g.numpy().T} for name, g in (("q_proj", wq), ("k_proj", wk), ("v_proj", wv))}
    grads["out_proj"] = {"weight": mha.out_proj.weight.grad.numpy().T}
    if use_bias:
        for name, g in zip(("q_proj", "k_proj", "v_proj"), mha.in_proj_bias.grad.split(dim)):
            grads[name]["bias"] = g.numpy()
        grads["out_proj"]["bias"] = mha.out_proj.bias.grad.numpy()
    return grads


CASES = [
    # (seed, mode, causal, mask_kind, kv_dim, use_bias)
    (0, "self", False, None, None, True),
    (1, "self", True, None, None, True),
    (2, "qkv", False, "full", None, True),
    (3, "kv", False, "keys", 5, False),
    (4, "qkv", True, "full", 3, True),
    (5, "self", False, "2d", None, True),
]


@pytest.mark.parametrize("seed, mode, causal, mask_kind, kv_dim, use_bias", CASES)
def test_matches_torch(seed, mode, causal, mask_kind, kv_dim, use_bias):
    rng = np.random.default_rng(seed)
    heads = int(rng.integers(1, 4))
    dim = heads * int(rng.integers(1, 4))
    batch, q_len = int(rng.integers(1, 4)), int(rng.integers(1, 7))
    kv_len = q_len if mode == "self" or causal else int(rng.integers(1, 7))
    kvd = dim if kv_dim is None else kv_dim
    model = lx.MultiHeadAttention(dim, num_heads=heads, kv_dim=kv_dim, use_bias=use_bias, is_causal=causal)
    ps, st = f64(lx.setup(rng, model))
    ps = lx.tree.map(lambda a: rng.normal(size=a.shape) * 0.5, ps)

    q = rng.normal(size=(batch, q_len, dim))
    k = q if mode == "self" else rng.normal(size=(batch, kv_len, kvd))
    v = k if mode in ("self", "kv") else rng.normal(size=(batch, kv_len, kvd))
    mask = None
    if mask_kind == "full":
        mask = rng.random((batch, heads, q_len, kv_len)) < 0.7
    elif mask_kind == "keys":  # key padding: (batch, 1, 1, kv_len)
        mask = rng.random((batch, 1, 1, kv_len)) < 0.6
    elif mask_kind == "2d":
        mask = rng.random((q_len, kv_len)) < 0.6
    if mask is not None:
        mask[..., 0] = True  # every query sees a key: torch gives NaN rows otherwise

    def inputs(q, k, v):
        # Self-attention passes one leaf as q, k and v; (q, kv) one leaf as k and v.
        k = q if mode == "self" else k
        v = k if mode in ("self", "kv") else v
        if mask is not None:
            return (q, k, v, mask)
        return {"self": q, "kv": (q, k), "qkv": (q, k, v)}[mode]

    (y, w), _ = model(inputs(q, k, v), ps, st)
    assert y.shape == (batch, q_len, dim) and w.shape == (batch, heads, q_len, kv_len)
    r, rw = rng.normal(size=y.shape), rng.normal(size=w.shape)

    def loss(q, k, v, ps):
        (y, w), _ = model(inputs(q, k, v), ps, st)
        return (y * r).sum() + (w * rw).sum()

    _, (gq, gk, gv, gps) = lx.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, ps)

    mha = torch_mha(ps, dim, heads, kvd, use_bias)
    tq = torch.tensor(q, requires_grad=True)
    tk = tq if mode == "self" else torch.tensor(k, requires_grad=True)
    tv = tk if mode in ("self", "kv") else torch.tensor(v, requires_grad=True)
    allowed = np.ones((batch, heads, q_len, kv_len), bool)
    if mask is not None:
        allowed &= mask
    if causal:
        allowed &= np.tril(np.ones((q_len, kv_len), bool))
    attn_mask = None if allowed.all() else torch.tensor(~allowed.reshape(batch * heads, q_len, kv_len))
    ty, tw = mha(tq, tk, tv, attn_mask=attn_mask, need_weights=True, average_attn_weights=False)
    ((ty * torch.tensor(r)).sum() + (tw * torch.tensor(rw)).sum()).backward()

    assert rel_err(y, ty.detach().numpy()) < 1e-6
    assert rel_err(w, tw.detach().numpy()) < 1e-6
    assert rel_err(gq, tq.grad.numpy()) < 1e-6
    if mode != "self":
        assert rel_err(gk, tk.grad.numpy()) < 1e-6
    if mode == "qkv":
        assert rel_err(gv, tv.grad.numpy()) < 1e-6
    expected = torch_param_grads(mha, dim, kvd, use_bias)
    for name, sub in expected.items():
        for key, g in sub.items():
            if (name, key) == ("k_proj", "bias"):
                # Adding a constant to every key leaves softmax unchanged: both are rounding noise.
                assert np.abs(gps[name][key]).max() < 1e-10 and np.abs(g).max() < 1e-10
            else:
                assert rel_err(gps[name][key], g) < 1e-6, (name, key)


def test_fully_masked_query_gets_zero_weights_and_finite_gradients():
    scores = np.random.default_rng(0).normal(size=(2, 3, 4))
    mask = np.ones((3, 4), bool)
    mask[1] = False
    w = masked_softmax(scores, mask=mask)
    assert np.all(w[:, 1] == 0) and np.allclose(w[:, [0, 2]].sum(-1), 1)
    g = lx.grad(lambda s: (masked_softmax(s, mask=mask, scale=0.5) ** 2).sum())(scores)
    assert np.all(np.isfinite(g)) and np.all(g[:, 1] == 0)


def test_masked_softmax_matches_finite_differences():
    rng = np.random.default_rng(1)
    s = rng.normal(size=(2, 3, 5))
    mask = rng.random((1, 3, 5)) < 0.7
    mask[..., 0] = True
    r = rng.normal(size=s.shape)

    def f(s):
        return (masked_softmax(s, scale=0.7, mask=mask, is_causal=True) * r).sum()

    g = lx.grad(f)(s)
    h = 1e-6
    for idx in [(0, 0, 0), (1, 2, 1), (0, 2, 2), (1, 1, 0)]:
        d = np.zeros_like(s)
        d[idx] = h
        assert abs((f(s + d) - f(s - d)) / (2 * h) - g[idx]) < 1e-7


def test_dropout_on_weights_uses_and_advances_state():
    rng = np.random.default_rng(0)
    model = lx.MultiHeadAttention(4, num_heads=2, dropout=0.5)
    ps, st = lx.setup(rng, model)
    assert sorted(st) == ["rng", "training"]
    x = rng.normal(size=(2, 6, 4)).astype(np.float32)
    (y1, w1), st1 = model(x, ps, st)
    (y2, w2), _ = model(x, ps, st)
    (y3, _), _ = model(x, ps, st1)
    assert np.array_equal(y1, y2) and not np.allclose(y1, y3)
    assert np.allclose(w1.sum(-1), 1)  # the returned weights are before dropout
    (y_test, _), st_test = model(x, ps, lx.testmode(st))
    (y_ref, _), _ = lx.MultiHeadAttention(4, num_heads=2)(x, ps, {})
    assert np.allclose(y_test, y_ref) and st_test["training"] is False


def test_bad_inputs():
    rng = np.random.default_rng(0)
    model = lx.Chain(lx.MultiHeadAttention(8, num_heads=2))
    ps, st = lx.setup(rng, model)
    q = np.ones((2, 5, 8), np.float32)
    with pytest.raises(
        lx.LayerError,
        match=r"^layer_1: MultiHeadAttention\(8, num_heads=2\): expected a mask broadcastable to "
        r"\(batch, heads, q_len, kv_len\) = \(2, 2, 5, 5\), got shape \(2, 5, 4\)",
    ):
        model((q, q, q, np.ones((2, 5, 4), bool)), ps, st)
    with pytest.raises(lx.LayerError, match="expected a boolean mask, got dtype float32"):
        model((q, q, q, np.ones((5, 5), np.float32)), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected q of shape \(batch, seq, 8\), got \(2, 5, 6\)"):
        model(np.ones((2, 5, 6), np.float32), ps, st)
    with pytest.raises(lx.LayerError, match="one batch size"):
        model((q, np.ones((3, 5, 8), np.float32)), ps, st)
    with pytest.raises(ValueError, match="divisible"):
        lx.MultiHeadAttention(6, num_heads=4)
    bad = lx.tree.map(lambda a: a, ps)
    bad["layer_1"]["k_proj"]["weight"] = np.ones((8, 3), np.float32)
    with pytest.raises(lx.LayerError, match=r"^layer_1/k_proj: Dense\(8 => 8\): expected parameter 'weight' of shape \(8, 8\)"):
        model(q, bad, st)


@pytest.mark.parametrize("heads", [1, 3])
def test_head_products_match_finite_differences_and_leave_inputs_alone(heads):
    from luxnn.ops.attention import attention_combine, attention_weights

    rng = np.random.default_rng(heads)
    q, k = rng.normal(size=(2, 4, 3 * heads)), rng.normal(size=(2, 5, 3 * heads))
    w, v = rng.random((2, heads, 4, 5)), rng.normal(size=(2, 5, 3 * heads))
    q0, k0 = q.copy(), k.copy()
    r1, r2 = rng.normal(size=(2, heads, 4, 5)), rng.normal(size=(2, 4, 3 * heads))
    mask = rng.random((1, 1, 4, 5)) < 0.7

    def f(q, k, w, v):
        weights = attention_weights(q, k, num_heads=heads, scale=0.3, mask=mask, is_causal=True)
        return (weights * r1).sum() + (attention_combine(w, v, num_heads=heads) * r2).sum()

    grads = lx.grad(f, argnums=(0, 1, 2, 3))(q, k, w, v)
    np.testing.assert_array_equal(q, q0)  # the scaled copy of q is never q itself
    np.testing.assert_array_equal(k, k0)
    args = [q, k, w, v]
    h = 1e-6
    for i, g in enumerate(grads):
        for idx in [(0,) * g.ndim, tuple(n - 1 for n in g.shape)]:
            plus = [a.copy() for a in args]
            minus = [a.copy() for a in args]
            plus[i][idx] += h
            minus[i][idx] -= h
            assert abs((f(*plus) - f(*minus)) / (2 * h) - g[idx]) < 1e-6


def test_attention_weights_rejects_a_bad_scale_or_mask():
    from luxnn.ops.attention import attention_weights

    q = np.ones((2, 3, 4))
    with pytest.raises(ValueError, match="attention_weights: scale must be positive, got 0"):
        attention_weights(q, q, num_heads=2, scale=0)
    with pytest.raises(ValueError, match=r"mask of shape \(3, 2\) does not broadcast to the scores' \(2, 2, 3, 3\)"):
        attention_weights(q, q, num_heads=2, mask=np.ones((3, 2), bool))
    with pytest.raises(ValueError, match="attention_weights: expected a boolean mask, got dtype int64"):
        attention_weights(q, q, num_heads=2, mask=np.ones((3, 3), np.int64), is_causal=True)
    expected = r"expected q \(batch, q_len, 2 \* d\) and k \(batch, kv_len, 2 \* d\), got shapes \(2, 3, 4\) and \(1, 3, 4\)"
    with pytest.raises(ValueError, match=expected):
        attention_weights(q, q[:1], num_heads=2)
    with pytest.raises(ValueError, match=r"got shapes \(2, 3, 4\) and \(2, 3, 4\)"):
        attention_weights(q, q, num_heads=3)


def test_attention_combine_rejects_shapes_that_do_not_fit():
    from luxnn.ops.attention import attention_combine

    w, v = np.ones((2, 2, 3, 5)), np.ones((2, 5, 4))
    assert attention_combine(w, v, num_heads=2).shape == (2, 3, 4)
    for bad_w, bad_v, heads in [(w, v[:, :4], 2), (w, v, 4), (w[0], v, 2), (w, v[:1], 2)]:
        with pytest.raises(ValueError, match="attention_combine: expected weights"):
            attention_combine(bad_w, bad_v, num_heads=heads)


def test_masked_softmax_refuses_scores_without_the_axes_it_needs():
    with pytest.raises(ValueError, match=r"masked_softmax: is_causal needs scores of shape \(\.\.\., q_len, kv_len\), got \(4,\)"):
        masked_softmax(np.zeros(4), is_causal=True)
    with pytest.raises(ValueError, match=r"masked_softmax: expected scores of shape \(\.\.\., kv_len\), got a 0-d array"):
        masked_softmax(np.zeros(()))
