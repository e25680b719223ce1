/*
 * Upstream: the allocator a core takes blocks from on a miss and gives them
 * back to on release. Two exist: host memory (upstream_host.c) and device
 * memory through the CUDA driver (upstream_cuda.c), which a CuPy front end
 * binds. An upstream is called with its core's lock held, and never waits for
 * the GIL or touches a core.
 */
#ifndef LX_UPSTREAM_H
#define LX_UPSTREAM_H

#include <stddef.h>

typedef struct {
    const char *name;
    void *ctx;
    /* `size` bytes, zero-filled when `zeroed`; NULL when out of memory. */
    void *(*alloc)(void *ctx, size_t size, int zeroed);
    /* Give back a block from alloc; `size` is the size it was allocated with. */
    void (*free)(void *ctx, void *ptr, size_t size);
} lx_upstream;

/* Host blocks of this many bytes and more are mapped 2 MiB aligned, with
 * transparent-huge-page advice (upstream_host.c). */
#define LX_HUGE_MIN ((size_t)4 << 20)

extern const lx_upstream host_upstream;

/* The CUDA driver's functions and context, as the CuPy front end binds them
 * (upstream_cuda.c); an lx_upstream's ctx for device memory. */
typedef struct {
    int (*mem_alloc)(unsigned long long *dptr, size_t size); /* cuMemAlloc_v2 */
    int (*mem_free)(unsigned long long dptr);                /* cuMemFree_v2 */
    int (*ctx_push)(void *context);                          /* cuCtxPushCurrent_v2 */
    int (*ctx_pop)(void **context);                          /* cuCtxPopCurrent_v2 */
    void *context; /* the device's primary context, retained by the front end */
    int pid;       /* the process that bound them: a forked child never calls them */
} lx_cuda_api;

/* The driver's error code of this thread's last failed upstream allocation
 * (0: none, or a host upstream), for the out-of-memory message. */
extern _Thread_local int tl_upstream_error;

void *cuda_alloc(void *ctx, size_t size, int zeroed);
void cuda_free(void *ctx, void *ptr, size_t size);

#endif /* LX_UPSTREAM_H */
