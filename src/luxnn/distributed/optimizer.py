"""`DistributedOptimizer`: gradients averaged over the ranks in flat buckets, then the
inner optimizer.

One collective per parameter array (what Lux's DistributedOptimizer does) pays a
collective's latency per array; a few large messages pay it a few times and run at the
transport's bandwidth. So the gradients are copied into flat buffers, one run of buffers
per dtype, each at most `bucket_bytes` (an array larger than that gets a buffer of its
own), made once for a layout of gradients and kept; each buffer is summed over the ranks in
place; the average is unpacked into fresh arrays (the division by the number of ranks and
the copy are one pass), and the inner transformation gets those. Every rank then holds the
same averaged gradients, so the same updates, and replicas started equal stay bit-identical.

With ``overlap=True`` the buckets travel during the backward pass, as PyTorch DDP's do:
buckets are filled in reverse parameter order (the order in which the backward pass
finishes gradients), a bucket's non-blocking allreduce starts as soon as its last gradient
is in, and `update` waits for them. The training verbs drive it through the optimizer's
``listen`` method (see `ListeningTransformation`); the arithmetic is that of the blocking
path, bucket for bucket.

Each step is a call of every rank (`Backend.call`): the blocking path's update, or the
overlapped path's backward pass, begins with the ranks' agreement, so that a rank one step
ahead or behind the others, or in another call, raises on every rank instead of averaging
another step's gradients. A step whose gradients were computed but never applied (its
objective raised and the loop went on) is made known to the others at the rank's next
`compute_gradients`; their update of that step then raises, and no rank applies it.
The step also scopes the layers' collectives (`step`): they run only between a step's
start (``listen``) and its update, and a rank abandoning the step meets them there.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .. import memory, optim, tree
from ..backend import is_array, module_of
from .backend import Backend, Pending, check_backend, check_int
from .collectives import check_same_layout
from .step import ABANDONED, ABANDONED_STEP, BACKWARD, LAYER_CALLS, UNUSED, Step, begin, end

__all__ = ["DistributedOptimizer", "GradientBuckets", "ListeningTransformation", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 25 << 20  # PyTorch DDP's default bucket_cap_mb
# A round's verdicts, by rank (`GradientBuckets.collect`): the lowest of the ranks' wins.
_ABANDONED, _REPLACED, _USED = 0, 1, 2
# The calls (`Backend.call`) of a step: its gradients' average (the update, or the
# backward pass with overlap); those of abandoning a step are `step`'s.
AVERAGE = "DistributedOptimizer's average of the gradients"
OVERLAPPED = "DistributedOptimizer's backward pass (overlap=True)"


def _not_on_one_device(x: Any, name: str) -> str | None:
    """What is wrong with the devices of tree `x`, or None if it is on one device."""
    from ..devices import get_device

    try:
        get_device(x)
    except ValueError as err:
        return f"the {name} must all be on one device, found {err}"
    return None


def _check_one_device(what: str, x: Any, name: str) -> None:
    problem = _not_on_one_device(x, name)
    if problem is not None:
        raise ValueError(f"{what}: {problem}")


class GradientBuckets:
    """Flat buffers that carry a tree of arrays through an allreduce: `average(x)` returns
    the mean of `x` over the ranks as new arrays, in `x`'s structure.

    The buffers are made (outside any allocator cache) on the first call and again only
    when the layout (structure, dtypes, shapes, devices) changes; a new layout is checked
    to be every rank's (one small collective) before any buffer travels. Leaves go into
    buckets from the last to the first, and `buffers` are in the order their last leaf
    comes in that walk. `pack`, `allreduce` and `unpack` are `average`'s three passes.

    A round streams gradients in instead: `begin` returns ``receive(position,
    gradient)``, which copies leaf `position` in and starts a bucket's non-blocking
    allreduce once the bucket is full and every bucket before it has started; `collect`
    waits for them and unpacks. A round ends with one more small allreduce, the ranks'
    verdict, so that they all take the same path. Before its first bucket starts, a
    round agrees that every rank is in the backward pass (`step.BACKWARD`); a round ended
    before that (its forward pass raised) started nothing on any rank, and `discard` only
    tells the others (`step.ABANDONED`), whose step then raises. Past that point,
    `collect(leaves)` says "used" if `leaves` are the very arrays the round received,
    "replaced" otherwise; `discard` (a round not collected: its backward pass raised;
    also called by `begin`, `pack`) says "abandoned", after starting the buckets not yet
    started, whatever they hold, so that every rank has started the same collectives. `collect` returns the averages only when
    every rank used its round, None when some rank replaced its gradients (every rank
    then averages the gradients it has with `average`), and raises when some rank
    abandoned it.

    >>> buckets = GradientBuckets(backend, bucket_bytes=1 << 20)  # doctest: +SKIP
    >>> buckets.average({"w": np.full(3, float(dist.local_rank(backend)))})  # doctest: +SKIP
    {'w': array([0.5, 0.5, 0.5])}
    """

    def __init__(self, backend: Backend, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        self.backend = check_backend(backend, "GradientBuckets")
        self.bucket_bytes = check_int("GradientBuckets", "bucket_bytes", bucket_bytes, minimum=1)
        self.buffers: list[Any] = []  # the flat buffers, in the order they are reduced
        self._key: Any = None
        self._views: list[Any] = []  # leaf i's place in its buffer, shaped as leaf i
        self._bucket_of: list[int] = []  # leaf i's buffer
        self._members: list[int] = []  # leaves per buffer
        self._round: _Round | None = None

    def average(self, x: Any) -> Any:
        leaves, structure = tree.flatten(x)
        self.discard()  # before the call: its collectives are those of the round's own call
        with self.backend.call(AVERAGE):
            self.pack(leaves, structure)
            self.allreduce()
        return tree.unflatten(structure, self.unpack())

    def pack(self, leaves: list[Any], structure: tree.Structure) -> None:
        """Copy `leaves` (a flattened tree, with its `structure`) into the buffers."""
        self.discard()
        self._layout(leaves, structure)
        for view, leaf in zip(self._views, leaves):
            view[...] = leaf

    def allreduce(self) -> None:
        """Sum every buffer over the ranks, in place."""
        for buffer in self.buffers:
            self.backend.allreduce(buffer, "sum")

    def unpack(self) -> list[Any]:
        """The leaves' averages over the ranks, as new arrays."""
        size = self.backend.size
        return [module_of(view).divide(view, size) for view in self._views]

    # ---- rounds -------------------------------------------------------------------------------

    def begin(self, leaves: list[Any], structure: tree.Structure) -> Callable[[int, Any], None]:
        """Open a round for gradients laid out as `leaves` (a flattened tree, such as the
        parameters); returns ``receive(position, gradient)``, to be called once per leaf."""
        self.discard()
        with self.backend.call(OVERLAPPED):
            self._layout(leaves, structure)
        self._round = _Round(self._members)
        self.backend.hold_open(self)  # its buffers live while the round's allreduces write them
        return self._receive

    def _receive(self, position: int, gradient: Any) -> None:
        round_ = self._round
        if round_ is None:
            raise RuntimeError("GradientBuckets: a gradient came after its round ended (a receive kept from an earlier begin)")
        if not round_.backward:
            self._begin_backward()
        if round_.received[position] is not None:  # counted twice, its bucket would start before it is full
            raise ValueError(f"GradientBuckets: leaf {position}'s gradient came twice in one round")
        self._views[position][...] = gradient
        round_.received[position] = gradient
        bucket = self._bucket_of[position]
        round_.missing[bucket] -= 1
        if round_.missing[bucket] == 0 and bucket == len(round_.pending):
            self._start_full(round_)
        elif round_.pending:
            round_.progress()

    def _start_full(self, round_: "_Round") -> None:
        # In bucket order, which is every rank's: collectives must start in one order.
        pending, missing = round_.pending, round_.missing
        while len(pending) < len(missing) and missing[len(pending)] == 0:
            pending.append(self.backend.start_allreduce(self.buffers[len(pending)], "sum"))

    def _begin_backward(self) -> None:
        """The ranks agree that they are all in the open round's backward pass, before any
        bucket starts: `RuntimeError`, with the round dropped, where some rank abandoned
        the round instead."""
        with self.backend.call(BACKWARD, compatible=(ABANDONED,)) as calls:
            if calls is not None:
                self.drop()
                raise RuntimeError(ABANDONED_STEP)
        self._round.backward = True

    def drop(self) -> None:
        """Forget the open round, if any, without a collective: only while no rank has
        started its buckets (before `step.BACKWARD`), where every rank drops it."""
        if self._round is not None:
            assert not self._round.pending, "a round whose allreduces started cannot be dropped"
            self._round = None
            self.backend.release(self)

    @property
    def is_open(self) -> bool:
        """Whether a round is open: `begin` has run and no `collect` or `discard` since."""
        return self._round is not None

    def collect(self, leaves: list[Any]) -> list[Any] | None:
        """End the open round with `leaves`, the flattened gradients to average: the
        leaves' averages over the ranks (as `unpack`) if every rank's are the arrays its
        round received; None if some rank's are not (they were replaced: average them with
        `average`, as every rank then does); a `RuntimeError` if some rank abandoned its
        round (see the class docstring)."""
        if not self._round.backward:  # no gradient came in (parameters without leaves)
            self._begin_backward()
        round_ = self._round
        received = len(leaves) == len(round_.received) and all(a is b for a, b in zip(leaves, round_.received))
        verdict = self._end(_USED if received else _REPLACED)
        if verdict == _ABANDONED:
            raise RuntimeError(ABANDONED_STEP)
        return self.unpack() if verdict == _USED else None

    def discard(self) -> None:
        """Finish the open round, if any, without using it (see the class docstring)."""
        if self._round is None:
            return
        if self._round.backward:
            self._end(_ABANDONED)
            return
        # The others are in this round's forward pass (a layer's call) or at its
        # backward's start: they drop it too, and nothing of it ever travelled.
        self.drop()
        with self.backend.call(ABANDONED, compatible=(*LAYER_CALLS, BACKWARD)):
            pass

    def _end(self, mine: int) -> int:
        """Close the round: start its buckets not yet started, then the verdicts'
        allreduce (the lowest wins), and wait for all of them; returns the verdict."""
        round_, self._round = self._round, None
        self.backend.release(self)
        round_.missing = [0] * len(round_.missing)
        self._start_full(round_)
        verdict = np.array([mine], np.int32)  # a NumPy array: through MPI on every backend
        round_.pending.append(self.backend.start_allreduce(verdict, "min"))
        for pending in round_.pending:
            pending.wait()
        return int(verdict[0])

    def _layout(self, leaves: list[Any], structure: tree.Structure) -> None:
        key = (structure, tuple((a.dtype, a.shape, a.device) if is_array(a) else type(a) for a in leaves))
        if key != self._key:
            self._build(tree.unflatten(structure, leaves), key)

    def _build(self, x: Any, key: Any) -> None:
        # Bad gradients are raised on every rank by the layouts' check: one rank raising
        # alone would leave the others in its collective.
        problem = next(
            (f"expected gradients as NumPy or CuPy arrays, got {type(leaf).__name__} at "
             + (f"'{path}'" if path else "the top of the tree") for path, leaf in tree.paths(x) if not is_array(leaf)),
            None,
        ) or _not_on_one_device(x, "gradients")  # fmt: skip
        check_same_layout(self.backend, "DistributedOptimizer", x, problem=problem)
        leaves = tree.leaves(x)
        buckets: list[list[int]] = []
        filling: dict[Any, list[int]] = {}  # dtype -> the bucket being filled
        for i in reversed(range(len(leaves))):  # the backward pass finishes the last leaves first
            members = filling.get(leaves[i].dtype)
            if members and sum(leaves[j].nbytes for j in members) + leaves[i].nbytes > self.bucket_bytes:
                buckets.append(members)
                members = None
            if members is None:
                members = filling[leaves[i].dtype] = []
            members.append(i)
        buckets += filling.values()
        buckets.sort(key=lambda members: -members[-1])  # by the leaf that fills them, first filled first
        buffers, views, bucket_of = [], [None] * len(leaves), [0] * len(leaves)
        with memory.uncached():  # kept for as long as the layout lasts, no part of a step
            for b, members in enumerate(buckets):
                xp = module_of(leaves[members[0]])
                buffer = xp.empty(sum(leaves[j].size for j in members), leaves[members[0]].dtype)
                offset = 0
                for j in members:
                    views[j] = buffer[offset : offset + leaves[j].size].reshape(leaves[j].shape)
                    bucket_of[j] = b
                    offset += leaves[j].size
                buffers.append(buffer)
        self.buffers, self._views, self._bucket_of, self._key = buffers, views, bucket_of, key
        self._members = [len(members) for members in buckets]


