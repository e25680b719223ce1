"""The ``luxnn bench`` and ``luxnn compare`` commands (their arguments are parsed, and
those that parsing alone can check are checked, in `luxnn.cli`)."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from . import BenchError, suite
from .compare import compare, compare_files
from .runner import LocalWorker, report, run, this_side, timing_for


class ArgumentError(BenchError):
    """A bad argument, found before anything is measured or built (exit status 2)."""


def _write(path: str, document: dict[str, Any]) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(document, f, indent=1)
            f.write("\n")
    except OSError as e:
        raise BenchError(f"cannot write {path}: {e.strerror}") from None
    print(f"luxnn bench: wrote {path}", file=sys.stderr)


def base_path(path: str) -> str:
    """Where ``--against`` writes the revision's result next to `path`: ``r.json`` -> ``r.base.json``."""
    stem, ext = os.path.splitext(path)
    return f"{stem}.base{ext or '.json'}"


def _check_selection(selection: suite.Selection, pattern: str | None, names: list[str]) -> None:
    """A `--filter` that selects no row (of `names`, the suite's) is refused."""
    if selection.row_count == 0 and selection.unavailable:
        raise ArgumentError(f"argument --filter: {pattern!r} matches only rows whose peer is not installed: {', '.join(selection.unavailable)}")
    if selection.row_count == 0:
        raise ArgumentError(f"argument --filter: expected a pattern that matches a row, got {pattern!r}, which matches no row; the rows are: {', '.join(names)}")


def bench(quick: bool, pattern: str | None, json_path: str | None, rounds: int | None, against: str | None, markdown: bool,
          device: str = "cpu") -> int:
    """Run the suite (`pattern` a valid regular expression, `rounds` at least 1, `json_path`
    writable: `luxnn.cli` checks those) on `device` ("cpu" or "gpu"); `ArgumentError` for a
    filter that selects no row, a revision that does not exist, or no usable GPU."""
    if device == "gpu":
        return gpu_bench(quick, pattern, json_path, rounds, against, markdown)
    selection = suite.select(quick, pattern)
    _check_selection(selection, pattern, [v.name for g in suite.groups(quick) for v in g.variants] + [suite.TIME_TO_LOAD])
    timing = timing_for(quick, rounds)
    if against is not None:
        from .revision import Revision, run_against

        try:
            Revision(against)  # checks that the revision exists; building it is run_against's work
        except BenchError as e:
            raise ArgumentError(f"argument --against: {e}") from None

        base, new = run_against(against, selection, quick=quick, timing=timing, pattern=pattern)
        print(compare(base, new, markdown=markdown))
        if json_path is not None:
            _write(base_path(json_path), base)
            _write(json_path, new)
        return 0
    worker = LocalWorker(quick, timing)
    (document,) = run(selection, [this_side()], [worker], quick=quick, timing=timing, pattern=pattern)
    print(report(document, markdown=markdown))
    if json_path is not None:
        _write(json_path, document)
    return 0


def gpu_bench(quick: bool, pattern: str | None, json_path: str | None, rounds: int | None, against: str | None, markdown: bool) -> int:
    """`bench` on the GPU (`gpu`): its rows in this process, beside PyTorch's."""
    from . import gpu

    if against is not None:
        raise ArgumentError(f"argument --against: expected no revision with --device gpu (the GPU rows run in this process only), got {against!r}")
    problem = gpu.device_problem()
    if problem is not None:
        raise ArgumentError(f"--device gpu needs CuPy and a CUDA device: {problem}")
    selection = gpu.select(pattern)
    _check_selection(selection, pattern, gpu.row_names())
    timing = timing_for(quick, rounds)
    (document,) = run(selection, [this_side()], [gpu.GPUWorker(timing)], quick=quick, timing=timing, pattern=pattern)
    document["device"] = "gpu"
    print(gpu.report(document, markdown=markdown))
    if json_path is not None:
        _write(json_path, document)
    return 0


def compare_command(base: str, new: str, markdown: bool) -> int:
    try:
        text = compare_files(base, new, markdown=markdown)
    except BenchError as e:  # every error of compare is about its two files
        raise ArgumentError(str(e)) from None
    print(text)
    return 0
