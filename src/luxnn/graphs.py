"""A warm training step captured as a CUDA graph and replayed (``TrainState(..., graphs=True)``).

A fixed-shape loop of `single_train_step_` on a GPU repeats the same kernels on the same
buffers: the allocator's plan (`luxnn.memory.plan`) gives every request of the step a
fixed place in one arena, on a cycle of two steps (the results of one step live while the
next runs). So once the plan serves two steps with no miss, the runner captures the next
two steps on the cache's stream and from then on replays them in turn: the GPU runs the
recorded kernels and the host launches one graph instead of each kernel. The second
capture makes its new states and optimizer state where the first graph reads them, so
that the two chain (the pools serve a step's small requests made before its first large
one, and their blocks move).

Signature. A graph belongs to one signature of the step: the model, the optimizer, the
objective and the AD backend (by identity), the batch's structure, shapes and dtypes, and
the states' structure and non-array leaves (a layer's ``training`` flag). A step of another
signature runs eagerly; graphs are kept for the `MAX_SIGNATURES` most recent.

A replay, else an eager step (and captures anew later), when:
- the inputs, every leaf of the parameters, states and optimizer state, are at the
  addresses and have the layouts the graph read (not after ``ts.replace(parameters=...)``
  or a loaded state);
- the graph's temporaries lie in the cache's arena, free (`AllocCache.arena_free`: not
  after a new plan or a trim, nor with an array kept there since), those the pools served
  kept by the graph;
- its results can be made where it writes them (`AllocCache.place_next`): arrays of the
  cache, as an eager step's, so that a result kept from an earlier step (a stored
  gradient) is never overwritten: its place is taken, and the step runs eagerly.
The batch is copied into the signature's input buffers (one copy per leaf; its eager
steps read them too); the loss and the stats come back as copies, which a loop may keep.

What a capture cannot hold runs eagerly, with one `GraphFallbackWarning` naming the
reason once `CAPTURE_TRIES` captures failed: an operation the device refuses while
capturing (a host synchronisation such as ``float(loss)`` in the objective, CuPy's own
cuBLAS), or a value the host computes at every step (`luxnn.capturing.host_value`: a
learning-rate schedule, a dropout draw). A failed capture ran nothing on the device: the
eager step then does the step, and raises what it raises.

Python that the step runs, the objective's included, runs at the captures (twice for the
second graph, recorded again to chain): a replay repeats its kernels only. Host values in
the batch are part of the signature. The runners of one cache share one stream: the cache
serves the stream it was first used on; one first used on another runs eagerly.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np

from . import capturing, tree
from .backend import is_array
from .memory import bin_size, cached, step
from .memory.plan import MATCH_ABOVE
from .step_graph import StepGraph, allocation, on_device, placed, ranges
from .optim.arrays import overwritten

__all__ = ["GraphFallbackWarning", "GraphStats", "Runner", "stats", "MAX_SIGNATURES", "CAPTURE_TRIES"]

MAX_SIGNATURES = 4
"""Signatures whose graphs are kept, the most recently used."""
CAPTURE_TRIES = 3
"""Failed tries before a signature stays eager: captures that failed or gave no graph to
keep, and graphs dropped before any of them replayed."""
GRAPHS = 2  # a signature's graphs: the plan's cycle of two steps
UNPLANNED = 8  # eager steps in a row of a signature not served wholly by a plan before that is said, once
WARM = 2  # eager steps the same plans serve with no miss before a capture: both places of
# the cycle seen (and what a step sets up once per set of addresses: a pointer table)

# A step's work: ``work(data) -> (grads, loss, stats, ts)`` without the bookkeeping of an
# in-place verb, and ``advance(new, ts)``, which does it (`ts` consumed, `new` to use) and
# returns the transition: its ``undo()`` for a step not done, its ``settle()`` for a step
# done whose new state the call cannot return (`luxnn.training`).
Work = Callable[[Any], tuple]
Advance = Callable[[Any, Any], Any]


class GraphFallbackWarning(RuntimeWarning):
    """A training step that could not be captured as a CUDA graph ran eagerly."""


class GraphStats(NamedTuple):
    """A training state's graph figures: steps captured, replayed and run eagerly, graphs
    kept now, and the last reason a capture fell back (None: none did)."""

    captures: int
    replays: int
    eager: int
    kept: int
    last_fallback: str | None


def stats(ts: Any) -> GraphStats:
    """The `GraphStats` of training state `ts` (all zero where it has no runner: the CPU,
    ``graphs=False``, no allocator cache).

    >>> import numpy as np, luxnn as lx
    >>> ps, st = lx.setup(np.random.default_rng(0), lx.Dense(3, 2))
    >>> lx.graphs.stats(lx.TrainState(lx.Dense(3, 2), ps, st, lx.optim.sgd(0.1)))
    GraphStats(captures=0, replays=0, eager=0, kept=0, last_fallback=None)
    """
    runner = ts.graph_runner
    return runner.stats() if runner is not None else GraphStats(0, 0, 0, 0, None)


def _static(leaf: Any) -> Any:
    """A states leaf in a signature: an array by its kind (its values are the graph's
    input), a plain value by itself, anything else by its type."""
    if is_array(leaf):
        return None
    return leaf if isinstance(leaf, (bool, int, float, str, type(None))) else type(leaf)


def _host_value(leaf: Any) -> Any:
    """A batch's leaf on the host in a signature: what the step's Python reads of it, by
    value (a replay repeats what its capture read); an object by itself (its identity)."""
    if isinstance(leaf, (np.ndarray, np.generic)):
        return leaf.dtype.str, leaf.shape, leaf.tobytes()
    try:
        hash(leaf)
    except TypeError:
        return type(leaf)
    return leaf


class _Signature:
    """A signature's graphs (least recently launched first), its batch buffers, and what
    its last eager step showed."""

    def __init__(self) -> None:
        self.graphs: list[StepGraph] = []
        self.buffers: Any = None
        self.warm = 0  # eager steps in a row the same plans served with no miss
        self.unplanned = 0  # eager steps in a row that its plans did not serve wholly
        self.plans = 0  # the cache's plans installed at its last eager step
        self.tries = 0  # failed tries (CAPTURE_TRIES)
        self.replayed = False  # whether a graph it keeps now has been replayed
        self.capturable = True


# A cache serves the stream current at its first scope (`luxnn.memory.cupy_backend`): the
# runners of one cache share the stream the first of them made for it.
_STREAMS: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _stream_for(xp: Any, cache: Any) -> tuple[Any, str | None]:
    """The stream that a runner of `cache` runs steps on, and why it cannot capture them
    (None: it can)."""
    stream = _STREAMS.get(cache)
    if stream is None and cache.front_end.stream is None:
        stream = _STREAMS[cache] = xp.cuda.Stream(non_blocking=False)  # waits for the legacy default stream
    if stream is None:
        return None, ("its allocator cache was first used on another stream, which it alone serves (a CUDA "
                      "training state's cache is first used by the state, on a stream of its own)")
    return stream, None


class Runner:
    """Captures and replays the in-place training steps of one training state (and the
    states made from it), on a stream of its own that its allocator cache serves."""

    def __init__(self, xp: Any, cache: Any) -> None:
        self.xp, self.cache = xp, cache
        self.stream, self._unusable = _stream_for(xp, cache)
        self._signatures: OrderedDict[Any, _Signature] = OrderedDict()
        self._counts = {"captures": 0, "replays": 0, "eager": 0}
        self._last_fallback: str | None = None
        self._warned: set[str] = set()

    def stats(self) -> GraphStats:
        kept = sum(len(s.graphs) for s in self._signatures.values())
        return GraphStats(self._counts["captures"], self._counts["replays"], self._counts["eager"], kept,
                          self._last_fallback)

    @contextlib.contextmanager
    def on_stream(self) -> Iterator[None]:
        """The runner's stream as the current one, ordered after the work queued before on
        the current stream, and that stream after it (the legacy default stream does both
        by itself)."""
        current = self.xp.cuda.get_current_stream()
        if self.stream is None or current.ptr == self.stream.ptr:
            yield
            return
        if current.ptr != 0:
            self.stream.wait_event(current.record())
        try:
            with self.stream:
                yield
        finally:
            if current.ptr != 0:
                current.wait_event(self.stream.record())

    def step(self, ad: Any, objective: Any, data: Any, ts: Any, work: Work, advance: Advance) -> tuple:
        """One in-place training step: replayed, captured or eager (see the module)."""
        with self.on_stream():
            if self._unusable is not None:
                self._warn(self._unusable)
                return self._eager(None, data, ts, work, advance)
            key = self._signature(ad, objective, data, ts)
            entry = self._signatures.get(key)
            if entry is None:
                entry = self._signatures[key] = _Signature()
                while len(self._signatures) > MAX_SIGNATURES:
                    self._signatures.popitem(last=False)
            self._signatures.move_to_end(key)
            if entry.graphs and entry.capturable:
                inputs = tree.leaves((ts.parameters, ts.states, ts.optimizer_state))
                for graph in entry.graphs:
                    if graph.reads(inputs) and self.cache.arena_free(graph.ptrs, graph.sizes):
                        replayed = self._replay(entry, graph, data, ts, advance)
                        if replayed is not None:
                            return replayed
                if len(entry.graphs) == GRAPHS:  # none can replay: eager steps, then captures anew
                    replayed = entry.replayed
                    entry.graphs.clear()  # what they keep goes back: the eager step's plan needs the places
                    entry.warm, entry.replayed = 0, False
                    if not replayed:  # as soon as captured: what they read or write is held elsewhere
                        self._failed(entry, "its graphs' inputs, or the places of their results, were taken "
                                            "by arrays kept from earlier steps (a training state still referenced?)")
            if entry.warm >= WARM and entry.capturable:
                return self._capture(entry, data, ts, work, advance)
            return self._eager(entry, data, ts, work, advance)

    def _signature(self, ad: Any, objective: Any, data: Any, ts: Any) -> tuple:
        batch, batch_structure = tree.flatten(data)
        states, states_structure = tree.flatten(ts.states)
        return (
            ts.model, ts.optimizer, objective, type(ad), batch_structure,
            tuple((type(x), x.shape, x.dtype.str) if on_device(x) else _host_value(x) for x in batch),
            states_structure, tuple(map(_static, states)),
        )  # fmt: skip

    def _eager(self, entry: _Signature | None, data: Any, ts: Any, work: Work, advance: Advance,
               then: Callable[[], None] | None = None) -> tuple:
        """The step run eagerly (reading the signature's input buffers while it may be
        captured); what the cache did for it tells whether the signature is warm. `then`
        runs after the step. Once the step is done, an error or an interrupt (a warning
        raised as an error) leaves the given state as after it."""
        capturable = entry is not None and entry.capturable
        batch = self._copy_batch(entry, data) if capturable else data
        before = self.cache.stats() if capturable else None
        with step(self.cache):
            grads, loss, stats_, new = work(batch)
        transition = advance(new, ts)
        try:
            self._counts["eager"] += 1
            if capturable:
                self._warmed(entry, before, self.cache.stats())
            if then is not None:
                then()
        except BaseException:
            transition.settle()
            raise
        return grads, loss, stats_, new

    def _warmed(self, entry: _Signature, before: Any, after: Any) -> None:
        # Warm: served by the plan with no miss (the pools serve the small requests made
        # before a step's first large one picks its plan), and by the same plans as the
        # steps before (a new one moves blocks).
        planned = after.misses == before.misses and after.plan_hits > before.plan_hits
        entry.warm = 0 if not planned else entry.warm + 1 if after.plans == entry.plans else 1
        entry.plans = after.plans
        entry.unplanned = 0 if planned else entry.unplanned + 1
        if entry.unplanned == UNPLANNED and after.plan_hits == before.plan_hits:
            self._warn("no plan of the allocator cache serves it (a cache plans a step that repeats and makes a "
                       f"request above {MATCH_ABOVE // 1024} KiB; a capture needs the plan's fixed places)")
        elif entry.unplanned == UNPLANNED:
            self._warn(f"the allocator cache's plans did not serve all of its requests at {UNPLANNED} steps in a "
                       "row (a capture needs every request at a plan's fixed place)")

    def _replay(self, entry: _Signature, graph: StepGraph, data: Any, ts: Any, advance: Advance) -> tuple | None:
        with cached(self.cache):
            results = graph.results(self.xp, self.cache)
        if results is None:
            return None
        self._copy_batch(entry, data)
        entry.graphs.remove(graph)
        entry.graphs.append(graph)  # launched last: tried last
        entry.replayed = True
        self._counts["replays"] += 1
        return self._launch(graph, results, ts, advance)

    def _copy_batch(self, entry: _Signature, data: Any) -> Any:
        """The batch with its device arrays copied into the signature's input buffers (made
        at its first step, outside the allocator's steps), which its graphs read and its
        eager steps too: a step captured then sees what the eager steps before it saw (the
        addresses of its inputs, and what is set up for them: a GEMM's layout, a pointer
        table). A non-contiguous array is made contiguous on the way."""
        leaves, structure = tree.flatten(data)
        if entry.buffers is None:
            with cached(self.cache):
                entry.buffers = [self.xp.empty_like(x) if on_device(x) else None for x in leaves]
        for buffer, x in zip(entry.buffers, leaves):
            if buffer is not None:
                self.xp.copyto(buffer, x)
        return tree.unflatten(structure, [x if buffer is None else buffer for buffer, x in zip(entry.buffers, leaves)])

    def _launch(self, graph: StepGraph, results: list, ts: Any, advance: Advance) -> tuple:
        """Launches `graph` for the step of `ts` and returns the step's `results`. The
        state is consumed before the launch; an error or a KeyboardInterrupt leaves it as
        before the step if the launch did not happen, else as after it: a step is done
        whole or not at all."""
        grads, loss, stats_, states, opt_state = results
        new = ts.replace(states=states, optimizer_state=opt_state, step=ts.step + 1)
        transition, launched = advance(new, ts), []
        try:
            graph.launch(self.xp, self.stream, launched)
            overwritten(opt_state)  # a count it hands out may be at the address of an older one
            # The loss and the stats as copies, made after the launch: a loop may keep them,
            # and kept where the graph writes them they would stop its next replay.
            with cached(self.cache):
                return grads, loss.copy(), tree.map(lambda x: x.copy() if on_device(x) else x, stats_), new
        except BaseException:
            # Not launched: the state given back as it was. Launched: the step is done, and
            # the state given becomes the one the call would have returned.
            transition.settle() if launched else transition.undo()
            raise

    def _capture(self, entry: _Signature, data: Any, ts: Any, work: Work, advance: Advance) -> tuple:
        batch = self._copy_batch(entry, data)
        try:
            recorded = self._record(ts, batch, work, {})
            partner = entry.graphs[-1] if len(entry.graphs) == 1 else None
            places = partner.closing(recorded, ts) if partner is not None else {}
            if places:  # again, its results made where the partner reads them (the pools' move)
                del recorded
                self.cache.forget_step()
                recorded = self._record(ts, batch, work, places)
        except KeyboardInterrupt:
            self.cache.forget_step()  # nothing ran on the device: the step was not done
            raise
        except Exception as err:  # noqa: BLE001 - whatever the capture met: the eager step says if it was the step's
            failure = f"{type(err).__name__}: {err}"
        else:
            failure = None
        if failure is not None:  # out of the handler: the error's frames, and the arrays they hold, are gone
            self.cache.forget_step()  # its requests stopped part way: nothing to plan from
            return self._fall_back(entry, data, ts, work, advance, failure)
        graph, parts, allocations, hooks = recorded
        del recorded
        fresh = dict(allocations)
        results = {allocation(x) for x in tree.leaves(parts) if on_device(x) and allocation(x) in fresh}
        kept = {allocation(x) for x in hooks.kept if on_device(x) and allocation(x) in fresh}
        temporaries = [(p, n) for p, n in allocations if n and p not in results and p not in kept]
        # A temporary that began where a result now does, and was larger: its bytes past the
        # result's block are written too (a block is a whole number of granules).
        temporaries += [(p + bin_size(fresh[p]), n - bin_size(fresh[p])) for p, n in allocations
                        if p in results and n > bin_size(fresh[p])]
        temporaries, held = self._hold_pooled(temporaries)
        captured = StepGraph(graph, tree.leaves((ts.parameters, ts.states, ts.optimizer_state)), parts, fresh,
                             temporaries, held, hooks)
        self._counts["captures"] += 1
        # Its temporaries in the plan's arena, where a replay can see that they are free
        # (its results it makes where they were, or stays eager). Else this launch only,
        # then eager steps again.
        if self.cache.in_arena(captured.ptrs, captured.sizes):
            entry.graphs.append(captured)  # a capture comes with fewer than GRAPHS kept
        else:
            self._failed(entry, "its memory is not all served by the allocator cache's plan")
        return self._launch(captured, parts, ts, advance)

    def _record(self, ts: Any, batch: Any, work: Work, places: dict[int, int]) -> tuple:
        """Captures the step's work on the runner's stream, in a step of the cache:
        (graph, its results [grads, loss, stats, states, optimizer state], its allocations
        in order as (address, bytes), what the code registered: `capturing.Capture`).
        `places`: the address for the allocation of each index given (`AllocCache.place_next`)."""
        xp, allocations = self.xp, []
        self.stream.begin_capture()
        try:
            with step(self.cache), capturing.capture() as hooks:
                inner = xp.cuda.get_allocator()

                def recording(size: int) -> Any:
                    pointer = placed(self.cache, places[len(allocations)], inner, size) if len(allocations) in places \
                        else inner(size)
                    allocations.append((pointer.ptr, size))
                    return pointer

                with xp.cuda.using_allocator(recording):
                    grads, loss, stats_, new = work(batch)
        except BaseException:
            try:
                self.stream.end_capture()  # an invalidated capture too: the stream is usable again
            except Exception:  # noqa: BLE001, S110 - the error that stopped the capture says more
                pass
            raise
        graph = self.stream.end_capture()
        return graph, [grads, loss, stats_, new.states, new.optimizer_state], allocations, hooks

    def _hold_pooled(self, temporaries: list) -> tuple[list, list]:
        """The temporaries of a capture in the plans' arena, and the memory of those the
        cache's pools served (small requests made before a step's first large one picks
        its plan), taken again now for the graph to keep. One that cannot be had is left
        among the first (and the graph is not kept: it is not in the arena)."""
        arena, held, largest = [], [], {}
        for ptr, size in temporaries:  # a block the capture freed and took again, once
            largest[ptr] = max(size, largest.get(ptr, 0))
        with cached(self.cache):
            for ptr, size in largest.items():
                if self.cache.in_arena(*ranges([(ptr, size)])):
                    arena.append((ptr, size))
                    continue
                memory = placed(self.cache, ptr, self.xp.cuda.alloc, size)
                held.append(memory) if memory.ptr == ptr else arena.append((ptr, size))
        return arena, held

    def _fall_back(self, entry: _Signature, data: Any, ts: Any, work: Work, advance: Advance, reason: str) -> tuple:
        # The eager step raises the step's own error, if it was one.
        return self._eager(entry, data, ts, work, advance, then=lambda: self._failed(entry, reason))

    def _failed(self, entry: _Signature, reason: str) -> None:
        """A capture that failed or gave no graph to keep: eager steps again, and after
        `CAPTURE_TRIES` of them (what was not set up yet before one, say, a new GEMM
        layout, is the next time) no more captures, said once."""
        entry.warm, entry.tries = 0, entry.tries + 1
        self._last_fallback = reason
        if entry.tries >= CAPTURE_TRIES:
            # Its graphs go with the input buffers they read: its eager steps read the batch itself.
            entry.capturable, entry.buffers = False, None
            entry.graphs.clear()
            self._warn(reason)

    def _warn(self, reason: str) -> None:
        self._last_fallback = reason
        if reason not in self._warned:
            self._warned.add(reason)
            warnings.warn(f"luxnn: this training step is not replayed as a CUDA graph and runs eagerly: {reason}",
                          GraphFallbackWarning, stacklevel=_outside_luxnn())


_PACKAGE = os.path.dirname(__file__)


def _outside_luxnn() -> int:
    """The stack level of the first caller outside luxnn, for a warning (from the caller
    of this function's caller)."""
    frame, level = sys._getframe(2), 2
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
