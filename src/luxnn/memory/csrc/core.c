/*
 * The core's life and its operations: creation and destruction, alloc (plan,
 * then pool, then upstream, under the limit) and free, trim, release, and
 * scopes (their peaks, and eviction when one closes). Functions named lx_*
 * take the core's lock; they are what the front ends call.
 */
#include "core.h"

#include <sched.h>
#include <stdlib.h>
#include <string.h>

/* lock_take's wait (core.h: The core's lock): spin a little, then give the CPU away
 * between tries, so that a holder that was preempted can finish. */
void
lock_wait(lx_lock *l)
{
    for (unsigned tries = 0;; tries++) {
        int unheld = 0;
        if (atomic_load_explicit(&l->held, memory_order_relaxed) == 0 &&
            atomic_compare_exchange_weak_explicit(&l->held, &unheld, 1, memory_order_acquire,
                                                  memory_order_relaxed)) {
            return;
        }
        if (tries < LX_LOCK_SPINS) {
            LX_CPU_RELAX();
        }
        else {
            sched_yield();
        }
    }
}

lx_core *
lx_core_new(lx_upstream up, size_t limit, uint64_t evict_after, size_t event_cap,
            size_t split_above)
{
    lx_core *c = calloc(1, sizeof(lx_core));
    if (c == NULL) {
        return NULL;
    }
    c->map.cap = 64;
    c->map.slots = calloc(c->map.cap, sizeof(lx_block *));
    c->events = event_cap ? calloc(event_cap, sizeof(lx_event)) : NULL;
    c->spans = event_cap ? calloc(LX_SPANS, sizeof(lx_span)) : NULL;
    c->span_group = 1;
    if (c->map.slots == NULL || (event_cap && (c->events == NULL || c->spans == NULL))) {
        free(c->map.slots);
        free(c->events);
        free(c->spans);
        free(c);
        return NULL;
    }
    c->event_cap = event_cap;
    c->up = up;
    c->limit = limit;
    c->evict_after = evict_after;
    c->lru.newer = c->lru.older = &c->lru;
    while (c->split_bin < LX_NBINS && bin_bytes(c->split_bin) <= split_above) {
        c->split_bin++;
    }
    while (c->quick_bin < c->split_bin && bin_bytes(c->quick_bin) <= LX_QUICK_MAX) {
        c->quick_bin++;
    }
    enlist_core(c);
    return c;
}

/*
 * Only called when nothing can free into the core any more (the NumPy front
 * end guarantees it: every array holds its handler, which holds the core).
 * Should a live block remain all the same, it is left allocated (with its
 * segment): never free what something may still use.
 */
void
lx_core_destroy(lx_core *c)
{
    unlist_core(c);
    trim_locked(c, 0);
    for (size_t i = 0; i < c->map.cap; i++) {
        free(c->map.slots[i]); /* records left (heads with their segments); memory stays */
    }
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        free_plan(c->plans[k]);
    }
    if (c->arena != NULL) { /* an arena with a live block: the memory stays */
        free(c->arena->busy);
        free(c->arena);
    }
    for (lx_arena *a = c->retired, *next; a != NULL; a = next) {
        next = a->next;
        free(a->busy);
        free(a);
    }
    free(c->rec);
    free(c->prev);
    free(c->map.slots);
    free(c->watchers);
    free(c->events);
    free(c->spans);
    free(c);
}

/* The place in its arena that this thread's next request of core `claimer` takes
 * (lx_place_next), or 0. */
static _Thread_local const lx_core *tl_claimer;
static _Thread_local uintptr_t tl_claimed;

void
lx_place_next(const lx_core *c, const void *ptr)
{
    tl_claimer = c;
    tl_claimed = (uintptr_t)ptr;
}

/* The block at the place claimed for this request of `size` bytes (bin `bin`): in the
 * plans' arena, if all of its bytes are free there, or a pool's free block that starts
 * there; else NULL: served as any. The claim is used up either way. */
