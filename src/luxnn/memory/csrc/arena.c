/*
 * A plan's arena (plan.c: Step plans): one or two upstream chunks, a bitmap
 * of its 512-B granules that marks the bytes of live blocks (a slot serves only
 * where all of its granules are free), the blocks placed in it, and its
 * retirement (an arena that serves no plan goes upstream when its last block
 * dies). Every function expects the core's lock held.
 */
#include "core.h"

#include <stdlib.h>
#include <string.h>

/* Whether granules [from, to) of the arena are all free; mark them busy or free. */
int
granules_free(const lx_arena *a, size_t from, size_t to)
{
    for (size_t g = from; g < to;) {
        size_t w = g / 64, lo = g % 64, n = to - g < 64 - lo ? to - g : 64 - lo;
        uint64_t mask = (n == 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1)) << lo;
        if (a->busy[w] & mask) {
            return 0;
        }
        g += n;
    }
    return 1;
}

static void
mark_granules(lx_arena *a, size_t from, size_t to, int busy)
{
    for (size_t g = from; g < to;) {
        size_t w = g / 64, lo = g % 64, n = to - g < 64 - lo ? to - g : 64 - lo;
        uint64_t mask = (n == 64 ? ~(uint64_t)0 : (((uint64_t)1 << n) - 1)) << lo;
        a->busy[w] = busy ? a->busy[w] | mask : a->busy[w] & ~mask;
        g += n;
    }
}

/* The offset in arena a of ptr, or SIZE_MAX when ptr is in neither of its chunks. */
size_t
arena_offset(const lx_arena *a, const void *ptr)
{
    uintptr_t p = (uintptr_t)ptr, base = (uintptr_t)a->base, base2 = (uintptr_t)a->base2;
    if (a->base != NULL && p >= base && p < base + a->first) {
        return (size_t)(p - base);
    }
    if (a->base2 != NULL && p >= base2 && p < base2 + (a->size - a->first)) {
        return a->first + (size_t)(p - base2);
    }
    return SIZE_MAX;
}

/* Give an arena with no live block back upstream; its bytes leave bytes_cached. */
static void
release_arena_locked(lx_core *c, lx_arena *a)
{
    c->fig.bytes_cached -= arena_held(a);
    if (a->base != NULL) {
        c->up.free(c->up.ctx, a->base, a->first);
        c->fig.upstream_frees++;
    }
    if (a->base2 != NULL) {
        c->up.free(c->up.ctx, a->base2, a->size - a->first);
        c->fig.upstream_frees++;
    }
    free(a->busy);
    free(a);
    record_locked(c, LX_EV_RELEASE);
}

/* A retired arena of two chunks gives back the one no block lives in (the other
 * waits for its last block). Returns the bytes released. */
static size_t
release_idle_chunk_locked(lx_core *c, lx_arena *a)
{
    if (a->base == NULL || a->base2 == NULL) {
        return 0;
    }
    size_t cut = a->first >> LX_QUANTUM_LOG2, end = a->size >> LX_QUANTUM_LOG2;
    char **chunk = granules_free(a, cut, end) ? &a->base2 : granules_free(a, 0, cut) ? &a->base : NULL;
    if (chunk == NULL) {
        return 0;
    }
    size_t bytes = chunk == &a->base2 ? a->size - a->first : a->first;
    c->up.free(c->up.ctx, *chunk, bytes);
    *chunk = NULL;
    c->fig.upstream_frees++;
    c->fig.bytes_cached -= bytes;
    record_locked(c, LX_EV_RELEASE);
    return bytes;
}

/* An arena that serves no more goes upstream, or retires until its last
 * block dies (a chunk with none in it goes now). Returns the bytes released now. */
size_t
drop_arena_locked(lx_core *c, lx_arena *a)
{
    if (a == NULL) {
        return 0;
    }
    if (a->live > 0) {
        a->next = c->retired;
        c->retired = a;
        return release_idle_chunk_locked(c, a);
    }
    size_t size = arena_held(a);
    release_arena_locked(c, a);
    return size;
}

/* A block at offset `at` of arena a, its granules marked busy; NULL when the
 * bookkeeping is out of memory. */
lx_block *
arena_block_locked(lx_core *c, lx_arena *a, size_t at, size_t size, uint32_t bin)
{
    lx_block *b = malloc(sizeof(lx_block));
    if (b == NULL || map_reserve(&c->map, 1) != 0) {
        free(b);
        return NULL;
    }
    *b = (lx_block){.ptr = arena_at(a, at), .size = size, .bin = bin, .arena = a};
    map_put(&c->map, b);
    mark_granules(a, at >> LX_QUANTUM_LOG2, (at + size) >> LX_QUANTUM_LOG2, 1);
    a->live++;
    a->live_bytes += size;
    a->last_used = c->fig.scopes;
    return b;
}

