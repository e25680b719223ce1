"""Issue 2's performance check: an MLP training step with luxnn's AD against the same step
written by hand in NumPy and against PyTorch eager, interleaved, medians of rounds; and the
AD bookkeeping cost per recorded primitive on tiny arrays.

    python benchmarks/core_step.py [--rounds 15] [--per-round 20]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import luxnn as lx
from luxnn.bench import models
from luxnn.bench.machine import blas, blas_summary

MLP = models.MLP()
BATCH, (IN, HIDDEN, OUT) = MLP.batch, MLP.sizes


def time_rounds(steps: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    """Round medians per variant. Each round starts with the next variant, and variants are
    separated by a pause: PyTorch's and OpenBLAS's worker threads spin for a while after
    their last call and would otherwise slow whichever variant runs next."""
    for step in steps.values():  # warm-up
        for _ in range(5):
            step()
    names = list(steps)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            time.sleep(0.3)
            step = steps[name]
            times = []
            for _ in range(per_round):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            samples[name].append(statistics.median(times))
    return samples


def bookkeeping(n_ops: int = 200, reps: int = 200) -> tuple[float, float]:
    """(traced, plain) seconds per primitive: forward record + backward vs the raw ops."""
    a = np.ones(4)

    def chain(v):
        for _ in range(n_ops):
            v = v * 1.0001
        return v.sum()

    def plain_with_backward(v):
        # The same arithmetic a VJP does: the forward product and the backward product.
        g = np.ones(4)
        for _ in range(n_ops):
            v = v * 1.0001
        for _ in range(n_ops):
            g = g * 1.0001
        return v.sum()

    vg = lx.value_and_grad(chain)
    best = {}
    for name, fn in (("traced", lambda: vg(a)), ("plain", lambda: plain_with_backward(a))):
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps / n_ops)
        best[name] = statistics.median(times)
    return best["traced"], best["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=20)
    args = parser.parse_args()

    steps = {
        "luxnn (cache on)": MLP.luxnn(),
        "luxnn (cache off)": MLP.luxnn(cache=None),
        "numpy by hand": MLP.numpy(),
    }
    try:
        steps["pytorch eager"] = MLP.torch()
    except ImportError:
        pass
    print(f"MLP {IN}-{HIDDEN}-{OUT}, batch {BATCH}, float32, SGD; BLAS: {blas_summary(blas())}")
    samples = time_rounds(steps, args.rounds, args.per_round)
    base = statistics.median(samples["numpy by hand"])
    print(f"{'step':<20} {'median':>10} {'IQR':>9} {'vs by hand':>11}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4)
        med = statistics.median(s)
        print(f"{name:<20} {med * 1e6:>8.0f}us {(q[2] - q[0]) * 1e6:>7.0f}us {med / base:>10.3f}x")
    traced, plain = bookkeeping()
    print(f"AD bookkeeping per primitive (record + backward, 4-element arrays): {(traced - plain) * 1e6:.2f} us "
          f"(traced {traced * 1e6:.2f} us, the same arithmetic untraced {plain * 1e6:.2f} us)")


if __name__ == "__main__":
    main()
