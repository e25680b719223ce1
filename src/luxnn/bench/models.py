"""The models of the benchmark suite and their peers, as step builders.

Each builder sets a model up and returns ``step()``, a callable that runs one forward call
(the basics) or one training step (forward, backward and the optimizer's update) on fixed
data. The luxnn training steps are ``lx.single_train_step_``; the peers are the same
networks in PyTorch eager (imported only when asked for) and, where it is short enough to
write, the same step by hand in NumPy.

The sizes are those of the issues: Lux.jl's own basics benchmarks, the layers issue's
MLP, CNN and transformer block, and the allocator issue's large-activation MLP. This module
imports luxnn only as ``luxnn`` (never relatively), so that ``luxnn bench --against`` can
run the same builders against another revision's luxnn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

import luxnn as lx

from .machine import blas_threads

Step = Callable[[], Any]


# ---- basics: one forward call at Lux.jl's benchmark sizes ------------------------------


def _forward(model: lx.Layer, shape: tuple[int, ...], device: Any) -> Step:
    """One forward call of `model` on a float32 input of `shape`, on `device` (None: NumPy)."""
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    if device is not None:
        ps, st, x = device((ps, st, x))
    return lambda: model(x, ps, st)


def basic_dense(device: Any = None) -> Step:
    """Dense 2 -> 3 on a batch of 3 (Lux.jl's ``basics/dense``)."""
    return _forward(lx.Dense(2, 3), (3, 2), device)


def basic_conv(device: Any = None) -> Step:
    """Conv 2x2, 3 -> 16 channels on a (4, 2, 2, 3) NHWC input (Lux.jl's ``basics/conv``)."""
    return _forward(lx.Conv(2, 3, 16), (4, 2, 2, 3), device)


def basic_mha(device: Any = None) -> Step:
    """Self-attention, dim 4, 2 heads on (batch 2, seq 3, dim 4) (Lux.jl's ``basics/MHA``)."""
    return _forward(lx.MultiHeadAttention(4, num_heads=2), (2, 3, 4), device)


BASICS: dict[str, Callable[..., Step]] = {"dense": basic_dense, "conv": basic_conv, "MHA": basic_mha}


# ---- training steps --------------------------------------------------------------------


def luxnn_train_step(model: lx.Layer, optimizer: Any, loss: Any, data: tuple, cache: Any) -> Step:
    """``single_train_step_`` of `model` on `data`. `cache`: "default" (the TrainState's
    own choice, the cache on the CPU), None (cache off) or an `AllocCache`."""
    ps, st = lx.setup(np.random.default_rng(0), model)
    kwargs = {} if isinstance(cache, str) else {"allocator_cache": cache}
    ts = lx.TrainState(model, ps, st, optimizer, **kwargs)
    ad = lx.AutoTape()

    def step() -> None:
        nonlocal ts
        _, _, _, ts = lx.single_train_step_(ad, loss, data, ts)

    return step


def torch_train_step(model: Any, optimizer: Any, loss_fn: Any, x: np.ndarray, y: np.ndarray, device: str = "cpu") -> Step:
    """The same training step in PyTorch eager: zero_grad, forward, backward, step, on as
    many threads as NumPy's BLAS; the data on `device` (the model's)."""
    import torch

    threads = blas_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    tx, ty = torch.from_numpy(x).to(device), torch.from_numpy(y).to(device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_fn(model(tx), ty).backward()
        optimizer.step()

    return step


def luxnn_mlp(sizes: tuple[int, int, int]) -> lx.Layer:
    """Dense d_in -> hidden (relu) -> d_out, the network of `MLP` and `LargeActivations`."""
    d_in, hidden, d_out = sizes
    return lx.Chain(lx.Dense(d_in, hidden, activation="relu"), lx.Dense(hidden, d_out))


def dropout_mlp() -> lx.Layer:
    """Six Dense 128 -> 128 (gelu), each followed by dropout 0.1, then Dense 128 -> 10: a
    model whose gradients are 64 KiB small blocks, made late in the step (issue 13's
    allocator figures, `benchmarks/promises.py`)."""
    return lx.Chain(*[lx.Chain(lx.Dense(128, 128, activation="gelu"), lx.Dropout(0.1)) for _ in range(6)], lx.Dense(128, 10))


def torch_mlp(sizes: tuple[int, int, int]) -> Any:
    """The same MLP in PyTorch."""
    import torch

    d_in, hidden, d_out = sizes
    return torch.nn.Sequential(torch.nn.Linear(d_in, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, d_out))


def numpy_mlp_params(sizes: tuple[int, int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(w1, b1, w2, b2) of the NumPy MLP: uniform weights scaled by 1/sqrt(fan-in), zero biases."""
    d_in, hidden, d_out = sizes
    rng = np.random.default_rng(0)
    w1 = (rng.uniform(-1, 1, (d_in, hidden)) / math.sqrt(d_in)).astype(np.float32)
    b1 = np.zeros(hidden, np.float32)
    w2 = (rng.uniform(-1, 1, (hidden, d_out)) / math.sqrt(hidden)).astype(np.float32)
    b2 = np.zeros(d_out, np.float32)
    return w1, b1, w2, b2


def numpy_mlp_backward_sgd(x: np.ndarray, h: np.ndarray, a: np.ndarray, g: np.ndarray, params: tuple, lr: float) -> None:
    """The MLP's backward from `g`, the loss gradient at its output (`h`: the hidden
    pre-activation, `a`: relu(h)), and the SGD update of `params` = (w1, b1, w2, b2) in place."""
    w1, b1, w2, b2 = params
    gw2 = a.T @ g
    gb2 = g.sum(axis=0)
    ga = g @ w2.T
    ga *= h > 0
    gw1 = x.T @ ga
    gb1 = ga.sum(axis=0)
    for param, grad in ((w1, gw1), (b1, gb1), (w2, gw2), (b2, gb2)):
        param -= lr * grad


@dataclass(frozen=True)
class MLP:
    """``training/mlp``: 784 -> 256 (relu) -> 10, batch 128, softmax cross-entropy, SGD."""

    batch: int = 128
    sizes: tuple[int, int, int] = (784, 256, 10)
    lr: float = 0.01

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        return rng.standard_normal((self.batch, self.sizes[0])).astype(np.float32), rng.integers(0, self.sizes[2], self.batch)

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(luxnn_mlp(self.sizes), lx.optim.sgd(self.lr), lx.losses.CrossEntropyLoss(), self.data(), cache)

    def numpy(self) -> Step:
        """The step by hand: forward, fused softmax cross-entropy gradient, backward, SGD."""
        x, y = self.data()
        params = w1, b1, w2, b2 = numpy_mlp_params(self.sizes)
        rows, lr, batch = np.arange(self.batch), self.lr, self.batch

        def step() -> float:
            h = x @ w1 + b1
            a = np.maximum(h, 0)
            z = a @ w2 + b2
            z -= z.max(axis=1, keepdims=True)
            e = np.exp(z)
            p = e / e.sum(axis=1, keepdims=True)
            loss = -np.log(p[rows, y]).mean()
            p[rows, y] -= 1
            p /= batch
            numpy_mlp_backward_sgd(x, h, a, p, params, lr)
            return float(loss)

        return step

    def torch(self) -> Step:
        import torch

        model = torch_mlp(self.sizes)
        x, y = self.data()
        return torch_train_step(model, torch.optim.SGD(model.parameters(), lr=self.lr), torch.nn.CrossEntropyLoss(), x, y)


@dataclass(frozen=True)
class CNN:
    """``training/cnn``: 28x28x1 images, batch 64; Conv 3x3 1 -> 32 + relu, 2x2 max pool,
    Conv 3x3 32 -> 64 + relu, 2x2 max pool, Dense 3136 -> 10 (padding 1: 28 -> 14 -> 7);
    softmax cross-entropy, Adam."""

    batch: int = 64
    lr: float = 1e-3

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        return rng.standard_normal((self.batch, 28, 28, 1)).astype(np.float32), rng.integers(0, 10, self.batch)

    def torch_data(self) -> tuple[np.ndarray, np.ndarray]:
        """`data` with the images NCHW, as PyTorch's Conv2d takes them."""
        x, y = self.data()
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2)), y  # NHWC -> NCHW

    def luxnn_model(self) -> lx.Layer:
        return lx.Chain(
            lx.Conv(3, 1, 32, activation="relu", padding=1), lx.MaxPool(2),
            lx.Conv(3, 32, 64, activation="relu", padding=1), lx.MaxPool(2),
            lx.Flatten(), lx.Dense(7 * 7 * 64, 10),
        )  # fmt: skip

    def torch_model(self) -> Any:
        import torch

        nn = torch.nn
        return nn.Sequential(
            nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(7 * 7 * 64, 10),
        )  # fmt: skip

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.CrossEntropyLoss(), self.data(), cache)

    def torch(self) -> Step:
        import torch

        model = self.torch_model()
        x, y = self.torch_data()
        return torch_train_step(model, torch.optim.Adam(model.parameters(), lr=self.lr), torch.nn.CrossEntropyLoss(), x, y)


