"""The `luxnn` command."""

from __future__ import annotations

import argparse
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import report, run

    figures = run(
        args.model, epochs=args.epochs, batch_size=args.batch_size, learning_rate=args.lr,
        seed=args.seed, memory_plot=args.memory_plot, progress=not args.no_progress,
    )  # fmt: skip
    print(report(figures))
    return 0


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
    demo.set_defaults(run=_demo)
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
