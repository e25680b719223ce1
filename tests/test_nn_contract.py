"""What a layer may be given and must give back: arrays of NumPy or CuPy only, inputs
matched to the parameters' dtype by the policy, (y, st) pairs, containers that name their
children."""

import warnings

import numpy as np
import pytest

import luxnn as lx


@pytest.fixture
def policy():
    """Set a dtype policy for one test; the default ("warn") afterwards."""
    yield lx.set_dtype_policy
    lx.set_dtype_policy("warn")


def _dense(dtype=np.float32):
    layer = lx.Dense(3, 2)
    ps, st = lx.setup(np.random.default_rng(0), layer)
    return layer, lx.tree.map(lambda p: p.astype(dtype), ps), st


# ---- arrays of other libraries --------------------------------------------------------


class ArithmeticOfItsOwn(np.ndarray):
    def __add__(self, other):
        return np.asarray(self) * 0


def _jax_array(shape):
    jnp = pytest.importorskip("jax.numpy", reason="jax arrays need jax")
    return jnp.ones(shape, jnp.float32)


def _torch_tensor(shape):
    torch = pytest.importorskip("torch", reason="torch tensors need torch")
    return torch.ones(shape)


# Factories, called in the test: JAX's threads start with its first array, and no test may
# fork after that (see test_fork_kernels.py), so none is made while collecting.
FOREIGN = {
    "ndarray subclass with arithmetic": lambda shape: np.ones(shape, np.float32).view(ArithmeticOfItsOwn),
    "masked array": lambda shape: np.ma.masked_array(np.ones(shape, np.float32)),
    "torch": _torch_tensor,
    "jax": _jax_array,
}


@pytest.mark.parametrize("kind", FOREIGN)
@pytest.mark.parametrize(
    "make",
    [
        lambda: lx.Dense(3, 2),
        lambda: lx.Chain(lx.Dense(3, 2), lx.Dense(2, 1)),
        lambda: lx.LayerNorm(3),
        lambda: lx.MultiHeadAttention(3, num_heads=1),
    ],
    ids=["Dense", "Chain", "LayerNorm", "MultiHeadAttention"],
)
def test_arrays_of_other_libraries_are_refused_by_name(make, kind):
    layer = make()
    ps, st = lx.setup(np.random.default_rng(0), layer)
    x = FOREIGN[kind]((1, 4, 3) if isinstance(layer, lx.MultiHeadAttention) else (4, 3))  # (batch, seq, dim)
    with pytest.raises(TypeError, match=f"NumPy and CuPy arrays, got {type(x).__module__}"):
        layer(x, ps, st)


def test_conv_refuses_an_ndarray_subclass_with_arithmetic_of_its_own():
    layer = lx.Conv(3, 2, 4)
    ps, st = lx.setup(np.random.default_rng(0), layer)
    x = np.ones((1, 5, 5, 2), np.float32).view(ArithmeticOfItsOwn)
    with pytest.raises(TypeError, match="ArithmeticOfItsOwn"):
        layer(x, ps, st)


def test_array_namespace_refuses_arrays_it_does_not_compute_on_and_keeps_numbers_and_memmaps(tmp_path):
    with pytest.raises(TypeError, match="MaskedArray"):
        lx.array_namespace(np.ma.masked_array([1.0]))
    assert lx.array_namespace(1.5) is np and lx.array_namespace([1.0, 2.0]) is np
    mapped = np.memmap(tmp_path / "m", np.float32, "w+", shape=(3,))
    assert lx.array_namespace(mapped) is np


# ---- the dtype policy ---------------------------------------------------------------------


