/* luxnn._blas: holds on NumPy's BLAS threads (used by luxnn.parallel).
 *
 * ---- Why C ---------------------------------------------------------------------------
 * While any hold is acquired the BLAS runs on one thread; when the last one is released
 * its thread count is set back to what it was. Counting a hold and setting the count must
 * happen together: in Python, a KeyboardInterrupt (or any exception a signal handler or a
 * trace function raises) can land between two lines, after the count was set to 1 and
 * before the hold was counted, and leave the BLAS on one thread for good. Here acquiring
 * and releasing (hold_acquire, hold_release) are plain C, allocating nothing, with the GIL
 * held from start to end: no Python code, no signal handler and no other thread runs in
 * between. A hold is released when it dies, so a hold whose release was never reached
 * (its owner's exit was interrupted) is released once its owner is gone.
 *
 * ---- The lock ------------------------------------------------------------------------
 * The GIL. Every function here runs with it held and never releases it.
 *
 * ---- Fork ----------------------------------------------------------------------------
 * A forked child has only the thread that forked. after_fork_in_child() drops the holds
 * that other threads had acquired (their owners will never release them in the child) and
 * restores the count if none is left.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>

typedef int (*set_threads_fn)(int);

static set_threads_fn set_threads = NULL; /* openblas_set_num_threads_local, or NULL */
static int threads_before = 0;             /* the count to restore when no hold is left */

typedef struct HoldObject {
    PyObject_HEAD
    struct HoldObject *prev, *next; /* the list of acquired holds */
    unsigned long thread;           /* the thread that acquired it */
    int held;
} HoldObject;

static HoldObject *acquired = NULL; /* the first acquired hold */
static Py_ssize_t acquired_count = 0;

static void
hold_acquire(HoldObject *self)
{
    if (self->held || set_threads == NULL)
        return;
    self->held = 1;
    self->thread = PyThread_get_thread_ident();
    self->prev = NULL;
    self->next = acquired;
    if (acquired != NULL)
        acquired->prev = self;
    acquired = self;
    if (acquired_count++ == 0)
        threads_before = set_threads(1);
}

/* Unlinks the hold; returns whether it was the last one. */
static int
hold_unlink(HoldObject *self)
{
    self->held = 0;
    if (self->prev != NULL)
        self->prev->next = self->next;
    else
        acquired = self->next;
    if (self->next != NULL)
        self->next->prev = self->prev;
    self->prev = self->next = NULL;
    return --acquired_count == 0;
}

static void
hold_release(HoldObject *self)
{
    if (self->held && hold_unlink(self))
        set_threads(threads_before);
}

/* acquire() and __enter__ */
static PyObject *
Hold_acquire(HoldObject *self, PyObject *Py_UNUSED(ignored))
{
    hold_acquire(self);
    Py_RETURN_NONE;
}

/* release() and __exit__(*exc_info) */
static PyObject *
Hold_release(HoldObject *self, PyObject *Py_UNUSED(args))
{
    hold_release(self);
    Py_RETURN_NONE;
}

static PyObject *
Hold_get_held(HoldObject *self, void *Py_UNUSED(closure))
{
    return PyBool_FromLong(self->held);
}

