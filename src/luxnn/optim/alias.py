"""The named optimisers, each a `chain` of the building blocks of `transform`.

Defaults and numbers are optax's; where PyTorch's optimiser of the same name agrees,
configured alike, it is said. `rmsprop` and `adagrad` keep PyTorch's semantics (eps outside
the square root), as they always had in luxnn. `mask` arguments take a tree of bools or a
function of the parameters returning one (see `masked`).

>>> from luxnn import optim, tree
>>> opt = optim.adamw(3e-4, weight_decay=0.05, mask=lambda ps: tree.map(lambda p: p.ndim > 1, ps))
"""

from __future__ import annotations

from typing import Any

from .arrays import ScalarOrSchedule
from .base import GradientTransformation
from .combine import chain
from .checks import check_float, check_learning_rate
from .transform import (
    add_decayed_weights, add_noise, clip_by_block_rms, ema, scale, scale_by_adadelta, scale_by_adam,
    scale_by_adamax, scale_by_amsgrad, scale_by_belief, scale_by_factored_rms, scale_by_learning_rate,
    scale_by_lion, scale_by_param_block_rms, scale_by_radam, scale_by_rms, scale_by_rss, scale_by_stddev,
    scale_by_trust_ratio, trace,
)  # fmt: skip
from .wrappers import masked

__all__ = [
    "sgd", "noisy_sgd", "adam", "adamw", "nadam", "nadamw", "radam", "adamax", "adamaxw", "amsgrad",
    "adabelief", "adadelta", "adafactor", "lamb", "lars", "lion", "rmsprop", "adagrad",
]  # fmt: skip


def sgd(learning_rate: ScalarOrSchedule, momentum: float = 0.0, nesterov: bool = False) -> GradientTransformation:
    """Stochastic gradient descent, with optional (Nesterov) momentum, as ``torch.optim.SGD``.

    For L2 weight decay, put ``add_decayed_weights(wd)`` in front: ``chain(add_decayed_weights(wd), sgd(lr))``.

    >>> opt = sgd(0.1, momentum=0.9, nesterov=True)
    """
    learning_rate = check_learning_rate("sgd: learning_rate", learning_rate)
    momentum = check_float("sgd: momentum", momentum)
    if nesterov and momentum == 0.0:
        raise ValueError("sgd: nesterov=True needs momentum > 0, got momentum=0.0")
    if momentum == 0.0:
        return chain(scale_by_learning_rate(learning_rate))
    return chain(trace(momentum, nesterov), scale_by_learning_rate(learning_rate))


def noisy_sgd(learning_rate: ScalarOrSchedule, eta: float = 0.01, gamma: float = 0.55,
              seed: int = 0) -> GradientTransformation:
    """SGD on gradients with annealed Gaussian noise of variance ``eta / t**gamma`` added
    (Neelakantan et al. 2015; optax; the noise comes from NumPy's generator, see `add_noise`).

    >>> opt = noisy_sgd(0.1, eta=0.01, seed=42)
    """
    learning_rate = check_learning_rate("noisy_sgd: learning_rate", learning_rate)
    return chain(add_noise(eta, gamma, seed), scale_by_learning_rate(learning_rate))