class _Round:
    """What one round has done: whether its backward pass began on every rank, leaves
    still missing per bucket, the started allreduces
    (of buckets ``0..len(pending)-1``), and the gradients received, by position."""

    __slots__ = ("missing", "pending", "received", "backward")

    def __init__(self, members: list[int]) -> None:
        self.backward = False  # whether the ranks agreed to be in the backward pass
        self.missing = list(members)
        self.pending: list[Pending] = []
        self.received: list[Any] = [None] * sum(members)

    def progress(self) -> None:
        """Let the oldest unfinished allreduce move on (MPI progresses inside its calls)."""
        for pending in self.pending:
            if not pending.test():
                return


class ListeningTransformation(optim.GradientTransformation):
    """A `GradientTransformation` that also takes gradients while the backward pass
    finishes them (an `optim.Listening` optimizer, see `optim.listen`): ``listen(params)``
    is called by the training verbs before each backward pass and returns
    ``on_gradient(position, gradient)`` (or None), which `luxnn.ad.value_and_grad` calls
    once per leaf of the parameters' tree (`position` in
    `luxnn.tree.leaves` order) as soon as its gradient is final. `update` then gets those
    very gradient arrays; arrays replaced in between are taken as they come, but arrays
    written to in place are not seen.
    """

    def __new__(cls, init: Callable, update: Callable, listen: Callable[[Any], Any]) -> "ListeningTransformation":
        self = super().__new__(cls, init, update)
        self.listen = listen
        return self

    def __reduce__(self) -> Any:
        return type(self), (self.init, self.update, self.listen)


