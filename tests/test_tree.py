"""lx.tree.map_with_path: every leaf with its "/"-joined path, as the names of tree.paths,
over one tree or several of one structure; used for optimizer masks by name."""

from typing import NamedTuple

import numpy as np
import pytest

import luxnn as lx
from luxnn import optim, tree


class Pair(NamedTuple):
    first: object
    second: object


def test_each_leaf_comes_with_the_path_tree_paths_gives_it_and_the_structure_is_kept():
    t = {"layer_1": {"weight": 1, "bias": 2}, "seq": [3, (4, Pair(5, {"x": 6}))], 7: 8}
    out = tree.map_with_path(lambda path, leaf: f"{path}={leaf}", t)
    assert tree.structure(out) == tree.structure(t) and isinstance(out["seq"][1][1], Pair)
    assert tree.leaves(out) == [f"{path}={leaf}" for path, leaf in tree.paths(t)]
    assert tree.leaves(out) == ["layer_1/weight=1", "layer_1/bias=2", "seq/0=3", "seq/1/0=4", "seq/1/1/0=5", "seq/1/1/1/x=6", "7=8"]
    assert tree.map_with_path(lambda path, leaf: path, 5) == ""


@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_leaves_of_every_other_tree_follow_the_path(count):
    t = {"a": [1, 2], "b": 3}
    others = [tree.map(lambda x, k=k: x * 10**k, t) for k in range(1, count + 1)]
    out = tree.map_with_path(lambda path, *leaves: f"{path}={sum(leaves)}", t, *others)
    factor = sum(10**k for k in range(count + 1))
    assert out == {"a": [f"a/0={factor}", f"a/1={2 * factor}"], "b": f"b={3 * factor}"}


def test_trees_of_another_structure_are_refused():
    with pytest.raises(ValueError, match=r"tree structures differ: expected keys \['a', 'b'\], got \['a'\]"):
        tree.map_with_path(lambda p, x, y: x, {"a": 1, "b": 2}, {"a": 1})
    with pytest.raises(ValueError, match="expected a sequence of length 2, got list of length 1"):
        tree.map_with_path(lambda p, x, y: x, [1, 2], [1])


def test_a_weight_decay_mask_by_name_decays_everything_but_the_biases():
    model = lx.Chain(lx.Dense(3, 4), lx.LayerNorm(4), lx.Dense(4, 2))
    ps, _ = lx.setup(np.random.default_rng(0), model)
    not_bias = lambda params: tree.map_with_path(lambda path, p: not path.endswith("/bias"), params)  # noqa: E731
    opt = optim.adamw(0.1, weight_decay=0.5, mask=not_bias)
    zeros = tree.map(np.zeros_like, ps)  # Adam's part is 0: only the decay moves a parameter
    updates, _ = opt.update(zeros, opt.init(ps), ps)
    for path, update in tree.paths(updates):
        p = dict(tree.paths(ps))[path]
        expected = np.zeros_like(p) if path.endswith("/bias") else -0.1 * 0.5 * p
        np.testing.assert_allclose(update, expected, rtol=1e-6, err_msg=path)
    assert any(path.endswith("/bias") for path, _ in tree.paths(updates))
