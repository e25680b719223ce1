/* luxnn.ops._recurrent: the LSTM's passes over a block of batch rows, forward and
 * backward, step after step in C (used by luxnn.ops.recurrent on NumPy arrays).
 *
 * ---- Why C ---------------------------------------------------------------------------
 * A step is a GEMM and the cell's pointwise work: four gate nonlinearities and the carry's
 * update. Written with NumPy the pointwise work is ten passes forward and eighteen
 * backward over (rows, 4H) and (rows, H) blocks, as long together as the GEMM at the
 * benchmark's sizes; here it is one loop over each row's columns. And the whole pass runs
 * with the GIL released, once: luxnn.ops.recurrent runs one pass per kernel thread, each
 * on rows of its own, and a pass written in Python took the GIL back twice per step, the
 * threads waiting for one another at each of those handovers.
 *
 * ---- Equations (PyTorch's; gates i, f, g, o in the column blocks of width H) ----------
 * forward:   a = [h_prev | x_t | 1] @ [w_hh; w_ih; b] (one GEMM);
 *            i, f, o = sigmoid(a), g = tanh(a), written back into the gate buffer;
 *            c = f * c_prev + i * g;  tanh_c = tanh(c);  h = o * tanh_c, written into the
 *            output and into the next step's GEMM input
 * backward:  with [dh | dc] += the step's output cotangent (if given),
 *            dc' = dc + dh * o * (1 - tanh_c^2)
 *            d = [dc' * g * i(1 - i) | dc' * c_prev * f(1 - f) | dc' * i * (1 - g^2) | dh * tanh_c * o(1 - o)]
 *            dc = dc' * f;  dh = d @ w_hh^T   (the cotangents carried to the step before)
 * sigmoid(x) = (1 + tanh(x / 2)) / 2, which never overflows.
 *
 * ---- tanh ----------------------------------------------------------------------------
 * float64: the C library's. float32: a 13/6-degree rational function on [-7.9053, 7.9053]
 * (the coefficients of Eigen's generic_fast_tanh_float, accurate to a few ulp; +-1 beyond,
 * x itself near 0), branch-free so that the compiler vectorises the loops; the C library's
 * tanhf is a call per element, several times slower than the whole loop.
 *
 * ---- The BLAS ------------------------------------------------------------------------
 * NumPy's own OpenBLAS, the one np.matmul calls (so that luxnn.parallel's holds on its
 * threads hold here too): found among the loaded libraries when the module loads, its
 * cblas_sgemm and cblas_dgemm with 64-bit (the scipy_/64_ names NumPy's wheels use) or
 * 32-bit integers. HAS_GEMM says whether they were found; without them the passes raise
 * and luxnn.ops.recurrent runs its own loop in Python.
 *
 * ---- Arrays --------------------------------------------------------------------------
 * NumPy arrays of one floating dtype (float32 or float64) with unit stride along their
 * last axis and any other strides; shapes and writability are checked, a mismatch raises
 * ValueError or TypeError naming the argument. A block of no rows is a pass that does nothing.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__linux__)
#include <dlfcn.h>
#include <link.h>
#endif

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

/* ---- the BLAS ------------------------------------------------------------------------ */

enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 }; /* CBLAS's constants */

static void *sgemm = NULL, *dgemm = NULL; /* cblas_sgemm and cblas_dgemm, with... */
static int blas_int64 = 0;                /* ...64-bit integers, or 32-bit ones */

#if defined(__linux__)
/* dl_iterate_phdr's callback: keeps the path of a loaded OpenBLAS, NumPy's if there is one. */
static int
find_openblas(struct dl_phdr_info *info, size_t size, void *found)
{
    const char *path = info->dlpi_name, *base = strrchr(path, '/');
    char **best = (char **)found;
    (void)size;
    if (strstr(base == NULL ? path : base + 1, "openblas") == NULL)
        return 0;
    if (*best == NULL || (strstr(*best, "numpy") == NULL && strstr(path, "numpy") != NULL)) {
        free(*best);
        *best = strdup(path);
    }
    return 0;
}

