/*
 * luxnn.memory._core -- the step-scoped caching allocator.
 *
 * One core does the bookkeeping of one AllocCache: which blocks it owns, which
 * are free (by size bin, and in least-recently-used order), and the figures.
 * It never reads or writes the contents of a block, so the same core can serve
 * host pointers (the NumPy front end below) and device pointers (a CuPy front
 * end plugs in its own lx_upstream: section 2b).
 *
 * Sections:
 *   1. size bins          which byte sizes share a free list
 *   1b. split pool        large blocks cut from free segments, coalesced back
 *   1c. step plans        large blocks of a repeated step at planned places
 *   2. upstream           where blocks come from and go back to
 *   2b. CUDA upstream     device memory through the CUDA driver, bound at run time
 *   3. ownership map      pointer -> block record, for every block the core owns
 *   4. the core           free lists, LRU order, figures, scope watchers, timeline
 *   4b. fork              every core lock taken before fork, released after it
 *   5. failure record     why this thread's last cached allocation failed
 *   6. NumPy front end    the NEP 49 handler whose ctx is a core
 *   7. Python bindings    the Core type and the module functions
 *
 * Locking: every mutable field of lx_core is guarded by core->lock. Functions
 * named lx_* take the lock; functions named *_locked expect it held. Nothing
 * done under the lock touches a Python object, so the handler's free (and
 * malloc) may run in any thread, with or without the GIL. Lock order when both
 * are held: the GIL first, then a core lock; no code path holding a core lock
 * waits for the GIL, so the two cannot deadlock.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_2_0_API_VERSION
#include <numpy/arrayobject.h>

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* ---- 1. Size bins -------------------------------------------------------
 *
 * A request of n bytes is served by a block of bin_bytes(bin_of(n)) >= n
 * bytes. Up to LX_SPLIT_ABOVE a free block is reused only for requests of
 * the same bin; above, blocks are pieces cut from free segments (1b).
 *
 *   n <= 8 KiB:       multiples of 512 B (16 classes)
 *   2^k < n <= 2^(k+1): LX_DIV classes per power of two, a step of 2^k / LX_DIV
 *
 * so a block wastes less than 512 B on a small request and less than
 * 1/LX_DIV (6.25 %) of a large one: within the 1.1x reserved/live budget for
 * any shape. LX_DIV trades that slack against reuse across nearby sizes
 * (variable batch or sequence lengths), chosen by measurement: see the
 * module docstring of luxnn/memory/cache.py (benchmarks/allocator.py --sweep).
 *
 * Requests above 2^LX_MAX_LOG2 bytes (128 TiB) are not binned: they fail as
 * out of memory, which they are on any machine.
 */
#define LX_DIV_LOG2 4
#define LX_DIV (1u << LX_DIV_LOG2)
#define LX_QUANTUM_LOG2 9
#define LX_LINEAR_LOG2 (LX_QUANTUM_LOG2 + LX_DIV_LOG2) /* linear classes up to 2^this */
#define LX_MAX_LOG2 47
#define LX_MAX_REQUEST ((size_t)1 << LX_MAX_LOG2)
#define LX_NBINS (LX_DIV * (LX_MAX_LOG2 - LX_LINEAR_LOG2 + 1))

/* The bin of a request of 1 <= n <= LX_MAX_REQUEST bytes. */
static inline uint32_t
bin_of(size_t n)
{
    uint64_t m = (uint64_t)n - 1;
    if (m < ((uint64_t)1 << LX_LINEAR_LOG2)) {
        return (uint32_t)(m >> LX_QUANTUM_LOG2);
    }
    int k = 63 - __builtin_clzll(m); /* 2^k <= m < 2^(k+1), so 2^k < n <= 2^(k+1) */
    uint32_t sub = (uint32_t)((m - ((uint64_t)1 << k)) >> (k - LX_DIV_LOG2));
    return LX_DIV * (uint32_t)(k - LX_LINEAR_LOG2 + 1) + sub;
}

/* The block size of a bin: the largest request it serves. */
static inline size_t
bin_bytes(uint32_t bin)
{
    if (bin < LX_DIV) {
        return (size_t)(bin + 1) << LX_QUANTUM_LOG2;
    }
    int k = (int)(bin / LX_DIV) - 1 + LX_LINEAR_LOG2;
    size_t sub = bin % LX_DIV;
    return ((size_t)1 << k) + ((sub + 1) << (k - LX_DIV_LOG2));
}

/* The largest bin whose block fits in s bytes, for s a positive multiple of
 * 512 B (every bin's size is one): where a free piece of s bytes is listed, so
 * that every piece listed in bin f or above can serve a request of bin f. */
static inline uint32_t
floor_bin(size_t s)
{
    uint32_t b = bin_of(s);
    return bin_bytes(b) == s ? b : b - 1;
}

/* ---- 1b. Split pool -----------------------------------------------------
 *
 * Decision: requests whose block is larger than LX_SPLIT_ABOVE are served by
 * PyTorch-style splitting, smaller ones by exact-bin reuse as before.
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
 * Small requests keep the exact-bin fast path and pool of their own, so that
 * long-lived small arrays never pin a large segment, and alloc+free of a small
 * array costs what it cost. The threshold is set by measurement: see the
 * module docstring of luxnn/memory/cache.py.
 */
#ifndef LX_SPLIT_ABOVE
#define LX_SPLIT_ABOVE ((size_t)64 << 10)
#endif
#define LX_MASK_WORDS ((LX_NBINS + 63) / 64)
/* Steps record and plans serve requests above this (and a lane's of any size): a
 * small block's bin holds as many blocks as a step ever needed at once, idle while
 * the step's peak needs other sizes. */
#ifndef LX_PLAN_ABOVE
#define LX_PLAN_ABOVE ((size_t)16 << 10)
#endif
/* Free pieces compared within the first non-empty bin for the best fit. */
#define LX_FIT_SCAN 16

/* ---- 1c. Step plans -----------------------------------------------------
 *
 * Decision: a training loop repeats one step, the same requests with the same
 * lifetimes, so its large blocks are placed by a plan made from earlier steps
 * rather than online. Online placement (1b) cannot know which block dies
 * when: it held 1.17x (CNN) to 1.27x (MLP) the peak live bytes of the
 * benchmark suite's training steps, against the design's 1.1x. The figures
 * with plans are in the module docstring of luxnn/memory/plan.py.
 *
 * - A cycle is one training step, as the training verbs mark it
 *   (lx_step_begin, lx_step_end; luxnn/training.py): scopes, the user's own
 *   included, neither open nor close one, so none left open (around a loop,
 *   in a suspended generator) can stop planning or grow a record. Each
 *   records its requests above LX_PLAN_ABOVE and its lanes' (below): the
 *   block size, and a clock (counting those allocations and deaths) at the
 *   allocation and at the death; -1 for a block still alive when the next
 *   cycle opens; and the most bytes the split pool held meanwhile. Before the
 *   next cycle opens, the planner (luxnn/memory/plan.py) takes the record and
 *   may install a plan: for each request of a recorded cycle a slot, its
 *   places in even and in odd cycles in one arena, such that requests alive
 *   at the same time never share a byte (the blocks that outlive a cycle, a
 *   step's gradients and new optimizer state, alive while the next step makes
 *   its own, take two places; the core carries them into the next cycle and
 *   records their deaths there). The arena may come in two chunks (two
 *   upstream allocations, no slot across the cut): the first at once, the
 *   second once the plan's first cycle is over (grow_arenas_locked), so that
 *   the first planned step, whose step before kept its results outside the
 *   arena, holds only the first. (The core also serves a second, kept arena,
 *   which the planner no longer asks for.) A plan widened later (threads
 *   interleave beyond it) is repacked into the arena in use; one it cannot
 *   hold waits (LX_BUSY) while a block lives in the arena.
 * - Warm-up (set_warm_up, luxnn/memory/plan.py: WarmUp): while it is on and
 *   no plan is installed, a step's recorded requests go upstream at their
 *   size, as exact-bin blocks marked orphan and direct, and back when they
 *   die: the steps a first plan is made from reserve what they use, nothing
 *   more; what the split pool served before a warm-up step (an optimizer's
 *   first state) goes back when the step begins, if it died.
 * - Lanes: a request made inside a share of a threaded kernel
 *   (luxnn.parallel.for_blocks) carries its lane, set per thread (tl_lane,
 *   below): the kernel call (numbered from the step's beginning), the share,
 *   and its rank among the share's requests. Threads interleave differently
 *   from step to step, so a lane's requests take other ranks in their bins and
 *   other clock ticks; within its lane their order is the same every step. The
 *   record keeps each one's lane, its birth and (if it died in its lane) death
 *   on the lane's own clock, and the planner places a call's lanes side by
 *   side for the call's whole span (luxnn/memory/plan.py).
 * - Matching: a request of a lane takes the slot of its (call, lane, rank);
 *   any other, the k-th such request of a bin in a cycle, takes the bin's
 *   k-th slot, else the (k+1)-th or (k-1)-th (a request from another thread),
 *   if not taken in this cycle and all its bytes are free now. Otherwise it is
 *   a plan miss and goes to a free run of the arena that fits, else to the
 *   split pool or its exact bin, as every request of a cycle without a plan
 *   does.
 * - Safety does not rest on the plan: a bitmap of each arena's 512-B
 *   granules marks the bytes of its live blocks, and a slot serves only when
 *   all of its bytes are free. A cycle unlike the recorded ones (other
 *   shapes, another interleaving of threads, an array kept longer) costs
 *   misses, never an overlap.
 * - An arena's bytes not in use are cached bytes; a plan hit is a hit. While
 *   plans serve, the whole free segments of the split pool that served no
 *   request since the first of them was installed are released when a cycle
 *   opens or closes: they are what the plans replaced (the segments of
 *   misses are kept, and evicted as usual). A replaced, freed, trimmed or
 *   evicted plan's arena goes upstream at once if no block lives in it, else
 *   when its last block dies (a retired arena).
 */

typedef struct lx_arena {
    char *base;               /* its first chunk: offsets [0, first) */
    char *base2;              /* its second chunk, offsets [first, size); NULL: not yet */
    size_t size;              /* bytes of both chunks */
    size_t first;             /* bytes of the first chunk (size: it is the only one) */
    size_t live;              /* blocks alive in it */
    size_t live_bytes;
    uint64_t *busy;           /* bit i: granule i (512 B) belongs to a live block */
    struct lx_arena *next;    /* the next retired arena */
} lx_arena;

typedef struct {
    size_t offset[2]; /* its place in even and odd cycles (equal unless it outlives one) */
    uint32_t arena;   /* LX_CYCLE or LX_KEPT */
    uint32_t bin;     /* the bin of its requests */
    uint64_t taken;   /* the last cycle that took it */
} lx_slot;

/* A lane of a threaded kernel call: its slots, in rank order. */
typedef struct {
    int64_t call, lane;
    uint32_t first, count;
} lx_lane_slots;

/* The lane this thread's requests are made in (set by luxnn.parallel around a
 * share of a kernel call; call 0: none): the kernel call (a number of
 * kernel_calls), the share, the requests made in it so far (of any size), and
 * its clock (those requests and the deaths in it of its blocks). */
typedef struct {
    int64_t call, lane, births, tick;
} lx_lane;

static _Thread_local lx_lane tl_lane;
static _Atomic int64_t kernel_calls; /* threaded kernel calls begun, in every thread */

/* A plan's arenas: the cycle arena, one for every block of the circular two-step
 * schedule (section 1c), and a kept one that install_plan still takes but the
 * planner no longer asks for (kept_size 0). Either may be NULL. */
enum { LX_CYCLE, LX_KEPT };

typedef struct {
    lx_arena *arena[2];
    lx_slot *slots;            /* the others' by bin, and within a bin in the recorded
                                  order; then the lanes' */
    size_t nslots;
    lx_lane_slots *lanes;      /* by (call, lane) */
    size_t nlanes;
    uint64_t installed;        /* scope clock of the first scope that the first of the
                                  plans that replaced one another could serve */
    uint64_t last_used;        /* scope clock when it last served a request */
    uint64_t from_cycle;       /* the first cycle it serves */
    uint32_t first[LX_NBINS];  /* each bin's first slot (if it has any) */
    uint32_t count[LX_NBINS];  /* each bin's slots */
    uint32_t rank[LX_NBINS];   /* this cycle: the bin's requests so far, out of lanes */
} lx_plan;

/* What install_plan says (luxnn.memory.plan.PlanStatus). */
enum { LX_PLAN_INSTALLED, LX_PLAN_LATER, LX_PLAN_NO_ROOM };

/* A recorded request of the open cycle (above LX_PLAN_ABOVE, or a lane's), for the planner. */
typedef struct { /* its int64 fields first, in the order of a record's columns */
    int64_t size, born, died; /* died: -1 while alive; still -1 when the cycle ends */
    int64_t call, lane;       /* its lane (call from 0: the step's first kernel call),
                                 or -1, -1 */
    int64_t lane_born, lane_died; /* on its lane's clock; lane_died -1 unless it died
                                     in its lane */
    struct lx_block *block;   /* while alive in the cycle */
} lx_request;
#define LX_REQUEST_COLUMNS 7  /* the int64 fields above, in their order */
_Static_assert(offsetof(lx_request, block) == LX_REQUEST_COLUMNS * sizeof(int64_t),
               "a request's int64 fields are its record's columns");

/* A request of the last cycle: as recorded, and, for one that outlived it, its
 * death on the clock of the cycle after (-1: alive at that one's end too). */
typedef struct {
    lx_request r;
    int64_t next_died;
} lx_carried;

/* Whether granules [from, to) of the arena are all free; mark them busy or free. */
static int
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

