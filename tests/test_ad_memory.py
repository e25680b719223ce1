"""The backward pass frees each node's saved values as soon as it has run.

The forward pass of a chain of N ops must keep O(N) saved arrays alive (that is the
forward's own working set). These tests check that the backward pass gives them back as it
goes: probes on the tape observe what is still alive while the VJPs run, so a tape that
kept every node until the end fails them. And a VJP closes over no input it does not need,
so intermediates die during the forward pass once nothing else uses them.
"""

from __future__ import annotations

import tracemalloc
import weakref

import numpy as np
import pytest

import luxnn as lx
from luxnn import ops
from luxnn.ad import primitive
from luxnn.ad import primitives as P

N = 40


class Saved:
    """A weakref-able stand-in for a value a VJP closes over."""

    def __init__(self, k: int) -> None:
        self.k = k


def tracked_double(refs: list, on_vjp=lambda saved: None):
    """A primitive ``x -> 2 x`` whose VJP closes over a `Saved`, weakly listed in `refs`."""

    @primitive
    def double(x):
        saved = Saved(len(refs))
        refs.append(weakref.ref(saved))

        def vjp(g, needs):
            on_vjp(saved)
            return (g * 2,)

        return x * 2, vjp

    return double


def test_saved_values_die_as_soon_as_their_node_has_run():
    refs: list[weakref.ref] = []
    alive_during: list[list[int]] = []

    def on_vjp(saved):
        # Every node recorded after this one has already run: its Saved must be gone.
        alive_during.append([r().k for r in refs[saved.k + 1:] if r() is not None])

    double = tracked_double(refs, on_vjp)

    def f(x):
        for _ in range(N):
            x = double(x)
        return x.sum()

    g = lx.grad(f)(np.ones(3))
    np.testing.assert_array_equal(g, np.full(3, 2.0**N))
    assert len(alive_during) == N
    assert all(not alive for alive in alive_during), alive_during
    assert all(r() is None for r in refs)


def test_no_saved_value_outlives_value_and_grad():
    refs: list[weakref.ref] = []
    double = tracked_double(refs)

    def f(x):
        y = double(x)
        return (double(y) * y).sum(), {"aux": double(y)}  # the aux node comes after the output

    (_, aux), g = lx.value_and_grad(f, has_aux=True)(np.ones(3))
    np.testing.assert_array_equal(g, np.full(3, 16.0))
    assert type(aux["aux"]) is np.ndarray and len(refs) == 3
    assert all(r() is None for r in refs), "the tape kept nodes alive after returning"


def _memory_probe(events: dict, name: str):
    """An identity primitive whose VJP records traced memory (current, peak) when it runs."""

    @primitive
    def probe(x):
        def vjp(g, needs):
            events[name] = tracemalloc.get_traced_memory()
            if name == "last":
                tracemalloc.reset_peak()  # the backward pass starts here
            return (g,)

        return x, vjp

    return probe


def _chain(x):
    """N elementwise primitives, each saving (at least) one array the size of x."""
    for k in range(N):
        x = [P.exp, P.tanh, ops.sigmoid, P.sin][k % 4](x * 0.5)
    return x


def test_backward_memory_stays_at_a_few_arrays():
    x = np.random.default_rng(0).uniform(0.1, 1.0, size=2**17)  # 1 MiB
    nbytes = x.nbytes
    events: dict = {}
    first, last = _memory_probe(events, "first"), _memory_probe(events, "last")

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        value, g = lx.value_and_grad(lambda x: last(_chain(first(x))).sum())(x)
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()

    start, end, peak = events["last"][0], *events["first"]
    # The forward's own working set: every op's saved array, alive when the backward starts.
    assert start - base > N * nbytes
    # While the VJPs run, a few arrays beyond it at most (cotangents), never O(N) more.
    assert peak - start < 4 * nbytes
    # When the last VJP runs, the saved values of all the others have been released.
    assert end - base < 4 * nbytes
    # Afterwards only the gradient (and the scalar value) is left.
    assert after - base < 1.5 * nbytes
    assert g.shape == x.shape and np.isfinite(g).all()


# Primitives whose VJP needs none of their input's values (only its shape, or their output).
# Views (reshape, transpose, basic indexing) are left out: their output keeps the input's memory.
INPUT_NOT_NEEDED = {
    "add": lambda a: a + 1.0,
    "subtract": lambda a: 1.0 - a,
    "divide-numerator": lambda a: a / 2.0,
    "negative": lambda a: -a,
    "exp": P.exp,
    "tanh": P.tanh,
    "sqrt": P.sqrt,
    "sigmoid": ops.sigmoid,
    "relu": ops.relu,
    "leaky_relu": ops.leaky_relu,
    "elu": ops.elu,
    "softmax": ops.softmax,
    "log_softmax": ops.log_softmax,
    "sum": lambda a: P.sum(a, axis=0),
    "mean": P.mean,
    "astype": lambda a: P.astype(a, np.float32),
    "concat": lambda a: P.concat([a, a]),
    "stack": lambda a: P.stack([a, a]),
    "take": lambda a: P.take(a, [0, 1]),
    "advanced-index": lambda a: a[[0, 1]],
    "broadcasting-add": lambda a: a + np.ones((2, 3, 4)),
    "where": lambda a: P.where(np.eye(3, 4, dtype=bool), a, 0.0),
}


@pytest.mark.parametrize("fn", INPUT_NOT_NEEDED.values(), ids=INPUT_NOT_NEEDED.keys())
def test_vjp_does_not_keep_an_input_it_does_not_need(fn):
    kept = []

    def f(x):
        a = x * 1.0  # an intermediate only `fn` uses (multiply saves x, not its output)
        ref = weakref.ref(a.value)
        y = fn(a)
        del a
        kept.append(ref() is not None)
        return y.sum()

    g = lx.grad(f)(np.full((3, 4), 2.0))
    assert g.shape == (3, 4) and kept == [False]
