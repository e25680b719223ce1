/*
 * A CUDA core's Python side: bind_cuda (the driver's functions, for
 * upstream_cuda.c) and the CupyHook type, the C functions that CuPy's
 * cupy.cuda.memory.CFunctionAllocator calls for every allocation of a cached
 * scope ("CuPy hook", below). Runs with the GIL held; the core's lock is taken
 * by the lx_* calls and around binding.
 */
#include "py.h"

#include <unistd.h>

/* bind_cuda(mem_alloc, mem_free, ctx_push, ctx_pop, context): the addresses of
 * the driver's functions (upstream_cuda.c) and of the retained primary context. */
PyObject *
Core_bind_cuda(CoreObject *self, PyObject *args)
{
    unsigned long long f[5];
    if (!PyArg_ParseTuple(args, "KKKKK:bind_cuda", &f[0], &f[1], &f[2], &f[3], &f[4])) {
        return NULL;
    }
    if (!self->cuda) {
        return PyErr_Format(PyExc_TypeError, "bind_cuda: this core serves host memory");
    }
    if (!f[0] || !f[1] || !f[2] || !f[3]) {
        return PyErr_Format(PyExc_ValueError, "bind_cuda: a function address is 0");
    }
    lx_core *c = self->core;
    lock_take(&c->lock);
    int bound = self->api.mem_alloc != NULL;
    if (!bound) {
        self->api.mem_free = (int (*)(unsigned long long))(uintptr_t)f[1];
        self->api.ctx_push = (int (*)(void *))(uintptr_t)f[2];
        self->api.ctx_pop = (int (*)(void **))(uintptr_t)f[3];
        self->api.context = (void *)(uintptr_t)f[4];
        self->api.pid = getpid();
        self->api.mem_alloc = (int (*)(unsigned long long *, size_t))(uintptr_t)f[0];
    }
    lock_give(&c->lock);
    if (bound) {
        return PyErr_Format(PyExc_RuntimeError, "bind_cuda: already bound");
    }
    Py_RETURN_NONE;
}

/* ---- CuPy hook ------------------------------------------------------------
 *
 * CuPy calls malloc(param, size, device_id) from CFunctionAllocator.malloc and
 * free(param, ptr, device_id) when the memory object it made for ptr dies
 * (cupy/cuda/memory.pyx: CFunctionAllocatorMemory), both with the GIL held;
 * param is a CupyHook. A hit costs no Python: the device is the argument, the
 * stream comes from CuPy's own C function (the hook's current_stream), the
 * block from the core.
 *
 * - The per-thread default stream has one handle in every thread: a hook that
 *   serves it serves the thread that bound the cache (`thread`) alone.
 * - A request on another device or stream than the cache's, or one the core's
 *   bookkeeping has no memory for, is made by the allocator the scope replaced
 *   (fallback, a Python callable size -> MemoryPointer); its MemoryPointer is
 *   kept in `foreign` until CuPy frees the pointer.
 * - Out of device memory (the core has already released its whole free blocks
 *   and retried), `release` lets CuPy's default pool give its free blocks back,
 *   and the core tries once more (never in a forked child, where every CUDA
 *   call is refused); a request still refused, or one over the
 *   limit, raises what `refuse(size)` makes: CuPy's Cython checks for a Python
 *   error after malloc (`except *`) and raises it, and a memory object whose
 *   malloc raised is never freed.
 * - Every pointer handed out holds a reference to the hook (so to the core):
 *   a cache dropped while its arrays live keeps their blocks valid, and the
 *   core goes when the last of them dies.
 */

typedef struct {
    PyObject_HEAD
    CoreObject *core;
    int device_id;
    intptr_t stream;                 /* the stream served */
    unsigned long thread;            /* the per-thread default stream: whose (0: any) */
    intptr_t (*current_stream)(void); /* CuPy's: -1 with a Python error set on failure */
    PyObject *fallback;
    PyObject *release;
    PyObject *refuse;
    PyObject *foreign; /* dict: pointer (int) -> the fallback's MemoryPointer */
} HookObject;

static void *
hook_fallback(HookObject *h, size_t size)
{
    PyObject *memptr = PyObject_CallFunction(h->fallback, "n", (Py_ssize_t)size);
    if (memptr == NULL) {
        return NULL;
    }
    void *ptr = NULL;
    PyObject *address = PyObject_GetAttrString(memptr, "ptr");
    if (address != NULL) {
        ptr = PyLong_AsVoidPtr(address);
        if (ptr == NULL && !PyErr_Occurred()) {
            PyErr_Format(PyExc_RuntimeError, "the allocator outside the cache returned a null "
                                             "pointer for %zu bytes", size);
        }
        else if (ptr != NULL && PyDict_SetItem(h->foreign, address, memptr) < 0) {
            ptr = NULL;
        }
        Py_DECREF(address);
    }
    Py_DECREF(memptr);
    if (ptr != NULL) {
        Py_INCREF(h);
    }
    return ptr;
}

