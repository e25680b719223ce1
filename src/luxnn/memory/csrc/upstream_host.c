/*
 * Host memory: the upstream of a core that serves NumPy. Stateless, with no
 * lock of its own: it is called with its core's lock held.
 */
#include "core.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- Host memory --------------------------------------------------------
 *
 * Like NumPy's default handler, blocks of 4 MiB and more (LX_HUGE_MIN) get
 * transparent-huge-page advice; we map them ourselves, 2 MiB aligned, so that
 * the advice covers the whole block and the pages come zero-filled (calloc on
 * a miss costs no memset). Smaller blocks come from posix_memalign, 64-byte
 * aligned (a cache line, and enough for any SIMD load).
 */

#define LX_HOST_ALIGN 64
#define LX_HUGE_ALIGN ((size_t)2 << 20)

static size_t
page_round(size_t size)
{
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    return (size + page - 1) & ~(page - 1);
}

static void *
host_alloc(void *ctx, size_t size, int zeroed)
{
    (void)ctx;
    if (size >= LX_HUGE_MIN) {
        size = page_round(size);
        size_t span = size + LX_HUGE_ALIGN;
        char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (raw == MAP_FAILED) {
            return NULL;
        }
        char *p = (char *)(((uintptr_t)raw + LX_HUGE_ALIGN - 1) &
                           ~(uintptr_t)(LX_HUGE_ALIGN - 1));
        size_t head = (size_t)(p - raw), tail = span - head - size;
        if (head) {
            munmap(raw, head);
        }
        if (tail) {
            munmap(p + size, tail);
        }
        madvise(p, size, MADV_HUGEPAGE); /* advice: where it fails, plain pages serve */
        return p;
    }
    void *p = NULL;
    if (posix_memalign(&p, LX_HOST_ALIGN, size) != 0) {
        return NULL;
    }
    if (zeroed) {
        memset(p, 0, size);
    }
    return p;
}

static void
host_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    if (size >= LX_HUGE_MIN) {
        munmap(ptr, page_round(size));
    }
    else {
        free(ptr);
    }
}

const lx_upstream host_upstream = {"host", NULL, host_alloc, host_free};
