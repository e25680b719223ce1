"""value_and_grad's contract: argnums, has_aux, errors, constants, and the arrays it hands out."""

from __future__ import annotations

import itertools
from collections import namedtuple

import numpy as np
import pytest

import luxnn as lx
from luxnn import tree
from luxnn.ad import primitives as P

R = np.random.default_rng(7)


def normal(*shape, dtype=np.float64):
    return R.normal(size=shape).astype(dtype)


def test_argnums_tuple_orders_gradients_as_asked():
    a, b, c = normal(3), normal(3), normal(3)
    value, (gc, ga) = lx.value_and_grad(lambda a, b, c: (a * b * c * c).sum(), argnums=(2, 0))(a, b, c)
    np.testing.assert_allclose(value, (a * b * c * c).sum())
    np.testing.assert_allclose(gc, 2 * a * b * c)
    np.testing.assert_allclose(ga, b * c * c)


def test_argnums_negative_and_out_of_range():
    a, b = normal(3), normal(3)
    np.testing.assert_allclose(lx.grad(lambda a, b: (a * b).sum(), argnums=-1)(a, b), a)
    with pytest.raises(ValueError, match="argnums 2 out of range for 2 arguments"):
        lx.grad(lambda a, b: (a * b).sum(), argnums=2)(a, b)


def test_gradient_of_a_tree_keeps_its_structure_and_keyword_arguments_pass_through():
    Pair = namedtuple("Pair", "w b")
    ps = {"layer": Pair(normal(2, 3), normal(3)), "scale": [normal(1)]}

    def f(ps, x, *, power):
        y = x @ ps["layer"].w + ps["layer"].b
        return (ps["scale"][0] * y**power).sum()

    x = normal(4, 2)
    g = lx.grad(f)(ps, x, power=2)
    assert tree.structure(g) == tree.structure(ps) and isinstance(g["layer"], Pair)
    y = x @ ps["layer"].w + ps["layer"].b
    np.testing.assert_allclose(g["layer"].b, (2 * ps["scale"][0] * y).sum(0))
    np.testing.assert_allclose(g["scale"][0], [(y**2).sum()])


def test_has_aux_returns_raw_aux_and_does_not_differentiate_it():
    x = normal(4)

    def f(x):
        h = x * x
        return h.sum(), {"h": h, "n": 3}

    (value, aux), g = lx.value_and_grad(f, has_aux=True)(x)
    assert type(aux["h"]) is np.ndarray and aux["n"] == 3
    np.testing.assert_allclose(aux["h"], x * x)
    np.testing.assert_allclose(value, (x * x).sum())
    np.testing.assert_allclose(g, 2 * x)
    g2, aux2 = lx.grad(f, has_aux=True)(x)
    np.testing.assert_allclose(g2, 2 * x)
    assert aux2["n"] == 3
    with pytest.raises(TypeError, match="pair"):
        lx.value_and_grad(lambda x: x.sum(), has_aux=True)(x)


@pytest.mark.parametrize("f", [lambda x: x * 2, lambda x: x[:2].sum(axis=0)], ids=["elementwise", "row"])
def test_non_scalar_output_is_an_error(f):
    with pytest.raises(TypeError, match=r"scalar.*shape \(\d"):
        lx.value_and_grad(f)(normal(3, 2))


def test_non_float_argument_is_a_type_error_naming_its_path():
    ps = {"layer_1": {"weight": normal(2, 2), "index": np.arange(2)}}
    with pytest.raises(TypeError, match=r"layer_1/index.*int64"):
        lx.grad(lambda ps: ps["layer_1"]["weight"].sum())(ps)
    with pytest.raises(TypeError, match=r"layer_1/1.*int"):
        lx.grad(lambda ps: ps["layer_1"][0].sum())({"layer_1": [normal(2), 3]})
    with pytest.raises(TypeError, match="the argument"):
        lx.grad(lambda x: x.sum())(np.arange(3))


def test_integer_inputs_are_constants():
    w = normal(5, 3)
    labels = np.array([0, 2, 2, 1])
    counts = np.array([[1, 2, 3]])

    def f(w, labels, counts):
        rows = P.take(w, labels, axis=1)  # integer index array: a constant
        return (rows * counts.T.sum()).sum() + (w * counts).sum() + (w * (labels.sum() + 1)).sum()

    g = lx.grad(f)(w, labels, counts)
    want = np.zeros_like(w)
    np.add.at(want, (slice(None), labels), counts.sum())
    np.testing.assert_allclose(g, want + counts + labels.sum() + 1)


