"""The declared interface of luxnn.optim's stages: capabilities are subclasses (`Stage`,
`InPlaceUpdate`, `UpdateInto`, `FreshUpdates`, `OwnedUpdate`, `FoldedFactor`,
`ScaledUpdate`) found with isinstance, never methods found by name; a user's stage of
either kind chains with the built-in ones; `update_into`, `precheck` and `listen` are
public."""

from __future__ import annotations

import numpy as np
import pytest

import luxnn.optim as optim
from luxnn import tree
from luxnn.distributed import ListeningTransformation


def make_params() -> dict:
    rng = np.random.default_rng(0)
    return {"dense": {"weight": rng.normal(size=(3, 4)), "bias": rng.normal(size=(4,))},
            "conv": rng.normal(size=(2, 2, 3, 5)), "emb": rng.normal(size=(7, 2))}


def make_grads(params: dict, steps: int = 4) -> list[dict]:
    rng = np.random.default_rng(1)
    return [tree.map(lambda p: rng.normal(size=p.shape), params) for _ in range(steps)]


def pure_run(opt, params, grads) -> dict:
    state = opt.init(params)
    for g in grads:
        updates, state = opt.update(g, state, params)
        params = optim.apply_updates(params, updates)
    return params


def in_place_run(opt, params, grads) -> dict:
    params = tree.map(np.copy, params)
    state = opt.init(params)
    for g in grads:
        state = optim.update_and_apply_(opt, g, state, params)
    return params


def assert_trees_close(a, b):
    for x, y in zip(tree.leaves(a), tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-14)


class Momentum(optim.InPlace):
    """A user's stage that declares in-place updates: one `compute` for all three."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def init(self, params):
        return optim.TraceState(trace=tree.map(np.zeros_like, params))

    def compute(self, grads, state, params, in_place, into=None):
        traces = tree.map(lambda g, t: np.add(g, t * self.decay, out=t if in_place else None), grads, state.trace)
        return tree.map(np.copy, traces), optim.TraceState(trace=traces)


class Halve(optim.Stateless, optim.FoldedFactor):
    """Multiplies the updates by 0.5; its own update must not run where it is folded."""

    def update(self, grads, state, params=None):
        raise AssertionError("a FoldedFactor stage after a ScaledUpdate stage is folded into it")

    def folded_factor(self, state):
        return 0.5, state


def by_hand_scale(factor: float) -> optim.GradientTransformation:
    """A user's transformation of two closures: the pure path only."""

    def init(params):
        return optim.EmptyState()

    def update(grads, state, params=None):
        return tree.map(lambda g: factor * g, grads), state

    return optim.GradientTransformation(init, update)


def test_the_built_in_stages_declare_their_capabilities():
    adam = optim.adam(1e-3)
    assert isinstance(adam.stage, optim.InPlace)
    direction, rate = adam.stage.stages
    assert isinstance(direction, (optim.ScaledUpdate)) and isinstance(direction, optim.FreshUpdates)
    assert isinstance(rate, optim.FoldedFactor) and isinstance(rate, optim.OwnedUpdate)
    assert isinstance(optim.scale_by_schedule(optim.constant_schedule(0.1)).stage, optim.UpdateInto)
    assert not isinstance(optim.clip(1.0).stage, optim.InPlaceUpdate)
    assert by_hand_scale(2.0).stage is None


def test_a_capability_must_be_implemented_to_be_declared():
    class Incomplete(optim.InPlaceUpdate):
        def init(self, params):
            return optim.EmptyState()

        def update(self, grads, state, params=None):
            return grads, state

    with pytest.raises(TypeError, match="update_in_place"):
        Incomplete()


def test_a_method_that_is_not_declared_is_not_used():
    class Duck:  # has the in-place method's name, declares nothing
        def init(self, params):
            return optim.EmptyState()

        def update(self, grads, state, params=None):
            return tree.map(lambda g: -g, grads), state

        def update_in_place(self, grads, state, params=None):
            raise AssertionError("an undeclared update_in_place was called")

        update_into = update_in_place

    duck = Duck()
    opt = optim.GradientTransformation(duck.init, duck.update)
    params, grads = make_params(), make_grads(make_params(), 2)
    assert opt.update_(grads[0], opt.init(params), params)[0]["conv"] is not None
    assert_trees_close(in_place_run(opt, params, grads), pure_run(opt, params, grads))


