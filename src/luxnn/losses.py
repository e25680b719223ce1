"""Loss objects. Each is a loss and an objective:

- ``loss(y_hat, y) -> scalar``
- ``loss(model, ps, st, (x, y)) -> (loss, st, stats)``, the objective the training API takes.

Predictions are batch first; class scores lie on the last axis. ``reduction`` is "mean"
(over the elements, or over the examples for losses per example), "sum" or "none". An
empty batch raises `ValueError`: a mean over no examples is NaN, and training on it would
carry the NaN into every parameter.

>>> import numpy as np
>>> loss = CrossEntropyLoss()
>>> float(loss(np.zeros((2, 3)), np.array([0, 2]))).__round__(4)
1.0986
"""

from __future__ import annotations

from typing import Any

import numpy as np

from . import ops
from .ad import array_namespace, stop_gradient

__all__ = [
    "Loss", "MSELoss", "L1Loss", "HuberLoss", "MSLELoss", "PoissonLoss", "HingeLoss",
    "SquaredHingeLoss", "CrossEntropyLoss", "NLLLoss", "KLDivergenceLoss", "BinaryCrossEntropyLoss",
    "FocalLoss", "BinaryFocalLoss", "DiceCoeffLoss",
]  # fmt: skip


class Loss:
    """Base of the losses: subclasses define `elementwise(y_hat, y)` (per element or per
    example); the base reduces it and adapts the loss to the objective signature."""

    reductions = ("mean", "sum", "none")

    def __init__(self, *, reduction: str = "mean") -> None:
        if reduction not in self.reductions:
            raise ValueError(f"{type(self).__name__}: reduction must be one of {self.reductions}, got {reduction!r}")
        self.reduction = reduction

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        raise NotImplementedError

    def value(self, y_hat: Any, y: Any) -> Any:
        """The reduced loss of predictions `y_hat` against targets `y`."""
        shape = getattr(y_hat, "shape", None)
        if shape is None:
            raise TypeError(f"{type(self).__name__}: expected an array of predictions, got {type(y_hat).__name__}")
        if (shape and shape[0] == 0) or getattr(y_hat, "size", 1) == 0:
            raise ValueError(f"{type(self).__name__}: empty batch (predictions of shape {shape}); a loss over no examples is undefined")
        return self._value(y_hat, y)

    def _value(self, y_hat: Any, y: Any) -> Any:
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
        if y_hat.shape != getattr(y, "shape", None):
            raise ValueError(f"{type(self).__name__}: expected targets of shape {y_hat.shape} like the predictions, got {getattr(y, 'shape', None)}")

    def _options(self) -> dict[str, Any]:
        """The constructor's options for the repr, besides the reduction."""
        return {}

    def __repr__(self) -> str:
        options = {**self._options(), "reduction": self.reduction}
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in options.items())})"


def _epsilon(epsilon: float | None, x: Any) -> float:
    """`epsilon`, or by default the machine epsilon of x's dtype (Lux's default)."""
    return float(np.finfo(x.dtype).eps) if epsilon is None else epsilon


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


