"""The models of ``luxnn bench --device gpu`` and their PyTorch peers, as steps on a CUDA GPU.

The training rows are the GPU issue's (issue 26) table: each is ``single_train_step_`` of a
classifier (softmax cross-entropy, Adam, float32) on fixed data, eager and replayed as CUDA
graphs, and the same step in PyTorch eager and captured whole as one CUDA graph on the same
GPU. The basics are `models.BASICS` (Lux.jl's forward calls) on the GPU, beside the same
layers in PyTorch. A step is a `DeviceStep`: a callable that also reports the peak of the
memory reserved from the device since its last `reset_peaks`, and for a step replayed as a
graph how many captures it made.

This module imports luxnn only as ``luxnn``, as `models` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import luxnn as lx

from . import models


class DeviceStep:
    """`step()` on the GPU; `peak_reserved()`: bytes held from the device at the most since
    `reset_peaks()` (`reserved` reads it, `reset` starts it over; None: not counted).
    `captures`: for a step that captures CUDA graphs, the number of captures so far (None:
    it never captures); `graph_stats`: luxnn's `luxnn.graphs.stats` of the step's training
    state as a dict (None: not a luxnn training step)."""

    def __init__(self, step: Callable[[], Any], reserved: Callable[[], int] | None = None,
                 reset: Callable[[], None] | None = None, *, captures: Callable[[], int] | None = None,
                 graph_stats: Callable[[], dict[str, Any]] | None = None) -> None:
        self.step, self._reserved, self._reset = step, reserved, reset
        self.captures, self.graph_stats = captures, graph_stats

    def __call__(self) -> Any:
        return self.step()

    def reset_peaks(self) -> None:
        if self._reset is not None:
            self._reset()

    def peak_reserved(self) -> int | None:
        return None if self._reserved is None else int(self._reserved())


def torch_cuda() -> Any:
    """PyTorch, when it is installed with a usable CUDA device; otherwise None."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def _torch_reserved() -> tuple[Callable[[], int], Callable[[], None]]:
    """PyTorch's caching allocator's peak reserved bytes (parameters, optimizer state and
    data included: they live in its blocks too) and its reset, which first releases the
    cached blocks no tensor uses (another row's)."""
    import torch

    def reset() -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()

    return torch.cuda.max_memory_reserved, reset


# ---- the training rows ---------------------------------------------------------------------


def _last_step(x: Any) -> Any:
    return x[:, -1]


def _first(outputs: Any) -> Any:
    return outputs[0]  # MultiHeadAttention's (y, weights)


def _mlp(sizes: tuple[int, ...]) -> lx.Layer:
    hidden = [lx.Dense(a, b, activation="relu") for a, b in zip(sizes[:-2], sizes[1:-1])]
    return lx.Chain(*hidden, lx.Dense(sizes[-2], sizes[-1]))


def _torch_mlp(sizes: tuple[int, ...]) -> Any:
    import torch

    layers: list = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [torch.nn.Linear(a, b), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def _cnn() -> lx.Layer:
    return lx.Chain(
        lx.Conv((3, 3), 1, 32, activation="relu", padding="same"),
        lx.Conv((3, 3), 32, 64, activation="relu", padding="same"),
        lx.MaxPool((2, 2)), lx.Flatten(),
        lx.Dense(14 * 14 * 64, 128, activation="relu"), lx.Dense(128, 10),
    )  # fmt: skip


def _torch_cnn() -> Any:
    import torch

    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(14 * 14 * 64, 128), nn.ReLU(), nn.Linear(128, 10),
    )  # fmt: skip


def _attention(dim: int = 256, heads: int = 8, length: int = 128) -> lx.Layer:
    return lx.Chain(
        lx.SkipConnection(lx.Chain(lx.MultiHeadAttention(dim, num_heads=heads, is_causal=True), lx.WrappedFunction(_first))),
        lx.LayerNorm(dim),
        lx.SkipConnection(lx.Chain(lx.Dense(dim, 4 * dim, activation="gelu"), lx.Dense(4 * dim, dim))),
        lx.LayerNorm(dim), lx.Flatten(), lx.Dense(length * dim, 10),
    )  # fmt: skip