class _Averaged(optim.InPlaceUpdate, optim.UpdateInto):
    """`optimizer` on the gradients averaged by `buckets`, streamed in during the backward
    pass with `overlap`; in place as the inner optimizer is (`apply_gradients_` then updates
    its moments in place and adds each leaf's update into its parameter)."""

    def __init__(self, optimizer: optim.GradientTransformation, buckets: GradientBuckets, overlap: bool) -> None:
        self.optimizer, self.buckets, self.overlap = optimizer, buckets, overlap
        self._computed = False  # overlap=False: gradients computed and not yet averaged
        self.step = Step(buckets.backend, self._drop)  # in progress from `listen` to the update

    def init(self, params: Any) -> Any:
        _check_one_device("DistributedOptimizer", params, "parameters")
        return self.optimizer.init(params)

    def precheck(self, state: Any) -> None:
        optim.precheck(self.optimizer, state)  # the inner optimizer's state is this one's

    def update(self, grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return self.optimizer.update(self._averaged(grads), state, params)

    def update_in_place(self, grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return self.optimizer.update_(self._averaged(grads), state, params)

    def update_into(self, grads: Any, state: Any, params: Any, into: list) -> Any:
        return optim.update_into(self.optimizer, self._averaged(grads), state, params, into)

    def _drop(self) -> None:
        """Every rank abandons the step in progress before its gradients travel (`step.Step`)."""
        self._computed = False
        self.buckets.drop()

    def _averaged(self, grads: Any) -> Any:
        end(self.step)
        if self.buckets.is_open:
            leaves, structure = tree.flatten(grads)
            averages = self.buckets.collect(leaves)
            if averages is not None:
                return tree.unflatten(structure, averages)
            return self.buckets.average(grads)
        self._computed = False  # before the call: an update that raises leaves no step behind
        with self.buckets.backend.call(AVERAGE, compatible=(UNUSED,)) as calls:
            if calls is not None:  # a rank dropped the gradients of this step: it raised in its own
                raise RuntimeError(ABANDONED_STEP)
            return self.buckets.average(grads)

    def listen(self, params: Any) -> Callable[[int, Any], None] | None:
        """Called by the training verbs before each forward and backward pass: with
        overlap, opens a round; without, says to the others when the last backward pass's
        gradients were never averaged (what the round's verdict says with overlap). Then
        the step is in progress (`step.begin`): layers synchronise over the ranks."""
        end(self.step)
        if self.overlap:
            receive = self.buckets.begin(*tree.flatten(params))
            begin(self.step)
            return receive
        if self._computed:
            with self.buckets.backend.call(UNUSED, compatible=(AVERAGE, *LAYER_CALLS)):
                pass  # the ranks in the update or in a layer's call raise; this one goes on with its new step
        self._computed = True
        begin(self.step)
        return None


def DistributedOptimizer(backend: Backend, optimizer: optim.GradientTransformation, *,
                         bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = False) -> optim.GradientTransformation:  # noqa: N802 - Lux's name
    """`optimizer` on the gradients averaged over the ranks (in buckets of at most
    `bucket_bytes`, see `GradientBuckets`): a `GradientTransformation` whose state is
    `optimizer`'s own, so a `TrainState` takes it as it is. Parameters and gradients must
    each be on one device.

    ``overlap=True`` averages during the backward pass of the training verbs (a
    `ListeningTransformation`): each bucket's allreduce starts once the backward pass has
    finished its gradients, and `update` waits for them. The results are those of
    ``overlap=False``. The collectives then start in `compute_gradients`, which every rank
    must therefore call as often as the others. `update` ends with one more small
    allreduce in which the ranks agree on what to average: gradients replaced between
    `compute_gradients` and `apply_gradients`, on any rank, make every rank average the
    gradients it was given (those changed in place would not be seen, which is why overlap
    is not the default); a rank whose backward pass raised makes the others' `update`
    raise `RuntimeError` once its next `compute_gradients` has finished the round, with
    nothing applied on any rank. ``overlap=False`` behaves alike: a rank whose
    `compute_gradients` raised makes the others' update of that step raise at its next
    `compute_gradients`; so with either, every rank calls `compute_gradients` as often as
    the others. Ranks in different calls (a step more on one rank, a rank ended) raise
    `CallMismatch` on every rank (see `Backend.call`).

    The training verbs (`compute_gradients`, `single_train_step*`) open each step (they
    call its ``listen``); the step lasts until the update. Inside it, and only there,
    layers synchronise over the ranks (`BatchNorm`'s running statistics, ``sync=True``'s
    batch statistics: `luxnn.distributed.step`), and a rank that raised in a forward pass
    makes the others' step raise too, the next step going on on every rank. A loop of its
    own around `luxnn.value_and_grad` and `apply_gradients(_)` opens no step: its
    `BatchNorm`s use their rank's batch, and a rank that skips an update there makes the
    ranks average different steps' gradients, which nothing detects.

    >>> opt = dist.DistributedOptimizer(backend, lx.optim.adam(1e-3), overlap=True)  # doctest: +SKIP
    >>> ts = lx.TrainState(model, ps, st, opt)  # doctest: +SKIP
    """
    backend = check_backend(backend, "DistributedOptimizer")
    if not isinstance(optimizer, optim.GradientTransformation):
        raise TypeError(f"DistributedOptimizer: expected an optimizer (luxnn.optim.GradientTransformation), got {type(optimizer).__name__}")
    if not isinstance(overlap, bool):
        raise TypeError(f"DistributedOptimizer: expected overlap True or False, got {overlap!r}")
    stage = _Averaged(optimizer, GradientBuckets(backend, bucket_bytes), overlap)
    return ListeningTransformation(stage.init, stage.update, stage.listen)
