"""The dtype policy: what a layer does with an input whose dtype is not its parameters'.

NumPy's promotion would run a float32 model on float64 data in float64 (twice the memory
and time) and cast the gradients back without a word, and make an integer input's output
float64. As Lux's ``match_eltype``, each layer with floating parameters passes its input
through `match_eltype`, which by default converts it to the parameters' floating dtype and
warns once per layer path:

- ``"warn"`` (default): convert, and warn once per layer path, naming both dtypes;
- ``"convert"``: convert silently;
- ``"error"``: raise a `LayerError`;
- ``"none"``: leave the input as it is (NumPy's promotion).

>>> import numpy as np, luxnn as lx
>>> lx.set_dtype_policy("convert")
>>> layer = lx.Dense(2, 1); ps, st = lx.setup(np.random.default_rng(0), layer)
>>> layer(np.ones((1, 2)), ps, st)[0].dtype       # float64 data, float32 parameters
dtype('float32')
>>> lx.set_dtype_policy("warn")
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from .ad import Traced, array_namespace
from .ad import primitives as P
from .core import LayerError, layer_path

__all__ = ["DtypeWarning", "get_dtype_policy", "match_eltype", "set_dtype_policy"]

POLICIES = ("warn", "convert", "error", "none")
_policy = "warn"
# The layers (and their paths) already warned about, with the warning's dtypes: one each.
_warned: set[tuple[Any, ...]] = set()


class DtypeWarning(UserWarning):
    """A layer converted an input to its parameters' dtype (the ``"warn"`` policy)."""


def set_dtype_policy(policy: str) -> None:
    """Set what layers do with inputs of another dtype than their parameters: ``"warn"``
    (default), ``"convert"``, ``"error"`` or ``"none"`` (see the module's docstring).

    >>> set_dtype_policy("warn")
    """
    global _policy
    if policy not in POLICIES:
        raise ValueError(f"set_dtype_policy: expected one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
    _policy = policy
    _warned.clear()


def get_dtype_policy() -> str:
    """The policy in force: ``"warn"``, ``"convert"``, ``"error"`` or ``"none"``.

    >>> get_dtype_policy()
    'warn'
    """
    return _policy


def match_eltype(layer: Any, x: Any, like: Any) -> Any:
    """`x` as `layer` should compute on it: converted to the floating dtype of its parameter
    `like` (an array or traced value; None when the layer has no parameters to match) as
    the policy says. Raises `TypeError` for an input that is not a NumPy, CuPy or traced
    array (JAX, torch, ...).

    >>> set_dtype_policy("convert")
    >>> match_eltype(None, np.ones(3, np.int64), np.zeros(2, np.float32)).dtype
    dtype('float32')
    >>> set_dtype_policy("warn")
    """
    traced = type(x) is Traced
    if not traced:
        array_namespace(x)  # TypeError for arrays of other libraries
    if like is None or _policy == "none":
        return x
    have, want = getattr(x, "dtype", None), like.dtype
    if have == want or want.kind != "f" or have is None or have.kind not in "fiub":
        return x
    if _policy == "error":
        raise LayerError(f"{type(layer).__name__}: expected an input of dtype {want}, got {have}")
    if _policy == "warn":
        _warn_once(layer, have, want)
    return P.astype(x, want) if traced else x.astype(want)


def _warn_once(layer: Any, have: np.dtype, want: np.dtype) -> None:
    path = layer_path()
    key = (id(layer), path, have, want)  # the layer itself: two models share their paths
    if key in _warned:
        return
    warnings.warn(
        f"{'/'.join(path) or 'the model'} ({type(layer).__name__}) got an input of dtype {have} "
        f"and has {want} parameters: the input is converted to {want}. Convert the data once "
        f"(x.astype(np.{want})), or call lx.set_dtype_policy('convert') to convert without this "
        "warning ('none' keeps NumPy's promotion)",
        DtypeWarning,
        stacklevel=3,
    )
    _warned.add(key)  # after the warning: where warnings are errors, every call raises
