/*
 * A CUDA core's Python side: bind_cuda (the driver's functions, for
 * upstream_cuda.c) and the Block type, the blocks handed to CuPy. Runs with
 * the GIL held; the core's lock is taken by the lx_* calls and around binding.
 */
#include "py.h"

/* A block of a CUDA core handed to CuPy: CuPy's memory object for the block
 * owns it, and the block goes back to the core when that object dies. */
typedef struct {
    PyObject_HEAD
    CoreObject *owner; /* the core outlives its blocks */
    void *ptr;
    size_t size;
} BlockObject;

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
        self->api.mem_alloc = (int (*)(unsigned long long *, size_t))(uintptr_t)f[0];
    }
    lock_give(&c->lock);
    if (bound) {
        return PyErr_Format(PyExc_RuntimeError, "bind_cuda: already bound");
    }
    Py_RETURN_NONE;
}

/* block(size) -> a Block of at least size bytes from a CUDA core; None when the
 * bookkeeping is out of memory (allocate elsewhere); MemoryError over the limit
 * or out of device memory even after releasing the free blocks (the reason
 * and figures in last_failure()). */
PyObject *
Core_block(CoreObject *self, PyObject *arg)
{
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!self->cuda || size < 0) {
        return PyErr_Format(PyExc_ValueError, "block(%zd): %s", size,
                            self->cuda ? "negative size" : "this core serves host memory");
    }
    BlockObject *block = PyObject_New(BlockObject, &BlockType);
    if (block == NULL) {
        return NULL;
    }
    int zero_filled;
    lx_status status;
    block->ptr = lx_alloc(self->core, (size_t)size, 0, &zero_filled, &status);
    if (block->ptr == NULL) {
        block->owner = NULL;
        Py_DECREF(block);
        if (status == LX_FALLBACK) {
            Py_RETURN_NONE;
        }
        return PyErr_Format(PyExc_MemoryError, "the cache cannot allocate %zd bytes", size);
    }
    block->size = bin_bytes(bin_of(size ? (size_t)size : 1)); /* served, so <= LX_MAX_REQUEST */
    Py_INCREF(self);
    block->owner = self;
    return (PyObject *)block;
}

static void
Block_dealloc(BlockObject *self)
{
    if (self->owner != NULL) {
        lx_free(self->owner->core, self->ptr);
        Py_DECREF(self->owner);
    }
    PyObject_Free(self);
}

static PyObject *
Block_get_ptr(BlockObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *
Block_get_size(BlockObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->size);
}

static PyGetSetDef Block_getset[] = {
    {"ptr", (getter)Block_get_ptr, NULL, "the block's address", NULL},
    {"size", (getter)Block_get_size, NULL, "the block's bytes (its size bin's)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn.memory._core.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of a CUDA core in use; it goes back to the core when it dies.",
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_getset = Block_getset,
};
