"""Normalisation layers: BatchNorm, InstanceNorm, LayerNorm, GroupNorm, RMSNorm
(channel-last inputs). BatchNorm, InstanceNorm, LayerNorm and GroupNorm take an
``activation`` applied after the affine map, as Lux's."""

from __future__ import annotations

import math
from typing import Any, Callable

import numpy as np

from ..ad import stop_gradient
from ..core import check_params, input_shape, Layer, LayerError
from ..dtypes import match_eltype
from ..ops.norm import frozen_normalize, moments, normalize, normalize_affine, rms_normalize, scale_shift, update_running
from .activations import get_activation

__all__ = ["BatchNorm", "InstanceNorm", "LayerNorm", "GroupNorm", "RMSNorm"]

Activation = str | Callable[[Any], Any] | None


def _positive_int(owner: str, name: str, n: Any) -> int:
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {n!r}")
    return int(n)


def _shape_arg(owner: str, shape: int | tuple[int, ...]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not dims:
        raise ValueError(f"{owner}: shape must have at least one dimension, got {shape!r}")
    return tuple(_positive_int(owner, "shape", n) for n in dims)


def _non_negative(owner: str, name: str, value: float) -> float:
    if not value >= 0:
        raise ValueError(f"{owner}: {name} must be >= 0, got {value!r}")
    return float(value)


def _options(**flags: Any) -> str:
    return "".join(f", {k}={v}" for k, v in flags.items())


class _Norm(Layer):
    """What the normalisation layers share: epsilon, the optional learned affine map
    ``y * scale (+ bias)`` over `_affine_shape` (without a bias where `with_bias` is False),
    and the activation after it."""

    default_epsilon = 1e-5
    default_affine = True
    with_bias = True

    def _init_affine(self, epsilon: float, affine: bool, shape: tuple[int, ...], activation: Activation = None) -> None:
        self.epsilon = _non_negative(type(self).__name__, "epsilon", epsilon)
        self.affine = bool(affine)
        self._affine_shape = shape
        self.activation = get_activation(activation)

    def _input(self, x: Any, ps: dict[str, Any]) -> Any:
        """`x` after the parameter check, in the parameters' dtype (the dtype policy)."""
        self._check_params(ps)
        return match_eltype(self, x, ps["scale"] if self.affine else None)

    def _activate(self, y: Any) -> Any:
        return y if self.activation is None else self.activation(y)

    def init_params(self, rng: np.random.Generator) -> dict[str, Any]:
        if not self.affine:
            return {}
        ps = {"scale": np.ones(self._affine_shape, np.float32)}
        if self.with_bias:
            ps["bias"] = np.zeros(self._affine_shape, np.float32)
        return ps

    def _check_params(self, ps: dict[str, Any]) -> None:
        names = ("scale", "bias") if self.with_bias else ("scale",)
        check_params(self, ps, {name: self._affine_shape for name in names} if self.affine else {})

    def _normalize(self, x: Any, ps: dict[str, Any], axes: tuple[int, ...], *, stats: Any = None,
                   centre: bool = True, scale_shape: tuple[int, ...] | None = None) -> Any:
        """`x` normalised over `axes` (centred, or by its root mean square), then the affine
        map (of its parameters reshaped to `scale_shape`): one fused primitive."""
        if not self.affine:
            if centre:
                return normalize(x, axis=axes, epsilon=self.epsilon, stats=stats)
            return rms_normalize(x, axis=axes, epsilon=self.epsilon)
        scale, bias = ps["scale"], ps["bias"] if self.with_bias else None
        if scale_shape is not None:
            scale, bias = scale.reshape(scale_shape), None if bias is None else bias.reshape(scale_shape)
        return normalize_affine(x, scale, bias, axis=axes, epsilon=self.epsilon, stats=stats, centre=centre)

    def _scale_and_shift(self, y: Any, ps: dict[str, Any]) -> Any:
        if not self.affine:
            return y
        return scale_shift(y, ps["scale"], ps["bias"]) if self.with_bias else y * ps["scale"]

    def _flags(self) -> dict[str, Any]:
        """The repr's keyword options that differ from their defaults."""
        flags: dict[str, Any] = {"epsilon": self.epsilon} if self.epsilon != self.default_epsilon else {}
        if self.affine != self.default_affine:
            flags["affine"] = self.affine
        if self.activation is not None:
            flags["activation"] = getattr(self.activation, "__name__", self.activation)
        return flags


def _check_channels_last(layer: Layer, x: Any, channels: int) -> tuple[int, ...]:
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) < 2 or shape[-1] != channels:
        raise LayerError(f"{layer}: expected input of shape (N, ..., {channels}) (channels last), got {input_shape(x)}")
    return shape


