"""Multi-head attention."""

from __future__ import annotations

import math
from typing import Any, Iterator

import numpy as np

from .. import init as initializers
from ..ad.namespace import array_namespace
from ..ad.tape import Traced
from ..backend import module_of
from ..core import input_shape, Layer, LayerError
from ..dtypes import match_eltype
from ..ops.attention import attention_combine, attention_weights
from .dense import Dense
from .dropout import child_generator, dropout_mask, fork_generator
from .positional import check_base, rope

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(Layer):
    """Multi-head scaled dot-product attention, as ``torch.nn.MultiheadAttention`` with
    ``batch_first=True``.

    Inputs, each of shape ``(batch, seq, features)``:

    - ``q``: self-attention (keys and values are `q`);
    - ``(q, kv)``: keys and values from `kv`;
    - ``(q, k, v)``;
    - ``(q, k, v, mask)``: `mask` a boolean array broadcastable to
      ``(batch, num_heads, q_len, kv_len)``, True where a query may attend to a key (as in
      Lux, Flax and PyTorch's scaled_dot_product_attention; the opposite of the boolean
      ``attn_mask`` of ``torch.nn.MultiheadAttention``), or None.

    `q` has `dim` features and `k`, `v` have `kv_dim` (default `dim`). With
    ``is_causal=True`` query i also never sees keys after position i. A query that may see
    no key gets zero weights and outputs the projections' bias. ``rotary=True`` rotates
    each head's projected queries and keys by their positions before the scores, as
    `RotaryPositionalEmbedding(dim // num_heads, base=rotary_base)` does (RoPE, as LLaMA).

    Returns ``((y, weights), state)``: y ``(batch, q_len, dim)`` and the attention weights
    ``(batch, num_heads, q_len, kv_len)`` (before dropout). Parameters ``{"q_proj",
    "k_proj", "v_proj", "out_proj"}``, each a `Dense`'s ``{"weight": (in, out), "bias":
    (out,)}``; initialised as PyTorch (Glorot-uniform input projections, zero biases).
    State ``{"rng": generator, "training": True}`` when ``dropout > 0`` (dropout on the
    attention weights in training mode), else ``{}``.

    >>> import luxnn as lx
    >>> mha = lx.MultiHeadAttention(8, num_heads=2, is_causal=True)
    >>> ps, st = lx.setup(np.random.default_rng(0), mha)
    >>> (y, w), st = mha(np.ones((3, 5, 8), np.float32), ps, st)
    >>> y.shape, w.shape
    ((3, 5, 8), (3, 2, 5, 5))
    """

    def __init__(
        self,
        dim: int,
        *,
        num_heads: int = 1,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        is_causal: bool = False,
        rotary: bool = False,
        rotary_base: float = 10000.0,
    ) -> None:
        for name, n in (("dim", dim), ("num_heads", num_heads), ("kv_dim", dim if kv_dim is None else kv_dim)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"MultiHeadAttention: {name} must be a positive integer, got {n!r}")
        if dim % num_heads:
            raise ValueError(f"MultiHeadAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"MultiHeadAttention: dropout must be a probability in [0, 1), got {dropout!r}")
        self.dim = int(dim)
        self.num_heads = int(num_heads)
        self.kv_dim = self.dim if kv_dim is None else int(kv_dim)
        self.dropout = float(dropout)
        self.use_bias = bool(use_bias)
        self.is_causal = bool(is_causal)
        if not isinstance(rotary, bool):
            raise ValueError(f"MultiHeadAttention: rotary must be True or False, got {rotary!r}")
        if rotary and (self.dim // self.num_heads) % 2:
            raise ValueError(f"MultiHeadAttention: rotary needs an even head size (features rotate in pairs), got dim // num_heads = {self.dim // self.num_heads}")
        self.rotary = rotary
        self.rotary_base = check_base("MultiHeadAttention", rotary_base)
        glorot, zero = initializers.glorot_uniform(), initializers.zeros
        self.q_proj = Dense(self.dim, self.dim, use_bias=use_bias, init_weight=glorot, init_bias=zero)
        self.k_proj = Dense(self.kv_dim, self.dim, use_bias=use_bias, init_weight=glorot, init_bias=zero)
        self.v_proj = Dense(self.kv_dim, self.dim, use_bias=use_bias, init_weight=glorot, init_bias=zero)
        self.out_proj = Dense(self.dim, self.dim, use_bias=use_bias, init_bias=zero)

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter((("q_proj", self.q_proj), ("k_proj", self.k_proj), ("v_proj", self.v_proj), ("out_proj", self.out_proj)))

    def init_state(self, rng: Any) -> dict[str, Any]:
        return {"rng": child_generator(rng), "training": True} if self.dropout > 0 else {}

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        q, k, v, mask = self._inputs(x)
        if not isinstance(ps, dict) or ps.keys() != {"q_proj", "k_proj", "v_proj", "out_proj"}:
            raise LayerError(f"{self}: expected parameters ['k_proj', 'out_proj', 'q_proj', 'v_proj'], got {sorted(ps) if isinstance(ps, dict) else type(ps).__name__}")
        batch, q_len, kv_len = q.shape[0], q.shape[1], k.shape[1]
        heads = self.num_heads
        if mask is not None:
            self._check_mask(mask, (batch, heads, q_len, kv_len))
        like = ps["q_proj"].get("weight") if isinstance(ps["q_proj"], dict) else None
        q, k, v = (match_eltype(self, t, like) for t in (q, k, v))
        weights = attention_weights(
            self._rotated(self._project("q_proj", q, ps)),
            self._rotated(self._project("k_proj", k, ps)),
            num_heads=heads,
            scale=1.0 / math.sqrt(self.dim // heads),
            mask=mask,
            is_causal=self.is_causal,
        )
        attended = weights
        if self.dropout > 0 and st["training"]:
            rng = fork_generator(st["rng"])
            xp = module_of(weights.value if type(weights) is Traced else weights)
            attended = weights * dropout_mask(rng, weights.shape, weights.dtype, self.dropout, xp)
            st = {"rng": rng, "training": True}
        out = attention_combine(attended, self._project("v_proj", v, ps), num_heads=heads)
        return (self._project("out_proj", out, ps), weights), st

    def _rotated(self, projected: Any) -> Any:
        """The (batch, seq, heads * d) projection with each head rotated by RoPE, if on."""
        if not self.rotary:
            return projected
        batch, seq, dim = projected.shape
        xp = array_namespace(projected)
        per_head = xp.reshape(projected, (batch, seq, self.num_heads, dim // self.num_heads))
        return xp.reshape(rope(per_head, base=self.rotary_base), (batch, seq, dim))

    def _project(self, name: str, x: Any, ps: dict[str, Any]) -> Any:
        try:
            return getattr(self, name)(x, ps[name], {})[0]
        except LayerError as err:
            raise err.within(name) from None

    def _inputs(self, x: Any) -> tuple[Any, Any, Any, Any]:
        if not isinstance(x, tuple):
            x = (x,)
        if len(x) == 1:
            q, k, v, mask = x[0], x[0], x[0], None
        elif len(x) == 2:
            q, k, v, mask = x[0], x[1], x[1], None
        elif len(x) in (3, 4):
            q, k, v, mask = (*x, None)[:4]
        else:
            raise LayerError(f"{self}: expected q, (q, kv), (q, k, v) or (q, k, v, mask), got a tuple of {len(x)}")
        for name, t, features in (("q", q, self.dim), ("k", k, self.kv_dim), ("v", v, self.kv_dim)):
            shape = getattr(t, "shape", None)
            if shape is None or len(shape) != 3 or shape[2] != features:
                raise LayerError(f"{self}: expected {name} of shape (batch, seq, {features}), got {input_shape(t)}")
        if k.shape[:2] != v.shape[:2] or k.shape[0] != q.shape[0]:
            raise LayerError(
                f"{self}: expected q, k, v with one batch size and k, v of one length, got "
                f"shapes {q.shape}, {k.shape}, {v.shape}"
            )
        return q, k, v, mask

    def _check_mask(self, mask: Any, target: tuple[int, int, int, int]) -> None:
        shape = getattr(mask, "shape", None)
        dtype = getattr(mask, "dtype", None)
        if dtype is None or dtype != np.bool_:
            raise LayerError(f"{self}: expected a boolean mask, got {type(mask).__name__ if dtype is None else f'dtype {dtype}'}")
        fits = len(shape) <= 4 and all(m in (1, t) for m, t in zip(reversed(shape), reversed(target)))
        if not fits:
            raise LayerError(
                f"{self}: expected a mask broadcastable to (batch, heads, q_len, kv_len) = {target}, got shape {shape}"
            )

    def __repr__(self) -> str:
        flags = [f"num_heads={self.num_heads}"]
        if self.kv_dim != self.dim:
            flags.append(f"kv_dim={self.kv_dim}")
        if self.dropout:
            flags.append(f"dropout={self.dropout}")
        if not self.use_bias:
            flags.append("use_bias=False")
        if self.is_causal:
            flags.append("is_causal=True")
        if self.rotary:
            flags.append("rotary=True" if self.rotary_base == 10000.0 else f"rotary=True, rotary_base={self.rotary_base}")
        return f"MultiHeadAttention({self.dim}, {', '.join(flags)})"
