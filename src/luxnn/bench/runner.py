"""Running the suite: warm-up, interleaved rounds, the memory pass, the fresh-process rows
and the result document.

Time. A variant is warmed up (at least its group's `suite.Group.warmup_calls` calls, four
unless the group says more, and `Timing.warmup_s`), then calibrated:
a sample is the mean of `inner` calls, so that it lasts at least `min_sample_s` (the
basics take microseconds), and a round takes about `round_s`. The variants of a group are
timed in rounds, round r starting with variant r mod n, with a garbage collection before
each variant's round; ``luxnn bench --against`` also alternates which side goes first.

Memory, in a separate pass after the rounds so that counting never perturbs a timed
sample: after four warm-up calls (a cache's step plan, `luxnn.memory.plan`, is made from
the first two and serves from the third; the fourth releases what it replaced; a group of
varying shapes says how many it needs, `suite.Group.warmup_calls`), `memory_calls` calls
run under an `AllocCache` with a timeline. For a luxnn step with
its cache on that is the TrainState's cache itself (a new TrainState given a recording
cache); for every other NumPy variant it is a counting cache wrapped around each call. Per call: allocations (hits + misses), bytes (the blocks handed
out, i.e. each request rounded up to the cache's size bins: 512 B under 8 KiB, then less
than 6.25 % over), upstream allocations (with the cache on: blocks taken from the system;
without it every allocation reaches NumPy's default allocator), peak live bytes (the
step's working set) and peak reserved bytes (cache on only: live plus cached); with the
cache on, also the all-time peaks (since the cache was made: the warm-up's included).

The first-run rows and time_to_load run one fresh process per round.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from typing import Any, Callable, Sequence

from . import BenchError, load, machine, suite
from .stats import format_allocs, format_bytes, format_count, format_ratio, format_time, ratio, summarize

FORMAT, SCHEMA = "luxnn-bench", 1
ALLOC_EVENTS = ("hit", "upstream")


@dataclass(frozen=True)
class Timing:
    """How long each part of a measurement takes (see the module's docstring)."""

    rounds: int
    warmup_s: float
    round_s: float
    min_sample_s: float
    max_samples: int
    memory_calls: int
    fresh_timeout_s: float


QUICK = Timing(rounds=5, warmup_s=0.05, round_s=0.02, min_sample_s=2e-4, max_samples=20, memory_calls=1, fresh_timeout_s=120)
FULL = Timing(rounds=8, warmup_s=0.5, round_s=0.2, min_sample_s=1e-3, max_samples=50, memory_calls=3, fresh_timeout_s=600)


def timing_for(quick: bool, rounds: int | None = None) -> Timing:
    base = QUICK if quick else FULL
    return base if rounds is None else Timing(**{**asdict(base), "rounds": rounds})


# ---- timing a step ----------------------------------------------------------------------


def calibrate(step: Callable[[], Any], timing: Timing, warmup_calls: int = 2) -> tuple[int, int, float]:
    """Warm `step` up (at least `warmup_calls` calls and `Timing.warmup_s`); returns (calls
    per sample, samples per round, seconds per call)."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max(2, warmup_calls) or time.perf_counter() - start < timing.warmup_s:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    per_call = statistics.median(times[len(times) // 2 :])
    inner = max(1, math.ceil(timing.min_sample_s / per_call))
    samples = min(timing.max_samples, max(1, round(timing.round_s / (inner * per_call))))
    return inner, samples, per_call


def sample(step: Callable[[], Any], inner: int, samples: int, sync: Callable[[], Any] | None = None) -> list[float]:
    """`samples` timings of `inner` calls each, in seconds per call; `sync` (a GPU's): called
    after the calls of each sample, inside its time, so that it counts their device work."""
    out = []
    perf_counter = time.perf_counter
    for _ in range(samples):
        t0 = perf_counter()
        for _ in range(inner):
            step()
        if sync is not None:
            sync()
        out.append((perf_counter() - t0) / inner)
    return out


def interleaved_rounds(
    steps: dict[str, Callable[[], Any]], rounds: int, per_round: int, warmup: int = 5, settle_s: float = 0.05
) -> dict[str, list[float]]:
    """Seconds per call of each of `steps`, one sample per round, the steps taking turns
    within a round (the per-issue scripts in benchmarks/). Before each sample, a pause lets
    the previous step's worker threads (OpenBLAS, OpenMP) stop spinning, so that they do
    not compete with the next one; then untimed calls for `settle_s` (at least one), as a
    training loop's steps follow one another: after a pause, sleeping threads (luxnn's,
    after 2 ms idle) wake slowly for the first few calls, on a virtual machine especially."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            time.sleep(0.3)
            settled = time.perf_counter() + settle_s
            step()
            while time.perf_counter() < settled:
                step()
            samples[name] += sample(step, per_round, 1)
    return samples


# ---- counting memory ------------------------------------------------------------------


def count_memory(step: Callable[[], Any], cache: Any, *, own: bool, calls: int, warmup: int = 4) -> dict[str, Any]:
    """The memory figures per call of `step` (see the module's docstring). `cache` is a
    recording `AllocCache`: the step's own (`own`) or one to wrap around each call."""
    import numpy as np

    from luxnn import memory

    scope = contextlib.nullcontext if own else (lambda: memory.cached(cache))
    for _ in range(warmup):
        with scope():
            step()
    warm = cache.stats()  # the warm-up's peaks: the run's all-time peaks, with the calls'
    cache.reset_peaks()
    before = cache.stats()
    events = cache.timeline()
    mark = events["t"][-1] if len(events) else -math.inf
    for _ in range(calls):
        with scope():
            step()
    after = cache.stats()
    events = cache.timeline()
    capacity = getattr(getattr(memory, "cache", None), "TIMELINE_CAPACITY", 1 << 16)
    complete = len(events) < capacity or (len(events) and events["t"][0] <= mark)
    window = events[events["t"] > mark]
    nbytes = None
    if complete:
        live = np.concatenate([[before.bytes_live], window["live"]])
        nbytes = float(np.diff(live)[np.isin(window["kind"], ALLOC_EVENTS)].sum()) / calls
    allocs = (after.hits + after.misses - before.hits - before.misses) / calls
    return {
        "calls": calls,
        "allocs": allocs,
        "bytes": nbytes,
        "upstream_allocs": (after.upstream_allocs - before.upstream_allocs) / calls if own else allocs,
        "peak_live": after.peak_live,
        "peak_reserved": after.peak_reserved if own else None,
        "all_time_peak_live": max(warm.peak_live, after.peak_live) if own else None,
        "all_time_peak_reserved": max(warm.peak_reserved, after.peak_reserved) if own else None,
        "allocator": "cache" if own else "numpy default",
    }


def describe_error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class Session:
    """A group's selected variants, set up and calibrated in this process.

    A variant that fails to set up (e.g. another revision lacks a feature it uses) is
    reported as that row's error; the others run.
    """

    sync: Callable[[], Any] | None = None  # a device's synchronisation, ending each sample

    def __init__(self, group: suite.Group, names: Sequence[str], timing: Timing) -> None:
        self.group, self.timing = group, timing
        self.steps: dict[str, Callable[[], Any]] = {}
        self.plan: dict[str, tuple[int, int, float]] = {}
        self.errors: dict[str, str] = {}
        for name in names:
            try:
                step, self.plan[name] = self._setup(group.variant(name))
                self.steps[name] = step
            except Exception as e:  # noqa: BLE001 - any failure of the measured code is the row's result
                self.errors[name] = describe_error(e)

    def _setup(self, variant: suite.Variant) -> tuple[Callable[[], Any], tuple[int, int, float]]:
        """The variant's step, built and calibrated."""
        step = variant.build("default")
        with self._load(variant.name):
            return step, calibrate(step, self.timing, self.group.warmup_calls)

    def describe(self) -> dict[str, Any]:
        return {"plan": {n: list(p) for n, p in self.plan.items()}, "errors": self.errors}

    def round(self, index: int) -> dict[str, list[float]]:
        names = list(self.steps)
        if not names:
            return {}
        k = index % len(names)
        out = {}
        for name in names[k:] + names[:k]:
            gc.collect()
            with self._load(name):
                out[name] = sample(self.steps[name], *self.plan[name][:2], self.sync)
        return out

    def _load(self, name: str) -> contextlib.AbstractContextManager:
        """The busy processes `name` is timed beside, if any."""
        busy = self.group.variant(name).busy
        return load.busy_processes(busy) if busy else contextlib.nullcontext()

    def memory(self) -> dict[str, Any]:
        from luxnn import memory

        out: dict[str, Any] = {}
        for name, step in self.steps.items():
            variant = self.group.variant(name)
            if variant.memory is None:
                out[name] = None
                continue
            calls = self.timing.memory_calls if self.plan[name][2] < 0.5 else 1
            warmup = self.group.warmup_calls
            try:
                cache = memory.AllocCache(record=True)
                if variant.memory == "own":
                    out[name] = count_memory(variant.build(cache), cache, own=True, calls=calls, warmup=warmup)
                else:
                    out[name] = count_memory(step, cache, own=False, calls=calls, warmup=warmup)
            except Exception as e:  # noqa: BLE001 - reported in the row, as the time is
                out[name] = {"error": describe_error(e)}
        return out


class LocalWorker:
    """Runs groups in this process: `luxnn bench` without ``--against``, and the body of a
    worker process (`worker.serve`). Its methods take and return JSON-able values."""

    def __init__(self, quick: bool, timing: Timing) -> None:
        self.quick, self.timing = quick, timing
        self.sessions: dict[str, Session] = {}

    def setup(self, group: str, names: list[str]) -> dict[str, Any]:
        session = self.sessions[group] = self._session(group, names)
        return session.describe()

    def _session(self, group: str, names: list[str]) -> Session:
        """The group's `Session`, set up."""
        return Session(suite.find_group(group, self.quick), names, self.timing)

    def round(self, group: str, index: int) -> dict[str, list[float]]:
        return self.sessions[group].round(index)

    def memory(self, group: str) -> dict[str, Any]:
        return self.sessions[group].memory()

    def teardown(self, group: str) -> None:
        del self.sessions[group]
        gc.collect()

    def info(self) -> dict[str, Any]:
        return {"versions": machine.versions(), "blas": machine.blas()}

    def close(self) -> None:
        self.sessions.clear()


# ---- fresh processes ----------------------------------------------------------------------


def first_run(group_name: str, quick: bool, count: bool) -> dict[str, Any]:
    """In a fresh process: set the group's step up and time its first call, or (`count`)
    count the memory of its first call instead."""
    from luxnn import memory

    group = suite.find_group(group_name, quick)
    step = group.variants[0].build("default")
    if count:
        cache = memory.AllocCache(record=True)
        return {"memory": count_memory(step, cache, own=False, calls=1, warmup=0)}
    t0 = time.perf_counter()
    step()
    return {"time": time.perf_counter() - t0}


IMPORT_SNIPPET = (
    "import json, time; t0 = time.perf_counter(); import luxnn; t = time.perf_counter() - t0; "
    "print(json.dumps({'time': t, 'path': luxnn.__file__}))"
)


@dataclass(frozen=True)
class Side:
    """What one column of a comparison runs: `label`, `paths` put ahead on ``PYTHONPATH``
    (where its luxnn and the bench package are found), `package` (the bench package's
    name there) and `root`, the directory its luxnn must be imported from."""

    label: str
    paths: tuple[str, ...]
    package: str
    root: str

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*self.paths, *filter(None, [env.get("PYTHONPATH")])])
        return env

    def python(self, args: list[str], timeout: float) -> dict[str, Any]:
        """Run ``python ARGS`` in a fresh process; its last line of output is JSON."""
        try:
            done = subprocess.run(
                [sys.executable, *args], env=self.env(), cwd=tempfile.gettempdir(),
                capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        lines = done.stdout.strip().splitlines()
        if done.returncode == 0 and lines:
            try:
                return json.loads(lines[-1])
            except json.JSONDecodeError:
                pass
        tail = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}, output {done.stdout.strip()[-200:]!r}"]
        return {"error": tail[0]}

    def first_run(self, group: str, quick: bool, count: bool, timeout: float) -> dict[str, Any]:
        args = ["-m", f"{self.package}.worker", "first-run", group] + ["--quick"] * quick + ["--memory"] * count
        return self.python(args, timeout)

    def time_to_load(self, timeout: float) -> dict[str, Any]:
        out = self.python(["-c", IMPORT_SNIPPET], timeout)
        if "path" in out and not os.path.realpath(out["path"]).startswith(os.path.realpath(self.root) + os.sep):
            raise BenchError(f"{self.label}: `import luxnn` found {out['path']}, not the luxnn under {self.root}")
        return out


