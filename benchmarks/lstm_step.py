"""Issue 14's LSTM check: an LSTM classifier (batch 64, sequence 50, input 32, hidden 128,
the last output into a Dense layer of 10 classes), training step = forward + backward +
Adam update with softmax cross-entropy, luxnn against ``torch.nn.LSTM`` in PyTorch eager
on the CPU, interleaved rounds, medians. The target: at most 1.3x PyTorch's step.

PyTorch's LSTM on the CPU runs oneDNN's fused RNN primitive (forward and backward);
``--no-onednn`` also times it with oneDNN off, PyTorch's own ATen LSTM (a GEMM per step
and a fused cell kernel, autograd through the steps), the peer a NumPy step is closest to.

    python benchmarks/lstm_step.py [--rounds 7] [--per-round 3] [--no-cache]
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

from luxnn.bench import models
from luxnn.bench.machine import blas, blas_summary
from luxnn.bench.runner import interleaved_rounds

MODEL = models.LSTM()


def without_onednn(step):
    """`step` with PyTorch's oneDNN (mkldnn) kernels turned off while it runs."""
    import torch

    def run() -> None:
        with warnings.catch_warnings():  # flags() warns that TF32 needs an Intel GPU
            warnings.simplefilter("ignore", UserWarning)
            with torch.backends.mkldnn.flags(enabled=False):
                step()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--per-round", type=int, default=3)
    parser.add_argument("--no-cache", action="store_true", help="train without the allocator cache")
    parser.add_argument("--no-onednn", action="store_true", help="also time PyTorch with oneDNN off")
    args = parser.parse_args()

    steps = {"luxnn": MODEL.luxnn(cache=None if args.no_cache else "default")}
    try:
        steps["pytorch (torch.nn.LSTM)"] = MODEL.torch()
        if args.no_onednn:
            steps["pytorch (oneDNN off)"] = without_onednn(MODEL.torch())
    except ImportError:
        pass
    print(
        f"LSTM classifier: batch {MODEL.batch}, sequence {MODEL.length}, input {MODEL.inputs}, "
        f"hidden {MODEL.hidden}, {MODEL.classes} classes, float32, Adam"
    )
    print(f"kernels: {blas_summary(blas())}; OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', 'unset')}")
    samples = interleaved_rounds(steps, args.rounds, args.per_round, warmup=3)
    base = statistics.median(samples["luxnn"])
    # The last column is luxnn's step time over this row's: the target is <= 1.3x PyTorch.
    print(f"{'step':<26} {'median':>9} {'IQR':>8} {'luxnn time / this':>18}")
    for name, s in samples.items():
        q = statistics.quantiles(s, n=4) if len(s) > 1 else (s[0], s[0], s[0])
        med = statistics.median(s)
        print(f"{name:<26} {med * 1e3:>7.2f}ms {(q[2] - q[0]) * 1e3:>6.2f}ms {base / med:>17.2f}x")


if __name__ == "__main__":
    main()
