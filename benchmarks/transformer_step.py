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
import time

import numpy as np

import luxnn as lx

BATCH, LENGTH, DIM, HEADS, LR = 32, 128, 256, 8, 1e-3


def kernels() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    return "; ".join(
        f"{i['internal_api']} {i.get('version')} {i.get('architecture') or ''} x{i['num_threads']}".replace("  ", " ")
        for i in threadpool_info()
    )


def luxnn_block() -> lx.Layer:
    attention = lx.SkipConnection(
        lx.Chain(lx.LayerNorm(DIM), lx.MultiHeadAttention(DIM, num_heads=HEADS)),
        lambda y_and_weights, x: y_and_weights[0] + x,
    )
    mlp = lx.SkipConnection(lx.Chain(lx.LayerNorm(DIM), lx.Dense(DIM, 4 * DIM, activation="gelu"), lx.Dense(4 * DIM, DIM)))
    return lx.Chain(attention, mlp)


def luxnn_step(x, y, cache=True):
    model = luxnn_block()
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, lx.optim.adam(LR), **({} if cache else {"allocator_cache": None}))
    loss, ad = lx.losses.MSELoss(), lx.AutoTape()

    def step():
        nonlocal ts
        _, _, _, ts = lx.single_train_step_(ad, loss, (x, y), ts)

    return step


def torch_step(x, y, need_weights):
    import torch

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(DIM), torch.nn.LayerNorm(DIM)
            self.attn = torch.nn.MultiheadAttention(DIM, HEADS, batch_first=True)
            self.mlp = torch.nn.Sequential(torch.nn.Linear(DIM, 4 * DIM), torch.nn.GELU(approximate="tanh"), torch.nn.Linear(4 * DIM, DIM))

        def forward(self, x):
            h = self.ln1(x)
            x = x + self.attn(h, h, h, need_weights=need_weights, average_attn_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    model = Block()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.MSELoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(tx), ty).backward()
        opt.step()

    return step


def time_rounds(steps: dict, rounds: int, per_round: int) -> dict[str, list[float]]:
    for step in steps.values():  # warm-up (caches, allocator, BLAS buffers)
        for _ in range(3):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            t0 = time.perf_counter()
            for _ in range(per_round):
                step()
            samples[name].append((time.perf_counter() - t0) / per_round)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--no-cache", action="store_true", help="train without the allocator cache")
    args = parser.parse_args()

    rng = np.random.default_rng(1)
    x = rng.standard_normal((BATCH, LENGTH, DIM)).astype(np.float32)
    y = rng.standard_normal((BATCH, LENGTH, DIM)).astype(np.float32)
    steps = {"luxnn": luxnn_step(x, y, cache=not args.no_cache)}
    try:
        import torch

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        steps["pytorch (need_weights=False)"] = torch_step(x, y, need_weights=False)
        steps["pytorch (need_weights=True)"] = torch_step(x, y, need_weights=True)
    except ImportError:
        pass
    print(f"transformer block: batch {BATCH}, length {LENGTH}, dim {DIM}, {HEADS} heads, float32, Adam")
    print(f"kernels: {kernels()}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    samples = time_rounds(steps, args.rounds, args.per_round)
    base = statistics.median(samples["luxnn"])
    # The last column is luxnn's step time over this row's: the target is <= 1.0x PyTorch.
    print(f"{'step':<30} {'median':>9} {'IQR':>8} {'luxnn time / this':>18}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0])
        med = statistics.median(s)
        print(f"{name:<30} {med * 1e3:>7.1f}ms {(q[2] - q[0]) * 1e3:>6.1f}ms {base / med:>17.2f}x")


if __name__ == "__main__":
    main()