static void
load_gemm(void)
{
    static const struct { const char *s, *d; int int64; } names[] = {
        {"scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", 1},
        {"cblas_sgemm64_", "cblas_dgemm64_", 1},
        {"scipy_cblas_sgemm", "scipy_cblas_dgemm", 0},
        {"cblas_sgemm", "cblas_dgemm", 0},
    };
    char *path = NULL;
    dl_iterate_phdr(find_openblas, &path);
    if (path == NULL)
        return;
    void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* a reference to the library already loaded */
    free(path);
    if (lib == NULL)
        return;
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        void *s = dlsym(lib, names[i].s), *d = dlsym(lib, names[i].d);
        if (s != NULL && d != NULL) {
            sgemm = s;
            dgemm = d;
            blas_int64 = names[i].int64;
            return; /* `lib` stays open: the pointers must outlive the module */
        }
    }
    dlclose(lib);
}
#else
static void
load_gemm(void)
{
}
#endif

/* ---- the kernels, once per dtype ---------------------------------------------------- */

typedef struct {
    char *data;
    npy_intp row, step; /* strides, in elements */
} Block;

#define AT(b, t) ((T *)(b).data + (t) * (b).step) /* step t's first row */

/* The kernels, once per dtype. */
#define T float
#define TANH tanh_f32
#define GEMM sgemm
#define KERNEL(name) name##_f32
#include "_recurrent_cell.h"
#undef T
#undef TANH
#undef GEMM
#undef KERNEL

#define T double
#define TANH tanh_f64
#define GEMM dgemm
#define KERNEL(name) name##_f64
#include "_recurrent_cell.h"
#undef T
#undef TANH
#undef GEMM
#undef KERNEL

/* ---- argument checks ---------------------------------------------------------------- */

static void
format_shape(char *buf, size_t size, int ndim, const npy_intp *shape)
{
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < ndim && used < size; i++)
        used += (size_t)snprintf(buf + used, size - used, i ? ", %zd" : "%zd", (Py_ssize_t)shape[i]);
    if (used < size)
        snprintf(buf + used, size - used, ndim == 1 ? ",)" : ")");
}

/* Checks that `obj` is an array of dtype `type` with `ndim` (2 or 3) axes of the sizes in
 * `shape` (-1: any, read back into it), unit stride along the last, writable if asked, and
 * fills `out` (strides of rows and, with 3 axes, of steps). Raises and returns 0 otherwise. */
static int
block_of(PyObject *obj, const char *name, int type, int ndim, npy_intp *shape, int writable, Block *out)
{
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a NumPy array, got %s", name, Py_TYPE(obj)->tp_name);
        return 0;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    npy_intp item = PyArray_ITEMSIZE(a);
    if (PyArray_TYPE(a) != type) {
        PyErr_Format(PyExc_TypeError, "%s: expected dtype %s, got %s", name, type == NPY_FLOAT32 ? "float32" : "float64",
                     PyArray_DESCR(a)->typeobj->tp_name);
        return 0;
    }
    int same = PyArray_NDIM(a) == ndim;
    for (int i = 0; same && i < ndim; i++)
        same = shape[i] < 0 || PyArray_DIM(a, i) == shape[i];
    if (!same) {
        char want[96], got[96];
        format_shape(want, sizeof want, ndim, shape);
        format_shape(got, sizeof got, PyArray_NDIM(a), PyArray_DIMS(a));
        PyErr_Format(PyExc_ValueError, "%s: expected shape %s (-1: any), got %s", name, want, got);
        return 0;
    }
    for (int i = 0; i < ndim; i++)
        shape[i] = PyArray_DIM(a, i);
    /* An empty array's strides may be anything (NumPy gives 0s); the passes never read it. */
    int unit = PyArray_SIZE(a) == 0 || shape[ndim - 1] <= 1 || PyArray_STRIDE(a, ndim - 1) == item;
    for (int i = 0; unit && i < ndim - 1; i++)
        unit = PyArray_STRIDE(a, i) % item == 0;
    if (!unit) {
        PyErr_Format(PyExc_ValueError, "%s: expected contiguous elements along the last axis", name);
        return 0;
    }
    if (writable && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s: expected a writable array", name);
        return 0;
    }
    out->data = PyArray_BYTES(a);
    out->row = PyArray_STRIDE(a, 0) / item;
    out->step = ndim == 3 ? PyArray_STRIDE(a, 1) / item : 0;
    return 1;
}

