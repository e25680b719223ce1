"""The CPU's implementations of the primitives of `luxnn.ops`, one module per area, chosen
by `luxnn.ops.traits.implementation` for NumPy arrays. They load with the package (NumPy
is every array's first device), so no primitive's first call pays for an import."""

from . import activations, attention, conv, cross_entropy, dense, embedding, norm, pool, recurrent, softmax

__all__ = ["activations", "attention", "conv", "cross_entropy", "dense", "embedding", "norm", "pool", "recurrent",
           "softmax"]  # fmt: skip