@dataclass(frozen=True)
class Transformer:
    """``training/transformer``: one pre-LayerNorm transformer block (self-attention, then
    an MLP 4x wide with tanh-GELU, each with a skip connection) on (batch, length, dim)
    inputs, MSE loss against random targets, Adam. PyTorch's peer calls its attention
    with ``need_weights=False`` (fused scaled_dot_product_attention, as
    ``torch.nn.TransformerEncoderLayer`` does)."""

    batch: int = 32
    length: int = 128
    dim: int = 256
    heads: int = 8
    lr: float = 1e-3

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        shape = (self.batch, self.length, self.dim)
        return rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)

    def luxnn_model(self) -> lx.Layer:
        dim = self.dim
        attention = lx.SkipConnection(
            lx.Chain(lx.LayerNorm(dim), lx.MultiHeadAttention(dim, num_heads=self.heads)),
            lambda y_and_weights, x: y_and_weights[0] + x,
        )
        mlp = lx.SkipConnection(lx.Chain(lx.LayerNorm(dim), lx.Dense(dim, 4 * dim, activation="gelu"), lx.Dense(4 * dim, dim)))
        return lx.Chain(attention, mlp)

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.MSELoss(), self.data(), cache)

    def torch(self, need_weights: bool = False) -> Step:
        """`need_weights=True` (not in the suite): the attention computes its weights
        explicitly (per head), as luxnn's MultiHeadAttention returns them."""
        import torch

        nn, dim, heads = torch.nn, self.dim, self.heads

        class Block(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
                self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
                self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"), nn.Linear(4 * dim, dim))

            def forward(self, x: Any) -> Any:
                h = self.ln1(x)
                x = x + self.attn(h, h, h, need_weights=need_weights, average_attn_weights=False)[0]
                return x + self.mlp(self.ln2(x))

        model = Block()
        x, y = self.data()
        return torch_train_step(model, torch.optim.Adam(model.parameters(), lr=self.lr), nn.MSELoss(), x, y)


@dataclass(frozen=True)
class LargeActivations:
    """``training/large-activations``: the allocator issue's MLP, 256 -> 4096 (relu) ->
    256 on a batch of 4096 in float32, so that its hidden activations (and their
    gradients) are 64 MiB arrays, the size at which every fresh allocation is mmap'd and
    page-faulted; MSE loss, SGD."""

    batch: int = 4096
    sizes: tuple[int, int, int] = (256, 4096, 256)
    lr: float = 1e-3

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        d_in, _, d_out = self.sizes
        return (
            rng.standard_normal((self.batch, d_in), dtype=np.float32),
            rng.standard_normal((self.batch, d_out), dtype=np.float32),
        )

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(luxnn_mlp(self.sizes), lx.optim.sgd(self.lr), lx.losses.MSELoss(), self.data(), cache)

    def numpy(self) -> Step:
        """The step by hand: forward, the MSE gradient, backward, SGD."""
        x, y = self.data()
        params = w1, b1, w2, b2 = numpy_mlp_params(self.sizes)
        lr, scale = self.lr, np.float32(2.0 / y.size)

        def step() -> float:
            h = x @ w1 + b1
            a = np.maximum(h, 0)
            diff = a @ w2 + b2 - y
            loss = float((diff * diff).mean())
            numpy_mlp_backward_sgd(x, h, a, diff * scale, params, lr)
            return loss

        return step

    def torch(self) -> Step:
        import torch

        model = torch_mlp(self.sizes)
        x, y = self.data()
        return torch_train_step(model, torch.optim.SGD(model.parameters(), lr=self.lr), torch.nn.MSELoss(), x, y)


@dataclass(frozen=True)
class LSTM:
    """``training/lstm``: an LSTM (input 32, hidden 128) over sequences of 50 steps, batch
    64, its last output into a Dense classifier (10 classes); softmax cross-entropy, Adam.
    PyTorch's peer is ``torch.nn.LSTM(batch_first=True)`` and a Linear."""

    batch: int = 64
    length: int = 50
    inputs: int = 32
    hidden: int = 128
    classes: int = 10
    lr: float = 1e-3

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        x = rng.standard_normal((self.batch, self.length, self.inputs)).astype(np.float32)
        return x, rng.integers(0, self.classes, self.batch)

    def luxnn_model(self) -> lx.Layer:
        return lx.Chain(lx.Recurrence(lx.LSTMCell(self.inputs, self.hidden)), lx.Dense(self.hidden, self.classes))

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.CrossEntropyLoss(), self.data(), cache)

    def torch(self) -> Step:
        import torch

        nn = torch.nn

        class Classifier(nn.Module):
            def __init__(self, inputs: int, hidden: int, classes: int) -> None:
                super().__init__()
                self.lstm = nn.LSTM(inputs, hidden, batch_first=True)
                self.head = nn.Linear(hidden, classes)

            def forward(self, x: Any) -> Any:
                return self.head(self.lstm(x)[0][:, -1])

        model = Classifier(self.inputs, self.hidden, self.classes)
        x, y = self.data()
        return torch_train_step(model, torch.optim.Adam(model.parameters(), lr=self.lr), nn.CrossEntropyLoss(), x, y)