/* ---- 2. Upstream --------------------------------------------------------
 *
 * The allocator the core takes blocks from on a miss and gives them back to
 * on release. A GPU front end supplies one that calls cudaMalloc/cudaFree.
 */
typedef struct {
    const char *name;
    void *ctx;
    /* `size` bytes, zero-filled when `zeroed`; NULL when out of memory. */
    void *(*alloc)(void *ctx, size_t size, int zeroed);
    /* Give back a block from alloc; `size` is the size it was allocated with. */
    void (*free)(void *ctx, void *ptr, size_t size);
} lx_upstream;

/*
 * Host memory. Like NumPy's default handler, blocks of 4 MiB and more get
 * transparent-huge-page advice; we map them ourselves, 2 MiB aligned, so that
 * the advice covers the whole block and the pages come zero-filled (calloc on
 * a miss costs no memset). Smaller blocks come from posix_memalign, 64-byte
 * aligned (a cache line, and enough for any SIMD load).
 */
#define LX_HOST_ALIGN 64
#define LX_HUGE_MIN ((size_t)4 << 20)
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

static const lx_upstream host_upstream = {"host", NULL, host_alloc, host_free};

/* ---- 2b. CUDA upstream --------------------------------------------------
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
 * functions never wait for it, so the lock order above holds.
 */
typedef struct {
    int (*mem_alloc)(unsigned long long *dptr, size_t size); /* cuMemAlloc_v2 */
    int (*mem_free)(unsigned long long dptr);                /* cuMemFree_v2 */
    int (*ctx_push)(void *context);                          /* cuCtxPushCurrent_v2 */
    int (*ctx_pop)(void **context);                          /* cuCtxPopCurrent_v2 */
    void *context; /* the device's primary context, retained by the front end */
} lx_cuda_api;

/* The driver's error code of this thread's last failed upstream allocation
 * (0: none, or a host upstream), for the out-of-memory message. */
static _Thread_local int tl_upstream_error;

static void *
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
    int err = api->ctx_push(api->context);
    if (err == 0) {
        err = api->mem_alloc(&dptr, size);
        api->ctx_pop(&popped);
    }
    tl_upstream_error = err;
    return err == 0 ? (void *)(uintptr_t)dptr : NULL;
}

static void
cuda_free(void *ctx, void *ptr, size_t size)
{
    const lx_cuda_api *api = ctx;
    void *popped;
    (void)size;
    /* A failure here (the driver already shut down at exit) leaves nothing to do. */
    if (api->ctx_push(api->context) == 0) {
        api->mem_free((unsigned long long)(uintptr_t)ptr);
        api->ctx_pop(&popped);
    }
}

/* ---- 3. Ownership map ---------------------------------------------------
 *
 * Every block the core owns, live or free, has a record, found by its
 * pointer in an open-addressing hash map (linear probing, backward-shift
 * deletion, load <= 1/2). A pointer not in the map is not ours: the front
 * end hands it to the plain allocator instead of guessing.
 */
struct lx_segment;

/* A block of the core: a whole upstream allocation (exact-bin pool: seg and
 * arena are NULL), a piece of a segment of the split pool (section 1b), or a
 * live block at a plan's place in an arena (section 1c; never free: its
 * record goes when it dies). */
typedef struct lx_block {
    void *ptr;
    size_t size;                   /* bytes: the request's bin size while live */
    struct lx_block *prev, *next;  /* neighbours in the bin's free list (free blocks) */
    struct lx_block *older, *newer; /* neighbours in the core's LRU ring (free blocks) */
    struct lx_block *left, *right; /* split pool: the pieces before and after (NULL: none) */
    struct lx_segment *seg;        /* split pool: the segment; NULL: the exact-bin pool */
    struct lx_arena *arena;        /* a plan's block (1c): its arena; seg is NULL */
    size_t rec;                    /* 1 + its index in the open cycle's record; 0: none */
    size_t carry;                  /* 1 + its index in the last cycle's record, which it
                                      outlived, while the next one runs; 0: none */
    uint32_t bin;   /* exact-bin pool and live pieces: the request's bin; free
                       pieces: floor_bin(size) */
    uint8_t live;   /* 1: in use by an array; 0: free */
    uint8_t orphan; /* exact-bin pool: live block released by free(): goes upstream
                       when it dies (pieces: seg->orphan) */
    uint8_t direct; /* the warm-up's (section 1c): upstream at its size, back when it dies */
} lx_block;

/* A segment of the split pool. Its leftmost piece (at base) lives exactly as
 * long as the segment (merges keep the left record, splits add records to the
 * right), so both share one allocation, an lx_head: freeing that piece's
 * record frees the segment's. */
typedef struct lx_segment {
    void *base;
    size_t size;        /* bytes allocated upstream */
    size_t live;        /* pieces in use by arrays */
    size_t live_bytes;  /* their bytes */
    uint64_t last_used; /* scope clock when a piece of it last served a request */
    uint8_t orphan;     /* released by free(): free pieces unlisted, upstream when no
                           piece is live */
} lx_segment;

typedef struct {
    lx_block block; /* first: a pointer to the head is a pointer to its block */
    lx_segment seg;
} lx_head;

typedef struct {
    lx_block **slots; /* NULL: empty */
    size_t cap;       /* a power of two */
    size_t count;
} lx_map;

static inline size_t
map_home(const lx_map *m, const void *ptr)
{
    uint64_t x = ((uint64_t)(uintptr_t)ptr >> 6) * 0x9E3779B97F4A7C15ull;
    return (size_t)(x >> 32) & (m->cap - 1);
}

static lx_block *
map_find(const lx_map *m, const void *ptr)
{
    size_t mask = m->cap - 1;
    for (size_t i = map_home(m, ptr);; i = (i + 1) & mask) {
        lx_block *b = m->slots[i];
        if (b == NULL || b->ptr == ptr) {
            return b;
        }
    }
}

/* Insert a record whose pointer is not in the map; capacity must allow it. */
static void
map_put(lx_map *m, lx_block *b)
{
    size_t mask = m->cap - 1, i = map_home(m, b->ptr);
    while (m->slots[i] != NULL) {
        i = (i + 1) & mask;
    }
    m->slots[i] = b;
    m->count++;
}

/* Make room for n more records; -1 when the bookkeeping itself is out of memory. */
static int
map_reserve(lx_map *m, size_t n)
{
    size_t cap = m->cap;
    while (2 * (m->count + n) > cap) {
        cap *= 2;
    }
    if (cap == m->cap) {
        return 0;
    }
    lx_map bigger = {calloc(cap, sizeof(lx_block *)), cap, 0};
    if (bigger.slots == NULL) {
        return -1;
    }
    for (size_t i = 0; i < m->cap; i++) {
        if (m->slots[i] != NULL) {
            map_put(&bigger, m->slots[i]);
        }
    }
    free(m->slots);
    *m = bigger;
    return 0;
}

/* Remove a record that is in the map. */
static void
map_remove(lx_map *m, const lx_block *b)
{
    size_t mask = m->cap - 1, hole = map_home(m, b->ptr);
    while (m->slots[hole] != b) {
        hole = (hole + 1) & mask;
    }
    /* Shift back every later entry of the run that may move into the hole:
     * one whose home is not cyclically within (hole, j]. */
    for (size_t j = (hole + 1) & mask; m->slots[j] != NULL; j = (j + 1) & mask) {
        size_t home = map_home(m, m->slots[j]->ptr);
        int stays = hole < j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (!stays) {
            m->slots[hole] = m->slots[j];
            hole = j;
        }
    }
    m->slots[hole] = NULL;
    m->count--;
}

/* ---- 4. The core --------------------------------------------------------- */

typedef struct {
    uint64_t hits;            /* requests served from a free list */
    uint64_t misses;          /* requests the free lists could not serve */
    uint64_t upstream_allocs; /* blocks and segments obtained from upstream */
    uint64_t upstream_frees;  /* blocks and segments given back to upstream */
    uint64_t scopes;          /* scopes entered; also the clock of evict_after */
    size_t bytes_live;        /* block bytes in use by arrays */
    size_t bytes_cached;      /* bytes held and not in use: free blocks and pieces
                                 (an orphan segment's too, though never reused) */
    size_t peak_live;         /* highest bytes_live since creation or reset_peaks */
    size_t peak_reserved;     /* highest bytes_live + bytes_cached, likewise */
    uint64_t plan_hits;       /* requests served at their planned place (also hits) */
    uint64_t plan_misses;     /* split-pool requests of cycles with a plan it did not serve */
    uint64_t plans;           /* plans installed */
    size_t inactive_split;    /* free bytes of the split pool's segments that hold a live
                                 piece (PyTorch's inactive_split_bytes) */
} lx_figures;

typedef struct {
    lx_block *top;      /* most recently freed block of the bin; linked by next */
    size_t nfree;
    uint64_t last_used; /* scope clock at the bin's last allocation request */
} lx_bin;

/* The peaks of one open scope (slots are reused; in_use marks the open ones). */
typedef struct {
    int in_use;
    pthread_t owner; /* the thread that opened it: a forked child keeps only its own */
    size_t peak_live, peak_reserved;
} lx_watcher;

enum {
    LX_EV_HIT,         /* a request served from a free list */
    LX_EV_UPSTREAM,    /* a request served by a new upstream block */
    LX_EV_RETURN,      /* a block back in the free lists: its array died */
    LX_EV_RELEASE,     /* a block given back upstream */
    LX_EV_SCOPE_ENTER,
    LX_EV_SCOPE_EXIT,
    LX_EV_PLAN,        /* an arena taken from upstream for a plan */
};

typedef struct {
    int64_t t_ns; /* CLOCK_MONOTONIC */
    int64_t bytes_live;
    int64_t bytes_reserved;
    int64_t kind;
} lx_event;

/* A span of the timeline: from a scope opened while none was open to the
 * close of the last one open (one step, in the usual loop; scopes of threads
 * that overlap make one span), or several spans in a row merged. The event
 * ring keeps only the last events; spans cover the whole run: when LX_SPANS
 * rows are full, neighbours merge pairwise and each row takes twice as many. */
typedef struct {
    int64_t t_enter, t_exit; /* CLOCK_MONOTONIC */
    int64_t live_enter, reserved_enter;
    int64_t peak_live, peak_reserved;
    int64_t live_exit, reserved_exit;
    int64_t spans; /* spans merged in this row */
} lx_span;

#define LX_SPANS 4096

typedef struct lx_core {
    pthread_mutex_t lock;
    lx_upstream up;             /* constant after creation */
    size_t limit;               /* 0: none */
    uint64_t evict_after;       /* 0: never */
    lx_figures fig;
    lx_bin bins[LX_NBINS];      /* the exact-bin pool's free lists, bins below split_bin */
    lx_bin split[LX_NBINS];     /* the split pool's free pieces by floor_bin (no last_used) */
    uint64_t split_mask[LX_MASK_WORDS]; /* bit i: split[i] holds a free piece */
    uint32_t split_bin;         /* the first bin served by the split pool; constant */
    uint32_t plan_bin;          /* the first bin that steps record and plans; constant */
    size_t split_whole;         /* bytes of the split pool's whole free segments */
    size_t split_held;          /* bytes of the split pool's segments */
    size_t split_peak;          /* the highest split_held since the cycle opened */
    lx_block lru;               /* ring sentinel: lru.newer is the oldest free block */
    lx_map map;
    lx_watcher *watchers;
    size_t nwatchers;           /* slots allocated */
    size_t watch_hi;            /* slots at or above this index are not in use */
    lx_event *events;           /* ring of the last event_cap events; NULL: not recording */
    size_t event_cap;
    uint64_t events_total;
    lx_span *spans;             /* LX_SPANS rows while recording, else NULL */
    size_t nspans;              /* rows in use */
    int64_t span_group;         /* spans a full row holds */
    lx_span open_span;          /* the span open now, while depth > 0 */
    /* Step plans (section 1c). */
    size_t depth;               /* scopes open */
    uint64_t cycle;             /* cycles opened */
    uint64_t cycle_misses;      /* plan misses of the open (or last) cycle */
    lx_plan *plan;              /* NULL: none */
    lx_arena *retired;          /* replaced arenas with live blocks */
    lx_request *rec;            /* the open cycle's record */
    size_t nrec, rec_cap;
    lx_carried *prev;           /* the last final record, with the deaths of its blocks
                                   that outlived it during the cycle after */
    size_t nprev, prev_cap;
    int64_t tick;               /* the record's clock */
    int rec_lost;               /* the record ran out of memory: incomplete */
    int pending;                /* the last cycle closed; its record not yet taken */
    int finished;               /* the last cycle's record is final (finish_record_locked) */
    int stepping;               /* a step is open: the cycle */
    int warm_up;                /* while no plan serves, a step's split-pool requests go
                                   upstream at their size, and back when they die */
    size_t direct_live;         /* the warm-up's blocks alive (section 1c) */
    size_t large_live;          /* bytes of live blocks above the split threshold */
    size_t large_peak;          /* the highest large_live since the cycle opened */
    pthread_t step_owner;       /* the thread that began it */
    int64_t call_base;          /* kernel_calls when it began */
    struct lx_core *fork_prev, *fork_next; /* every core, for fork (section 4b); guarded
                                              by cores_lock, not by lock */
} lx_core;

typedef enum {
    LX_OK,
    LX_FALLBACK,      /* the bookkeeping is out of memory: use the plain allocator */
    LX_OVER_LIMIT,    /* one request larger than the limit */
    LX_OUT_OF_MEMORY, /* upstream failed, even after releasing every free block */
    LX_BUSY,          /* a plan's arena that must be replaced is in use: not now */
} lx_status;

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static void
record_locked(lx_core *c, int kind)
{
    if (c->events == NULL) {
        return;
    }
    lx_event *e = &c->events[c->events_total % c->event_cap];
    e->t_ns = now_ns();
    e->bytes_live = (int64_t)c->fig.bytes_live;
    e->bytes_reserved = (int64_t)(c->fig.bytes_live + c->fig.bytes_cached);
    e->kind = kind;
    c->events_total++;
}

