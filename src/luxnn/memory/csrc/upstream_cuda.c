/*
 * The CUDA upstream: device memory through the CUDA driver, whose functions
 * are bound at run time. Stateless but for each thread's last driver error:
 * it is called with its core's lock held.
 */
#include "core.h"

#include <stdint.h>
#include <unistd.h>

/* ---- CUDA upstream ------------------------------------------------------
 *
 * Device memory from the CUDA driver API: cuMemAlloc / cuMemFree in the
 * device's primary context, the context that the CUDA runtime and so CuPy
 * use. The context is pushed around each call, so any thread may allocate or
 * release whatever its current device or context. The extension links no CUDA
 * library (it builds on machines without one): the CuPy front end
 * (luxnn/memory/cupy_backend.py) looks the functions up in libcuda with ctypes
 * and binds them on the cache's first use; the tests bind host-memory fakes
 * with the same signatures. Driver functions return 0 on success.
 *
 * The CuPy front end calls into the core with the GIL held, and the driver
 * functions never wait for it, so the lock order (core.h) holds.
 *
 * A forked child inherits the core but not a usable CUDA context: the driver
 * is never called there (api->pid is the binding process). Its allocations
 * fail, and a block released there is left alone: its memory is the parent's.
 */

/* The driver's error for an allocation in a forked child (CUDA_ERROR_NOT_INITIALIZED). */
#define LX_CUDA_FORKED 3

/* The driver's error code of this thread's last failed upstream allocation
 * (0: none, or a host upstream), for the out-of-memory message. */
_Thread_local int tl_upstream_error;

void *
cuda_alloc(void *ctx, size_t size, int zeroed)
{
    const lx_cuda_api *api = ctx;
    unsigned long long dptr = 0;
    void *popped;
    (void)zeroed; /* the CuPy front end never asks for zero-filled blocks */
    if (api->mem_alloc == NULL) {
        tl_upstream_error = -1; /* not bound: the front end binds before any use */
        return NULL;
    }
    if (getpid() != api->pid) {
        tl_upstream_error = LX_CUDA_FORKED;
        return NULL;
    }
    int err = api->ctx_push(api->context);
    if (err == 0) {
        err = api->mem_alloc(&dptr, size);
        api->ctx_pop(&popped);
    }
    tl_upstream_error = err;
    return err == 0 ? (void *)(uintptr_t)dptr : NULL;
}

void
cuda_free(void *ctx, void *ptr, size_t size)
{
    const lx_cuda_api *api = ctx;
    void *popped;
    (void)size;
    /* A failure here (the driver already shut down at exit) leaves nothing to do. */
    if (getpid() == api->pid && api->ctx_push(api->context) == 0) {
        api->mem_free((unsigned long long)(uintptr_t)ptr);
        api->ctx_pop(&popped);
    }
}
