"""Issue 2's performance check: an MLP training step with luxnn's AD against the same step
written by hand in NumPy and against PyTorch eager, interleaved, medians of rounds; and the
AD bookkeeping cost per recorded primitive on tiny arrays.

    python benchmarks/core_step.py [--rounds 15] [--no-cache]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import numpy as np

import luxnn as lx

BATCH, IN, HIDDEN, OUT, LR = 128, 784, 256, 10, 0.01


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "threadpoolctl not installed"
    return "; ".join(
        f"{i['internal_api']} {i.get('version')} {i.get('architecture')} x{i['num_threads']}"
        for i in threadpool_info()
        if i["user_api"] == "blas"
    )


def make_data(rng):
    x = rng.standard_normal((BATCH, IN)).astype(np.float32)
    y = rng.integers(0, OUT, BATCH)
    return x, y


def luxnn_step(x, y, cache):
    model = lx.Chain(lx.Dense(IN, HIDDEN, activation="relu"), lx.Dense(HIDDEN, OUT))
    ps, st = lx.setup(np.random.default_rng(0), model)
    kwargs = {} if cache else {"allocator_cache": None}
    ts = lx.TrainState(model, ps, st, lx.optim.sgd(LR), **kwargs)
    loss, ad = lx.losses.CrossEntropyLoss(), lx.AutoTape()

    def step():
        nonlocal ts
        _, _, _, ts = lx.single_train_step_(ad, loss, (x, y), ts)

    return step


def numpy_step(x, y):
    rng = np.random.default_rng(0)
    w1 = (rng.uniform(-1, 1, (IN, HIDDEN)) / math.sqrt(IN)).astype(np.float32)
    b1 = np.zeros(HIDDEN, np.float32)
    w2 = (rng.uniform(-1, 1, (HIDDEN, OUT)) / math.sqrt(HIDDEN)).astype(np.float32)
    b2 = np.zeros(OUT, np.float32)
    rows = np.arange(BATCH)

    def step():
        h = x @ w1 + b1
        a = np.maximum(h, 0)
        z = a @ w2 + b2
        z -= z.max(axis=1, keepdims=True)
        e = np.exp(z)
        p = e / e.sum(axis=1, keepdims=True)
        _loss = -np.log(p[rows, y]).mean()
        p[rows, y] -= 1
        p /= BATCH
        gw2 = a.T @ p
        gb2 = p.sum(axis=0)
        ga = p @ w2.T
        ga *= h > 0
        gw1 = x.T @ ga
        gb1 = ga.sum(axis=0)
        for param, g in ((w1, gw1), (b1, gb1), (w2, gw2), (b2, gb2)):
            param -= LR * g

    return step


def torch_step(x, y):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, OUT))
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn(model(tx), ty).backward()
        opt.step()

    return step


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

    x, y = make_data(np.random.default_rng(1))
    steps = {
        "luxnn (cache on)": luxnn_step(x, y, cache=True),
        "luxnn (cache off)": luxnn_step(x, y, cache=False),
        "numpy by hand": numpy_step(x, y),
    }
    try:
        import torch

        torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
        steps["pytorch eager"] = torch_step(x, y)
    except ImportError:
        pass
    print(f"MLP {IN}-{HIDDEN}-{OUT}, batch {BATCH}, float32, SGD; BLAS: {blas_info()}")
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