static void *
hook_malloc(void *param, size_t size, int device_id)
{
    HookObject *h = param;
    if (device_id != h->device_id) {
        return hook_fallback(h, size);
    }
    intptr_t stream = h->current_stream();
    if (stream == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (stream != h->stream || (h->thread && PyThread_get_thread_ident() != h->thread)) {
        return hook_fallback(h, size);
    }
    lx_core *c = h->core->core;
    int zero_filled;
    lx_status status;
    void *ptr = lx_alloc(c, size, 0, &zero_filled, &status);
    /* In a forked child the core's upstream refuses every request (upstream_cuda.c):
     * CuPy's pool is not asked either, its release being a CUDA call. */
    if (ptr == NULL && status == LX_OUT_OF_MEMORY && getpid() == h->core->api.pid) {
        PyObject *done = PyObject_CallNoArgs(h->release);
        if (done == NULL) {
            return NULL;
        }
        Py_DECREF(done);
        ptr = lx_alloc(c, size, 0, &zero_filled, &status);
    }
    if (ptr != NULL) {
        Py_INCREF(h);
        return ptr;
    }
    if (status == LX_FALLBACK) {
        return hook_fallback(h, size);
    }
    PyObject *error = PyObject_CallFunction(h->refuse, "n", (Py_ssize_t)size);
    if (error != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(error), error);
        Py_DECREF(error);
    }
    return NULL;
}

static void
hook_free(void *param, void *ptr, int Py_UNUSED(device_id))
{
    HookObject *h = param;
    if (!lx_free(h->core->core, ptr)) { /* the fallback's */
        PyObject *address = PyLong_FromVoidPtr(ptr);
        if (address == NULL || PyDict_DelItem(h->foreign, address) < 0) {
            PyErr_WriteUnraisable((PyObject *)h);
        }
        Py_XDECREF(address);
    }
    Py_DECREF(h); /* may be the last reference: then the core's too */
}

static PyObject *
Hook_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"core",     "device_id", "stream",  "current_stream",
                             "fallback", "release",   "refuse",  "thread", NULL};
    PyObject *core, *fallback, *release, *refuse;
    int device_id;
    Py_ssize_t stream;
    unsigned long long current_stream;
    unsigned long thread = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OinKOOO|k:CupyHook", kwlist, &core,
                                     &device_id, &stream, &current_stream, &fallback,
                                     &release, &refuse, &thread)) {
        return NULL;
    }
    if (!PyObject_TypeCheck(core, &CoreType) || !((CoreObject *)core)->cuda) {
        return PyErr_Format(PyExc_TypeError, "CupyHook: expected a CUDA core, got %R", core);
    }
    if (current_stream == 0 || !PyCallable_Check(fallback) || !PyCallable_Check(release) ||
        !PyCallable_Check(refuse)) {
        return PyErr_Format(PyExc_TypeError, "CupyHook: expected a stream query address and "
                                             "three callables");
    }
    HookObject *self = (HookObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->foreign = PyDict_New();
    if (self->foreign == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    self->core = (CoreObject *)Py_NewRef(core);
    self->device_id = device_id;
    self->stream = (intptr_t)stream;
    self->thread = thread;
    self->current_stream = (intptr_t (*)(void))(uintptr_t)current_stream;
    self->fallback = Py_NewRef(fallback);
    self->release = Py_NewRef(release);
    self->refuse = Py_NewRef(refuse);
    return (PyObject *)self;
}

static void
Hook_dealloc(HookObject *self)
{
    Py_XDECREF(self->foreign);
    Py_XDECREF(self->fallback);
    Py_XDECREF(self->release);
    Py_XDECREF(self->refuse);
    Py_XDECREF(self->core);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* (param, malloc, free): the addresses CFunctionAllocator(param, malloc, free, owner) takes. */
static PyObject *
Hook_get_functions(HookObject *self, void *Py_UNUSED(closure))
{
    return Py_BuildValue("(NNN)", PyLong_FromVoidPtr(self),
                         PyLong_FromVoidPtr((void *)(uintptr_t)hook_malloc),
                         PyLong_FromVoidPtr((void *)(uintptr_t)hook_free));
}

static PyObject *
Hook_get_foreign(HookObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSsize_t(PyDict_GET_SIZE(self->foreign));
}

static PyGetSetDef Hook_getset[] = {
    {"functions", (getter)Hook_get_functions, NULL,
     "(param, malloc, free): addresses for cupy.cuda.memory.CFunctionAllocator", NULL},
    {"foreign", (getter)Hook_get_foreign, NULL,
     "pointers from the outside allocator still in use", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject HookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn.memory._core.CupyHook",
    .tp_basicsize = sizeof(HookObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CupyHook(core, device_id, stream, current_stream, fallback, release, refuse, "
              "thread=0): a CUDA core's blocks for cupy.cuda.memory.CFunctionAllocator("
              "*hook.functions, hook), serving requests on device_id and stream "
              "(current_stream: the address of a C function intptr_t (void) returning the "
              "current stream), and if thread is not 0 only in that thread "
              "(threading.get_ident()); the others go to fallback(size); out of memory, "
              "release() then refuse(size), the exception to raise.",
    .tp_new = Hook_new,
    .tp_dealloc = (destructor)Hook_dealloc,
    .tp_getset = Hook_getset,
};
