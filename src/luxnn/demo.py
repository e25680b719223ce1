"""`luxnn demo`: train a small network on scikit-learn's bundled 8x8 digits and report
accuracy, time per step and the allocator cache's figures."""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

import luxnn as lx
from luxnn.ops import device_checks

MODELS = ("mlp", "cnn")
WARM_UP_STEPS = 3
"""Steps the cache may still take blocks upstream in: the first two are recorded and the
third is planned; from the next one on a fixed-shape loop takes none (docs/design.md)."""


def load_digits(seed: int) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The digits (1797 images of 8x8, values 0..16, scikit-learn ships them), scaled to
    [0, 1], as ``(train, test)`` pairs of ``(images (N, 8, 8, 1) float32, labels (N,))``,
    split 80/20 per class."""
    try:
        from sklearn.datasets import load_digits as sklearn_digits
    except ImportError as err:
        raise SystemExit("luxnn demo needs scikit-learn for its data: pip install 'luxnn[examples]'") from err
    digits = sklearn_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int64)
    rng = np.random.default_rng(seed)
    test = np.zeros(len(labels), bool)
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        test[members[: len(members) // 5]] = True
    return (images[~test], labels[~test]), (images[test], labels[test])


def build_model(name: str) -> lx.Layer:
    """The demo's networks: an MLP on the flattened pixels, or a small CNN."""
    if name == "mlp":
        return lx.Chain(lx.Flatten(), lx.Dense(64, 128, activation="relu"), lx.Dense(128, 10))
    if name == "cnn":
        return lx.Chain(
            lx.Conv((3, 3), 1, 16, activation="relu", padding="same"),
            lx.Conv((3, 3), 16, 32, activation="relu", padding="same"),
            lx.MaxPool((2, 2)),
            lx.Flatten(),
            lx.Dense(4 * 4 * 32, 64, activation="relu"),
            lx.Dense(64, 10),
        )
    raise ValueError(f"unknown demo model {name!r}; expected one of {MODELS}")


def accuracy(model: lx.Layer, ps: Any, st: Any, x: Any, y: np.ndarray) -> float:
    logits, _ = model(x, ps, lx.testmode(st))
    return float((lx.cpu_device()(logits).argmax(axis=-1) == y).mean())


def _device(name: str) -> lx.devices.Device:
    if name == "cpu":
        return lx.cpu_device()
    if name == "gpu":
        return lx.gpu_device(force=True)  # asked for a GPU: no silent fallback
    raise ValueError(f"unknown demo device {name!r}; expected 'cpu' or 'gpu'")