static lx_block *
take_claimed_locked(lx_core *c, size_t size, uint32_t bin)
{
    const void *ptr = (const void *)tl_claimed;
    tl_claimer = NULL;
    lx_arena *a = c->arena;
    size_t at = a != NULL && size != 0 ? arena_offset(a, ptr) : SIZE_MAX;
    if (at == SIZE_MAX) {
        return size != 0 ? take_pooled_at_locked(c, ptr, bin, size) : NULL;
    }
    if ((at & (((size_t)1 << LX_QUANTUM_LOG2) - 1)) != 0 || !arena_serves(a, at, size) ||
        !granules_free(a, at >> LX_QUANTUM_LOG2, (at + size) >> LX_QUANTUM_LOG2)) {
        return NULL; /* a block starts on a granule: its bitmap marks whole granules */
    }
    return arena_block_locked(c, a, at, size, bin);
}

/*
 * A block of at least n bytes for the caller to use, or NULL with the reason
 * in *status. *zero_filled tells whether the block is known to hold zeros
 * (only ever for a new upstream block requested with zeroed).
 */
void *
lx_alloc(lx_core *c, size_t n, int zeroed, int *zero_filled, lx_status *status)
{
    *zero_filled = 0;
    n = n ? n : 1;
    lock_take(&c->lock);
    uint32_t bin = n <= LX_MAX_REQUEST ? bin_of(n) : 0;
    size_t size = n <= LX_MAX_REQUEST ? bin_bytes(bin) : 0;
    int split = bin >= c->split_bin, no_record = 0;
    int64_t call = -1, lane = -1, lane_rank = 0;
    if (c->stepping && size != 0) {
        lane_of_locked(c, &call, &lane);
        lane_rank = call >= 0 ? tl_lane.births++ : 0;
    }
    /* Recorded and planned: every request of a step, the smallest too (a bias and its
     * moments, made anew each step out of place, would pin slabs idle at the peak). */
    int recorded = c->stepping && size != 0;
    lx_block *b = tl_claimer == c ? take_claimed_locked(c, size, bin) : NULL;
    if (recorded) { /* a claimed place counts in the plan's choice and ranks as any request */
        choose_plan_locked(c, size, call);
        int64_t rank = call >= 0 ? lane_rank : c->rank[bin]++;
        b = b == NULL && c->arena != NULL ? take_planned_locked(c, bin, size, call, lane, rank) : b;
    }
    /* Warm-up: what no plan serves goes upstream at its size (a miss, by design); the
     * small ones out of lanes too once this step or the one before had larger
     * requests, after the step's first above LX_MATCH_ABOVE (plan.c: Warm-up). */
    int direct = b == NULL && recorded && c->warm_up &&
                 (split || call >= 0 || ((c->warm_small || c->cycle_plannable > 0) && c->matched > 0));
    int seg = !direct; /* a miss makes a new segment: a slab, or one of the split pool */
    if (b != NULL || size == 0 || direct) {
        /* planned; above 128 TiB: a miss that fails below; the warm-up's */
    }
    else if (!split) { /* small: its quick list (the fast path), else a slab's piece */
        if (bin < c->quick_bin) {
            b = take_quick_locked(c, bin);
        }
        if (b == NULL) {
            b = take_piece_locked(c, &c->small, bin, size, &no_record);
        }
        if (b == NULL && !no_record && c->quick_bytes > 0) { /* the quick blocks, coalesced */
            flush_quick_locked(c, 0, c->quick_bin);
            b = take_piece_locked(c, &c->small, bin, size, &no_record);
        }
    }
    else {
        b = take_piece_locked(c, &c->split, bin, size, &no_record);
    }
    int kind = LX_EV_HIT;
    if (b != NULL) {
        c->fig.bytes_cached -= size;
        c->fig.hits++;
    }
    else {
        c->fig.misses++;
        void *ptr = NULL;
        lx_block *rest = NULL; /* a slab's or a consolidated segment's bytes beyond the block */
        size_t got = size;     /* bytes taken from upstream */
        int filled = zeroed;   /* whether they come zero-filled */
        if (c->limit && (size == 0 || size > c->limit)) {
            *status = LX_OVER_LIMIT; /* no trim can make room for it */
        }
        else if (size == 0) {
            *status = LX_OUT_OF_MEMORY; /* above 128 TiB: no machine has it */
        }
        else if (no_record ||
                 (b = malloc(seg ? sizeof(lx_head) : sizeof(lx_block))) == NULL ||
                 map_reserve(&c->map, 2) != 0) {
            *status = LX_FALLBACK;
        }
        else {
            if (c->limit) { /* make room: live + cached + size <= limit, if trimming can */
                size_t room = c->limit - size;
                trim_locked(c, room > c->fig.bytes_live ? room - c->fig.bytes_live : 0);
                if (c->fig.bytes_live + c->fig.bytes_cached > room) {
                    drop_plan_locked(c); /* its arena in use retires: back when its blocks die */
                }
            }
            tl_upstream_error = 0;
            size_t slab = seg && !split ? slab_bytes_locked(c, size) : size;
            /* Consolidation (pool.c: Split pool): the split pool's whole free segments,
             * each smaller than the request, add up to it: they go back and the
             * new segment takes their bytes too (reserved grows by size, as on
             * any miss). Should that fail, the request alone is asked for. */
            if (seg && split && c->split.whole >= size && c->split.whole <= LX_MAX_REQUEST - size &&
                (rest = malloc(sizeof(lx_block))) != NULL) {
                got = size + release_wholes_locked(c, &c->split, UINT64_MAX);
                ptr = c->up.alloc(c->up.ctx, got, zeroed);
            }
            /* A slab (pool.c: Small blocks), where the limit leaves room for it: its
             * bytes beyond the block are a free piece, not asked to be zero-filled. */
            else if (slab > size &&
                     (!c->limit || c->fig.bytes_live + c->fig.bytes_cached + slab <= c->limit) &&
                     (rest = malloc(sizeof(lx_block))) != NULL) {
                got = slab;
                filled = 0;
                ptr = c->up.alloc(c->up.ctx, got, 0);
            }
            if (ptr == NULL) {
                got = size;
                filled = zeroed;
                ptr = c->up.alloc(c->up.ctx, size, zeroed);
            }
            if (ptr == NULL && c->fig.bytes_cached > 0) { /* out of memory: trim, retry */
                trim_locked(c, 0);
                ptr = c->up.alloc(c->up.ctx, size, zeroed);
            }
            *status = ptr != NULL ? LX_OK : LX_OUT_OF_MEMORY;
        }
        if (ptr == NULL) {
            free(b);
            free(rest);
            if (*status != LX_FALLBACK) {
                note_failure_locked(c, *status, n);
            }
            lock_give(&c->lock);
            return NULL;
        }
        *b = (lx_block){.ptr = ptr, .size = size, .bin = bin, .orphan = (uint8_t)direct,
                        .direct = (uint8_t)direct};
        c->direct_live += direct;
        if (seg) { /* a new segment, this block its first piece */
            lx_head *head = (lx_head *)b;
            lx_pool *pool = split ? &c->split : &c->small;
            head->seg = (lx_segment){.base = ptr, .size = got, .last_used = c->fig.scopes,
                                     .pool = pool};
            note_piece_locked(c, &head->seg, size, +1);
            b->seg = &head->seg;
            pool->held += got;
            c->split_peak = c->split.held > c->split_peak ? c->split.held : c->split_peak;
        }
        map_put(&c->map, b);
        if (got > size) {
            *rest = (lx_block){.ptr = (char *)ptr + size, .size = got - size, .left = b,
                               .seg = b->seg};
            rest->bin = floor_bin(rest->size);
            b->right = rest;
            map_put(&c->map, rest);
            c->fig.bytes_cached += rest->size;
            link_free_locked(c, rest);
        }
        else {
            free(rest);
        }
        c->fig.upstream_allocs++;
        *zero_filled = filled;
        kind = LX_EV_UPSTREAM;
    }
    b->live = 1;
    c->fig.bytes_live += size;
    if (split) {
        c->large_live += size;
        c->large_peak = c->large_live > c->large_peak ? c->large_live : c->large_peak;
    }
    if (recorded) {
        note_birth_locked(c, b, call, lane);
    }
    note_peaks_locked(c);
    record_locked(c, kind);
    lock_give(&c->lock);
    *status = LX_OK;
    return b->ptr;
}

