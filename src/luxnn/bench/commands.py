"""The ``luxnn bench`` and ``luxnn compare`` commands (their arguments are in `luxnn.cli`)."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

from . import BenchError, suite
from .compare import compare, compare_files
from .runner import LocalWorker, report, run, this_side, timing_for


def _json_target(path: str) -> str:
    """`path`, checked before anything is measured: its directory must exist."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise BenchError(f"--json {path}: no such directory {directory}")
    if os.path.isdir(path):
        raise BenchError(f"--json {path}: is a directory; give a file name")
    return path


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


def bench(quick: bool, pattern: str | None, json_path: str | None, rounds: int | None, against: str | None, markdown: bool) -> int:
    if rounds is not None and rounds < 1:
        raise BenchError(f"--rounds must be at least 1, got {rounds}")
    try:
        selection = suite.select(quick, pattern)
    except re.error as e:
        raise BenchError(f"--filter {pattern!r} is not a regular expression: {e}") from None
    if selection.row_count == 0 and selection.unavailable:
        raise BenchError(f"--filter {pattern!r} matches only rows whose peer is not installed: {', '.join(selection.unavailable)}")
    if selection.row_count == 0:
        names = [v.name for g in suite.groups(quick) for v in g.variants] + [suite.TIME_TO_LOAD]
        raise BenchError(f"--filter {pattern!r} matches no row; the rows are:\n  " + "\n  ".join(names))
    if json_path is not None:
        _json_target(json_path)
    timing = timing_for(quick, rounds)
    if against is not None:
        from .revision import run_against

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


def compare_command(base: str, new: str, markdown: bool) -> int:
    print(compare_files(base, new, markdown=markdown))
    return 0