def this_side() -> Side:
    """The luxnn this process imports (the working tree, for an editable install)."""
    import luxnn

    root = os.path.dirname(luxnn.__file__)
    return Side(git_label(root), (os.path.dirname(root),), __package__, root)


def git_label(path: str) -> str:
    """``abc1234567`` (+ ``-dirty`` when tracked files changed) for a git checkout, else the version."""
    try:
        sha = subprocess.run(["git", "-C", path, "rev-parse", "--short=10", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", path, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        import luxnn

        return f"luxnn {luxnn.__version__}"
    return f"{sha}-dirty" if dirty else sha


# ---- the run ---------------------------------------------------------------------------


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _time_cell(row: dict[str, Any]) -> str:
    if row.get("error"):
        return "error"
    return format_time(*summarize(row["times"]))


def run(
    selection: suite.Selection,
    sides: Sequence[Side],
    workers: Sequence[Any],
    *,
    quick: bool,
    timing: Timing,
    pattern: str | None = None,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Measure the selected rows on every side, rounds interleaved across the sides;
    returns one result document per side. `workers[i]` runs the groups of `sides[i]`."""
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    start_machine = machine.machine()
    load, cpus = start_machine["load_average"], start_machine["cpus_usable"]
    if load and cpus and load[0] > cpus / 2:
        _log(progress, f"luxnn bench: warning: load average {load[0]:.2f} on {cpus} CPUs; other processes will add noise")
    rows: list[dict[str, dict[str, Any]]] = [{} for _ in sides]
    done, total = 0, selection.row_count

    def order(r: int) -> list[int]:
        return list(range(len(sides)))[:: 1 if r % 2 == 0 else -1]

    def announce(name: str) -> None:
        nonlocal done
        done += 1
        cells = "  ".join(f"{s.label}: {_time_cell(rows[i][name])}" for i, s in enumerate(sides)) if len(sides) > 1 else _time_cell(rows[0][name])
        _log(progress, f"[{done}/{total}] {name}  {cells}")

    for group, names, first in selection.groups:
        if names:
            t0 = time.perf_counter()
            plans = [w.setup(group.name, names) for w in workers]
            times = [{n: [] for n in names} for _ in sides]
            for r in range(timing.rounds):
                for i in order(r):
                    for name, samples in workers[i].round(group.name, r).items():
                        times[i][name].append(samples)
            memories = [w.memory(group.name) for w in workers]
            for w in workers:
                w.teardown(group.name)
            for i in range(len(sides)):
                for name in names:
                    plan = plans[i]["plan"].get(name)
                    rows[i][name] = {
                        "name": name, "group": group.name, "kind": "step", "params": group.params,
                        "times": times[i][name] if plan else [], "inner": plan[0] if plan else None,
                        "memory": memories[i].get(name), "error": plans[i]["errors"].get(name),
                    }  # fmt: skip
            for name in names:
                announce(name)
            _log(progress, f"      ({group.name}: {time.perf_counter() - t0:.0f} s)")
        if first:
            name = group.first_run
            results: list[list[dict]] = [[] for _ in sides]
            for r in range(timing.rounds):
                for i in order(r):
                    results[i].append(sides[i].first_run(group.name, quick, False, timing.fresh_timeout_s))
            for i, side in enumerate(sides):
                errors = [x["error"] for x in results[i] if "error" in x]
                counted = side.first_run(group.name, quick, True, timing.fresh_timeout_s)
                rows[i][name] = {
                    "name": name, "group": group.name, "kind": "first run", "params": group.params,
                    "times": [[x["time"]] for x in results[i] if "time" in x], "inner": 1,
                    "memory": counted.get("memory") or ({"error": counted["error"]} if "error" in counted else None),
                    "error": errors[0] if errors else None,
                }  # fmt: skip
            announce(name)
    if selection.time_to_load:
        results = [[] for _ in sides]
        for r in range(max(timing.rounds, suite.MIN_LOAD_ROUNDS)):
            for i in order(r):
                results[i].append(sides[i].time_to_load(timing.fresh_timeout_s))
        for i in range(len(sides)):
            errors = [x["error"] for x in results[i] if "error" in x]
            rows[i][suite.TIME_TO_LOAD] = {
                "name": suite.TIME_TO_LOAD, "group": suite.TIME_TO_LOAD, "kind": "load", "params": {},
                "times": [[x["time"]] for x in results[i] if "time" in x], "inner": 1, "memory": None,
                "error": errors[0] if errors else None,
            }  # fmt: skip
        announce(suite.TIME_TO_LOAD)

    end_machine = machine.machine()
    documents = []
    for i, (side, worker) in enumerate(zip(sides, workers)):
        info = worker.info()
        documents.append({
            "format": FORMAT, "schema": SCHEMA, "suite": "quick" if quick else "full",
            "label": side.label, "created": started, "command": ["luxnn", *sys.argv[1:]],
            "config": {"rounds": timing.rounds, "filter": pattern, "timing": asdict(timing)},
            "machine": {**start_machine, "load_average_end": end_machine["load_average"]},
            "versions": info["versions"], "blas": info["blas"], "environment": machine.environment(),
            "unavailable": list(selection.unavailable), "rows": list(rows[i].values()),
        })  # fmt: skip
    return documents


# ---- the table of one run ---------------------------------------------------------------


def report(document: dict[str, Any], *, markdown: bool = False) -> str:
    """The tables of one run: time (relative to the group's first row, luxnn with its
    cache on) and memory."""
    from .compare import render_table, header_lines

    rows = document["rows"]
    summaries = {r["name"]: summarize(r["times"]) for r in rows if r["times"] and not r.get("error")}
    reference: dict[str, str] = {}
    for r in rows:
        if r["kind"] == "step":
            reference.setdefault(r["group"], r["name"])
    time_rows, memory_rows = [], []
    for r in rows:
        name = r["name"]
        cell = "error: " + r["error"] if r.get("error") else format_time(*summaries[name]) if name in summaries else "—"
        ref = reference.get(r["group"]) if r["kind"] == "step" else None
        rel = ""
        if ref and ref != name and name in summaries and ref in summaries:
            rel = format_ratio(*ratio(*summaries[name], *summaries[ref]))
        time_rows.append([name, cell, rel])
        m = r.get("memory")
        if m and "error" in m:
            memory_rows.append([name, "error: " + m["error"], "", "", "", "", ""])
        elif m and m.get("bytes") is not None:
            reserved = "—" if m["peak_reserved"] is None else format_bytes(m["peak_reserved"])
            memory_rows.append([name, format_allocs(m["allocs"], m["bytes"]), format_count(m["upstream_allocs"]),
                                format_bytes(m["peak_live"]), reserved, _reserved_per_live(m, "peak_"),
                                _reserved_per_live(m, "all_time_peak_")])  # fmt: skip
    out = header_lines([("run", document)], markdown)
    out.append("")
    out.append(render_table(["name", "time", "time / first row of its group"], time_rows, markdown))
    if memory_rows:
        out.append("")
        headers = ["name", "memory per call", "upstream allocs per call", "peak live", "peak reserved", "reserved / live", "all-time reserved / live"]
        out.append(render_table(headers, memory_rows, markdown))
    return "\n".join(out)


def _reserved_per_live(m: dict[str, Any], prefix: str) -> str:
    # Peak reserved / peak live (cache on: once warm, or all-time with the warm-up).
    live, reserved = m.get(prefix + "live"), m.get(prefix + "reserved")
    return f"{reserved / live:.3f}" if live and reserved is not None else "—"
