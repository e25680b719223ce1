"""Issue 4's transformer check: one pre-LayerNorm transformer block (batch 32, length 128,
dim 256, 8 heads, MLP 4x with tanh-GELU), training step = forward + backward + Adam
update with an MSE loss, luxnn against PyTorch eager on the CPU, interleaved rounds,
medians.

PyTorch runs the same block twice: with ``need_weights=False`` (what
``torch.nn.TransformerEncoderLayer`` does: fused scaled_dot_product_attention) and with
``need_weights=True`` (explicit attention weights, as luxnn's MultiHeadAttention returns).

    python benchmarks/transformer_step.py [--rounds 7] [--per-round 3] [--no-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics

from luxnn.bench import models
from luxnn.bench.machine import blas, blas_summary
from luxnn.bench.runner import interleaved_rounds

BLOCK = models.Transformer()
BATCH, LENGTH, DIM, HEADS = BLOCK.batch, BLOCK.length, BLOCK.dim, BLOCK.heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--no-cache", action="store_true", help="train without the allocator cache")
    args = parser.parse_args()

    steps = {"luxnn": BLOCK.luxnn(cache=None if args.no_cache else "default")}
    try:
        steps["pytorch (need_weights=False)"] = BLOCK.torch(need_weights=False)
        steps["pytorch (need_weights=True)"] = BLOCK.torch(need_weights=True)
    except ImportError:
        pass
    print(f"transformer block: batch {BATCH}, length {LENGTH}, dim {DIM}, {HEADS} heads, float32, Adam")
    print(f"kernels: {blas_summary(blas())}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    samples = interleaved_rounds(steps, args.rounds, args.per_round, warmup=3)
    base = statistics.median(samples["luxnn"])
    # The last column is luxnn's step time over this row's: the target is <= 1.0x PyTorch.
    print(f"{'step':<30} {'median':>9} {'IQR':>8} {'luxnn time / this':>18}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0])
        med = statistics.median(s)
        print(f"{name:<30} {med * 1e3:>7.1f}ms {(q[2] - q[0]) * 1e3:>6.1f}ms {base / med:>17.2f}x")


if __name__ == "__main__":
    main()