def adam(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
         eps_root: float = 0.0, *, nesterov: bool = False) -> GradientTransformation:
    """Adam, as ``torch.optim.Adam`` and ``optax.adam`` (``nesterov=True``: `nadam`).

    >>> opt = adam(3e-4)
    """
    learning_rate = check_learning_rate("adam: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate))


def _decay(weight_decay: float, mask: Any, name: str) -> GradientTransformation:
    return add_decayed_weights(check_float(f"{name}: weight_decay", weight_decay), mask)


def adamw(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, weight_decay: float = 1e-4, mask: Any = None, *,
          nesterov: bool = False) -> GradientTransformation:
    """Adam with decoupled weight decay, ``p -= lr * (adam_direction + weight_decay * p)``,
    as ``torch.optim.AdamW`` and ``optax.adamw`` (the decay is scaled by the learning rate);
    `mask` limits the decay, e.g. to weight matrices.

    >>> opt = adamw(1e-3, weight_decay=1e-2)
    """
    learning_rate = check_learning_rate("adamw: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=nesterov), _decay(weight_decay, mask, "adamw"),
                 scale_by_learning_rate(learning_rate))


def nadam(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0) -> GradientTransformation:
    """Adam with Nesterov momentum, as ``optax.nadam`` (Dozat 2016). ``torch.optim.NAdam``
    differs: it multiplies the momentum by a decaying schedule (its ``momentum_decay``).

    >>> opt = nadam(1e-3)
    """
    learning_rate = check_learning_rate("nadam: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=True), scale_by_learning_rate(learning_rate))


def nadamw(learning_rate: ScalarOrSchedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
           eps_root: float = 0.0, weight_decay: float = 1e-4, mask: Any = None) -> GradientTransformation:
    """`nadam` with `adamw`'s decoupled weight decay, as ``optax.nadamw``.

    >>> opt = nadamw(1e-3, weight_decay=1e-2)
    """
    learning_rate = check_learning_rate("nadamw: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps, eps_root, nesterov=True), _decay(weight_decay, mask, "nadamw"),
                 scale_by_learning_rate(learning_rate))


def radam(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
          eps_root: float = 0.0, threshold: float = 5.0, *, nesterov: bool = False) -> GradientTransformation:
    """Rectified Adam (Liu et al. 2020), as ``optax.radam``; ``torch.optim.RAdam`` agrees
    but for eps, which it scales by ``sqrt(1 - b2**t)``, and ``ro > 5`` against ``ro >= 5``.

    >>> opt = radam(1e-3)
    """
    learning_rate = check_learning_rate("radam: learning_rate", learning_rate)
    return chain(scale_by_radam(b1, b2, eps, eps_root, threshold, nesterov=nesterov),
                 scale_by_learning_rate(learning_rate))


def adamax(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adamax, Adam with the infinity norm, as ``optax.adamax`` and ``torch.optim.Adamax``.

    >>> opt = adamax(2e-3)
    """
    learning_rate = check_learning_rate("adamax: learning_rate", learning_rate)
    return chain(scale_by_adamax(b1, b2, eps), scale_by_learning_rate(learning_rate))


def adamaxw(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            weight_decay: float = 1e-4, mask: Any = None) -> GradientTransformation:
    """`adamax` with decoupled weight decay, as ``optax.adamaxw``.

    >>> opt = adamaxw(2e-3, weight_decay=1e-2)
    """
    learning_rate = check_learning_rate("adamaxw: learning_rate", learning_rate)
    return chain(scale_by_adamax(b1, b2, eps), _decay(weight_decay, mask, "adamaxw"),
                 scale_by_learning_rate(learning_rate))


def amsgrad(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
            eps_root: float = 0.0, bias_correction_mu: bool = True,
            bias_correction_nu: bool = True) -> GradientTransformation:
    """AMSGrad, as ``optax.amsgrad`` (see `scale_by_amsgrad` for how PyTorch's
    ``Adam(amsgrad=True)`` differs).

    >>> opt = amsgrad(1e-3)
    """
    learning_rate = check_learning_rate("amsgrad: learning_rate", learning_rate)
    return chain(scale_by_amsgrad(b1, b2, eps, eps_root, bias_correction_mu, bias_correction_nu),
                 scale_by_learning_rate(learning_rate))


def adabelief(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-16,
              eps_root: float = 1e-16, *, nesterov: bool = False) -> GradientTransformation:
    """AdaBelief (Zhuang et al. 2020), as ``optax.adabelief``.

    >>> opt = adabelief(1e-3)
    """
    learning_rate = check_learning_rate("adabelief: learning_rate", learning_rate)
    return chain(scale_by_belief(b1, b2, eps, eps_root, nesterov=nesterov), scale_by_learning_rate(learning_rate))


def adadelta(learning_rate: ScalarOrSchedule = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0.0,
             weight_decay_mask: Any = None) -> GradientTransformation:
    """Adadelta (Zeiler 2012), as ``optax.adadelta`` and ``torch.optim.Adadelta`` (L2 decay
    added to the gradient first). The learning rate defaults to PyTorch's 1.0 (optax's
    None would add the direction without its minus sign).

    >>> opt = adadelta()
    """
    learning_rate = check_learning_rate("adadelta: learning_rate", learning_rate)
    return chain(_decay(weight_decay, weight_decay_mask, "adadelta"), scale_by_adadelta(rho, eps),
                 scale_by_learning_rate(learning_rate))


def adafactor(learning_rate: ScalarOrSchedule | None = None, min_dim_size_to_factor: int = 128,
              decay_rate: float = 0.8, decay_offset: int = 0, multiply_by_parameter_scale: bool = True,
              clipping_threshold: float | None = 1.0, momentum: float | None = None,
              weight_decay_rate: float | None = None, eps: float = 1e-30, factored: bool = True,
              weight_decay_mask: Any = None) -> GradientTransformation:
    """Adafactor (Shazeer & Stern 2018), as ``optax.adafactor``: factored second moments,
    per-leaf RMS clipping at `clipping_threshold`, steps relative to the parameters' RMS
    (`multiply_by_parameter_scale`), optional momentum (an `ema` without debiasing) and
    weight decay. With ``learning_rate=None`` the step is the parameter scale alone.

    >>> opt = adafactor(1e-2)
    """
    steps = [scale_by_factored_rms(factored, decay_rate, decay_offset, min_dim_size_to_factor, eps)]
    if clipping_threshold is not None:
        steps.append(clip_by_block_rms(clipping_threshold))
    if learning_rate is not None:
        steps.append(scale_by_learning_rate(check_learning_rate("adafactor: learning_rate", learning_rate),
                                            flip_sign=False))
    if multiply_by_parameter_scale:
        steps.append(scale_by_param_block_rms())
    if momentum is not None:
        steps.append(ema(momentum, debias=False))
    if weight_decay_rate is not None:
        steps.append(_decay(weight_decay_rate, weight_decay_mask, "adafactor"))
    steps.append(scale(-1.0))
    return chain(*steps)


def lamb(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-6,
         eps_root: float = 0.0, weight_decay: float = 0.0, mask: Any = None) -> GradientTransformation:
    """LAMB (You et al. 2020), as ``optax.lamb``: Adam's direction plus weight decay, scaled
    per leaf by the trust ratio ``|p| / |u|``.

    >>> opt = lamb(1e-3, weight_decay=1e-2)
    """
    learning_rate = check_learning_rate("lamb: learning_rate", learning_rate)
    return chain(scale_by_adam(b1, b2, eps, eps_root), _decay(weight_decay, mask, "lamb"), scale_by_trust_ratio(),
                 scale_by_learning_rate(learning_rate))


def lars(learning_rate: ScalarOrSchedule, weight_decay: float = 0.0, weight_decay_mask: Any = True,
         trust_coefficient: float = 0.001, eps: float = 0.0, trust_ratio_mask: Any = True, momentum: float = 0.9,
         nesterov: bool = False) -> GradientTransformation:
    """LARS (You et al. 2017), as ``optax.lars``: L2 decay, the trust ratio
    ``trust_coefficient * |p| / |u|`` per leaf, the learning rate, then momentum.

    >>> opt = lars(0.1, weight_decay=1e-4)
    """
    learning_rate = check_learning_rate("lars: learning_rate", learning_rate)
    return chain(
        _decay(weight_decay, weight_decay_mask, "lars"),
        masked(scale_by_trust_ratio(trust_coefficient=trust_coefficient, eps=eps), trust_ratio_mask),
        scale_by_learning_rate(learning_rate),
        trace(check_float("lars: momentum", momentum), nesterov),
    )  # fmt: skip


def lion(learning_rate: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.99, weight_decay: float = 1e-3,
         mask: Any = None) -> GradientTransformation:
    """Lion (Chen et al. 2023), as ``optax.lion``: the sign of a momentum mix, plus
    decoupled weight decay. Use a learning rate 3-10x smaller than AdamW's.

    >>> opt = lion(1e-4)
    """
    learning_rate = check_learning_rate("lion: learning_rate", learning_rate)
    return chain(scale_by_lion(b1, b2), _decay(weight_decay, mask, "lion"), scale_by_learning_rate(learning_rate))


def rmsprop(learning_rate: ScalarOrSchedule, decay: float = 0.9, eps: float = 1e-8, momentum: float = 0.0,
            centered: bool = False) -> GradientTransformation:
    """RMSprop with PyTorch's semantics: ``torch.optim.RMSprop(lr, alpha=decay, eps,
    momentum, centered)``. eps is added outside the square root, the averages start at 0,
    and momentum is applied before the learning rate (optax differs on the first and last).

    >>> opt = rmsprop(1e-2, decay=0.99, momentum=0.9, centered=True)
    """
    learning_rate = check_learning_rate("rmsprop: learning_rate", learning_rate)
    momentum = check_float("rmsprop: momentum", momentum)
    direction = scale_by_stddev(decay, eps) if centered else scale_by_rms(decay, eps)
    if momentum == 0.0:
        return chain(direction, scale_by_learning_rate(learning_rate))
    return chain(direction, trace(momentum), scale_by_learning_rate(learning_rate))


def adagrad(learning_rate: ScalarOrSchedule, initial_accumulator_value: float = 0.0,
            eps: float = 1e-10) -> GradientTransformation:
    """Adagrad with PyTorch's semantics (``torch.optim.Adagrad`` with lr_decay=0):
    ``p -= lr * g / (sqrt(sum g**2) + eps)``.

    >>> opt = adagrad(1e-2, initial_accumulator_value=0.1)
    """
    learning_rate = check_learning_rate("adagrad: learning_rate", learning_rate)
    return chain(scale_by_rss(initial_accumulator_value, eps), scale_by_learning_rate(learning_rate))
