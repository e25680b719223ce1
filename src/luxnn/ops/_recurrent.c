/* luxnn.ops._recurrent: the LSTM cell's pointwise work of one step, forward and backward,
 * in one pass over the step's rows (used by luxnn.ops.recurrent on NumPy arrays).
 *
 * ---- Why C ---------------------------------------------------------------------------
 * Between one step's hidden-projection GEMM and the next, the cell applies four gate
 * nonlinearities and updates its carry: written with NumPy that is ten passes forward and
 * eighteen backward over (batch, 4H) and (batch, H) blocks, each a call with its own
 * overhead, as long together as the GEMM itself at the benchmark's sizes. Here each is one
 * loop over the columns of each row, with the GIL released, so that the threads running
 * different rows of a batch (luxnn.ops.recurrent cuts it) run at once.
 *
 * ---- Equations (PyTorch's; gates i, f, g, o in the column blocks of width H) ----------
 * forward:   i, f, o = sigmoid(.), g = tanh(.) of the step's pre-activations, written back
 *            into gates;  c = f * c_prev + i * g;  tanh_c = tanh(c);  h = o * tanh_c (and a
 *            copy of h where the caller keeps the next step's input)
 * backward:  with [dh | dc] += the step's output cotangent (if given),
 *            dc' = dc + dh * o * (1 - tanh_c^2)
 *            d = [dc' * g * i(1 - i) | dc' * c_prev * f(1 - f) | dc' * i * (1 - g^2) | dh * tanh_c * o(1 - o)]
 *            dc = dc' * f   (the cotangent carried to the step before)
 * sigmoid(x) = (1 + tanh(x / 2)) / 2, which never overflows.
 *
 * ---- tanh ----------------------------------------------------------------------------
 * float64: the C library's. float32: a 13/6-degree rational function on [-7.9053, 7.9053]
 * (the coefficients of Eigen's generic_fast_tanh_float, accurate to a few ulp; +-1 beyond,
 * x itself near 0), branch-free so that the compiler vectorises the loops; the C library's
 * tanhf is a call per element, several times slower than the whole loop.
 *
 * ---- Arrays --------------------------------------------------------------------------
 * Every argument is a 2-D NumPy array of one floating dtype (float32 or float64) with
 * unit column stride and any row stride (the callers pass row blocks of time-major
 * buffers); shapes and writability are checked, and a mismatch raises ValueError or
 * TypeError naming the argument.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>

static float
tanh_f32(float x)
{
    const float bound = 7.90531110763549805f;
    float y = x > bound ? bound : (x < -bound ? -bound : x);
    float y2 = y * y;
    float p = y2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
    p = y2 * p + -8.60467152213735e-11f;
    p = y2 * p + 5.12229709037114e-08f;
    p = y2 * p + 1.48572235717979e-05f;
    p = y2 * p + 6.37261928875436e-04f;
    p = y2 * p + 4.89352455891786e-03f;
    p = y * p;
    float q = y2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
    q = y2 * q + 2.26843463243900e-03f;
    q = y2 * q + 4.89352518554385e-03f;
    float r = p / q;
    return fabsf(x) < 4e-4f ? x : r;
}

static double
tanh_f64(double x)
{
    return tanh(x);
}

/* The row loops are compiled for AVX2 + FMA and for AVX-512 beside the baseline (SSE2 on
 * x86-64), the best one picked when the module loads (GCC's target_clones, an ifunc: GCC 11
 * or later on Linux); the baseline alone was 2.5x slower at hidden 128 than AVX2's. */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("default", "arch=haswell", "arch=x86-64-v4")))
#else
#define CLONES
#endif

/* The kernels, once per dtype. */
#define T float
#define TANH tanh_f32
#define KERNEL(name) name##_f32
#include "_recurrent_cell.h"
#undef T
#undef TANH
#undef KERNEL

#define T double
#define TANH tanh_f64
#define KERNEL(name) name##_f64
#include "_recurrent_cell.h"
#undef T
#undef TANH
#undef KERNEL

