"""Positional embeddings: the sinusoidal table against its formula, RoPE against a reference
written here from the formula (both pair conventions), the rotary primitive's VJP against
finite differences, MultiHeadAttention(rotary=True) against attention computed by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.positional import rotary, rotary_tables
from test_ad_primitives import check_grad  # the one finite-difference checker


@pytest.mark.parametrize("dim", [6, 5])  # an odd dim drops the last cosine
def test_sinusoidal_table_is_the_formula(dim):
    seq, base = 9, 100.0
    layer = lx.SinusoidalPositionalEmbedding(dim, base=base, mode="return")
    ps, st = lx.setup(np.random.default_rng(0), layer)
    assert ps == {} and st == {}
    table, _ = layer(np.zeros((2, seq, dim)), ps, st)
    want = np.empty((seq, dim + 1))
    for pos in range(seq):
        for i in range((dim + 1) // 2):
            angle = pos / base ** (2 * i / dim)
            want[pos, 2 * i], want[pos, 2 * i + 1] = math.sin(angle), math.cos(angle)
    assert table.shape == (seq, dim) and table.dtype == np.float64
    np.testing.assert_allclose(table, want[:, :dim], rtol=1e-12, atol=1e-15)
    x = np.random.default_rng(1).normal(size=(3, seq, dim)).astype(np.float32)
    y, _ = lx.SinusoidalPositionalEmbedding(dim, base=base)(x, ps, st)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, x + want[:, :dim], rtol=1e-6, atol=1e-6)


def test_sinusoidal_table_for_token_ids():
    layer = lx.SinusoidalPositionalEmbedding(4, mode="return")
    table, _ = layer(np.zeros((2, 3), np.int64), {}, {})
    want, _ = layer(np.zeros((2, 3, 4), np.float32), {}, {})
    assert table.dtype == np.float32 and table.shape == (3, 4)
    np.testing.assert_array_equal(table, want)
    with pytest.raises(lx.LayerError, match=r"expected input of shape \(batch, seq <= 4096, 4\), got \(2, 3\)"):
        lx.SinusoidalPositionalEmbedding(4)(np.zeros((2, 3)), {}, {})


def test_sinusoidal_embedding_passes_gradients_through():
    x = np.random.default_rng(2).normal(size=(2, 3, 4))
    g = lx.grad(lambda x: (lx.SinusoidalPositionalEmbedding(4)(x, {}, {})[0] ** 2).sum())(x)
    table = lx.SinusoidalPositionalEmbedding(4, mode="return")(x, {}, {})[0]
    np.testing.assert_allclose(g, 2 * (x + table), rtol=1e-12)


def reference_rope(x, base, interleaved):
    """RoPE from its definition: feature pair (a, b) of position m, frequency i, multiplied
    as the complex number a + ib by e^{i m theta_i}, theta_i = base^(-2i/d). Pairs:
    (2i, 2i+1) interleaved (Meta's LLaMA: view_as_complex of consecutive features), else
    (i, i + d/2) (Hugging Face's LLaMA: q * cos + rotate_half(q) * sin)."""
    d = x.shape[-1]
    y = np.empty_like(x)
    for m in range(x.shape[1]):
        for i in range(d // 2):
            j, k = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
            z = (x[:, m, ..., j] + 1j * x[:, m, ..., k]) * np.exp(1j * m * base ** (-2 * i / d))
            y[:, m, ..., j], y[:, m, ..., k] = z.real, z.imag
    return y


def hugging_face_rope(x, base):
    """Hugging Face's LLaMA formula, written as it is there: cat(freqs, freqs) angles and
    rotate_half(x) = cat(-x2, x1)."""
    d = x.shape[-1]
    freqs = np.outer(np.arange(x.shape[1]), base ** (-np.arange(0, d, 2) / d))
    emb = np.concatenate([freqs, freqs], axis=-1)[None, :, None, :]
    rotate_half = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], axis=-1)
    return x * np.cos(emb) + rotate_half * np.sin(emb)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(2, 5, 3, 8), (3, 4, 6)])
def test_rope_matches_the_reference(interleaved, shape):
    x = np.random.default_rng(3).normal(size=shape)
    rope = lx.RotaryPositionalEmbedding(shape[-1], base=500.0, interleaved=interleaved)
    y, _ = rope(x, {}, {})
    np.testing.assert_allclose(y, reference_rope(x, 500.0, interleaved), rtol=1e-12, atol=1e-12)
    if len(shape) == 4 and not interleaved:
        np.testing.assert_allclose(y, hugging_face_rope(x, 500.0), rtol=1e-12, atol=1e-12)


def test_rope_scores_depend_on_relative_position_only():
    rng = np.random.default_rng(4)
    rope = lx.RotaryPositionalEmbedding(8)
    q, k = rng.normal(size=(1, 1, 8)), rng.normal(size=(1, 1, 8))
    # the same q and k at every position: the score of positions (m, n) depends on m - n
    rq = rope(np.repeat(q, 6, axis=1), {}, {})[0][0]
    rk = rope(np.repeat(k, 6, axis=1), {}, {})[0][0]
    scores = rq @ rk.T
    for shift in range(-5, 6):
        diagonal = np.diagonal(scores, offset=shift)
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=1e-10)
    assert not np.allclose(np.diagonal(scores, 1)[0], np.diagonal(scores, 2)[0])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_vjp_matches_finite_differences(interleaved):
    cos, sin = rotary_tables(4, 6, base=50.0, dtype=np.float64)
    x = np.random.default_rng(5).normal(size=(2, 4, 3, 6))
    check_grad(lambda x: rotary(x, cos[:, None], sin[:, None], interleaved=interleaved), x)


