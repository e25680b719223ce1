"""The caching allocator against NumPy's own allocator, side by side in one run.

    python benchmarks/allocator.py              # sections 1-3 (about 2 minutes on 2 cores)
    python benchmarks/allocator.py --section 1  # one of them
    python benchmarks/allocator.py --sweep      # 4: the bin rounding and evict_after choices
    python benchmarks/allocator.py --gpu        # 5: alloc+free on a GPU (needs CuPy and one)

1. alloc+free (np.empty + del) through the cache's handler and NumPy's default handler, at
   64 B (also inside a step, as in the training verbs), 1 MiB and 64 MiB, against the
   budget at 64 B; the cost of a scope's entry and exit (`cached`, and `step`, which the
   training verbs enter: it also marks the step for the plans), and of a planned step
   against the same arrays with the cache off. CPU time of the one thread, so that other
   processes' load adds little.
2. A large-activation MLP step (batch 4096, 256 -> 4096 -> 256, float32: 64 MiB hidden
   activations, forward and backward matmuls) and an elementwise-heavy step on 64 MiB
   arrays, cache on vs off, each configuration in a fresh process (so that peak RSS is its
   own), rounds interleaved; "off, glibc tuned" is the best plain-Python alternative:
   MALLOC_MMAP_THRESHOLD_ and MALLOC_TRIM_THRESHOLD_ raised so that freed memory stays in
   the heap.
3. A chain of 20 elementwise ops on 32 MiB arrays whose temporaries die at once: our peak
   reserved vs the sum of the allocations, which is what a pinning cache (GPUArrays'
   AllocCache) holds.
4. (--sweep) A model of exact-bin reuse (the core's bins and eviction policy, without the
   splitting of blocks above 64 KiB) on a fixed-shape and a variable-length workload; its
   "real core misses" column is the real core, splitting included, so the two columns
   differ by what splitting saves.
5. (--gpu) alloc+free of device memory (``cupy.cuda.alloc`` + del, and ``cupy.empty`` + del
   at 512 B) through CuPy's default memory pool and through the cache's C hook (a
   `cached` scope on the `CUDADevice`), at 512 B, 64 KiB, 1 MiB and 64 MiB: host CPU time
   per pair (neither launches work on the device).

Times are medians over rounds; lower is better.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections import defaultdict

import numpy as np

from luxnn import memory

MiB = 1 << 20


def blas_info() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl not installed)"
    infos = [i for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(
        f"{i.get('internal_api')} {i.get('version')} {i.get('architecture')} "
        f"({i.get('num_threads')} threads)"
        for i in infos
    ) or "none found"


# ---- 1. alloc + free --------------------------------------------------------------------

# The issue's budget for the handler: alloc+free of a small array (64 B) through the cache
# costs at most this much more than through NumPy's default handler (which keeps small
# blocks in buckets of its own).
BUDGET_64B_NS = 20


def cpu_ns() -> int:
    # CPU time of this thread: a round preempted by another process's work costs nothing
    # here, and every timed loop below runs on this thread alone.
    return time.thread_time_ns()


def alloc_free_ns(nbytes: int, reps: int) -> float:
    empty, uint8 = np.empty, np.uint8
    t = cpu_ns()
    for _ in range(reps):
        a = empty(nbytes, uint8)
        del a
    return (cpu_ns() - t) / reps


def scope_ns(open_scope, reps: int, nbytes: int = 0, count: int = 0) -> float:
    """A scope's entry and exit, with `count` arrays of `nbytes` made and freed inside."""
    empty, uint8, arrays = np.empty, np.uint8, range(count)
    t = cpu_ns()
    for _ in range(reps):
        with open_scope():
            for _ in arrays:
                a = empty(nbytes, uint8)
                del a
    return (cpu_ns() - t) / reps


