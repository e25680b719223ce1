"""The `luxnn` command: ``luxnn demo``, ``luxnn bench``, ``luxnn compare``.

Every argument is checked before any work starts; a bad one gets one line on stderr naming
the argument, what was expected and what came, and exit status 2 (argparse's convention).

>>> parser().parse_args(["demo", "--lr", "1e-2", "--epochs", "3"]).lr
0.01
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (its usage block is what --help is for)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


class _BadArgument(Exception):
    """An argument found bad after parsing (it needs the data, a GPU, a library)."""


def _integer(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"expected an integer of at least {low}, got {text!r}")
        return value

    return parse


def _learning_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def _output_file(text: str) -> str:
    """A path that a file can be written to: its directory exists and is writable."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file name, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a file name, got the directory {text!r}")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"expected a file in an existing directory, got {text!r}: no such directory {directory}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"expected a file in a writable directory, got {text!r}: cannot write into {directory}")
    return text


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"expected a regular expression, got {text!r}, which is not a regular expression: {e}") from None
    return text


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("luxnn")
    except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
        from . import __version__

        return f"{__version__} (not installed)"


# ---- luxnn demo ---------------------------------------------------------------------------


def _check_demo(args: argparse.Namespace) -> None:
    """What parsing alone cannot check: the batch against the data, the GPU, matplotlib."""
    from . import demo

    (_, train_labels), _ = demo.load_digits(args.seed)
    if args.batch_size > len(train_labels):
        raise _BadArgument(
            f"argument --batch-size: expected at most {len(train_labels)} (the demo's training images; every batch is full), "
            f"got {args.batch_size}"
        )
    if args.workers > 1:
        from .distributed.launch import missing

        if missing():
            raise _BadArgument(f"argument --workers: {missing()}")
        if args.batch_size % args.workers:
            raise _BadArgument(f"argument --batch-size: expected a multiple of --workers {args.workers} (each rank's share), got {args.batch_size}")
    if args.device == "gpu":
        from .devices import gpu_device

        try:
            gpu_device(force=True)
        except RuntimeError as e:
            raise _BadArgument(f"argument --device: expected a usable CUDA GPU for 'gpu', got none ({e.__cause__ or e})") from None
    if args.memory_plot:
        try:
            from matplotlib.backend_bases import FigureCanvasBase
        except ImportError as e:
            raise _BadArgument(f"argument --memory-plot: needs matplotlib, which does not import ({e}): pip install 'luxnn[plot]'") from None
        extension = os.path.splitext(args.memory_plot)[1].lstrip(".").lower()
        formats = FigureCanvasBase.get_supported_filetypes()
        if extension and extension not in formats:
            raise _BadArgument(f"argument --memory-plot: expected a file name ending in one of {sorted(formats)}, got {args.memory_plot!r}")


def _demo(args: argparse.Namespace) -> int:
    from .demo import report, run

    _check_demo(args)
    options = dict(
        epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
        memory_plot=args.memory_plot, progress=not args.no_progress, device=args.device,
    )  # fmt: skip
    if args.workers > 1:
        from .distributed.launch import run_demo

        return run_demo(args.workers, {"model_name": args.model, **options})
    print(report(run(args.model, **options)))
    return 0


# ---- luxnn bench, luxnn compare -----------------------------------------------------------


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchError, commands

    try:
        if args.command == "compare":
            return commands.compare_command(args.base, args.new, args.markdown)
        return commands.bench(args.quick, args.filter, args.json, args.rounds, args.against, args.markdown, args.device)
    except commands.ArgumentError as e:
        raise _BadArgument(str(e)) from None
    except BenchError as e:
        print(f"luxnn {args.command}: {e}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    root = _Parser(prog="luxnn", description="luxnn: explicit-state neural networks on NumPy and CuPy")
    root.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    commands = root.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small network on the bundled 8x8 digits")
    demo.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    demo.add_argument("--epochs", type=_integer(1), default=30)
    demo.add_argument("--batch-size", type=_integer(1), default=64, help="images per step, at most the training set (every batch is full)")
    demo.add_argument("--lr", type=_learning_rate, default=3e-3, help="Adam's learning rate (finite, above 0)")
    demo.add_argument("--seed", type=_integer(0), default=0)
    demo.add_argument("--memory-plot", metavar="PATH", type=_output_file, help="draw the allocator cache's timeline to PATH (PNG; another extension picks another format)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="train on the CPU or on a CUDA GPU (CuPy)")
    demo.add_argument("--workers", type=_integer(1), default=1, metavar="N", help="train data-parallel on N ranks through mpiexec (pip install 'luxnn[mpi]')")
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="run the benchmark suite (see BENCHMARKS.md)")
    bench.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (under 2 minutes)")
    bench.add_argument("--filter", metavar="REGEX", type=_regex, help="only the rows whose names match REGEX")
    bench.add_argument("--json", metavar="PATH", type=_output_file, help="write every sample, the machine and the versions to PATH")
    bench.add_argument("--rounds", type=_integer(1), metavar="N", help="rounds per row (default 5 quick, 8 full)")
    bench.add_argument("--against", metavar="REV", help="also build git revision REV and print the comparison")
    bench.add_argument("--markdown", action="store_true", help="print markdown tables")
    bench.add_argument("--device", choices=("cpu", "gpu"), default="cpu",
                       help="the CPU suite, or the training rows and basics on a CUDA GPU beside PyTorch's (CuPy)")
    bench.set_defaults(run=_bench)
    compare = commands.add_parser("compare", help="compare two `luxnn bench --json` results")
    compare.add_argument("base", metavar="BASE.json")
    compare.add_argument("new", metavar="NEW.json")
    compare.add_argument("--markdown", action="store_true", help="print markdown tables")
    compare.set_defaults(run=_bench)
    return root


def main(argv: list[str] | None = None) -> int:
    """Run the command `argv` (default: ``sys.argv[1:]``); returns its exit status."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as e:  # --help, --version, or a bad argument (already on stderr)
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.run(args)
    except _BadArgument as e:
        print(f"luxnn {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"luxnn {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
