"""Terms added to the updates: decayed weights (L2 regularisation or AdamW's decoupled
decay) and annealed Gaussian noise.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from luxnn.backend import module_of

from .arrays import Params, Updates, cast_like, map_arrays, next_count, scalar_as, upcast, zero_count
from .base import EmptyState, FreshUpdates, FusedUpdate, GradientTransformation, Stage, Stateless, transformation
from .fused import Fragment, FusedStep
from .checks import check_float, check_match, check_params

__all__ = [
    "AddNoiseState", "add_decayed_weights", "add_noise",
]  # fmt: skip


class AddNoiseState(NamedTuple):
    """Step count and seed of `add_noise`."""

    count: Any
    rng_key: Any


def decayed(u: Any, p: Any, weight_decay: float) -> Any:
    """``u + weight_decay * p`` in the compute dtype, returned in `u`'s dtype."""
    out = upcast(p) * weight_decay
    out += u
    return cast_like(out, u)


# `decayed` as a fused fragment (`fused`).
DECAY_FRAGMENT = Fragment(
    "decay",
    "const double $weight_decay",
    "u = (P)(mul((T)p, $t_weight_decay) + (T)u);",
    lambda weight_decay, *, dtype: float(weight_decay),  # a Python float, as `_AddDecayedWeights.weight_decay`
    lambda weight_decay, u, p: decayed(u, p, weight_decay),
    prologue="const T $t_weight_decay = (T)$weight_decay;",
)


class _AddDecayedWeights(Stateless, FreshUpdates, FusedUpdate):

    def __init__(self, weight_decay: float) -> None:
        self.weight_decay = weight_decay

    def update(self, grads: Updates, state: EmptyState, params: Params = None) -> tuple[Updates, EmptyState]:
        self._check(grads, params)
        weight_decay = self.weight_decay
        return map_arrays(lambda u, p: decayed(u, p, weight_decay), grads, params), state

    def fused_step(self, grads: Updates, state: EmptyState, params: Params,
                   factor: Any = 1.0) -> tuple[FusedStep, EmptyState]:
        self._check(grads, params)
        return FusedStep(DECAY_FRAGMENT, (), (self.weight_decay,)), state

    @staticmethod
    def _check(grads: Updates, params: Params) -> None:
        check_params("add_decayed_weights", params)
        check_match(params, "params", grads, "grads")


def add_decayed_weights(weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """Add ``weight_decay * params`` to the updates (needs `params` in `update`); `mask`
    (a tree of bools, or a function of the parameters returning one) limits it to the
    leaves marked True, e.g. no decay on biases and norm scales (see `masked`).

    Before `scale_by_learning_rate` this is L2 regularisation, as PyTorch's SGD
    ``weight_decay``; after `scale_by_adam` it is AdamW's decoupled decay.

    >>> import numpy as np
    >>> t = add_decayed_weights(0.1)
    >>> t.update({"w": np.zeros(1)}, EmptyState(), {"w": np.ones(1)})[0]
    {'w': array([0.1])}
    """
    t = transformation(_AddDecayedWeights(check_float("add_decayed_weights: weight_decay", weight_decay)))
    if mask is None:
        return t
    from .wrappers import masked

    return masked(t, mask)


class _AddNoise(Stage):
    def __init__(self, eta: float, gamma: float, seed: int) -> None:
        self.eta, self.gamma, self.seed = eta, gamma, seed

    def init(self, params: Params) -> AddNoiseState:
        return AddNoiseState(count=zero_count(params), rng_key=np.asarray(self.seed, dtype=np.int64))

    def update(self, grads: Updates, state: AddNoiseState, params: Params = None):
        count = next_count(state.count)
        std = module_of(count).sqrt(self.eta / count**self.gamma)
        # The noise of step t comes from the seed and t alone (NumPy's generator, on the
        # host: reading the two 0-d arrays is no device round trip on the CPU).
        entropy = [int(_on_host(state.rng_key)), int(_on_host(count))]
        rng = np.random.default_rng(np.random.SeedSequence(entropy))

        def leaf(g: Any) -> Any:
            gc = upcast(g)
            xp = module_of(gc)
            noise = xp.asarray(rng.standard_normal(gc.shape, dtype=gc.dtype if gc.dtype.kind == "f" else None))
            noise *= scalar_as(std, gc.dtype)
            noise += gc
            return cast_like(noise, g)

        return map_arrays(leaf, grads), AddNoiseState(count=count, rng_key=state.rng_key)


def _on_host(x: Any) -> Any:
    return x.get() if hasattr(x, "get") else x


def add_noise(eta: float = 0.01, gamma: float = 0.55, seed: int = 0) -> GradientTransformation:
    """Add Gaussian noise of variance ``eta / t**gamma`` to the updates, t the 1-based
    step (Neelakantan et al. 2015, optax). The noise of each step is drawn from `seed` and
    the step alone (NumPy's generator on the host: on a GPU, one read of the count and one
    copy of the noise per step), so a run repeats exactly; it cannot equal optax's (JAX's
    generator) number for number.

    >>> import numpy as np
    >>> t = add_noise(0.01, 0.55, seed=0)
    >>> updates, state = t.update({"w": np.zeros(3)}, t.init({"w": np.zeros(3)}))
    """
    return transformation(_AddNoise(check_float("add_noise: eta", eta), check_float("add_noise: gamma", gamma),
                                    int(seed)))
