"""Embedding against torch.nn.functional.embedding in float64."""

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.embedding import scatter_add_rows

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("num, shape", [(7, (20,)), (5, (3, 4, 6)), (300, (2, 500)), (1, (4,))])
def test_matches_torch_with_repeated_indices(num, shape):
    rng = np.random.default_rng(num)
    dim = int(rng.integers(1, 6))
    model = lx.Embedding(num, dim)
    ps, st = lx.setup(rng, model)
    ps = {"weight": ps["weight"].astype(np.float64)}
    idx = rng.integers(0, num, size=shape)
    assert len(np.unique(idx)) < idx.size  # repeated indices
    y, _ = model(idx, ps, st)
    assert y.shape == (*shape, dim)
    r = rng.normal(size=y.shape)
    _, g = lx.value_and_grad(lambda p: (model(idx, p, st)[0] * r).sum())(ps)
    tw = torch.tensor(ps["weight"], requires_grad=True)
    ty = torch.nn.functional.embedding(torch.tensor(idx), tw)
    (ty * torch.tensor(r)).sum().backward()
    np.testing.assert_array_equal(y, ty.detach().numpy())
    np.testing.assert_allclose(g["weight"], tw.grad.numpy(), rtol=1e-9, atol=1e-12)


def test_init_is_standard_normal_and_unsigned_indices_work():
    model = lx.Embedding(1000, 64)
    ps, st = lx.setup(np.random.default_rng(0), model)
    w = ps["weight"]
    assert w.shape == (1000, 64) and w.dtype == np.float32
    assert abs(w.mean()) < 0.02 and abs(w.std() - 1) < 0.02
    y, _ = model(np.array([3, 3], np.uint8), ps, st)
    np.testing.assert_array_equal(y, w[[3, 3]])


def test_scatter_paths_agree_with_add_at():
    rng = np.random.default_rng(0)
    for rows in (4, 1000):
        idx = rng.integers(0, rows, 3000)
        g = rng.normal(size=(3000, 3))
        expected = np.zeros((rows, 3))
        np.add.at(expected, idx, g)
        np.testing.assert_allclose(scatter_add_rows(g, idx, rows), expected, rtol=1e-12, atol=1e-12)


def test_bad_indices_name_range_and_values():
    model = lx.Chain(lx.Embedding(10, 4))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match=r"^layer_1: Embedding\(10 => 4\): expected indices in \[0, 10\), got indices from 0 to 10$"):
        model(np.array([0, 10]), ps, st)
    with pytest.raises(lx.LayerError, match=r"got indices from -1 to 3"):
        model(np.array([-1, 3]), ps, st)
    with pytest.raises(lx.LayerError, match=r"expected integer indices in \[0, 10\), got an array of dtype float32"):
        model(np.array([1.0], np.float32), ps, st)
    with pytest.raises(lx.LayerError, match="got list"):
        model([1, 2], ps, st)