def section_alloc_free(rounds: int) -> None:
    print(f"\n1. alloc+free (np.empty + del), ns of CPU time per pair, median of {rounds} interleaved rounds")
    print(f"   {'size':>16} {'NumPy default':>14} {'cache':>10} {'cache - default':>16}")
    cache = memory.AllocCache()
    rows = (
        ("64 B", 64, 200_000, memory.cached), ("64 B in a step", 64, 200_000, memory.step),
        ("1 MiB", MiB, 20_000, memory.cached), ("64 MiB", 64 * MiB, 2_000, memory.cached),
    )  # fmt: skip
    small = None
    for label, nbytes, reps, scope in rows:
        default, ours = [], []
        for _ in range(rounds):
            default.append(alloc_free_ns(nbytes, reps))
            with scope(cache):  # one scope (one step) around the whole round
                ours.append(alloc_free_ns(nbytes, reps))
        d, o = statistics.median(default), statistics.median(ours)
        small = o - d if small is None else small
        print(f"   {label:>16} {d:14.0f} {o:10.0f} {o - d:+16.0f}")
    verdict = "within" if small <= BUDGET_64B_NS else "OVER"
    print(f"   64 B: cache - default = {small:+.0f} ns, {verdict} the budget of +{BUDGET_64B_NS} ns")

    # A step's own cost: its scope, and its end's record of its requests (which the plan
    # made from the steps before serves), against the same requests with the cache
    # off, as a training verb runs them (cached(None) is its scope then).
    planned = memory.AllocCache()
    for _ in range(8):  # the warm-up and the plan
        scope_ns(lambda: memory.step(planned), 1, 128 << 10, 8)
    print(f"   scope entry + exit, ns of CPU time, median of {rounds} rounds")
    print(f"   {'scope':>44} {'ns':>8}")
    scopes = (
        ("cached(None): a verb's scope, cache off", lambda: memory.cached(None), 0, 0),
        ("cached(cache)", lambda: memory.cached(cache), 0, 0),
        ("step(cache)", lambda: memory.step(cache), 0, 0),
        ("cached(None), 8 arrays of 128 KiB", lambda: memory.cached(None), 128 << 10, 8),
        ("step(cache), 8 arrays of 128 KiB, planned", lambda: memory.step(planned), 128 << 10, 8),
    )  # fmt: skip
    times = {label: [] for label, *_ in scopes}
    before = planned.stats()
    for _ in range(rounds):
        for label, open_scope, nbytes, count in scopes:
            times[label].append(scope_ns(open_scope, 20_000, nbytes, count))
    for label, *_ in scopes:
        print(f"   {label:>44} {statistics.median(times[label]):8.0f}")
    after = planned.stats()
    print(f"   (the planned steps: {after.plan_hits - before.plan_hits} arrays at their planned place, "
          f"{after.plan_misses - before.plan_misses} plan misses, {after.upstream_allocs - before.upstream_allocs} upstream)")


# ---- 5. alloc + free on the GPU -------------------------------------------------------------


def section_gpu(rounds: int, cupy: object, cache: memory.AllocCache) -> None:
    """Section 5 with `cupy` (the module) and a cache on its current device."""
    print(f"\n5. alloc+free of device memory, ns of CPU time per pair, median of {rounds} interleaved rounds")
    print(f"   {'request':>24} {'CuPy pool':>10} {'cache':>10} {'cache / pool':>13}")
    pool = cupy.cuda.MemoryPool()
    alloc, empty, uint8 = cupy.cuda.alloc, cupy.empty, cupy.uint8

    def pairs(make, nbytes: int, reps: int) -> float:
        t = cpu_ns()
        for _ in range(reps):
            a = make(nbytes)
            del a
        return (cpu_ns() - t) / reps

    rows = (
        ("cuda.alloc 512 B", alloc, 512, 100_000), ("cupy.empty 512 B", lambda n: empty(n, uint8), 512, 50_000),
        ("cuda.alloc 64 KiB", alloc, 64 << 10, 100_000), ("cuda.alloc 1 MiB", alloc, MiB, 20_000),
        ("cuda.alloc 64 MiB", alloc, 64 * MiB, 2_000),
    )  # fmt: skip
    for label, make, nbytes, reps in rows:
        theirs, ours = [], []
        for _ in range(rounds):
            with cupy.cuda.using_allocator(pool.malloc):
                pairs(make, nbytes, 10)  # the block is cached from here on
                theirs.append(pairs(make, nbytes, reps))
            with memory.cached(cache):
                pairs(make, nbytes, 10)
                ours.append(pairs(make, nbytes, reps))
        t, o = statistics.median(theirs), statistics.median(ours)
        print(f"   {label:>24} {t:10.0f} {o:10.0f} {o / t:13.2f}")
    pool.free_all_blocks()
    stats = cache.stats()
    print(f"   (the cache: {stats.hits} hits, {stats.upstream_allocs} driver allocations)")


def gpu_section(rounds: int) -> None:
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no CUDA device")
    except Exception as err:  # CuPy missing, or no driver
        print(f"\n5. alloc+free on the GPU: skipped, it needs CuPy and a CUDA GPU ({err})")
        return
    from luxnn import CUDADevice

    section_gpu(rounds, cupy, memory.AllocCache(CUDADevice(cupy.cuda.runtime.getDevice())))


# ---- 2. training-like steps, one process per configuration --------------------------------


def mlp_step(x, w1, w2):
    """Forward and backward of relu(x @ w1) @ w2 with a squared loss."""
    h = x @ w1
    a = np.maximum(h, 0)
    y = a @ w2
    g = y * (2.0 / y.size)
    gw2 = a.T @ g
    ga = g @ w2.T
    ga *= h > 0
    gw1 = x.T @ ga
    return float((y * y).mean()), gw1, gw2


