"""``luxnn bench --against REV``: a git revision and the working tree, measured in one run.

The revision is checked out in a temporary ``git worktree`` and built there (C extension
included) with ``pip install --no-build-isolation --no-deps --target``. Both sides run the
working tree's suite (this package, copied under another name next to each side's luxnn),
so that only luxnn differs; each side is a worker process, and the driver runs their
rounds alternately (see `runner.run`). Everything temporary is removed afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import BenchError, suite
from .runner import Side, Timing, git_label, run

COPY = "_luxnn_bench"
"""The name the suite's copy is imported under in the workers."""


class ProcessWorker:
    """A `runner.LocalWorker` in a worker process of `side` (see `worker.serve`)."""

    def __init__(self, side: Side, quick: bool, timing: Timing) -> None:
        self.side = side
        self.log = tempfile.TemporaryFile("w+")
        command = [sys.executable, "-m", f"{side.package}.worker", "serve", "--timing", json.dumps(asdict(timing))]
        self.proc = subprocess.Popen(
            command + ["--quick"] * quick, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
            text=True, env=side.env(), cwd=tempfile.gettempdir(),
        )  # fmt: skip
        path = self.info()["versions"]["luxnn_path"]
        if os.path.realpath(path) != os.path.realpath(side.root):
            self.close()
            raise BenchError(f"{side.label}: the worker imported luxnn from {path}, not from {side.root}")

    def _stderr_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().strip().splitlines()
        return "\n".join(lines[-5:]) or "(no output)"

    def _call(self, op: str, *args: Any) -> Any:
        try:
            self.proc.stdin.write(json.dumps({"op": op, "args": list(args)}) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            code = self.proc.wait()
            raise BenchError(f"the worker for {self.side.label} stopped (exit code {code}):\n{self._stderr_tail()}")
        answer = json.loads(line)
        if "error" in answer:
            raise BenchError(f"{self.side.label}: {op} failed: {answer['error']}")
        return answer["ok"]

    def setup(self, group: str, names: list[str]) -> dict[str, Any]:
        return self._call("setup", group, names)

    def round(self, group: str, index: int) -> dict[str, list[float]]:
        return self._call("round", group, index)

    def memory(self, group: str) -> dict[str, Any]:
        return self._call("memory", group)

    def teardown(self, group: str) -> None:
        self._call("teardown", group)

    def info(self) -> dict[str, Any]:
        return self._call("info")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=30)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


class Revision:
    """A context manager: the revision `rev` of the repository holding the imported luxnn,
    checked out and built in a temporary directory; ``sides()`` gives (revision, working
    tree) for `runner.run`."""

    def __init__(self, rev: str, progress: bool = True) -> None:
        import luxnn

        self.rev, self.progress = rev, progress
        self.root = os.path.dirname(os.path.abspath(luxnn.__file__))
        top = _git(self.root, "rev-parse", "--show-toplevel")
        if top.returncode != 0:
            raise BenchError(f"--against needs luxnn imported from a git checkout; {self.root} is not in one")
        self.repo = top.stdout.strip()
        found = None if not rev.strip() or rev.startswith("-") else _git(self.repo, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
        if found is None or found.returncode != 0:
            raise BenchError(f"revision {rev!r} does not exist in {self.repo}")
        self.sha = found.stdout.strip()
        self.tmp: str | None = None

    def __enter__(self) -> Revision:
        self.tmp = tempfile.mkdtemp(prefix="luxnn-bench-")
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _build(self) -> None:
        assert self.tmp is not None
        tree, self.site = os.path.join(self.tmp, "tree"), os.path.join(self.tmp, "site")
        added = _git(self.repo, "worktree", "add", "--detach", tree, self.sha)
        if added.returncode != 0:
            raise BenchError(f"cannot check out {self.rev!r} in a worktree:\n{_tail(added.stderr)}")
        if self.progress:
            print(f"luxnn bench: building {self.rev} ({self.sha[:10]}) in {tree}", file=sys.stderr, flush=True)
        built = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-compile",
             "--disable-pip-version-check", "--quiet", "--target", self.site, tree],
            capture_output=True, text=True,
        )  # fmt: skip
        if built.returncode != 0 or not os.path.isdir(os.path.join(self.site, "luxnn")):
            raise BenchError(f"revision {self.rev!r} ({self.sha[:10]}) failed to build:\n{_tail(built.stdout + built.stderr)}")
        self.copy = os.path.join(self.tmp, "suite")
        shutil.copytree(Path(__file__).parent, os.path.join(self.copy, COPY), ignore=shutil.ignore_patterns("__pycache__"))

    def sides(self) -> tuple[Side, Side]:
        label = self.rev if self.sha.startswith(self.rev) else f"{self.rev} ({self.sha[:10]})"
        base = Side(label, (self.copy, self.site), COPY, os.path.join(self.site, "luxnn"))
        new = Side(f"{git_label(self.root)} (working tree)", (self.copy, os.path.dirname(self.root)), COPY, self.root)
        return base, new

    def __exit__(self, *exc: Any) -> None:
        if self.tmp is None:
            return
        tree = os.path.join(self.tmp, "tree")
        if os.path.isdir(tree):
            _git(self.repo, "worktree", "remove", "--force", tree)
        shutil.rmtree(self.tmp, ignore_errors=True)
        _git(self.repo, "worktree", "prune")
        self.tmp = None


def run_against(
    rev: str, selection: suite.Selection, *, quick: bool, timing: Timing, pattern: str | None, progress: bool = True
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(revision's result, working tree's result), measured in one interleaved run."""
    with Revision(rev, progress) as revision:
        sides = revision.sides()
        workers: list[ProcessWorker] = []
        try:
            for side in sides:
                workers.append(ProcessWorker(side, quick, timing))
            base, new = run(selection, sides, workers, quick=quick, timing=timing, pattern=pattern, progress=progress)
        finally:
            for w in workers:
                w.close()
    return base, new
