/*
 * The Python side's shared types: the Core object, and what py_module.c,
 * py_plan.c, py_cuda.c and numpy_handler.c offer one another. All of it runs
 * with the GIL held (the NEP 49 hooks of numpy_handler.c excepted: they only
 * call the core). Included first in those files, since Python.h must come
 * before any system header.
 */
#ifndef LX_PY_H
#define LX_PY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "core.h"

typedef struct {
    PyObject_HEAD
    lx_core *core;
    int cuda;        /* 1: device memory (upstream_cuda.c), served to CuPy by a CupyHook */
    lx_cuda_api api; /* the CUDA upstream's functions, once bound */
} CoreObject;

/* py_module.c: the Core type; fill a new structseq with n new references (NULL: an error, all released) */
extern PyTypeObject CoreType;
PyObject *filled(PyObject *seq, PyObject **items, size_t n);

/* py_plan.c: the planner's interface */
extern PyStructSequence_Desc record_desc;
extern PyTypeObject RecordType;
PyObject *Core_take_record(CoreObject *self, PyObject *Py_UNUSED(ignored));
PyObject *Core_install_plan(CoreObject *self, PyObject *args, PyObject *kwargs);
PyObject *Core_arena_ranges_free(CoreObject *self, PyObject *args);
PyObject *Core_place_next(CoreObject *self, PyObject *ptr);

/* py_cuda.c: a CUDA core's binding, and the hook that serves its blocks to CuPy */
extern PyTypeObject HookType;
PyObject *Core_bind_cuda(CoreObject *self, PyObject *args);

/* numpy_handler.c: the NEP 49 handler */
int import_numpy(void);
PyObject *Core_numpy_handler(CoreObject *self, PyObject *Py_UNUSED(ignored));
PyObject *mod_get_handler(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored));
PyObject *mod_set_handler(PyObject *Py_UNUSED(mod), PyObject *handler);

#endif /* LX_PY_H */