def test_rope_keeps_float32():
    x = np.ones((1, 3, 4), np.float32)
    assert lx.RotaryPositionalEmbedding(4)(x, {}, {})[0].dtype == np.float32
    g = lx.grad(lambda x: (lx.RotaryPositionalEmbedding(4)(x, {}, {})[0] ** 2).sum())(x)
    assert g.dtype == np.float32
    np.testing.assert_allclose(g, 2 * x, rtol=1e-6)  # a rotation keeps the norm


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_with_rotary_matches_attention_by_hand(is_causal):
    rng = np.random.default_rng(6)
    dim, heads, batch, seq = 8, 2, 2, 5
    mha = lx.MultiHeadAttention(dim, num_heads=heads, rotary=True, is_causal=is_causal)
    ps, st = lx.setup(np.random.default_rng(0), mha)
    ps = lx.tree.map(lambda a: rng.normal(size=a.shape) * 0.5, ps)  # float64, non-zero biases
    x = rng.normal(size=(batch, seq, dim))
    (y, w), _ = mha(x, ps, st)

    def proj(name, t):
        return t @ ps[name]["weight"] + ps[name]["bias"]

    d = dim // heads
    q = reference_rope(proj("q_proj", x).reshape(batch, seq, heads, d), 10000.0, False)
    k = reference_rope(proj("k_proj", x).reshape(batch, seq, heads, d), 10000.0, False)
    v = proj("v_proj", x).reshape(batch, seq, heads, d)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d)
    if is_causal:
        scores = np.where(np.tril(np.ones((seq, seq), bool)), scores, -np.inf)
    weights = softmax(scores)
    out = np.einsum("bhqk,bkhd->bqhd", weights, v).reshape(batch, seq, dim)
    np.testing.assert_allclose(w, weights, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(y, proj("out_proj", out), rtol=1e-10, atol=1e-12)
    # and its gradients against finite differences
    check_grad(lambda x: mha(x, ps, st)[0][0], x, rtol=1e-5, atol=1e-7)


def test_attention_rotary_leaves_parameters_and_plain_attention_unchanged():
    plain, rope = lx.MultiHeadAttention(8, num_heads=2), lx.MultiHeadAttention(8, num_heads=2, rotary=True)
    ps_plain, st = lx.setup(np.random.default_rng(0), plain)
    ps_rope, _ = lx.setup(np.random.default_rng(0), rope)
    assert lx.tree.map(np.shape, ps_plain) == lx.tree.map(np.shape, ps_rope)
    x = np.random.default_rng(1).normal(size=(1, 4, 8)).astype(np.float32)
    (y_plain, w_plain), _ = plain(x, ps_plain, st)
    (y_rope, w_rope), _ = rope(x, ps_plain, st)
    assert not np.allclose(w_plain, w_rope)
    one = x[:, :1]  # a single position, 0, is not rotated
    np.testing.assert_allclose(rope(one, ps_plain, st)[0][0], plain(one, ps_plain, st)[0][0], rtol=1e-6)
    assert repr(rope) == "MultiHeadAttention(8, num_heads=2, rotary=True)"


def test_attention_converts_inputs_by_the_dtype_policy():
    mha = lx.MultiHeadAttention(4, num_heads=2)
    ps, st = lx.setup(np.random.default_rng(0), mha)
    with pytest.warns(lx.DtypeWarning, match="MultiHeadAttention"):
        (y, w), _ = mha(np.ones((1, 3, 4)), ps, st)
    assert y.dtype == w.dtype == np.float32


def test_bad_configuration_and_input():
    with pytest.raises(ValueError, match="head_dim must be even"):
        lx.RotaryPositionalEmbedding(5)
    with pytest.raises(ValueError, match="rotary needs an even head size"):
        lx.MultiHeadAttention(6, num_heads=2, rotary=True)
    with pytest.raises(ValueError, match="rotary must be True or False"):
        lx.MultiHeadAttention(8, num_heads=2, rotary="yes")
    with pytest.raises(ValueError, match="mode must be one of"):
        lx.SinusoidalPositionalEmbedding(4, mode="concat")
    with pytest.raises(ValueError, match="base must be a number above 1"):
        lx.SinusoidalPositionalEmbedding(4, base=1)
    with pytest.raises(lx.LayerError, match=r"expected input of shape \(batch, seq <= 3, 4\), got \(1, 4, 4\)"):
        lx.SinusoidalPositionalEmbedding(4, max_len=3)(np.zeros((1, 4, 4)), {}, {})
    with pytest.raises(lx.LayerError, match=r"expected input of shape \(batch, seq <= 4096, \[heads,\] 4\), got \(2, 6\)"):
        lx.RotaryPositionalEmbedding(4)(np.zeros((2, 6)), {}, {})
    model = lx.Chain(lx.SinusoidalPositionalEmbedding(4))
    with pytest.raises(lx.LayerError, match=r"^layer_1: SinusoidalPositionalEmbedding\(4\): expected"):
        model(np.zeros((1, 2, 3)), *lx.setup(np.random.default_rng(0), model))
