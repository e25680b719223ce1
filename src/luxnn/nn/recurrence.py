"""Layers over sequences: `Recurrence` runs a cell over ``(batch, seq, features)``,
`Bidirectional` runs two, and `Padded` carries the lengths of sequences padded to one.

Padded sequences run forward as they are (a step never reads the ones after it), and in
reverse through `reverse_padded`, which reads each one from its own last step; outputs
past a sequence's length are then set to zero and its final carry is taken at its last step.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterator, NamedTuple

from .. import tree
from ..ad.namespace import array_namespace
from ..ad.tape import stop_gradient
from ..backend import module_of
from ..core import call_child, input_shape, Layer, LayerError
from ..ops.recurrent import reverse_padded
from .recurrent import RecurrentCell, Steps

__all__ = ["Padded", "Recurrence", "Bidirectional", "split_carry"]


class Padded(NamedTuple):
    """A batch of sequences of different lengths, padded to one: `x` ``(batch, seq,
    features)`` and `lengths` ``(batch,)``, integers in ``[1, seq]`` (a list, NumPy or
    CuPy array), as PyTorch's ``pack_padded_sequence(x, lengths, batch_first=True)`` and
    Flax's ``seq_lengths``. `Recurrence` and `Bidirectional` take one as their input; their
    sequence outputs are then `Padded` too (zero past each length), so that they stack.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Recurrence(lx.GRUCell(3, 4), return_sequence=True)
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> y, st = model(lx.Padded(np.ones((2, 5, 3), np.float32), [5, 2]), ps, st)
    >>> y.x.shape, float(abs(y.x[1, 2:]).max())
    ((2, 5, 4), 0.0)
    """

    x: Any
    lengths: Any


def _checked_lengths(layer: Layer, lengths: Any, x: Any) -> Any:
    """`lengths` as an integer array of x's backend, after checking it."""
    batch, seq = x.shape[:2]
    try:
        lengths = module_of(stop_gradient(x)).asarray(lengths)
    except (TypeError, ValueError) as e:
        raise LayerError(f"{layer}: expected lengths as integers of x's device, got {type(lengths).__name__} ({e})") from None
    if lengths.dtype.kind not in "iu" or lengths.shape != (batch,):
        got = f"{lengths.dtype} of shape {lengths.shape}"
        raise LayerError(f"{layer}: expected lengths of shape ({batch},), integers in [1, {seq}], got {got}")
    if batch and (int(lengths.min()) < 1 or int(lengths.max()) > seq):
        raise LayerError(f"{layer}: expected lengths in [1, {seq}], got values in [{int(lengths.min())}, {int(lengths.max())}]")
    return lengths


def split_carry(layer: Layer, x: Any) -> tuple[Any, Any]:
    """``(x, carry)`` of the input of a layer over sequences, given as x alone (x or `Padded`;
    carry None) or as the pair ``(x, carry)``."""
    if not isinstance(x, tuple) or isinstance(x, Padded):
        return x, None
    if len(x) != 2:
        raise LayerError(f"{layer}: expected x or (x, carry), got a tuple of {len(x)}")
    return x


def _at_last_steps(values: Any, lengths: Any) -> Any:
    """``values[b, lengths[b] - 1]`` for each b: ``(batch, seq, ...)`` -> ``(batch, ...)``."""
    return values[module_of(lengths).arange(lengths.shape[0]), lengths - 1]


def _zero_past_lengths(hs: Any, lengths: Any) -> Any:
    backend = module_of(lengths)
    valid = backend.arange(hs.shape[1]) < lengths.reshape(-1, 1)
    return hs * valid.astype(hs.dtype).reshape(*valid.shape, 1)