/* Take back a block whose array died. Returns 0 if ptr is not the core's. */
int
lx_free(lx_core *c, void *ptr)
{
    lock_take(&c->lock);
    lx_block *b = map_find(&c->map, ptr);
    if (b == NULL) {
        int ours = in_an_arena_locked(c, ptr); /* a second free of a plan's block: ignored */
        lock_give(&c->lock);
        return ours;
    }
    if (b->live) { /* a second free of a free block is ignored: it is cached */
        b->live = 0;
        c->fig.bytes_live -= b->size;
        if (b->size >= bin_bytes(c->split_bin)) {
            c->large_live -= b->size;
        }
        c->fig.bytes_cached += b->size;
        if (b->rec || b->carry) {
            note_death_locked(c, b);
        }
        if (b->arena != NULL) {
            put_planned_locked(c, b);
        }
        else if (b->seg != NULL && b->bin < c->quick_bin && !b->seg->orphan) {
            put_quick_locked(c, b); /* the fast path */
        }
        else if (b->seg != NULL) {
            return_piece_locked(c, b);
        }
        else { /* a whole block: the warm-up's, or one that free() released */
            int direct = b->direct; /* the warm-up's: outside every arena */
            release_locked(c, b);
            c->direct_live -= direct;
            if (direct && c->direct_live == 0 && c->arena != NULL && c->cycle >= c->arena->from_cycle) {
                grow_arena_locked(c); /* the first planned step's last outsider died */
            }
        }
    }
    lock_give(&c->lock);
    return 1;
}

