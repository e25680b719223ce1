/*
 * The pools: the small pool (blocks up to the split threshold, cut from slabs
 * and coalesced back, the smallest through quick lists: the note "Small
 * blocks" below) and the split pool (larger blocks cut from free segments and
 * coalesced back: "Split pool"). Both are segments tiled by pieces; their free
 * lists and LRU ring, the release of whole free segments, and trimming. Every
 * function expects the core's lock held.
 */
#include "core.h"

#include <stdlib.h>

/* ---- Split pool ---------------------------------------------------------
 *
 * Decision: requests whose block is larger than LX_SPLIT_ABOVE are served by
 * PyTorch-style splitting of segments of their own size, smaller ones from
 * slabs (below: Small blocks).
 *
 * Exact-bin reuse alone leaves every block of a size not in use at the
 * moment of a step's peak reserved but idle, far above the design's 1.1x
 * peak live on the benchmark's training rows (BENCHMARKS.md). Best fit
 * across bins up to a bound (1.25x or 2x the request, the whole block counted
 * live) was the simpler alternative, but it only moves the waste from cached
 * to live bytes, and a freed 4 MiB block still could not hold two 2 MiB
 * arrays. So, for the large requests:
 *
 * - A segment is one upstream allocation. It is tiled by pieces (block
 *   records linked to their neighbours by address, left and right); a miss
 *   makes a segment of exactly the request's block size.
 * - A request takes the best-fitting free piece of the split pool (the
 *   smallest among the first non-empty floor bins at or above its bin) and
 *   splits it: the request's block is the front, the rest stays a free piece
 *   of the same segment. A piece's block size is still bin_size(request), so
 *   every figure and the realloc rule mean what they meant.
 * - A freed piece coalesces at once with free neighbours: no two adjacent
 *   free pieces ever exist, and a segment whose arrays all died is one free
 *   piece again.
 * - Separate segments never coalesce, so a miss consolidates: when the whole
 *   free segments (each smaller than the request, or it would have hit) add
 *   up to the request, they go back upstream and the new segment takes their
 *   bytes as well as the request's. Reserved grows by the request, as on any
 *   miss, but the free bytes become one piece that later requests can split.
 * - Only whole free segments go upstream: trim, the limit, out-of-memory
 *   retries and eviction release those (eviction: a segment that served no
 *   request during evict_after scopes). free() releases the whole free
 *   segments and marks the others orphans: their free pieces are never reused
 *   (they stay counted as cached, which they are), and the segment goes
 *   upstream when its last live piece dies.
 *
 * Offsets within a segment are multiples of 512 B (block sizes are), so every
 * piece keeps its segment's alignment up to 512 B: 64 B for posix_memalign,
 * 512 B for huge host blocks (2 MiB aligned segments), and for cuMemAlloc
 * what its pointer has up to 512 B (documented 256 B; in practice 512 B or
 * more, which CuPy's pool also assumes).
 *
 * Small requests have a pool of their own, so that long-lived small arrays
 * never pin a large segment. The threshold is set by measurement: see the
 * module docstring of luxnn/memory/cache.py.
 */

/* ---- Small blocks -------------------------------------------------------
 *
 * Decision: blocks up to LX_SPLIT_ABOVE come from slabs that split and
 * coalesce, as PyTorch's small pool does (requests up to 1 MiB packed into 2
 * MiB segments), instead of one upstream allocation per block reused only for
 * its own bin: exact bins held, for every bin, as many blocks as a step ever
 * needed of it at once, idle while the step's peak needed other sizes, and
 * freed bytes of one size could not serve another.
 *
 * - A slab is a segment of the small pool: the split pool's pieces, best fit,
 *   splitting and coalescing (above), with their own free lists, so that
 *   small long-lived arrays never pin a large segment and large requests never
 *   fragment a slab.
 * - A miss takes a new slab: a sixteenth of the bytes the slabs hold already,
 *   from LX_SLAB_MIN (16 KiB) to LX_SLAB_MAX (2 MiB, PyTorch's), never less
 *   than the block: a model whose small blocks take a few KiB does not hold 2
 *   MiB for them, and the newest slab's slack is at most LX_SLAB_MIN or a
 *   sixteenth of the slabs, within the 1.1x reserved/live budget (an eighth
 *   would not be). Under a limit that leaves no room for the slab, the slab is
 *   the block alone. Slabs never merge with one another: a block larger than
 *   the free bytes of every slab takes a new one.
 * - The fast path: a block of at most LX_QUICK_MAX whose array dies goes onto
 *   its bin's quick list without coalescing, and the next request of the bin
 *   takes it back, as the exact bins did: the list's top, no split, no record
 *   made or freed (the budget: NumPy's default handler + 20 ns for a 64 B
 *   alloc+free, benchmarks/allocator.py); splitting and coalescing each time
 *   would cost a record's malloc and free and two map updates. Quick blocks
 *   are free pieces that have not coalesced yet (glibc's fastbins): a miss
 *   that no free piece of the slabs serves flushes every quick list (each
 *   block coalesced with its free neighbours) and tries again; so do trim,
 *   free() and a bin's eviction (its quick list not asked for during
 *   evict_after scopes coalesces; a whole free slab that served nothing
 *   during them goes back).
 * - Figures: a slab's free bytes, quick blocks included, are cached bytes; while
 *   a block of it lives they count in inactive_split, the same figure as the
 *   split pool's (free bytes of segments that still hold a live block).
 */

