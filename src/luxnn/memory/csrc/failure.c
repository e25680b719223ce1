/*
 * The failure record: why this thread's last cached allocation failed, with
 * the cache's figures then (note below). Thread-local: no lock of its own;
 * written with the failing core's lock held, read by last_failure().
 */
#include "core.h"

/* ---- Failure record -----------------------------------------------------
 *
 * A NEP 49 malloc can only return NULL, and NumPy then raises its own
 * MemoryError. So a failing request leaves its reason and the cache's figures
 * here, per thread; the Python scope that sees the MemoryError replaces it
 * with one that carries them (luxnn.memory.scope).
 */

_Thread_local lx_failure tl_failure;

void
note_failure_locked(lx_core *c, lx_status status, size_t request)
{
    tl_failure.seq++;
    tl_failure.status = status;
    tl_failure.request = request;
    tl_failure.limit = c->limit;
    tl_failure.fig = c->fig;
    tl_failure.upstream_error = tl_upstream_error;
}
