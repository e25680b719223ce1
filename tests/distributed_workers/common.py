"""What several workers share: printing a rank's line, and a small float64 problem."""

import sys

import numpy as np

import luxnn as lx


def say(rank, message):
    sys.stdout.write(f"rank {rank}: {message}\n")  # one write: the ranks' lines do not mix
    sys.stdout.flush()


def small_problem(hidden, samples):
    """``(model, ps, st, x, y)``: a 3-`hidden`-2 tanh MLP with float64 parameters, the same
    on every rank, and `samples` fixed draws of data."""
    model = lx.Chain(lx.Dense(3, hidden, activation="tanh"), lx.Dense(hidden, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    rng = np.random.default_rng(1)
    return model, lx.tree.map(lambda a: a.astype(np.float64), ps), st, rng.standard_normal((samples, 3)), rng.standard_normal((samples, 2))
