"""GPU training steps under three allocators, side by side in one run (needs CuPy and a GPU).

    python benchmarks/gpu_step.py [--steps 20] [--models mlp,cnn,attention]

For each model, the same Adam training step (`single_train_step_`, fixed shapes, float32)
runs under:

  (a) no pool      cupy.cuda.set_allocator(None): every allocation is a cudaMalloc
  (b) CuPy pool    CuPy's default MemoryPool
  (c) luxnn cache  the TrainState's AllocCache on the CUDADevice (upstream: cuMemAlloc),
                   served to CuPy by its C hook

Two passes per allocator, each from a fresh TrainState and after warm-up steps: a timing
pass with the allocator as it is (step time = wall time of N synchronised steps / N), and
a memory pass in which the driver allocations are counted by a wrapper around CuPy's raw
allocator (for (a) and (b): it is their upstream; for (c): allocations outside the cache,
the parameters and batch, while the cache counts its own), and peaks are taken:

  peak live      bytes in use by arrays: (a) the raw allocations, (b) the pool's
                 used_bytes after each allocation, (c) the cache's peak_live plus what
                 lives outside it (parameters, optimizer state made before, the batch)
  peak reserved  bytes held from the driver: (a) = live, (b) the pool's upstream bytes,
                 (c) the cache's peak_reserved plus what lives outside it

Driver allocations of a fresh state: during its first step, its second and third, and per
step from the fourth on (target for (c): 0; docs/design.md's budget); a line per model under the
table gives the cache's driver allocations step by step and its plans' figures. The last lines give the ratios of (c) to (a) and (b). The script
exits 1 if a model failed (its row says why), after printing the table.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import luxnn as lx


def mlp() -> tuple[lx.Layer, tuple[int, ...], int]:
    return lx.Chain(lx.Dense(784, 2048, activation="relu"), lx.Dense(2048, 2048, activation="relu"), lx.Dense(2048, 10)), (1024, 784), 10


def cnn() -> tuple[lx.Layer, tuple[int, ...], int]:
    model = lx.Chain(
        lx.Conv((3, 3), 1, 32, activation="relu", padding="same"),
        lx.Conv((3, 3), 32, 64, activation="relu", padding="same"),
        lx.MaxPool((2, 2)),
        lx.Flatten(),
        lx.Dense(14 * 14 * 64, 128, activation="relu"),
        lx.Dense(128, 10),
    )
    return model, (128, 28, 28, 1), 10


class _TakeFirst(lx.Layer):
    def __call__(self, x: Any, ps: Any, st: Any) -> Any:
        return x[0], st


def attention() -> tuple[lx.Layer, tuple[int, ...], int]:
    dim = 256
    block = lx.Chain(
        lx.SkipConnection(lx.Chain(lx.MultiHeadAttention(dim, num_heads=8, is_causal=True), _TakeFirst())),
        lx.LayerNorm(dim),
        lx.SkipConnection(lx.Chain(lx.Dense(dim, 4 * dim, activation="gelu"), lx.Dense(4 * dim, dim))),
        lx.LayerNorm(dim),
        lx.Flatten(),
        lx.Dense(128 * dim, 10),
    )
    return block, (32, 128, dim), 10


MODELS: dict[str, Callable[[], tuple[lx.Layer, tuple[int, ...], int]]] = {"mlp": mlp, "cnn": cnn, "attention": attention}


class Meter:
    """Counts driver allocations made through CuPy's raw allocator and their live bytes."""

    def __init__(self, cupy: Any) -> None:
        self.cupy = cupy
        self.count = self.live = self.peak = 0

    def malloc(self, size: int) -> Any:
        cupy = self.cupy
        mem = cupy.cuda.Memory(size)  # cudaMalloc
        self.count += 1
        self.live += size
        self.peak = max(self.peak, self.live)
        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(mem.ptr, size, _Release(mem, size, self), mem.device_id), 0)

    def reset_peak(self) -> None:
        self.peak = self.live