def run(model_name: str = "mlp", *, epochs: int = 30, batch_size: int = 64, learning_rate: float = 3e-3,
        seed: int = 0, memory_plot: str | None = None, progress: bool = True, device: str = "cpu",
        backend: Any = None) -> dict[str, Any]:
    """Train the demo model on `device` ("cpu" or "gpu"); returns its figures (accuracy,
    seconds per step, cache stats). With a `luxnn.distributed` `backend`, data-parallel:
    each rank takes its share of every batch of `batch_size` and the gradients are averaged
    (the figures then add the ranks and the time in collectives; rank 0 draws the plot)."""
    from tqdm.auto import tqdm

    (x_train, y_train), (x_test, y_test) = load_digits(seed)
    model = build_model(model_name)
    rng = np.random.default_rng(seed)
    dev = _device(device)
    ps, st = dev(lx.setup(rng, model))
    cache = lx.memory.AllocCache(None if device == "cpu" else dev, record=memory_plot is not None)
    optimizer = lx.optim.adam(learning_rate)
    if backend is None:
        loader = lx.DataLoader((x_train, y_train), batch_size, shuffle=True, drop_last=True, rng=rng, device=dev)
    else:
        from . import distributed as dist

        ps, st = dist.synchronize(backend, (ps, st))
        optimizer = dist.DistributedOptimizer(backend, optimizer)
        loader = dist.DistributedDataLoader(backend, (x_train, y_train), batch_size // backend.size, seed=seed, device=dev)
        progress, memory_plot = progress and backend.rank == 0, memory_plot if backend.rank == 0 else None
    ts = lx.TrainState(model, ps, st, optimizer, allocator_cache=cache)
    # A GPU step is timed to its end, not to the end of its launches.
    sync = dev.xp.cuda.runtime.deviceSynchronize if device == "gpu" else lambda: None  # the state's stream too
    loss_fn, ad = lx.losses.CrossEntropyLoss(), lx.AutoTape()

    step_times: list[float] = []
    collective_times: list[float] = []  # with a backend: each step's seconds in collectives
    upstream_after_first = upstream_steady = 0  # after step 1; from WARM_UP_STEPS + 1 on
    bar = tqdm(total=epochs * len(loader), desc=f"demo {model_name}", unit="step", disable=not progress)
    for _ in range(epochs):
        for batch in loader:
            before = cache.stats().upstream_allocs
            in_collectives = backend.stats.seconds if backend is not None else 0.0
            t0 = time.perf_counter()
            _, loss, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
            sync()
            step_times.append(time.perf_counter() - t0)
            if backend is not None:
                collective_times.append(backend.stats.seconds - in_collectives)
            upstream = cache.stats().upstream_allocs - before
            upstream_after_first += upstream if len(step_times) > 1 else 0
            upstream_steady += upstream if len(step_times) > WARM_UP_STEPS else 0
            bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
            bar.update()
        device_checks.check_now()  # labels a GPU's kernels found out of range, once per epoch
    bar.close()

    figures = {
        "model": model_name,
        "device": repr(dev),
        "parameters": lx.parameter_count(ts.parameters),
        "steps": len(step_times),
        "test_accuracy": accuracy(model, ts.parameters, ts.states, dev(x_test), y_test),
        "seconds_per_step": statistics.median(step_times),
        "cache": cache.stats(),
        "upstream_allocs_after_first_step": upstream_after_first,
        "upstream_allocs_after_warm_up": upstream_steady,
    }
    if backend is not None:
        figures["workers"] = backend.size
        figures["collective_seconds_per_step"] = statistics.median(collective_times)
    if memory_plot:
        lx.memory.plot_timeline(cache, memory_plot)
        figures["memory_plot"] = memory_plot
    return figures


def report(figures: dict[str, Any]) -> str:
    """The demo's closing lines."""
    s = figures["cache"]
    lines = [
        f"model {figures['model']} on {figures.get('device', 'CPUDevice()')}: {figures['parameters']} parameters, {figures['steps']} steps",
        f"test accuracy {figures['test_accuracy']:.2%}, median time per step {figures['seconds_per_step'] * 1e3:.3f} ms",
        f"allocator cache: {s.hits} hits ({s.plan_hits} at planned places), {s.misses} misses, "
        f"{figures['upstream_allocs_after_warm_up']} upstream allocations from step {WARM_UP_STEPS + 1} on "
        f"({figures['upstream_allocs_after_first_step']} after the first step, warm-up included), "
        f"peak live {_mib(s.peak_live)}, peak reserved {_mib(s.peak_reserved)} "
        f"({s.peak_reserved / max(s.peak_live, 1):.2f}x live; at the end {s.bytes_reserved / max(s.peak_live, 1):.2f}x)",
    ]
    if "workers" in figures:
        share = figures["collective_seconds_per_step"] / figures["seconds_per_step"]
        lines.append(
            f"data-parallel on {figures['workers']} ranks: median time per step in collectives {figures['collective_seconds_per_step'] * 1e3:.3f} ms "
            f"({share:.0%} of the median step; waiting for the other ranks included)"
        )
    if "memory_plot" in figures:
        lines.append(f"memory timeline written to {figures['memory_plot']}")
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"
