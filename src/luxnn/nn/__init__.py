"""Layers."""

from .activations import ACTIVATIONS, get_activation
from .containers import Chain
from .conv import Conv, ConvTranspose
from .pooling import AvgPool, GlobalAvgPool, GlobalMaxPool, MaxPool
from .shape import Flatten, Reshape
from .dense import Dense

__all__ = ["ACTIVATIONS", "Chain", "Dense", "get_activation"]
__all__ += ["Conv", "ConvTranspose", "MaxPool", "AvgPool", "GlobalMaxPool", "GlobalAvgPool", "Flatten", "Reshape"]
