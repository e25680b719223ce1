/*
 * For the tests: the bookkeeping checked against itself (Core.audit: every
 * record, segment, free list, arena and figure; called with the core's lock
 * held, it changes nothing), and the core's lock stressed by threads that run
 * without the GIL (Core.stress_lock).
 */
#include "core.h"

#include <stdlib.h>
#include <string.h>

/* Check an arena against the blocks in it (for audit_locked). */
static const char *
audit_arena_locked(lx_core *c, const lx_arena *a, int retired)
{
    size_t blocks = 0, bytes = 0, busy = 0, phases[3] = {0, 0, 0};
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        if (b != NULL && b->arena == a) {
            blocks++;
            bytes += b->size;
            if (b->phase > 2) {
                return "an arena's block has a parity other than even or odd";
            }
            phases[b->phase]++;
        }
    }
    for (size_t w = 0; w < ((a->size >> LX_QUANTUM_LOG2) + 63) / 64; w++) {
        busy += (size_t)__builtin_popcountll(a->busy[w]);
    }
    if (blocks != a->live || bytes != a->live_bytes || busy != bytes >> LX_QUANTUM_LOG2) {
        return "an arena's count of live blocks, bytes or busy granules is wrong";
    }
    if (phases[1] != a->phase_live[0] || phases[2] != a->phase_live[1]) {
        return "an arena's count of live blocks at even and odd places is wrong";
    }
    if (retired && blocks == 0) {
        return "a retired arena with no live block is still held";
    }
    return NULL;
}

/* Check the bookkeeping against itself (for the tests): NULL when every record,
 * segment, free list and figure agrees, else what does not. */
