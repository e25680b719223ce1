"""Every primitive's VJP against central finite differences in float64.

One checker, `check_grad`, does all the work: it contracts the output (any tree of arrays)
with fixed random weights, differentiates that scalar with `value_and_grad` and compares
with central differences of the plain NumPy forward, argument by argument.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.special

import luxnn as lx
from luxnn import ops, tree
from luxnn.ad import primitive
from luxnn.ad import primitives as P

R = np.random.default_rng(20240601)


def normal(*shape: int) -> np.ndarray:
    return R.normal(size=shape)


def positive(*shape: int) -> np.ndarray:
    return R.uniform(0.5, 2.0, size=shape)


def away(*shape: int) -> np.ndarray:
    """Normal values pushed at least 0.2 away from 0, where kinks (relu, abs) live."""
    x = R.normal(size=shape)
    return np.sign(x) * (0.2 + np.abs(x))


def numeric_grad(fn, args: list, n: int, eps: float) -> np.ndarray:
    x = args[n]
    g = np.zeros_like(x)
    flat = x.reshape(-1)  # a view: writing into it perturbs args[n]
    for i in range(x.size):
        orig = flat[i]
        flat[i] = orig + eps
        hi = fn(*args)
        flat[i] = orig - eps
        lo = fn(*args)
        flat[i] = orig
        g.reshape(-1)[i] = (hi - lo) / (2 * eps)
    return g


def check_grad(f, *args, argnums=None, ref=None, eps=1e-6, rtol=1e-6, atol=1e-7):
    """Compare ``value_and_grad`` of ``f`` with central differences.

    `f` maps arrays to a tree of arrays; `argnums` defaults to every floating array
    argument; `ref`, a plain NumPy function, checks the forward value too.
    """
    args = [np.array(a) if isinstance(a, np.ndarray) else a for a in args]  # owned copies
    if argnums is None:
        argnums = tuple(i for i, a in enumerate(args) if isinstance(a, np.ndarray) and a.dtype.kind == "f")
    out = f(*args)
    if ref is not None:
        for got, want in zip(tree.leaves(out), tree.leaves(ref(*args)), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    r = np.random.default_rng(0)
    weights = [r.normal(size=np.shape(o)) for o in tree.leaves(out)]

    def scalar(*a):
        return sum((o * w).sum() for o, w in zip(tree.leaves(f(*a)), weights, strict=True))

    value, grads = lx.value_and_grad(scalar, argnums=argnums)(*args)
    np.testing.assert_allclose(value, scalar(*args), rtol=1e-12)
    for n, g in zip(argnums, grads, strict=True):
        assert g.shape == args[n].shape and g.dtype == args[n].dtype, (n, g.shape, g.dtype)
        np.testing.assert_allclose(g, numeric_grad(scalar, args, n, eps), rtol=rtol, atol=atol,
                                   err_msg=f"gradient of argument {n}")
    return grads


def case(name, f, *args, **check_kw):
    return pytest.param(f, args, check_kw, id=name)


# -- cases ----------------------------------------------------------------------------------

BROADCAST = [((3, 4), (3, 4)), ((3, 4), (4,)), ((2, 1, 4), (3, 1)), ((3, 4), ()), ((), (2, 3))]

BINARY = [
    case(f"{name}-{sa}-{sb}", fn, make_a(*sa), make_b(*sb))
    for name, fn, make_a, make_b in [
        ("add", P.add, normal, normal),
        ("subtract", P.subtract, normal, normal),
        ("multiply", P.multiply, normal, normal),
        ("divide", P.divide, normal, away),
        ("power", P.power, positive, normal),
        ("maximum", P.maximum, normal, normal),
        ("minimum", P.minimum, normal, normal),
    ]
    for sa, sb in BROADCAST
]

SQRT_2_OVER_PI = math.sqrt(2 / math.pi)

UNARY = [
    case("negative", P.negative, normal(3, 4)),
    case("exp", P.exp, normal(3, 4)),
    case("log", P.log, positive(3, 4)),
    case("log1p", P.log1p, R.uniform(-0.5, 2.0, (3, 4))),
    case("sqrt", P.sqrt, positive(3, 4)),
    case("square", P.square, normal(3, 4)),
    case("abs", P.abs, away(3, 4)),
    case("tanh", P.tanh, normal(3, 4)),
    case("sin", P.sin, normal(3, 4)),
    case("cos", P.cos, normal(3, 4)),
    case("clip", lambda x: P.clip(x, -0.5, 0.5), away(3, 4) * 0.8),
    *[case(f"{fn.__name__}-{k}", lambda x, fn=fn, k=k: fn(x, k), normal(2, 3, 4),
           ref=lambda x, fn=fn, k=k: getattr(np, fn.__name__)(x, k))
      for fn in (P.tril, P.triu) for k in (0, 1, -1)],
    case("sigmoid", ops.sigmoid, np.r_[normal(8), 30.0, -30.0], ref=scipy.special.expit),
    case("relu", ops.relu, away(3, 4), ref=lambda x: np.maximum(x, 0)),
    case("gelu-tanh", ops.gelu, normal(3, 4) * 2,
         ref=lambda x: 0.5 * x * (1 + np.tanh(SQRT_2_OVER_PI * (x + 0.044715 * x**3)))),
    case("gelu-erf", lambda x: ops.gelu(x, approximate="none"), normal(3, 4) * 2,
         ref=lambda x: 0.5 * x * (1 + scipy.special.erf(x / math.sqrt(2)))),
    case("softplus", ops.softplus, np.r_[normal(8), 30.0, -30.0], ref=lambda x: np.logaddexp(0, x)),
    case("silu", ops.silu, normal(3, 4) * 3, ref=lambda x: x * scipy.special.expit(x)),
    case("leaky_relu", lambda x: ops.leaky_relu(x, negative_slope=0.1), away(3, 4),
         ref=lambda x: np.where(x > 0, x, 0.1 * x)),
    case("elu", lambda x: ops.elu(x, alpha=1.5), away(3, 4),
         ref=lambda x: np.where(x > 0, x, 1.5 * np.expm1(x))),
]

POWER = [
    case("power-int-exponent-negative-base", lambda x: P.power(x, 3), normal(3, 4)),
    case("power-half", lambda x: P.power(x, 0.5), positive(3, 4)),
    case("power-scalar-base", lambda x: P.power(2.0, x), normal(3, 4)),
    case("power-array-exponent", P.power, positive(2, 3), normal(3)),
    case("power-array-base-broadcast", P.power, positive(3), normal(2, 3)),
]

WHERE = [
    case("where", lambda a, b, c=normal(3, 4) > 0: P.where(c, a, b), normal(3, 4), normal(3, 4)),
    case("where-broadcast", lambda a, b, c=normal(4) > 0: P.where(c, a, b), normal(3, 1), normal(4)),
    case("where-scalar-branch", lambda a, c=normal(2, 3) > 0: P.where(c, a, 0.0), normal(2, 3)),
    case("where-condition-broadcasts", lambda a, b, c=normal(2, 3, 4) > 0: P.where(c, a, b),
         normal(4), normal(3, 1)),
]

MATMUL = [
    case(f"matmul-{sa}@{sb}", P.matmul, normal(*sa), normal(*sb))
    for sa, sb in [
        ((3, 4), (4, 5)),
        ((2, 3, 4), (4, 5)),
        ((2, 1, 3, 4), (5, 4, 2)),
        ((3, 4), (2, 4, 5)),
        ((4,), (4, 5)),
        ((3, 4), (4,)),
        ((4,), (4,)),
        ((4,), (2, 4, 5)),
        ((2, 3, 4), (4,)),
    ]
]

AXES = [None, 1, -1, (0, 2), (-1, 0)]
REDUCTIONS = [
    case(f"{name}-axis={axis}-keepdims={keepdims}", lambda x, fn=fn, axis=axis, keepdims=keepdims:
         fn(x, axis=axis, keepdims=keepdims), normal(2, 3, 4),
         ref=lambda x, name=name, axis=axis, keepdims=keepdims:
         getattr(np, name)(x, axis=axis, keepdims=keepdims))
    for name, fn in [("sum", P.sum), ("mean", P.mean), ("max", P.max), ("min", P.min), ("var", P.var)]
    for axis in AXES
    for keepdims in (False, True)
] + [
    case("var-correction", lambda x: P.var(x, axis=0, correction=1), normal(4, 3),
         ref=lambda x: np.var(x, axis=0, ddof=1)),
    case("var-ddof", lambda x: P.var(x, ddof=1), normal(4, 3), ref=lambda x: np.var(x, ddof=1)),
]

SHAPES = [
    case("reshape", lambda x: P.reshape(x, (4, 6)), normal(2, 3, 4)),
    case("reshape-infer", lambda x: P.reshape(x, (-1,)), normal(2, 3, 4)),
    case("transpose-reverse", P.transpose, normal(2, 3, 4)),
    case("transpose-axes", lambda x: P.transpose(x, (1, 0, 2)), normal(2, 3, 4)),
    case("transpose-negative-axes", lambda x: P.transpose(x, (1, 0, -1)), normal(2, 3, 4),
         ref=lambda x: np.transpose(x, (1, 0, 2))),
    case("permute_dims", lambda x: P.permute_dims(x, (2, 0, 1)), normal(2, 3, 4)),
    case("permute_dims-negative", lambda x: P.permute_dims(x, (-1, -3, -2)), normal(2, 3, 4),
         ref=lambda x: np.transpose(x, (2, 0, 1))),
    case("swapaxes", lambda x: P.swapaxes(x, 0, -1), normal(2, 3, 4), ref=lambda x: np.swapaxes(x, 0, -1)),
    case("matrix_transpose", P.matrix_transpose, normal(2, 3, 4), ref=lambda x: np.swapaxes(x, -1, -2)),
    *[case(f"moveaxis-{s}-{d}", lambda x, s=s, d=d: P.moveaxis(x, s, d), normal(2, 3, 4),
           ref=lambda x, s=s, d=d: np.moveaxis(x, s, d))
      for s, d in [(0, -1), (-1, 0), (1, 2), (2, 1)]],
    *[case(f"expand_dims-{a}", lambda x, a=a: P.expand_dims(x, a), normal(2, 3),
           ref=lambda x, a=a: np.expand_dims(x, a))
      for a in [0, -1, 1, (0, -1)]],
    *[case(f"squeeze-{a}", lambda x, a=a: P.squeeze(x, a), normal(2, 1, 3, 1),
           ref=lambda x, a=a: np.squeeze(x, a))
      for a in [None, 1, -1, (1, 3)]],
    case("broadcast_to", lambda x: P.broadcast_to(x, (2, 3, 4)), normal(3, 1)),
    case("broadcast_to-scalar", lambda x: P.broadcast_to(x, (2, 2)), normal()),
    case("concat-0", lambda a, b: P.concat([a, b]), normal(2, 3), normal(1, 3)),
    case("concat-last", lambda a, b: P.concat([a, b], axis=-1), normal(2, 3), normal(2, 2)),
    case("concat-None", lambda a, b: P.concat([a, b], axis=None), normal(2, 3), normal(4)),
    case("concat-with-constant", lambda a, b, c=normal(1, 3): P.concat([a, c, b]),
         normal(2, 3), normal(1, 3)),
    *[case(f"stack-{a}", lambda x, y, a=a: P.stack([x, y, x], axis=a), normal(2, 3), normal(2, 3))
      for a in [0, 1, -1]],
    case("split-sections", lambda x: P.split(x, 3, axis=-1), normal(2, 6),
         ref=lambda x: np.split(x, 3, axis=-1)),
    case("split-indices", lambda x: P.split(x, [1, 4]), normal(5, 2), ref=lambda x: np.split(x, [1, 4])),
]

MASK = normal(2, 3, 4) > 0
INDEXING = [
    case(f"getitem-{name}", lambda x, index=index: P.getitem(x, index), normal(3, 4, 5),
         ref=lambda x, index=index: x[index])
    for name, index in [
        ("int", 1),
        ("negative-int", -1),
        ("slice-step", (slice(None), slice(None, None, 2))),
        ("negative-step", (slice(None, None, -1), 1)),
        ("negative-step-ellipsis", (slice(1, None), Ellipsis, slice(None, None, -2))),
        ("none", (None, slice(None), -2)),
        ("ellipsis-none", (Ellipsis, None, slice(1, 3))),
        ("all-ints", (0, 1, 2)),
        ("repeated-list", [0, 0, 2, 0]),
        ("repeated-2d-array", np.array([[0, 1], [1, 1]])),
        ("negative-array", np.array([-1, 0, -1])),
        ("slice-and-array", (slice(None), [2, 2, 0])),
        ("array-pairs", ([0, 1, 1, 1], [2, 3, 3, 3])),
        ("array-slice-array", ([0, 0], slice(None), [4, 4])),
    ]
] + [
    case("getitem-bool-mask", lambda x: P.getitem(x, MASK), normal(2, 3, 4), ref=lambda x: x[MASK]),
    case("getitem-bool-mask-leading", lambda x: P.getitem(x, MASK[..., 0]), normal(2, 3, 4),
         ref=lambda x: x[MASK[..., 0]]),
    case("take-flat", lambda x: P.take(x, np.array([5, 5, 0, 11])), normal(3, 4)),
    case("take-axis0-repeated", lambda x: P.take(x, [2, 2, 0], axis=0), normal(3, 4)),
    case("take-axis-last-2d", lambda x: P.take(x, np.array([[1, 1], [3, -1]]), axis=-1), normal(2, 3, 4),
         ref=lambda x: np.take(x, np.array([[1, 1], [3, -1]]), axis=-1)),
]

SOFTMAX = [
    *[case(f"logsumexp-axis={a}-keepdims={k}", lambda x, a=a, k=k: ops.logsumexp(x, axis=a, keepdims=k),
           normal(2, 3, 4) * 3, ref=lambda x, a=a, k=k: scipy.special.logsumexp(x, axis=a, keepdims=k))
      for a in [-1, 0, None, (0, 2)] for k in (False, True)],
    *[case(f"softmax-{a}", lambda x, a=a: ops.softmax(x, axis=a), normal(3, 5) * 3,
           ref=lambda x, a=a: scipy.special.softmax(x, axis=a)) for a in [-1, 0]],
    *[case(f"log_softmax-{a}", lambda x, a=a: ops.log_softmax(x, axis=a), normal(3, 5) * 3,
           ref=lambda x, a=a: scipy.special.log_softmax(x, axis=a)) for a in [-1, 0]],
]

NORM = [
    case(f"scale_shift-{shape}-{affine}", ops.scale_shift, normal(*shape), normal(*affine), normal(*affine),
         ref=lambda y, s, b: y * s + b)
    for shape, affine in [((3, 4), (4,)), ((2, 3, 4), (3, 4)), ((3, 4), (3, 4))]
]


@pytest.mark.parametrize("f, args, check_kw",
                         BINARY + UNARY + POWER + WHERE + MATMUL + REDUCTIONS + SHAPES + INDEXING + SOFTMAX + NORM)
def test_vjp_matches_finite_differences(f, args, check_kw):
    check_grad(f, *args, **check_kw)


def test_astype_round_trip_through_float32():
    x = normal(3, 4)

    def f(x):
        return P.astype(P.astype(x, np.float32) * np.float32(3), np.float64)

    # Finite differences through float32 rounding need a wide step; f is linear, so that is exact
    # up to rounding.
    (g,) = check_grad(f, x, eps=1e-2, rtol=1e-4, atol=1e-5)
    assert g.dtype == np.float64
    _, vjp = P.astype.raw(x, np.float32)
    assert vjp(np.ones((3, 4), np.float32), (True,))[0].dtype == np.float64


def test_astype_to_integer_is_a_constant():
    x = normal(3, 4) * 3
    g = lx.grad(lambda x: (x * P.astype(x, np.int64)).sum())(x)
    np.testing.assert_array_equal(g, x.astype(np.int64))


# -- dispatch: array namespace, NumPy functions and ufuncs, Python operators, methods -----------

C = normal(3, 4)


def through_namespace(x):
    """Array-API code, as layers write it: NumPy on arrays, the traced namespace when traced."""
    xp = lx.array_namespace(x)
    x = xp.asarray(x)
    y = xp.sum(xp.exp(x) * xp.tanh(x), axis=0) + xp.mean(xp.concat([x, x * 2]), axis=0)
    return y + xp.permute_dims(xp.reshape(x, (4, 3)), (1, 0))[0] * xp.asarray(x, dtype=xp.float64)[1]


DISPATCH = {
    "namespace": through_namespace,
    "np.exp": np.exp,
    "np.sum-axis": lambda x: np.sum(x, axis=0),
    "np.sum": np.sum,
    "np.mean": np.mean,
    "np.var-ddof": lambda x: np.var(x, axis=1, ddof=1),
    "np.max": lambda x: np.max(x, axis=-1),
    "np.maximum": lambda x: np.maximum(x, 0.1),
    "np.abs": np.abs,
    "np.sqrt": lambda x: np.sqrt(x * x + 1),
    "np.matmul-constant-left": lambda x: np.matmul(C.T, x),
    "np.concatenate": lambda x: np.concatenate([x, C], axis=1),
    "np.stack": lambda x: np.stack([x, C]),
    "np.split": lambda x: np.split(x, 2, axis=1),
    "np.where": lambda x: np.where(x > 0, x, 0.1 * x),
    "np.transpose": np.transpose,
    "np.reshape": lambda x: np.reshape(x, (2, 6)),
    "np.swapaxes": lambda x: np.swapaxes(x, 0, 1),
    "np.moveaxis": lambda x: np.moveaxis(x[None], 0, -1),
    "np.expand_dims": lambda x: np.expand_dims(x, 1),
    "np.squeeze": lambda x: np.squeeze(x[:, None]),
    "np.broadcast_to": lambda x: np.broadcast_to(x, (2, 3, 4)),
    "np.take": lambda x: np.take(x, [1, 1], axis=1),
    "np.clip": lambda x: np.clip(x, -0.5, 0.5),
    "np.tril": lambda x: np.tril(x, -1),
    "xp.triu": lambda x: lx.array_namespace(x).triu(x, 1),
    "scalar+x": lambda x: 2.0 + x,
    "x+scalar": lambda x: x + 2,
    "scalar-x": lambda x: 3 - x,
    "x-scalar": lambda x: x - 3.0,
    "scalar*x": lambda x: 2 * x,
    "x*scalar": lambda x: x * 2.5,
    "scalar/x": lambda x: 3.0 / x,
    "x/scalar": lambda x: x / 3,
    "x**scalar": lambda x: x**2,
    "scalar**x": lambda x: 2.0**x,
    "npscalar*x": lambda x: np.float64(2.0) * x,
    "npscalar-x": lambda x: np.float64(2.0) - x,
    "array-x": lambda x: C - x,
    "array/x": lambda x: C / x,
    "array@x": lambda x: C.T @ x,
    "x@array": lambda x: x @ C.T,
    "x@x": lambda x: x @ x.T,
    "neg-pos-abs": lambda x: -(+abs(x)),
    "x*x": lambda x: x * x,
    "method-sum": lambda x: x.sum(axis=1, keepdims=True),
    "method-mean-max-min": lambda x: x.mean() + x.max(axis=0) - x.min(axis=1).sum(),
    "method-var": lambda x: x.var(axis=0, ddof=1),
    "method-reshape-varargs": lambda x: x.reshape(2, 6),
    "method-transpose-varargs": lambda x: x[None].transpose(2, 0, 1),
    "method-T-mT": lambda x: x.T + x.mT,
    "method-squeeze-swapaxes": lambda x: x[:, None].squeeze(1).swapaxes(0, 1),
    "getitem-traced-rows": lambda x: x[x[:, 0] > 0],
    "iterate-rows": lambda x: [row * i for i, row in enumerate(x)],
}


@pytest.mark.parametrize("f", DISPATCH.values(), ids=DISPATCH.keys())
def test_dispatch_on_traced_values(f):
    check_grad(f, away(3, 4))


def test_asarray_keeps_traced_values_and_makes_constants():
    def f(x):
        xp = lx.array_namespace(x)
        c = xp.asarray([1.0, 2.0, 3.0])
        assert type(c) is np.ndarray
        return (xp.asarray(x, dtype=xp.float32) * c).sum() + (xp.array(x) * c).sum()

    g = lx.grad(f)(np.ones(3))
    assert g.dtype == np.float64
    np.testing.assert_array_equal(g, [2.0, 4.0, 6.0])


def test_array_namespace_resolves_per_argument():
    x = normal(2)
    assert lx.array_namespace(x) is np
    assert lx.array_namespace(None, 1.0, x) is np
    seen = []

    def f(x, c):
        seen.append(lx.array_namespace(c, x))
        return (x * c).sum()

    lx.grad(f)(x, x)
    assert isinstance(seen[0], lx.ad.TracedNamespace)
    assert seen[0].float32 is np.float32 and seen[0].newaxis is None


# -- conventions at non-differentiable points ----------------------------------------------------


@pytest.mark.parametrize("fn, wins", [(P.maximum, np.greater), (P.minimum, np.less)])
def test_binary_extremum_ties_split_evenly(fn, wins):
    a = np.array([1.0, 2.0, 3.0, -1.0])
    b = np.array([1.0, 0.0, 5.0, -1.0])
    ga, gb = lx.grad(lambda a, b: fn(a, b).sum(), argnums=(0, 1))(a, b)
    tie = a == b
    np.testing.assert_array_equal(ga, np.where(tie, 0.5, wins(a, b)))
    np.testing.assert_array_equal(gb, np.where(tie, 0.5, wins(b, a)))
    (g,) = lx.grad(lambda a: fn(a, a).sum(), argnums=(0,))(a)  # both operands are one leaf
    np.testing.assert_array_equal(g, np.ones(4))


@pytest.mark.parametrize("fn", [P.max, P.min])
def test_reduction_ties_split_evenly(fn):
    x = np.array([[2.0, 2.0, 2.0, 1.0], [-1.0, 3.0, 3.0, -1.0]])
    extreme = fn(x, axis=1, keepdims=True)
    g = lx.grad(lambda x: (fn(x, axis=1) * np.array([3.0, 2.0])).sum())(x)
    hit = x == extreme
    np.testing.assert_allclose(g, hit / hit.sum(axis=1, keepdims=True) * np.array([[3.0], [2.0]]))


def test_relu_gradient_at_zero_is_zero():
    g = lx.grad(lambda x: ops.relu(x).sum())(np.array([-1.0, 0.0, 1.0]))
    np.testing.assert_array_equal(g, [0.0, 0.0, 1.0])


# -- numerical stability ---------------------------------------------------------------------------

STRICT = {"over": "raise", "divide": "raise", "invalid": "raise"}  # underflow to 0 is fine


def test_softmax_family_is_stable_at_large_magnitudes():
    x = normal(4, 6) * 1e3
    w = normal(4, 6)
    with np.errstate(**STRICT):
        lse, g_lse = lx.value_and_grad(lambda x: ops.logsumexp(x, axis=-1).sum())(x)
        _, g_sm = lx.value_and_grad(lambda x: (ops.softmax(x) * w).sum())(x)
        _, g_lsm = lx.value_and_grad(lambda x: (ops.log_softmax(x) * w).sum())(x)
    p = scipy.special.softmax(x, axis=-1)
    np.testing.assert_allclose(lse, scipy.special.logsumexp(x, axis=-1).sum(), rtol=1e-12)
    np.testing.assert_allclose(ops.log_softmax(x), scipy.special.log_softmax(x, axis=-1), atol=1e-9)
    np.testing.assert_allclose(g_lse, p, atol=1e-12)
    np.testing.assert_allclose(g_sm, p * (w - (p * w).sum(-1, keepdims=True)), atol=1e-12)
    np.testing.assert_allclose(g_lsm, w - p * w.sum(-1, keepdims=True), atol=1e-9)


@pytest.mark.parametrize("fn", [ops.sigmoid, ops.softplus, ops.silu, ops.gelu, ops.elu])
def test_activations_are_stable_at_large_magnitudes(fn):
    x = np.array([-1e3, -40.0, 40.0, 1e3])
    with np.errstate(**STRICT):
        value, g = lx.value_and_grad(lambda x: fn(x).sum())(x)
    assert np.isfinite(value) and np.isfinite(g).all()


# -- float32 stays float32 ---------------------------------------------------------------------------


def cotangent_dtypes(f, *args):
    """The dtypes of the forward output and of the cotangents reaching each argument."""
    seen = []

    @primitive
    def probe(x):
        def vjp(g, needs):
            seen.append(g.dtype)
            return (g,)

        return x, vjp

    out = []

    def scalar(*a):
        y = f(*(probe(x) for x in a))
        out.append(y.dtype)
        return y.sum()

    lx.grad(scalar, argnums=tuple(range(len(args))))(*args)
    return out + seen


FLOAT32 = {
    "maximum": lambda x, y: P.maximum(x, y),
    "minimum": lambda x, y: P.minimum(x, y[0]),
    "max": lambda x, y: P.max(x, axis=0) + P.min(y, axis=-1).sum(),
    "var-mean": lambda x, y: P.var(x, axis=0) + P.mean(y),
    "power": lambda x, y: P.power(P.abs(x) + 1, y),
    "divide": lambda x, y: x / (y * y + 1),
    "matmul": lambda x, y: x @ y.T,
    "activations": lambda x, y: ops.sigmoid(x) + ops.softplus(y) + ops.gelu(x) + ops.silu(y)
    + ops.elu(x) + ops.leaky_relu(y) + ops.relu(x) + ops.gelu(y, approximate="none"),
    "unary": lambda x, y: P.exp(x) + P.log1p(P.abs(y)) + P.sqrt(x * x + 1) + P.tanh(y) + P.log(P.abs(x) + 1),
    "softmax": lambda x, y: ops.softmax(x) + ops.log_softmax(y) + ops.logsumexp(x, keepdims=True),
    "indexing": lambda x, y: x[::-1] + y[[0, 0, 1]] + P.take(x, [1, 1, 2], axis=0) + y[1:, None].sum(),
    "shapes": lambda x, y: P.stack([x, y]).sum(0) + P.split(P.concat([x, y], axis=1), 2, axis=1)[1],
}


@pytest.mark.parametrize("f", FLOAT32.values(), ids=FLOAT32.keys())
def test_float32_stays_float32(f):
    x, y = normal(3, 4).astype(np.float32), away(3, 4).astype(np.float32)
    assert cotangent_dtypes(f, x, y) == [np.float32] * 3
