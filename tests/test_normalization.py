"""Normalisation layers against PyTorch in float64: outputs, gradients, running statistics."""

import numpy as np
import pytest

import luxnn as lx
from luxnn.ops.norm import normalize, rms_normalize

torch = pytest.importorskip("torch")
F = torch.nn.functional


def f64(tree):
    return lx.tree.map(lambda a: a.astype(np.float64) if isinstance(a, np.ndarray) else a, tree)


def rel_err(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def random_params(rng, ps):
    return lx.tree.map(lambda a: rng.normal(size=a.shape), ps)


def value_grads(model, x, ps, st, r):
    def loss(x, ps):
        y, _ = model(x, ps, st)
        return (y * r).sum()

    return lx.value_and_grad(loss, argnums=(0, 1))(x, ps)


def check_against(model, ps, torch_fn, x, rng):
    """Compare value and gradients of (y * r).sum() for x and every parameter."""
    st = f64(lx.setup(rng, model)[1])
    y, _ = model(x, ps, st)
    r = rng.normal(size=y.shape)
    value, (gx, gps) = value_grads(model, x, ps, st, r)
    tx = torch.tensor(x, requires_grad=True)
    tps = {k: torch.tensor(v, requires_grad=True) for k, v in ps.items()}
    ty = torch_fn(tx, tps)
    (ty * torch.tensor(r)).sum().backward()
    assert rel_err(y, ty.detach().numpy()) < 1e-6
    assert abs(float(value) - float((ty * torch.tensor(r)).sum().detach())) < 1e-6 * max(1.0, abs(float(value)))
    assert rel_err(gx, tx.grad.numpy()) < 1e-6
    for k in ps:
        assert rel_err(gps[k], tps[k].grad.numpy()) < 1e-6, k


@pytest.mark.parametrize("seed", range(3))
def test_layernorm_matches_torch(seed):
    rng = np.random.default_rng(seed)
    lead = tuple(rng.integers(1, 5, size=rng.integers(1, 3)))
    shape = tuple(int(n) for n in rng.integers(2, 7, size=rng.integers(1, 3)))
    model = lx.LayerNorm(shape if len(shape) > 1 else shape[0], epsilon=1e-5)
    ps = random_params(rng, f64(lx.setup(rng, model)[0]))
    x = rng.normal(size=lead + shape) * 3 + 1
    check_against(model, ps, lambda tx, p: F.layer_norm(tx, shape, p["scale"], p["bias"], 1e-5), x, rng)


def test_layernorm_without_affine():
    rng = np.random.default_rng(0)
    model = lx.LayerNorm(5, affine=False)
    x = rng.normal(size=(3, 5))
    check_against(model, {}, lambda tx, p: F.layer_norm(tx, (5,), eps=1e-5), x, rng)


@pytest.mark.parametrize("seed", range(3))
def test_rmsnorm_matches_torch(seed):
    rng = np.random.default_rng(seed)
    dim = int(rng.integers(2, 9))
    model = lx.RMSNorm(dim)
    ps = random_params(rng, f64(lx.setup(rng, model)[0]))
    x = rng.normal(size=(int(rng.integers(1, 4)), int(rng.integers(1, 5)), dim))
    check_against(model, ps, lambda tx, p: F.rms_norm(tx, (dim,), p["scale"], 1e-6), x, rng)


@pytest.mark.parametrize("seed", range(3))
def test_groupnorm_matches_torch(seed):
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(1, 4))
    channels = groups * int(rng.integers(1, 4))
    spatial = tuple(int(n) for n in rng.integers(1, 5, size=seed % 3))  # (N, C), (N, L, C), (N, H, W, C)
    model = lx.GroupNorm(groups, channels)
    ps = random_params(rng, f64(lx.setup(rng, model)[0]))
    x = rng.normal(size=(2, *spatial, channels)) * 2 - 1

    def torch_fn(tx, p):
        first = tx.movedim(-1, 1)
        return F.group_norm(first, groups, p["scale"], p["bias"], 1e-5).movedim(1, -1)

    check_against(model, ps, torch_fn, x, rng)


@pytest.mark.parametrize("seed", range(3))
def test_batchnorm_train_matches_torch(seed):
    rng = np.random.default_rng(seed)
    channels = int(rng.integers(1, 6))
    spatial = tuple(int(n) for n in rng.integers(1, 5, size=(0, 2, 1)[seed]))
    model = lx.BatchNorm(channels)
    ps = random_params(rng, f64(lx.setup(rng, model)[0]))
    x = rng.normal(size=(3, *spatial, channels)) * 2 + 0.5

    def torch_fn(tx, p):
        first = tx.movedim(-1, 1)
        return F.batch_norm(first, None, None, p["scale"], p["bias"], training=True, eps=1e-5).movedim(1, -1)

    check_against(model, ps, torch_fn, x, rng)


