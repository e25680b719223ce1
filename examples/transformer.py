"""Train a one-block transformer to sort sequences of digits.

Input: 10 random digits, e.g. ``3 9 0 3 7 1 1 8 2 5``; target at every position: the
sorted sequence ``0 1 1 2 3 3 5 7 8 9``. The model: token embedding + learned positional
embedding, one pre-LayerNorm block (bidirectional multi-head self-attention and an MLP,
each in a residual SkipConnection), a final LayerNorm and a Dense head giving 10 logits
per position; softmax cross-entropy, Adam with warm-up and cosine decay.

Measured (``python examples/transformer.py``, the defaults, seed 0; 4 minutes on 2 shared
CPU cores): final loss 0.0004, test accuracy 100.00% of the digits and 99.95% of the
whole sequences (1999 of 2000).

    python examples/transformer.py [--steps 1500] [--causal]

``--causal`` trains the same model with causal attention (each position sees only the
digits before it), which cannot sort: it shows the masking at work, not a better model.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
from tqdm import tqdm

import luxnn as lx

VOCAB, LENGTH = 10, 10


class TokenAndPosition(lx.Layer):
    """Token embedding plus a learned embedding of each position: ``(batch, seq)`` integer
    digits -> ``(batch, seq, dim)``."""

    def __init__(self, vocab: int, length: int, dim: int) -> None:
        self.tokens = lx.Embedding(vocab, dim)
        self.positions = lx.Embedding(length, dim)

    def children(self):
        return iter((("tokens", self.tokens), ("positions", self.positions)))

    def __call__(self, x: Any, ps: dict, st: dict) -> tuple[Any, dict]:
        tokens, _ = self.tokens(x, ps["tokens"], st["tokens"])
        positions, _ = self.positions(np.arange(x.shape[1]), ps["positions"], st["positions"])
        return tokens + positions, st


def make_model(dim: int, heads: int, causal: bool) -> lx.Layer:
    attention = lx.SkipConnection(
        lx.Chain(lx.LayerNorm(dim), lx.MultiHeadAttention(dim, num_heads=heads, is_causal=causal)),
        lambda y_and_weights, x: y_and_weights[0] + x,  # the block outputs (y, weights)
    )
    mlp = lx.SkipConnection(lx.Chain(lx.LayerNorm(dim), lx.Dense(dim, 4 * dim, activation="relu"), lx.Dense(4 * dim, dim)))
    return lx.Chain(
        embed=TokenAndPosition(VOCAB, LENGTH, dim),
        attention=attention,
        mlp=mlp,
        norm=lx.LayerNorm(dim),
        head=lx.Dense(dim, VOCAB),
    )


def make_data(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    x = rng.integers(0, VOCAB, size=(n, LENGTH))
    return x, np.sort(x, axis=1)


def evaluate(model: lx.Layer, ps: Any, st: Any, data: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """(digit accuracy, whole-sequence accuracy) in test mode."""
    x, y = data
    logits, _ = model(x, ps, lx.testmode(st))
    right = logits.argmax(axis=-1) == y
    return float(right.mean()), float(right.all(axis=1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    model = make_model(args.dim, args.heads, args.causal)
    ps, st = lx.setup(rng, model)
    warmup = min(100, args.steps // 10)
    schedule = lx.optim.warmup_cosine_decay_schedule(0.0, args.lr, warmup_steps=warmup, decay_steps=args.steps)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(schedule))
    loss_fn, ad = lx.losses.CrossEntropyLoss(), lx.AutoTape()
    # Fresh random sequences for every step (10^10 possible inputs: no epoch to overfit);
    # the test set is drawn from a separate generator.
    train_rng = np.random.default_rng(args.seed + 1)
    test = make_data(np.random.default_rng(args.seed + 2), 2000)

    print(f"{lx.parameter_count(ps)} parameters; sorting {LENGTH} digits; causal={args.causal}")
    progress = tqdm(range(args.steps), desc="train", unit="step")
    for step in progress:
        _, loss, _, ts = lx.single_train_step_(ad, loss_fn, make_data(train_rng, args.batch_size), ts)
        if step % 50 == 0 or step == args.steps - 1:
            progress.set_postfix(loss=f"{float(loss):.4f}")
    digits, sequences = evaluate(model, ts.parameters, ts.states, test)
    print(f"test accuracy: {digits:.2%} of digits, {sequences:.2%} of whole sequences")


if __name__ == "__main__":
    main()