/* Free pieces compared within the first non-empty bin for the best fit. */
#define LX_FIT_SCAN 16

/* The free list a free block is listed in: its bin's quick list, or its pool's list. */
static inline lx_bin *
bin_list(lx_core *c, const lx_block *b)
{
    return b->quick ? &c->quick[b->bin] : &b->seg->pool->free[b->bin];
}

/* A free block leaves the free lists (to be used, or released). The figures
 * are the caller's: moving between lists changes no byte figure. */
void
unlink_free_locked(lx_core *c, lx_block *b)
{
    lx_bin *bin = bin_list(c, b);
    if (b->prev) {
        b->prev->next = b->next;
    }
    else {
        bin->top = b->next;
    }
    if (b->next) {
        b->next->prev = b->prev;
    }
    bin->nfree--;
    if (b->quick) {
        c->quick_bytes -= b->size;
    }
    else {
        lx_pool *pool = b->seg->pool;
        if (bin->nfree == 0) {
            pool->mask[b->bin / 64] &= ~((uint64_t)1 << (b->bin % 64));
        }
        if (whole_locked(b)) {
            pool->whole -= b->size;
        }
    }
    b->older->newer = b->newer;
    b->newer->older = b->older;
}

/* A free block enters the free lists: on top of its bin, newest in the LRU ring. */
void
link_free_locked(lx_core *c, lx_block *b)
{
    lx_bin *bin = bin_list(c, b);
    b->prev = NULL;
    b->next = bin->top;
    if (bin->top) {
        bin->top->prev = b;
    }
    bin->top = b;
    if (b->quick) {
        c->quick_bytes += b->size;
    }
    else {
        lx_pool *pool = b->seg->pool;
        if (bin->nfree == 0) {
            pool->mask[b->bin / 64] |= (uint64_t)1 << (b->bin % 64);
        }
        if (whole_locked(b)) {
            pool->whole += b->size; /* a listed piece keeps its neighbours while listed */
        }
    }
    bin->nfree++;
    b->newer = &c->lru;
    b->older = c->lru.older;
    c->lru.older->newer = b;
    c->lru.older = b;
}

/* Give a free, whole block that is in no free list back upstream and forget
 * it (a segment's last piece: the segment too). Its bytes leave bytes_cached. */
void
release_locked(lx_core *c, lx_block *b)
{
    map_remove(&c->map, b);
    c->up.free(c->up.ctx, b->ptr, b->size);
    c->fig.upstream_frees++;
    c->fig.bytes_cached -= b->size;
    if (b->seg != NULL) {
        b->seg->pool->held -= b->size;
    }
    free(b); /* a segment's last piece is its head: the segment goes with it */
    record_locked(c, LX_EV_RELEASE);
}

