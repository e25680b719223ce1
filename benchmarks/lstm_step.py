"""Issue 14's LSTM check: an LSTM classifier (batch 64, sequence 50, input 32, hidden 128,
the last output into a Dense layer of 10 classes), training step = forward + backward +
Adam update with softmax cross-entropy, luxnn against ``torch.nn.LSTM`` in PyTorch eager
on the CPU, interleaved rounds, medians. The target: at most 1.3x PyTorch's step.

PyTorch's LSTM on the CPU runs oneDNN's fused RNN primitive (forward and backward);
``--no-onednn`` also times it with oneDNN off, PyTorch's own ATen LSTM (a GEMM per step
and a fused cell kernel, autograd through the steps), the peer a NumPy step is closest to.

    python benchmarks/lstm_step.py [--rounds 7] [--per-round 3] [--no-cache] [--no-onednn]
"""

from __future__ import annotations

import argparse
import warnings

from peers import add_step_options, time_against_peers

from luxnn.bench import models

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
    add_step_options(parser)
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
    time_against_peers(steps, args)  # the target: luxnn time / PyTorch's >= 1 / 1.3


if __name__ == "__main__":
    main()
