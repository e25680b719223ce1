"""What the allocator cache costs a training step, on steps whose allocations weigh most:
``single_train_step_`` with a cache of its own against ``allocator_cache=None``, interleaved rounds
(`luxnn.bench.runner.interleaved_rounds`), medians. Issue 13: the cache is never slower
than no cache beyond noise. The models: the suite's MLP (784-256-10, batch 128, SGD), one
whose every request is a small block (64-64-10, batch 128: a step no plan is made for), one
of many small blocks made late in the step (six Dense 128 with dropout, batch 256, AdamW)
and one of a single example (16-32-4, batch 1, Adam: the cache's cost per step alone).

Where a step's arrays lie in memory moves its time by more than the cache costs (the CPU's
caches are indexed by physical address, which a process gets anew, and a step keeps its
arrays' places for the process's life: BENCHMARKS.md, "What the cache costs a step").
Within one process the two sides have different memory, so one process's ratio carries
that luck; ``--processes P`` runs each model in P fresh processes and reports the median
of their ratios, with the lowest and highest.

    python benchmarks/cache_cost.py [--rounds 15] [--per-round 20] [--only mlp small] [--processes 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

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


def measure(name: str, rounds: int, per_round: int) -> dict:
    """One model's rounds in this process: the medians on and off (seconds) and the
    median and quartiles of the rounds' off / on ratios."""
    model, optimizer, data = models()[name]
    loss = lx.losses.CrossEntropyLoss()
    steps = {"on": luxnn_train_step(model(), optimizer(), loss, data, lx.memory.AllocCache()),
             "off": luxnn_train_step(model(), optimizer(), loss, data, None)}  # fmt: skip
    samples = interleaved_rounds(steps, rounds, per_round, warmup=5)
    ratios = [off / on for on, off in zip(samples["on"], samples["off"])]  # the same round's
    q = statistics.quantiles(ratios, n=4)
    return {"on": statistics.median(samples["on"]), "off": statistics.median(samples["off"]),
            "ratio": statistics.median(ratios), "q1": q[0], "q3": q[2]}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=20, help="calls per sample")
    parser.add_argument("--only", nargs="*", help="models to run (default: all)")
    parser.add_argument("--processes", type=int, default=1, help="fresh processes per model")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one model, JSON out
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.rounds, args.per_round)))
        return
    print(f"kernels: {blas_summary(blas())}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    spread_of = "(IQR of the rounds)" if args.processes <= 1 else f"(lowest-highest of {args.processes} processes)"
    print(f"{'model':<12} {'cache on':>10} {'cache off':>10} {'off / on':>9} {spread_of:>{len(spread_of) + 1}}")
    for name in models():
        if args.only and name not in args.only:
            continue
        if args.processes <= 1:
            m = measure(name, args.rounds, args.per_round)
            spread = f"{m['q1']:.3f}-{m['q3']:.3f}"
        else:
            command = [sys.executable, __file__, "--one", name, "--rounds", str(args.rounds), "--per-round", str(args.per_round)]
            runs = [json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
                    for _ in range(args.processes)]  # fmt: skip
            ratios = [r["ratio"] for r in runs]
            m = {k: statistics.median(r[k] for r in runs) for k in ("on", "off")}
            m["ratio"], spread = statistics.median(ratios), f"{min(ratios):.3f}-{max(ratios):.3f}"
        print(f"{name:<12} {m['on'] * 1e6:>8.1f}us {m['off'] * 1e6:>8.1f}us {m['ratio']:>9.3f} {spread:>{len(spread_of) + 1}}")


if __name__ == "__main__":
    main()
