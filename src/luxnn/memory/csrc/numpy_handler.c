/*
 * The NumPy front end (NEP 49): a handler whose ctx is a core, its capsule, and
 * NumPy's handler of the current context. Its malloc and free run in any
 * thread, with or without the GIL (they only call the core's lx_* functions);
 * the capsule functions run with the GIL held. The only file that uses
 * NumPy's C API (import_numpy loads its table).
 */
#include "py.h"

#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <stdlib.h>
#include <string.h>

/* ---- NumPy front end (NEP 49) -------------------------------------------
 *
 * ctx is the core. Zeroing (calloc on a hit) and copying (realloc) happen
 * here, not in the core. Pointers the core does not own were made by the
 * plain allocator (LX_FALLBACK) and go back to it.
 */

static void *
np_malloc(void *ctx, size_t size)
{
    int zero_filled;
    lx_status status;
    void *p = lx_alloc(ctx, size, 0, &zero_filled, &status);
    if (p == NULL && status == LX_FALLBACK) {
        p = malloc(size ? size : 1);
    }
    return p;
}

static void *
np_calloc(void *ctx, size_t nelem, size_t elsize)
{
    if (elsize != 0 && nelem > SIZE_MAX / elsize) {
        return NULL;
    }
    size_t size = nelem * elsize;
    int zero_filled;
    lx_status status;
    void *p = lx_alloc(ctx, size, 1, &zero_filled, &status);
    if (p != NULL && !zero_filled) {
        memset(p, 0, size); /* a reused block holds its last array's data */
    }
    if (p == NULL && status == LX_FALLBACK) {
        p = calloc(nelem ? nelem : 1, elsize ? elsize : 1);
    }
    return p;
}

static void
np_free(void *ctx, void *ptr, size_t size)
{
    (void)size; /* the core's record knows the block's size */
    if (ptr != NULL && !lx_free(ctx, ptr)) {
        free(ptr);
    }
}

/* A new block, the contents copied, the old block freed: blocks never grow in place. */
static void *
np_realloc(void *ctx, void *ptr, size_t new_size)
{
    if (ptr == NULL) {
        return np_malloc(ctx, new_size);
    }
    size_t old_size = lx_live_size(ctx, ptr);
    if (old_size == 0) {
        return realloc(ptr, new_size); /* from the plain allocator */
    }
    size_t n = new_size ? new_size : 1;
    if (n <= LX_MAX_REQUEST && bin_bytes(bin_of(n)) == old_size) {
        return ptr; /* the same bin: the block already fits */
    }
    void *q = np_malloc(ctx, new_size);
    if (q != NULL) {
        memcpy(q, ptr, old_size < new_size ? old_size : new_size);
        np_free(ctx, ptr, old_size);
    }
    return q;
}

static const char handler_capsule_name[] = "mem_handler"; /* NumPy requires this name */

static void
handler_capsule_destructor(PyObject *capsule)
{
    PyMem_RawFree(PyCapsule_GetPointer(capsule, handler_capsule_name));
    Py_XDECREF(PyCapsule_GetContext(capsule)); /* the core it kept alive */
}

/* A new NEP 49 handler capsule routing to this core. It holds a reference to
 * the core, and every array made through it holds the capsule, so the core
 * outlives the last array whatever happens to the Python AllocCache. */
PyObject *
Core_numpy_handler(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    if (self->cuda) {
        return PyErr_Format(PyExc_TypeError, "numpy_handler: this core serves device memory");
    }
    PyDataMem_Handler *h = PyMem_RawCalloc(1, sizeof(PyDataMem_Handler));
    if (h == NULL) {
        return PyErr_NoMemory();
    }
    strncpy(h->name, "luxnn_cache", sizeof(h->name) - 1);
    h->version = 1;
    h->allocator = (PyDataMemAllocator){self->core, np_malloc, np_calloc, np_realloc,
                                        np_free};
    PyObject *capsule = PyCapsule_New(h, handler_capsule_name, handler_capsule_destructor);
    if (capsule == NULL) {
        PyMem_RawFree(h);
        return NULL;
    }
    if (PyCapsule_SetContext(capsule, self) != 0) {
        Py_DECREF(capsule);
        return NULL;
    }
    Py_INCREF(self);
    return capsule;
}

PyObject *
mod_get_handler(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    return PyDataMem_GetHandler();
}

/* Set NumPy's handler in the current context (None: NumPy's default);
 * returns the handler it replaces. */
PyObject *
mod_set_handler(PyObject *Py_UNUSED(mod), PyObject *handler)
{
    if (handler == Py_None) {
        return PyDataMem_SetHandler(NULL);
    }
    if (!PyCapsule_IsValid(handler, handler_capsule_name)) {
        PyErr_SetString(PyExc_TypeError, "expected a NumPy mem_handler capsule or None");
        return NULL;
    }
    return PyDataMem_SetHandler(handler);
}

/* Load NumPy's C API table for this file (PyInit__core); -1 with an ImportError set. */
int
import_numpy(void)
{
    import_array1(-1);
    return 0;
}