def elementwise_step(x):
    y = np.tanh(x)
    z = y * y + x
    w = np.exp(-z)
    v = w * x - y
    return float(np.abs(v).sum())


def worker(step_name: str, mode: str, steps: int) -> dict:
    rng = np.random.default_rng(0)
    if step_name == "mlp":
        x = rng.standard_normal((4096, 256), dtype=np.float32)
        w1 = rng.standard_normal((256, 4096), dtype=np.float32) * 0.05
        w2 = rng.standard_normal((4096, 256), dtype=np.float32) * 0.05

        def step():
            return mlp_step(x, w1, w2)

    else:
        x = rng.standard_normal((4096, 4096), dtype=np.float32)

        def step():
            return elementwise_step(x)

    cache = memory.AllocCache() if mode == "cache" else None
    with memory.cached(cache):
        step()  # the first step: allocations reach the system
    times, faults = [], []
    upstream_before = cache.stats().upstream_allocs if cache else 0
    for _ in range(steps):
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter()
        with memory.cached(cache):
            step()
        times.append(time.perf_counter() - t0)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {
        "time": statistics.median(times),
        "faults": statistics.median(faults),
        "upstream": (cache.stats().upstream_allocs - upstream_before) / steps if cache else None,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


GLIBC_TUNED = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
CONFIGS = (("cache on", "cache", {}), ("cache off", "off", {}), ("off, glibc tuned", "off", GLIBC_TUNED))


def run_worker(step_name: str, mode: str, env_extra: dict, steps: int) -> dict:
    env = {**os.environ, **env_extra}
    out = subprocess.run(
        [sys.executable, __file__, "--worker", step_name, mode, str(steps)],
        env=env, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return json.loads(out.stdout)


def section_steps(rounds: int, steps: int) -> None:
    print(f"\n2. training-like steps: median over {rounds} interleaved rounds of {steps} steps after the first")
    print(f"   {'step':<12} {'allocator':<17} {'ms/step':>8} {'vs off':>7} {'faults/step':>12} "
          f"{'upstream/step':>14} {'peak RSS':>10} {'vs off':>7}")  # fmt: skip
    for step_name, title in (("mlp", "MLP 64 MiB"), ("elementwise", "elementwise")):
        results = defaultdict(list)
        for r in range(rounds):
            order = CONFIGS[r % 3 :] + CONFIGS[: r % 3]
            for label, mode, env in order:
                results[label].append(run_worker(step_name, mode, env, steps))
        med = {
            label: {k: statistics.median(x[k] for x in runs) if runs[0][k] is not None else None for k in runs[0]}
            for label, runs in results.items()
        }
        off = med["cache off"]
        for label, _, _ in CONFIGS:
            m = med[label]
            upstream = "-" if m["upstream"] is None else f"{m['upstream']:.1f}"
            print(f"   {title:<12} {label:<17} {1e3 * m['time']:8.1f} {m['time'] / off['time']:7.3f} "
                  f"{m['faults']:12.0f} {upstream:>14} {m['peak_rss'] / MiB:7.0f} MiB "
                  f"{m['peak_rss'] / off['peak_rss']:6.3f}")  # fmt: skip


# ---- 3. temporaries that die early ----------------------------------------------------------


def section_chain() -> None:
    cache = memory.AllocCache()
    x0 = np.random.default_rng(0).standard_normal(32 * MiB // 8)  # 32 MiB
    with memory.cached(cache) as scope:
        x = x0
        for _ in range(20):
            x = np.sin(x)  # the previous temporary dies here
        del x
    total = 20 * x0.nbytes
    s = scope.stats
    print("\n3. a chain of 20 elementwise ops on 32 MiB arrays")
    print(f"   sum of allocations (a pinning cache holds this): {total / MiB:.0f} MiB")
    print(f"   our peak reserved: {s.peak_reserved / MiB:.0f} MiB ({s.peak_reserved / total:.3f} of it), "
          f"peak live {s.peak_live / MiB:.0f} MiB, upstream allocations {s.upstream_allocs}")  # fmt: skip


# ---- 4. the choices: bin rounding and evict_after ------------------------------------------


def model_bin_size(n: int, div_log2: int) -> int:
    """bin_bytes(bin_of(n)) of the core's csrc/bins.h with 2**div_log2 classes per power of two."""
    m, quantum_log2 = max(n, 1) - 1, 9
    if m < 1 << (quantum_log2 + div_log2):
        return ((m >> quantum_log2) + 1) << quantum_log2
    k = m.bit_length() - 1
    step = 1 << (k - div_log2)
    return (1 << k) + ((m - (1 << k)) // step + 1) * step


def model_cache(workload: list[list[int]], div_log2: int, evict_after: float) -> dict:
    """The core's policy on steps whose requests all live until the step (scope) ends."""
    free: dict[int, int] = defaultdict(int)
    last_used: dict[int, int] = {}
    reserved = peak_reserved = peak_requested = misses = requests = 0
    for clock, sizes in enumerate(workload, 1):
        requested = 0
        for n in sizes:
            b = model_bin_size(n, div_log2)
            last_used[b] = clock
            requests += 1
            if free[b]:
                free[b] -= 1
            else:
                misses += 1
                reserved += b
            requested += n
            peak_requested = max(peak_requested, requested)
            peak_reserved = max(peak_reserved, reserved)
        for n in sizes:
            free[model_bin_size(n, div_log2)] += 1
        for b in free:
            if free[b] and clock - last_used[b] >= evict_after:
                reserved -= free[b] * b
                free[b] = 0
    return {"misses": misses, "requests": requests, "ratio": peak_reserved / peak_requested}


def variable_length_workload(steps: int = 300) -> list[list[int]]:
    """Attention-like steps, batch 16, 8 heads, width 256, sequence length drawn from
    32..512, and a short last batch (5) every 25 steps, like an epoch's end."""
    rng = np.random.default_rng(0)
    work = []
    for i in range(steps):
        batch, length = (5 if i % 25 == 24 else 16), int(rng.integers(32, 513))
        act, scores = batch * length * 256 * 4, batch * 8 * length * length * 4
        work.append([act, act, scores, scores, act, act, batch * length * 4])
    return work


def fixed_workload(steps: int = 50) -> list[list[int]]:
    """An MLP step with shapes that are not powers of two: batch 1000, 784 -> 3000 -> 10."""
    f = 4
    sizes = [1000 * 3000 * f] * 4 + [1000 * 10 * f] * 3 + [784 * 3000 * f, 3000 * f, 3000 * 10 * f, 10 * f]
    return [sizes] * steps


def real_cache(workload: list[list[int]], evict_after: int) -> int:
    """Upstream allocations of the real core (built rounding) on the same requests."""
    cache = memory.AllocCache(evict_after=evict_after)
    for sizes in workload:
        with memory.cached(cache):
            held = [np.empty(n, np.uint8) for n in sizes]
            del held
    return cache.stats().upstream_allocs


def section_sweep() -> None:
    var, fixed = variable_length_workload(), fixed_workload()
    built = int(np.log2(memory._core.BIN_DIVISIONS))
    print("\n4a. bin rounding: classes per power of two (evict_after = default "
          f"{memory.DEFAULT_EVICT_AFTER}); peak reserved / peak requested, misses")  # fmt: skip
    print(f"   {'classes':>8} {'fixed: ratio':>13} {'variable: ratio':>16} {'misses':>8} {'hit rate':>9}")
    for div_log2 in (2, 3, 4, 5, 6):
        f = model_cache(fixed, div_log2, memory.DEFAULT_EVICT_AFTER)
        v = model_cache(var, div_log2, memory.DEFAULT_EVICT_AFTER)
        mark = "  <- built" if div_log2 == built else ""
        print(f"   {1 << div_log2:>8} {f['ratio']:13.3f} {v['ratio']:16.3f} {v['misses']:8d} "
              f"{1 - v['misses'] / v['requests']:9.3f}{mark}")  # fmt: skip
    print(f"\n4b. evict_after (scopes), {1 << built} classes, variable-length workload, "
          f"{len(var)} steps of {len(var[0])} requests")  # fmt: skip
    print(f"   {'evict_after':>11} {'peak reserved / requested':>26} {'misses':>8} {'real core misses':>17}")
    for evict_after in (1, 2, 4, 8, 16, 32, 64, 10**9):
        v = model_cache(var, built, evict_after)
        real = real_cache(var, evict_after) if evict_after in (2, memory.DEFAULT_EVICT_AFTER) else None
        label = "never" if evict_after == 10**9 else str(evict_after)
        print(f"   {label:>11} {v['ratio']:26.3f} {v['misses']:8d} {'' if real is None else real:>17}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="steps per round after the first (default 4)")
    parser.add_argument("--section", type=int, choices=(1, 2, 3), help="only this section")
    parser.add_argument("--sweep", action="store_true", help="only section 4, the policy choices")
    parser.add_argument("--gpu", action="store_true", help="only section 5, alloc+free on a GPU")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        step_name, mode, steps = args.worker
        print(json.dumps(worker(step_name, mode, int(steps))))
        return
    print(f"numpy {np.__version__}, BLAS: {blas_info()}, {os.cpu_count()} CPUs, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}")  # fmt: skip
    if args.sweep:
        section_sweep()
        return
    if args.gpu:
        gpu_section(args.rounds)
        return
    sections = {1: lambda: section_alloc_free(args.rounds), 2: lambda: section_steps(args.rounds, args.steps), 3: section_chain}
    for number, section in sections.items():
        if args.section in (None, number):
            section()


if __name__ == "__main__":
    main()