static void
open_span_locked(lx_core *c)
{
    int64_t live = (int64_t)c->fig.bytes_live;
    int64_t reserved = (int64_t)(c->fig.bytes_live + c->fig.bytes_cached);
    c->open_span = (lx_span){now_ns(), 0, live, reserved, live, reserved, 0, 0, 1};
}

static lx_span
merged_spans(lx_span a, lx_span b)
{
    a.t_exit = b.t_exit;
    a.peak_live = b.peak_live > a.peak_live ? b.peak_live : a.peak_live;
    a.peak_reserved = b.peak_reserved > a.peak_reserved ? b.peak_reserved : a.peak_reserved;
    a.live_exit = b.live_exit;
    a.reserved_exit = b.reserved_exit;
    a.spans += b.spans;
    return a;
}

static void
close_span_locked(lx_core *c)
{
    lx_span *s = &c->open_span;
    s->t_exit = now_ns();
    s->live_exit = (int64_t)c->fig.bytes_live;
    s->reserved_exit = (int64_t)(c->fig.bytes_live + c->fig.bytes_cached);
    if (c->nspans > 0 && c->spans[c->nspans - 1].spans < c->span_group) {
        c->spans[c->nspans - 1] = merged_spans(c->spans[c->nspans - 1], *s);
        return;
    }
    if (c->nspans == LX_SPANS) {
        for (size_t i = 0; i < LX_SPANS / 2; i++) {
            c->spans[i] = merged_spans(c->spans[2 * i], c->spans[2 * i + 1]);
        }
        c->nspans = LX_SPANS / 2;
        c->span_group *= 2;
    }
    c->spans[c->nspans++] = *s;
}

/* After bytes_live or the reserved bytes grew: raise the peaks that they pass. */
static void
note_peaks_locked(lx_core *c)
{
    size_t live = c->fig.bytes_live, reserved = live + c->fig.bytes_cached;
    if (live > c->fig.peak_live) {
        c->fig.peak_live = live;
    }
    if (reserved > c->fig.peak_reserved) {
        c->fig.peak_reserved = reserved;
    }
    if (c->spans != NULL && c->depth > 0) {
        if ((int64_t)live > c->open_span.peak_live) {
            c->open_span.peak_live = (int64_t)live;
        }
        if ((int64_t)reserved > c->open_span.peak_reserved) {
            c->open_span.peak_reserved = (int64_t)reserved;
        }
    }
    for (size_t i = 0; i < c->watch_hi; i++) {
        lx_watcher *w = &c->watchers[i];
        if (w->in_use && live > w->peak_live) {
            w->peak_live = live;
        }
        if (w->in_use && reserved > w->peak_reserved) {
            w->peak_reserved = reserved;
        }
    }
}

/* The free list a free block is listed in. */
static inline lx_bin *
bin_list(lx_core *c, const lx_block *b)
{
    return b->seg == NULL ? &c->bins[b->bin] : &c->split[b->bin];
}

/* A free block leaves the free lists (to be used, or released). The figures
 * are the caller's: moving between lists changes no byte figure. */
static void
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
    if (--bin->nfree == 0 && b->seg != NULL) {
        c->split_mask[b->bin / 64] &= ~((uint64_t)1 << (b->bin % 64));
    }
    if (b->seg != NULL && b->left == NULL && b->right == NULL) {
        c->split_whole -= b->size;
    }
    b->older->newer = b->newer;
    b->newer->older = b->older;
}

/* A free block enters the free lists: on top of its bin, newest in the LRU ring. */
static void
link_free_locked(lx_core *c, lx_block *b)
{
    lx_bin *bin = bin_list(c, b);
    b->prev = NULL;
    b->next = bin->top;
    if (bin->top) {
        bin->top->prev = b;
    }
    bin->top = b;
    if (bin->nfree++ == 0 && b->seg != NULL) {
        c->split_mask[b->bin / 64] |= (uint64_t)1 << (b->bin % 64);
    }
    if (b->seg != NULL && b->left == NULL && b->right == NULL) {
        c->split_whole += b->size; /* a listed piece keeps its neighbours while listed */
    }
    b->newer = &c->lru;
    b->older = c->lru.older;
    c->lru.older->newer = b;
    c->lru.older = b;
}

/* Whether a free block is a whole upstream allocation, which alone may go back. */
static inline int
whole_locked(const lx_block *b)
{
    return b->left == NULL && b->right == NULL;
}

/* Give a free, whole block that is in no free list back upstream and forget
 * it (a segment's last piece: the segment too). Its bytes leave bytes_cached. */
static void
release_locked(lx_core *c, lx_block *b)
{
    map_remove(&c->map, b);
    c->up.free(c->up.ctx, b->ptr, b->size);
    c->fig.upstream_frees++;
    c->fig.bytes_cached -= b->size;
    c->split_held -= b->seg != NULL ? b->size : 0;
    free(b); /* a segment's last piece is its head: the segment goes with it */
    record_locked(c, LX_EV_RELEASE);
}

/* The first bin at or above `from` whose split-pool list is not empty, or LX_NBINS. */
static inline uint32_t
first_split_bin(const lx_core *c, uint32_t from)
{
    size_t w = from / 64;
    uint64_t bits = c->split_mask[w] & (~(uint64_t)0 << (from % 64));
    while (bits == 0) {
        if (++w == LX_MASK_WORDS) {
            return LX_NBINS;
        }
        bits = c->split_mask[w];
    }
    return (uint32_t)(w * 64 + (size_t)__builtin_ctzll(bits));
}

/* A piece of `size` bytes of `seg` became live (+1) or free (-1): a segment's free
 * bytes count as inactive_split while a piece of it is live. */
static void
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

/* A split-pool request of `size` bytes (bin `bin`): the best-fitting free
 * piece, cut to size and taken out of the free lists, its remainder a new free
 * piece to its right. NULL when no free piece fits, or (*no_record set) when
 * the bookkeeping has no memory for the remainder's record. */