/* ---- argument checks ---------------------------------------------------------------- */

typedef struct {
    char *data;
    npy_intp stride; /* the row stride, in elements */
} Rows;

/* Checks that `obj` is a (rows, cols) array of dtype `type` with unit column stride
 * (writable if asked) and fills `out`; raises and returns 0 otherwise. */
static int
rows_of(PyObject *obj, const char *name, int type, npy_intp rows, npy_intp cols, int writable, Rows *out)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a NumPy array, got %s", name, Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    npy_intp item = PyArray_ITEMSIZE(a);
    if (PyArray_TYPE(a) != type) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", name,
                     type == NPY_FLOAT32 ? "float32" : "float64", PyArray_DESCR(a)->typeobj->tp_name);
        return 0;
    }
    if (PyArray_NDIM(a) != 2) {
        PyErr_Format(PyExc_ValueError, "%s: expected shape (%zd, %zd), got a %d-d array", name, (Py_ssize_t)rows,
                     (Py_ssize_t)cols, PyArray_NDIM(a));
        return 0;
    }
    if (PyArray_DIM(a, 0) != rows || PyArray_DIM(a, 1) != cols) {
        PyErr_Format(PyExc_ValueError, "%s: expected shape (%zd, %zd), got (%zd, %zd)", name, (Py_ssize_t)rows,
                     (Py_ssize_t)cols, (Py_ssize_t)PyArray_DIM(a, 0), (Py_ssize_t)PyArray_DIM(a, 1));
        return 0;
    }
    if ((cols > 1 && PyArray_STRIDE(a, 1) != item) || PyArray_STRIDE(a, 0) % item != 0) {
        PyErr_Format(PyExc_ValueError, "%s: expected rows of contiguous elements", name);
        return 0;
    }
    if (writable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable array", name);
        return 0;
    }
    out->data = PyArray_BYTES(a);
    out->stride = PyArray_STRIDE(a, 0) / item;
    return 1;
}

/* The dtype and the shape (rows, H) that the gate buffer `gates` (rows, 4H) sets. */
static int
gate_shape(PyObject *gates, int *type, npy_intp *rows, npy_intp *H)
{
    if (!PyArray_Check(gates) || PyArray_NDIM((PyArrayObject *)gates) != 2 ||
        PyArray_DIM((PyArrayObject *)gates, 1) % 4 != 0) {
        PyErr_SetString(PyExc_ValueError, "gates: expected a 2-d NumPy array of shape (rows, 4 * H)");
        return 0;
    }
    *type = PyArray_TYPE((PyArrayObject *)gates);
    if (*type != NPY_FLOAT32 && *type != NPY_FLOAT64) {
        PyErr_SetString(PyExc_TypeError, "gates: expected dtype float32 or float64");
        return 0;
    }
    *rows = PyArray_DIM((PyArrayObject *)gates, 0);
    *H = PyArray_DIM((PyArrayObject *)gates, 1) / 4;
    return 1;
}

PyDoc_STRVAR(lstm_forward_doc,
             "lstm_forward(gates, c_prev, h, c, tanh_c, h_next)\n--\n\n"
             "One LSTM step's pointwise work on `rows` rows: `gates` (rows, 4H) holds the step's\n"
             "pre-activations and is overwritten with the activated gates i, f, g, o; writes c, h and\n"
             "tanh(c), each (rows, H), from c_prev (rows, H), and h once more into h_next (rows, H)\n"
             "unless it is None.");