def test_by_default_an_input_of_another_dtype_is_converted_with_one_warning_per_layer_path(policy):
    policy("warn")
    model = lx.Chain(lx.Dense(3, 2), lx.Chain(lx.Dense(2, 2)))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((4, 3))  # float64 data, float32 parameters
    with pytest.warns(lx.DtypeWarning) as seen:
        y, _ = model(x, ps, st)
    assert y.dtype == np.float32
    assert len(seen) == 1 and "layer_1 (Dense) got an input of dtype float64 and has float32" in str(seen[0].message)
    assert "set_dtype_policy" in str(seen[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x, ps, st)  # the same layer path: no second warning
    half = {**ps, "layer_2": lx.tree.map(lambda p: p.astype(np.float16), ps["layer_2"])}
    with pytest.warns(lx.DtypeWarning, match="layer_2/layer_1 .Dense. got an input of dtype float32 and has float16"):
        model(x, half, st)


def test_integer_inputs_give_the_parameters_dtype_and_gradients_keep_it(policy):
    policy("convert")
    layer, ps, st = _dense()
    y, _ = layer(np.ones((4, 3), np.int64), ps, st)
    assert y.dtype == np.float32
    grads = lx.grad(lambda ps: layer(np.ones((4, 3)), ps, st)[0].sum())(ps)
    assert all(g.dtype == np.float32 for g in lx.tree.leaves(grads))


def test_the_error_policy_names_the_layer_and_both_dtypes(policy):
    policy("error")
    model = lx.Chain(lx.Dense(3, 2))
    ps, st = lx.setup(np.random.default_rng(0), model)
    with pytest.raises(lx.LayerError, match="layer_1: Dense: expected an input of dtype float32, got float64"):
        model(np.ones((4, 3)), ps, st)


def test_the_none_policy_keeps_numpys_promotion(policy):
    policy("none")
    layer, ps, st = _dense()
    assert layer(np.ones((4, 3)), ps, st)[0].dtype == np.float64


def test_matching_dtypes_pass_through_untouched(policy):
    policy("error")
    layer, ps, st = _dense(np.float64)
    x = np.ones((4, 3))
    assert layer(x, ps, st)[0].dtype == np.float64


@pytest.mark.parametrize("bad", ["warning", None, 1])
def test_set_dtype_policy_rejects_unknown_policies_and_keeps_the_old_one(bad, policy):
    policy("convert")
    with pytest.raises(ValueError, match="expected one of 'warn', 'convert', 'error', 'none'"):
        lx.set_dtype_policy(bad)
    assert lx.get_dtype_policy() == "convert"


# ---- the (y, st) contract and children() ---------------------------------------------------


class ReturnsOnlyY(lx.Layer):
    def __call__(self, x, ps, st):
        return x * 2


@pytest.mark.parametrize("rows", [2, 5])
def test_a_child_that_returns_y_alone_is_named_by_path_and_class(rows):
    model = lx.Chain(lx.Dense(3, 3), lx.Chain(ReturnsOnlyY()))
    ps, st = lx.setup(np.random.default_rng(0), model)
    x = np.ones((rows, 3), np.float32)
    with pytest.raises(lx.LayerError, match=r"layer_2/layer_1: ReturnsOnlyY returned a ndarray of shape \(%d, 3\): a layer returns a pair \(y, st\)" % rows):
        model(x, ps, st)


def test_a_pair_whose_state_is_not_a_dict_is_refused_and_so_is_a_whole_model_through_apply():
    class ReturnsTwoArrays(lx.Layer):
        def __call__(self, x, ps, st):
            return x, x

    x = np.ones((2, 3), np.float32)
    with pytest.raises(lx.LayerError, match=r"layer_1: ReturnsTwoArrays returned a tuple of 2 \(ndarray, ndarray\)"):
        lx.Parallel(None, ReturnsTwoArrays())(x, {"layer_1": {}}, {"layer_1": {}})
    with pytest.raises(lx.LayerError, match="ReturnsOnlyY returned a ndarray"):
        lx.apply(ReturnsOnlyY(), x, {}, {})
    with pytest.raises(lx.LayerError, match="ReturnsOnlyY returned"):
        lx.SkipConnection(ReturnsOnlyY())(x, {}, {})


class ForgetsChildren(lx.Layer):
    def __init__(self):
        self.inner = lx.Dense(3, 3)
        self.blocks = [lx.Dense(3, 3)]

    def __call__(self, x, ps, st):
        y, st_inner = self.inner(x, ps["inner"], st["inner"])
        return y, {"inner": st_inner}


class NamesOneChildOfTwo(ForgetsChildren):
    def children(self):
        return iter([("inner", self.inner)])


@pytest.mark.parametrize("kind", [ForgetsChildren, NamesOneChildOfTwo])
def test_setup_names_a_container_whose_children_leave_out_a_layer_it_holds(kind):
    with pytest.raises(lx.LayerError, match=r"layer_2: %s holds the layer Dense in '(inner|blocks)', but its children\(\) does not name it" % kind.__name__):
        lx.setup(np.random.default_rng(0), lx.Chain(lx.Dense(3, 3), kind()))


def test_wrappers_that_share_their_layers_parameters_pass_setup():
    ps, _ = lx.setup(np.random.default_rng(0), lx.SkipConnection(lx.Dense(3, 3)))
    assert sorted(ps) == ["bias", "weight"]


def test_a_layer_held_for_weight_tying_passes_setup_when_it_is_a_child_elsewhere():
    class TiedHead(lx.Layer):
        def __init__(self, embedding):
            self.embedding = embedding  # its parameters are the embedding's, passed in by the parent

        def __call__(self, x, ps, st):
            return x, st

    class Model(lx.Layer):
        def __init__(self):
            self.emb, self.head = lx.Dense(3, 3), None
            self.head = TiedHead(self.emb)

        def children(self):
            return iter([("emb", self.emb), ("head", self.head)])

    ps, _ = lx.setup(np.random.default_rng(0), Model())
    assert sorted(ps) == ["emb", "head"]
