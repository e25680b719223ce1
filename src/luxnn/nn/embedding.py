"""Embedding: a trainable lookup table indexed by integers."""

from __future__ import annotations

from typing import Any

import numpy as np

from .. import init as initializers
from ..core import Layer, LayerError, check_params
from ..ops.embedding import lookup_rows

__all__ = ["Embedding"]


class Embedding(Layer):
    """Row `i` of the table for each integer index `i`: indices of any shape ``(...)``
    -> ``(..., dim)``. Parameters ``{"weight": (num_embeddings, dim)}``, initialised
    N(0, 1) as in PyTorch. The gradient accumulates repeated indices.

    >>> import luxnn as lx
    >>> emb = lx.Embedding(10, 4)
    >>> ps, st = lx.setup(np.random.default_rng(0), emb)
    >>> emb(np.array([[1, 2, 2]]), ps, st)[0].shape
    (1, 3, 4)
    """

    def __init__(
        self, num_embeddings: int, dim: int, *, init_weight: initializers.Initializer | None = None
    ) -> None:
        for name, n in (("num_embeddings", num_embeddings), ("dim", dim)):
            if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
                raise ValueError(f"Embedding: {name} must be a positive integer, got {n!r}")
        self.num_embeddings = int(num_embeddings)
        self.dim = int(dim)
        self.init_weight = init_weight or initializers.normal(1.0)

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        return {"weight": self.init_weight(rng, (self.num_embeddings, self.dim))}

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        dtype = getattr(x, "dtype", None)
        if dtype is None or dtype.kind not in "iu":
            raise LayerError(
                f"{self}: expected integer indices in [0, {self.num_embeddings}), got "
                f"{type(x).__name__ if dtype is None else f'an array of dtype {dtype}'}"
            )
        check_params(self, ps, {"weight": (self.num_embeddings, self.dim)})
        # The indices' range: checked on the host for NumPy arrays, by the kernel on a GPU.
        return lookup_rows(ps["weight"], x, owner=str(self), error=LayerError), st

    def __repr__(self) -> str:
        return f"Embedding({self.num_embeddings} => {self.dim})"
