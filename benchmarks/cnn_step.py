"""Issue 4's CNN training step: luxnn against PyTorch eager on the CPU, side by side.

28x28x1 images, batch 64: Conv 3x3 1->32 + relu, 2x2 max pool, Conv 3x3 32->64 + relu, 2x2
max pool, Dense 3136->10 (padding 1, so 28 -> 14 -> 7), softmax cross-entropy, Adam.
Interleaved rounds, medians; both frameworks on the same number of threads.

    python benchmarks/cnn_step.py [--rounds 15] [--per-round 10] [--threads N] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics

import numpy as np

import luxnn as lx
from luxnn.bench import models
from luxnn.bench.machine import blas, blas_summary
from luxnn.bench.runner import interleaved_rounds

CNN = models.CNN()
BATCH = CNN.batch


def luxnn_forward_backward():
    x, y = CNN.data()
    model = CNN.luxnn_model()
    ps, st = lx.setup(np.random.default_rng(0), model)
    loss = lx.losses.CrossEntropyLoss()
    vg = lx.value_and_grad(lambda ps: loss(model(x, ps, st)[0], y))
    return lambda: vg(ps)


def torch_forward_backward():
    import torch

    model = CNN.torch_model()
    x, y = CNN.torch_data()
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        model.zero_grad(set_to_none=True)
        loss_fn(model(tx), ty).backward()

    return step


def profile(step, n: int = 30) -> None:
    import cProfile
    import pstats

    for _ in range(3):
        step()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        step()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="BLAS and PyTorch threads")
    parser.add_argument("--profile", action="store_true", help="cProfile luxnn's training step instead")
    args = parser.parse_args()

    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads, user_api="blas")
    if args.profile:
        profile(CNN.luxnn())
        return

    import torch

    torch.set_num_threads(args.threads)
    steps = {
        "luxnn train step (cache on)": CNN.luxnn(),
        "luxnn train step (cache off)": CNN.luxnn(cache=None),
        "pytorch train step": CNN.torch(),
        "luxnn fwd+bwd": luxnn_forward_backward(),
        "pytorch fwd+bwd": torch_forward_backward(),
    }
    print(f"CNN 28x28x1, batch {BATCH}, conv3x3 32 + pool, conv3x3 64 + pool, dense 10; float32, Adam")
    print(f"BLAS: {blas_summary(blas())}; torch {torch.__version__} threads={torch.get_num_threads()}; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")
    samples = interleaved_rounds(steps, args.rounds, args.per_round)
    medians = {name: statistics.median(s) for name, s in samples.items()}
    print(f"{'step':<30} {'median':>9} {'IQR':>8}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4)
        print(f"{name:<30} {medians[name] * 1e3:>7.2f}ms {(q[2] - q[0]) * 1e3:>6.2f}ms")
    torch_step = medians["pytorch train step"]
    for name in ("luxnn train step (cache on)", "luxnn train step (cache off)"):
        print(f"ratio {name} / pytorch train step: {medians[name] / torch_step:.2f}x")
    print(f"ratio luxnn fwd+bwd / pytorch fwd+bwd: {medians['luxnn fwd+bwd'] / medians['pytorch fwd+bwd']:.2f}x")


if __name__ == "__main__":
    main()
