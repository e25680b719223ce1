"""The CPU's implementations of the primitives of `luxnn.ops`, one module per area, chosen
by `luxnn.ops.traits.implementation` for NumPy arrays."""