class Recurrence(Layer):
    """Runs a cell over ``(batch, seq, in_dims)`` inputs (Lux's ``Recurrence``): the last
    output ``(batch, hidden)``, or with ``return_sequence=True`` every output ``(batch, seq,
    hidden)``. ``reverse=True`` reads the sequence from its end; outputs stay aligned with
    the input positions, so the last output is then the one at position 0.

    The carry starts as the cell's initial carry, or as `carry` given with the input as
    ``(x, carry)`` (a cell's carry, as `return_carry` returns it: to go on from where a
    call stopped, or to start a decoder from an encoder's carry).

    A `Padded` input runs each sequence over its own length: outputs past it are zero (the
    sequence output is `Padded` too), the last output and the carry are those of its last
    step, and ``reverse=True`` starts at that step. ``return_carry=True`` returns ``(y,
    carry)``, the carry after the last step taken (the cell's: h, or ``(h, c)`` for the
    LSTM, each ``(batch, hidden)``), as PyTorch's ``h_n`` / ``(h_n, c_n)``.

    Parameters and state ``{"cell": ...}``. A `RecurrentCell` runs as one fused primitive over the sequence; any other cell layer
    (``(x_t or (x_t, carry)) -> ((h_t, carry), state)``) step by step. Stack layers as
    ``Chain(Recurrence(a, return_sequence=True), Recurrence(b))``.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Chain(lx.Recurrence(lx.LSTMCell(3, 8)), lx.Dense(8, 2))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((4, 7, 3), np.float32), ps, st)[0].shape
    (4, 2)
    >>> encoder = lx.Recurrence(lx.LSTMCell(3, 8), return_carry=True)
    >>> ps, st = lx.setup(np.random.default_rng(0), encoder)
    >>> (h, (h_n, c_n)), st = encoder(lx.Padded(np.ones((2, 7, 3), np.float32), [7, 3]), ps, st)
    >>> c_n.shape
    (2, 8)
    """

    def __init__(self, cell: Layer, *, return_sequence: bool = False, reverse: bool = False, return_carry: bool = False) -> None:
        if not isinstance(cell, Layer):
            raise TypeError(f"Recurrence: cell must be a luxnn Layer, got {type(cell).__name__}")
        self.cell = cell
        self.return_sequence = bool(return_sequence)
        self.reverse = bool(reverse)
        self.return_carry = bool(return_carry)

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter((("cell", self.cell),))

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, carry = split_carry(self, x)
        xs, lengths = (x.x, x.lengths) if isinstance(x, Padded) else (x, None)
        shape = getattr(xs, "shape", None)
        in_dims = getattr(self.cell, "in_dims", "in_dims")
        if shape is None or len(shape) != 3 or shape[1] < 1 or (isinstance(self.cell, RecurrentCell) and shape[2] != in_dims):
            raise LayerError(f"{self}: expected input of shape (batch, seq >= 1, {in_dims}), got {input_shape(xs)}")
        if lengths is not None:
            lengths = _checked_lengths(self, lengths, xs)
            xs = reverse_padded(xs, lengths) if self.reverse else xs
        run = self._fused if isinstance(self.cell, RecurrentCell) else self._step_by_step
        hs, last, carry, st = run(xs, carry, ps, st, self.reverse and lengths is None, lengths)
        if not self.return_sequence:
            y = last
        elif lengths is None:
            y = hs
        else:
            y = Padded(_zero_past_lengths(reverse_padded(hs, lengths) if self.reverse else hs, lengths), lengths)
        return ((y, carry) if self.return_carry else y), st

    # Both runs start from `carry` (None: the cell's initial carry) and return (every output
    # (batch, seq, hidden) or None when not needed, the last output, the carry after it, the
    # new state); with lengths, they run forward and take the last output and the carry at
    # each sequence's last step.

    def _fused(self, xs: Any, carry: Any, ps: Any, st: Any, reverse: bool, lengths: Any) -> tuple:
        xp = array_namespace(xs)
        every = self.return_sequence or lengths is not None
        steps = Steps(xp.permute_dims(xs, (1, 0, 2)), carry, reverse=reverse, last_only=not every)
        packed, st_cell = call_child("cell", self.cell, steps, ps, st)
        if not every:
            return (None, *self.cell.unpack(packed), {"cell": st_cell})
        packed = xp.permute_dims(packed, (1, 0, 2))
        hs = self.cell.unpack(packed)[0]
        last = packed[:, 0 if reverse else -1] if lengths is None else _at_last_steps(packed, lengths)
        return (hs, *self.cell.unpack(last), {"cell": st_cell})

    def _step_by_step(self, xs: Any, carry: Any, ps: Any, st: Any, reverse: bool, lengths: Any) -> tuple:
        seq = xs.shape[1]
        order = range(seq - 1, -1, -1) if reverse else range(seq)
        outputs, carries = {}, {}
        for t in order:
            step_in = xs[:, t] if carry is None else (xs[:, t], carry)
            (outputs[t], carry), cell_st = call_child("cell", self.cell, step_in, ps, st)
            st = {"cell": cell_st}
            if lengths is not None:
                carries[t] = carry
        xp = array_namespace(xs)
        hs = xp.stack([outputs[t] for t in range(seq)], axis=1) if self.return_sequence or lengths is not None else None
        if lengths is None:
            return hs, outputs[order[-1]], carry, st
        carry = tree.map(lambda *per_step: _at_last_steps(xp.stack(per_step, axis=1), lengths), *(carries[t] for t in range(seq)))
        return hs, _at_last_steps(hs, lengths), carry, st

    def __repr__(self) -> str:
        flags = ("return_sequence", "reverse", "return_carry")
        rest = "".join(f", {f}=True" for f in flags if getattr(self, f))
        return f"Recurrence({self.cell!r}{rest})"


def _concat(f: Any, b: Any) -> Any:
    return array_namespace(f, b).concatenate([f, b], axis=-1)  # `concat` is not in CuPy 13


