"""`chain`: transformations one after the other, each stage run by what it declares (its
own update, into the updates before it, with the factor of the stage after it folded in,
or, adding into CuPy parameters, all of them in one fused launch per dtype).
"""

from __future__ import annotations

from typing import Any

from .arrays import Params, Updates
from .base import (
    FoldedFactor, FreshUpdates, FusedUpdate, GradientTransformation, InPlace, KernelUpdate, OwnedUpdate,
    ScaledUpdate, check_state_type, check_transformation, on_device, transformation, update_into
)  # fmt: skip
from .fused import launch, scale_step

__all__ = ["chain"]


# How `chain` runs a stage: its own update (pure, in place or adding `into`), its update
# into the updates the stage before made (`OwnedUpdate` after `FreshUpdates`), or its
# update scaled by the factor of the stage after it (`ScaledUpdate`, then `FoldedFactor`),
# or, adding into CuPy parameters, its kernel with that factor (`KernelUpdate`).
_OWN, _OWNED, _SCALED, _KERNEL = "own", "owned", "scaled", "kernel"


def _plan(stages: list) -> list[tuple[int, str]]:
    """(position of the stage, how it runs) for each step of a chain of `stages` (None for
    a transformation that is no `Stage`), from what they declare."""
    steps, i, fresh = [], 0, False  # fresh: the updates so far are arrays nothing else holds
    while i < len(stages):
        stage, follower = stages[i], stages[i + 1] if i + 1 < len(stages) else None
        if isinstance(stage, ScaledUpdate) and isinstance(follower, FoldedFactor):
            steps.append((i, _SCALED))
            stage, i = follower, i + 2
        else:
            steps.append((i, _OWNED if fresh and isinstance(stage, OwnedUpdate) else _OWN))
            i += 1
        fresh = isinstance(stage, FreshUpdates)
    return steps


def _kernel_plan(stages: list) -> list[tuple[int, str]] | None:
    """The steps of a chain of `stages` adding into CuPy parameters when it ends with a
    `KernelUpdate` stage and a `FoldedFactor` one (a learning rate): that pair runs as one
    kernel per leaf, the factor folded in. None for any other chain (a `KernelUpdate`
    stage last runs its kernel through `update_into`)."""
    n = len(stages)
    if n >= 2 and isinstance(stages[-2], KernelUpdate) and isinstance(stages[-1], FoldedFactor):
        return _plan(stages[:-2]) + [(n - 2, _KERNEL)]
    return None


_FUSED, _FOLDED, _FACTOR, _NESTED = "fused", "folded", "factor", "nested"


def _fused_plan(stages: list) -> list[tuple[int, str]] | None:
    """The steps of a chain of `stages` adding into CuPy parameters as one fused launch
    (`FusedUpdate`), when each stage is a `FusedUpdate` (`_FUSED`; `_FOLDED` when also
    `ScaledUpdate` and followed by a `FoldedFactor`, whose factor it takes) or a
    `FoldedFactor` (`_FACTOR`, a scaling fragment) or a chain of such stages (`_NESTED`);
    None for any other chain."""
    steps, i = [], 0
    while i < len(stages):
        stage, follower = stages[i], stages[i + 1] if i + 1 < len(stages) else None
        if isinstance(stage, FusedUpdate) and isinstance(stage, ScaledUpdate) and isinstance(follower, FoldedFactor):
            steps.append((i, _FOLDED))
            i += 2
            continue
        if isinstance(stage, FusedUpdate):
            steps.append((i, _FUSED))
        elif isinstance(stage, FoldedFactor):
            steps.append((i, _FACTOR))
        elif isinstance(stage, _Chain) and stage.fused_steps is not None:
            steps.append((i, _NESTED))
        else:
            return None
        i += 1
    return steps


class _Chain(InPlace):
    def __init__(self, transforms: tuple[GradientTransformation, ...]) -> None:
        self.transforms = transforms
        self.stages = [t.stage for t in transforms]
        self.steps = _plan(self.stages)
        self.kernel_steps = _kernel_plan(self.stages)
        self.fused_steps = _fused_plan(self.stages)

    def init(self, params: Params) -> tuple:
        return tuple(t.init(params) for t in self.transforms)

    def _check_state(self, state: Any) -> None:
        """A ValueError unless `state` holds one state of the right type per stage."""
        n = len(self.transforms)
        if not isinstance(state, tuple) or len(state) != n:
            size = len(state) if isinstance(state, tuple) else type(state).__name__
            raise ValueError(f"chain of {n} transformations got an optimizer state of {size} entries")
        for stage, s in zip(self.stages, state):
            check_state_type(stage, s)

    def precheck(self, state: tuple) -> None:
        self._check_state(state)
        for stage, s in zip(self.stages, state):
            if stage is not None:
                stage.precheck(s)

    def compute(self, grads: Updates, state: tuple, params: Params, in_place: bool,
                into: list | None = None) -> tuple[Updates, tuple]:
        self._check_state(state)
        if into is not None and self.fused_steps is not None and on_device(into):
            steps, fused_states = self._fused_parts(grads, state, params)
            if launch(steps, grads, into):
                return None, fused_states
        new_states: list = []
        last = len(self.transforms) - 1
        fused = into is not None and self.kernel_steps is not None and on_device(into)
        for i, how in self.kernel_steps if fused else self.steps:
            t, stage, s = self.transforms[i], self.stages[i], state[i]
            if how == _KERNEL:  # the last step
                factor, follower_state = self.stages[i + 1].folded_factor(state[i + 1])
                new_states += [stage.kernel_update_into(grads, s, params, into, factor), follower_state]
                return None, tuple(new_states)
            if how == _SCALED:
                factor, follower_state = self.stages[i + 1].folded_factor(state[i + 1])
                grads, s = stage.update_scaled(grads, s, params, factor, in_place, into if i + 1 == last else None)
                new_states += [s, follower_state]
                continue
            if how == _OWNED:
                grads, s = stage.update_owned(grads, s, params)
            elif into is not None and i == last:  # the last stage adds its updates
                grads, s = None, update_into(t, grads, s, params, into)
            else:
                grads, s = (t.update_ if in_place else t.update)(grads, s, params)
            new_states.append(s)
        return grads, tuple(new_states)


    def _fused_parts(self, grads: Updates, state: tuple, params: Params) -> tuple[list, tuple]:
        """The steps of this chain's fused launch (`fused_steps`) and the new state."""
        self._check_state(state)
        steps, new_states = [], []
        for i, how in self.fused_steps:
            stage, s = self.stages[i], state[i]
            if how == _NESTED:
                nested_steps, s = stage._fused_parts(grads, s, params)
                steps += nested_steps
                new_states.append(s)
                continue
            if how == _FACTOR:
                factor, s = stage.folded_factor(s)
                steps.append(scale_step(factor))
                new_states.append(s)
                continue
            factor, follower_state = self.stages[i + 1].folded_factor(state[i + 1]) if how == _FOLDED else (1.0, None)
            step, s = stage.fused_step(grads, s, params, factor)
            steps.append(step)
            new_states += [s, follower_state] if how == _FOLDED else [s]
        return steps, tuple(new_states)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply `transforms` one after the other; the state is the tuple of their states.

    >>> from luxnn import optim
    >>> opt = chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(), optim.scale_by_learning_rate(1e-3))
    """
    for i, t in enumerate(transforms):
        check_transformation(f"chain: argument {i}", t)
    return transformation(_Chain(transforms))