/* The lowest offset of a run of free granules of arena a that holds `size` bytes
 * in one of its chunks. */
int
free_run(const lx_arena *a, size_t size, size_t *at)
{
    size_t need = size >> LX_QUANTUM_LOG2, granules = arena_held(a) >> LX_QUANTUM_LOG2, run = 0;
    size_t wall = a->first >> LX_QUANTUM_LOG2;
    for (size_t g = 0; g < granules && need > 0; g++) {
        run = (a->busy[g / 64] >> (g % 64)) & 1 ? 0 : g == wall ? 1 : run + 1;
        if (run == need) {
            *at = (g + 1 - need) << LX_QUANTUM_LOG2;
            return 1;
        }
    }
    return 0;
}

/* The highest offset, at least `from`, of a run of free granules of arena a that
 * holds `size` bytes in one of its chunks. */
int
free_run_above(const lx_arena *a, size_t size, size_t from, size_t *at)
{
    size_t need = size >> LX_QUANTUM_LOG2, run = 0;
    size_t wall = a->first >> LX_QUANTUM_LOG2, low = (from + ((size_t)1 << LX_QUANTUM_LOG2) - 1) >> LX_QUANTUM_LOG2;
    for (size_t g = arena_held(a) >> LX_QUANTUM_LOG2; g-- > low && need > 0;) {
        run = (a->busy[g / 64] >> (g % 64)) & 1 ? 0 : g + 1 == wall ? 1 : run + 1;
        if (run == need) {
            *at = g << LX_QUANTUM_LOG2;
            return 1;
        }
    }
    return 0;
}

/* Whether arena a serves no plan any more (it stays until its last block dies). */
int
retired_locked(const lx_core *c, const lx_arena *a)
{
    return c->arena != a;
}

/* Whether every range [ptrs[i], ptrs[i] + sizes[i]) lies in one chunk of the plans'
 * arena and (unless live_too) holds no live block's byte: where a replayed CUDA graph
 * may write the step it captured (luxnn/graphs.py). All free counts as a use of the
 * arena, so that replays keep it from eviction as the steps they stand for would. */
int
arena_ranges_free_locked(lx_core *c, const int64_t *ptrs, const int64_t *sizes, size_t n, int live_too,
                         uint64_t now)
{
    lx_arena *a = c->arena;
    if (a == NULL) {
        return 0;
    }
    for (size_t i = 0; i < n; i++) {
        size_t at = arena_offset(a, (const void *)(uintptr_t)ptrs[i]), size = (size_t)sizes[i];
        if (at == SIZE_MAX || !arena_serves(a, at, size)) {
            return 0;
        }
        size_t end = (at + size + ((size_t)1 << LX_QUANTUM_LOG2) - 1) >> LX_QUANTUM_LOG2;
        if (!live_too && !granules_free(a, at >> LX_QUANTUM_LOG2, end)) {
            return 0;
        }
    }
    if (!live_too) {
        a->last_used = now;
    }
    return 1;
}

/* Whether ptr lies in the plans' arena or a retired one. */
int
in_an_arena_locked(const lx_core *c, const void *ptr)
{
    if (c->arena != NULL && arena_offset(c->arena, ptr) != SIZE_MAX) {
        return 1;
    }
    for (const lx_arena *a = c->retired; a != NULL; a = a->next) {
        if (arena_offset(a, ptr) != SIZE_MAX) {
            return 1;
        }
    }
    return 0;
}

/* A planned block whose array died (already out of bytes_live, into
 * bytes_cached): its bytes are free again, its record goes. */
void
put_planned_locked(lx_core *c, lx_block *b)
{
    lx_arena *a = b->arena;
    size_t at = arena_offset(a, b->ptr);
    mark_granules(a, at >> LX_QUANTUM_LOG2, (at + b->size) >> LX_QUANTUM_LOG2, 0);
    a->live--;
    a->live_bytes -= b->size;
    if (b->phase != 0) {
        a->phase_live[b->phase - 1]--;
    }
    map_remove(&c->map, b);
    free(b);
    if (a->live == 0 && retired_locked(c, a)) {
        lx_arena **link = &c->retired;
        while (*link != a) {
            link = &(*link)->next;
        }
        *link = a->next;
        release_arena_locked(c, a);
        return;
    }
    if (retired_locked(c, a)) {
        release_idle_chunk_locked(c, a);
    }
    record_locked(c, LX_EV_RETURN);
}

