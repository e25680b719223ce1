"""The allocator's two promises, on models it was not tuned for (issue 13).

For each model: 30 training steps with the default kernel threads, in a fresh process,
3 runs; it prints the upstream allocations per step from step 4 on (promise 1: 0; a step
counts from its beginning to the next one's), the
steady peak reserved / peak live (steps 11-30, after ``reset_peaks``; promise 2: at most
1.05) and the all-time one (every step, warm-up included, what a memory monitor sees; at
most 1.10).

    python benchmarks/promises.py                  # every model, 3 runs each
    python benchmarks/promises.py --only cnn lm --runs 5

Each run is its own process, so that no run inherits another's cache or kernel threads.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

STEPS = 30
FIRST_COUNTED = 4  # promise 1 counts from this step on (1-based)
STEADY_FROM = 11  # the steady figures: peaks over steps STEADY_FROM..STEPS


def models() -> dict:
    """name -> (model, optimizer, loss, data, split): `split` runs ``compute_gradients``
    then ``apply_gradients_`` instead of ``single_train_step_``; `data` is a batch, or a
    function of the step number giving one (``lm-buckets``: shapes that vary, for which
    promise 1 is not made)."""
    import numpy as np

    import luxnn as lx
    from luxnn.bench import models as bench

    def images(shape, classes=10):
        rng = np.random.default_rng(1)
        return rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0])

    def mlp(*sizes, activation="relu"):
        layers = [lx.Dense(a, b, activation=activation) for a, b in zip(sizes[:-2], sizes[1:-1])]
        return lx.Chain(*layers, lx.Dense(sizes[-2], sizes[-1]))

    ce, adam = lx.losses.CrossEntropyLoss(), lx.optim.adam(1e-3)
    cnn, resnet, lm, lstm = bench.CNN(), bench.ResNet(), bench.LM(), bench.LSTM()
    block = bench.Transformer(batch=16, length=128, dim=256)
    big = bench.LargeActivations()
    buckets = bench.LM(buckets=(32, 64, 96, 128))
    batches, pick = [buckets.data(n) for n in buckets.buckets], np.random.default_rng(0).integers(0, 4, STEPS + 1)
    return {
        "cnn": (cnn.luxnn_model(), adam, ce, cnn.data(), False),
        "cnn-split": (cnn.luxnn_model(), adam, ce, cnn.data(), True),
        "resnet": (resnet.luxnn_model(), adam, ce, resnet.data(), False),
        "transformer": (block.luxnn_model(), adam, lx.losses.MSELoss(), block.data(), False),
        "mlp-adam": (mlp(256, 1024, 1024, 10), adam, ce, images((512, 256)), False),
        "mlp-adam-split": (mlp(256, 1024, 1024, 10), adam, ce, images((512, 256)), True),
        "mlp-momentum": (mlp(784, 3000, 10), lx.optim.sgd(0.01, momentum=0.9), ce, images((1000, 784)), False),
        "mlp-suite": (bench.luxnn_mlp((784, 256, 10)), lx.optim.sgd(0.01), ce, images((128, 784)), False),
        "large-activations": (bench.luxnn_mlp(big.sizes), lx.optim.sgd(0.01), lx.losses.MSELoss(), big.data(), False),
        "lm": (lm.luxnn_model(), adam, ce, lm.data(lm.length), False),
        "lstm": (lstm.luxnn_model(), adam, ce, lstm.data(), False),
        "lm-buckets": (buckets.luxnn_model(), adam, ce, lambda step: batches[pick[step]], False),
    }


def one_run(name: str) -> dict:
    """The figures of one run of `name`, in this process."""
    import numpy as np

    import luxnn as lx
    from luxnn import parallel

    model, optimizer, loss, data, split = models()[name]
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, optimizer)
    cache, ad = ts.allocator_cache, lx.AutoTape()
    marks, all_time = [], None  # upstream allocations as each step begins
    for step in range(1, STEPS + 1):
        batch = data(step) if callable(data) else data
        if step == STEADY_FROM:
            figures = cache.stats()
            all_time = (figures.peak_live, figures.peak_reserved)
            cache.reset_peaks()
        marks.append(cache.stats().upstream_allocs)
        if split:
            grads, _, _, ts = lx.compute_gradients(ad, loss, batch, ts)
            ts = lx.apply_gradients_(ts, grads)
            del grads
        else:
            _, _, _, ts = lx.single_train_step_(ad, loss, batch, ts)
    steady = cache.stats()
    # A step's count runs to the next step's beginning: what its results' deaths cause counts.
    upstream = np.diff([*marks, steady.upstream_allocs]).tolist()
    live, reserved = max(all_time[0], steady.peak_live), max(all_time[1], steady.peak_reserved)
    return {
        "threads": parallel.num_threads(),
        "upstream": upstream,
        "steady": steady.peak_reserved / steady.peak_live,
        "all_time": reserved / live,
        "plans": steady.plans,
        "peak_live_mb": live / 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="models to run (default: all)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(one_run(args.worker)))
        return
    names = args.only or list(models())
    print(f"{STEPS} steps, {args.runs} runs each; upstream allocations per step from step {FIRST_COUNTED}; "
          f"reserved/live steady (steps {STEADY_FROM}-{STEPS}) and all-time")
    print(f"| model | threads | peak live | upstream/step, each run | steady reserved/live | all-time reserved/live | plans |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        runs = []
        for _ in range(args.runs):
            out = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True, check=True)
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        per_step = " / ".join(f"{sum(r['upstream'][FIRST_COUNTED - 1:]) / (STEPS - FIRST_COUNTED + 1):.2f}" for r in runs)
        steady = " / ".join(f"{r['steady']:.3f}" for r in runs)
        all_time = " / ".join(f"{r['all_time']:.3f}" for r in runs)
        plans = " / ".join(str(r["plans"]) for r in runs)
        print(f"| {name} | {runs[0]['threads']} | {runs[0]['peak_live_mb']:.1f} MB | {per_step} | {steady} | {all_time} | {plans} |", flush=True)


if __name__ == "__main__":
    main()