static PyObject *
lstm_forward(PyObject *self, PyObject *args)
{
    PyObject *o_gates, *o_cp, *o_h, *o_c, *o_tc, *o_hn;
    if (!PyArg_ParseTuple(args, "OOOOOO:lstm_forward", &o_gates, &o_cp, &o_h, &o_c, &o_tc, &o_hn))
        return NULL;
    int type;
    npy_intp n, H;
    Rows gates, cp, h, c, tc, hn = {NULL, 0};
    if (!gate_shape(o_gates, &type, &n, &H) || !rows_of(o_gates, "gates", type, n, 4 * H, 1, &gates) ||
        !rows_of(o_cp, "c_prev", type, n, H, 0, &cp) || !rows_of(o_h, "h", type, n, H, 1, &h) ||
        !rows_of(o_c, "c", type, n, H, 1, &c) || !rows_of(o_tc, "tanh_c", type, n, H, 1, &tc) ||
        (o_hn != Py_None && !rows_of(o_hn, "h_next", type, n, H, 1, &hn)))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT32)
        lstm_forward_f32(n, H, (float *)gates.data, gates.stride, (float *)cp.data, cp.stride, (float *)h.data,
                         h.stride, (float *)c.data, c.stride, (float *)tc.data, tc.stride, (float *)hn.data, hn.stride);
    else
        lstm_forward_f64(n, H, (double *)gates.data, gates.stride, (double *)cp.data, cp.stride, (double *)h.data,
                         h.stride, (double *)c.data, c.stride, (double *)tc.data, tc.stride, (double *)hn.data,
                         hn.stride);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lstm_backward_doc,
             "lstm_backward(gates, tanh_c, c_prev, g, dh, dc, d)\n--\n\n"
             "One LSTM step's pointwise backward pass on `rows` rows: adds the step's output cotangent\n"
             "g (rows, 2H) = [dh | dc] (or nothing, for None) into dh and dc (rows, H), writes the\n"
             "pre-activation cotangent d (rows, 4H) from the activated gates (rows, 4H), tanh_c and\n"
             "c_prev (rows, H), and leaves in dc the cotangent of c_prev (dh is then h_prev's after\n"
             "the caller's d @ w_hh.T).");

static PyObject *
lstm_backward(PyObject *self, PyObject *args)
{
    PyObject *o_gates, *o_tc, *o_cp, *o_g, *o_dh, *o_dc, *o_d;
    if (!PyArg_ParseTuple(args, "OOOOOOO:lstm_backward", &o_gates, &o_tc, &o_cp, &o_g, &o_dh, &o_dc, &o_d))
        return NULL;
    int type;
    npy_intp n, H;
    Rows gates, tc, cp, g = {NULL, 0}, dh, dc, d;
    if (!gate_shape(o_gates, &type, &n, &H) || !rows_of(o_gates, "gates", type, n, 4 * H, 0, &gates) ||
        !rows_of(o_tc, "tanh_c", type, n, H, 0, &tc) || !rows_of(o_cp, "c_prev", type, n, H, 0, &cp) ||
        (o_g != Py_None && !rows_of(o_g, "g", type, n, 2 * H, 0, &g)) || !rows_of(o_dh, "dh", type, n, H, 1, &dh) ||
        !rows_of(o_dc, "dc", type, n, H, 1, &dc) || !rows_of(o_d, "d", type, n, 4 * H, 1, &d))
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT32)
        lstm_backward_f32(n, H, (float *)gates.data, gates.stride, (float *)tc.data, tc.stride, (float *)cp.data,
                          cp.stride, (float *)g.data, g.stride, (float *)dh.data, dh.stride, (float *)dc.data,
                          dc.stride, (float *)d.data, d.stride);
    else
        lstm_backward_f64(n, H, (double *)gates.data, gates.stride, (double *)tc.data, tc.stride, (double *)cp.data,
                          cp.stride, (double *)g.data, g.stride, (double *)dh.data, dh.stride, (double *)dc.data,
                          dc.stride, (double *)d.data, d.stride);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"lstm_forward", lstm_forward, METH_VARARGS, lstm_forward_doc},
    {"lstm_backward", lstm_backward, METH_VARARGS, lstm_backward_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "luxnn.ops._recurrent", "The LSTM cell's pointwise kernels (see luxnn.ops.recurrent).", -1,
    methods,
};

PyMODINIT_FUNC
PyInit__recurrent(void)
{
    import_array();
    return PyModule_Create(&module);
}
