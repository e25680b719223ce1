"""The `luxnn` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import report, run

    if args.memory_plot:
        try:
            import matplotlib  # noqa: F401 - checked before training, not after it
        except ImportError:
            print("luxnn demo: --memory-plot needs matplotlib: pip install 'luxnn[plot]'", file=sys.stderr)
            return 2
    figures = run(
        args.model, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr,
        seed=args.seed, memory_plot=args.memory_plot, progress=not args.no_progress, device=args.device,
    )  # fmt: skip
    print(report(figures))
    return 0


def _bench(args: argparse.Namespace) -> int:
    from .bench import BenchError, commands

    try:
        if args.command == "compare":
            return commands.compare_command(args.base, args.new, args.markdown)
        return commands.bench(args.quick, args.filter, args.json, args.rounds, args.against, args.markdown)
    except BenchError as e:
        print(f"luxnn {args.command}: {e}", file=sys.stderr)
        return 1


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="luxnn", description="luxnn: explicit-state neural networks on NumPy and CuPy")
    commands = root.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="train a small network on the bundled 8x8 digits")
    demo.add_argument("--model", choices=("mlp", "cnn"), default="mlp")
    demo.add_argument("--epochs", type=int, default=30)
    demo.add_argument("--batch-size", type=int, default=64)
    demo.add_argument("--lr", type=float, default=3e-3, help="Adam's learning rate")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--memory-plot", metavar="PATH", help="draw the allocator cache's timeline to PATH (PNG)")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="train on the CPU or on a CUDA GPU (CuPy)")
    demo.set_defaults(run=_demo)
    bench = commands.add_parser("bench", help="run the benchmark suite (see BENCHMARKS.md)")
    bench.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds (under 2 minutes)")
    bench.add_argument("--filter", metavar="REGEX", help="only the rows whose names match REGEX")
    bench.add_argument("--json", metavar="PATH", help="write every sample, the machine and the versions to PATH")
    bench.add_argument("--rounds", type=int, metavar="N", help="rounds per row (default 5 quick, 8 full)")
    bench.add_argument("--against", metavar="REV", help="also build git revision REV and print the comparison")
    bench.add_argument("--markdown", action="store_true", help="print markdown tables")
    bench.set_defaults(run=_bench)
    compare = commands.add_parser("compare", help="compare two `luxnn bench --json` results")
    compare.add_argument("base", metavar="BASE.json")
    compare.add_argument("new", metavar="NEW.json")
    compare.add_argument("--markdown", action="store_true", help="print markdown tables")
    compare.set_defaults(run=_bench)
    return root


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("epochs", "batch_size"):
        if getattr(args, name, 1) < 1:
            print(f"luxnn: --{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