/* The block size of a live block of the core, or 0 if ptr is not one. */
size_t
lx_live_size(lx_core *c, void *ptr)
{
    lock_take(&c->lock);
    lx_block *b = map_find(&c->map, ptr);
    size_t size = b != NULL && b->live ? b->size : 0;
    lock_give(&c->lock);
    return size;
}

size_t
lx_trim(lx_core *c, size_t max_cached)
{
    lock_take(&c->lock);
    size_t released = trim_locked(c, max_cached);
    lock_give(&c->lock);
    return released;
}

/* The limit of the requests from now on (0: none); what the core holds stays,
 * and the next request that needs room makes it (lx_alloc). */
void
lx_set_limit(lx_core *c, size_t limit)
{
    lock_take(&c->lock);
    c->limit = limit;
    lock_give(&c->lock);
}

/* Release every whole free block and segment now, and every other when its
 * last array dies (an orphan). Blocks allocated afterwards are cached as usual. */
void
lx_release_all(lx_core *c)
{
    lock_take(&c->lock);
    trim_locked(c, 0); /* the quick lists flushed too */
    drop_plan_locked(c); /* one with live blocks: retired, released when they die */
    /* What is still listed is a free piece of a segment with a live piece. */
    while (c->lru.newer != &c->lru) {
        unlink_free_locked(c, c->lru.newer);
    }
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        if (b != NULL && b->seg != NULL) {
            b->seg->orphan = 1;
        }
        else if (b != NULL && b->arena == NULL) {
            b->orphan = 1; /* every whole block left (the warm-up's) is live */
        }
    }
    lock_give(&c->lock);
}

/* Open a scope: advance the clock, start watching its peaks. Returns the
 * watcher's slot, or -1 when the bookkeeping is out of memory. */
