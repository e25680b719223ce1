"""luxnn: explicit-state neural networks on NumPy and CuPy, trained under a step-scoped
caching allocator.

>>> import numpy as np, luxnn as lx
>>> model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 2))
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> lx.parameter_count(ps)
58
"""

from . import ad, init, nn, ops, tree
from .ad import AutoTape, array_namespace, grad, stop_gradient, value_and_grad
from .core import Layer, LayerError, apply, parameter_count, setup, testmode, trainmode
from .devices import CPUDevice, CUDADevice, cpu_device, get_device, gpu_device
from .nn import *  # noqa: F403 - the layers are the package's vocabulary
from .nn import __all__ as _layers

__version__ = "0.1.0"

__all__ = [
    "ad", "init", "nn", "ops", "tree", "AutoTape", "array_namespace", "grad", "stop_gradient",
    "value_and_grad", "Layer", "LayerError", "apply", "parameter_count", "setup", "testmode",
    "trainmode", "CPUDevice", "CUDADevice", "cpu_device", "get_device", "gpu_device", *_layers,
]  # fmt: skip
