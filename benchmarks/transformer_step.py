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

from peers import add_step_options, time_against_peers

from luxnn.bench import models

BLOCK = models.Transformer()
BATCH, LENGTH, DIM, HEADS = BLOCK.batch, BLOCK.length, BLOCK.dim, BLOCK.heads


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_options(parser)
    args = parser.parse_args()

    steps = {"luxnn": BLOCK.luxnn(cache=None if args.no_cache else "default")}
    try:
        steps["pytorch (need_weights=False)"] = BLOCK.torch(need_weights=False)
        steps["pytorch (need_weights=True)"] = BLOCK.torch(need_weights=True)
    except ImportError:
        pass
    print(f"transformer block: batch {BATCH}, length {LENGTH}, dim {DIM}, {HEADS} heads, float32, Adam")
    time_against_peers(steps, args, decimals=1)  # the target: luxnn time / PyTorch's >= 1


if __name__ == "__main__":
    main()
