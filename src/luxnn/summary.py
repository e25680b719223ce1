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
from .nn.embedding import Embedding

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


def _takes_tokens(model: Layer) -> bool:
    """Whether the first layer the input reaches, going down each layer's first child
    (a `Chain`'s first layer, a wrapper's layer), is an `Embedding`."""
    while not isinstance(model, Embedding):
        first = next(iter(model.children()), None)
        if first is None:
            return False
        model = first[1]
    return True


def _as_input(model: Layer, x: Any, dtype: Any) -> Any:
    """`x`, or zeros of shape `x` (a tuple of ints) and of `dtype`: by default int64 (token
    0) for a model that takes tokens, float32 otherwise."""
    if not (isinstance(x, tuple) and x and all(isinstance(n, (int, np.integer)) for n in x)):
        if dtype is not None:
            raise TypeError(f"dtype= is for an input given as a shape, got an input of type {type(x).__name__}")
        return x
    if dtype is None:
        dtype = np.int64 if _takes_tokens(model) else np.float32
    return np.zeros(x, dtype)


def _run(model: Layer, x: Any, ps: Any, st: Any, rng: Any, dtype: Any, observe: Any = None) -> tuple[Any, Any]:
    if not isinstance(model, Layer):
        raise TypeError(f"expected a luxnn Layer, got {type(model).__name__}")
    x = _as_input(model, x, dtype)
    if ps is None or st is None:
        new_ps, new_st = setup(np.random.default_rng(0) if rng is None else rng, model)
        ps = new_ps if ps is None else ps
        st = new_st if st is None else st
    with intercept_calls(observe) if observe is not None else contextlib.nullcontext():
        return apply(model, x, ps, testmode(st))[0], ps


def outputsize(model: Layer, x: Any, ps: Any = None, st: Any = None, *, rng: Any = None, dtype: Any = None) -> Any:
    """The shape of ``model``'s output on `x` (an array, a tuple of arrays, or a shape
    for zeros), as Flux's ``outputsize``: a tuple, or a tuple of them for several
    outputs. The model runs once in test mode on `ps` and `st` (by default set up from
    `rng`); the state it returns is dropped, so no training state changes.

    A shape gives zeros of `dtype`: by default int64 (token 0) when the model takes
    tokens (the first layer its input reaches, down the first layers of containers, is
    an `Embedding`), float32 otherwise.

    >>> import luxnn as lx
    >>> lx.outputsize(lx.Chain(lx.Conv(3, 1, 4), lx.Flatten()), (2, 8, 8, 1))
    (2, 144)
    >>> lx.outputsize(lx.Chain(lx.Embedding(100, 16), lx.Dense(16, 100)), (2, 64))  # tokens
    (2, 64, 100)
    """
    return _shape_of(_run(model, x, ps, st, rng, dtype)[0])


def summary(
    model: Layer, x: Any, ps: Any = None, st: Any = None, *, rng: Any = None, dtype: Any = None, show: bool = True,
    file: TextIO | None = None,
) -> Summary:
    """A table of every layer call of ``model(x)``: the layer's path, its class, its
    output shape and its parameter count, then the total; printed (to `file`, by default
    standard output) unless ``show=False``, and returned as a `Summary`. `x`, `ps`, `st`, `rng` and `dtype` as for
    `outputsize`;
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

    _, ps = _run(model, x, ps, st, rng, dtype, observe)
    nbytes = int(sum(getattr(leaf, "nbytes", 0) for leaf in tree.leaves(ps)))
    result = Summary(tuple(r for r in rows if r is not None), parameter_count(ps), nbytes)
    if show:
        print(result, file=sys.stdout if file is None else file)
    return result