@dataclass(frozen=True)
class Autoencoder:
    """``training/autoencoder``: a VAE's layers without its sampling, 784 -> 400 (relu) ->
    20 -> 400 (relu) -> 784, batch 64, MSE against its input, Adam: a small model's step,
    all small products (20 M multiply-adds and fewer), timed quiet and beside busy processes."""

    batch: int = 64
    sizes: tuple[int, ...] = (784, 400, 20, 400, 784)
    lr: float = 1e-3

    def luxnn_model(self) -> lx.Layer:
        last = len(self.sizes) - 2
        return lx.Chain(*[
            lx.Dense(n_in, n_out, activation=None if i in (1, last) else "relu")
            for i, (n_in, n_out) in enumerate(zip(self.sizes, self.sizes[1:]))
        ])  # fmt: skip

    def luxnn(self, cache: Any = "default") -> Step:
        x = np.random.default_rng(1).standard_normal((self.batch, self.sizes[0])).astype(np.float32)
        return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.MSELoss(), (x, x), cache)


# ---- optimisers ------------------------------------------------------------------------


@dataclass(frozen=True)
class OptimAdam:
    """``optim/adam``: one Adam update over the parameter tree of ``training/transformer``
    with fixed float32 gradients, as the in-place verb ``apply_gradients_`` runs it (no
    allocator cache, as the peer); the peer is the same update as a hand-written per-leaf
    NumPy loop (moments updated in place, one scratch buffer per leaf, no allocation).
    ``functional=True``: optax's pure ``update`` then ``apply_updates_``, whose peer is the
    same loop under optax's contract. The wrapped variants put the same Adam inside
    ``masked`` (every leaf selected), ``multi_transform`` (two groups, matrices and the
    rest) and ``inject_hyperparams``."""

    transformer: Transformer = Transformer()
    lr: float = 1e-3

    def tree(self) -> tuple[Any, Any]:
        ps, _ = lx.setup(np.random.default_rng(0), self.transformer.luxnn_model())
        rng = np.random.default_rng(1)
        return ps, lx.tree.map(lambda p: rng.standard_normal(p.shape).astype(p.dtype), ps)

    def optimizer(self, wrapper: str) -> Any:
        optim = lx.optim
        if wrapper == "adam":
            return optim.adam(self.lr)
        if wrapper == "masked":
            return optim.masked(optim.adam(self.lr), True)
        if wrapper == "multi_transform":
            labels = lambda ps: lx.tree.map(lambda p: "matrices" if p.ndim > 1 else "vectors", ps)  # noqa: E731
            return optim.multi_transform({"matrices": optim.adam(self.lr), "vectors": optim.adam(self.lr)}, labels)
        if wrapper == "inject_hyperparams":
            return optim.inject_hyperparams(optim.adam)(learning_rate=self.lr)
        raise ValueError(f"OptimAdam: unknown wrapper {wrapper!r}")

    def luxnn(self, wrapper: str = "adam", functional: bool = False) -> Step:
        ps, grads = self.tree()
        opt = self.optimizer(wrapper)
        if not functional:
            ts = lx.TrainState(self.transformer.luxnn_model(), ps, {}, opt, allocator_cache=None)

            def step_() -> None:
                nonlocal ts
                ts = lx.apply_gradients_(ts, grads)

            return step_
        state = opt.init(ps)

        def step() -> None:
            nonlocal state
            updates, state = opt.update(grads, state, ps)
            lx.optim.apply_updates_(ps, updates)

        return step

    def numpy(self, pure: bool = False) -> Step:
        """The hand-written loop; ``pure=True``: under optax's contract, as `luxnn` runs
        (new moment arrays each step, the updates of every leaf made before any is added)."""
        ps, grads = self.tree()
        params, gs = lx.tree.leaves(ps), lx.tree.leaves(grads)
        mus, nus, scratch = ([np.zeros_like(p) for p in params] for _ in range(3))
        b1, b2, eps, lr = 0.9, 0.999, 1e-8, self.lr
        t = 0

        def step() -> None:
            nonlocal t
            t += 1
            c1, c2 = 1.0 / (1.0 - b1**t), 1.0 / (1.0 - b2**t)
            updates = []
            for i, (g, m, v) in enumerate(zip(gs, mus, nus)):
                s = np.empty_like(g) if pure else scratch[i]
                if pure:
                    m, v = mus[i], nus[i] = m * b1, v * b2
                else:
                    m *= b1
                    v *= b2
                np.multiply(g, 1.0 - b1, out=s)
                m += s
                np.multiply(g, g, out=s)
                s *= 1.0 - b2
                v += s
                np.multiply(v, c2, out=s)  # s <- sqrt(v_hat) + eps
                np.sqrt(s, out=s)
                s += eps
                np.divide(m, s, out=s)
                s *= lr * c1
                updates.append(s)
                if not pure:
                    params[i] -= s
            if pure:
                for p, s in zip(params, updates):
                    p -= s

        return step