static lx_block *
take_piece_locked(lx_core *c, uint32_t bin, size_t size, int *no_record)
{
    uint32_t f = first_split_bin(c, bin);
    if (f == LX_NBINS) {
        return NULL;
    }
    lx_block *best = c->split[f].top;
    int scanned = 0;
    for (lx_block *b = best->next; b != NULL && ++scanned < LX_FIT_SCAN; b = b->next) {
        if (b->size < best->size) {
            best = b;
        }
    }
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

/* A piece whose array died (already out of bytes_live, into bytes_cached):
 * coalesce it with its free neighbours, then list it, or, in an orphan
 * segment that it now fills, give the segment back. */
static void
return_piece_locked(lx_core *c, lx_block *b)
{
    lx_segment *seg = b->seg;
    int listed = !seg->orphan; /* an orphan segment's free pieces are in no list */
    note_piece_locked(c, seg, b->size, -1);
    if (b->left != NULL && !b->left->live) {
        lx_block *left = b->left;
        if (listed) {
            unlink_free_locked(c, left);
        }
        absorb_locked(c, left, b);
        b = left;
    }
    if (b->right != NULL && !b->right->live) {
        if (listed) {
            unlink_free_locked(c, b->right);
        }
        absorb_locked(c, b, b->right);
    }
    b->bin = floor_bin(b->size);
    if (listed) {
        link_free_locked(c, b);
    }
    else if (whole_locked(b)) {
        release_locked(c, b);
        return;
    }
    record_locked(c, LX_EV_RETURN); /* its bytes are cached (an orphan's: until it is whole) */
}

static size_t drop_plan_locked(lx_core *c);
static void grow_arenas_locked(lx_core *c);

/* Release whole free blocks and segments, least recently used first, until at
 * most max_cached bytes stay cached (or nothing whole is left: free pieces of
 * segments in use cannot go back). Returns the bytes released. */
static size_t
trim_pools_locked(lx_core *c, size_t max_cached)
{
    size_t released = 0;
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

/* trim_pools_locked, then the plan if one of its arenas is idle (that one goes
 * upstream, one in use retires), until at most max_cached bytes stay cached.
 * Returns the bytes released. */
static size_t
trim_locked(lx_core *c, size_t max_cached)
{
    size_t released = trim_pools_locked(c, max_cached);
    if (c->fig.bytes_cached > max_cached && c->plan != NULL &&
        ((c->plan->arena[LX_CYCLE] != NULL && c->plan->arena[LX_CYCLE]->live == 0) ||
         (c->plan->arena[LX_KEPT] != NULL && c->plan->arena[LX_KEPT]->live == 0))) {
        released += drop_plan_locked(c); /* an arena in use retires */
    }
    return released;
}

/* Release every whole free segment of the split pool that served no request
 * since the scope clock read `since` (UINT64_MAX: all); returns their bytes. */
static size_t
release_split_wholes_locked(lx_core *c, uint64_t since)
{
    size_t released = 0;
    for (lx_block *b = c->lru.newer; c->split_whole > 0 && b != &c->lru;) {
        lx_block *newer = b->newer;
        if (b->seg != NULL && whole_locked(b) &&
            (since == UINT64_MAX || b->seg->last_used < since)) {
            unlink_free_locked(c, b);
            released += b->size;
            release_locked(c, b);
        }
        b = newer;
    }
    return released;
}

/* ---- 4, continued: step plans (section 1c) ---------------------------- */

/* The bytes of arena a taken from upstream: its first chunk, and its second once there
 * (a retired arena may have given back the one of its chunks that no block lives in). */
static inline size_t
arena_held(const lx_arena *a)
{
    return (a->base != NULL ? a->first : 0) + (a->base2 != NULL ? a->size - a->first : 0);
}

/* The address of offset `at` of arena a (in a chunk it holds). */
static inline char *
arena_at(const lx_arena *a, size_t at)
{
    return at < a->first ? a->base + at : a->base2 + (at - a->first);
}

/* The offset in arena a of ptr, or SIZE_MAX when ptr is in neither of its chunks. */
static size_t
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

/* Whether bytes [at, at + size) of arena a lie in one chunk that it holds. */
static inline int
arena_serves(const lx_arena *a, size_t at, size_t size)
{
    return at + size <= arena_held(a) && (at >= a->first || at + size <= a->first);
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

static void
free_plan(lx_plan *p)
{
    if (p != NULL) {
        free(p->slots);
        free(p->lanes);
        free(p);
    }
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
static size_t
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

/* The plan serves no more: its arenas are dropped. Returns the bytes released now. */
static size_t
drop_plan_locked(lx_core *c)
{
    lx_plan *p = c->plan;
    if (p == NULL) {
        return 0;
    }
    c->plan = NULL;
    size_t released = drop_arena_locked(c, p->arena[LX_CYCLE]);
    released += drop_arena_locked(c, p->arena[LX_KEPT]);
    free_plan(p);
    return released;
}

/* A block at offset `at` of arena a, its granules marked busy; NULL when the
 * bookkeeping is out of memory. */
static lx_block *
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
    c->plan->last_used = c->fig.scopes;
    return b;
}

/* The lowest offset of a run of free granules of arena a that holds `size` bytes
 * in one of its chunks. */
static int
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

/* The slots of lane (call, lane) of plan p, or NULL. */
static const lx_lane_slots *
lane_slots(const lx_plan *p, int64_t call, int64_t lane)
{
    size_t lo = 0, hi = p->nlanes;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const lx_lane_slots *l = &p->lanes[mid];
        if (l->call == call && l->lane == lane) {
            return l;
        }
        if (l->call < call || (l->call == call && l->lane < lane)) {
            lo = mid + 1;
        }
        else {
            hi = mid;
        }
    }
    return NULL;
}

/* A recorded request of `size` bytes (bin `bin`) at its planned place: the
 * slot of its lane and rank there (call >= 0), else of its rank among the
 * bin's requests out of lanes; NULL: a plan miss, served elsewhere. */
static lx_block *
take_planned_locked(lx_core *c, uint32_t bin, size_t size, int64_t call, int64_t lane,
                    int64_t lane_rank)
{
    lx_plan *p = c->plan;
    if (c->cycle < p->from_cycle) {
        return NULL; /* installed while this cycle was open: not planned for, not a miss */
    }
    uint32_t first, count, rank;
    int tries; /* the slot of its rank, then (out of lanes) its neighbours' */
    if (call >= 0) {
        const lx_lane_slots *l = lane_slots(p, call, lane);
        first = l != NULL ? l->first : 0;
        count = l != NULL ? l->count : 0;
        rank = lane_rank < (int64_t)count ? (uint32_t)lane_rank : count;
        tries = 1;
    }
    else {
        first = p->first[bin];
        count = p->count[bin];
        rank = p->rank[bin]++;
        tries = 3; /* a neighbour's: another thread may have made a request of the size */
    }
    uint32_t ranks[3] = {rank, rank + 1, rank - 1};
    lx_slot *own = rank < count ? &p->slots[first + rank] : NULL;
    for (int k = 0; k < tries && own != NULL; k++) {
        if (ranks[k] >= count) { /* also rank - 1 for rank 0 */
            continue;
        }
        lx_slot *s = &p->slots[first + ranks[k]];
        lx_arena *a = p->arena[s->arena];
        if (s->arena != own->arena || s->taken == c->cycle || s->bin != bin) {
            continue;
        }
        /* Its place of this cycle's parity, else the other (a block that outlives its
         * cycle: a cycle with no request between steps shifts the parity). */
        size_t at = s->offset[c->cycle & 1];
        if (!arena_serves(a, at, size) ||
            !granules_free(a, at >> LX_QUANTUM_LOG2, (at + size) >> LX_QUANTUM_LOG2)) {
            at = s->offset[(c->cycle + 1) & 1];
        }
        if (!arena_serves(a, at, size) ||
            !granules_free(a, at >> LX_QUANTUM_LOG2, (at + size) >> LX_QUANTUM_LOG2)) {
            continue;
        }
        lx_block *b = arena_block_locked(c, a, at, size, bin);
        if (b == NULL) {
            break;
        }
        s->taken = c->cycle;
        c->fig.plan_hits++;
        return b;
    }
    c->fig.plan_misses++;
    c->cycle_misses++;
    /* A miss (the planner widens the plan from it): any free run of the cycle arena that
     * fits, before the split pool (threads' temporaries of one size swap places from step
     * to step); the bitmap keeps it clear of every live block. */
    lx_arena *a = p->arena[LX_CYCLE];
    size_t at;
    return a != NULL && free_run(a, size, &at) ? arena_block_locked(c, a, at, size, bin) : NULL;
}

/* Whether arena a serves no plan any more (it stays until its last block dies). */
static int
retired_locked(const lx_core *c, const lx_arena *a)
{
    return c->plan == NULL || (c->plan->arena[LX_CYCLE] != a && c->plan->arena[LX_KEPT] != a);
}

/* Whether ptr lies in an arena of the plan or a retired one. */
static int
in_an_arena_locked(const lx_core *c, const void *ptr)
{
    for (int k = 0; k < 3; k++) {
        const lx_arena *a = k < 2 ? (c->plan != NULL ? c->plan->arena[k] : NULL) : c->retired;
        for (; a != NULL; a = k < 2 ? NULL : a->next) {
            if (arena_offset(a, ptr) != SIZE_MAX) {
                return 1;
            }
        }
    }
    return 0;
}

/* A planned block whose array died (already out of bytes_live, into
 * bytes_cached): its bytes are free again, its record goes. */
static void
put_planned_locked(lx_core *c, lx_block *b)
{
    lx_arena *a = b->arena;
    size_t at = arena_offset(a, b->ptr);
    mark_granules(a, at >> LX_QUANTUM_LOG2, (at + b->size) >> LX_QUANTUM_LOG2, 0);
    a->live--;
    a->live_bytes -= b->size;
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

/* The lane of this thread's requests in the open step (*call counted from the
 * step's first kernel call), or -1, -1: none, or one of an earlier step (a
 * lane left set by an interrupt: its requests are matched as any other's). */
static void
lane_of_locked(const lx_core *c, int64_t *call, int64_t *lane)
{
    int in_lane = c->stepping && tl_lane.call > c->call_base;
    *call = in_lane ? tl_lane.call - c->call_base - 1 : -1;
    *lane = in_lane ? tl_lane.lane : -1;
}

/* The open cycle's record: a split-pool block was allocated, or died. */
static void
note_birth_locked(lx_core *c, lx_block *b)
{
    if (c->rec_lost) {
        return;
    }
    if (c->nrec == c->rec_cap) {
        size_t cap = c->rec_cap ? 2 * c->rec_cap : 256;
        lx_request *rec = realloc(c->rec, cap * sizeof(lx_request));
        if (rec == NULL) {
            c->rec_lost = 1;
            return;
        }
        c->rec = rec;
        c->rec_cap = cap;
    }
    int64_t call, lane;
    lane_of_locked(c, &call, &lane);
    c->rec[c->nrec] = (lx_request){(int64_t)b->size, c->tick++, -1, call, lane,
                                   call >= 0 ? tl_lane.tick++ : -1, -1, b};
    b->rec = ++c->nrec;
}

static void
note_death_locked(lx_core *c, lx_block *b)
{
    if (b->rec) {
        lx_request *r = &c->rec[b->rec - 1];
        int64_t call, lane;
        lane_of_locked(c, &call, &lane);
        r->died = c->tick++;
        if (r->call >= 0 && r->call == call && r->lane == lane) {
            r->lane_died = tl_lane.tick++;
        }
        r->block = NULL;
        b->rec = 0;
    }
    if (b->carry) {
        lx_carried *r = &c->prev[b->carry - 1];
        r->next_died = c->tick++;
        r->r.block = NULL;
        b->carry = 0;
    }
}

/* The last cycle's record is final: its blocks alive now outlive it (died
 * stays -1) and are carried into the next (their deaths there are noted); those
 * that died since it closed died at its end, as far as the planner is
 * concerned. The record before it is dropped (its blocks still alive outlive
 * two cycles: next_died stays -1). */
static void
finish_record_locked(lx_core *c)
{
    for (size_t i = 0; i < c->nprev; i++) {
        if (c->prev[i].r.block != NULL) {
            c->prev[i].r.block->carry = 0;
        }
    }
    c->nprev = 0;
    if (c->nrec > c->prev_cap) {
        lx_carried *prev = realloc(c->prev, c->nrec * sizeof(lx_carried));
        if (prev != NULL) {
            c->prev = prev;
            c->prev_cap = c->nrec;
        }
    }
    int keep = !c->rec_lost && c->nrec <= c->prev_cap;
    for (size_t i = 0; i < c->nrec; i++) {
        lx_request *r = &c->rec[i];
        lx_block *b = r->block;
        if (b != NULL) {
            b->rec = 0;
            r->block = NULL;
        }
        if (keep) {
            c->prev[i] = (lx_carried){*r, -1};
            c->prev[i].r.block = b;
            if (b != NULL) {
                b->carry = i + 1;
            }
        }
    }
    c->nprev = keep ? c->nrec : 0;
    c->pending = 0;
    c->finished = 1;
}

/* A cycle opens: a fresh record, every slot free to take, and while a plan
 * serves, no whole free segment of the split pool that served nothing since
 * the plan came stays (what the plan replaced; misses' segments are kept, and
 * evicted as usual). */
static void
open_cycle_locked(lx_core *c)
{
    if (!c->finished) {
        finish_record_locked(c); /* nobody took it, or it holds no request */
    }
    c->finished = 0;
    c->cycle++;
    if (c->plan != NULL) {
        memset(c->plan->rank, 0, sizeof(c->plan->rank));
        if (c->cycle > c->plan->from_cycle) {
            grow_arenas_locked(c); /* a warm-up block outlived the first planned step */
        }
        /* Blocks that outlived the last cycle may have died since it closed. */
        release_split_wholes_locked(c, c->plan->installed);
    }
    else if (c->warm_up) {
        /* The warm-up holds nothing: what the split pool served before it (an optimizer's
         * first state, made outside a step) goes back once it died. */
        release_split_wholes_locked(c, UINT64_MAX);
    }
    c->cycle_misses = 0;
    c->large_peak = c->large_live;
    c->split_peak = c->split_held;
    c->nrec = 0;
    c->tick = 0;
    c->rec_lost = 0;
}

/* ---- 5. Failure record --------------------------------------------------
 *
 * A NEP 49 malloc can only return NULL, and NumPy then raises its own
 * MemoryError. So a failing request leaves its reason and the cache's figures
 * here, per thread; the Python scope that sees the MemoryError replaces it
 * with one that carries them (luxnn.memory.scope).
 */
typedef struct {
    uint64_t seq;   /* failures in this thread so far */
    int status;     /* LX_OVER_LIMIT or LX_OUT_OF_MEMORY */
    size_t request; /* bytes asked for */
    size_t limit;   /* the cache's limit, 0 if none */
    lx_figures fig; /* the cache's figures when it failed */
    int upstream_error; /* the CUDA driver's error code, 0 for host memory */
} lx_failure;

static _Thread_local lx_failure tl_failure;

static void
note_failure_locked(lx_core *c, lx_status status, size_t request)
{
    tl_failure.seq++;
    tl_failure.status = status;
    tl_failure.request = request;
    tl_failure.limit = c->limit;
    tl_failure.fig = c->fig;
    tl_failure.upstream_error = tl_upstream_error;
}

/* ---- 4b. Fork ------------------------------------------------------------
 *
 * fork() copies only the thread that calls it. A core lock that another thread
 * held at that moment would stay locked in the child for ever, over a half-done
 * operation. So (pthread_atfork, the standard pattern) the forking thread takes
 * every core's lock before the fork, and parent and child release them after
 * it: no core is mid-operation in the child. In the child, the scopes that
 * other threads had open can never close: they are closed there, and a step
 * that another thread began ends unrecorded, so the child's own steps record
 * and plan afresh. Lock order: cores_lock, then the cores' locks in list
 * order; nothing else holds two core locks, nor cores_lock with a core lock.
 */
static pthread_mutex_t cores_lock = PTHREAD_MUTEX_INITIALIZER;
static lx_core *cores; /* every live core, linked by fork_next */

static void
enlist_core(lx_core *c)
{
    pthread_mutex_lock(&cores_lock);
    c->fork_prev = NULL;
    c->fork_next = cores;
    if (cores != NULL) {
        cores->fork_prev = c;
    }
    cores = c;
    pthread_mutex_unlock(&cores_lock);
}

static void
unlist_core(lx_core *c)
{
    pthread_mutex_lock(&cores_lock);
    if (c->fork_prev != NULL) {
        c->fork_prev->fork_next = c->fork_next;
    } else {
        cores = c->fork_next;
    }
    if (c->fork_next != NULL) {
        c->fork_next->fork_prev = c->fork_prev;
    }
    pthread_mutex_unlock(&cores_lock);
}

static void
before_fork(void)
{
    pthread_mutex_lock(&cores_lock);
    for (lx_core *c = cores; c != NULL; c = c->fork_next) {
        pthread_mutex_lock(&c->lock);
    }
}

static void
after_fork_in_parent(void)
{
    for (lx_core *c = cores; c != NULL; c = c->fork_next) {
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&cores_lock);
}

/* In a forked child: the scopes of threads that the child has not. */
static void
close_foreign_scopes_locked(lx_core *c)
{
    pthread_t me = pthread_self();
    for (size_t i = 0; i < c->watch_hi; i++) {
        lx_watcher *w = &c->watchers[i];
        if (w->in_use && !pthread_equal(w->owner, me)) {
            w->in_use = 0;
            c->depth--;
        }
    }
    while (c->watch_hi > 0 && !c->watchers[c->watch_hi - 1].in_use) {
        c->watch_hi--;
    }
    if (c->stepping && !pthread_equal(c->step_owner, me)) { /* it ends unrecorded */
        finish_record_locked(c);
        c->nrec = 0;
        c->stepping = 0;
    }
}

static void
after_fork_in_child(void)
{
    for (lx_core *c = cores; c != NULL; c = c->fork_next) {
        close_foreign_scopes_locked(c);
        pthread_mutex_unlock(&c->lock);
    }
    pthread_mutex_unlock(&cores_lock);
}

/* ---- 4, continued: the core's operations ------------------------------ */

static lx_core *
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
    if (c->map.slots == NULL || (event_cap && (c->events == NULL || c->spans == NULL)) ||
        pthread_mutex_init(&c->lock, NULL) != 0) {
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
    while (c->plan_bin < c->split_bin && bin_bytes(c->plan_bin) <= LX_PLAN_ABOVE) {
        c->plan_bin++;
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
static void
lx_core_destroy(lx_core *c)
{
    unlist_core(c);
    trim_locked(c, 0);
    for (size_t i = 0; i < c->map.cap; i++) {
        free(c->map.slots[i]); /* records left (heads with their segments); memory stays */
    }
    if (c->plan != NULL) { /* an arena with a live block: the memory stays */
        for (int k = 0; k < 2; k++) {
            if (c->plan->arena[k] != NULL) {
                free(c->plan->arena[k]->busy);
                free(c->plan->arena[k]);
            }
        }
        free_plan(c->plan);
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
    pthread_mutex_destroy(&c->lock);
    free(c);
}

/*
 * A block of at least n bytes for the caller to use, or NULL with the reason
 * in *status. *zero_filled tells whether the block is known to hold zeros
 * (only ever for a new upstream block requested with zeroed).
 */
static void *
lx_alloc(lx_core *c, size_t n, int zeroed, int *zero_filled, lx_status *status)
{
    *zero_filled = 0;
    n = n ? n : 1;
    pthread_mutex_lock(&c->lock);
    uint32_t bin = n <= LX_MAX_REQUEST ? bin_of(n) : 0;
    size_t size = n <= LX_MAX_REQUEST ? bin_bytes(bin) : 0;
    int split = bin >= c->split_bin, no_record = 0;
    int64_t call = -1, lane = -1, lane_rank = 0;
    if (c->stepping && size != 0) {
        lane_of_locked(c, &call, &lane);
        lane_rank = call >= 0 ? tl_lane.births++ : 0;
    }
    /* Recorded and planned: requests above LX_PLAN_ABOVE, and a lane's small ones, of
     * which threads can hold more at once in one step than in another. */
    int recorded = (bin >= c->plan_bin || call >= 0) && c->stepping;
    /* (The small ones out of lanes keep their bins: a step without larger requests is
     * not planned, and needs no warm-up.) */
    int direct = recorded && (split || call >= 0) && c->warm_up && c->plan == NULL;
    int seg = split && !direct; /* a miss makes a new segment of the split pool */
    lx_block *b = NULL;
    if (size == 0) {
        /* above 128 TiB: a miss that fails below */
    }
    else if (direct) {
        /* warm-up: a miss, by design */
    }
    else if (!split) { /* the fast path: exact-bin reuse */
        if (recorded && c->plan != NULL) {
            b = take_planned_locked(c, bin, size, call, lane, lane_rank);
        }
        if (b == NULL) {
            c->bins[bin].last_used = c->fig.scopes;
            if ((b = c->bins[bin].top) != NULL) {
                unlink_free_locked(c, b);
            }
        }
    }
    else {
        if (c->plan != NULL && c->stepping) {
            b = take_planned_locked(c, bin, size, call, lane, lane_rank);
        }
        if (b == NULL) {
            b = take_piece_locked(c, bin, size, &no_record);
        }
    }
    int kind = LX_EV_HIT;
    if (b != NULL) {
        c->fig.bytes_cached -= size;
        c->fig.hits++;
    }
    else {
        c->fig.misses++;
        void *ptr = NULL;
        lx_block *rest = NULL; /* a consolidated segment's bytes beyond the request */
        size_t got = size;     /* bytes taken from upstream */
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
            /* Consolidation (section 1b): the split pool's whole free segments,
             * each smaller than the request, add up to it: they go back and the
             * new segment takes their bytes too (reserved grows by size, as on
             * any miss). Should that fail, the request alone is asked for. */
            if (seg && c->split_whole >= size && c->split_whole <= LX_MAX_REQUEST - size &&
                (rest = malloc(sizeof(lx_block))) != NULL) {
                got = size + release_split_wholes_locked(c, UINT64_MAX);
                ptr = c->up.alloc(c->up.ctx, got, zeroed);
            }
            if (ptr == NULL) {
                got = size;
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
            pthread_mutex_unlock(&c->lock);
            return NULL;
        }
        *b = (lx_block){.ptr = ptr, .size = size, .bin = bin, .orphan = (uint8_t)direct,
                        .direct = (uint8_t)direct};
        c->direct_live += direct;
        if (seg) { /* a new segment, this block its first piece */
            lx_head *head = (lx_head *)b;
            head->seg = (lx_segment){.base = ptr, .size = got, .last_used = c->fig.scopes};
            note_piece_locked(c, &head->seg, size, +1);
            b->seg = &head->seg;
            c->split_held += got;
            c->split_peak = c->split_held > c->split_peak ? c->split_held : c->split_peak;
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
        *zero_filled = zeroed;
        kind = LX_EV_UPSTREAM;
    }
    b->live = 1;
    c->fig.bytes_live += size;
    if (split) {
        c->large_live += size;
        c->large_peak = c->large_live > c->large_peak ? c->large_live : c->large_peak;
    }
    if (recorded) {
        note_birth_locked(c, b);
    }
    note_peaks_locked(c);
    record_locked(c, kind);
    pthread_mutex_unlock(&c->lock);
    *status = LX_OK;
    return b->ptr;
}

/* Take back a block whose array died. Returns 0 if ptr is not the core's. */
static int
lx_free(lx_core *c, void *ptr)
{
    pthread_mutex_lock(&c->lock);
    lx_block *b = map_find(&c->map, ptr);
    if (b == NULL) {
        int ours = in_an_arena_locked(c, ptr); /* a second free of a plan's block: ignored */
        pthread_mutex_unlock(&c->lock);
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
        else if (b->seg != NULL) {
            return_piece_locked(c, b);
        }
        else if (b->orphan) {
            int direct = b->direct; /* the warm-up's: outside every arena */
            release_locked(c, b);
            c->direct_live -= direct;
            if (direct && c->direct_live == 0 && c->plan != NULL && c->cycle >= c->plan->from_cycle) {
                grow_arenas_locked(c); /* the first planned step's last outsider died */
            }
        }
        else {
            link_free_locked(c, b);
            record_locked(c, LX_EV_RETURN);
        }
    }
    pthread_mutex_unlock(&c->lock);
    return 1;
}

/* The block size of a live block of the core, or 0 if ptr is not one. */
static size_t
lx_live_size(lx_core *c, void *ptr)
{
    pthread_mutex_lock(&c->lock);
    lx_block *b = map_find(&c->map, ptr);
    size_t size = b != NULL && b->live ? b->size : 0;
    pthread_mutex_unlock(&c->lock);
    return size;
}

static size_t
lx_trim(lx_core *c, size_t max_cached)
{
    pthread_mutex_lock(&c->lock);
    size_t released = trim_locked(c, max_cached);
    pthread_mutex_unlock(&c->lock);
    return released;
}

/* Release every whole free block and segment now, and every other when its
 * last array dies (an orphan). Blocks allocated afterwards are cached as usual. */
static void
lx_release_all(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    trim_locked(c, 0);
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
            b->orphan = 1; /* every exact-bin block left is live */
        }
    }
    pthread_mutex_unlock(&c->lock);
}

static void
lx_reset_peaks(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    c->fig.peak_live = c->fig.bytes_live;
    c->fig.peak_reserved = c->fig.bytes_live + c->fig.bytes_cached;
    pthread_mutex_unlock(&c->lock);
}

/* Open a scope: advance the clock, start watching its peaks. Returns the
 * watcher's slot, or -1 when the bookkeeping is out of memory. */
static long
lx_scope_enter(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    size_t slot = 0;
    while (slot < c->nwatchers && c->watchers[slot].in_use) {
        slot++;
    }
    if (slot == c->nwatchers) {
        size_t n = c->nwatchers ? 2 * c->nwatchers : 8;
        lx_watcher *w = realloc(c->watchers, n * sizeof(lx_watcher));
        if (w == NULL) {
            pthread_mutex_unlock(&c->lock);
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
    if (slot >= c->watch_hi) {
        c->watch_hi = slot + 1;
    }
    c->fig.scopes++;
    if (c->depth++ == 0 && c->spans != NULL) {
        open_span_locked(c);
    }
    record_locked(c, LX_EV_SCOPE_ENTER);
    pthread_mutex_unlock(&c->lock);
    return (long)slot;
}

/* Close a scope: report its peaks, and release the free blocks of every
 * exact-bin size bin not asked for during the last evict_after scopes, every
 * whole free segment that served no request during them, and likewise a
 * plan. -1 if slot is not open. */
static int
lx_scope_exit(lx_core *c, size_t slot, size_t *peak_live, size_t *peak_reserved)
{
    pthread_mutex_lock(&c->lock);
    if (slot >= c->nwatchers || !c->watchers[slot].in_use) {
        pthread_mutex_unlock(&c->lock);
        return -1;
    }
    *peak_live = c->watchers[slot].peak_live;
    *peak_reserved = c->watchers[slot].peak_reserved;
    c->watchers[slot].in_use = 0;
    while (c->watch_hi > 0 && !c->watchers[c->watch_hi - 1].in_use) {
        c->watch_hi--;
    }
    uint64_t now = c->fig.scopes;
    for (uint32_t i = 0; c->evict_after && i < c->split_bin; i++) {
        lx_bin *bin = &c->bins[i];
        while (bin->top != NULL && now - bin->last_used >= c->evict_after) {
            lx_block *b = bin->top;
            unlink_free_locked(c, b);
            release_locked(c, b);
        }
    }
    for (lx_block *b = c->lru.newer; c->evict_after && c->split_whole > 0 && b != &c->lru;) {
        lx_block *newer = b->newer;
        if (b->seg != NULL && whole_locked(b) && now - b->seg->last_used >= c->evict_after) {
            unlink_free_locked(c, b);
            release_locked(c, b);
        }
        b = newer;
    }
    if (c->evict_after && c->plan != NULL && now - c->plan->last_used >= c->evict_after) {
        drop_plan_locked(c);
    }
    if (--c->depth == 0 && c->spans != NULL) {
        close_span_locked(c);
    }
    record_locked(c, LX_EV_SCOPE_EXIT);
    pthread_mutex_unlock(&c->lock);
    return 0;
}

/* The open step ends: its record waits for the planner if it holds a request
 * (a step with none is no cycle to plan). */
static void
end_step_locked(lx_core *c)
{
    c->stepping = 0;
    if (c->plan != NULL && c->cycle >= c->plan->from_cycle && c->direct_live == 0) {
        grow_arenas_locked(c); /* no block of the steps before it is alive outside */
    }
    if (c->nrec > 0 || c->rec_lost) {
        c->pending = 1;
        if (c->plan != NULL) {
            release_split_wholes_locked(c, c->plan->installed);
        }
    }
}

/* A training step begins (one still open ends first): a cycle opens. */
static void
lx_step_begin(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    if (c->stepping) {
        end_step_locked(c);
    }
    open_cycle_locked(c);
    c->stepping = 1;
    c->step_owner = pthread_self();
    c->call_base = atomic_load(&kernel_calls);
    pthread_mutex_unlock(&c->lock);
}

/* The training step ends, if one is open. */
static void
lx_step_end(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    if (c->stepping) {
        end_step_locked(c);
    }
    pthread_mutex_unlock(&c->lock);
}

/* The record of the last cycle, if it closed, no cycle is open and it holds a
 * request: n rows of (size, born, died) in *rows (malloc'd for the caller;
 * NULL with n 0 when the record is incomplete), its plan misses in *misses,
 * in *planned whether a plan is installed now (none: none was, or it was
 * dropped), in *split_peak the most bytes the split pool held during it, in
 * *large_peak the most bytes its blocks above the split threshold (and those
 * of earlier steps) held, and in *prev (malloc'd) the *nprev rows of the
 * record before it with their next deaths. Returns whether there was a record
 * to take. */
static int
lx_take_record(lx_core *c, int64_t **rows, size_t *n, uint64_t *misses, int *planned,
               size_t *split_peak, size_t *large_peak, int64_t **prev, size_t *nprev)
{
    pthread_mutex_lock(&c->lock);
    int pending = c->pending && !c->stepping && (c->nrec > 0 || c->rec_lost);
    *rows = NULL;
    *n = 0;
    *misses = c->cycle_misses;
    *planned = c->plan != NULL;
    *split_peak = c->split_peak;
    *large_peak = c->large_peak;
    *prev = NULL;
    *nprev = 0;
    const size_t columns = LX_REQUEST_COLUMNS;
    if (pending && c->nprev > 0 &&
        (*prev = malloc(c->nprev * (columns + 1) * sizeof(int64_t))) != NULL) {
        for (size_t i = 0; i < c->nprev; i++) {
            memcpy(*prev + (columns + 1) * i, &c->prev[i].r, columns * sizeof(int64_t));
            (*prev)[(columns + 1) * i + columns] = c->prev[i].next_died;
        }
        *nprev = c->nprev;
    }
    if (pending) {
        finish_record_locked(c);
        *rows = c->rec_lost ? NULL : malloc((c->nrec ? c->nrec : 1) * columns * sizeof(int64_t));
        for (size_t i = 0; *rows != NULL && i < c->nrec; i++) {
            memcpy(*rows + columns * i, &c->rec[i], columns * sizeof(int64_t));
        }
        *n = *rows != NULL ? c->nrec : 0;
    }
    pthread_mutex_unlock(&c->lock);
    return pending;
}

/* `size` bytes from upstream for an arena (after a trim of the pools, if the
 * limit or the system asks for it), counted as cached; NULL with the reason in
 * *status. The trim leaves the plan alone: the arena may be the plan's own,
 * taking its second chunk (grow_arenas_locked). */
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
static lx_arena *
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

/* The plan's arenas take their second chunks, if they wait for them (the first
 * planned step is over: the blocks of the step before it, held outside the
 * arena, have died). One that cannot be had now is asked for again later; its
 * slots miss meanwhile. */
static void
grow_arenas_locked(lx_core *c)
{
    for (int k = 0; c->plan != NULL && k < 2; k++) {
        lx_arena *a = c->plan->arena[k];
        lx_status status;
        if (a != NULL && a->base2 == NULL && a->first < a->size) {
            a->base2 = arena_chunk_locked(c, a->size - a->first, &status);
        }
    }
}

/*
 * Install plan p (section 1c), built by the caller (slots, first, count), whose
 * arenas must hold arena_size[] bytes (0: none), the cycle arena's in two
 * chunks: `first` bytes now, the rest once the plan's first cycle is over
 * (first == arena_size[LX_CYCLE]: one chunk). Each arena of the current plan
 * serves again if it is large enough (and in one chunk, or cut where the new
 * one is); else it is dropped before a new one comes from upstream (the split
 * pool's whole free segments first go back: the plan replaces them). The new
 * plan serves from the next cycle to open, which takes the places planned for
 * even cycles (so that its first cycle needs the first chunk only). The core takes p in any case. Returns LX_OK; LX_BUSY, nothing
 * changed, when the cycle arena must grow while a block lives in it (a block
 * planned to die in its cycle outlived it); or, the old plan dropped all the
 * same, why there is no plan now: LX_OVER_LIMIT, LX_OUT_OF_MEMORY, LX_FALLBACK
 * (no memory for the bookkeeping).
 */
static lx_status
lx_install_plan(lx_core *c, lx_plan *p, const size_t arena_size[2], size_t first)
{
    pthread_mutex_lock(&c->lock);
    lx_plan *old = c->plan;
    int first_plan = old == NULL;
    lx_arena *own = old != NULL ? old->arena[LX_CYCLE] : NULL;
    if (own != NULL && own->live > 0 && own->size < arena_size[LX_CYCLE]) {
        /* Held with its replacement it would double the arena: wait until it is idle. */
        pthread_mutex_unlock(&c->lock);
        free_plan(p);
        return LX_BUSY;
    }
    /* The split pool's segments unused since plans serve are what they replaced. */
    p->installed = old != NULL ? old->installed : c->fig.scopes + 1; /* the next scope's clock */
    for (int k = 0; old != NULL && k < 2; k++) {
        lx_arena *a = old->arena[k];
        if (arena_size[k] > 0 && a != NULL && a->size >= arena_size[k] &&
            (a->first == a->size || arena_size[k] <= a->first ||
             (k == LX_CYCLE && a->first == first))) { /* each new slot in one of its chunks */
            p->arena[k] = old->arena[k]; /* serves again */
            old->arena[k] = NULL;
        }
    }
    drop_plan_locked(c);
    lx_status status = LX_OK;
    if ((arena_size[0] > 0 && p->arena[0] == NULL) || (arena_size[1] > 0 && p->arena[1] == NULL)) {
        release_split_wholes_locked(c, UINT64_MAX);
    }
    for (int k = 0; k < 2 && status == LX_OK; k++) {
        if (arena_size[k] > 0 && p->arena[k] == NULL) {
            p->arena[k] = new_arena_locked(c, arena_size[k], k == LX_CYCLE ? first : arena_size[k],
                                           &status);
        }
    }
    if (status != LX_OK) {
        drop_arena_locked(c, p->arena[LX_CYCLE]);
        drop_arena_locked(c, p->arena[LX_KEPT]);
        pthread_mutex_unlock(&c->lock);
        free_plan(p);
        return status;
    }
    if (first_plan) { /* the plan serves the recorded small requests: their bins idle */
        for (uint32_t bin = c->plan_bin; bin < c->split_bin; bin++) {
            for (lx_block *b; (b = c->bins[bin].top) != NULL;) {
                unlink_free_locked(c, b);
                release_locked(c, b);
            }
        }
    }
    p->from_cycle = c->cycle + 1; /* the next to open: one open now was not planned for */
    if (p->from_cycle & 1) { /* its first cycle takes the places planned for an even one */
        for (size_t i = 0; i < p->nslots; i++) {
            size_t even = p->slots[i].offset[0];
            p->slots[i].offset[0] = p->slots[i].offset[1];
            p->slots[i].offset[1] = even;
        }
    }
    p->last_used = c->fig.scopes;
    c->plan = p;
    c->fig.plans++;
    pthread_mutex_unlock(&c->lock);
    return LX_OK;
}

/* Check an arena against the blocks in it (for audit_locked below). */
static const char *
audit_arena_locked(lx_core *c, const lx_arena *a, int retired)
{
    size_t blocks = 0, bytes = 0, busy = 0;
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        if (b != NULL && b->arena == a) {
            blocks++;
            bytes += b->size;
        }
    }
    for (size_t w = 0; w < ((a->size >> LX_QUANTUM_LOG2) + 63) / 64; w++) {
        busy += (size_t)__builtin_popcountll(a->busy[w]);
    }
    if (blocks != a->live || bytes != a->live_bytes || busy != bytes >> LX_QUANTUM_LOG2) {
        return "an arena's count of live blocks, bytes or busy granules is wrong";
    }
    if (retired && blocks == 0) {
        return "a retired arena with no live block is still held";
    }
    return NULL;
}

/* Check the bookkeeping against itself (for the tests): NULL when every record,
 * segment, free list and figure agrees, else what does not. */
static const char *
audit_locked(lx_core *c)
{
    size_t live = 0, cached = 0, owned = 0, records = 0, listed = 0, unlisted = 0, held = 0;
    size_t free_records = 0, segments = 0, large = 0, inactive = 0;
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
        if (b->seg == NULL) { /* the exact-bin pool, or the warm-up: a whole upstream block */
            if ((b->bin >= c->split_bin && !b->orphan) || b->size != bin_bytes(b->bin)) {
                return "an exact-bin block's size is not its bin's, or its bin is split";
            }
            if (b->left != NULL || b->right != NULL) {
                return "an exact-bin block has neighbours";
            }
            if (b->orphan && !b->live) {
                return "an exact-bin orphan is free but still held";
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
        if (b->live ? (b->bin < c->split_bin || b->size != bin_bytes(b->bin))
                    : b->bin != floor_bin(b->size)) {
            return "a piece's bin is wrong (live: its request's; free: floor_bin of its size)";
        }
        if ((b->left == NULL) != (offset == 0) ||
            (b->right == NULL) != (offset + b->size == seg->size)) {
            return "a piece at a segment's edge has a neighbour there, or one inside has none";
        }
        if (b->right != NULL && (b->right->left != b || b->right->seg != seg ||
                                 (char *)b->right->ptr != (char *)b->ptr + b->size)) {
            return "a piece's right neighbour does not follow it";
        }
        if (b->right != NULL && !b->live && !b->right->live) {
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
        segments += seg->size;
    }
    for (uint32_t i = 0; i < LX_NBINS; i++) {
        for (int pool = 0; pool < 2; pool++) {
            lx_bin *bin = pool ? &c->split[i] : &c->bins[i];
            size_t n = 0;
            for (lx_block *b = bin->top, *prev = NULL; b != NULL; prev = b, b = b->next) {
                if (b->live || b->bin != i || b->prev != prev || map_find(&c->map, b->ptr) != b ||
                    (b->seg != NULL) != pool || (b->seg != NULL && b->seg->orphan) ||
                    (b->seg == NULL && b->orphan)) {
                    return "a free list holds a live, foreign, orphan or unowned block";
                }
                n++;
            }
            if (n != bin->nfree) {
                return "a bin's count of free blocks is wrong";
            }
            if (pool && (n != 0) != (int)((c->split_mask[i / 64] >> (i % 64)) & 1)) {
                return "the split pool's bin mask disagrees with its lists";
            }
            listed += n;
        }
    }
    size_t in_lru = 0, split_whole = 0;
    for (lx_block *b = c->lru.newer; b != &c->lru; b = b->newer) {
        if (b->live || b->newer->older != b) {
            return "the LRU ring holds a live block or is broken";
        }
        in_lru++;
        split_whole += b->seg != NULL && whole_locked(b) ? b->size : 0;
    }
    if (split_whole != c->split_whole) {
        return "the bytes of the split pool's whole free segments are miscounted";
    }
    for (size_t i = 0; i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        unlisted += b != NULL && !b->live && b->seg != NULL && b->seg->orphan;
    }
    if (in_lru != listed) {
        return "the LRU ring and the free lists disagree";
    }
    lx_arena *arenas[2] = {NULL, NULL};
    if (c->plan != NULL) {
        arenas[0] = c->plan->arena[LX_CYCLE];
        arenas[1] = c->plan->arena[LX_KEPT];
        if (arenas[0] == NULL && arenas[1] == NULL) {
            return "a plan has no arena";
        }
        if (c->plan->last_used > c->fig.scopes) {
            return "a plan was used in the future";
        }
    }
    for (int k = 0; k < 3; k++) {
        for (lx_arena *a = k < 2 ? arenas[k] : c->retired; a != NULL; a = k < 2 ? NULL : a->next) {
            const char *broken = audit_arena_locked(c, a, k == 2);
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
    if (segments != c->split_held || c->split_peak < c->split_held) {
        return "the split pool's bytes held (or their peak in the cycle) are miscounted";
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

static lx_figures
lx_figures_of(lx_core *c)
{
    pthread_mutex_lock(&c->lock);
    lx_figures f = c->fig;
    pthread_mutex_unlock(&c->lock);
    return f;
}

/* ---- 6. NumPy front end (NEP 49) ----------------------------------------
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

/* ---- 7. Python bindings ------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    lx_core *core;
    int cuda;        /* 1: device memory (section 2b), served through Block objects */
    lx_cuda_api api; /* the CUDA upstream's functions, once bound */
} CoreObject;

/* A block of a CUDA core handed to CuPy: CuPy's memory object for the block
 * owns it, and the block goes back to the core when that object dies. */
typedef struct {
    PyObject_HEAD
    CoreObject *owner; /* the core outlives its blocks */
    void *ptr;
    size_t size;
} BlockObject;

static const char handler_capsule_name[] = "mem_handler"; /* NumPy requires this name */

static PyObject *
Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"limit",    "evict_after", "timeline_capacity",
                             "upstream", "split_above", NULL};
    unsigned long long limit = 0, evict_after = 0, timeline_capacity = 0;
    unsigned long long split_above = LX_SPLIT_ABOVE;
    const char *upstream = "host";
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|KKKsK:Core", kwlist, &limit,
                                     &evict_after, &timeline_capacity, &upstream,
                                     &split_above)) {
        return NULL;
    }
    int cuda = strcmp(upstream, "cuda") == 0;
    if (!cuda && strcmp(upstream, "host") != 0) {
        return PyErr_Format(PyExc_ValueError, "upstream must be 'host' or 'cuda', got '%s'",
                            upstream);
    }
    if (limit > LX_MAX_REQUEST) {
        return PyErr_Format(PyExc_ValueError, "limit %llu is above %zu bytes", limit,
                            LX_MAX_REQUEST);
    }
    CoreObject *self = (CoreObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    self->cuda = cuda;
    lx_upstream up = host_upstream;
    if (cuda) {
        up = (lx_upstream){"cuda", &self->api, cuda_alloc, cuda_free};
    }
    if (split_above > LX_MAX_REQUEST) {
        split_above = LX_MAX_REQUEST; /* no split pool */
    }
    self->core = lx_core_new(up, (size_t)limit, evict_after, (size_t)timeline_capacity,
                             (size_t)split_above);
    if (self->core == NULL) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    return (PyObject *)self;
}

static void
Core_dealloc(CoreObject *self)
{
    if (self->core != NULL) {
        lx_core_destroy(self->core);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Named results (structseqs: tuples whose items are also attributes). */
static PyStructSequence_Field figures_fields[] = {
    {"hits", NULL}, {"misses", NULL}, {"upstream_allocs", NULL}, {"upstream_frees", NULL},
    {"bytes_live", NULL}, {"bytes_cached", NULL}, {"bytes_reserved", NULL},
    {"peak_live", NULL}, {"peak_reserved", NULL}, {"scopes", NULL}, {"plan_hits", NULL},
    {"plan_misses", NULL}, {"plans", NULL}, {"inactive_split_bytes", NULL}, {NULL, NULL},
};
static PyStructSequence_Desc figures_desc = {
    "luxnn.memory._core.Figures", "A core's figures (luxnn.memory.CacheStats).",
    figures_fields, 14,
};
static PyTypeObject FiguresType;

static PyStructSequence_Field record_fields[] = {
    {"rows", "bytes of native int64 (size, born, died, call, lane, lane_born, lane_died) "
             "rows, one per request (call, lane: -1 out of a kernel's lanes; lane_died: -1 "
             "unless it died in its lane)"},
    {"misses", "the step's requests above the split threshold that the plan missed"},
    {"planned", "whether a plan is installed now"},
    {"split_peak", "the most bytes the split pool held during the step"},
    {"large_peak", "the most bytes that live blocks above the split threshold held in it"},
    {"previous", "bytes of native int64 rows of rows' columns and next_died: the step "
                 "before's record, with the deaths in this step of its blocks that outlived it "
                 "(-1: alive at this step's end too); empty if not known"},
    {NULL, NULL},
};
static PyStructSequence_Desc record_desc = {
    "luxnn.memory._core.Record", "A step's record for the planner (luxnn.memory.plan).",
    record_fields, 6,
};
static PyTypeObject RecordType;

/* Fill a new structseq with n new references (NULL: an error, all released). */
static PyObject *
filled(PyObject *seq, PyObject **items, size_t n)
{
    int ok = seq != NULL;
    for (size_t i = 0; i < n; i++) {
        ok = ok && items[i] != NULL;
    }
    for (size_t i = 0; i < n; i++) {
        if (ok) {
            PyStructSequence_SetItem(seq, (Py_ssize_t)i, items[i]);
        }
        else {
            Py_XDECREF(items[i]);
        }
    }
    if (!ok) {
        Py_XDECREF(seq);
        return NULL;
    }
    return seq;
}

static PyObject *
figures_object(lx_figures f)
{
    PyObject *items[] = {
        PyLong_FromUnsignedLongLong(f.hits), PyLong_FromUnsignedLongLong(f.misses),
        PyLong_FromUnsignedLongLong(f.upstream_allocs),
        PyLong_FromUnsignedLongLong(f.upstream_frees), PyLong_FromSize_t(f.bytes_live),
        PyLong_FromSize_t(f.bytes_cached), PyLong_FromSize_t(f.bytes_live + f.bytes_cached),
        PyLong_FromSize_t(f.peak_live), PyLong_FromSize_t(f.peak_reserved),
        PyLong_FromUnsignedLongLong(f.scopes), PyLong_FromUnsignedLongLong(f.plan_hits),
        PyLong_FromUnsignedLongLong(f.plan_misses), PyLong_FromUnsignedLongLong(f.plans),
        PyLong_FromSize_t(f.inactive_split),
    };
    return filled(PyStructSequence_New(&FiguresType), items, sizeof(items) / sizeof(items[0]));
}

static PyObject *
Core_stats(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    return figures_object(lx_figures_of(self->core));
}

static PyObject *
Core_reset_peaks(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_reset_peaks(self->core);
    Py_RETURN_NONE;
}

static PyObject *
Core_trim(CoreObject *self, PyObject *arg)
{
    Py_ssize_t max_cached = PyLong_AsSsize_t(arg);
    if (max_cached == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (max_cached < 0) {
        return PyErr_Format(PyExc_ValueError, "max_cached_bytes must be >= 0, got %zd",
                            max_cached);
    }
    return PyLong_FromSize_t(lx_trim(self->core, (size_t)max_cached));
}

static PyObject *
Core_release_all(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_release_all(self->core);
    Py_RETURN_NONE;
}

static PyObject *
Core_scope_enter(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    long slot = lx_scope_enter(self->core);
    return slot < 0 ? PyErr_NoMemory() : PyLong_FromLong(slot);
}

static PyObject *
Core_scope_exit(CoreObject *self, PyObject *arg)
{
    Py_ssize_t slot = PyLong_AsSsize_t(arg);
    if (slot == -1 && PyErr_Occurred()) {
        return NULL;
    }
    size_t peak_live, peak_reserved;
    if (slot < 0 || lx_scope_exit(self->core, (size_t)slot, &peak_live, &peak_reserved)) {
        return PyErr_Format(PyExc_ValueError, "no open scope in slot %zd", slot);
    }
    return Py_BuildValue("(nn)", (Py_ssize_t)peak_live, (Py_ssize_t)peak_reserved);
}

static PyObject *
Core_step_begin(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_step_begin(self->core);
    Py_RETURN_NONE;
}

static PyObject *
Core_step_end(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_step_end(self->core);
    Py_RETURN_NONE;
}

static PyObject *
Core_set_warm_up(CoreObject *self, PyObject *arg)
{
    int on = PyObject_IsTrue(arg);
    if (on < 0) {
        return NULL;
    }
    pthread_mutex_lock(&self->core->lock);
    self->core->warm_up = on;
    pthread_mutex_unlock(&self->core->lock);
    Py_RETURN_NONE;
}

static PyObject *
Core_drop_plan(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->core->lock);
    drop_plan_locked(self->core);
    pthread_mutex_unlock(&self->core->lock);
    Py_RETURN_NONE;
}

/* take_record() -> None, or the Record of the last cycle (section 1c) when it
 * closed, no cycle is open, it made a split-pool request and nobody took it
 * yet (rows: empty when the record ran out of memory). */
static PyObject *
Core_take_record(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    int64_t *rows;
    size_t n;
    uint64_t misses;
    int planned;
    size_t split_peak, large_peak, nprev;
    int64_t *prev;
    if (!lx_take_record(self->core, &rows, &n, &misses, &planned, &split_peak, &large_peak,
                        &prev, &nprev)) {
        Py_RETURN_NONE;
    }
    PyObject *record = PyStructSequence_New(&RecordType);
    PyObject *items[] = {
        PyBytes_FromStringAndSize(rows != NULL ? (const char *)rows : "",
                                  (Py_ssize_t)(LX_REQUEST_COLUMNS * n * sizeof(int64_t))),
        PyLong_FromUnsignedLongLong(misses), PyBool_FromLong(planned),
        PyLong_FromSize_t(split_peak), PyLong_FromSize_t(large_peak),
        PyBytes_FromStringAndSize(prev != NULL ? (const char *)prev : "",
                                  (Py_ssize_t)((LX_REQUEST_COLUMNS + 1) * nprev * sizeof(int64_t))),
    };
    free(rows);
    free(prev);
    return filled(record, items, sizeof(items) / sizeof(items[0]));
}

/* Element i of an int64 buffer, whatever its alignment. */
static int64_t
int64_at(const Py_buffer *b, size_t i)
{
    int64_t v;
    memcpy(&v, (const char *)b->buf + i * sizeof(int64_t), sizeof(v));
    return v;
}

/* install_plan(cycle_size, kept_size, sizes, even, odd, which[, call, lane]):
 * section 1c; the last six are buffers of native int64 of one length (which: 0
 * for the cycle's arena, 1 for the kept one; without call and lane, no slot is
 * a lane's). The slots out of lanes (call and lane -1) come first, sizes ascending; then the lanes' (call, lane >= 0), by
 * call and lane, each lane's in rank order. Returns "installed"; "later"
 * (nothing changed: the cycle arena to replace is in use, or there was no
 * memory to build the plan; try again later); or "no room" (the limit, out of
 * memory, or no memory for an arena's bitmap: the old plan is dropped). The
 * plan is built from the checked values here, with the GIL held, so that no
 * other thread can change a buffer between its check and its use. */
static PyObject *
Core_install_plan(CoreObject *self, PyObject *args)
{
    enum { SIZES, EVEN, ODD, WHICH, CALL, LANE, NBUF };
    unsigned long long arena[2];
    Py_buffer buf[NBUF] = {{0}};
    unsigned long long first = 0;
    if (!PyArg_ParseTuple(args, "KKy*y*y*y*|y*y*K:install_plan", &arena[0], &arena[1],
                          &buf[SIZES], &buf[EVEN], &buf[ODD], &buf[WHICH], &buf[CALL],
                          &buf[LANE], &first)) {
        return NULL;
    }
    int lanes = buf[CALL].obj != NULL || buf[LANE].obj != NULL; /* else: none in lanes */
    first = first == 0 ? arena[0] : first;
    size_t n = (size_t)buf[SIZES].len / sizeof(int64_t), nlanes = 0;
    const size_t quantum = (size_t)1 << LX_QUANTUM_LOG2;
    const char *bad = NULL;
    lx_plan *p = NULL;
    if (buf[SIZES].len % sizeof(int64_t) || n == 0 || n >= UINT32_MAX) {
        bad = "sizes, even, odd, which, call and lane must be int64 arrays of one length, "
              "at least 1";
    }
    for (int k = EVEN; bad == NULL && k < (lanes ? NBUF : CALL); k++) {
        if (buf[k].len != buf[SIZES].len) {
            bad = "sizes, even, odd, which, call and lane must be int64 arrays of one length, "
                  "at least 1";
        }
    }
    if (bad == NULL && (arena[0] % quantum || arena[0] > LX_MAX_REQUEST || arena[1] % quantum ||
                        arena[1] > LX_MAX_REQUEST || arena[0] + arena[1] == 0)) {
        bad = "the arena sizes must be multiples of 512 bytes, not both 0";
    }
    else if (first % quantum || first > arena[0]) {
        bad = "the first chunk must be a multiple of 512 bytes within the cycle arena";
    }
    int64_t last_call = -1, last_lane = -1;
    for (size_t i = 0, last = 0; bad == NULL && i < n; i++) { /* check every slot */
        int64_t size = int64_at(&buf[SIZES], i), even = int64_at(&buf[EVEN], i),
                odd = int64_at(&buf[ODD], i), which = int64_at(&buf[WHICH], i),
                call = lanes ? int64_at(&buf[CALL], i) : -1,
                lane = lanes ? int64_at(&buf[LANE], i) : -1;
        size_t room = which == 0 || which == 1 ? (size_t)arena[which] : 0;
        if (room == 0) {
            bad = "every which must be 0 or 1, naming an arena of a positive size";
        }
        else if (size <= 0 || (size_t)size > room ||
                 bin_bytes(bin_of((size_t)size)) != (size_t)size ||
                 (call < 0 && (bin_of((size_t)size) < self->core->plan_bin ||
                               (size_t)size < last))) {
            bad = "sizes must be block sizes, each within its arena, out of lanes of "
                  "split-pool bins and ascending";
        }
        else if (even < 0 || odd < 0 || (size_t)even % quantum || (size_t)odd % quantum ||
                 (size_t)even > room - (size_t)size || (size_t)odd > room - (size_t)size) {
            bad = "every offset must be a multiple of 512 bytes with its block inside its arena";
        }
        else if (which == 0 && (((size_t)even < first && (size_t)(even + size) > first) ||
                                ((size_t)odd < first && (size_t)(odd + size) > first))) {
            bad = "no block of the cycle arena may straddle its first chunk's end";
        }

        else if ((call < 0) != (lane < 0) || call < last_call ||
                 (call == last_call && lane < last_lane)) {
            bad = "call and lane must be both -1 (first) or both >= 0, by call and lane";
        }
        else if (call >= 0 && (call != last_call || lane != last_lane)) {
            nlanes++;
        }
        last = (size_t)size;
        last_call = call;
        last_lane = lane;
    }
    if (bad == NULL && ((p = calloc(1, sizeof(lx_plan))) == NULL ||
                        (p->nslots = n, p->slots = calloc(n, sizeof(lx_slot))) == NULL ||
                        (nlanes > 0 && (p->lanes = calloc(nlanes, sizeof(lx_lane_slots))) == NULL))) {
        free_plan(p);
        p = NULL;
    }
    for (size_t i = 0; p != NULL && i < n; i++) { /* then build the plan from them */
        size_t size = (size_t)int64_at(&buf[SIZES], i);
        uint32_t b = bin_of(size), which = (uint32_t)int64_at(&buf[WHICH], i);
        int64_t call = lanes ? int64_at(&buf[CALL], i) : -1;
        int64_t lane = lanes ? int64_at(&buf[LANE], i) : -1;
        p->slots[i] = (lx_slot){{(size_t)int64_at(&buf[EVEN], i), (size_t)int64_at(&buf[ODD], i)},
                                which, b, 0};
        if (call < 0) {
            if (p->count[b]++ == 0) {
                p->first[b] = (uint32_t)i;
            }
            continue;
        }
        lx_lane_slots *l = p->nlanes > 0 ? &p->lanes[p->nlanes - 1] : NULL;
        if (l == NULL || l->call != call || l->lane != lane) {
            l = &p->lanes[p->nlanes++];
            *l = (lx_lane_slots){call, lane, (uint32_t)i, 0};
        }
        l->count++;
    }
    for (int k = 0; k < NBUF; k++) {
        if (buf[k].obj != NULL) {
            PyBuffer_Release(&buf[k]);
        }
    }
    if (bad != NULL) {
        free_plan(p);
        return PyErr_Format(PyExc_ValueError, "install_plan: %s", bad);
    }
    lx_status status = LX_BUSY; /* no plan built: no memory for it, try later */
    if (p != NULL) {
        size_t sizes_of_arenas[2] = {(size_t)arena[0], (size_t)arena[1]};
        Py_BEGIN_ALLOW_THREADS
        status = lx_install_plan(self->core, p, sizes_of_arenas, (size_t)first);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(status == LX_OK     ? LX_PLAN_INSTALLED
                           : status == LX_BUSY ? LX_PLAN_LATER
                                               : LX_PLAN_NO_ROOM);
}

/* blocks() -> [(ptr, size, live, segment base, segment size, orphan)] for
 * every block the core owns, in no order: an exact-bin block is a segment of
 * its own, a plan's block is in its arena (orphan: a retired one; an arena's
 * free bytes have no row). For the tests; the list is built after the lock is
 * let go. */
static PyObject *
Core_blocks(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_core *c = self->core;
    typedef struct {
        void *ptr, *base;
        size_t size, seg_size;
        int live, orphan;
    } row;
    pthread_mutex_lock(&c->lock);
    size_t n = 0;
    row *rows = malloc((c->map.count ? c->map.count : 1) * sizeof(row));
    for (size_t i = 0; rows != NULL && i < c->map.cap; i++) {
        lx_block *b = c->map.slots[i];
        if (b != NULL && b->arena != NULL) { /* orphan: the arena retired */
            lx_arena *a = b->arena;
            int second = arena_offset(a, b->ptr) >= a->first; /* its chunk */
            rows[n++] = (row){b->ptr, second ? a->base2 : a->base, b->size,
                              second ? a->size - a->first : a->first, b->live,
                              retired_locked(c, a)};
        }
        else if (b != NULL) {
            lx_segment *seg = b->seg;
            rows[n++] = (row){b->ptr, seg ? seg->base : b->ptr, b->size,
                              seg ? seg->size : b->size, b->live,
                              seg ? seg->orphan : b->orphan};
        }
    }
    pthread_mutex_unlock(&c->lock);
    if (rows == NULL) {
        return PyErr_NoMemory();
    }
    PyObject *list = PyList_New((Py_ssize_t)n);
    for (size_t i = 0; list != NULL && i < n; i++) {
        PyObject *item = Py_BuildValue("(NnONnO)", PyLong_FromVoidPtr(rows[i].ptr),
                                       (Py_ssize_t)rows[i].size, rows[i].live ? Py_True : Py_False,
                                       PyLong_FromVoidPtr(rows[i].base),
                                       (Py_ssize_t)rows[i].seg_size,
                                       rows[i].orphan ? Py_True : Py_False);
        if (item == NULL) {
            Py_CLEAR(list);
            break;
        }
        PyList_SET_ITEM(list, (Py_ssize_t)i, item);
    }
    free(rows);
    return list;
}

static PyObject *
Core_audit(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    pthread_mutex_lock(&self->core->lock);
    const char *broken = audit_locked(self->core);
    pthread_mutex_unlock(&self->core->lock);
    if (broken != NULL) {
        PyErr_SetString(PyExc_AssertionError, broken);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* bind_cuda(mem_alloc, mem_free, ctx_push, ctx_pop, context): the addresses of
 * the driver's functions (section 2b) and of the retained primary context. */
static PyObject *
Core_bind_cuda(CoreObject *self, PyObject *args)
{
    unsigned long long f[5];
    if (!PyArg_ParseTuple(args, "KKKKK:bind_cuda", &f[0], &f[1], &f[2], &f[3], &f[4])) {
        return NULL;
    }
    if (!self->cuda) {
        return PyErr_Format(PyExc_TypeError, "bind_cuda: this core serves host memory");
    }
    if (!f[0] || !f[1] || !f[2] || !f[3]) {
        return PyErr_Format(PyExc_ValueError, "bind_cuda: a function address is 0");
    }
    lx_core *c = self->core;
    pthread_mutex_lock(&c->lock);
    int bound = self->api.mem_alloc != NULL;
    if (!bound) {
        self->api.mem_free = (int (*)(unsigned long long))(uintptr_t)f[1];
        self->api.ctx_push = (int (*)(void *))(uintptr_t)f[2];
        self->api.ctx_pop = (int (*)(void **))(uintptr_t)f[3];
        self->api.context = (void *)(uintptr_t)f[4];
        self->api.mem_alloc = (int (*)(unsigned long long *, size_t))(uintptr_t)f[0];
    }
    pthread_mutex_unlock(&c->lock);
    if (bound) {
        return PyErr_Format(PyExc_RuntimeError, "bind_cuda: already bound");
    }
    Py_RETURN_NONE;
}

static PyTypeObject BlockType;

/* block(size) -> a Block of at least size bytes from a CUDA core; None when the
 * bookkeeping is out of memory (allocate elsewhere); MemoryError over the limit
 * or out of device memory even after releasing the free blocks (the reason
 * and figures in last_failure()). */
static PyObject *
Core_block(CoreObject *self, PyObject *arg)
{
    Py_ssize_t size = PyLong_AsSsize_t(arg);
    if (size == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (!self->cuda || size < 0) {
        return PyErr_Format(PyExc_ValueError, "block(%zd): %s", size,
                            self->cuda ? "negative size" : "this core serves host memory");
    }
    BlockObject *block = PyObject_New(BlockObject, &BlockType);
    if (block == NULL) {
        return NULL;
    }
    int zero_filled;
    lx_status status;
    block->ptr = lx_alloc(self->core, (size_t)size, 0, &zero_filled, &status);
    if (block->ptr == NULL) {
        block->owner = NULL;
        Py_DECREF(block);
        if (status == LX_FALLBACK) {
            Py_RETURN_NONE;
        }
        return PyErr_Format(PyExc_MemoryError, "the cache cannot allocate %zd bytes", size);
    }
    block->size = bin_bytes(bin_of(size ? (size_t)size : 1)); /* served, so <= LX_MAX_REQUEST */
    Py_INCREF(self);
    block->owner = self;
    return (PyObject *)block;
}

static void
Block_dealloc(BlockObject *self)
{
    if (self->owner != NULL) {
        lx_free(self->owner->core, self->ptr);
        Py_DECREF(self->owner);
    }
    PyObject_Free(self);
}

static PyObject *
Block_get_ptr(BlockObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromVoidPtr(self->ptr);
}

static PyObject *
Block_get_size(BlockObject *self, void *Py_UNUSED(closure))
{
    return PyLong_FromSize_t(self->size);
}

static PyGetSetDef Block_getset[] = {
    {"ptr", (getter)Block_get_ptr, NULL, "the block's address", NULL},
    {"size", (getter)Block_get_size, NULL, "the block's bytes (its size bin's)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn.memory._core.Block",
    .tp_basicsize = sizeof(BlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of a CUDA core in use; it goes back to the core when it dies.",
    .tp_dealloc = (destructor)Block_dealloc,
    .tp_getset = Block_getset,
};

static void
handler_capsule_destructor(PyObject *capsule)
{
    PyMem_RawFree(PyCapsule_GetPointer(capsule, handler_capsule_name));
    Py_XDECREF(PyCapsule_GetContext(capsule)); /* the core it kept alive */
}

/* A new NEP 49 handler capsule routing to this core. It holds a reference to
 * the core, and every array made through it holds the capsule, so the core
 * outlives the last array whatever happens to the Python AllocCache. */
static PyObject *
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

/* (events as bytes, events lost to the ring's bound), oldest event first. */
static PyObject *
Core_timeline(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_core *c = self->core;
    if (c->events == NULL) {
        return Py_BuildValue("(y#K)", "", (Py_ssize_t)0, 0ULL);
    }
    size_t cap = c->event_cap;
    lx_event *copy = PyMem_Malloc(cap * sizeof(lx_event));
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&c->lock);
    uint64_t total = c->events_total;
    size_t n = total < cap ? (size_t)total : cap;
    for (size_t i = 0; i < n; i++) {
        copy[i] = c->events[(total - n + i) % cap];
    }
    pthread_mutex_unlock(&c->lock);
    PyObject *result = Py_BuildValue("(y#K)", (const char *)copy,
                                     (Py_ssize_t)(n * sizeof(lx_event)),
                                     (unsigned long long)(total - n));
    PyMem_Free(copy);
    return result;
}

/* The timeline's spans as bytes of int64 rows (lx_span's fields in order),
 * oldest first; empty when not recording. */
static PyObject *
Core_timeline_spans(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lx_core *c = self->core;
    if (c->spans == NULL) {
        return PyBytes_FromStringAndSize("", 0);
    }
    lx_span *copy = PyMem_Malloc(LX_SPANS * sizeof(lx_span));
    if (copy == NULL) {
        return PyErr_NoMemory();
    }
    pthread_mutex_lock(&c->lock);
    size_t n = c->nspans;
    memcpy(copy, c->spans, n * sizeof(lx_span));
    pthread_mutex_unlock(&c->lock);
    PyObject *result =
        PyBytes_FromStringAndSize((const char *)copy, (Py_ssize_t)(n * sizeof(lx_span)));
    PyMem_Free(copy);
    return result;
}

static PyMethodDef Core_methods[] = {
    {"stats", (PyCFunction)Core_stats, METH_NOARGS,
     "stats() -> Figures: hits, misses, upstream_allocs, upstream_frees, bytes_live, "
     "bytes_cached, bytes_reserved, peak_live, peak_reserved, scopes, plan_hits, "
     "plan_misses, plans, inactive_split_bytes"},
    {"reset_peaks", (PyCFunction)Core_reset_peaks, METH_NOARGS,
     "Set the peaks to the current figures."},
    {"trim", (PyCFunction)Core_trim, METH_O,
     "trim(max_cached_bytes) -> bytes released, least recently used first"},
    {"release_all", (PyCFunction)Core_release_all, METH_NOARGS,
     "Release the free blocks now and the live ones when they die."},
    {"scope_enter", (PyCFunction)Core_scope_enter, METH_NOARGS,
     "Open a scope; returns its watcher slot."},
    {"install_plan", (PyCFunction)Core_install_plan, METH_VARARGS,
     "install_plan(cycle_size, kept_size, sizes, even, odd, which) -> PLAN_INSTALLED, "
     "PLAN_LATER or PLAN_NO_ROOM"},
    {"scope_exit", (PyCFunction)Core_scope_exit, METH_O,
     "scope_exit(slot) -> (peak_live, peak_reserved) of the scope; evicts unused bins"},
    {"step_begin", (PyCFunction)Core_step_begin, METH_NOARGS,
     "A training step begins (one still open ends first): its requests are recorded"},
    {"step_end", (PyCFunction)Core_step_end, METH_NOARGS,
     "The training step ends: its record waits for take_record"},
    {"set_warm_up", (PyCFunction)Core_set_warm_up, METH_O,
     "set_warm_up(on): while on and no plan serves, a step's requests above the split "
     "threshold go upstream at their size and back when they die"},
    {"drop_plan", (PyCFunction)Core_drop_plan, METH_NOARGS,
     "drop_plan(): the step plan, if any, serves no more (its arenas go upstream when idle)"},
    {"take_record", (PyCFunction)Core_take_record, METH_NOARGS,
     "take_record() -> None or the last step's Record (rows, misses, planned, split_peak, "
     "large_peak, previous)"},
    {"blocks", (PyCFunction)Core_blocks, METH_NOARGS,
     "[(ptr, size, live, segment_base, segment_size, orphan)] of every block owned"},
    {"audit", (PyCFunction)Core_audit, METH_NOARGS,
     "Raise AssertionError unless the records, free lists and figures agree."},
    {"numpy_handler", (PyCFunction)Core_numpy_handler, METH_NOARGS,
     "A new NEP 49 handler capsule allocating from this core."},
    {"bind_cuda", (PyCFunction)Core_bind_cuda, METH_VARARGS,
     "bind_cuda(mem_alloc, mem_free, ctx_push, ctx_pop, context): a CUDA core's driver "
     "functions (addresses of cuMemAlloc_v2, cuMemFree_v2, cuCtxPushCurrent_v2, "
     "cuCtxPopCurrent_v2) and primary context; once, before its first block"},
    {"block", (PyCFunction)Core_block, METH_O,
     "block(size) -> Block from a CUDA core; None: allocate elsewhere; MemoryError: "
     "over the limit or out of device memory (see last_failure())"},
    {"timeline", (PyCFunction)Core_timeline, METH_NOARGS,
     "(event bytes, events dropped); each event is 4 int64: t_ns, live, reserved, kind"},
    {"timeline_spans", (PyCFunction)Core_timeline_spans, METH_NOARGS,
     "bytes of int64 rows: t_enter, t_exit, live_enter, reserved_enter, peak_live, "
     "peak_reserved, live_exit, reserved_exit, spans (merged in the row)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn.memory._core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(limit=0, evict_after=0, timeline_capacity=0, upstream='host', "
              "split_above=SPLIT_ABOVE): the bookkeeping of one AllocCache (0 means none / "
              "never / not recording); upstream 'cuda' serves device memory once "
              "bind_cuda() is called; requests whose block is larger than split_above "
              "bytes are served by splitting free segments (above MAX_REQUEST: never).",
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
};

static PyObject *
mod_bin_size(PyObject *Py_UNUSED(mod), PyObject *arg)
{
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (n < 0 || (size_t)n > LX_MAX_REQUEST) {
        return PyErr_Format(PyExc_ValueError, "no bin for %zd bytes", n);
    }
    return PyLong_FromSize_t(bin_bytes(bin_of(n ? (size_t)n : 1)));
}

static PyObject *
mod_get_handler(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    return PyDataMem_GetHandler();
}

/* Set NumPy's handler in the current context (None: NumPy's default);
 * returns the handler it replaces. */
static PyObject *
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

/* This thread's last failure: (seq, over_limit, request, limit, figures,
 * upstream_error) or None. */
static PyObject *
mod_last_failure(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    lx_failure f = tl_failure;
    if (f.seq == 0) {
        Py_RETURN_NONE;
    }
    return Py_BuildValue("(KOnnNi)", (unsigned long long)f.seq,
                         f.status == LX_OVER_LIMIT ? Py_True : Py_False,
                         (Py_ssize_t)f.request, (Py_ssize_t)f.limit,
                         figures_object(f.fig), f.upstream_error);
}

/* kernel_call() -> the number of a threaded kernel call that begins (section
 * 1c: lanes), for enter_lane in each of its shares' threads. */
static PyObject *
mod_kernel_call(PyObject *Py_UNUSED(mod), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLongLong(atomic_fetch_add(&kernel_calls, 1) + 1);
}

/* enter_lane(call, lane) -> this thread's lane before, for leave_lane: from now
 * on its requests (of any size) are made in share `lane` of kernel call `call`. */
static PyObject *
mod_enter_lane(PyObject *Py_UNUSED(mod), PyObject *args)
{
    long long call, lane;
    if (!PyArg_ParseTuple(args, "LL:enter_lane", &call, &lane)) {
        return NULL;
    }
    if (call < 1 || lane < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "enter_lane: expected a call from kernel_call() and a lane >= 0, "
                            "got %lld and %lld", call, lane);
    }
    PyObject *before = Py_BuildValue("(LLLL)", (long long)tl_lane.call, (long long)tl_lane.lane,
                                     (long long)tl_lane.births, (long long)tl_lane.tick);
    if (before != NULL) {
        tl_lane = (lx_lane){call, lane, 0, 0};
    }
    return before;
}

/* leave_lane(before): this thread's lane as enter_lane found it. */
static PyObject *
mod_leave_lane(PyObject *Py_UNUSED(mod), PyObject *args)
{
    long long call, lane, births, tick;
    if (!PyArg_ParseTuple(args, "(LLLL):leave_lane", &call, &lane, &births, &tick)) {
        return NULL;
    }
    tl_lane = (lx_lane){call, lane, births, tick};
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"kernel_call", mod_kernel_call, METH_NOARGS,
     "kernel_call() -> the number of a threaded kernel call that begins (for enter_lane)"},
    {"enter_lane", mod_enter_lane, METH_VARARGS,
     "enter_lane(call, lane) -> this thread's lane before: its requests are made in share "
     "`lane` of kernel call `call` until leave_lane"},
    {"leave_lane", mod_leave_lane, METH_VARARGS,
     "leave_lane(before): this thread's lane as enter_lane found it"},
    {"bin_size", mod_bin_size, METH_O, "bin_size(n) -> bytes of the block serving n bytes"},
    {"get_handler", mod_get_handler, METH_NOARGS, "NumPy's handler in this context."},
    {"set_handler", mod_set_handler, METH_O,
     "set_handler(capsule or None) -> the previous handler of this context"},
    {"last_failure", mod_last_failure, METH_NOARGS,
     "(seq, over_limit, request, limit, figures, upstream_error) of this thread's last "
     "failure, or None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef core_module = {
    PyModuleDef_HEAD_INIT, "_core", "The allocator's C core and NumPy handler.", -1,
    module_methods,
};

PyMODINIT_FUNC
PyInit__core(void)
{
    import_array();
    if (PyType_Ready(&CoreType) < 0 || PyType_Ready(&BlockType) < 0 ||
        (FiguresType.tp_name == NULL &&
         PyStructSequence_InitType2(&FiguresType, &figures_desc) < 0) ||
        (RecordType.tp_name == NULL &&
         PyStructSequence_InitType2(&RecordType, &record_desc) < 0)) {
        return NULL;
    }
    static int fork_handlers;
    if (!fork_handlers) {
        if (pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) != 0) {
            return PyErr_NoMemory();
        }
        fork_handlers = 1;
    }
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObjectRef(m, "Figures", (PyObject *)&FiguresType) < 0 ||
        PyModule_AddObjectRef(m, "Record", (PyObject *)&RecordType) < 0 ||
        PyModule_AddIntConstant(m, "BIN_DIVISIONS", LX_DIV) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_INSTALLED", LX_PLAN_INSTALLED) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_LATER", LX_PLAN_LATER) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_NO_ROOM", LX_PLAN_NO_ROOM) < 0 ||
        PyModule_AddIntConstant(m, "HUGE_PAGE_MIN", (long)LX_HUGE_MIN) < 0 ||
        PyModule_AddObject(m, "SPLIT_ABOVE", PyLong_FromSize_t(LX_SPLIT_ABOVE)) < 0 ||
        PyModule_AddObject(m, "MAX_REQUEST", PyLong_FromSize_t(LX_MAX_REQUEST)) < 0 ||
        PyModule_AddObject(m, "EVENT_KINDS",
                           Py_BuildValue("(sssssss)", "hit", "upstream", "return",
                                         "release", "scope_enter", "scope_exit", "plan")) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
