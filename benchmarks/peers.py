"""What the training-step scripts here share: their options, and one timed table of a luxnn
step against its peers (interleaved rounds, medians), read as ``luxnn time / this``.

    from peers import add_step_options, time_against_peers
"""

from __future__ import annotations

import argparse
import os
import statistics
from collections.abc import Callable

from luxnn.bench.machine import blas, blas_summary
from luxnn.bench.runner import interleaved_rounds


def add_step_options(parser: argparse.ArgumentParser) -> None:
    """--rounds, --per-round and --no-cache (train without the allocator cache)."""
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--no-cache", action="store_true", help="train without the allocator cache")


def time_against_peers(steps: dict[str, Callable[[], None]], args: argparse.Namespace, *, decimals: int = 2) -> None:
    """Time `steps` (the first is luxnn's) in `args.rounds` interleaved rounds and print,
    after the kernels' line, each step's median and IQR and luxnn's median over its own."""
    print(f"kernels: {blas_summary(blas())}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    samples = interleaved_rounds(steps, args.rounds, args.per_round, warmup=3)
    base = statistics.median(next(iter(samples.values())))
    width = max(len(name) for name in samples) + 2
    print(f"{'step':<{width}} {'median':>9} {'IQR':>8} {'luxnn time / this':>18}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0])
        med = statistics.median(s)
        print(f"{name:<{width}} {med * 1e3:>7.{decimals}f}ms {(q[2] - q[0]) * 1e3:>6.{decimals}f}ms {base / med:>17.2f}x")