@dataclass(frozen=True)
class ResNet:
    """``training/resnet``: a ResNet-style CNN on 32x32x3 images, batch 32: Conv 3x3 3 ->
    16 with BatchNorm and relu, two residual blocks (Conv 3x3, BatchNorm, relu, Conv 3x3,
    BatchNorm, plus the skip connection), 2x2 max pool, Dense 4096 -> 10; softmax
    cross-entropy, Adam. luxnn only (a model of the allocator issue's)."""

    batch: int = 32
    channels: int = 16
    lr: float = 1e-3

    def data(self) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(1)
        return rng.standard_normal((self.batch, 32, 32, 3)).astype(np.float32), rng.integers(0, 10, self.batch)

    def luxnn_model(self) -> lx.Layer:
        c = self.channels

        def block() -> lx.Layer:
            body = lx.Chain(lx.Conv(3, c, c, padding=1), lx.BatchNorm(c, activation="relu"), lx.Conv(3, c, c, padding=1), lx.BatchNorm(c))
            return lx.SkipConnection(body, lambda y, x: y + x)

        return lx.Chain(
            lx.Conv(3, 3, c, padding=1), lx.BatchNorm(c, activation="relu"), block(), block(),
            lx.MaxPool(2), lx.Flatten(), lx.Dense(16 * 16 * c, 10),
        )  # fmt: skip

    def luxnn(self, cache: Any = "default") -> Step:
        return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.CrossEntropyLoss(), self.data(), cache)


