"""The allocator's two promises, on models it was not tuned for (issue 13).

For each model: 30 training steps with the default kernel threads, in a fresh process,
3 runs; it prints the upstream allocations per step from step 4 on (promise 1: 0; a step
counts from its beginning to the next one's), the
steady peak reserved / peak live (steps 11-30, after ``reset_peaks``; promise 2: at most
1.05) and the all-time one (every step, warm-up included, what a memory monitor sees; at
most 1.10).

Then loops whose shapes vary (a plan per request-size signature, `luxnn.memory.plan`): 60
steps each; the upstream allocations per step over steps 31-60 (once every signature has
its plan: 0), the plans installed by step 30 and by step 60 (none made again and again),
the steady reserved / live (steps 31-60) and the all-time one (at most 1.25).

    python benchmarks/promises.py                  # every model and loop, 3 runs each
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
    """name -> (model, optimizer, loss, data, verbs): `verbs` "in place" runs
    ``single_train_step_``, "split" ``compute_gradients`` then ``apply_gradients_``, "out of
    place" ``single_train_step`` (each step's results, new parameters and moments, outlive
    it); `data` is a batch (for shapes that vary: `varying`)."""
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
    dropout_mlp = bench.dropout_mlp()
    small_cnn = lx.Chain(
        lx.Conv((3, 3), 1, 16, activation="relu"), lx.MaxPool((2, 2)), lx.Conv((3, 3), 16, 32, activation="relu"),
        lx.MaxPool((2, 2)), lx.Flatten(), lx.Dense(5 * 5 * 32, 10),
    )  # fmt: skip
    gru = lx.Chain(lx.Recurrence(lx.GRUCell(8, 32)), lx.Dense(32, 3))
    bilstm = lx.Chain(lx.LSTM(6, 12, num_layers=2, bidirectional=True), lx.Flatten(), lx.Dense(7 * 24, 5))
    return {
        "cnn": (cnn.luxnn_model(), adam, ce, cnn.data(), "in place"),
        "cnn-split": (cnn.luxnn_model(), adam, ce, cnn.data(), "split"),
        "resnet": (resnet.luxnn_model(), adam, ce, resnet.data(), "in place"),
        "transformer": (block.luxnn_model(), adam, lx.losses.MSELoss(), block.data(), "in place"),
        "mlp-adam": (mlp(256, 1024, 1024, 10), adam, ce, images((512, 256)), "in place"),
        "mlp-adam-split": (mlp(256, 1024, 1024, 10), adam, ce, images((512, 256)), "split"),
        "mlp-momentum": (mlp(784, 3000, 10), lx.optim.sgd(0.01, momentum=0.9), ce, images((1000, 784)), "in place"),
        "mlp-suite": (bench.luxnn_mlp((784, 256, 10)), lx.optim.sgd(0.01), ce, images((128, 784)), "in place"),
        "large-activations": (bench.luxnn_mlp(big.sizes), lx.optim.sgd(0.01), lx.losses.MSELoss(), big.data(), "in place"),
        "lm": (lm.luxnn_model(), adam, ce, lm.data(lm.length), "in place"),
        "lstm": (lstm.luxnn_model(), adam, ce, lstm.data(), "in place"),
        # Three more that nothing was tuned on: 64 KiB gradients (small blocks) made late
        # in the step, a small convolutional net, a GRU over a sequence.
        "mlp-dropout": (dropout_mlp, lx.optim.adamw(1e-3), ce, images((256, 128)), "in place"),
        "cnn-small": (small_cnn, adam, ce, images((32, 28, 28, 1)), "in place"),
        "gru": (gru, adam, ce, images((16, 20, 8), classes=3), "in place"),
        # Blocks of at most 64 KiB (slabs'), many of tens of KiB: planned, not left to slabs.
        "bilstm-small": (bilstm, adam, ce, images((16, 7, 6), classes=5), "in place"),
        # Out of place: two generations of parameters and moments alive at each step's end.
        "mlp-adam-out-of-place": (mlp(256, 1024, 1024, 10), adam, ce, images((512, 256)), "out of place"),
        "mlp-dropout-out-of-place": (dropout_mlp, lx.optim.adamw(1e-3), ce, images((256, 128)), "out of place"),
        "cnn-small-out-of-place": (small_cnn, adam, ce, images((32, 28, 28, 1)), "out of place"),
        "gru-out-of-place": (gru, adam, ce, images((16, 20, 8), classes=3), "out of place"),
    }


VARYING_STEPS = 60
VARYING_STEADY_FROM = 31
EVAL_EVERY = 5


def varying() -> dict:
    """name -> (model, optimizer, loss, schedule, verb): ``schedule(step)`` gives
    ``("train", batch)`` or ``("eval", inputs)`` (a pass in test mode, marked as a step of
    the cache's); `verb` trains on a batch."""
    import numpy as np

    import luxnn as lx
    from luxnn.bench import models as bench

    ce, adam = lx.losses.CrossEntropyLoss(), lx.optim.adam(1e-3)
    buckets = bench.LM(buckets=(32, 64, 96, 128))
    lengths = [buckets.data(n) for n in buckets.buckets]
    pick = np.random.default_rng(0).integers(0, len(lengths), VARYING_STEPS + 1)

    def bucketed(step):
        return "train", lengths[pick[step]]

    def epochs(*batches):  # one step per batch, in turn: the last one short
        return lambda step: ("train", batches[step % len(batches)])

    def with_eval(batch, held_out):
        return lambda step: ("eval", held_out) if step % EVAL_EVERY == 0 else ("train", batch)

    # Loops the allocator was not tuned on: a transformer block's lengths and an MLP's batch
    # sizes drawn at random, out of place.
    blocks = [bench.Transformer(batch=8, length=n, dim=128, heads=4) for n in (32, 64, 96, 128)]
    block_batches = [b.data() for b in blocks]
    block_pick = np.random.default_rng(2).integers(0, len(blocks), VARYING_STEPS + 1)
    sizes = np.random.default_rng(3).choice([64, 128, 192, 256], VARYING_STEPS + 1)

    cnn, resnet = bench.CNN(), bench.ResNet()
    full, short = cnn.data(), bench.CNN(batch=20).data()
    mlp = lx.Chain(lx.Dense(256, 1024, activation="relu"), lx.Dense(1024, 1024, activation="relu"), lx.Dense(1024, 10))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((600, 256)).astype(np.float32), rng.integers(0, 10, 600)
    return {
        "lm-buckets": (buckets.luxnn_model(), adam, ce, bucketed, lx.single_train_step_),
        "lm-buckets-out-of-place": (buckets.luxnn_model(), adam, ce, bucketed, lx.single_train_step),
        "cnn-short-last-batch": (cnn.luxnn_model(), adam, ce, epochs(full, full, full, short), lx.single_train_step_),
        "mlp-short-last-batch": (mlp, adam, ce, epochs(*[(x[k:k + 256], y[k:k + 256]) for k in (0, 256)], (x[512:], y[512:])), lx.single_train_step_),
        "resnet-eval-every-5": (resnet.luxnn_model(), adam, ce, with_eval(resnet.data(), resnet.data()[0][:8]), lx.single_train_step_),
        "transformer-lengths-out-of-place": (
            blocks[0].luxnn_model(), adam, lx.losses.MSELoss(), lambda step: ("train", block_batches[block_pick[step]]), lx.single_train_step,
        ),
        "mlp-batches-out-of-place": (mlp, adam, ce, lambda step: ("train", (x[: sizes[step]], y[: sizes[step]])), lx.single_train_step),
    }


def one_varying_run(name: str) -> dict:
    """The figures of one run of the varying loop `name`, in this process."""
    import numpy as np

    import luxnn as lx
    from luxnn import memory, parallel

    model, optimizer, loss, schedule, verb = varying()[name]
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, optimizer)
    cache, ad = ts.allocator_cache, lx.AutoTape()
    marks, plans, all_time = [], {}, None
    for step in range(1, VARYING_STEPS + 1):
        if step == VARYING_STEADY_FROM:
            figures = cache.stats()
            all_time, plans["by_30"] = (figures.peak_live, figures.peak_reserved), figures.plans
            cache.reset_peaks()
        marks.append(cache.stats().upstream_allocs)
        kind, batch = schedule(step)
        if kind == "eval":
            with memory.step(cache):
                logits, _ = ts.model(batch, ts.parameters, lx.testmode(ts.states))
                del logits
        else:
            _, _, _, ts = verb(ad, loss, batch, ts)
    steady = cache.stats()
    upstream = np.diff([*marks, steady.upstream_allocs]).tolist()
    live, reserved = max(all_time[0], steady.peak_live), max(all_time[1], steady.peak_reserved)
    return {
        "threads": parallel.num_threads(),
        "upstream": upstream[VARYING_STEADY_FROM - 1:],
        "steady": steady.peak_reserved / steady.peak_live,
        "all_time": reserved / live,
        "plans": f"{plans['by_30']}/{steady.plans}",
        "peak_live_mb": live / 1e6,
    }