def _data_parallel_step() -> Any:
    """The data-parallel step in progress over several ranks (a `DistributedOptimizer`'s,
    see `luxnn.distributed.step`), else None."""
    from ..distributed.step import current

    return current()


class _RunningNorm(_Norm):
    """A norm over statistics of the batch that can keep running averages of them, as
    PyTorch's BatchNorm and InstanceNorm: in training mode the batch's statistics, and
    ``running = (1 - momentum) * running + momentum * batch`` with the unbiased variance;
    in test mode the running statistics. Subclasses say which axes a statistic spans.

    In a data-parallel step over several ranks (the forward pass of `compute_gradients` or
    `single_train_step*` with a `luxnn.distributed.DistributedOptimizer`), the running
    statistics updated in training mode are averaged over the ranks (weighted by their
    batch sizes), so that the replicas' states stay equal: an average rather than rank 0's (what PyTorch DDP
    broadcasts) because it uses every rank's batch, for one small allreduce per layer as
    a broadcast would take. ``sync`` (BatchNorm's) normalises with the global batch's
    statistics there. Anywhere else (a rank training a model of its own, evaluation, a
    loop of its own around `luxnn.value_and_grad`) the layer uses its rank's batch alone."""

    default_track_stats = True
    statistic_of = "channel"  # what one statistic is of, for messages
    sync = False

    def _init_running(
        self, num_features: int, activation: Activation, momentum: float, epsilon: float, affine: bool, track_stats: bool
    ) -> None:
        owner = type(self).__name__
        self.num_features = _positive_int(owner, "num_features", num_features)
        if not 0.0 <= momentum <= 1.0:
            raise ValueError(f"{owner}: momentum must be in [0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        self.track_stats = bool(track_stats)
        self._init_affine(epsilon, affine, (self.num_features,), activation)

    def _statistic_axes(self, x: Any) -> tuple[int, ...]:
        raise NotImplementedError

    def init_state(self, rng: np.random.Generator) -> dict[str, Any]:
        if not self.track_stats:
            return {"training": True}
        c = self.num_features
        return {"running_mean": np.zeros(c, np.float32), "running_var": np.ones(c, np.float32), "training": True}

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = self._statistic_axes(x)
        x = self._input(x, ps)
        expected_state = {"running_mean", "running_var", "training"} if self.track_stats else {"training"}
        if not isinstance(st, dict) or st.keys() != expected_state:
            raise LayerError(f"{self}: expected state keys {sorted(expected_state)}, got {sorted(st) if isinstance(st, dict) else type(st).__name__}")
        training = st["training"]
        if training or not self.track_stats:
            y, st = self._batch_statistics(x, ps, st, axes, update=training and self.track_stats)
            return self._activate(y), st
        # Test mode: the running statistics fold into one per-channel scale and shift.
        scale, bias = (ps["scale"], ps["bias"]) if self.affine else (None, None)
        y = frozen_normalize(x, scale, bias, st["running_mean"], st["running_var"], epsilon=self.epsilon)
        return self._activate(y), st

    def _batch_statistics(self, x: Any, ps: dict[str, Any], st: dict[str, Any], axes: tuple[int, ...],
                          update: bool) -> tuple[Any, dict[str, Any]]:
        """`x` normalised with its batch's statistics and mapped by the affine map, and the
        state (its running statistics updated where `update`)."""
        step = _data_parallel_step()
        if self.sync and step is not None:
            y, st = self._global_batch_statistics(x, st, axes, update, step)
            return self._scale_and_shift(y, ps), st
        if not update:
            return self._normalize(x, ps, axes), st
        count = self._check_count(x, math.prod(x.shape[a] for a in axes))
        # The statistics come from the raw values: the running statistics must never hold
        # (or keep alive) traced values, and normalize's VJP already accounts for them.
        mean, var = moments(stop_gradient(x), axes)
        y = self._normalize(x, ps, axes, stats=(mean, var))
        running = self._running(st, mean, var, count)
        if step is not None:
            from ..distributed import norm

            running = norm.average_running(step, *running, x.shape[0])
        return y, self._state(st, *running)

    def _global_batch_statistics(self, x: Any, st: dict[str, Any], axes: tuple[int, ...], update: bool,
                                 step: Any) -> tuple[Any, dict[str, Any]]:
        """`_batch_statistics` with the statistics of every rank's batch together."""
        from ..distributed import norm

        mean, var, count = norm.batch_moments(step, stop_gradient(x), axes)
        if update:
            self._check_count(x, count)
        y = norm.normalize(x, axis=axes, epsilon=self.epsilon, stats=(mean, var), count=count, step=step)
        return (y, self._state(st, *self._running(st, mean, var, count))) if update else (y, st)

    def _check_count(self, x: Any, count: int) -> int:
        if count < 2:
            raise LayerError(f"{self}: expected more than 1 value per {self.statistic_of} in training mode, got input of shape {x.shape}")
        return count

    def _running(self, st: dict[str, Any], mean: Any, var: Any, count: int) -> tuple[Any, Any]:
        """The running statistics updated with a batch's `mean` and biased `var` (kept
        dimensions), each of `count` values."""
        # One statistic per channel (BatchNorm) or per sample and channel (InstanceNorm,
        # whose running statistics are the means over the batch, as PyTorch's).
        return update_running(st["running_mean"], st["running_var"], mean, var, self.momentum, count)

    @staticmethod
    def _state(st: dict[str, Any], new_mean: Any, new_var: Any) -> dict[str, Any]:
        rm, rv = st["running_mean"], st["running_var"]
        return {
            "running_mean": new_mean.astype(rm.dtype, copy=False),
            "running_var": new_var.astype(rv.dtype, copy=False),
            "training": True,
        }

    def __repr__(self) -> str:
        flags = {"momentum": self.momentum} if self.momentum != 0.1 else {}
        flags.update(self._flags())
        if self.track_stats != self.default_track_stats:
            flags["track_stats"] = self.track_stats
        if self.sync:
            flags["sync"] = True
        return f"{type(self).__name__}({self.num_features}{_options(**flags)})"


class BatchNorm(_RunningNorm):
    """Batch normalisation over the last (channel) axis: input ``(N, C)``, ``(N, L, C)`` or
    ``(N, H, W, C)`` (any rank >= 2), statistics over every axis but the last, then
    `activation` (a name, a function or None).

    Parameters ``{"scale": (C,), "bias": (C,)}`` (when `affine`); state
    ``{"running_mean": (C,), "running_var": (C,), "training": True}`` (without the running
    statistics when ``track_stats=False``). In training mode the layer normalises with the
    batch statistics and returns updated running statistics, as PyTorch does:
    ``running = (1 - momentum) * running + momentum * batch`` with the unbiased batch
    variance. In test mode (`luxnn.testmode`) it uses the running statistics; with
    ``track_stats=False`` it always uses the batch statistics.

    Data parallelism (`luxnn.distributed` with several ranks): inside a data-parallel
    step, that is the forward pass of `compute_gradients` or `single_train_step*` with a
    `DistributedOptimizer` (from the step's start to its update), the training-mode
    running statistics are averaged over the ranks, so the replicas' states stay equal
    (the running mean is then that of the global batch; the running variance the mean
    of the ranks' variances). ``sync=True`` makes the batch statistics those of the global
    batch, in the forward pass and in the gradient, as PyTorch's ``SyncBatchNorm``: the
    ranks then compute what one process would on the whole batch, running variance
    included, for two small allreduces per layer and step (one in the forward pass, one
    in the backward) where the default takes one. Outside such a step (ranks training
    models of their own, an evaluation, a loop of its own around `value_and_grad`) and
    without several ranks the layer uses its rank's batch alone, `sync` or not.

    >>> import luxnn as lx
    >>> bn = lx.BatchNorm(3, "relu")
    >>> ps, st = lx.setup(np.random.default_rng(0), bn)
    >>> y, st = bn(np.random.default_rng(1).normal(size=(8, 4, 4, 3)).astype(np.float32), ps, st)
    >>> y.shape, sorted(st), bool(y.min() >= 0)
    ((8, 4, 4, 3), ['running_mean', 'running_var', 'training'], True)
    """

    def __init__(
        self,
        num_features: int,
        activation: Activation = None,
        *,
        momentum: float = 0.1,
        epsilon: float = 1e-5,
        affine: bool = True,
        track_stats: bool = True,
        sync: bool = False,
    ) -> None:
        self._init_running(num_features, activation, momentum, epsilon, affine, track_stats)
        self.sync = bool(sync)

    def _statistic_axes(self, x: Any) -> tuple[int, ...]:
        _check_channels_last(self, x, self.num_features)
        return tuple(range(x.ndim - 1))


class InstanceNorm(_RunningNorm):
    """Instance normalisation, as ``torch.nn.InstanceNorm1d/2d/3d``: each sample's each
    channel normalised over the spatial axes of channel-last input ``(N, *spatial, C)``
    (at least one spatial axis), then `activation`.

    PyTorch's defaults: no affine map and no running statistics. ``affine=True`` adds
    parameters ``{"scale": (C,), "bias": (C,)}``; ``track_stats=True`` keeps
    ``running_mean``/``running_var`` (the batch means of the samples' statistics, with
    the unbiased variance, updated by `momentum`) and uses them in test mode, as
    PyTorch's ``track_running_stats=True``. State ``{"training": True}`` otherwise.

    >>> import luxnn as lx
    >>> norm = lx.InstanceNorm(3)
    >>> ps, st = lx.setup(np.random.default_rng(0), norm)
    >>> y, _ = norm(np.random.default_rng(1).normal(size=(2, 5, 5, 3)), ps, st)
    >>> bool(np.allclose(y.mean(axis=(1, 2)), 0))
    True
    """

    default_affine = False
    default_track_stats = False
    statistic_of = "channel of a sample"

    def __init__(
        self,
        num_features: int,
        activation: Activation = None,
        *,
        momentum: float = 0.1,
        epsilon: float = 1e-5,
        affine: bool = False,
        track_stats: bool = False,
    ) -> None:
        self._init_running(num_features, activation, momentum, epsilon, affine, track_stats)

    def _statistic_axes(self, x: Any) -> tuple[int, ...]:
        shape = _check_channels_last(self, x, self.num_features)
        if len(shape) < 3:
            raise LayerError(f"{self}: expected input of shape (N, *spatial, {self.num_features}) with a spatial axis, got {shape}")
        return tuple(range(1, len(shape) - 1))


class LayerNorm(_Norm):
    """Layer normalisation over the trailing dimensions `shape` (an int or a tuple), as
    ``torch.nn.LayerNorm(shape)``: input ``(..., *shape)`` -> same shape; parameters
    ``{"scale": shape, "bias": shape}`` (when `affine`), initialised to ones and zeros;
    then `activation` (a name, a function or None).

    >>> import luxnn as lx
    >>> ln = lx.LayerNorm(4)
    >>> ps, st = lx.setup(np.random.default_rng(0), ln)
    >>> ln(np.arange(8, dtype=np.float32).reshape(2, 4), ps, st)[0].shape
    (2, 4)
    """

    def __init__(
        self, shape: int | tuple[int, ...], activation: Activation = None, *, epsilon: float = 1e-5, affine: bool = True
    ) -> None:
        self.shape = _shape_arg("LayerNorm", shape)
        self._init_affine(epsilon, affine, self.shape, activation)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = _trailing_axes(self, x, self.shape)
        x = self._input(x, ps)
        return self._activate(self._normalize(x, ps, axes)), st

    def __repr__(self) -> str:
        return f"LayerNorm({_shape_repr(self.shape)}{_options(**self._flags())})"


class RMSNorm(_Norm):
    """Root-mean-square normalisation over the trailing dimensions `dim` (an int or a
    tuple): ``y = x / sqrt(mean(x**2) + epsilon) * scale``, no centring and no bias.
    Parameters ``{"scale": dim}`` (when `affine`), initialised to ones. The default epsilon
    is 1e-6 (Flax's and LLaMA's); PyTorch's default is the dtype's machine epsilon.

    >>> import luxnn as lx
    >>> norm = lx.RMSNorm(4)
    >>> ps, st = lx.setup(np.random.default_rng(0), norm)
    >>> sorted(ps)
    ['scale']
    """

    default_epsilon = 1e-6
    with_bias = False

    def __init__(self, dim: int | tuple[int, ...], *, epsilon: float = 1e-6, affine: bool = True) -> None:
        self.shape = _shape_arg("RMSNorm", dim)
        self._init_affine(epsilon, affine, self.shape)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        axes = _trailing_axes(self, x, self.shape)
        x = self._input(x, ps)
        return self._normalize(x, ps, axes, centre=False), st

    def __repr__(self) -> str:
        return f"RMSNorm({_shape_repr(self.shape)}{_options(**self._flags())})"


class GroupNorm(_Norm):
    """Group normalisation of channel-last input ``(N, ..., num_channels)``: the channels
    split into `num_groups` groups of consecutive channels, each normalised over its
    channels and all spatial positions of one sample (as ``torch.nn.GroupNorm`` on the
    channel-first layout). Parameters ``{"scale": (C,), "bias": (C,)}`` (when `affine`);
    then `activation` (a name, a function or None).

    >>> import luxnn as lx
    >>> gn = lx.GroupNorm(2, 4)
    >>> ps, st = lx.setup(np.random.default_rng(0), gn)
    >>> gn(np.ones((2, 3, 3, 4), np.float32), ps, st)[0].shape
    (2, 3, 3, 4)
    """

    def __init__(
        self, num_groups: int, num_channels: int, activation: Activation = None, *, epsilon: float = 1e-5, affine: bool = True
    ) -> None:
        self.num_groups = _positive_int("GroupNorm", "num_groups", num_groups)
        self.num_channels = _positive_int("GroupNorm", "num_channels", num_channels)
        if self.num_channels % self.num_groups:
            raise ValueError(f"GroupNorm: num_channels ({num_channels}) must be divisible by num_groups ({num_groups})")
        self._init_affine(epsilon, affine, (self.num_channels,), activation)

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        c, g = self.num_channels, self.num_groups
        shape = _check_channels_last(self, x, c)
        x = self._input(x, ps)
        grouped = x.reshape((*shape[:-1], g, c // g))
        axes = (*range(1, len(shape) - 1), len(shape))
        y = self._normalize(grouped, ps, axes, scale_shape=(g, c // g)).reshape(shape)
        return self._activate(y), st

    def __repr__(self) -> str:
        return f"GroupNorm({self.num_groups}, {self.num_channels}{_options(**self._flags())})"


def _trailing_axes(layer: Layer, x: Any, shape: tuple[int, ...]) -> tuple[int, ...]:
    got = getattr(x, "shape", None)
    if got is None or len(got) < len(shape) or tuple(got[len(got) - len(shape):]) != shape:
        raise LayerError(f"{layer}: expected input of shape (..., {', '.join(map(str, shape))}), got {got}")
    return tuple(range(len(got) - len(shape), len(got)))


def _shape_repr(shape: tuple[int, ...]) -> str:
    return str(shape[0]) if len(shape) == 1 else str(shape)