@pytest.mark.parametrize("shape", [(6, 4), (5, 3, 4, 4)])
def test_batchnorm_running_stats_and_testmode_match_torch(shape):
    rng = np.random.default_rng(1)
    channels = shape[-1]
    model = lx.BatchNorm(channels, momentum=0.3)
    ps, st = f64(lx.setup(rng, model))
    ps = random_params(rng, ps)
    torch_bn = (torch.nn.BatchNorm1d if len(shape) == 2 else torch.nn.BatchNorm2d)(channels, momentum=0.3).double()
    with torch.no_grad():
        torch_bn.weight.copy_(torch.tensor(ps["scale"]))
        torch_bn.bias.copy_(torch.tensor(ps["bias"]))
    to_first = (0, 3, 1, 2) if len(shape) == 4 else (0, 1)
    for _ in range(4):
        x = rng.normal(size=shape) * 3 + 2
        y, st = model(x, ps, st)
        ty = torch_bn(torch.tensor(x.transpose(to_first)))
        assert rel_err(y.transpose(to_first), ty.detach().numpy()) < 1e-6
    assert st["training"] is True
    assert rel_err(st["running_mean"], torch_bn.running_mean.numpy()) < 1e-6
    assert rel_err(st["running_var"], torch_bn.running_var.numpy()) < 1e-6

    test_st = lx.testmode(st)
    torch_bn.eval()
    x = rng.normal(size=shape)
    y, st_after = model(x, ps, test_st)
    assert rel_err(y.transpose(to_first), torch_bn(torch.tensor(x.transpose(to_first))).detach().numpy()) < 1e-6
    assert st_after["running_mean"] is test_st["running_mean"]  # test mode leaves the statistics alone

    # Test-mode gradients: the running statistics are constants.
    r = rng.normal(size=shape)
    _, (gx, gps) = value_grads(model, x, ps, test_st, r)
    tx = torch.tensor(x.transpose(to_first), requires_grad=True)
    (torch_bn(tx) * torch.tensor(r.transpose(to_first))).sum().backward()
    assert rel_err(gx.transpose(to_first), tx.grad.numpy()) < 1e-6
    assert rel_err(gps["scale"], torch_bn.weight.grad.numpy()) < 1e-6
    assert rel_err(gps["bias"], torch_bn.bias.grad.numpy()) < 1e-6


def test_batchnorm_running_stats_are_raw_arrays_under_differentiation():
    rng = np.random.default_rng(0)
    model = lx.BatchNorm(3)
    ps, st = f64(lx.setup(rng, model))
    x = rng.normal(size=(4, 3))

    def loss(ps):
        y, new_st = model(x, ps, st)
        return (y * y).sum(), new_st

    (_, new_st), _ = lx.value_and_grad(loss, has_aux=True)(ps)
    assert type(new_st["running_mean"]) is np.ndarray and type(new_st["running_var"]) is np.ndarray
    assert st["running_mean"].tolist() == [0.0, 0.0, 0.0]  # the input state is untouched


def test_batchnorm_without_tracking_uses_batch_stats_in_testmode():
    rng = np.random.default_rng(0)
    model = lx.BatchNorm(2, track_stats=False, affine=False)
    ps, st = lx.setup(rng, model)
    assert st == {"training": True} and ps == {}
    x = rng.normal(size=(5, 2)) * 4 + 3
    y, _ = model(x, ps, lx.testmode(st))
    expected = F.batch_norm(torch.tensor(x), None, None, training=True, eps=1e-5).numpy()
    assert rel_err(y, expected) < 1e-6


def test_fused_primitives_match_finite_differences():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 4, 5))
    r = rng.normal(size=x.shape)
    for fn in (lambda v: normalize(v, axis=(0, 2), epsilon=1e-3), lambda v: rms_normalize(v, axis=-1, epsilon=1e-3)):
        g = lx.grad(lambda v: (fn(v) * r).sum())(x)
        h = 1e-6
        for idx in [(0, 0, 0), (1, 2, 3), (2, 3, 4)]:
            dx = np.zeros_like(x)
            dx[idx] = h
            numeric = ((fn(x + dx) * r).sum() - (fn(x - dx) * r).sum()) / (2 * h)
            assert abs(numeric - g[idx]) < 1e-6


