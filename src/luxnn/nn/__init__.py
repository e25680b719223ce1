"""Layers."""

from .activations import ACTIVATIONS, get_activation
from .containers import Chain
from .dense import Dense

__all__ = ["ACTIVATIONS", "Chain", "Dense", "get_activation"]