const char *
audit_locked(lx_core *c)
{
    size_t live = 0, cached = 0, owned = 0, records = 0, listed = 0, unlisted = 0, held = 0;
    size_t free_records = 0, large = 0, inactive = 0, quick = 0;
    size_t pool_held[2] = {0, 0}; /* bytes of the slabs, of the split pool's segments */
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        if (b == NULL) {
            continue;
        }
        records++;
        free_records += !b->live;
        large += b->live && b->size >= bin_bytes(c->split_bin) ? b->size : 0;
        if (map_find(&c->map, b->ptr) != b) {
            return "a record cannot be found by its pointer";
        }
        *(b->live ? &live : &cached) += b->size;
        if (b->arena != NULL) { /* a plan's block: its arena is counted below */
            lx_arena *a = b->arena;
            size_t at = arena_offset(a, b->ptr);
            if (!b->live || b->seg != NULL || b->size != bin_bytes(b->bin) || at == SIZE_MAX ||
                at % ((size_t)1 << LX_QUANTUM_LOG2) || !arena_serves(a, at, b->size)) {
                return "a plan's block is free, not a split bin's size, or outside its arena";
            }
            size_t g = at >> LX_QUANTUM_LOG2, end = (at + b->size) >> LX_QUANTUM_LOG2;
            for (; g < end && ((a->busy[g / 64] >> (g % 64)) & 1); g++) {
            }
            if (g != end) {
                return "a plan's live block has a granule not marked busy";
            }
            continue;
        }
        if (b->seg == NULL) { /* the warm-up's, or one free() released: a whole upstream block */
            if (!b->orphan || b->size != bin_bytes(b->bin) || b->quick) {
                return "a whole block is not an orphan, its size not its bin's, or quick";
            }
            if (b->left != NULL || b->right != NULL) {
                return "a whole block has neighbours";
            }
            if (!b->live) {
                return "a whole orphan is free but still held";
            }
            owned++;
            held += b->size;
            continue;
        }
        lx_segment *seg = b->seg;
        size_t offset = (size_t)((char *)b->ptr - (char *)seg->base);
        if (b->size == 0 || b->size % ((size_t)1 << LX_QUANTUM_LOG2) != 0 ||
            (uintptr_t)b->ptr < (uintptr_t)seg->base || offset % ((size_t)1 << LX_QUANTUM_LOG2) ||
            offset + b->size > seg->size || offset + b->size < offset) {
            return "a piece is not a 512-B multiple inside its segment";
        }
        int small = seg->pool == &c->small;
        if (!small && seg->pool != &c->split) {
            return "a segment belongs to no pool";
        }
        if (b->live || b->quick ? (b->bin < c->split_bin) != small || b->size != bin_bytes(b->bin)
                                : b->bin != floor_bin(b->size)) {
            return "a piece's bin is wrong (live or quick: its request's, in its pool; free: "
                   "floor_bin of its size)";
        }
        if (b->quick && (b->live || !small || b->bin >= c->quick_bin || seg->orphan)) {
            return "a quick block is live, in the split pool, of a bin without a quick list, "
                   "or in an orphan slab";
        }
        quick += b->quick ? b->size : 0;
        if ((b->left == NULL) != (offset == 0) ||
            (b->right == NULL) != (offset + b->size == seg->size)) {
            return "a piece at a segment's edge has a neighbour there, or one inside has none";
        }
        if (b->right != NULL && (b->right->left != b || b->right->seg != seg ||
                                 (char *)b->right->ptr != (char *)b->ptr + b->size)) {
            return "a piece's right neighbour does not follow it";
        }
        if (b->right != NULL && !b->live && !b->right->live && !b->quick && !b->right->quick) {
            return "two adjacent free pieces were not coalesced";
        }
        if (b->left != NULL) {
            continue;
        }
        /* The segment's head: the pieces from here tile it exactly. */
        if ((lx_block *)((char *)seg - offsetof(lx_head, seg)) != b || seg->base != b->ptr) {
            return "a segment's head is not its first piece's record";
        }
        size_t tiled = 0, live_pieces = 0, live_bytes = 0;
        for (lx_block *p = b; p != NULL; p = p->right) {
            if (p->seg != seg || map_find(&c->map, p->ptr) != p) {
                return "a segment's piece belongs elsewhere or is not owned";
            }
            tiled += p->size;
            live_pieces += p->live;
            live_bytes += p->live ? p->size : 0;
        }
        if (tiled != seg->size) {
            return "a segment's pieces do not add up to its size";
        }
        if (live_pieces != seg->live || live_bytes != seg->live_bytes) {
            return "a segment's count of live pieces or bytes is wrong";
        }
        inactive += live_pieces > 0 ? seg->size - live_bytes : 0;
        if (seg->orphan && live_pieces == 0) {
            return "an orphan segment with no live piece is still held";
        }
        if (seg->last_used > c->fig.scopes) {
            return "a segment was used in the future";
        }
        owned++;
        held += seg->size;
        pool_held[!small] += seg->size;
    }
    lx_pool *pools[2] = {&c->small, &c->split};
    for (uint32_t i = 0; i < LX_NBINS; i++) {
        for (int list = 0; list < 3; list++) { /* quick, the small pool's, the split pool's */
            lx_bin *bin = list == 0 ? &c->quick[i] : &pools[list - 1]->free[i];
            size_t n = 0;
            for (lx_block *b = bin->top, *prev = NULL; b != NULL; prev = b, b = b->next) {
                if (b->live || b->bin != i || b->prev != prev || map_find(&c->map, b->ptr) != b ||
                    b->seg == NULL || b->seg->orphan || b->quick != (list == 0) ||
                    (list > 0 && b->seg->pool != pools[list - 1])) {
                    return "a free list holds a live, foreign, orphan or unowned block";
                }
                n++;
            }
            if (n != bin->nfree) {
                return "a bin's count of free blocks is wrong";
            }
            if (list > 0 && (n != 0) != (int)((pools[list - 1]->mask[i / 64] >> (i % 64)) & 1)) {
                return "a pool's bin mask disagrees with its lists";
            }
            listed += n;
        }
    }
    size_t in_lru = 0, whole[2] = {0, 0};
    for (lx_block *b = c->lru.newer; b != &c->lru; b = b->newer) {
        if (b->live || b->newer->older != b) {
            return "the LRU ring holds a live block or is broken";
        }
        in_lru++;
        whole[b->seg->pool == &c->split] += !b->quick && whole_locked(b) ? b->size : 0;
    }
    if (whole[0] != c->small.whole || whole[1] != c->split.whole) {
        return "the bytes of a pool's whole free segments are miscounted";
    }
    if (quick != c->quick_bytes) {
        return "the bytes of the quick lists are miscounted";
    }
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        unlisted += b != NULL && !b->live && b->seg != NULL && b->seg->orphan;
    }
    if (in_lru != listed) {
        return "the LRU ring and the free lists disagree";
    }
    int serving_kept = c->serving == NULL;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        lx_plan *p = c->plans[k];
        if (p != NULL && c->arena == NULL) {
            return "a plan has no arena";
        }
        if (p != NULL && p->last_cycle > c->cycle + 1) {
            return "a plan was used in the future";
        }
        serving_kept |= p != NULL && p == c->serving;
        if (p == NULL && (c->candidates >> k) & 1) {
            return "a place with no plan is a candidate to serve the cycle";
        }
        if (p == NULL && (c->stand_ins >> k) & 1) {
            return "a place with no plan may stand in for a cycle";
        }
    }
    if (!serving_kept) {
        return "the plan serving the cycle is not one of the plans";
    }
    if (c->arena != NULL && c->arena->last_used > c->fig.scopes) {
        return "the arena was used in the future";
    }
    for (int k = 0; k < 2; k++) {
        for (lx_arena *a = k == 0 ? c->arena : c->retired; a != NULL; a = k == 0 ? NULL : a->next) {
            const char *broken = audit_arena_locked(c, a, k == 1);
            if (broken != NULL) {
                return broken;
            }
            cached += arena_held(a) - a->live_bytes;
            owned += (a->base != NULL) + (a->base2 != NULL);
            held += arena_held(a);
        }
    }
    if (live != c->fig.bytes_live || cached != c->fig.bytes_cached) {
        return "bytes_live or bytes_cached disagrees with the records";
    }
    if (inactive != c->fig.inactive_split) {
        return "inactive_split disagrees with the free bytes of segments in use";
    }
    if (large != c->large_live) {
        return "large_live disagrees with the live blocks above the split threshold";
    }
    if (held != live + cached) {
        return "the blocks and segments held do not add up to bytes_live + bytes_cached";
    }
    if (pool_held[0] != c->small.held || pool_held[1] != c->split.held ||
        c->split_peak < c->split.held) {
        return "a pool's bytes held (or the split pool's peak in the cycle) are miscounted";
    }
    if (records != c->map.count) {
        return "the map's count of records is wrong";
    }
    if (free_records != listed + unlisted) {
        return "a free block is neither listed nor in an orphan segment";
    }
    if (owned != c->fig.upstream_allocs - c->fig.upstream_frees) {
        return "the blocks owned disagree with upstream allocations minus frees";
    }
    return NULL;
}