def _mean(f: Any, b: Any) -> Any:
    return (f + b) * 0.5


# Module-level functions, so that a Bidirectional pickles.
_MERGES: dict[str, Callable[[Any, Any], Any]] = {
    "concat": _concat,
    "sum": operator.add,
    "mean": _mean,
    "mul": operator.mul,
}


def _check_cells(forward_cell: Layer, backward_cell: Layer, merge: Any) -> None:
    """Refuse cells that cannot read one input or whose outputs `merge` cannot combine."""
    sizes = {}
    for what in ("in_dims", "hidden"):
        f, b = getattr(forward_cell, what, None), getattr(backward_cell, what, None)
        sizes[what] = (f, b) if f is not None and b is not None and f != b else None
    if sizes["in_dims"]:
        f, b = sizes["in_dims"]
        raise ValueError(f"Bidirectional: both cells read the same input, got in_dims {f} ({forward_cell!r}) and {b} ({backward_cell!r})")
    if sizes["hidden"] and isinstance(merge, str) and merge != "concat":
        f, b = sizes["hidden"]
        raise ValueError(
            f"Bidirectional: merge={merge!r} combines the outputs elementwise and needs one hidden size, got "
            f"{f} ({forward_cell!r}) and {b} ({backward_cell!r}); use merge='concat' for different sizes"
        )


class Bidirectional(Layer):
    """Two recurrences over ``(batch, seq, in_dims)`` (or `Padded`): `forward_cell` from
    the start, `backward_cell` from the end, their outputs (aligned with the input
    positions) merged by `merge`: "concat" (last axis, forward first, as PyTorch's
    ``bidirectional=True``), "sum", "mean", "mul" (these need cells of one hidden size) or
    a function ``merge(forward, backward)``.

    With ``return_sequence=True`` (the default) the output is ``(batch, seq, H)``, else the
    merge of each direction's last output (forward at position seq - 1, backward at 0, as
    PyTorch's ``h_n``; with `Padded` input, forward at each sequence's last step).
    ``return_carry=True`` returns ``(y, (forward_carry, backward_carry))``, each direction's
    carry after its last step; an input ``(x, (forward_carry, backward_carry))`` starts
    from these. Parameters and state ``{"forward": {"cell": ...},
    "backward": {"cell": ...}}``: two `Recurrence` layers.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.Bidirectional(lx.GRUCell(3, 4), lx.GRUCell(3, 4))
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((2, 6, 3), np.float32), ps, st)[0].shape
    (2, 6, 8)
    """

    def __init__(
        self, forward_cell: Layer, backward_cell: Layer, *, merge: str | Callable[[Any, Any], Any] = "concat",
        return_sequence: bool = True, return_carry: bool = False,
    ) -> None:  # fmt: skip
        if not (callable(merge) or (isinstance(merge, str) and merge in _MERGES)):
            raise ValueError(f"Bidirectional: merge must be one of {sorted(_MERGES)} or a function, got {merge!r}")
        _check_cells(forward_cell, backward_cell, merge)
        options = {"return_sequence": return_sequence, "return_carry": return_carry}
        self.forward = Recurrence(forward_cell, **options)
        self.backward = Recurrence(backward_cell, reverse=True, **options)
        self.merge = merge
        self._combine = _MERGES[merge] if isinstance(merge, str) else merge
        self.return_sequence = bool(return_sequence)
        self.return_carry = bool(return_carry)

    def children(self) -> Iterator[tuple[str, Layer]]:
        return iter((("forward", self.forward), ("backward", self.backward)))

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, carry = split_carry(self, x)
        if carry is not None and not (isinstance(carry, tuple) and len(carry) == 2):
            raise LayerError(f"{self}: expected the carry as (forward_carry, backward_carry), got {type(carry).__name__}")
        x_f, x_b = (x, x) if carry is None else ((x, carry[0]), (x, carry[1]))
        f, st_f = call_child("forward", self.forward, x_f, ps, st)
        b, st_b = call_child("backward", self.backward, x_b, ps, st)
        st = {"forward": st_f, "backward": st_b}
        if self.return_carry:
            (f, carry_f), (b, carry_b) = f, b
        y = Padded(self._combine(f.x, b.x), f.lengths) if isinstance(f, Padded) else self._combine(f, b)
        return ((y, (carry_f, carry_b)) if self.return_carry else y), st

    def __repr__(self) -> str:
        merge = "" if self.merge == "concat" else f", merge={self.merge if isinstance(self.merge, str) else getattr(self.merge, '__name__', self.merge)!r}"
        rs = "" if self.return_sequence else ", return_sequence=False"
        rc = ", return_carry=True" if self.return_carry else ""
        return f"Bidirectional({self.forward.cell!r}, {self.backward.cell!r}{merge}{rs}{rc})"
