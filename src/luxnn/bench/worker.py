"""The suite's worker process.

    python -m luxnn.bench.worker serve [--quick] --timing JSON
    python -m luxnn.bench.worker first-run GROUP [--quick] [--memory]

``serve`` reads one JSON request per line on stdin, ``{"op": "setup" | "round" | "memory"
| "teardown" | "info", "args": [...]}``, calls `runner.LocalWorker`'s method of that name
and answers one JSON line, ``{"ok": result}`` or ``{"error": message}``. ``first-run``
prints one JSON line (see `runner.first_run`). Either way the JSON goes to the original
stdout and anything else the measured code prints goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from .runner import LocalWorker, Timing, first_run


def _protocol_stream() -> TextIO:
    """The original stdout, for JSON only; file descriptor 1 then points at stderr."""
    stream = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    return stream


def serve(worker: LocalWorker, requests: TextIO, answers: TextIO) -> None:
    ops = {"setup", "round", "memory", "teardown", "info"}
    for line in requests:
        request = json.loads(line)
        if request["op"] == "exit":
            break
        if request["op"] not in ops:
            answer = {"error": f"unknown op {request['op']!r}"}
        else:
            try:
                answer = {"ok": getattr(worker, request["op"])(*request.get("args", []))}
            except Exception as e:  # noqa: BLE001 - the driver reports it with the side's name
                answer = {"error": f"{type(e).__name__}: {e}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker")
    commands = parser.add_subparsers(dest="command", required=True)
    serve_cmd = commands.add_parser("serve")
    serve_cmd.add_argument("--quick", action="store_true")
    serve_cmd.add_argument("--timing", required=True)
    first = commands.add_parser("first-run")
    first.add_argument("group")
    first.add_argument("--quick", action="store_true")
    first.add_argument("--memory", action="store_true")
    args = parser.parse_args(argv)
    out = _protocol_stream()
    if args.command == "serve":
        serve(LocalWorker(args.quick, Timing(**json.loads(args.timing))), sys.stdin, out)
    else:
        out.write(json.dumps(first_run(args.group, args.quick, args.memory)) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