static void
Hold_dealloc(HoldObject *self)
{
    hold_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Hold_methods[] = {
    {"__enter__", (PyCFunction)Hold_acquire, METH_NOARGS, "Acquire the hold."},
    {"__exit__", (PyCFunction)Hold_release, METH_VARARGS, "Release the hold."},
    {"acquire", (PyCFunction)Hold_acquire, METH_NOARGS,
     "Acquire the hold (nothing if it is held already)."},
    {"release", (PyCFunction)Hold_release, METH_NOARGS,
     "Release the hold (nothing if it is not held)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Hold_getset[] = {
    {"held", (getter)Hold_get_held, NULL, "Whether the hold is acquired.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject HoldType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn._blas.Hold",
    .tp_basicsize = sizeof(HoldObject),
    .tp_dealloc = (destructor)Hold_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A hold on the BLAS's threads: one thread while any hold is acquired. "
              "As a context manager: acquired on entry, released on exit.",
    .tp_methods = Hold_methods,
    .tp_getset = Hold_getset,
    .tp_new = PyType_GenericNew,
};

/* ---- Steps ---------------------------------------------------------------------------
 * A step (luxnn.parallel.step) is a hold that its first threaded kernel acquires
 * (hold_for_step) and that the step's exit releases, with the step set in a context
 * variable meanwhile. Entering sets the variable and exiting resets it and releases, each
 * in one call, for the reason above.
 */
typedef struct {
    HoldObject hold;
    PyObject *token; /* from entering the step, until its exit */
} StepObject;

static PyObject *current_step = NULL; /* the ContextVar of the innermost open step */

static PyObject *
Step_enter(StepObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->token != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "step: this step is open already");
        return NULL;
    }
    self->token = PyContextVar_Set(current_step, (PyObject *)self);
    if (self->token == NULL)
        return NULL;
    Py_INCREF(self);
    return (PyObject *)self;
}

static PyObject *
Step_exit(StepObject *self, PyObject *Py_UNUSED(args))
{
    /* The variable first: resetting it may allocate, and so run a collection's finalizers;
     * with the step no longer current, none of them can acquire its hold again. */
    int failed = 0;
    if (self->token != NULL) {
        PyObject *token = self->token;
        self->token = NULL;
        failed = PyContextVar_Reset(current_step, token);
        Py_DECREF(token);
    }
    hold_release(&self->hold);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

static void
Step_dealloc(StepObject *self)
{
    hold_release(&self->hold);
    Py_CLEAR(self->token);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Step_methods[] = {
    {"__enter__", (PyCFunction)Step_enter, METH_NOARGS, "Open the step."},
    {"__exit__", (PyCFunction)Step_exit, METH_VARARGS, "Close the step and release its hold."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject StepType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn._blas.Step",
    .tp_basicsize = sizeof(StepObject),
    .tp_dealloc = (destructor)Step_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "A scope whose hold is acquired by its first threaded kernel (hold_for_step) "
              "and released when it closes.",
    .tp_methods = Step_methods,
    .tp_base = &HoldType,
    .tp_new = PyType_GenericNew,
};

static PyObject *
hold_for_step(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    PyObject *step;
    if (PyContextVar_Get(current_step, Py_None, &step) < 0)
        return NULL;
    if (step != Py_None)
        hold_acquire((HoldObject *)step);
    Py_DECREF(step);
    Py_RETURN_NONE;
}

static PyObject *
use(PyObject *Py_UNUSED(module), PyObject *arg)
{
    void *address = PyLong_AsVoidPtr(arg);
    if (address == NULL && PyErr_Occurred())
        return NULL;
    if (acquired_count > 0) {
        PyErr_SetString(PyExc_RuntimeError, "use: a hold is acquired; the setter cannot change now");
        return NULL;
    }
    set_threads = (set_threads_fn)address;
    Py_RETURN_NONE;
}

static PyObject *
holds(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromSsize_t(acquired_count);
}

static PyObject *
after_fork_in_child(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    unsigned long me = PyThread_get_thread_ident();
    int had = acquired_count > 0;
    HoldObject *hold = acquired;
    while (hold != NULL) {
        HoldObject *next = hold->next;
        if (hold->thread != me)
            hold_unlink(hold);
        hold = next;
    }
    if (had && acquired_count == 0)
        set_threads(threads_before);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"use", use, METH_O,
     "use(address): the address of the BLAS's int set_threads(int n) -> previous n, or 0."},
    {"holds", holds, METH_NOARGS, "The number of holds acquired."},
    {"hold_for_step", hold_for_step, METH_NOARGS,
     "Acquire the hold of the innermost open step, if any."},
    {"after_fork_in_child", after_fork_in_child, METH_NOARGS,
     "Drop the holds of the threads a forked child does not have."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "luxnn._blas", "Holds on NumPy's BLAS threads.", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__blas(void)
{
    if (PyType_Ready(&HoldType) < 0 || PyType_Ready(&StepType) < 0)
        return NULL;
    current_step = PyContextVar_New("luxnn_parallel_step", NULL);
    if (current_step == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Hold", (PyObject *)&HoldType) < 0 ||
        PyModule_AddObjectRef(m, "Step", (PyObject *)&StepType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
