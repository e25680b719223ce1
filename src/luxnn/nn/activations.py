"""Activations by name, for layers' ``activation=`` argument."""

from __future__ import annotations

from typing import Any, Callable

from .. import ops
from ..ad import primitives

ACTIVATIONS: dict[str, Callable[[Any], Any] | None] = {
    "identity": None,
    "relu": ops.relu,
    "gelu": ops.gelu,
    "tanh": primitives.tanh,
    "sigmoid": ops.sigmoid,
    "softplus": ops.softplus,
    "swish": ops.silu,
    "silu": ops.silu,
    "leaky_relu": ops.leaky_relu,
    "elu": ops.elu,
}


def get_activation(activation: str | Callable[[Any], Any] | None) -> Callable[[Any], Any] | None:
    """The function for `activation` (a name, a callable, or None); None means identity.

    >>> get_activation("relu").__name__
    'relu'
    """
    if activation is None or callable(activation):
        return activation
    if isinstance(activation, str) and activation in ACTIVATIONS:
        return ACTIVATIONS[activation]
    raise ValueError(f"unknown activation {activation!r}; expected a callable or one of {sorted(ACTIVATIONS)}")
