"""CUDA's implementations of the primitives of `luxnn.ops`, one module per area (the same
functions as `luxnn.ops.cpu`'s), chosen by `luxnn.ops.traits.implementation` for CuPy
arrays: whole-batch kernels and luxnn's own CUDA kernels (`luxnn.kernels`)."""