/* The dtype and (rows, seq, H) that the gate buffer (rows, seq >= 1, 4H) sets. */
static int
gate_shape(PyObject *gates, int *type, npy_intp *rows, npy_intp *seq, npy_intp *H)
{
    PyArrayObject *a = (PyArrayObject *)gates;
    if (!PyArray_Check(gates) || PyArray_NDIM(a) != 3 || PyArray_DIM(a, 1) < 1 || PyArray_DIM(a, 2) % 4 != 0) {
        PyErr_SetString(PyExc_ValueError, "gates: expected a 3-d NumPy array of shape (rows, seq >= 1, 4 * H)");
        return 0;
    }
    *type = PyArray_TYPE(a);
    if (*type != NPY_FLOAT32 && *type != NPY_FLOAT64) {
        PyErr_SetString(PyExc_TypeError, "gates: expected dtype float32 or float64");
        return 0;
    }
    if (sgemm == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "luxnn.ops._recurrent: NumPy's BLAS was not found (HAS_GEMM is False)");
        return 0;
    }
    *rows = PyArray_DIM(a, 0);
    *seq = PyArray_DIM(a, 1);
    *H = PyArray_DIM(a, 2) / 4;
    return 1;
}

/* Whether the BLAS's integers hold every stride and size of `blocks` and `sizes`. */
static int
fits_the_blas(const Block *blocks, int n_blocks, const npy_intp *sizes, int n_sizes)
{
    npy_intp most = 0;
    for (int i = 0; i < n_blocks; i++)
        most = Py_MAX(most, Py_MAX(blocks[i].row, blocks[i].step));
    for (int i = 0; i < n_sizes; i++)
        most = Py_MAX(most, sizes[i]);
    if (!blas_int64 && most > INT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "luxnn.ops._recurrent: arrays too large for the BLAS's 32-bit integers");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(lstm_forward_pass_doc,
             "lstm_forward_pass(inputs, weights, gates, out, tanh_c, c0, reverse)\n--\n\n"
             "The LSTM's forward pass over a block of `rows` batch rows. inputs (rows, seq, K): each\n"
             "step's GEMM rows [h_prev | x_t | 1], h_prev given at the first step taken (the pass\n"
             "writes the others); weights (K, 4H): [w_hh; w_ih; b]. Writes the activated gates\n"
             "(rows, seq, 4H), out (rows, seq, 2H) = [h_t | c_t] and tanh_c (rows, seq, H), from c0\n"
             "(rows, H); `reverse`: from the last step to the first.");

static PyObject *
lstm_forward_pass(PyObject *self, PyObject *args)
{
    PyObject *o_in, *o_w, *o_gates, *o_out, *o_tc, *o_c0;
    int reverse;
    if (!PyArg_ParseTuple(args, "OOOOOOp:lstm_forward_pass", &o_in, &o_w, &o_gates, &o_out, &o_tc, &o_c0, &reverse))
        return NULL;
    int type;
    npy_intp n, seq, H;
    Block in, w, gates, out, tc, c0;
    if (!gate_shape(o_gates, &type, &n, &seq, &H))
        return NULL;
    npy_intp s_in[3] = {n, seq, -1}, s_gates[3] = {n, seq, 4 * H}, s_out[3] = {n, seq, 2 * H}, s_tc[3] = {n, seq, H};
    npy_intp s_c0[2] = {n, H};
    if (!block_of(o_in, "inputs", type, 3, s_in, 1, &in) || !block_of(o_gates, "gates", type, 3, s_gates, 1, &gates) ||
        !block_of(o_out, "out", type, 3, s_out, 1, &out) || !block_of(o_tc, "tanh_c", type, 3, s_tc, 1, &tc) ||
        !block_of(o_c0, "c0", type, 2, s_c0, 0, &c0))
        return NULL;
    npy_intp K = s_in[2], s_w[2] = {K, 4 * H};
    Block all[5] = {in, gates, out, tc, c0};
    if (!block_of(o_w, "weights", type, 2, s_w, 0, &w) || !fits_the_blas(all, 5, s_w, 2))
        return NULL;
    if (K < H) {
        PyErr_Format(PyExc_ValueError, "inputs: expected at least H = %zd columns, got %zd", (Py_ssize_t)H, (Py_ssize_t)K);
        return NULL;
    }
    if (n == 0)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT32)
        lstm_forward_pass_f32(n, seq, H, K, reverse, in, (const float *)w.data, w.row, gates, out, tc,
                              (const float *)c0.data, c0.row);
    else
        lstm_forward_pass_f64(n, seq, H, K, reverse, in, (const double *)w.data, w.row, gates, out, tc,
                              (const double *)c0.data, c0.row);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

PyDoc_STRVAR(lstm_backward_pass_doc,
             "lstm_backward_pass(gates, tanh_c, out, c0, g, dhc, d, weights, reverse, need_h0)\n--\n\n"
             "The LSTM's backward pass over the block of rows of a forward pass (its gates, tanh_c,\n"
             "out and c0; weights (K, 4H), w_hh its first H rows). g (rows, seq, 2H): every step's\n"
             "output cotangent, or None; dhc (rows, 2H): [dh | dc], the cotangent carried into the\n"
             "last step taken, left as that of (h0, c0) (dh only if need_h0). Writes d (rows, seq,\n"
             "4H), the cotangent of each step's pre-activations.");

static PyObject *
lstm_backward_pass(PyObject *self, PyObject *args)
{
    PyObject *o_gates, *o_tc, *o_out, *o_c0, *o_g, *o_dhc, *o_d, *o_w;
    int reverse, need_h0;
    if (!PyArg_ParseTuple(args, "OOOOOOOOpp:lstm_backward_pass", &o_gates, &o_tc, &o_out, &o_c0, &o_g, &o_dhc, &o_d,
                          &o_w, &reverse, &need_h0))
        return NULL;
    int type;
    npy_intp n, seq, H;
    Block gates, tc, out, c0, g = {NULL, 0, 0}, dhc, d, w;
    if (!gate_shape(o_gates, &type, &n, &seq, &H))
        return NULL;
    npy_intp s_gates[3] = {n, seq, 4 * H}, s_tc[3] = {n, seq, H}, s_out[3] = {n, seq, 2 * H}, s_g[3] = {n, seq, 2 * H};
    npy_intp s_c0[2] = {n, H}, s_dhc[2] = {n, 2 * H}, s_d[3] = {n, seq, 4 * H}, s_w[2] = {-1, 4 * H};
    if (!block_of(o_gates, "gates", type, 3, s_gates, 0, &gates) || !block_of(o_tc, "tanh_c", type, 3, s_tc, 0, &tc) ||
        !block_of(o_out, "out", type, 3, s_out, 0, &out) || !block_of(o_c0, "c0", type, 2, s_c0, 0, &c0) ||
        (o_g != Py_None && !block_of(o_g, "g", type, 3, s_g, 0, &g)) ||
        !block_of(o_dhc, "dhc", type, 2, s_dhc, 1, &dhc) || !block_of(o_d, "d", type, 3, s_d, 1, &d) ||
        !block_of(o_w, "weights", type, 2, s_w, 0, &w))
        return NULL;
    Block all[8] = {gates, tc, out, c0, g, dhc, d, w};
    if (!fits_the_blas(all, 8, s_w, 2))
        return NULL;
    if (s_w[0] < H) {
        PyErr_Format(PyExc_ValueError, "weights: expected at least H = %zd rows, got %zd", (Py_ssize_t)H,
                     (Py_ssize_t)s_w[0]);
        return NULL;
    }
    if (n == 0)
        Py_RETURN_NONE;
    Py_BEGIN_ALLOW_THREADS
    if (type == NPY_FLOAT32)
        lstm_backward_pass_f32(n, seq, H, reverse, need_h0, gates, tc, out, (const float *)c0.data, c0.row, g,
                               (float *)dhc.data, dhc.row, d, (const float *)w.data, w.row);
    else
        lstm_backward_pass_f64(n, seq, H, reverse, need_h0, gates, tc, out, (const double *)c0.data, c0.row, g,
                               (double *)dhc.data, dhc.row, d, (const double *)w.data, w.row);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"lstm_forward_pass", lstm_forward_pass, METH_VARARGS, lstm_forward_pass_doc},
    {"lstm_backward_pass", lstm_backward_pass, METH_VARARGS, lstm_backward_pass_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "luxnn.ops._recurrent", "The LSTM's passes in C (see luxnn.ops.recurrent).", -1, methods,
};

PyMODINIT_FUNC
PyInit__recurrent(void)
{
    import_array();
    load_gemm();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "HAS_GEMM", sgemm != NULL ? Py_True : Py_False) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
