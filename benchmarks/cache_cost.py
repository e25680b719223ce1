"""What the allocator cache costs a training step, on steps whose allocations weigh most:
``single_train_step_`` with a cache of its own against ``allocator_cache=None``, interleaved rounds
(`luxnn.bench.runner.interleaved_rounds`), medians. Issue 13: the cache is never slower
than no cache beyond noise. The models: the suite's MLP (784-256-10, batch 128, SGD), one
whose every request is a small block (64-64-10, batch 128: a step no plan is made for), one
of many small blocks made late in the step (six Dense 128 with dropout, batch 256, AdamW)
and one of a single example (16-32-4, batch 1, Adam: the cache's cost per step alone).

    python benchmarks/cache_cost.py [--rounds 15] [--per-round 20] [--only mlp small]
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import luxnn as lx
from luxnn.bench.machine import blas, blas_summary
from luxnn.bench.models import MLP, dropout_mlp, luxnn_mlp, luxnn_train_step
from luxnn.bench.runner import interleaved_rounds


def _data(batch: int, features: int, classes: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((batch, features)).astype(np.float32), rng.integers(0, classes, batch)


def models() -> dict:
    """name -> (a layer maker, an optimizer maker, data)."""
    suite = MLP()
    return {
        "mlp": (lambda: luxnn_mlp(suite.sizes), lambda: lx.optim.sgd(suite.lr), suite.data()),
        "small": (lambda: luxnn_mlp((64, 64, 10)), lambda: lx.optim.sgd(0.01), _data(128, 64, 10)),
        "dropout": (dropout_mlp, lambda: lx.optim.adamw(1e-3), _data(256, 128, 10)),
        "one-example": (lambda: lx.Chain(lx.Dense(16, 32, activation="tanh"), lx.Dense(32, 4)), lambda: lx.optim.adam(1e-3), _data(1, 16, 4)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=20, help="calls per sample")
    parser.add_argument("--only", nargs="*", help="models to run (default: all)")
    args = parser.parse_args()
    print(f"kernels: {blas_summary(blas())}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    print(f"{'model':<12} {'cache on':>10} {'cache off':>10} {'off / on':>9} {'(IQR of the rounds)':>20}")
    loss = lx.losses.CrossEntropyLoss()
    for name, (model, optimizer, data) in models().items():
        if args.only and name not in args.only:
            continue
        steps = {"on": luxnn_train_step(model(), optimizer(), loss, data, lx.memory.AllocCache()),
                 "off": luxnn_train_step(model(), optimizer(), loss, data, None)}  # fmt: skip
        samples = interleaved_rounds(steps, args.rounds, args.per_round, warmup=5)
        ratios = [off / on for on, off in zip(samples["on"], samples["off"])]  # the same round's
        q = statistics.quantiles(ratios, n=4)
        on, off = (statistics.median(samples[k]) * 1e6 for k in ("on", "off"))
        print(f"{name:<12} {on:>8.1f}us {off:>8.1f}us {statistics.median(ratios):>9.3f} {f'{q[0]:.3f}-{q[2]:.3f}':>20}")


if __name__ == "__main__":
    main()