def test_bad_input_names_layer_and_shapes():
    rng = np.random.default_rng(0)
    bn = lx.BatchNorm(3)
    ps, st = lx.setup(rng, bn)
    with pytest.raises(lx.LayerError, match=r"BatchNorm\(3\): expected input of shape \(N, \.\.\., 3\).*got \(2, 4\)"):
        bn(np.ones((2, 4), np.float32), ps, st)
    with pytest.raises(lx.LayerError, match="more than 1 value per channel"):
        bn(np.ones((1, 3), np.float32), ps, st)
    ln = lx.LayerNorm((2, 3))
    ps, st = lx.setup(rng, ln)
    with pytest.raises(lx.LayerError, match=r"expected input of shape \(\.\.\., 2, 3\), got \(4, 3, 2\)"):
        ln(np.ones((4, 3, 2), np.float32), ps, st)
    model = lx.Chain(lx.Dense(4, 6), lx.GroupNorm(2, 4))
    ps, st = lx.setup(rng, model)
    with pytest.raises(lx.LayerError, match=r"^layer_2: GroupNorm\(2, 4\): expected input of shape \(N, \.\.\., 4\)"):
        model(np.ones((2, 4), np.float32), ps, st)
    with pytest.raises(ValueError, match="divisible"):
        lx.GroupNorm(3, 4)
    with pytest.raises(ValueError, match="momentum"):
        lx.BatchNorm(3, momentum=1.5)
    rms = lx.RMSNorm(4)
    ps, st = lx.setup(rng, rms)
    with pytest.raises(lx.LayerError, match="expected parameter 'scale' of shape"):
        rms(np.ones((2, 4), np.float32), {"scale": np.ones(3, np.float32)}, st)


def test_scale_shift_rejects_an_affine_map_not_of_the_trailing_shape():
    y = np.ones((3, 4))
    with pytest.raises(ValueError, match=r"trailing shape of y \(3, 4\), got \(3,\) and \(3,\)"):
        lx.ops.scale_shift(y, np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match=r"got \(4,\) and \(1,\)"):
        lx.ops.scale_shift(y, np.ones(4), np.ones(1))


class _TwoRanks:
    """A stand-in backend of 2 ranks holding the same batch (a sum over the ranks doubles),
    recording its calls; `others` is what the agreement says the other rank is in."""

    size = 2

    def __init__(self, others=None):
        self.calls, self.others = [], others

    def call(self, name, compatible=(), layout=""):
        import contextlib

        self.calls.append(name)
        return contextlib.nullcontext(None if self.others is None else [name, self.others])

    def allreduce(self, a, op="sum"):
        a *= 2


def test_batchnorm_synchronises_over_the_ranks_only_inside_a_data_parallel_step(monkeypatch):
    from luxnn.distributed import backend as backends
    from luxnn.distributed import step as dp

    bn = lx.BatchNorm(3)
    ps, st = f64(lx.setup(np.random.default_rng(0), bn))
    x = np.random.default_rng(1).normal(size=(6, 3))
    backend = _TwoRanks()
    monkeypatch.setattr(backends, "_current", backend)  # as after dist.initialize: not a reason to synchronise
    _, alone = bn(x, ps, st)
    assert backend.calls == [] and dp.current() is None  # no step in progress: this rank's batch only
    step = dp.Step(backend, drop=lambda: None)
    dp.begin(step)
    try:
        _, averaged = bn(x, ps, st)
    finally:
        dp.end(step)
    assert backend.calls == [dp.RUNNING] and dp.current() is None
    np.testing.assert_allclose(averaged["running_mean"], alone["running_mean"], rtol=1e-12)  # the same batch on both ranks
    np.testing.assert_allclose(averaged["running_var"], alone["running_var"], rtol=1e-12)


def test_a_layer_whose_step_another_rank_abandoned_drops_the_step_and_raises():
    from luxnn.distributed import step as dp

    bn = lx.BatchNorm(3, sync=True)
    ps, st = f64(lx.setup(np.random.default_rng(0), bn))
    dropped = []
    step = dp.Step(_TwoRanks(others=dp.UNUSED), drop=lambda: dropped.append(True))
    dp.begin(step)
    try:
        with pytest.raises(RuntimeError, match="a rank abandoned this step's gradients"):
            bn(np.ones((4, 3)), ps, st)
        assert dropped == [True] and dp.current() is None  # the step ends on this rank too
    finally:
        dp.end(step)