/* ---- A stress of the core's lock ------------------------------------------
 *
 * Threads that allocate and free at once, as no Python code can (NumPy takes
 * the GIL around both): each takes `blocks` blocks of `size` bytes in turn,
 * keeps its last LX_STRESS_KEPT, fills each with its own byte and checks that
 * byte all through before it frees the block. A block found changed was handed
 * to two threads at once: what the lock exists to prevent. */
#define LX_STRESS_KEPT 4

typedef struct {
    lx_core *c;
    size_t blocks, size;
    unsigned char mark;
    size_t changed; /* blocks found changed */
    int failed;     /* a request failed */
} lx_stress;

static size_t
changed_bytes(const unsigned char *p, size_t size, unsigned char mark)
{
    size_t changed = 0;
    for (size_t i = 0; i < size; i++) {
        changed += p[i] != mark;
    }
    return changed;
}

static void *
stress_thread(void *arg)
{
    lx_stress *s = arg;
    void *kept[LX_STRESS_KEPT] = {NULL};
    for (size_t i = 0; i < s->blocks + LX_STRESS_KEPT; i++) {
        void **slot = &kept[i % LX_STRESS_KEPT];
        if (*slot != NULL) {
            s->changed += changed_bytes(*slot, s->size, s->mark) > 0;
            lx_free(s->c, *slot);
            *slot = NULL;
        }
        if (i < s->blocks && !s->failed) {
            int zero_filled;
            lx_status status;
            *slot = lx_alloc(s->c, s->size, 0, &zero_filled, &status);
            if (*slot == NULL) {
                s->failed = 1;
                continue;
            }
            memset(*slot, s->mark, s->size);
        }
    }
    return NULL;
}

/* Run `threads` (1 to 64) stress threads at once on core c, `blocks` blocks of
 * `size` bytes each; returns the blocks found changed, or -1 if a thread could
 * not start or a request failed (threads started still finish first). */
long
lx_stress_lock(lx_core *c, int threads, size_t blocks, size_t size)
{
    if (threads < 1 || threads > 64) {
        return -1;
    }
    pthread_t ids[64];
    lx_stress runs[64];
    int started = 0, failed = 0;
    while (started < threads && !failed) {
        runs[started] = (lx_stress){.c = c, .blocks = blocks, .size = size,
                                    .mark = (unsigned char)(started + 1)};
        failed = pthread_create(&ids[started], NULL, stress_thread, &runs[started]) != 0;
        started += !failed;
    }
    long changed = 0;
    for (int k = 0; k < started; k++) {
        pthread_join(ids[k], NULL);
        changed += (long)runs[k].changed;
        failed |= runs[k].failed;
    }
    return failed ? -1 : changed;
}
