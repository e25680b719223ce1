"""luxnn: explicit-state neural networks on NumPy and CuPy, trained under a step-scoped
caching allocator.

>>> import numpy as np, luxnn as lx
>>> model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 2))
>>> ps, st = lx.setup(np.random.default_rng(0), model)
>>> lx.parameter_count(ps)
58
"""

from . import ad, data, distributed, init, losses, memory, nn, ops, optim, parallel, tree
from .checkpoint import CheckpointError, load, save
from .data import DataLoader
from .ad import AutoTape, array_namespace, grad, stop_gradient, value_and_grad
from .core import Layer, LayerError, apply, parameter_count, setup, testmode, trainmode
from .dtypes import DtypeWarning, get_dtype_policy, set_dtype_policy
from . import generators
from .generators import child_generator, draw
from .devices import CPUDevice, CUDADevice, cpu_device, get_device, gpu_device
from .memory import get_allocator_cache
from .nn import *  # noqa: F403 - the layers are the package's vocabulary
from .nn import __all__ as _layers
from .parallel import num_threads, set_num_threads
from .summary import outputsize, summary
from .training import (
    TrainState, apply_gradients, apply_gradients_, compute_gradients, single_train_step,
    single_train_step_,
)  # fmt: skip

__version__ = "0.1.0"

__all__ = [
    "ad", "data", "distributed", "init", "losses", "memory", "nn", "ops", "optim", "parallel", "tree", "load", "save", "CheckpointError",
    "num_threads", "set_num_threads", "summary", "outputsize",
    "DataLoader", "get_allocator_cache", "TrainState", "apply_gradients", "apply_gradients_",
    "compute_gradients", "single_train_step", "single_train_step_", "AutoTape", "array_namespace", "grad", "stop_gradient",
    "value_and_grad", "Layer", "LayerError", "apply", "parameter_count", "setup", "testmode",
    "trainmode", "DtypeWarning", "get_dtype_policy", "set_dtype_policy", "CPUDevice", "CUDADevice", "cpu_device", "get_device", "gpu_device", *_layers,
]  # fmt: skip
__all__ += ["generators", "child_generator", "draw"]
