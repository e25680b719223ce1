"""The benchmark suite's structure and the comparison's arithmetic (never speed)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from luxnn.bench import stats
from luxnn.cli import main

MS, US = 1e-3, 1e-6


def result(suite: str = "quick", rows: list | None = None) -> dict:
    return {
        "format": "luxnn-bench", "schema": 1, "suite": suite, "label": "test", "created": "2024-01-01T00:00:00+00:00",
        "machine": {"cpu": "Test CPU", "cpus_usable": 2, "load_average": [0.5, 0.5, 0.5], "load_average_end": [0.6, 0.5, 0.5]},
        "versions": {"luxnn": "0.1.0", "numpy": "2.0"}, "blas": [], "rows": rows or [],
    }  # fmt: skip


def row(name: str, times: list, memory: dict | None = None, kind: str = "step") -> dict:
    return {"name": name, "group": name, "kind": kind, "params": {}, "times": times, "inner": 1, "memory": memory, "error": None}


def mem(allocs: float, nbytes: float, upstream: float, peak_live: int, peak_reserved: int | None) -> dict:
    return {"calls": 1, "allocs": allocs, "bytes": nbytes, "upstream_allocs": upstream,
            "peak_live": peak_live, "peak_reserved": peak_reserved, "allocator": "cache"}  # fmt: skip


# Round medians of "a": base 2, 3, 3, 5 ms (median 3, quartiles 2.75 and 3.5: IQR 0.75),
# new 1.5 ms in every round (IQR 0): ratio 2, error 2 * 0.75 / 3 = 0.5, significant.
# "b": base 10, 12 us (median 11, IQR 1), new 11, 13 us (median 12, IQR 1): ratio 11/12,
# error 11/12 * sqrt((1/11)^2 + (1/12)^2) = 0.113, not significant.
BASE = result(rows=[
    row("time_to_load", [[0.30], [0.31], [0.29], [0.30], [0.30]], kind="load"),
    row("a", [[1 * MS, 2 * MS, 3 * MS], [3 * MS], [4 * MS, 2 * MS], [5 * MS]], mem(10, 2048, 0, 4096, 8192)),
    row("b", [[10 * US], [12 * US]], mem(3, 1536, 3, 1024, None)),
    row("c", [[1.0], [1.0]]),
])  # fmt: skip
NEW = result(rows=[
    row("a", [[1.5 * MS]] * 4, mem(5, 1024, 0, 2048, 4096)),
    row("b", [[11 * US], [13 * US]], mem(3, 1536, 3, 1024, None)),
    row("time_to_load", [[0.15], [0.15], [0.15], [0.15], [0.15]], kind="load"),
])  # fmt: skip


def write(path, doc) -> str:
    path.write_text(json.dumps(doc))
    return str(path)


def test_statistics():
    rounds = [[1.0, 2.0, 3.0], [3.0], [4.0, 2.0], [5.0]]
    medians = [2.0, 3.0, 3.0, 5.0]
    med, iqr = stats.summarize(rounds)
    assert med == 3.0
    assert iqr == pytest.approx(np.percentile(medians, 75) - np.percentile(medians, 25)) == pytest.approx(0.75)
    for q in (0.0, 0.1, 0.25, 0.5, 0.9, 1.0):
        xs = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
        assert stats.quantile(xs, q) == pytest.approx(np.percentile(xs, 100 * q))
    assert stats.summarize([[2.0]]) == (2.0, 0.0)
    r, err = stats.ratio(11.0, 1.0, 12.0, 1.0)
    assert r == pytest.approx(11 / 12)
    assert err == pytest.approx(11 / 12 * np.sqrt((1 / 11) ** 2 + (1 / 12) ** 2))
    assert stats.significance(2.0, 0.5) == "faster"
    assert stats.significance(0.5, 0.1) == "slower"
    assert stats.significance(r, err) == ""
    assert stats.significance(1.04, 0.001) == ""  # within 5 %
    assert stats.format_time(3 * MS, 0.75 * MS) == "3.00 ± 0.75 ms"
    assert stats.format_time(1.5, 0.0) == "1.50 ± 0 s"
    assert stats.format_time(950 * US, 221 * US) == "950 ± 220 μs"
    assert stats.format_allocs(10, 2048) == "10 allocs: 2.05 kB"


def test_compare_markdown(tmp_path, capsys):
    base, new = write(tmp_path / "base.json", BASE), write(tmp_path / "new.json", NEW)
    assert main(["compare", base, new, "--markdown"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    header = "| name | base | new | base / new |"
    assert lines.count(header) == 3  # time, memory, peaks
    start = lines.index(header)
    assert lines[start + 1] == "|:---|:---:|:---:|:---:|"
    assert lines[start + 2 : start + 6] == [
        "| a | 3.00 ± 0.75 ms | 1.50 ± 0 ms | **2.00 ± 0.50** faster |",
        "| b | 11.0 ± 1.0 μs | 12.0 ± 1.0 μs | 0.917 ± 0.11 |",
        "| c | 1.00 ± 0 s | — | — |",
        "| time_to_load | 300 ± 0 ms | 150 ± 0 ms | **2.00 ± 0** faster |",  # last, although first in BASE
    ]
    memory = lines.index(header, start + 1)
    assert lines[memory + 2 : memory + 4] == [
        "| a | 10 allocs: 2.05 kB | 5 allocs: 1.02 kB | 2.00 |",
        "| b | 3 allocs: 1.54 kB | 3 allocs: 1.54 kB | 1.00 |",
    ]
    peaks = lines.index(header, memory + 1)
    assert lines[peaks + 2 : peaks + 4] == [
        "| a | 4.10 kB / 8.19 kB, 0 upstream | 2.05 kB / 4.10 kB, 0 upstream | 2.00 |",
        "| b | 1.02 kB / —, 3 upstream | 1.02 kB / —, 3 upstream | 1.00 |",
    ]
    assert "- base: test (quick suite" in out and "Test CPU" in out


def test_compare_plain_text_is_aligned(tmp_path, capsys):
    assert main(["compare", write(tmp_path / "b.json", BASE), write(tmp_path / "n.json", NEW)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("|")]
    table = lines[: 2 + 4]
    assert [c.strip() for c in table[0].strip("|").split("|")] == ["name", "base", "new", "base / new"]
    assert len({len(line) for line in table}) == 1  # padded to equal widths
    assert "2.00 ± 0.50 faster" in table[2]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_the_busy_row_is_timed_beside_its_processes_and_the_quiet_row_alone(monkeypatch):
    from luxnn.bench import load, runner, suite

    opened, live_per_sample = [], []
    busy_processes, sample = load.busy_processes, runner.sample

    @contextlib.contextmanager
    def recording_processes(count):
        with busy_processes(count) as pids:
            opened.append(pids)
            yield pids

    def recording_sample(*args):
        live_per_sample.append(sum(_alive(pid) for pids in opened for pid in pids))
        return sample(*args)

    monkeypatch.setattr(load, "busy_processes", recording_processes)
    monkeypatch.setattr(runner, "sample", recording_sample)
    selection = suite.select(True, "training/autoencoder")
    timing = runner.timing_for(True, 2)
    (doc,) = runner.run(selection, [runner.this_side()], [runner.LocalWorker(True, timing)], quick=True, timing=timing, progress=False)
    quiet, busy = doc["rows"]
    assert (quiet["name"], busy["name"]) == ("training/autoencoder (quiet)", "training/autoencoder (2 busy processes)")
    assert quiet["error"] is None and busy["error"] is None and len(busy["times"]) == 2
    assert busy["params"]["busy_processes"] == 2 and busy["memory"] is None  # the quiet row's step: counted there
    assert sorted(live_per_sample) == [0, 0, 2, 2]  # each round: one sample quiet, one beside two processes
    assert len(opened) == 3 and not any(_alive(pid) for pids in opened for pid in pids)  # calibration, 2 rounds


def test_busy_processes_end_when_the_body_raises():
    from luxnn.bench.load import busy_processes

    with pytest.raises(KeyError):
        with busy_processes(2) as pids:
            assert len(set(pids)) == 2 and all(_alive(pid) for pid in pids)
            raise KeyError("the measured code failed")
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no such file"),
        ("{not json", "not valid JSON"),
        ('{"rows": []}', "not a luxnn bench result"),
        (json.dumps({**BASE, "schema": 99}), "schema 99"),
        (json.dumps({**BASE, "rows": [{"name": "a", "times": "fast"}]}), "malformed result, row 0"),
        (json.dumps({**BASE, "suite": "full"}), "results of different suites"),
        (json.dumps({**BASE, "rows": [row("z", [[1.0]])]}), "no row in common"),
    ],
)
def test_compare_bad_input(tmp_path, capsys, content, message):
    base = tmp_path / "base.json"
    if content is not None:
        base.write_text(content)
    assert main(["compare", str(base), write(tmp_path / "new.json", NEW)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.startswith("luxnn compare: ")


def test_bench_quick_basics_json(tmp_path, capsys):
    path = tmp_path / "r.json"
    assert main(["bench", "--quick", "--filter", "basics", "--rounds", "2", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(path.read_text())
    assert (doc["format"], doc["schema"], doc["suite"]) == ("luxnn-bench", 1, "quick")
    assert doc["config"]["rounds"] == 2 and doc["config"]["filter"] == "basics"
    assert {"cpu", "cpus_usable", "load_average", "load_average_end", "python"} <= set(doc["machine"])
    assert {"luxnn", "numpy", "luxnn_path"} <= set(doc["versions"])
    blas = [p for p in doc["blas"] if p["user_api"] == "blas"]
    assert blas and blas[0]["num_threads"] >= 1 and "architecture" in blas[0]  # threadpoolctl is a test dependency
    names = [r["name"] for r in doc["rows"]]
    assert names == [f"basics/{n}{s}" for n in ("dense", "conv", "MHA") for s in ("", " (first run)")]
    for r in doc["rows"]:
        assert r["error"] is None, r
        assert len(r["times"]) == 2 and all(len(rd) >= 1 and all(t > 0 for t in rd) for rd in r["times"])
        assert r["kind"] == ("first run" if "first run" in r["name"] else "step")
        if r["kind"] == "first run":
            assert all(len(rd) == 1 for rd in r["times"])
        m = r["memory"]
        assert m["allocs"] >= 1 and m["bytes"] >= 512 * m["allocs"] and m["peak_live"] > 0
        assert m["upstream_allocs"] == m["allocs"] and m["peak_reserved"] is None  # no cache: NumPy's allocator
    assert "basics/MHA (first run)" in out and "memory per call" in out
    # The file compares with itself: every ratio is exactly 1.
    assert main(["compare", str(path), str(path)]) == 0
    table = "\n".join(line for line in capsys.readouterr().out.splitlines() if line.startswith("|"))
    assert table.count("1.00 ± ") == 6 and "faster" not in table and "slower" not in table


def test_bench_memory_pass_counts_the_cache(tmp_path):
    """The memory figures of a cached training step: no upstream allocation after warm-up."""
    from luxnn.bench import runner, suite

    selection = suite.select(True, r"training/mlp \(cache (on|off)\)")
    worker = runner.LocalWorker(True, runner.timing_for(True, 1))
    (doc,) = runner.run(selection, [runner.this_side()], [worker], quick=True, timing=runner.timing_for(True, 1), progress=False)
    on, off = doc["rows"]
    assert (on["name"], off["name"]) == ("training/mlp (cache on)", "training/mlp (cache off)")
    assert on["memory"]["upstream_allocs"] == 0 and on["memory"]["peak_reserved"] >= on["memory"]["peak_live"]
    assert off["memory"]["upstream_allocs"] == off["memory"]["allocs"] > 0
    assert on["memory"]["allocs"] == off["memory"]["allocs"]


def test_bench_times_and_counts_the_bucketed_lm_once_every_length_is_planned(threads):
    """training/lm-buckets warms up its group's calls (4 lengths a call) before it is timed
    and counted: its memory pass sees planned steps, no upstream allocation (with the four
    calls of the other rows, it saw lengths not planned yet)."""
    from luxnn.bench import runner, suite

    threads(1)  # the plan's guarantee; two threads' figures are benchmarks/promises.py's
    selection = suite.select(True, r"training/lm-buckets \(cache on\)")
    (group, names, _), = selection.groups
    assert group.warmup_calls * 4 > 30 and names == ["training/lm-buckets (cache on)"]
    timing = runner.timing_for(True, 1)
    (doc,) = runner.run(selection, [runner.this_side()], [runner.LocalWorker(True, timing)], quick=True, timing=timing, progress=False)
    (row,) = doc["rows"]
    assert row["error"] is None and row["memory"]["upstream_allocs"] == 0 and row["memory"]["allocs"] > 4 * 100
    assert row["memory"]["peak_reserved"] <= 1.05 * row["memory"]["peak_live"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--filter", "no-such-row"], "matches no row"),
        (["--filter", "("], "not a regular expression"),
        (["--rounds", "0"], "argument --rounds: expected an integer of at least 1, got '0'"),
        (["--json", "/no/such/dir/r.json"], "no such directory"),
        (["--against", "no-such-revision-xyz"], "revision 'no-such-revision-xyz' does not exist"),
        (["--against", "--help"], "does not exist"),
    ],
)
def test_bench_bad_input(capsys, args, message):
    argv = ["bench", "--quick", "--filter", "basics/dense$", *args] if args[0] != "--filter" else ["bench", "--quick", *args]
    if args[0] == "--against" and args[1].startswith("-"):
        argv = ["bench", "--quick", f"--against={args[1]}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_against_a_revision_that_fails_to_build(tmp_path, monkeypatch, capsys):
    """A revision whose build fails: a clear message, and the temporary worktree is gone."""
    import luxnn

    repo = tmp_path / "repo"
    (repo / "src" / "luxnn").mkdir(parents=True)
    (repo / "src" / "luxnn" / "__init__.py").write_text("")
    (repo / "setup.py").write_text("raise SystemExit('this revision does not build')\n")

    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "broken")
    monkeypatch.setattr(luxnn, "__file__", str(repo / "src" / "luxnn" / "__init__.py"))
    assert main(["bench", "--quick", "--filter", "basics/dense$", "--against", "HEAD"]) == 1
    err = capsys.readouterr().err
    assert "failed to build" in err and "this revision does not build" in err and "Traceback" not in err
    listed = subprocess.run(["git", "-C", str(repo), "worktree", "list"], capture_output=True, text=True).stdout
    assert len(listed.strip().splitlines()) == 1  # only the main worktree is left


def _in_git_checkout() -> bool:
    import os

    import luxnn

    if shutil.which("git") is None:
        return False
    here = os.path.dirname(luxnn.__file__)
    return subprocess.run(["git", "-C", here, "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _in_git_checkout(), reason="needs luxnn imported from a git checkout")
def test_against_head(tmp_path, capsys):
    """The pull-request check end to end: HEAD built in a temporary worktree, both sides
    measured, the comparison printed, both results written, nothing left behind."""
    import luxnn

    repo = subprocess.run(["git", "-C", luxnn.__path__[0], "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip()
    path = tmp_path / "r.json"
    argv = ["bench", "--quick", "--filter", "basics/dense$", "--rounds", "2", "--against", "HEAD", "--json", str(path)]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "| name" in out and "base / new" in out
    assert any(line.startswith("| basics/dense ") for line in out.splitlines())
    base, new = json.loads((tmp_path / "r.base.json").read_text()), json.loads(path.read_text())
    assert base["label"].startswith("HEAD") and new["label"].endswith("(working tree)")
    assert new["versions"]["luxnn_path"] == luxnn.__path__[0]
    assert base["versions"]["luxnn_path"] != new["versions"]["luxnn_path"]
    for doc in (base, new):
        (only,) = doc["rows"]
        assert only["name"] == "basics/dense" and only["error"] is None and len(only["times"]) == 2
    # The run's own worktree is gone (other processes may add and remove theirs meanwhile).
    tree = os.path.dirname(os.path.dirname(base["versions"]["luxnn_path"].rstrip("/")))
    after = subprocess.run(["git", "-C", repo, "worktree", "list"], capture_output=True, text=True).stdout
    assert tree not in after and not os.path.exists(tree), (tree, after)


def test_compare_shows_failed_rows(tmp_path, capsys):
    """A row that failed on one side (e.g. a revision without the feature): 'error', no ratio."""
    failed = {**row("a", []), "error": "TypeError: no such argument", "memory": {"error": "TypeError: no such argument"}}
    new = result(rows=[failed, *NEW["rows"][1:]])
    assert main(["compare", write(tmp_path / "b.json", BASE), write(tmp_path / "n.json", new), "--markdown"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| a | 3.00 ± 0.75 ms | error | — |" in lines
    assert "| a | 10 allocs: 2.05 kB | error | — |" in lines