class HuberLoss(Loss):
    """Huber loss, as ``torch.nn.HuberLoss(delta=...)`` and Lux's: ``0.5 * d^2`` where
    ``|d| <= delta`` and ``delta * (|d| - 0.5 * delta)`` beyond, for ``d = y_hat - y``.

    >>> float(HuberLoss(delta=1.0)(np.array([0.5, 3.0]), np.zeros(2)))
    1.3125
    """

    def __init__(self, delta: float = 1.0, *, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if not delta > 0:
            raise ValueError(f"HuberLoss: delta must be positive, got {delta!r}")
        self.delta = float(delta)

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        xp = array_namespace(y_hat, y)
        d = y_hat - y
        size = xp.abs(d)
        return xp.where(stop_gradient(size) <= self.delta, 0.5 * d * d, self.delta * (size - 0.5 * self.delta))

    def _options(self) -> dict[str, Any]:
        return {"delta": self.delta}


class MSLELoss(Loss):
    """Mean squared logarithmic error, as Lux's:
    ``(log(y_hat + epsilon) - log(y + epsilon))^2``, `epsilon` by default the machine
    epsilon of the predictions' dtype.

    >>> round(float(MSLELoss()(np.array([1.1, 2.2, 3.3]), np.array([1.0, 2.0, 3.0]))), 6)
    0.009084
    """

    def __init__(self, *, epsilon: float | None = None, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.epsilon = epsilon

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        xp, eps = array_namespace(y_hat, y), _epsilon(self.epsilon, y_hat)
        d = xp.log(y_hat + eps) - xp.log(y + eps)
        return d * d

    def _options(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon}


class PoissonLoss(Loss):
    """Poisson negative log-likelihood without its constant term, as
    ``torch.nn.PoissonNLLLoss(full=False)``: ``y_hat - y * log(y_hat + epsilon)`` for
    predicted rates (Lux's PoissonLoss, the default), or ``exp(y_hat) - y * y_hat`` for
    log-rates with ``log_input=True`` (PyTorch's default).

    >>> round(float(PoissonLoss()(np.array([1.0, 3.0, 3.0]), np.array([1.0, 2.0, 3.0]))), 6)
    0.502313
    """

    def __init__(self, *, log_input: bool = False, epsilon: float = 1e-8, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.log_input = bool(log_input)
        self.epsilon = float(epsilon)

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        xp = array_namespace(y_hat, y)
        if self.log_input:
            return xp.exp(y_hat) - y * y_hat
        return y_hat - y * xp.log(y_hat + self.epsilon)

    def _options(self) -> dict[str, Any]:
        return {"log_input": self.log_input, "epsilon": self.epsilon}


class HingeLoss(Loss):
    """Hinge loss for targets in {-1, 1}, as Lux's: ``max(0, 1 - y_hat * y)``.

    >>> float(HingeLoss()(np.array([0.5, 2.0]), np.array([1.0, -1.0])))
    1.75
    """

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        return array_namespace(y_hat, y).maximum(1 - y_hat * y, 0)


class SquaredHingeLoss(Loss):
    """Squared hinge loss for targets in {-1, 1}, as Lux's: ``max(0, 1 - y_hat * y)^2``.

    >>> float(SquaredHingeLoss()(np.array([0.5, 2.0]), np.array([1.0, -1.0])))
    4.625
    """

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        margin = array_namespace(y_hat, y).maximum(1 - y_hat * y, 0)
        return margin * margin


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

    def _options(self) -> dict[str, Any]:
        return {"label_smoothing": self.label_smoothing} if self.label_smoothing else {}


def _is_labels(y: Any) -> bool:
    return getattr(y, "dtype", np.dtype(float)).kind in "iub"


class _ClassTargets:
    """What the losses over class scores ``(..., K)`` share: targets as integer labels of
    shape ``y_hat.shape[:-1]`` or as probabilities of the shape of ``y_hat``, per-class
    `weight` ``(K,)`` and an `ignore_index` label, checked alike (as PyTorch's)."""

    def _init_classes(self, weight: Any, ignore_index: int | None) -> None:
        if weight is not None:
            weight = np.asarray(weight)
            if weight.ndim != 1 or weight.dtype.kind not in "fiu" or (weight < 0).any():
                raise ValueError(f"{type(self).__name__}: weight must be a 1-D array of non-negative class weights, got {weight!r}")
        if ignore_index is not None and (not isinstance(ignore_index, (int, np.integer)) or isinstance(ignore_index, bool)):
            raise ValueError(f"{type(self).__name__}: ignore_index must be an int or None, got {ignore_index!r}")
        self.weight = weight
        self.ignore_index = None if ignore_index is None else int(ignore_index)

    def _check_classes(self, y_hat: Any, y: Any) -> None:
        k = y_hat.shape[-1] if y_hat.ndim else 0
        if self.weight is not None and self.weight.shape != (k,):
            raise ValueError(f"{type(self).__name__}: expected a weight per class ({k},), got {self.weight.shape}")
        if not _is_labels(y):
            if self.ignore_index is not None:
                raise ValueError(f"{type(self).__name__}: ignore_index applies to integer labels, got targets of dtype {y.dtype}")
            shape = getattr(y, "shape", None)
            if shape != y_hat.shape:
                hint = "; class labels must be integers (e.g. y.astype(np.int64))" if shape == y_hat.shape[:-1] else ""
                raise ValueError(
                    f"{type(self).__name__}: expected integer class labels of shape {y_hat.shape[:-1]} or class "
                    f"probabilities of shape {y_hat.shape}, got targets of shape {shape} and dtype "
                    f"{getattr(y, 'dtype', type(y).__name__)}{hint}"
                )
            return
        if y.shape != y_hat.shape[:-1]:
            raise ValueError(f"{type(self).__name__}: expected integer labels of shape {y_hat.shape[:-1]}, got {y.shape}")

    def _class_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {} if self.weight is None else {"weight": self.weight.tolist()}
        if self.ignore_index is not None:
            options["ignore_index"] = self.ignore_index
        return options


def _pick(xp: Any, scores: Any, labels: Any) -> Any:
    """``scores[..., labels]``: each example's entry at its label, shape ``labels.shape``."""
    k = scores.shape[-1]
    flat = array_namespace(labels).arange(labels.size) * k + labels.reshape(-1)
    return xp.reshape(xp.take(xp.reshape(scores, (-1,)), flat), labels.shape)


class CrossEntropyLoss(_LabelSmoothingLoss, _ClassTargets):
    """Softmax cross-entropy from logits over the last axis, as ``torch.nn.CrossEntropyLoss``.

    Targets are integer class labels of shape ``y_hat.shape[:-1]`` (fused kernel) or
    probabilities of the same shape as ``y_hat``. ``label_smoothing=s`` mixes the target
    with the uniform distribution: ``(1 - s) * target + s / K``. `weight` ``(K,)`` weighs
    each class; labels equal to `ignore_index` count for nothing. "mean" averages over the
    examples: with labels, divided by the total weight of the examples not ignored (their
    count without `weight`), as PyTorch; with probabilities, by the number of examples.

    >>> loss = CrossEntropyLoss(weight=np.array([1.0, 3.0]), ignore_index=-100)
    >>> round(float(loss(np.zeros((3, 2)), np.array([0, 1, -100]))), 4)
    0.6931
    """

    def __init__(
        self, *, label_smoothing: float = 0.0, weight: Any = None, ignore_index: int | None = None, reduction: str = "mean"
    ) -> None:
        super().__init__(label_smoothing=label_smoothing, reduction=reduction)
        self._init_classes(weight, ignore_index)

    def _value(self, y_hat: Any, y: Any) -> Any:
        if not _is_labels(y):
            return super()._value(y_hat, y)
        self._check_classes(y_hat, y)  # integer labels: the fused kernel checks them and does the reduction too
        return ops.softmax_cross_entropy(
            y_hat, y, label_smoothing=self.label_smoothing, reduction=self.reduction, weight=self.weight,
            ignore_index=self.ignore_index, owner=type(self).__name__,
        )  # fmt: skip

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_classes(y_hat, y)
        if _is_labels(y):
            return ops.softmax_cross_entropy(
                y_hat, y, label_smoothing=self.label_smoothing, weight=self.weight, ignore_index=self.ignore_index,
                owner=type(self).__name__,
            )
        self._check_same_shape(y_hat, y)
        target = self._smooth(y, y_hat.shape[-1])
        if self.weight is not None:
            target = target * array_namespace(y_hat).asarray(self.weight, dtype=y_hat.dtype)
        return -(target * ops.log_softmax(y_hat, axis=-1)).sum(axis=-1)

    def _options(self) -> dict[str, Any]:
        return {**super()._options(), **self._class_options()}


class NLLLoss(Loss, _ClassTargets):
    """Negative log-likelihood of integer labels under log-probabilities ``(..., K)`` (a
    `log_softmax`'s output), as ``torch.nn.NLLLoss``: ``-weight[y] * y_hat[..., y]``;
    labels equal to `ignore_index` count for nothing, and "mean" divides by the total
    weight of the examples not ignored.

    >>> logp = np.log(np.array([[0.5, 0.5], [0.9, 0.1]]))
    >>> round(float(NLLLoss()(logp, np.array([0, 1]))), 4)
    1.4979
    """

    def __init__(self, *, weight: Any = None, ignore_index: int | None = None, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self._init_classes(weight, ignore_index)

    def _value(self, y_hat: Any, y: Any) -> Any:
        if not _is_labels(y):
            raise ValueError(f"NLLLoss: expected integer labels, got targets of dtype {getattr(y, 'dtype', type(y).__name__)}")
        self._check_classes(y_hat, y)  # the fused kernel checks the labels' range
        return ops.nll_loss(y_hat, y, reduction=self.reduction, weight=self.weight, ignore_index=self.ignore_index,
                            owner="NLLLoss")

    def _options(self) -> dict[str, Any]:
        return self._class_options()


class KLDivergenceLoss(Loss):
    """Kullback-Leibler divergence of the target distribution from the predicted one, as
    ``torch.nn.KLDivLoss(log_target=False)``: ``y * (log y - y_hat)`` (0 where y is 0) for
    predicted log-probabilities `y_hat` and target probabilities `y` of one shape;
    ``from_logits=True`` takes logits over the last axis (their `log_softmax`).

    Reductions as PyTorch's: "mean" over every element, "batchmean" (the divergence per
    example, Lux's KLDivergenceLoss) sums and divides by the batch size, "sum", "none".

    >>> p = np.array([[0.5, 0.5]])
    >>> round(float(KLDivergenceLoss(reduction="batchmean")(np.log([[0.25, 0.75]]), p)), 4)
    0.1438
    """

    reductions = ("mean", "batchmean", "sum", "none")

    def __init__(self, *, from_logits: bool = False, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        self.from_logits = bool(from_logits)

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        xp = array_namespace(y_hat, y)
        log_p = ops.log_softmax(y_hat, axis=-1) if self.from_logits else y_hat
        positive = y > 0
        return xp.where(positive, y * xp.log(xp.where(positive, y, 1)), 0) - y * log_p

    def _reduce(self, values: Any) -> Any:
        if self.reduction == "batchmean":
            return values.sum() / (values.shape[0] if values.ndim else 1)
        return super()._reduce(values)

    def _options(self) -> dict[str, Any]:
        return {"from_logits": self.from_logits} if self.from_logits else {}


class BinaryCrossEntropyLoss(_LabelSmoothingLoss):
    """Binary cross-entropy from logits: ``softplus(x) - x * y``, stable for any x;
    targets in [0, 1] of the logits' shape, optionally smoothed towards 1/2."""

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        # Two classes: the smoothed target moves towards 1/2.
        return ops.softplus(y_hat) - y_hat * self._smooth(y, 2)


class _FocalLoss(Loss):
    """The focal losses' options: the focusing exponent `gamma` and whether the
    predictions are logits or probabilities."""

    def __init__(self, gamma: float = 2.0, *, from_logits: bool = True, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if not (isinstance(gamma, (int, float)) and gamma >= 0):
            raise ValueError(f"{type(self).__name__}: gamma must be a number >= 0, got {gamma!r}")
        self.gamma = float(gamma)
        self.from_logits = bool(from_logits)

    def _options(self) -> dict[str, Any]:
        return {"gamma": self.gamma, **({} if self.from_logits else {"from_logits": False})}


class FocalLoss(_FocalLoss):
    """Focal loss over classes (Lin et al. 2017, Lux's FocalLoss): per example
    ``-sum_c y_c * (1 - p_c)^gamma * log p_c``, which down-weighs well-classified
    examples; ``gamma = 0`` is the cross-entropy. `y_hat` are logits over the last axis
    (``p = softmax(y_hat)``), or probabilities with ``from_logits=False`` (Lux's input,
    offset by the dtype's epsilon); targets are integer labels or probabilities, as for
    `CrossEntropyLoss`. "mean" averages over the examples.

    >>> round(float(FocalLoss(gamma=0.0)(np.zeros((2, 4)), np.array([0, 3]))), 4)
    1.3863
    """

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        xp = array_namespace(y_hat, y)
        if self.from_logits:
            log_p = ops.log_softmax(y_hat, axis=-1)
            p = xp.exp(log_p)
        else:
            p = y_hat + _epsilon(None, y_hat)
            log_p = xp.log(p)
        terms = xp.clip(1 - p, 0, None) ** self.gamma * log_p
        if _is_labels(y):
            if y.shape != y_hat.shape[:-1] or (y.size and (int(y.min()) < 0 or int(y.max()) >= y_hat.shape[-1])):
                raise ValueError(f"FocalLoss: expected integer labels in [0, {y_hat.shape[-1]}) of shape {y_hat.shape[:-1]}, got shape {y.shape}")
            return -_pick(xp, terms, y)
        self._check_same_shape(y_hat, y)
        return -(y * terms).sum(axis=-1)


class BinaryFocalLoss(_FocalLoss):
    """Binary focal loss (Lin et al. 2017; Lux's BinaryFocalLoss): ``(1 - p_t)^gamma``
    times the binary cross-entropy, ``p_t = y * p + (1 - y) * (1 - p)``; for targets in
    {0, 1} that is Lux's ``-(1 - p_t)^gamma * log(p_t)``. `y_hat` are logits
    (``p = sigmoid(y_hat)``, stable for any value; torchvision's ``sigmoid_focal_loss``
    without alpha), or probabilities with ``from_logits=False`` (Lux's form, offset by
    the dtype's epsilon).

    >>> y = np.array([[0.0, 1, 0], [1, 0, 1]])
    >>> p = np.array([[0.268941, 0.5, 0.268941], [0.731059, 0.5, 0.731059]])
    >>> round(float(BinaryFocalLoss(from_logits=False)(p, y)), 6)
    0.072868
    """

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        xp = array_namespace(y_hat, y)
        if self.from_logits:
            p = ops.sigmoid(y_hat)
            p_t = y * p + (1 - y) * (1 - p)
            cross_entropy = ops.softplus(y_hat) - y_hat * y
            return xp.clip(1 - p_t, 0, None) ** self.gamma * cross_entropy
        p = y_hat + _epsilon(None, y_hat)
        p_t = y * p + (1 - y) * (1 - p)
        return -(xp.clip(1 - p_t, 0, None) ** self.gamma) * xp.log(p_t)


class DiceCoeffLoss(Loss):
    """Dice coefficient loss for segmentation (Milletari et al. 2016), as Lux's: per
    example ``1 - (2 * sum(y * y_hat) + smooth) / (sum(y_hat^2) + sum(y^2) + smooth)``
    over all axes but the batch axis (over everything for 1-D input); "mean" averages over
    the examples.

    >>> round(float(DiceCoeffLoss()(np.array([1.1, 2.1, 3.1]), np.array([1.0, 2.0, 3.0]))), 6)
    0.000992
    """

    def __init__(self, *, smooth: float = 1.0, reduction: str = "mean") -> None:
        super().__init__(reduction=reduction)
        if not smooth >= 0:
            raise ValueError(f"DiceCoeffLoss: smooth must be >= 0, got {smooth!r}")
        self.smooth = float(smooth)

    def elementwise(self, y_hat: Any, y: Any) -> Any:
        self._check_same_shape(y_hat, y)
        axes = tuple(range(1, y_hat.ndim)) if y_hat.ndim > 1 else None
        overlap = (y * y_hat).sum(axis=axes)
        total = (y_hat * y_hat).sum(axis=axes) + (y * y).sum(axis=axes)
        return 1 - (2 * overlap + self.smooth) / (total + self.smooth)

    def _options(self) -> dict[str, Any]:
        return {"smooth": self.smooth}