INDEPENDENT = {
    "other-argument": lambda x, y: (y * y).sum(),
    "numpy-scalar": lambda x, y: np.float64(2.0),
    "python-float": lambda x, y: 2.0,
    "stop_gradient": lambda x, y: (lx.stop_gradient(x["a"]) * 3).sum(),
}


@pytest.mark.parametrize("f", INDEPENDENT.values(), ids=INDEPENDENT.keys())
def test_function_independent_of_its_argument_has_zero_gradients(f):
    x, y = {"a": normal(3, dtype=np.float32), "b": normal(2, 2)}, normal(3)
    value, g = lx.value_and_grad(f)(x, y)
    assert float(value) == pytest.approx(float(f(x, y)))
    for leaf, like in zip(tree.leaves(g), tree.leaves(x), strict=True):
        assert leaf.shape == like.shape and leaf.dtype == like.dtype and not leaf.any()


def test_stop_gradient_blocks_the_derivative():
    x = normal(3)
    g = lx.grad(lambda x: (x * lx.stop_gradient(x)).sum())(x)
    np.testing.assert_allclose(g, x)


def test_traced_value_refuses_conversion_to_a_plain_array():
    def f(x):
        np.asarray(x)

    with pytest.raises(TypeError, match="stop_gradient"):
        lx.grad(f)(normal(3))
    with pytest.raises(TypeError, match="stop_gradient"):
        lx.grad(lambda x: np.array(x * 2))(normal(3))


@pytest.mark.parametrize("call, name", [
    (lambda x: lx.array_namespace(x).sinh(x), "sinh"),
    (lambda x: lx.array_namespace(x).cumsum(x), "cumsum"),
    (lambda x: np.sinh(x), "sinh"),
    (lambda x: np.cumsum(x), "cumsum"),
    (lambda x: np.exp(x, out=np.empty(3)), "exp"),
    (lambda x: np.add.reduce(x), "add.reduce"),
])  # fmt: skip
def test_unsupported_function_is_not_implemented_with_its_name(call, name):
    with pytest.raises(NotImplementedError, match=rf"{name}.*derivative"):
        lx.grad(lambda x: call(x).sum())(normal(3))


def test_nested_differentiation_is_refused_clearly():
    def outer(x):
        return lx.grad(lambda y: (x * y).sum())(x).sum()

    with pytest.raises(ValueError, match="nested differentiation"):
        lx.grad(outer)(normal(3))


# -- the gradient arrays handed out ---------------------------------------------------------


OWNERSHIP = {
    # add hands the same cotangent to both operands
    "sum(a + b)": lambda a, b: (a + b).sum(),
    "broadcast": lambda a, b: (a[None] + b + a).sum(),
    "sum-views": lambda a, b: a.sum() + b.sum(),
    "concat-views": lambda a, b: (P.concat([a, b]) * 2).sum(),
    "stack-views": lambda a, b: (P.stack([a, b], axis=-1) ** 2).sum(),
    "transpose": lambda a, b: (a.T * b.T).sum(),
    "reshape": lambda a, b: (a.reshape(-1) @ b.reshape(-1)),
    "float64-constant": lambda a, b: (a * np.ones(3) + b).sum(),
    "identity-getitem": lambda a, b: a[...].sum() + b[:, ::1].sum(),
}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("f", OWNERSHIP.values(), ids=OWNERSHIP.keys())
def test_gradients_are_owned_contiguous_arrays_of_the_parameter_dtype(f, dtype):
    x = normal(2, 3, dtype=dtype)
    ps = {"a": x, "b": x, "c": normal(2, 3, dtype=dtype)}  # the same array twice is two leaves
    grads = lx.grad(lambda ps: f(ps["a"], ps["b"]) + (ps["c"][::-1] * 0).sum())(ps)
    leaves = tree.leaves(grads)
    for g in leaves:
        assert type(g) is np.ndarray and g.dtype == dtype and g.shape == (2, 3)
        assert g.flags.owndata and g.flags.c_contiguous and g.flags.writeable
    for g, other in itertools.combinations(leaves + tree.leaves(ps), 2):
        assert not np.shares_memory(g, other) or g is other is x
    before = leaves[1].copy()
    leaves[0] += 1
    np.testing.assert_array_equal(leaves[1], before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_zero_dimensional_parameters_get_zero_dimensional_arrays(dtype):
    ps = {"s": np.array(1.5, dtype), "t": np.array(2.0, dtype)}
    value, g = lx.value_and_grad(lambda ps: ps["s"] * ps["t"] * 3.0)(ps)
    assert float(value) == pytest.approx(9.0)
    for got, want in [(g["s"], 6.0), (g["t"], 4.5)]:
        assert type(got) is np.ndarray and got.shape == () and got.dtype == dtype
        assert got.flags.owndata and float(got) == want
