"""Seeing a model: a table of its layers' outputs and parameters, and its output shape.

Both run the model once, in test mode, on an input (or zeros of a given shape), and look
at every layer call through `luxnn.core.intercept_calls`: no layer class is changed and
no state the caller holds is touched.

>>> import numpy as np, luxnn as lx
>>> model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 2))
>>> lx.outputsize(model, (3, 4))
(3, 2)
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Any, TextIO

import numpy as np

from . import tree
from .core import Layer, apply, intercept_calls, layer_path, parameter_count, setup, testmode

__all__ = ["summary", "outputsize", "Summary", "SummaryRow"]


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One layer call: its path in the model (``""`` for the model itself), its class,
    its output's shape (a tuple, or a tuple/dict of them for several outputs), the number
    of parameters it was given (its own and its children's) and how deep in the model it
    was called (0 for the model)."""

    path: str
    layer: str
    output_shape: Any
    parameters: int
    depth: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """The layers a model called, in call order, and its parameter total; ``str`` gives
    the table (as Flax's ``tabulate`` or torchinfo)."""

    rows: tuple[SummaryRow, ...]
    total_parameters: int
    total_bytes: int

    def __str__(self) -> str:
        header = ("Layer", "Type", "Output shape", "Parameters")
        cells = [header] + [
            ("  " * row.depth + (row.path.rsplit("/", 1)[-1] or "(model)"), row.layer, str(row.output_shape), f"{row.parameters:,}")
            for row in self.rows
        ]
        widths = [max(len(cell[i]) for cell in cells) for i in range(len(header))]

        def line(cell: tuple[str, ...]) -> str:
            return "  ".join(c.rjust(w) if i == 3 else c.ljust(w) for i, (c, w) in enumerate(zip(cell, widths))).rstrip()

        rule = "-" * len(line(tuple("-" * w for w in widths)))
        body = [line(header), rule, *map(line, cells[1:]), rule]
        body.append(f"Total parameters: {self.total_parameters:,} ({_bytes(self.total_bytes)})")
        return "\n".join(body)


def _bytes(n: int) -> str:
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"


def _shape_of(y: Any) -> Any:
    if hasattr(y, "shape"):
        return tuple(y.shape)
    if isinstance(y, (tuple, list)):
        return tuple(_shape_of(v) for v in y)
    if isinstance(y, dict):
        return {k: _shape_of(v) for k, v in y.items()}
    return type(y).__name__


def _as_input(x: Any) -> Any:
    """`x`, or float32 zeros when `x` is a shape (a tuple of ints)."""
    if isinstance(x, tuple) and x and all(isinstance(n, (int, np.integer)) for n in x):
        return np.zeros(x, np.float32)
    return x


def _run(model: Layer, x: Any, ps: Any, st: Any, rng: Any, observe: Any = None) -> tuple[Any, Any]:
    if not isinstance(model, Layer):
        raise TypeError(f"expected a luxnn Layer, got {type(model).__name__}")
    if ps is None or st is None:
        new_ps, new_st = setup(np.random.default_rng(0) if rng is None else rng, model)
        ps = new_ps if ps is None else ps
        st = new_st if st is None else st
    with intercept_calls(observe) if observe is not None else contextlib.nullcontext():
        return apply(model, _as_input(x), ps, testmode(st))[0], ps


def outputsize(model: Layer, x: Any, ps: Any = None, st: Any = None, *, rng: Any = None) -> Any:
    """The shape of ``model``'s output on `x` (an array, a tuple of arrays, or a shape
    for float32 zeros), as Flux's ``outputsize``: a tuple, or a tuple of them for several
    outputs. The model runs once in test mode on `ps` and `st` (by default set up from
    `rng`); the state it returns is dropped, so no training state changes.

    >>> import luxnn as lx
    >>> lx.outputsize(lx.Chain(lx.Conv(3, 1, 4), lx.Flatten()), (2, 8, 8, 1))
    (2, 144)
    """
    return _shape_of(_run(model, x, ps, st, rng)[0])


def summary(
    model: Layer, x: Any, ps: Any = None, st: Any = None, *, rng: Any = None, show: bool = True, file: TextIO | None = None
) -> Summary:
    """A table of every layer call of ``model(x)``: the layer's path, its class, its
    output shape and its parameter count, then the total; printed (to `file`, by default
    standard output) unless ``show=False``, and returned as a `Summary`. `x`, `ps`, `st` and `rng` as for `outputsize`;
    a layer called several times (`RepeatedLayer`) has a row per call, and a layer that
    shares its wrapper's parameters (`SkipConnection`) a row under the wrapper's.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Chain(lx.Dense(4, 8, activation="relu"), lx.Dense(8, 2))
    >>> table = lx.summary(model, (3, 4))
    Layer      Type   Output shape  Parameters
    ------------------------------------------
    (model)    Chain  (3, 2)                58
      layer_1  Dense  (3, 8)                40
      layer_2  Dense  (3, 2)                18
    ------------------------------------------
    Total parameters: 58 (232 B)
    >>> [row.output_shape for row in table.rows]
    [(3, 2), (3, 8), (3, 2)]
    """
    rows: list[SummaryRow | None] = []
    depth = 0

    def observe(layer: Layer, x: Any, ps: Any, st: Any) -> Any:
        nonlocal depth
        index, level = len(rows), depth
        rows.append(None)  # the row's place: a layer comes before the children it calls
        depth += 1
        try:
            out = layer(x, ps, st)
        finally:
            depth = level
        y = out[0] if isinstance(out, tuple) and len(out) == 2 else out
        rows[index] = SummaryRow("/".join(layer_path()), type(layer).__name__, _shape_of(y), parameter_count(ps), level)
        return out

    _, ps = _run(model, x, ps, st, rng, observe)
    nbytes = int(sum(getattr(leaf, "nbytes", 0) for leaf in tree.leaves(ps)))
    result = Summary(tuple(r for r in rows if r is not None), parameter_count(ps), nbytes)
    if show:
        print(result, file=sys.stdout if file is None else file)
    return result