long
lx_scope_enter(lx_core *c)
{
    lock_take(&c->lock);
    size_t slot = 0;
    while (slot < c->nwatchers && c->watchers[slot].in_use) {
        slot++;
    }
    if (slot == c->nwatchers) {
        size_t n = c->nwatchers ? 2 * c->nwatchers : 8;
        lx_watcher *w = realloc(c->watchers, n * sizeof(lx_watcher));
        if (w == NULL) {
            lock_give(&c->lock);
            return -1;
        }
        memset(w + c->nwatchers, 0, (n - c->nwatchers) * sizeof(lx_watcher));
        c->watchers = w;
        c->nwatchers = n;
    }
    c->watchers[slot].in_use = 1;
    c->watchers[slot].owner = pthread_self();
    c->watchers[slot].peak_live = c->fig.bytes_live;
    c->watchers[slot].peak_reserved = c->fig.bytes_live + c->fig.bytes_cached;
    c->watchers[slot].entry = c->fig;
    if (slot >= c->watch_hi) {
        c->watch_hi = slot + 1;
    }
    c->fig.scopes++;
    if (c->depth++ == 0 && c->spans != NULL) {
        open_span_locked(c);
    }
    record_locked(c, LX_EV_SCOPE_ENTER);
    lock_give(&c->lock);
    return (long)slot;
}

/* Close a scope: coalesce the quick list of every bin not asked for during the
 * last evict_after scopes, release every whole free segment (a slab, or the
 * split pool's) that served no request during them, and likewise a plan; then
 * report its figures (those releases counted). -1 if slot is not open. */
int
lx_scope_exit(lx_core *c, size_t slot, lx_scope_figures *figures)
{
    lock_take(&c->lock);
    if (slot >= c->nwatchers || !c->watchers[slot].in_use) {
        lock_give(&c->lock);
        return -1;
    }
    lx_watcher *w = &c->watchers[slot];
    w->in_use = 0;
    while (c->watch_hi > 0 && !c->watchers[c->watch_hi - 1].in_use) {
        c->watch_hi--;
    }
    uint64_t now = c->fig.scopes;
    for (uint32_t i = 0; c->evict_after && i < c->quick_bin; i++) {
        if (c->quick[i].top != NULL && now - c->quick[i].last_used >= c->evict_after) {
            flush_quick_locked(c, i, i + 1);
        }
    }
    for (lx_block *b = c->lru.newer;
         c->evict_after && c->small.whole + c->split.whole > 0 && b != &c->lru;) {
        lx_block *newer = b->newer;
        if (!b->quick && whole_locked(b) && now - b->seg->last_used >= c->evict_after) {
            unlink_free_locked(c, b);
            release_locked(c, b);
        }
        b = newer;
    }
    if (c->evict_after && c->arena != NULL && now - c->arena->last_used >= c->evict_after) {
        drop_plan_locked(c);
    }
    if (--c->depth == 0 && c->spans != NULL) {
        close_span_locked(c);
    }
    record_locked(c, LX_EV_SCOPE_EXIT);
    const lx_figures *in = &w->entry, *out = &c->fig;
    *figures = (lx_scope_figures){
        .hits = out->hits - in->hits, .misses = out->misses - in->misses,
        .upstream_allocs = out->upstream_allocs - in->upstream_allocs,
        .upstream_frees = out->upstream_frees - in->upstream_frees,
        .scopes = out->scopes - in->scopes,
        .live_change = (int64_t)out->bytes_live - (int64_t)in->bytes_live,
        .cached_change = (int64_t)out->bytes_cached - (int64_t)in->bytes_cached,
        .reserved_change = (int64_t)(out->bytes_live + out->bytes_cached) -
                           (int64_t)(in->bytes_live + in->bytes_cached),
        .peak_live = w->peak_live, .peak_reserved = w->peak_reserved};
    lock_give(&c->lock);
    return 0;
}