def _torch_attention(dim: int = 256, heads: int = 8, length: int = 128) -> Any:
    import torch

    nn = torch.nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))
            self.head = nn.Linear(length * dim, 10)
            self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(length))

        def forward(self, x: Any) -> Any:
            x = self.ln1(x + self.attn(x, x, x, attn_mask=self.mask, is_causal=True, need_weights=False)[0])
            x = self.ln2(x + self.mlp(x))
            return self.head(x.flatten(1))

    return Block()


def _lstm(inputs: int = 32, hidden: int = 256) -> lx.Layer:
    return lx.Chain(lx.LSTM(inputs, hidden), lx.WrappedFunction(_last_step), lx.Dense(hidden, 10))


def _torch_lstm(inputs: int = 32, hidden: int = 256) -> Any:
    import torch

    nn = torch.nn

    class Classifier(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm, self.head = nn.LSTM(inputs, hidden, batch_first=True), nn.Linear(hidden, 10)

        def forward(self, x: Any) -> Any:
            return self.head(self.lstm(x)[0][:, -1])

    return Classifier()


@dataclass(frozen=True)
class Classifier:
    """A training row: `model()` (luxnn) and `torch_model()` (its PyTorch peer) on inputs of
    `shape` (batch first; images NHWC for luxnn, NCHW for PyTorch when `images`), 10
    classes, softmax cross-entropy, Adam (learning rate 1e-3), float32. Its steps: `luxnn`
    (eager, or replayed as CUDA graphs), `torch` (PyTorch eager) and `torch_graph`
    (PyTorch's whole step captured as one CUDA graph)."""

    name: str
    shape: tuple[int, ...]
    model: Callable[[], lx.Layer]
    torch_model: Callable[[], Any]
    images: bool = False
    classes: int = 10

    def data(self, batch: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        shape = self.shape if batch is None else (batch, *self.shape[1:])
        rng = np.random.default_rng(1)
        return rng.standard_normal(shape).astype(np.float32), rng.integers(0, self.classes, shape[0])

    def luxnn(self, cache: Any = "default", batch: int | None = None, device: Any = None, graphs: bool = True) -> DeviceStep:
        """The step on `device` (default: the first GPU) with the TrainState's allocator
        cache (`cache`: "default", None or an `AllocCache`, as `models.luxnn_train_step`)
        and its `graphs` (True: warm steps captured as CUDA graphs and replayed; False:
        always eager); its peak reserved is the cache's plus the arrays kept outside it
        (parameters, states, optimizer state, the batch); its graph statistics are
        `luxnn.graphs.stats` of the training state."""
        device = lx.gpu_device(force=True) if device is None else device
        model = self.model()
        ps, st = device(lx.setup(np.random.default_rng(0), model))
        kwargs = {} if isinstance(cache, str) else {"allocator_cache": cache}
        ts = lx.TrainState(model, ps, st, lx.optim.adam(1e-3), graphs=graphs, **kwargs)
        data, ad, loss = device(self.data(batch)), lx.AutoTape(), lx.losses.CrossEntropyLoss()

        def step() -> None:
            nonlocal ts
            _, _, _, ts = lx.single_train_step_(ad, loss, data, ts)

        def reserved() -> int:
            kept = lx.tree.leaves((ts.parameters, ts.states, ts.optimizer_state, data))
            cache_peak = 0 if ts.allocator_cache is None else ts.allocator_cache.stats().peak_reserved
            return cache_peak + sum(a.nbytes for a in kept if hasattr(a, "nbytes"))

        def reset() -> None:
            if ts.allocator_cache is not None:
                ts.allocator_cache.reset_peaks()

        def captures() -> int:
            return lx.graphs.stats(ts).captures

        def graph_stats() -> dict[str, Any]:
            return lx.graphs.stats(ts)._asdict()

        return DeviceStep(step, reserved, reset, captures=captures if graphs else None, graph_stats=graph_stats)

    def _torch_data(self, batch: int | None) -> tuple[np.ndarray, np.ndarray]:
        x, y = self.data(batch)
        if self.images:
            x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))  # NHWC -> NCHW
        return x, y

    def torch(self, device: str = "cuda", batch: int | None = None) -> DeviceStep:
        """The PyTorch step on `device` (its peak reserved counted on "cuda" only)."""
        import torch

        model = self.torch_model().to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        step = models.torch_train_step(model, optimizer, torch.nn.CrossEntropyLoss(), *self._torch_data(batch), device=device)
        return DeviceStep(step, *_torch_reserved()) if device == "cuda" else DeviceStep(step)

    def torch_graph(self, batch: int | None = None, warmup_calls: int = 3) -> DeviceStep:
        """The PyTorch step captured whole (forward, backward and ``Adam(capturable=True)``)
        as one CUDA graph, the way PyTorch captures a whole network: the first
        `warmup_calls` calls are eager steps on a side stream, the next captures the step on
        that stream and replays it, later calls replay. Every call first copies the batch
        into the graph's static input tensors, as a training loop must."""
        import torch

        model = self.torch_model().to("cuda")
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, capturable=True)
        loss_fn = torch.nn.CrossEntropyLoss()
        batch_x, batch_y = (torch.from_numpy(a).to("cuda") for a in self._torch_data(batch))
        static_x, static_y = batch_x.clone(), batch_y.clone()
        side, graph, calls = torch.cuda.Stream(), torch.cuda.CUDAGraph(), 0

        def train() -> None:
            optimizer.zero_grad(set_to_none=True)  # in the capture: backward makes the grads in the graph's pool
            loss_fn(model(static_x), static_y).backward()
            optimizer.step()

        def step() -> None:
            nonlocal calls
            calls += 1
            static_x.copy_(batch_x)
            static_y.copy_(batch_y)
            if calls > warmup_calls:
                if calls == warmup_calls + 1:
                    with torch.cuda.graph(graph, stream=side):
                        train()
                graph.replay()
                return
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                train()
            torch.cuda.current_stream().wait_stream(side)

        return DeviceStep(step, *_torch_reserved(), captures=lambda: int(calls > warmup_calls))


