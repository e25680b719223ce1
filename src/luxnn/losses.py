"""Loss objects. Each is a loss and an objective:

- ``loss(y_hat, y) -> scalar``
- ``loss(model, ps, st, (x, y)) -> (loss, st, stats)``, the objective the training API takes.

>>> import numpy as np
>>> loss = CrossEntropyLoss()
>>> float(loss(np.zeros((2, 3)), np.array([0, 2]))).__round__(4)
1.0986
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import ops
from .ad import array_namespace

__all__ = ["Loss", "MSELoss", "L1Loss", "CrossEntropyLoss", "BinaryCrossEntropyLoss"]

_REDUCTIONS = ("mean", "sum", "none")


class Loss:
    """Base of the losses: subclasses define `elementwise(y_hat, y)` (per element or per
    example); the base reduces it and adapts the loss to the objective signature."""

    def __init__(self, *, reduction: str = "mean") -> None:
        if reduction not in _REDUCTIONS:
            raise ValueError(f"{type(self).__name__}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
        self.reduction = reduction

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        raise NotImplementedError

    def value(self, y_hat: Any, y: Any) -> Any:
        """The reduced loss of predictions `y_hat` against targets `y`."""
        return self._reduce(self.elementwise(y_hat, y))

    def __call__(self, *args: Any) -> Any:
        if len(args) == 2:
            return self.value(*args)
        if len(args) == 4:
            model, ps, st, data = args
            if not (isinstance(data, (tuple, list)) and len(data) == 2):
                raise ValueError(f"{type(self).__name__}: expected data as a pair (x, y), got {type(data).__name__}")
            x, y = data
            y_hat, st = model(x, ps, st)
            return self.value(y_hat, y), st, {}
        raise TypeError(
            f"{type(self).__name__} takes (y_hat, y) as a loss or (model, ps, st, data) as an "
            f"objective; got {len(args)} arguments"
        )

    def _reduce(self, values: Any) -> Any:
        if self.reduction == "mean":
            return values.mean()
        if self.reduction == "sum":
            return values.sum()
        return values

    def _check_same_shape(self, y_hat: Any, y: Any) -> None:
        if y_hat.shape != y.shape:
            raise ValueError(f"{type(self).__name__}: expected targets of shape {y_hat.shape} like the predictions, got {y.shape}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


class MSELoss(Loss):
    """Mean squared error ``(y_hat - y)^2``; shapes must agree exactly."""

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        diff = y_hat - y
        return diff * diff


class L1Loss(Loss):
    """Mean absolute error ``|y_hat - y|``; shapes must agree exactly."""

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        return array_namespace(y_hat, y).abs(y_hat - y)


class _LabelSmoothingLoss(Loss):
    """A loss whose targets may be smoothed towards the uniform distribution over the
    classes, ``(1 - s) * target + s / K``: the same option, checked and applied alike, for
    the softmax (K classes) and the binary (K = 2) cross-entropy."""

    def __init__(self, *, label_smoothing: float = 0.0, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if not 0.0 <= label_smoothing < 1.0:
            raise ValueError(f"{type(self).__name__}: label_smoothing must be in [0, 1), got {label_smoothing}")
        self.label_smoothing = float(label_smoothing)

    def _smooth(self, y: Any, num_classes: int) -> Any:
        if not self.label_smoothing:
            return y
        return y * (1 - self.label_smoothing) + self.label_smoothing / num_classes


class CrossEntropyLoss(_LabelSmoothingLoss):
    """Softmax cross-entropy from logits over the last axis.

    Targets are integer class labels of shape ``y_hat.shape[:-1]`` (fused kernel) or
    probabilities of the same shape as ``y_hat``. ``label_smoothing=s`` mixes the target
    with the uniform distribution: ``(1 - s) * target + s / K``. Reduction averages over
    examples.
    """

    def value(self, y_hat: Any, y: Any) -> Any:
        if not _is_labels(y):
            return super().value(y_hat, y)
        self._check_labels(y_hat, y)  # integer labels: the fused kernel does the reduction too
        return ops.softmax_cross_entropy(y_hat, y, label_smoothing=self.label_smoothing, reduction=self.reduction)

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        k = y_hat.shape[-1] if y_hat.ndim else 0
        if _is_labels(y):
            self._check_labels(y_hat, y)
            return ops.softmax_cross_entropy(y_hat, y, label_smoothing=self.label_smoothing)
        self._check_same_shape(y_hat, y)
        return -(self._smooth(y, k) * ops.log_softmax(y_hat, axis=-1)).sum(axis=-1)

    def _check_labels(self, y_hat: Any, y: Any) -> None:
        k = y_hat.shape[-1] if y_hat.ndim else 0
        if y.shape != y_hat.shape[:-1]:
            raise ValueError(f"CrossEntropyLoss: expected integer labels of shape {y_hat.shape[:-1]}, got {y.shape}")
        if y.size and (int(y.min()) < 0 or int(y.max()) >= k):
            raise ValueError(f"CrossEntropyLoss: labels must lie in [0, {k}), got values in [{int(y.min())}, {int(y.max())}]")


def _is_labels(y: Any) -> bool:
    return getattr(y, "dtype", np.dtype(float)).kind in "iub"


class BinaryCrossEntropyLoss(_LabelSmoothingLoss):
    """Binary cross-entropy from logits: ``softplus(x) - x * y``, stable for any x;
    targets in [0, 1] of the logits' shape, optionally smoothed towards 1/2."""

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        # Two classes: the smoothed target moves towards 1/2.
        return ops.softplus(y_hat) - y_hat * self._smooth(y, 2)