/* `size` bytes from upstream for an arena (after a trim of the pools, if the
 * limit or the system asks for it), counted as cached; NULL with the reason in
 * *status. The trim leaves the plan alone: the arena may be the plan's own,
 * taking its second chunk (grow_arena_locked). */
static char *
arena_chunk_locked(lx_core *c, size_t size, lx_status *status)
{
    *status = LX_OK;
    if (c->limit) { /* live + cached + size <= limit, if trimming can */
        size_t room = c->fig.bytes_live < c->limit ? c->limit - c->fig.bytes_live : 0;
        trim_pools_locked(c, room > size ? room - size : 0);
        if (c->fig.bytes_live + c->fig.bytes_cached + size > c->limit) {
            *status = LX_OVER_LIMIT;
            return NULL;
        }
    }
    char *base = c->up.alloc(c->up.ctx, size, 0);
    if (base == NULL) {
        trim_pools_locked(c, 0);
        base = c->up.alloc(c->up.ctx, size, 0);
    }
    if (base == NULL) {
        *status = LX_OUT_OF_MEMORY;
        return NULL;
    }
    c->fig.upstream_allocs++;
    c->fig.bytes_cached += size;
    note_peaks_locked(c);
    record_locked(c, LX_EV_PLAN);
    return base;
}

/* A new arena of `size` bytes, of which the first `first` now (the rest: a
 * second chunk, grow_arena_locked); NULL with the reason in *status. */
lx_arena *
new_arena_locked(lx_core *c, size_t size, size_t first, lx_status *status)
{
    lx_arena *a = calloc(1, sizeof(lx_arena));
    if (a == NULL ||
        (a->busy = calloc(((size >> LX_QUANTUM_LOG2) + 63) / 64, sizeof(uint64_t))) == NULL) {
        free(a);
        *status = LX_FALLBACK;
        return NULL;
    }
    if ((a->base = arena_chunk_locked(c, first, status)) == NULL) {
        free(a->busy);
        free(a);
        return NULL;
    }
    a->size = size;
    a->first = first;
    return a;
}

/* The plans' arena takes its second chunk, if it waits for it (the first
 * planned step is over: the blocks of the step before it, held outside the
 * arena, have died; or a plan grew the arena). One that cannot be had now is
 * asked for again later; its slots miss meanwhile. */
void
grow_arena_locked(lx_core *c)
{
    lx_arena *a = c->arena;
    lx_status status;
    if (a != NULL && a->base2 == NULL && a->first < a->size) {
        a->base2 = arena_chunk_locked(c, a->size - a->first, &status);
    }
}

/* Arena a grows to `size` bytes, beyond its first chunk: its second chunk, which
 * no block lives in, goes back, and one of the new size comes (now or, while
 * the first planned step's outsiders live, later). LX_BUSY, nothing changed: a
 * block lives in the second chunk; LX_OVER_LIMIT: the limit has no room for it. */
lx_status
grow_arena_to_locked(lx_core *c, lx_arena *a, size_t size)
{
    size_t cut = a->first >> LX_QUANTUM_LOG2, end = a->size >> LX_QUANTUM_LOG2;
    if (a->base2 != NULL && !granules_free(a, cut, end)) {
        return LX_BUSY;
    }
    size_t second = a->base2 != NULL ? a->size - a->first : 0;
    if (c->limit) { /* live + cached - second + the new second chunk <= limit, if trimming can */
        size_t need = size - a->first;
        size_t room = c->limit >= c->fig.bytes_live + need ? c->limit - c->fig.bytes_live - need : 0;
        trim_pools_locked(c, room + second);
        if (c->fig.bytes_live + c->fig.bytes_cached - second + need > c->limit) {
            return LX_OVER_LIMIT;
        }
    }
    size_t words = ((size >> LX_QUANTUM_LOG2) + 63) / 64, had = (end + 63) / 64;
    uint64_t *busy = realloc(a->busy, words * sizeof(uint64_t));
    if (busy == NULL) {
        return LX_FALLBACK;
    }
    memset(busy + had, 0, (words - had) * sizeof(uint64_t));
    a->busy = busy;
    if (a->base2 != NULL) {
        c->up.free(c->up.ctx, a->base2, second);
        a->base2 = NULL;
        c->fig.upstream_frees++;
        c->fig.bytes_cached -= second;
        record_locked(c, LX_EV_RELEASE);
    }
    a->size = size;
    if (c->cycle >= a->from_cycle && c->direct_live == 0) {
        grow_arena_locked(c);
    }
    return LX_OK;
}
