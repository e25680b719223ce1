"""Dropout, with its random generator kept in the layer's state.

The generator in a state is always a NumPy one, on every device, drawn from with
`luxnn.generators.draw` (never advanced in place). For CuPy arrays the mask is made on the
device from one seed drawn from that generator, by a counter-based hash of each element's
index (splitmix64): no random state lives on the device (a CuPy generator's state could
not be copied cheaply for the "never advanced in place" rule), and no mask is copied from
the host. The
masks of the two backends differ for the same seed; each is reproducible from the state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ad.tape import Traced
from ..backend import module_of
from ..core import Layer, LayerError
from ..generators import child_generator, draw, fork_generator
from ..kernels import Elementwise

# The generators' helpers stay importable from here, where the layers that draw find them.
__all__ = ["Dropout", "AlphaDropout", "dropout_mask", "fork_generator", "child_generator"]


def _splitmix_mask_twin(seed: np.uint64, p: float, scale: float, mask: np.ndarray) -> None:
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + np.arange(mask.size, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    uniform = (z >> np.uint64(11)).astype(np.float64) * (1.0 / 9007199254740992.0)
    mask.reshape(-1)[...] = np.where(uniform >= p, scale, 0.0)


# splitmix64 of seed + i * golden ratio, its top 53 bits as a uniform in [0, 1): `scale`
# where that is >= p, else 0.
DEVICE_MASK_KERNEL = Elementwise(
    "luxnn_dropout_mask",
    "uint64 seed, float64 p, float64 scale",
    "T mask",
    """
    unsigned long long z = seed + (unsigned long long)i * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    mask = (T)((double)(z >> 11) * (1.0 / 9007199254740992.0) >= p ? scale : 0.0);
    """,
    twin=_splitmix_mask_twin,
)


def dropout_mask(rng: Any, shape: tuple[int, ...], dtype: Any, p: float, xp: Any = np) -> Any:
    """Inverted-dropout multiplier: 0 with probability `p`, else ``1 / (1 - p)``; advances
    `rng` (a NumPy generator). `xp`: the array module of the mask (NumPy or CuPy)."""
    if xp is not np:
        return DEVICE_MASK_KERNEL(np.uint64(rng.integers(2**63)), p, 1.0 / (1.0 - p), xp.empty(shape, dtype))
    draw_dtype = dtype if np.dtype(dtype) in (np.float32, np.float64) else np.float32
    mask = (rng.random(shape, dtype=draw_dtype) >= p).astype(dtype)
    mask *= 1.0 / (1.0 - p)
    return mask


class _RandomLayer(Layer):
    """A layer that draws from a generator kept in its state ``{"rng", "training"}`` in
    training mode and is the identity in test mode (or when ``p == 0``)."""

    def __init__(self, p: float) -> None:
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not 0.0 <= p < 1.0:
            raise ValueError(f"{type(self).__name__}: p must be a probability in [0, 1), got {p!r}")
        self.p = float(p)

    def init_state(self, rng: Any) -> dict[str, Any]:
        return {"rng": child_generator(rng), "training": True}

    def _draw(self, x: Any, rng: Any, xp: Any) -> Any:
        """The output in training mode, drawing from `rng` (a copy of the state's)."""
        raise NotImplementedError

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        if not isinstance(st, dict) or st.keys() != {"rng", "training"}:
            raise LayerError(f"{self}: expected state keys ['rng', 'training'], got {sorted(st) if isinstance(st, dict) else type(st).__name__}")
        if not st["training"] or self.p == 0.0:
            return x, st
        xp = module_of(x.value if type(x) is Traced else x)
        y, rng = draw(st["rng"], lambda g: self._draw(x, g, xp))
        return y, {"rng": rng, "training": True}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.p})"


class Dropout(_RandomLayer):
    """Zero each entry with probability `p` in training mode and scale the rest by
    ``1 / (1 - p)``; the identity in test mode (`luxnn.testmode`).

    State ``{"rng": generator, "training": True}``. The generator in the state is never
    advanced in place (`luxnn.generators.draw`): a call draws the mask from a copy and
    returns the advanced copy in the new state, so calling twice with the same state gives
    the same mask, and threading the returned state through gives fresh masks.

    >>> import luxnn as lx
    >>> drop = lx.Dropout(0.5)
    >>> ps, st = lx.setup(np.random.default_rng(0), drop)
    >>> x = np.ones((2, 4), np.float32)
    >>> y1, st1 = drop(x, ps, st)
    >>> y2, _ = drop(x, ps, st)
    >>> bool((y1 == y2).all()), sorted(set(y1.ravel().tolist())) == [0.0, 2.0]
    (True, True)
    """

    def _draw(self, x: Any, rng: Any, xp: Any) -> Any:
        return x * dropout_mask(rng, x.shape, x.dtype, self.p, xp)


# SELU's -alpha * scale: the value a dropped SELU activation takes (Klambauer et al. 2017).
_SELU_NEGATIVE_SATURATION = -1.7580993408473766


class AlphaDropout(_RandomLayer):
    """Dropout for self-normalising (SELU) networks, as ``torch.nn.AlphaDropout``: in
    training mode each entry is set with probability `p` to SELU's negative saturation
    value, and the result is mapped by ``a * y + b`` so that inputs of zero mean and unit
    variance keep them; the identity in test mode. State and generator as `Dropout`.

    >>> import luxnn as lx
    >>> drop = lx.AlphaDropout(0.2)
    >>> ps, st = lx.setup(np.random.default_rng(0), drop)
    >>> y, _ = drop(np.random.default_rng(1).standard_normal((1000, 100)), ps, st)
    >>> abs(float(y.mean())) < 0.05, round(float(y.std()), 1)
    (True, 1.0)
    """

    def _draw(self, x: Any, rng: Any, xp: Any) -> Any:
        p, alpha = self.p, _SELU_NEGATIVE_SATURATION
        a = 1.0 / np.sqrt((alpha * alpha * p + 1) * (1 - p))
        keep = dropout_mask(rng, x.shape, x.dtype, p, xp) != 0
        scale = (a * keep).astype(x.dtype, copy=False)
        # a * (x * keep + alpha * (1 - keep)) + b with b = -a * alpha * p, as one multiply-add
        shift = (a * alpha * (1 - p - keep)).astype(x.dtype, copy=False)
        return x * scale + shift