/* The first bin at or above `from` whose list in the pool is not empty, or LX_NBINS. */
static inline uint32_t
first_free_bin(const lx_pool *pool, uint32_t from)
{
    size_t w = from / 64;
    uint64_t bits = pool->mask[w] & (~(uint64_t)0 << (from % 64));
    while (bits == 0) {
        if (++w == LX_MASK_WORDS) {
            return LX_NBINS;
        }
        bits = pool->mask[w];
    }
    return (uint32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
}

/* A piece of `size` bytes of `seg` became live (+1) or free (-1): a segment's free
 * bytes count as inactive_split while a piece of it is live. */
void
note_piece_locked(lx_core *c, lx_segment *seg, size_t size, int change)
{
    if (seg->live > 0) {
        c->fig.inactive_split -= seg->size - seg->live_bytes;
    }
    seg->live = change > 0 ? seg->live + 1 : seg->live - 1;
    seg->live_bytes = change > 0 ? seg->live_bytes + size : seg->live_bytes - size;
    if (seg->live > 0) {
        c->fig.inactive_split += seg->size - seg->live_bytes;
    }
}

/* A request of `size` bytes (bin `bin`) from a pool: the best-fitting free
 * piece, cut to size and taken out of the free lists, its remainder a new free
 * piece to its right. NULL when no free piece fits, or (*no_record set) when
 * the bookkeeping has no memory for the remainder's record. */
static lx_block *take_free_locked(lx_core *c, lx_block *best, uint32_t bin, size_t size, int *no_record);

lx_block *
take_piece_locked(lx_core *c, lx_pool *pool, uint32_t bin, size_t size, int *no_record)
{
    uint32_t f = first_free_bin(pool, bin);
    if (f == LX_NBINS) {
        return NULL;
    }
    lx_block *best = pool->free[f].top;
    int scanned = 0;
    for (lx_block *b = best->next; b != NULL && ++scanned < LX_FIT_SCAN; b = b->next) {
        if (b->size < best->size) {
            best = b;
        }
    }
    return take_free_locked(c, best, bin, size, no_record);
}

/* Free piece `best` of a pool (in its free list) for a request of `size` bytes (bin
 * `bin`), its bytes beyond `size` split off as a free piece; NULL (no_record set)
 * when the bookkeeping is out of memory. */
static lx_block *
take_free_locked(lx_core *c, lx_block *best, uint32_t bin, size_t size, int *no_record)
{
    lx_block *rest = NULL;
    if (best->size > size) {
        if ((rest = malloc(sizeof(lx_block))) == NULL || map_reserve(&c->map, 1) != 0) {
            free(rest);
            *no_record = 1;
            return NULL;
        }
    }
    unlink_free_locked(c, best);
    if (rest != NULL) {
        *rest = (lx_block){.ptr = (char *)best->ptr + size, .size = best->size - size,
                           .left = best, .right = best->right, .seg = best->seg};
        rest->bin = floor_bin(rest->size);
        if (best->right != NULL) {
            best->right->left = rest;
        }
        best->right = rest;
        best->size = size;
        map_put(&c->map, rest);
        link_free_locked(c, rest);
    }
    best->bin = bin;
    note_piece_locked(c, best->seg, size, +1);
    best->seg->last_used = c->fig.scopes;
    return best;
}

/* A small request of a bin below quick_bin from its quick list: the block that
 * died last there, or NULL (the fast path: a list's top, no split). */
lx_block *
take_quick_locked(lx_core *c, uint32_t bin)
{
    lx_bin *list = &c->quick[bin];
    lx_block *b = list->top;
    list->last_used = c->fig.scopes;
    if (b == NULL) {
        return NULL;
    }
    list->top = b->next;
    if (b->next != NULL) {
        b->next->prev = NULL;
    }
    list->nfree--;
    c->quick_bytes -= b->size;
    b->older->newer = b->newer;
    b->newer->older = b->older;
    b->quick = 0;
    note_piece_locked(c, b->seg, b->size, +1);
    b->seg->last_used = c->fig.scopes;
    return b;
}

/* The free block of a pool that starts at ptr, for a request of `size` bytes (bin
 * `bin`): a quick block of that bin, or a free piece of at least `size` bytes (split);
 * NULL: none there (live, in an arena, inside a larger piece, too small). */
lx_block *
take_pooled_at_locked(lx_core *c, const void *ptr, uint32_t bin, size_t size)
{
    lx_block *b = map_find(&c->map, ptr);
    if (b == NULL || b->live || b->seg == NULL || b->seg->orphan || b->size < size ||
        (b->quick && b->bin != bin) || (b->seg->pool == &c->split) != (bin >= c->split_bin)) {
        return NULL; /* a request takes a block of its own pool, as any other would */
    }
    if (!b->quick) {
        int no_record = 0;
        return take_free_locked(c, b, bin, size, &no_record);
    }
    unlink_free_locked(c, b);
    b->quick = 0;
    note_piece_locked(c, b->seg, b->size, +1);
    b->seg->last_used = c->fig.scopes;
    return b;
}

/* A small block of a bin below quick_bin whose array died (already out of
 * bytes_live, into bytes_cached), in a segment that is no orphan: on top of
 * its quick list, not coalesced yet (flush_quick_locked does that). */
void
put_quick_locked(lx_core *c, lx_block *b)
{
    note_piece_locked(c, b->seg, b->size, -1);
    b->quick = 1;
    link_free_locked(c, b);
    record_locked(c, LX_EV_RETURN);
}

/* Merge the free piece `right` into its left neighbour `left` (both out of the lists). */
static void
absorb_locked(lx_core *c, lx_block *left, lx_block *right)
{
    left->size += right->size;
    left->right = right->right;
    if (right->right != NULL) {
        right->right->left = left;
    }
    map_remove(&c->map, right);
    free(right); /* never a head: a head has no left neighbour */
}

/* A free piece in no list: coalesce it with its free neighbours, then list it,
 * or, in an orphan segment that it now fills, give the segment back. Returns 0
 * when the segment went back. (Quick blocks are free neighbours that have not
 * coalesced yet: past one, there may be another.) */
static int
coalesce_locked(lx_core *c, lx_block *b)
{
    int listed = !b->seg->orphan; /* an orphan segment's free pieces are in no list */
    while (b->left != NULL && !b->left->live) {
        lx_block *left = b->left;
        if (listed) {
            unlink_free_locked(c, left);
        }
        absorb_locked(c, left, b);
        b = left;
    }
    while (b->right != NULL && !b->right->live) {
        if (listed) {
            unlink_free_locked(c, b->right);
        }
        absorb_locked(c, b, b->right);
    }
    b->quick = 0;
    b->bin = floor_bin(b->size);
    if (listed) {
        link_free_locked(c, b);
    }
    else if (whole_locked(b)) {
        release_locked(c, b);
        return 0;
    }
    return 1;
}

/* A piece whose array died (already out of bytes_live, into bytes_cached):
 * coalesced with its free neighbours and listed, or, in an orphan segment that
 * it now fills, the segment given back. */
void
return_piece_locked(lx_core *c, lx_block *b)
{
    note_piece_locked(c, b->seg, b->size, -1);
    if (coalesce_locked(c, b)) {
        record_locked(c, LX_EV_RETURN); /* its bytes are cached (an orphan's: until it is whole) */
    }
}

/* The quick lists of bins [from, to) give their blocks back to their slabs,
 * coalesced with their free neighbours. */
void
flush_quick_locked(lx_core *c, uint32_t from, uint32_t to)
{
    for (uint32_t bin = from; bin < to && c->quick_bytes > 0; bin++) {
        for (lx_block *b; (b = c->quick[bin].top) != NULL;) {
            unlink_free_locked(c, b);
            coalesce_locked(c, b);
        }
    }
}

/* The bytes of a new slab for a small block of `size` bytes: a sixteenth of what
 * the slabs hold already, from LX_SLAB_MIN to LX_SLAB_MAX in steps of
 * LX_SLAB_MIN, and never less than the block. */
size_t
slab_bytes_locked(const lx_core *c, size_t size)
{
    size_t s = c->small.held / 16;
    s = s < LX_SLAB_MIN ? LX_SLAB_MIN : s > LX_SLAB_MAX ? LX_SLAB_MAX : s;
    s = (s + LX_SLAB_MIN - 1) & ~(LX_SLAB_MIN - 1);
    return s > size ? s : size;
}

/* Release whole free blocks and segments, least recently used first, until at
 * most max_cached bytes stay cached (or nothing whole is left: free pieces of
 * segments in use cannot go back); the quick lists are flushed first, so that
 * slabs whose blocks all died are whole. Returns the bytes released. */
size_t
trim_pools_locked(lx_core *c, size_t max_cached)
{
    size_t released = 0;
    if (c->fig.bytes_cached > max_cached) {
        flush_quick_locked(c, 0, c->quick_bin);
    }
    lx_block *b = c->lru.newer;
    while (b != &c->lru && c->fig.bytes_cached > max_cached) {
        lx_block *newer = b->newer;
        if (whole_locked(b)) {
            unlink_free_locked(c, b);
            released += b->size;
            release_locked(c, b);
        }
        b = newer;
    }
    return released;
}

/* trim_pools_locked, then the plans if their arena is idle (it goes upstream),
 * until at most max_cached bytes stay cached. Returns the bytes released. */
size_t
trim_locked(lx_core *c, size_t max_cached)
{
    size_t released = trim_pools_locked(c, max_cached);
    if (c->fig.bytes_cached > max_cached && c->arena != NULL && c->arena->live == 0) {
        released += drop_plan_locked(c);
    }
    return released;
}

/* Release every whole free segment of the pool that served no request since
 * the scope clock read `since` (UINT64_MAX: all); returns their bytes. */
size_t
release_wholes_locked(lx_core *c, lx_pool *pool, uint64_t since)
{
    size_t released = 0;
    for (lx_block *b = c->lru.newer; pool->whole > 0 && b != &c->lru;) {
        lx_block *newer = b->newer;
        if (!b->quick && b->seg->pool == pool && whole_locked(b) &&
            (since == UINT64_MAX || b->seg->last_used < since)) {
            unlink_free_locked(c, b);
            released += b->size;
            release_locked(c, b);
        }
        b = newer;
    }
    return released;
}
