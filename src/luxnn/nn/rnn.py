"""Stacked recurrent layers as PyTorch's ``nn.LSTM``, ``nn.GRU`` and ``nn.RNN``: `LSTM`,
`GRU` and `RNN`, built of `Recurrence` or `Bidirectional` layers over today's cells."""

from __future__ import annotations

from typing import Any, Iterator

from ..ad.namespace import array_namespace
from ..core import Layer, LayerError, call_child
from .dropout import Dropout
from .recurrence import Bidirectional, Padded, Recurrence, split_carry
from .recurrent import GRUCell, LSTMCell, RecurrentCell, RNNCell

__all__ = ["LSTM", "GRU", "RNN"]


class _Stacked(Layer):
    """`num_layers` recurrences, each reading the previous one's sequence output (see
    `LSTM`); subclasses name the cell."""

    carry_parts = 1  # the arrays of a cell's carry: h (2 for the LSTM's (h, c))

    def _cell(self, in_dims: int) -> RecurrentCell:
        raise NotImplementedError

    def __init__(
        self, in_dims: int, hidden: int, num_layers: int = 1, *, bidirectional: bool = False, dropout: float = 0.0,
        use_bias: bool = True, return_sequence: bool = True, return_carry: bool = False,
    ) -> None:  # fmt: skip
        name = type(self).__name__
        if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 1:
            raise ValueError(f"{name}: num_layers must be a positive integer, got {num_layers!r}")
        if not isinstance(dropout, (int, float)) or isinstance(dropout, bool) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"{name}: dropout must be a probability in [0, 1), got {dropout!r}")
        self.in_dims, self.hidden, self.num_layers = in_dims, hidden, num_layers
        self.bidirectional, self.dropout, self.use_bias = bool(bidirectional), float(dropout), bool(use_bias)
        self.return_sequence, self.return_carry = bool(return_sequence), bool(return_carry)
        self.directions = 2 if self.bidirectional else 1
        self.layers = []
        for k in range(num_layers):
            # every layer but the last returns its sequence, for the next one to read
            options = {"return_sequence": return_sequence or k < num_layers - 1, "return_carry": True}
            cell_in = in_dims if k == 0 else self.directions * hidden
            if self.bidirectional:
                self.layers.append(Bidirectional(self._cell(cell_in), self._cell(cell_in), **options))
            else:
                self.layers.append(Recurrence(self._cell(cell_in), **options))
        # torch's dropout: on the outputs of every layer but the last, in training mode
        self.drop = Dropout(self.dropout) if self.dropout > 0 and num_layers > 1 else None

    def children(self) -> Iterator[tuple[str, Layer]]:
        named = [(f"layer_{k + 1}", layer) for k, layer in enumerate(self.layers)]
        return iter(named + ([("dropout", self.drop)] if self.drop is not None else []))

    def __call__(self, x: Any, ps: dict[str, Any], st: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        x, start = split_carry(self, x)
        starts = self._unstacked(start) if start is not None else None
        new_st, carries = dict(st), []
        for k, layer in enumerate(self.layers):
            if k > 0 and self.drop is not None:
                seq = x.x if isinstance(x, Padded) else x
                seq, new_st["dropout"] = call_child("dropout", self.drop, seq, ps, new_st)
                x = Padded(seq, x.lengths) if isinstance(x, Padded) else seq
            name = f"layer_{k + 1}"
            if starts is not None:
                x = (x, starts[k])
            (x, carry), new_st[name] = call_child(name, layer, x, ps, new_st)
            carries.extend(carry if self.bidirectional else (carry,))
        return ((x, self._stacked(carries)) if self.return_carry else x), new_st

    def _unstacked(self, start: Any) -> list[Any]:
        """Each layer's carry to start from, out of PyTorch's stacked ``h_0`` (or ``(h_0,
        c_0)``): a cell's carry, or a pair of them for a bidirectional layer."""
        parts = start if self.carry_parts == 2 and isinstance(start, tuple) else (start,)
        count = self.num_layers * self.directions
        shapes = [getattr(p, "shape", None) for p in parts]
        if len(parts) != self.carry_parts or any(s is None or len(s) != 3 or (s[0], s[2]) != (count, self.hidden) for s in shapes):
            kind = "(h_0, c_0), each" if self.carry_parts == 2 else "h_0"
            raise LayerError(f"{self}: expected the carry {kind} of shape ({count}, batch, {self.hidden}), got {shapes}")
        cells = [tuple(p[i] for p in parts) if self.carry_parts == 2 else parts[0][i] for i in range(count)]
        if self.bidirectional:
            return [(cells[2 * k], cells[2 * k + 1]) for k in range(self.num_layers)]
        return cells

    def _stacked(self, carries: list[Any]) -> Any:
        """PyTorch's ``h_n`` ``(num_layers * directions, batch, hidden)`` (layer by layer, the
        forward direction first), or ``(h_n, c_n)`` for the LSTM's carries ``(h, c)``."""
        if isinstance(carries[0], tuple):
            return tuple(self._stacked([c[i] for c in carries]) for i in range(len(carries[0])))
        return array_namespace(*carries).stack(carries, axis=0)

    def __repr__(self) -> str:
        defaults = {"num_layers": 1, "bidirectional": False, "dropout": 0.0, "use_bias": True, "return_sequence": True, "return_carry": False}
        extra = "".join(f", {k}={getattr(self, k)!r}" for k, v in defaults.items() if getattr(self, k) != v)
        return f"{type(self).__name__}({self.in_dims} => {self.hidden}{self._repr_extra()}{extra})"

    def _repr_extra(self) -> str:
        return ""


class LSTM(_Stacked):
    """A stack of `num_layers` LSTMs over ``(batch, seq, in_dims)`` or `Padded` input, as
    ``torch.nn.LSTM(in_dims, hidden, num_layers, batch_first=True, bidirectional=,
    dropout=)``: layer k + 1 reads layer k's outputs (both directions concatenated),
    `dropout` applies to every layer's output but the last's in training mode.

    The output is every step's ``(batch, seq, D * hidden)`` (D = 2 if `bidirectional`,
    else 1; `Padded` for `Padded` input), or with ``return_sequence=False`` the last layer's
    last output ``(batch, D * hidden)``; with ``return_carry=True``, ``(output, (h_n,
    c_n))``, each ``(num_layers * D, batch, hidden)`` ordered as PyTorch's. An input ``(x,
    (h_0, c_0))`` of these shapes starts from them (else from zeros). Parameters
    ``{"layer_k": {"cell": ...}}``, or ``{"layer_k": {"forward": {"cell": ...}, "backward":
    {"cell": ...}}}`` if `bidirectional`, each an `LSTMCell`'s; state also ``{"dropout":
    ...}`` with `dropout`.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.LSTM(3, 8, num_layers=2, bidirectional=True, return_carry=True)
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> (y, (h_n, c_n)), st = model(np.ones((4, 7, 3), np.float32), ps, st)
    >>> y.shape, h_n.shape, ps["layer_2"]["forward"]["cell"]["weight_ih"].shape
    ((4, 7, 16), (4, 4, 8), (16, 32))
    """

    carry_parts = 2

    def _cell(self, in_dims: int) -> RecurrentCell:
        return LSTMCell(in_dims, self.hidden, use_bias=self.use_bias)


class GRU(_Stacked):
    """A stack of GRUs, as ``torch.nn.GRU``: as `LSTM`, over `GRUCell` layers; the carry is
    h alone (``return_carry=True`` returns ``(output, h_n)``, an input ``(x, h_0)`` starts
    from h_0).

    >>> import numpy as np, luxnn as lx
    >>> model = lx.GRU(3, 8, num_layers=2, dropout=0.1)
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((4, 7, 3), np.float32), ps, st)[0].shape
    (4, 7, 8)
    """

    def _cell(self, in_dims: int) -> RecurrentCell:
        return GRUCell(in_dims, self.hidden, use_bias=self.use_bias)


class RNN(_Stacked):
    """A stack of Elman RNNs, as ``torch.nn.RNN`` (``nonlinearity`` is `activation` here,
    "tanh" or "relu"): as `GRU`, over `RNNCell` layers.

    >>> import numpy as np, luxnn as lx
    >>> model = lx.RNN(3, 8, activation="relu", return_sequence=False)
    >>> ps, st = lx.setup(np.random.default_rng(0), model)
    >>> model(np.ones((4, 7, 3), np.float32), ps, st)[0].shape
    (4, 8)
    """

    def __init__(self, in_dims: int, hidden: int, num_layers: int = 1, *, activation: str = "tanh", **options: Any) -> None:
        if activation not in ("tanh", "relu"):
            raise ValueError(f"RNN: activation must be 'tanh' or 'relu', got {activation!r}")
        self.activation = activation
        super().__init__(in_dims, hidden, num_layers, **options)

    def _cell(self, in_dims: int) -> RecurrentCell:
        return RNNCell(in_dims, self.hidden, self.activation, use_bias=self.use_bias)

    def _repr_extra(self) -> str:
        return "" if self.activation == "tanh" else ", relu"