def test_a_users_plain_transformation_chains_with_the_built_in_ones():
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.scale_by_adam(), by_hand_scale(-0.1),
                      optim.add_decayed_weights(1e-2))
    params, grads = make_params(), make_grads(make_params())
    assert_trees_close(in_place_run(opt, params, grads), pure_run(opt, params, grads))


def test_a_stage_that_declares_an_in_place_update_is_used_in_place():
    stage = Momentum(0.9)
    opt = optim.chain(optim.GradientTransformation(stage.init, stage.update), optim.scale(-0.1))
    params, grads = make_params(), make_grads(make_params())
    state = opt.init(params)
    trace = state[0].trace["conv"]
    _, pure_state = opt.update(grads[0], state, params)
    assert pure_state[0].trace["conv"] is not trace and not trace.any()
    _, new_state = opt.update_(grads[0], state, params)
    assert new_state[0].trace["conv"] is trace and trace.any()
    assert_trees_close(in_place_run(opt, params, grads), pure_run(opt, params, grads))
    reference = pure_run(optim.sgd(0.1, momentum=0.9), params, grads)
    assert_trees_close(in_place_run(opt, params, grads), reference)


@pytest.mark.parametrize("run", [pure_run, in_place_run], ids=["pure", "in place"])
def test_a_declared_folded_factor_is_folded_into_the_stage_before(run):
    opt = optim.chain(optim.scale_by_adam(), optim.GradientTransformation(Halve().init, Halve().update))
    params, grads = make_params(), make_grads(make_params())
    assert_trees_close(run(opt, params, grads), pure_run(optim.chain(optim.scale_by_adam(), optim.scale(0.5)),
                                                          params, grads))


@pytest.mark.parametrize("make", [lambda: optim.adamw(1e-2, weight_decay=0.1), lambda: by_hand_scale(-0.1)],
                         ids=["adamw", "plain"])
def test_update_into_adds_the_updates_into_the_arrays(make):
    opt, params, grads = make(), make_params(), make_grads(make_params(), 1)
    updates, _ = opt.update(grads[0], opt.init(params), params)
    targets = tree.map(np.copy, params)
    optim.update_into(opt, grads[0], opt.init(params), params, tree.leaves(targets))
    assert_trees_close(targets, optim.apply_updates(params, updates))


def test_precheck_refuses_a_state_of_another_optimizer():
    params = make_params()
    with pytest.raises(ValueError, match="ScaleByAdamState, got one of type TraceState"):
        optim.precheck(optim.adam(1e-3), optim.sgd(0.1, momentum=0.9).init(params))
    optim.precheck(by_hand_scale(1.0), "anything")  # a transformation that is no Stage checks nothing


def test_listen_finds_the_listener_of_a_listening_optimizer():
    heard = []
    sgd = optim.sgd(0.1)

    def listener(params):
        heard.append(params)
        return heard.append

    opt = ListeningTransformation(sgd.init, sgd.update, listener)
    assert isinstance(opt, optim.Listening) and not isinstance(sgd, optim.Listening)
    assert optim.listen(opt, {"w": 1}) == heard.append and heard == [{"w": 1}]
    assert optim.listen(sgd, {"w": 1}) is None


@pytest.mark.parametrize(
    "wrap",
    [lambda t: optim.chain(optim.clip(1.0), t), lambda t: optim.MultiSteps(t, 2), lambda t: optim.masked(t, {"w": True}),
     lambda t: optim.multi_transform({"a": t}, {"w": "a"}), lambda t: optim.apply_if_finite(t, 3)],
    ids=["chain", "MultiSteps", "masked", "multi_transform", "apply_if_finite"],
)  # fmt: skip
def test_a_listening_optimizer_inside_another_is_refused(wrap):
    # Inside another, the training verbs would not find it: no step opened, so BatchNorm's
    # statistics would drift apart over the ranks without a word.
    sgd = optim.sgd(0.1)
    with pytest.raises(ValueError, match=r"listens to the backward pass .* must be the outermost optimizer"):
        wrap(ListeningTransformation(sgd.init, sgd.update, lambda params: None))
    wrap(sgd)  # the same wrapper around a plain optimizer is built
