"""Initialisers: their statistics on large draws (fixed seeds, bounds many standard errors
wide), their shapes and dtypes, that they pickle, and their bad options."""

from __future__ import annotations

import copy
import math
import pickle

import numpy as np
import pytest

from luxnn import init

N = 400_000  # draws per statistic: the standard error of a std estimate is std / 900


def draw(initializer, shape, seed=0, dtype=np.float64):
    return initializer(np.random.default_rng(seed), shape, dtype)


@pytest.mark.parametrize(
    "initializer, shape, std",
    [
        (init.lecun_uniform(), (800, 500), math.sqrt(1 / 800)),
        (init.lecun_normal(), (800, 500), math.sqrt(1 / 800)),
        (init.variance_scaling(2.0, "fan_out", "normal"), (3, 3, 64, 50), math.sqrt(2 / (9 * 50))),
        (init.variance_scaling(0.5, "fan_avg", "uniform"), (400, 1000), math.sqrt(0.5 / 700)),
        (init.variance_scaling(1.0, "fan_in", "truncated_normal"), (3, 3, 40, 1200), math.sqrt(1 / 360)),
        (init.truncated_normal(std=0.02), (N,), 0.02),  # bounds at ±2 (100 std): untruncated
        (init.sparse_init(0.0, std=0.05), (500, 800), 0.05),
    ],
)
def test_initialisers_have_the_variance_they_promise(initializer, shape, std):
    w = draw(initializer, shape)
    assert w.shape == shape and w.dtype == np.float64
    assert abs(w.mean()) < 5 * std / math.sqrt(w.size)
    assert abs(w.std() / std - 1) < 0.01


def test_variance_scaling_truncated_normal_stays_within_two_standard_deviations_before_rescaling():
    w = draw(init.variance_scaling(1.0, "fan_in", "truncated_normal"), (1000, 400))
    bound = 2 * math.sqrt(1 / 1000) / 0.87962566103423978
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound


def test_truncated_normal_respects_asymmetric_bounds_and_its_moments():
    w = draw(init.truncated_normal(std=1.0, a=-0.5, b=2.0, mean=0.0), (N,))
    assert w.min() >= -0.5 and w.max() <= 2.0
    # Moments of N(0, 1) truncated to [-0.5, 2], from the closed forms.
    from scipy.stats import truncnorm

    mean, var = truncnorm.stats(-0.5, 2.0, moments="mv")
    assert abs(w.mean() - mean) < 5 * math.sqrt(var / N)
    assert abs(w.var() / var - 1) < 0.01


@pytest.mark.parametrize("shape", [(64, 64), (200, 50), (30, 120), (3, 3, 16, 32)])
def test_orthogonal_gives_orthonormal_columns_or_rows(shape):
    w = draw(init.orthogonal(gain=1.5), shape)
    m = w.reshape(-1, shape[-1])
    gram = m.T @ m if m.shape[0] >= m.shape[1] else m @ m.T
    np.testing.assert_allclose(gram, 1.5**2 * np.eye(gram.shape[0]), atol=1e-12)


def test_orthogonal_draws_are_uniform_over_rotations():
    # A Haar-random orthogonal matrix's first entry has mean 0 and variance 1/n; without the
    # sign fix, a Householder QR's is always negative (mean about -0.8/sqrt(n) = -0.11).
    n = 50
    first = np.array([draw(init.orthogonal(), (n, n), seed)[0, 0] for seed in range(400)])
    assert abs(first.mean()) < 5 / math.sqrt(400 * n)
    assert abs(first.var() * n - 1) < 0.5


def test_identity_init_is_the_identity_map():
    np.testing.assert_array_equal(draw(init.identity_init(gain=2.0), (3, 4)), 2 * np.eye(3, 4))
    k = draw(init.identity_init(), (3, 3, 4, 4))
    x = np.random.default_rng(0).normal(size=(5, 4))
    np.testing.assert_array_equal(x @ k[1, 1], x)  # the centre tap passes channels through
    assert k.sum() == 4


def test_sparse_init_zeroes_the_fraction_asked_in_every_row():
    w = draw(init.sparse_init(0.3, std=0.01), (200, 50))
    assert ((w == 0).sum(axis=1) == 15).all()  # ceil(0.3 * 50)
    nonzero = w[w != 0]
    assert abs(nonzero.std() / 0.01 - 1) < 0.03


ALL = [
    init.zeros, init.ones, init.constant(0.5), init.normal(0.1), init.uniform(-1, 2), init.glorot_uniform(),
    init.glorot_normal(), init.kaiming_uniform(), init.kaiming_normal(), init.truncated_normal(),
    init.orthogonal(), init.lecun_uniform(), init.lecun_normal(), init.variance_scaling(),
    init.identity_init(), init.sparse_init(0.5),
]  # fmt: skip


@pytest.mark.parametrize("initializer", ALL, ids=repr)
def test_initialisers_pickle_deep_copy_and_draw_the_same(initializer):
    for copied in (pickle.loads(pickle.dumps(initializer)), copy.deepcopy(initializer)):
        assert copied == initializer and repr(copied) == repr(initializer)
        np.testing.assert_array_equal(draw(copied, (6, 4), dtype=np.float32), draw(initializer, (6, 4), dtype=np.float32))
    assert draw(initializer, (6, 4), dtype=np.float32).dtype == np.float32


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: init.truncated_normal(std=0), "std must be a positive number"),
        (lambda: init.truncated_normal(a=1, b=1), "expected a < b"),
        (lambda: init.variance_scaling(mode="fan"), "mode must be one of"),
        (lambda: init.variance_scaling(distribution="cauchy"), "distribution must be one of"),
        (lambda: init.variance_scaling(scale=-1), "scale must be a positive number"),
        (lambda: init.sparse_init(1.5), r"sparsity must be in \[0, 1\]"),
        (lambda: init.kaiming_uniform(nonlinearity="selu"), "unknown nonlinearity"),
        (lambda: init.orthogonal()(None, (5,)), "at least 2 dimensions"),
        (lambda: init.identity_init()(None, (5,)), "at least 2 dimensions"),
        (lambda: init.sparse_init(0.1)(np.random.default_rng(0), (2, 3, 4)), "2-dimensional shape"),
    ],
)
def test_bad_options_raise_value_error(make, message):
    with pytest.raises(ValueError, match=message):
        make()
