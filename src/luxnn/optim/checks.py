"""Validation of what the optimisers are given: hyperparameters and schedules' values, and
trees (gradients, updates, masks) against the parameters, with the path where they differ.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import numpy as np

from luxnn import tree

from .arrays import Params, ScalarOrSchedule, Updates


def check_float(name: str, value: Any, *, low: float = 0.0, high: float = math.inf,
                low_open: bool = False, high_open: bool = False) -> float:
    """`value` as a finite Python float, or a ValueError naming `name` and the allowed
    range (an infinite or NaN hyperparameter is never meant: it turns every update into
    inf or NaN)."""
    try:
        if isinstance(value, (str, bytes)):  # float("0.1") parses: a typo or a config left unparsed
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number, got {value!r}") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    too_low = number <= low if low_open else number < low
    too_high = number >= high if high_open else number > high
    if too_low or too_high:
        left = "(" if low_open else "["
        right = ")" if high_open or high == math.inf else "]"
        raise ValueError(f"{name} must be in {left}{low}, {high}{right}, got {value!r}")
    return number


def check_decay(name: str, value: Any) -> float:
    """A decay rate or beta: in [0, 1)."""
    return check_float(name, value, high=1.0, high_open=True)


def check_learning_rate(name: str, learning_rate: ScalarOrSchedule) -> ScalarOrSchedule:
    if callable(learning_rate):
        return learning_rate
    return check_float(name, learning_rate)


def check_schedule_value(name: str, value: Any, count: Any) -> None:
    """A ValueError naming `name` unless `value`, what a schedule gave at step `count`, is
    a finite number. A value on a GPU is not read back for the check: that would wait for
    the device on every update."""
    if isinstance(value, (int, float, np.generic, np.ndarray)):
        number = value.item() if isinstance(value, np.ndarray) and value.size == 1 else value
        if isinstance(number, np.ndarray) or not math.isfinite(number):
            raise ValueError(f"{name}: the schedule gave {value!r} at step {count}; "
                             "a schedule must give a finite number")


def check_steps(name: str, value: Any, *, positive: bool) -> int:
    try:
        steps = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if steps < (1 if positive else 0):
        raise ValueError(f"{name} must be {'>= 1' if positive else '>= 0'}, got {steps}")
    return steps


def tree_mismatch(expected: Any, got: Any, path: tuple = ()) -> str | None:
    """Where and how `got` differs from `expected` in structure or leaf shapes, or None.
    (It runs on every update: the path is only formatted once something differs.)"""
    if isinstance(expected, dict):
        if not isinstance(got, dict):
            return f"{where(path)}: expected a dict with keys {list(expected)}, got {type(got).__name__}"
        if expected.keys() != got.keys():
            return f"{where(path)}: expected keys {sorted(map(str, expected))}, got {sorted(map(str, got))}"
        children = [(k, expected[k], got[k]) for k in expected]
    elif isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            size = f" of length {len(got)}" if isinstance(got, (list, tuple)) else ""
            return f"{where(path)}: expected a sequence of length {len(expected)}, got {type(got).__name__}{size}"
        children = list(zip(range(len(expected)), expected, got))
    else:
        if isinstance(got, (dict, list, tuple)):
            return f"{where(path)}: expected an array, got a {type(got).__name__}"
        expected_shape, got_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
        if expected_shape is not None and got_shape is not None and tuple(expected_shape) != tuple(got_shape):
            return f"{where(path)}: expected shape {tuple(expected_shape)}, got {tuple(got_shape)}"
        return None
    for key, e, g in children:
        problem = tree_mismatch(e, g, (*path, key))
        if problem:
            return problem
    return None


def where(path: tuple) -> str:
    """``at 'a/b'`` for a path of keys, ``at the root`` for the empty path."""
    return f"at '{'/'.join(map(str, path))}'" if path else "at the root"


def _matches(expected: Any, got: Any) -> bool:
    """Whether `got` has `expected`'s structure and leaf shapes: `tree_mismatch`'s answer
    without its paths, for the check every update makes."""
    if isinstance(expected, dict):
        if not isinstance(got, dict) or expected.keys() != got.keys():
            return False
        for k, v in expected.items():
            if not _matches(v, got[k]):
                return False
        return True
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(expected):
            return False
        for e, g in zip(expected, got):
            if not _matches(e, g):
                return False
        return True
    if isinstance(got, (dict, list, tuple)):
        return False
    expected_shape, got_shape = getattr(expected, "shape", None), getattr(got, "shape", None)
    return expected_shape is None or got_shape is None or tuple(expected_shape) == tuple(got_shape)


def check_match(expected: Any, expected_name: str, got: Any, got_name: str) -> None:
    if _matches(expected, got):
        return
    problem = tree_mismatch(expected, got)
    if problem:
        raise ValueError(f"{got_name} do not match {expected_name} {problem}")


def check_gradients(who: str, params: Params, grads: Updates, leaves: list | None = None) -> None:
    """A ValueError naming `who` and the first path of `params` whose gradient is no array
    (a Python float: the optimisers compute on arrays). `leaves`: those of `grads`, if
    already at hand. Structure and shapes are checked where the gradients are used."""
    for i, g in enumerate(tree.leaves(grads) if leaves is None else leaves):
        if type(g) is not np.ndarray and not (hasattr(g, "dtype") and hasattr(g, "shape")):
            check_match(params, "params", grads, "grads")  # else the paths of params are not the gradients'
            path, p = tree.paths(params)[i]
            raise ValueError(f"{who}: the gradient at '{path}' is a {type(g).__name__}; expected an array "
                             f"of shape {tuple(getattr(p, 'shape', ()))} like its parameter")


def check_params(name: str, params: Params) -> None:
    if params is None:
        raise ValueError(f"{name} needs the parameters: call update(grads, opt_state, params)")
