"""The rows of the suite, in groups of variants that are timed side by side.

A `Group` is set up once in a process and its variants are timed in interleaved rounds
(round r starts with variant r mod n). Row names:

- ``basics/dense``, ``basics/conv``, ``basics/MHA``: one forward call at Lux.jl's sizes;
  ``basics/NAME (first run)``: the first call after set-up, one fresh process per round;
- ``training/NAME (cache on)``, ``(cache off)``: ``single_train_step_`` with the
  TrainState's allocator cache and without one; ``(numpy by hand)``, ``(pytorch eager)``:
  the peers, where they exist and PyTorch is installed;
- ``training/resnet``, ``training/lm``, ``training/lm-buckets`` (the allocator issue's
  models: BatchNorm and skip connections; embedding and causal attention; its length drawn
  from 4 buckets each step): luxnn's cache on and off only;
- ``training/autoencoder (quiet)``, ``(2 busy processes)``: a small model's step (a
  VAE's layers) timed alone and beside two processes that spin on a core each
  (`load.busy_processes`), in the same rounds: how much a shared machine slows it;
- ``training/transformer-quick`` and ``training/large-activations-quick``: ``--quick``'s
  smaller sizes (their rows are never compared with the full ones);
- ``distributed/allreduce-25MiB (...)`` and ``distributed/mlp (...)``: steps run in the
  ranks of an ``mpiexec`` job through a proxy (`distributed` says how, and what each row runs);
- ``optim/adam (luxnn)``, ``(numpy by hand)``, ``(luxnn, functional)``, ``(numpy by hand,
  pure)``, ``(masked)``, ``(multi_transform)``, ``(inject_hyperparams)``: one Adam update
  over the transformer row's parameter tree as ``apply_gradients_`` runs it, the
  hand-written loop in place, optax's pure update and the loop under its contract, and the
  same Adam inside each wrapper, in place (``optim/adam-quick``: the quick tree);
- ``time_to_load``: ``import luxnn`` in a fresh process, one per round (at least 5).
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from . import distributed, models

TIME_TO_LOAD = "time_to_load"
MIN_LOAD_ROUNDS = 5


@dataclass(frozen=True)
class Variant:
    """One row of a group.

    build(cache): the step. For ``memory == "own"`` (luxnn with its cache on) `cache` is
    the `AllocCache` the TrainState must use, or "default" for its own choice; the other
    variants ignore it. memory: "own" (counted by the cache the step runs in), "wrapped"
    (counted by a counting cache around each call: NumPy's default allocator otherwise) or
    None (not counted: not NumPy arrays, as PyTorch's, or another row's step). needs: a
    module that must be importable. busy: processes spinning on a core each while the
    variant is calibrated and timed (`load.busy_processes`).
    """

    name: str
    build: Callable[[Any], models.Step]
    memory: str | None
    needs: str | None = None
    busy: int = 0

    @property
    def available(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


@dataclass(frozen=True)
class Group:
    """Variants timed side by side; `first_run`: the name of the fresh-process row, if any.
    `warmup_calls`: the calls before a variant is timed or its memory counted (a cache
    plans a step from its first two and serves from the third; a loop whose shapes vary is
    warm once each shape was planned)."""

    name: str
    variants: tuple[Variant, ...]
    params: dict = field(default_factory=dict)
    first_run: str | None = None
    warmup_calls: int = 4

    def variant(self, name: str) -> Variant:
        return next(v for v in self.variants if v.name == name)


def _basic(name: str) -> Group:
    build = models.BASICS[name]
    row = f"basics/{name}"
    return Group(row, (Variant(row, lambda _cache: build(), "wrapped"),), first_run=f"{row} (first run)")


def _training(name: str, model: Any, params: dict, *, warmup_calls: int = 4) -> Group:
    variants = [
        Variant(f"{name} (cache on)", model.luxnn, "own"),
        Variant(f"{name} (cache off)", lambda _cache: model.luxnn(None), "wrapped"),
    ]
    if hasattr(model, "numpy"):
        variants.append(Variant(f"{name} (numpy by hand)", lambda _cache: model.numpy(), "wrapped"))
    if hasattr(model, "torch"):
        variants.append(Variant(f"{name} (pytorch eager)", lambda _cache: model.torch(), None, needs="torch"))
    return Group(name, tuple(variants), params, warmup_calls=warmup_calls)


def _busy(name: str, model: Any, params: dict, busy: int) -> Group:
    """The step of `model` quiet, then beside `busy` spinning processes."""
    variants = (Variant(f"{name} (quiet)", model.luxnn, "own"),
                Variant(f"{name} ({busy} busy processes)", model.luxnn, None, busy=busy))
    return Group(name, variants, {**params, "busy_processes": busy})


def _optim(model: models.OptimAdam, suffix: str) -> Group:
    name = f"optim/adam{suffix}"
    variants = [Variant(f"{name} (luxnn)", lambda _cache: model.luxnn(), "wrapped"),
                Variant(f"{name} (numpy by hand)", lambda _cache: model.numpy(), "wrapped"),
                Variant(f"{name} (luxnn, functional)", lambda _cache: model.luxnn(functional=True), "wrapped"),
                Variant(f"{name} (numpy by hand, pure)", lambda _cache: model.numpy(pure=True), "wrapped")]
    variants += [Variant(f"{name} ({w})", lambda _cache, w=w: model.luxnn(w), "wrapped")
                 for w in ("masked", "multi_transform", "inject_hyperparams")]
    t = model.transformer
    return Group(name, tuple(variants), {"tree": "training/transformer", "dim": t.dim, "heads": t.heads,
                                         "dtype": "float32", "optimizer": "adam"})


def _distributed() -> list[Group]:
    def row(group: str, label: str, ranks: int, step: str) -> Variant:
        return Variant(f"{group} ({label})", lambda _cache: distributed.proxy(ranks, step), None, needs="mpi4py")

    allreduce, mlp = "distributed/allreduce-25MiB", "distributed/mlp"
    return [
        Group(allreduce, (
            row(allreduce, "mpi4py Allreduce", 2, "allreduce-raw"),
            row(allreduce, "DistributedOptimizer bucket", 2, "allreduce-bucket"),
            row(allreduce, "DistributedOptimizer update", 2, "allreduce-update"),
        ), {"ranks": 2, "bytes": distributed.BUCKET_BYTES, "dtype": "float32"}),
        Group(mlp, (
            row(mlp, "2 ranks, batch split", 2, "mlp-ranks"),
            row(mlp, "2 ranks, gradient allreduce", 2, "mlp-allreduce"),
            row(mlp, "2 ranks, 256 KiB buckets", 2, "mlp-buckets"),
            row(mlp, "2 ranks, 256 KiB buckets, overlap", 2, "mlp-overlap"),
            row(mlp, "2 ranks, no allreduce", 2, "mlp-local"),
            row(mlp, "1 process, whole batch", 1, "mlp-whole"),
            row(mlp, "round trip, 2 ranks", 2, "noop"),
            row(mlp, "round trip, 1 process", 1, "noop"),
        ), {"batch": 128, "sizes": [784, 256, 10], "optimizer": "sgd", "ranks": 2}),
    ]  # fmt: skip


def groups(quick: bool) -> list[Group]:
    """The suite's groups, in the order they run and print."""
    suffix = "-quick" if quick else ""
    transformer = models.Transformer(batch=8, length=64, dim=128, heads=4) if quick else models.Transformer()
    large = models.LargeActivations(batch=2048) if quick else models.LargeActivations()
    lstm = models.LSTM()
    return [
        _basic("dense"),
        _basic("conv"),
        _basic("MHA"),
        _training("training/mlp", models.MLP(), {"batch": 128, "sizes": [784, 256, 10], "optimizer": "sgd"}),
        _training("training/cnn", models.CNN(), {"batch": 64, "image": [28, 28, 1], "channels": [32, 64], "optimizer": "adam"}),
        _training(
            f"training/transformer{suffix}", transformer,
            {"batch": transformer.batch, "length": transformer.length, "dim": transformer.dim,
             "heads": transformer.heads, "optimizer": "adam"},
        ),  # fmt: skip
        _training(
            f"training/large-activations{suffix}", large,
            {"batch": large.batch, "sizes": list(large.sizes), "optimizer": "sgd",
             "activation_bytes": large.batch * large.sizes[1] * 4},
        ),  # fmt: skip
        _training("training/resnet", models.ResNet(), {"batch": 32, "image": [32, 32, 3], "channels": 16, "blocks": 2, "optimizer": "adam"}),
        _training("training/lm", models.LM(), {"batch": 16, "length": 128, "vocab": 1000, "dim": 128, "optimizer": "adam"}),
        _training(
            "training/lm-buckets", models.LM(buckets=(32, 64, 96, 128)),
            {"batch": 16, "lengths": [32, 64, 96, 128], "vocab": 1000, "dim": 128, "optimizer": "adam"},
            warmup_calls=8,  # 32 steps: warm from step 31 on, as benchmarks/promises.py's loops
        ),  # fmt: skip
        _training(
            "training/lstm", lstm,
            {"batch": lstm.batch, "length": lstm.length, "inputs": lstm.inputs, "hidden": lstm.hidden,
             "classes": lstm.classes, "optimizer": "adam"},
        ),  # fmt: skip
        _busy("training/autoencoder", models.Autoencoder(), {"batch": 64, "sizes": [784, 400, 20, 400, 784], "optimizer": "adam"}, 2),
        _optim(models.OptimAdam(transformer), suffix),
        *_distributed(),
    ]


def find_group(name: str, quick: bool) -> Group:
    for group in groups(quick):
        if group.name == name:
            return group
    raise KeyError(f"no group {name!r} in the {'quick' if quick else 'full'} suite")


@dataclass(frozen=True)
class Selection:
    """The rows a run measures: for each group, its selected variants and whether its
    first-run row is selected; and whether time_to_load is."""

    groups: list[tuple[Group, list[str], bool]]
    time_to_load: bool
    unavailable: list[str]

    @property
    def row_count(self) -> int:
        return sum(len(names) + first for _, names, first in self.groups) + self.time_to_load


def select(quick: bool, pattern: str | None) -> Selection:
    """The rows whose names `pattern` (a regular expression, searched) matches; variants
    whose peer is not installed are left out and named in ``unavailable``."""
    return select_from(groups(quick), pattern, with_time_to_load=True)


def select_from(candidates: list[Group], pattern: str | None, *, with_time_to_load: bool) -> Selection:
    """`select` over the groups `candidates` (time_to_load among them if `with_time_to_load`)."""
    regex = re.compile(pattern) if pattern else None

    def wanted(name: str) -> bool:
        return regex is None or regex.search(name) is not None

    chosen, unavailable = [], []
    for group in candidates:
        names = []
        for v in group.variants:
            if wanted(v.name):
                (names if v.available else unavailable).append(v.name)
        first = group.first_run is not None and wanted(group.first_run)
        if names or first:
            chosen.append((group, names, first))
    return Selection(chosen, with_time_to_load and wanted(TIME_TO_LOAD), unavailable)