@dataclass(frozen=True)
class LM:
    """``training/lm``: a language model's step: token ids (batch 16, length 128, vocabulary
    1000) -> Embedding 128 -> a causal self-attention block (pre-LayerNorm, 4 heads, skip
    connection) -> Dense to the vocabulary; softmax cross-entropy on the next tokens, Adam.
    ``training/lm-buckets``: the same model fed as a bucketing data loader feeds it, one
    length of 4 buckets (32, 64, 96, 128) a step; a call is 4 steps, one of each length
    in an order drawn afresh (a fixed seed), so that every call does the same work."""

    batch: int = 16
    length: int = 128
    vocab: int = 1000
    dim: int = 128
    heads: int = 4
    buckets: tuple[int, ...] = ()
    lr: float = 1e-3

    def data(self, length: int) -> tuple[np.ndarray, np.ndarray]:
        rng = np.random.default_rng(length)
        return rng.integers(0, self.vocab, (self.batch, length)), rng.integers(0, self.vocab, (self.batch, length))

    def luxnn_model(self) -> lx.Layer:
        attention = lx.SkipConnection(
            lx.Chain(lx.LayerNorm(self.dim), lx.MultiHeadAttention(self.dim, num_heads=self.heads, is_causal=True)),
            lambda y_and_weights, x: y_and_weights[0] + x,
        )
        return lx.Chain(lx.Embedding(self.vocab, self.dim), attention, lx.Dense(self.dim, self.vocab))

    def luxnn(self, cache: Any = "default") -> Step:
        if not self.buckets:
            return luxnn_train_step(self.luxnn_model(), lx.optim.adam(self.lr), lx.losses.CrossEntropyLoss(), self.data(self.length), cache)
        batches = {length: self.data(length) for length in self.buckets}
        model = self.luxnn_model()
        ps, st = lx.setup(np.random.default_rng(0), model)
        kwargs = {} if isinstance(cache, str) else {"allocator_cache": cache}
        ts = lx.TrainState(model, ps, st, lx.optim.adam(self.lr), **kwargs)
        ad, loss, rng = lx.AutoTape(), lx.losses.CrossEntropyLoss(), np.random.default_rng(0)

        def steps() -> None:
            nonlocal ts
            for length in rng.permutation(self.buckets):
                _, _, _, ts = lx.single_train_step_(ad, loss, batches[length], ts)

        return steps
