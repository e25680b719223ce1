"""One training step captured as a CUDA graph (`luxnn.graphs` captures and replays them):
the graph, what it reads (the addresses and layouts of its inputs), where it writes (its
temporaries in the plans' arena, those the pools served kept with it, and its results'
allocations), and the functions run around each launch (`luxnn.capturing`).

Its results are not kept: a launch makes them again as arrays of the allocator cache where
the graph writes them (`AllocCache.place_next`), as an eager step's, so a result that a
loop still holds from an earlier launch keeps its place and the launch does not happen.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import numpy as np

from . import tree
from .backend import is_array

__all__ = ["StepGraph", "on_device", "layout", "allocation", "ranges", "placed"]


def on_device(x: Any) -> bool:
    """Whether `x` is an array of a device's (not NumPy's)."""
    return is_array(x) and not isinstance(x, np.ndarray)


def layout(leaf: Any) -> Any:
    """What a graph depends on of an input leaf: a device array's address and layout, a
    host array's values (read by the captured Python), any other leaf itself."""
    if on_device(leaf):
        return leaf.data.ptr, leaf.shape, leaf.strides, leaf.dtype.str
    if isinstance(leaf, np.ndarray):
        return leaf.shape, leaf.dtype.str, leaf.tobytes()
    return leaf


def allocation(a: Any) -> int:
    """The address of the allocation that device array `a` lies in."""
    return a.data.mem.ptr


def placed(cache: Any, ptr: int, allocate: Callable[[int], Any], size: int) -> Any:
    """``allocate(size)`` served at `ptr` where the cache can (`AllocCache.place_next`),
    else anywhere; the claim never outlives the call."""
    cache.place_next(ptr)
    try:
        return allocate(size)
    finally:
        cache.place_next(0)  # used up by the request, or never: address 0 is no block's


def ranges(ranges: list[tuple[int, int]]) -> tuple[bytes, bytes]:
    """(address, bytes) pairs as `AllocCache.arena_free` takes them."""
    return np.array([p for p, _ in ranges], np.int64).tobytes(), np.array([n for _, n in ranges], np.int64).tobytes()


class Placed(NamedTuple):
    """A result of a graph: where it lies in one of the graph's allocations, its layout."""

    allocation: int
    offset: int
    shape: tuple
    dtype: Any
    strides: tuple


class StepGraph:
    """One captured step: its CUDA graph, what it reads (`layout` of its inputs), where
    its temporaries lie in the plans' arena (`ptrs` and `sizes`; those the pools served,
    it keeps: `held`), where its results lie (`allocations`, `parts`), and the functions
    run around each launch."""

    def __init__(self, graph: Any, inputs: list, results: tuple, fresh: dict, temporaries: list, held: list,
                 hooks: Any) -> None:
        self.graph, self.hooks = graph, hooks
        self.layout = [layout(x) for x in inputs]
        self.input_ptrs = [x.data.ptr if on_device(x) else None for x in inputs]
        allocations: dict[int, int] = {}
        self.parts = []
        for part in results:  # grads, loss, stats, states, optimizer state
            leaves, structure = tree.flatten(part)
            out = []
            for leaf in leaves:
                base = allocation(leaf) if on_device(leaf) else None
                if base in fresh:
                    allocations[base] = fresh[base]
                    leaf = Placed(base, leaf.data.ptr - base, leaf.shape, leaf.dtype, leaf.strides)
                out.append(leaf)
            self.parts.append((structure, out))
        self.allocations = list(allocations.items())
        self.ptrs, self.sizes = ranges(temporaries)
        self.event = None  # recorded after the last launch when hooks read its results
        self.held = held  # memory of its temporaries that the cache's pools served

    def closing(self, recorded: tuple, ts: Any) -> dict[int, int]:
        """For the capture `recorded` of the step after this graph's: where its allocations
        must be for its new states and optimizer state to lie where this graph reads
        them (by allocation index; empty: they do), so that the two replay in turn."""
        _, parts, allocations, _ = recorded
        last = {ptr: i for i, (ptr, _) in enumerate(allocations)}  # the live one: made last there
        skip = len(tree.leaves(ts.parameters))
        places = {}
        for leaf, want in zip(tree.leaves(parts[3:]), self.input_ptrs[skip:]):
            base = allocation(leaf) if on_device(leaf) else None
            if base in last and want is not None and leaf.data.ptr != want:
                places[last[base]] = want - (leaf.data.ptr - base)
        return places

    def reads(self, inputs: list) -> bool:
        return len(inputs) == len(self.layout) and all(map(lambda x, want: layout(x) == want, inputs, self.layout))

    def results(self, xp: Any, cache: Any) -> list | None:
        """This launch's results: (grads, loss, stats, states, optimizer state), arrays of
        the cache made where the graph writes them; None if a place is taken (a result of
        an earlier launch that a loop still holds). Call it in a `cached` scope of `cache`."""
        memory = {}
        for ptr, size in self.allocations:
            memory[ptr] = placed(cache, ptr, xp.cuda.alloc, size)
            if memory[ptr].ptr != ptr:
                return None
        return [
            tree.unflatten(structure, [
                xp.ndarray(x.shape, x.dtype, memptr=memory[x.allocation] + x.offset, strides=x.strides)
                if isinstance(x, Placed) else x for x in leaves
            ])
            for structure, leaves in self.parts
        ]  # fmt: skip

    def launch(self, xp: Any, stream: Any, launched: list) -> None:
        """Launches the graph on `stream`, with the hooks around it; `launched` gets an item
        in the same C call that launches (`list.extend` over `map`), so that an interrupt
        raised as the call returns still finds the launch recorded."""
        if self.event is not None and not self.event.done:
            self.event.synchronize()  # the flags of its last launch read before it writes them again
        for fn in self.hooks.before:
            fn()
        launched.extend(map(self.graph.launch, (stream,)))
        for fn in self.hooks.after:
            fn()
        if self.hooks.after:
            self.event = xp.cuda.Event(disable_timing=True)
            self.event.record(stream)