TRAINING: dict[str, Classifier] = {c.name: c for c in (
    Classifier("mlp", (128, 784), lambda: _mlp((784, 256, 10)), lambda: _torch_mlp((784, 256, 10))),
    Classifier("mlp-wide", (1024, 784), lambda: _mlp((784, 2048, 2048, 10)), lambda: _torch_mlp((784, 2048, 2048, 10))),
    Classifier("cnn", (128, 28, 28, 1), _cnn, _torch_cnn, images=True),
    Classifier("attention", (32, 128, 256), _attention, _torch_attention),
    Classifier("lstm", (64, 64, 32), _lstm, _torch_lstm),
)}  # fmt: skip
"""The training rows: MLP 784-256-10 on batch 128; MLP 784-2048-2048-10 on 1024; CNN (two
3x3 convs 1 -> 32 -> 64 with relu, 2x2 max pool, Dense 12544 -> 128 -> 10) on 128 28x28x1
images; an attention block (causal self-attention d256, 8 heads, and a 4x MLP with
tanh-GELU, each with a skip connection and a LayerNorm, then Dense to 10) on batch 32 of
length 128; an LSTM (input 32, hidden 256) over 64 steps on batch 64, its last output
into Dense 256 -> 10."""


# ---- the basics ------------------------------------------------------------------------------


def luxnn_basic(name: str) -> DeviceStep:
    """`models.BASICS[name]` on the first GPU (memory not counted: a forward call at Lux.jl's
    sizes holds a few hundred bytes)."""
    return DeviceStep(models.BASICS[name](lx.gpu_device(force=True)))


def torch_basic(name: str, device: str = "cuda") -> DeviceStep:
    """The same forward call in PyTorch eager on `device`, without autograd's recording
    (luxnn's forward records nothing either)."""
    import torch

    nn, rng = torch.nn, np.random.default_rng(1)
    if name == "dense":
        layer, shape = nn.Linear(2, 3), (3, 2)
    elif name == "conv":
        layer, shape = nn.Conv2d(3, 16, 2), (4, 3, 2, 2)  # NCHW
    else:
        layer, shape = nn.MultiheadAttention(4, 2, batch_first=True), (2, 3, 4)
    layer, x = layer.to(device), torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(device)
    call = (lambda: layer(x, x, x, average_attn_weights=False)) if name == "MHA" else (lambda: layer(x))

    def step() -> Any:
        with torch.no_grad():
            return call()

    return DeviceStep(step)
