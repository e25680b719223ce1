"""Layers."""

from .activations import ACTIVATIONS, get_activation
from .containers import Chain
from .conv import Conv, ConvTranspose
from .pooling import AdaptiveAvgPool, AdaptiveMaxPool, AvgPool, GlobalAvgPool, GlobalMaxPool, MaxPool
from .upsampling import PixelShuffle, Upsample
from .shape import Flatten, Reshape
from .dense import Dense
from .attention import MultiHeadAttention
from .containers import Parallel, SkipConnection
from .dropout import AlphaDropout, Dropout
from .embedding import Embedding
from .normalization import BatchNorm, GroupNorm, InstanceNorm, LayerNorm, RMSNorm
from .stateful import StatefulLayer
from .basic import Bilinear, NoOpLayer, Scale, WrappedFunction
from .containers import BranchLayer, Maxout, PairwiseFusion, RepeatedLayer
from .recurrent import GRUCell, LSTMCell, RecurrentCell, RNNCell, Steps
from .recurrence import Bidirectional, Padded, Recurrence
from .rnn import GRU, LSTM, RNN
from .positional import RotaryPositionalEmbedding, SinusoidalPositionalEmbedding

__all__ = ["ACTIVATIONS", "Chain", "Dense", "get_activation"]
__all__ += [
    "MultiHeadAttention", "Parallel", "SkipConnection", "Dropout", "Embedding", "BatchNorm",
    "GroupNorm", "LayerNorm", "RMSNorm", "StatefulLayer",
]  # fmt: skip
__all__ += ["Conv", "ConvTranspose", "MaxPool", "AvgPool", "GlobalMaxPool", "GlobalAvgPool", "Flatten", "Reshape"]
__all__ += [
    "WrappedFunction", "NoOpLayer", "Scale", "Bilinear", "BranchLayer", "Maxout", "PairwiseFusion",
    "RepeatedLayer", "InstanceNorm", "AlphaDropout", "AdaptiveAvgPool", "AdaptiveMaxPool", "Upsample",
    "PixelShuffle",
]  # fmt: skip
__all__ += ["Steps", "RecurrentCell", "RNNCell", "LSTMCell", "GRUCell", "Recurrence", "Bidirectional", "Padded"]
__all__ += ["LSTM", "GRU", "RNN"]
__all__ += ["SinusoidalPositionalEmbedding", "RotaryPositionalEmbedding"]