class _Release:
    __slots__ = ("mem", "size", "meter")

    def __init__(self, mem: Any, size: int, meter: Meter) -> None:
        self.mem, self.size, self.meter = mem, size, meter

    def __del__(self) -> None:
        self.meter.live -= self.size


@dataclass
class Row:
    model: str
    allocator: str
    ms_per_step: float = float("nan")
    allocs_per_step: float = float("nan")
    allocs_first_step: int = -1
    allocs_warm_up: tuple[int, ...] = ()
    peak_live: int = 0
    peak_reserved: int = 0
    error: str = ""
    note: str = ""


def _train_state(make: Callable, cache: Any, cupy: Any) -> tuple[Any, Any]:
    model, shape, classes = make()
    rng = np.random.default_rng(0)
    gpu = lx.CUDADevice(cupy.cuda.runtime.getDevice())
    ps, st = gpu(lx.setup(rng, model))
    batch = gpu((rng.standard_normal(shape).astype(np.float32), rng.integers(0, classes, shape[0])))
    kwargs = {} if cache == "default" else {"allocator_cache": cache}
    return lx.TrainState(model, ps, st, lx.optim.adam(1e-4), graphs=False, **kwargs), batch  # the allocator, eagerly


def _steps(ts: Any, batch: Any, n: int, sync: Callable[[], None]) -> Any:
    loss_fn, ad = lx.losses.CrossEntropyLoss(), lx.AutoTape()
    for _ in range(n):
        _, _, _, ts = lx.single_train_step_(ad, loss_fn, batch, ts)
    sync()
    return ts


def measure(name: str, make: Callable, allocator: str, steps: int, warmup: int, cupy: Any) -> Row:
    row = Row(name, allocator)
    sync = cupy.cuda.runtime.deviceSynchronize  # a training state's verbs run on a stream of its own
    cache = "default" if allocator == "luxnn cache" else None

    # Timing pass: the allocator as users have it.
    pool = cupy.cuda.MemoryPool()
    cupy.cuda.set_allocator(None if allocator == "no pool" else pool.malloc)
    ts, batch = _train_state(make, cache, cupy)
    ts = _steps(ts, batch, warmup, sync)
    t0 = time.perf_counter()
    ts = _steps(ts, batch, steps, sync)
    row.ms_per_step = (time.perf_counter() - t0) / steps * 1e3
    del ts, batch
    gc.collect()
    pool.free_all_blocks()

    # Memory pass: driver allocations counted under the same allocator.
    meter = Meter(cupy)
    used_peak = [0]
    if allocator == "CuPy pool":
        pool = cupy.cuda.MemoryPool(meter.malloc)

        def pool_malloc(size: int) -> Any:
            memptr = pool.malloc(size)
            used_peak[0] = max(used_peak[0], pool.used_bytes())
            return memptr

        cupy.cuda.set_allocator(pool_malloc)
    else:
        cupy.cuda.set_allocator(meter.malloc)
    ts, batch = _train_state(make, cache, cupy)
    lx_cache = ts.allocator_cache
    driver = (lambda: meter.count + lx_cache.stats().upstream_allocs) if lx_cache is not None else (lambda: meter.count)
    per_step = []
    for step in range(1 + warmup + steps):
        if step == 1 + warmup:  # the peaks of the steps after warm-up
            meter.reset_peak()
            used_peak[0] = pool.used_bytes() if allocator == "CuPy pool" else 0
            if lx_cache is not None:
                lx_cache.reset_peaks()
        before = driver()
        ts = _steps(ts, batch, 1, sync)
        per_step.append(driver() - before)
    row.allocs_first_step, row.allocs_warm_up = per_step[0], tuple(per_step[1:3])
    row.allocs_per_step = sum(per_step[3:]) / len(per_step[3:])  # from step 4 (docs/design.md's budget)
    if allocator == "no pool":
        row.peak_live = row.peak_reserved = meter.peak
    elif allocator == "CuPy pool":
        row.peak_live, row.peak_reserved = used_peak[0], meter.peak
    else:
        s = lx_cache.stats()
        row.peak_live, row.peak_reserved = s.peak_live + meter.peak, s.peak_reserved + meter.peak
        row.note = (
            f"driver allocations by step {per_step[:8]}...; plans {s.plans}, {s.plan_hits} of {s.hits} hits "
            f"planned, {s.plan_misses} plan misses, {meter.count} driver allocations outside the cache (the state and batch's included)"
        )
    del ts, batch, lx_cache
    gc.collect()
    pool.free_all_blocks()
    cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    return row