def one_run(name: str) -> dict:
    """The figures of one run of `name`, in this process."""
    import numpy as np

    import luxnn as lx
    from luxnn import parallel

    model, optimizer, loss, data, verbs = models()[name]
    ps, st = lx.setup(np.random.default_rng(0), model)
    ts = lx.TrainState(model, ps, st, optimizer)
    cache, ad = ts.allocator_cache, lx.AutoTape()
    marks, all_time = [], None  # upstream allocations as each step begins
    for step in range(1, STEPS + 1):
        batch = data
        if step == STEADY_FROM:
            figures = cache.stats()
            all_time = (figures.peak_live, figures.peak_reserved)
            cache.reset_peaks()
        marks.append(cache.stats().upstream_allocs)
        if verbs == "split":
            grads, _, _, ts = lx.compute_gradients(ad, loss, batch, ts)
            ts = lx.apply_gradients_(ts, grads)
            del grads
        else:
            verb = lx.single_train_step_ if verbs == "in place" else lx.single_train_step
            _, _, _, ts = verb(ad, loss, batch, ts)
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
        print(json.dumps(one_varying_run(args.worker) if args.worker in varying() else one_run(args.worker)))
        return
    names = [n for n in args.only or list(models()) if n in models()]
    loops = [n for n in args.only or list(varying()) if n in varying()]
    print(f"{STEPS} steps, {args.runs} runs each; upstream allocations per step from step {FIRST_COUNTED}; "
          f"reserved/live steady (steps {STEADY_FROM}-{STEPS}) and all-time")
    print(f"| model | threads | peak live | upstream/step, each run | steady reserved/live | all-time reserved/live | plans |")
    print("|---|---|---|---|---|---|---|")
    for name in names:
        runs = _runs(name, args.runs)
        per_step = " / ".join(f"{sum(r['upstream'][FIRST_COUNTED - 1:]) / (STEPS - FIRST_COUNTED + 1):.2f}" for r in runs)
        steady = " / ".join(f"{r['steady']:.3f}" for r in runs)
        all_time = " / ".join(f"{r['all_time']:.3f}" for r in runs)
        plans = " / ".join(str(r["plans"]) for r in runs)
        print(f"| {name} | {runs[0]['threads']} | {runs[0]['peak_live_mb']:.1f} MB | {per_step} | {steady} | {all_time} | {plans} |", flush=True)
    if not loops:
        return
    print(f"\nShapes that vary: {VARYING_STEPS} steps, {args.runs} runs each; upstream allocations per step over steps "
          f"{VARYING_STEADY_FROM}-{VARYING_STEPS}; plans installed by step {VARYING_STEADY_FROM - 1} / by step {VARYING_STEPS}; "
          f"reserved/live steady (steps {VARYING_STEADY_FROM}-{VARYING_STEPS}) and all-time")
    print("| loop | threads | peak live | upstream/step once warm, each run | plans installed | steady reserved/live | all-time reserved/live |")
    print("|---|---|---|---|---|---|---|")
    for name in loops:
        runs = _runs(name, args.runs)
        per_step = " / ".join(f"{sum(r['upstream']) / len(r['upstream']):.2f}" for r in runs)
        plans = " / ".join(r["plans"] for r in runs)
        steady = " / ".join(f"{r['steady']:.3f}" for r in runs)
        all_time = " / ".join(f"{r['all_time']:.3f}" for r in runs)
        print(f"| {name} | {runs[0]['threads']} | {runs[0]['peak_live_mb']:.1f} MB | {per_step} | {plans} | {steady} | {all_time} |", flush=True)


def _runs(name: str, runs: int) -> list[dict]:
    """`runs` runs of `name`, each in a fresh process."""
    results = []
    for _ in range(runs):
        out = subprocess.run([sys.executable, __file__, "--worker", name], capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return results


if __name__ == "__main__":
    main()