def _mib(n: int) -> str:
    return f"{n / 2**20:9.2f}"


def table(rows: list[Row], gpu_name: str) -> str:
    head = f"GPU training steps on {gpu_name} (float32, Adam; time per step after warm-up, driver allocations per step from the fourth)"
    lines = [
        head,
        "",
        f"{'model':<10} {'allocator':<12} {'ms/step':>9} {'driver allocs/step':>19} {'first step':>10} {'2nd/3rd':>8} "
        f"{'peak live MiB':>14} {'peak reserved MiB':>18} {'reserved/live':>13}",
    ]
    for r in rows:
        if r.error:
            lines.append(f"{r.model:<10} {r.allocator:<12} failed: {r.error}")
            continue
        lines.append(
            f"{r.model:<10} {r.allocator:<12} {r.ms_per_step:9.3f} {r.allocs_per_step:19.2f} {r.allocs_first_step:10d} "
            f"{'/'.join(map(str, r.allocs_warm_up)):>8} "
            f"{_mib(r.peak_live):>14} {_mib(r.peak_reserved):>18} {r.peak_reserved / max(r.peak_live, 1):13.2f}"
        )
    lines += [f"{r.model:<10} {r.allocator}: {r.note}" for r in rows if r.note]
    lines.append("")
    lines.append("ratios of (c) luxnn cache to (a) no pool and (b) CuPy pool: step time, peak reserved")
    by = {(r.model, r.allocator): r for r in rows if not r.error}
    for model in dict.fromkeys(r.model for r in rows):
        c, a, b = by.get((model, "luxnn cache")), by.get((model, "no pool")), by.get((model, "CuPy pool"))
        if c is None or a is None or b is None:
            lines.append(f"{model:<10} (incomplete)")
            continue
        lines.append(
            f"{model:<10} time c/a {c.ms_per_step / a.ms_per_step:5.2f}  c/b {c.ms_per_step / b.ms_per_step:5.2f}   "
            f"reserved c/a {c.peak_reserved / max(a.peak_reserved, 1):5.2f}  c/b {c.peak_reserved / max(b.peak_reserved, 1):5.2f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    if args.warmup < 2 or args.steps < 1:
        parser.error(f"expected --warmup of 2 steps or more and --steps of 1 or more, got {args.warmup} and {args.steps}")
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as err:
        print(f"gpu_step: needs CuPy and a CUDA GPU ({err})", file=sys.stderr)
        return 2
    gpu_name = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())["name"].decode()
    rows: list[Row] = []
    for name in args.models.split(","):
        make = MODELS[name]
        try:
            # Compile the step's kernels once, outside every measurement.
            _steps(*_train_state(make, None, cupy), 2, cupy.cuda.runtime.deviceSynchronize)
            for allocator in ("no pool", "CuPy pool", "luxnn cache"):
                rows.append(measure(name, make, allocator, args.steps, args.warmup, cupy))
                print(f"gpu_step: {name} / {allocator}: {rows[-1].ms_per_step:.3f} ms", file=sys.stderr, flush=True)
        except Exception as err:
            traceback.print_exc()
            rows.append(Row(name, "-", error=f"{type(err).__name__}: {err}".splitlines()[0][:160]))
        finally:
            cupy.cuda.set_allocator(cupy.get_default_memory_pool().malloc)
    print(table(rows, gpu_name))
    return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
