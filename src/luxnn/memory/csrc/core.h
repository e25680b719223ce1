/*
 * luxnn.memory._core -- the step-scoped caching allocator: the core's types,
 * its lock contract, and what each of its files offers the others.
 *
 * One core does the bookkeeping of one AllocCache: which blocks it owns, which
 * are free (by size bin, and in least-recently-used order), and the figures.
 * It never reads or writes the contents of a block, so the same core can serve
 * host pointers (the NumPy front end) and device pointers (a CuPy front end
 * plugs in its own lx_upstream: upstream_cuda.c).
 *
 * Files (src/luxnn/memory/csrc/; the design notes are comment blocks beside
 * the code they explain, named here in quotes):
 *   bins.h            size bins: which byte sizes share a free list ("Size bins")
 *   core.h            the core's types, its lock ("The core's lock") and lock contract;
 *                     the functions across files
 *   map.c             ownership map: pointer -> block record ("Ownership map")
 *   pool.c            the small pool's slabs and quick lists ("Small blocks"), the
 *                     split pool ("Split pool")
 *   plan.c            step plans: a request at its planned place, installing a
 *                     plan ("Step plans")
 *   arena.c           a plan's arena: chunks, granule bitmap, blocks, retirement
 *   record.c          steps, their record for the planner, kernel lanes
 *   core.c            the core's life and operations: alloc, free, trim, scopes
 *   figures.c         peaks, the event ring and the timeline's spans
 *   audit.c           the bookkeeping checked against itself (for the tests)
 *   failure.c         why this thread's last cached allocation failed ("Failure record")
 *   fork.c            every core lock taken before fork, released after it ("Fork")
 *   upstream.h        where blocks come from and go back to
 *   upstream_host.c   host memory ("Host memory")
 *   upstream_cuda.c   device memory through the CUDA driver, bound at run time
 *                     ("CUDA upstream")
 *   numpy_handler.c   the NEP 49 handler whose ctx is a core ("NumPy front end")
 *   py.h, py_module.c the Core type and the module; py_plan.c the planner's
 *                     interface; py_cuda.c bind_cuda and the CuPy hook ("CuPy hook")
 *
 * Locking: every mutable field of lx_core is guarded by core->lock. Functions
 * named lx_* take the lock; functions named *_locked expect it held. Nothing
 * done under the lock touches a Python object (the core's own files do not
 * include Python.h: only py.h and so py_*.c and numpy_handler.c do), so the
 * handler's free (and malloc) may run in any thread, with or without the GIL.
 * Lock order when both are held: the GIL first, then a core lock; no code path
 * holding a core lock waits for the GIL, so the two cannot deadlock.
 *
 * All of it is internal to the extension: it is built with -fvisibility=hidden,
 * and only PyInit__core is exported.
 */
#ifndef LX_CORE_H
#define LX_CORE_H

#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1 /* POSIX and Linux calls under -std=c11 (Python.h defines it too) */
#endif

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "bins.h"
#include "upstream.h"

/* ---- Thresholds -----------------------------------------------------------
 *
 * Requests whose block is larger than LX_SPLIT_ABOVE go to the split pool
 * (pool.c: Split pool), smaller ones to the small pool's slabs (pool.c: Small
 * blocks), whose blocks up to LX_QUICK_MAX wait in quick lists when they die. */
#ifndef LX_SPLIT_ABOVE
#define LX_SPLIT_ABOVE ((size_t)64 << 10)
#endif
#define LX_MASK_WORDS ((LX_NBINS + 63) / 64)
/* Steps record every request and plans serve them (plan.c: Step plans); the
 * requests above this out of lanes match a step to its plan (plan.c: Matching),
 * and only they, missing their slot, take a stand-in's or a free run of the
 * arena: a small block there would sit on bytes that the next step's plan gives
 * a larger one, for as long as it lives. */
#ifndef LX_MATCH_ABOVE
#define LX_MATCH_ABOVE ((size_t)16 << 10)
#endif
#define LX_QUICK_MAX ((size_t)1 << 10)     /* small blocks freed to a quick list */
#define LX_SLAB_MIN ((size_t)16 << 10)     /* the small pool's first slab */
#define LX_SLAB_MAX ((size_t)2 << 20)      /* and its largest (PyTorch's small segments) */

/* ---- Blocks, segments and the ownership map ------------------------------ */

struct lx_segment;

/* A block of the core: a piece of a segment of a pool (a slab of the small
 * pool or a segment of the split pool: pool.c), a live block at a plan's place in
 * an arena (plan.c: Step plans; never free: its record goes when it dies), or a
 * whole upstream allocation of the warm-up's (seg and arena NULL; an orphan). */
typedef struct lx_block {
    void *ptr;
    size_t size;                   /* bytes: the request's bin size while live */
    struct lx_block *prev, *next;  /* neighbours in the bin's free list (free blocks) */
    struct lx_block *older, *newer; /* neighbours in the core's LRU ring (free blocks) */
    struct lx_block *left, *right; /* split pool: the pieces before and after (NULL: none) */
    struct lx_segment *seg;        /* its pool's segment; NULL: a plan's or the warm-up's */
    struct lx_arena *arena;        /* a plan's block (plan.c): its arena; seg is NULL */
    size_t rec;                    /* 1 + its index in the open cycle's record; 0: none */
    size_t carry;                  /* 1 + its index in the last cycle's record, which it
                                      outlived, while the next one runs; 0: none */
    uint32_t bin;   /* live and quick blocks: the request's bin; free pieces:
                       floor_bin(size) */
    uint8_t live;   /* 1: in use by an array; 0: free */
    uint8_t quick;  /* a free small block in its bin's quick list, not coalesced yet */
    uint8_t orphan; /* a whole block (seg NULL): goes upstream when it dies (pieces:
                       seg->orphan) */
    uint8_t direct; /* the warm-up's (plan.c: Warm-up): upstream at its size, back when it dies */
    uint8_t phase;  /* a plan's block at a slot's place: 1 + the parity of that place; else 0 */
} lx_block;

struct lx_pool;

/* A segment of a pool: one upstream allocation. Its leftmost piece (at base) lives exactly as
 * long as the segment (merges keep the left record, splits add records to the
 * right), so both share one allocation, an lx_head: freeing that piece's
 * record frees the segment's. */
typedef struct lx_segment {
    void *base;
    size_t size;        /* bytes allocated upstream */
    size_t live;        /* pieces in use by arrays */
    size_t live_bytes;  /* their bytes */
    uint64_t last_used; /* scope clock when a piece of it last served a request */
    struct lx_pool *pool; /* the pool it belongs to */
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

static inline lx_block *
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

/* ---- Step plans (plan.c: Step plans) ------------------------------------- */

typedef struct lx_arena {
    char *base;               /* its first chunk: offsets [0, first) */
    char *base2;              /* its second chunk, offsets [first, size); NULL: not yet */
    size_t size;              /* bytes of both chunks */
    size_t first;             /* bytes of the first chunk (size: it is the only one) */
    size_t live;              /* blocks alive in it */
    size_t live_bytes;
    size_t phase_live[2];     /* its live blocks at a slot's even / odd place */
    uint64_t *busy;           /* bit i: granule i (512 B) belongs to a live block */
    uint64_t from_cycle;      /* the first cycle its plans serve, an even one (lx_core's
                                 parity) */
    uint64_t last_used;       /* scope clock when it last served a request */
    struct lx_arena *next;    /* the next retired arena */
} lx_arena;

typedef struct {
    size_t offset[2]; /* its place in the arena's even and odd cycles (equal unless it
                         outlives one) */
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

extern _Thread_local lx_lane tl_lane;
extern _Atomic int64_t kernel_calls; /* threaded kernel calls begun, in every thread */

/* Plans kept at once, one per request-size signature (luxnn.memory.plan.Planner
 * chooses which to replace), all in the core's one arena. */
#define LX_PLANS 8
/* A step's first requests out of lanes that choose its plan (the sizes a plan keeps). */
#define LX_MATCH 64

typedef struct {
    lx_slot *slots;            /* the others' by bin, and within a bin in the recorded
                                  order; then the lanes' */
    size_t nslots;
    lx_lane_slots *lanes;      /* by (call, lane) */
    size_t nlanes;
    size_t *sequence;          /* the sizes of its first recorded requests out of lanes,
                                  in the order they came (at most LX_MATCH) */
    uint32_t nsequence;
    uint64_t last_cycle;       /* the last cycle it served a request in, or was installed */
    uint64_t from_cycle;       /* the first cycle it serves */
    size_t span;               /* the end of its highest slot: its misses go above (plan.c) */
    uint32_t first[LX_NBINS];  /* each bin's first slot (if it has any) */
    uint32_t count[LX_NBINS];  /* each bin's slots */
} lx_plan;

/* What install_plan says (luxnn.memory.plan.PlanStatus). */
enum { LX_PLAN_INSTALLED, LX_PLAN_LATER, LX_PLAN_NO_ROOM };

/* A request of the open cycle, for the planner. */
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

/* What the planner learns of a cycle with its record (luxnn.memory.plan). */
typedef struct {
    uint64_t misses;     /* the requests its plan missed */
    uint64_t plannable;  /* its requests that make it planned: above the split
                            threshold or LX_MATCH_ABOVE, or a kernel's lanes'
                            (0: it is not planned) */
    int plan;            /* the place of the plan that served it, or -1: none */
    uint32_t installed;  /* bit k: a plan is in place k now */
    size_t split_peak;   /* the most bytes the split pool held during it */
    size_t large_peak;   /* the most bytes its blocks above the split threshold (and
                            those of earlier steps) held */
    size_t arena_size;   /* the plans' arena now: its bytes (0: none) */
    size_t arena_first;  /* and its first chunk's */
    size_t arena_live;   /* and its live blocks' */
} lx_record_info;

/* ---- The core ------------------------------------------------------------ */

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
    size_t inactive_split;    /* free bytes of the pools' segments (slabs and the split
                                 pool's) that hold a live piece (PyTorch's
                                 inactive_split_bytes); not a plan's arena */
} lx_figures;

typedef struct {
    lx_block *top;      /* most recently freed block of the bin; linked by next */
    size_t nfree;
    uint64_t last_used; /* quick lists: scope clock at the bin's last allocation request */
} lx_bin;

/* A pool of segments split into pieces that coalesce when they are free (pool.c). */
typedef struct lx_pool {
    lx_bin free[LX_NBINS];         /* free pieces by floor_bin (no last_used) */
    uint64_t mask[LX_MASK_WORDS];  /* bit i: free[i] holds a piece */
    size_t whole;                  /* bytes of its whole free segments */
    size_t held;                   /* bytes of its segments */
} lx_pool;

/* The peaks of one open scope, and the figures at its entry (slots are reused;
 * in_use marks the open ones). */
typedef struct {
    int in_use;
    pthread_t owner; /* the thread that opened it: a forked child keeps only its own */
    size_t peak_live, peak_reserved;
    lx_figures entry;
} lx_watcher;

/* A closed scope's own figures (luxnn.memory.ScopeStats, in its order): counted from
 * its entry to its exit, the changes of the figures, and its peaks. */
typedef struct {
    uint64_t hits, misses, upstream_allocs, upstream_frees, scopes;
    int64_t live_change, cached_change, reserved_change;
    size_t peak_live, peak_reserved;
} lx_scope_figures;

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

/* ---- The core's lock ------------------------------------------------------
 *
 * Every alloc and every free of an array takes it, mostly without a rival (the
 * threads of a kernel's lanes are the rivals), and holds it for a few hundred
 * instructions. An uncontended pthread mutex costs two atomic read-modify-writes
 * a round trip (in a process with a second thread; glibc drops them while it
 * has one), which is most of what a small block's alloc and free cost beyond
 * NumPy's own (BENCHMARKS.md); this lock costs one: taking it is a compare-and-
 * swap, giving it back a release store. So nobody sleeps on it (a store wakes
 * no one): a waiter spins LX_LOCK_SPINS times, then yields the CPU between
 * tries, so that a holder that was preempted (another process busy on the
 * cores) gets to run and finish. Nothing waits on anything while holding it but
 * upstream (malloc, mmap, cudaMalloc), which rivals then wait out by yielding. */
typedef struct {
    _Atomic int held;
} lx_lock;

#define LX_LOCK_SPINS 100

#if defined(__x86_64__) || defined(__i386__)
#define LX_CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define LX_CPU_RELAX() __asm__ __volatile__("yield")
#else
#define LX_CPU_RELAX() ((void)0)
#endif

void lock_wait(lx_lock *l); /* core.c: lock_take's slow path */

static inline void
lock_take(lx_lock *l)
{
    int unheld = 0;
    if (!atomic_compare_exchange_weak_explicit(&l->held, &unheld, 1, memory_order_acquire,
                                               memory_order_relaxed)) {
        lock_wait(l);
    }
}

static inline void
lock_give(lx_lock *l)
{
    atomic_store_explicit(&l->held, 0, memory_order_release);
}

typedef struct lx_core {
    lx_lock lock;
    lx_upstream up;             /* constant after creation */
    size_t limit;               /* 0: none (lx_set_limit) */
    uint64_t evict_after;       /* 0: never */
    lx_figures fig;
    lx_bin quick[LX_NBINS];     /* the quick lists: free small blocks of bins below quick_bin */
    size_t quick_bytes;         /* their bytes */
    lx_pool small;              /* slabs: blocks of bins below split_bin */
    lx_pool split;              /* segments: blocks of split_bin and above */
    uint32_t quick_bin;         /* the first bin without a quick list; constant */
    uint32_t split_bin;         /* the first bin served by the split pool; constant */
    size_t split_peak;          /* the highest split.held since the cycle opened */
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
    /* Step plans (plan.c, record.c). */
    size_t depth;               /* scopes open */
    uint64_t cycle;             /* cycles opened */
    uint64_t cycle_misses;      /* plan misses of the open (or last) cycle */
    uint64_t cycle_plannable;   /* its recorded requests a plan is made for */
    lx_plan *plans[LX_PLANS];   /* NULL: none in that place */
    lx_arena *arena;            /* the plans' arena; NULL: none (then no plan either) */
    uint64_t plans_since;       /* scope clock of the first scope the latest plan could
                                   serve: the split pool's segments unused since then are
                                   what the plans replaced */
    lx_plan *serving;           /* the plan chosen for the open (or last) cycle; NULL: none */
    int parity;                 /* the open cycle's places in the plans' arena: 0 (even)
                                   in its from_cycle, then the other than that of most
                                   blocks alive at a slot's place as the cycle opens
                                   (record.c) */
    uint32_t stand_ins;         /* bit k: plans[k] may stand in for a cycle no plan follows
                                   (its kept blocks are where every plan keeps them; plan.c) */
    uint32_t candidates;        /* bit k: plans[k] matches the open cycle's requests so far */
    uint32_t matched;           /* the open cycle's requests out of lanes above LX_MATCH_ABOVE
                                   so far (up to LX_MATCH) */
    uint32_t rank[LX_NBINS];    /* the open cycle's recorded requests of each bin out of
                                   lanes so far */
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
    int warm_up;                /* a step's recorded requests that neither a plan nor a
                                   free run of the arena serves go upstream at their
                                   size, and back when they die */
    int warm_small;             /* and its small ones too: the step before had requests
                                   a plan is made for (plan.c: Warm-up) */
    size_t direct_live;         /* the warm-up's blocks alive (plan.c: Warm-up) */
    size_t large_live;          /* bytes of live blocks above the split threshold */
    size_t large_peak;          /* the highest large_live since the cycle opened */
    pthread_t step_owner;       /* the thread that began it */
    int64_t call_base;          /* kernel_calls when it began */
    struct lx_core *fork_prev, *fork_next; /* every core, for fork (fork.c); guarded
                                              by cores_lock, not by lock */
} lx_core;

typedef enum {
    LX_OK,
    LX_FALLBACK,      /* the bookkeeping is out of memory: use the plain allocator */
    LX_OVER_LIMIT,    /* one request larger than the limit */
    LX_OUT_OF_MEMORY, /* upstream failed, even after releasing every free block */
    LX_BUSY,          /* the plans' arena must change where a block lives: not now */
} lx_status;

/* ---- Failure record (failure.c) ------------------------------------------ */

typedef struct {
    uint64_t seq;   /* failures in this thread so far */
    int status;     /* LX_OVER_LIMIT or LX_OUT_OF_MEMORY */
    size_t request; /* bytes asked for */
    size_t limit;   /* the cache's limit, 0 if none */
    lx_figures fig; /* the cache's figures when it failed */
    int upstream_error; /* the CUDA driver's error code, 0 for host memory */
} lx_failure;

extern _Thread_local lx_failure tl_failure; /* this thread's last failure */

/* ---- Small helpers, inline ----------------------------------------------- */

/* Whether a free block is a whole upstream allocation, which alone may go back. */
static inline int
whole_locked(const lx_block *b)
{
    return b->left == NULL && b->right == NULL;
}

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

/* Whether bytes [at, at + size) of arena a lie in one chunk that it holds (a retired
 * arena may hold its second chunk alone). */
static inline int
arena_serves(const lx_arena *a, size_t at, size_t size)
{
    return at >= a->first ? a->base2 != NULL && at + size <= a->size
                          : a->base != NULL && at + size <= a->first;
}

void record_event_locked(lx_core *c, int kind); /* figures.c */

/* An event of `kind` into the timeline, if it records (inline: every alloc and free
 * calls it, and it records only when the cache was made with a timeline). */
static inline void
record_locked(lx_core *c, int kind)
{
    if (c->events != NULL) {
        record_event_locked(c, kind);
    }
}

/* The lane of this thread's requests in the open step (*call counted from the
 * step's first kernel call), or -1, -1: none, or one of an earlier step (a
 * lane left set by an interrupt: its requests are matched as any other's).
 * A lane's call is one kernel_call() gave (enter_lane checks), so while no
 * kernel call began since the step did, no thread is in one of its lanes: the
 * thread-local lane (a call into the dynamic linker from a shared library) is
 * read only once one did. Inline: every request of a step asks it. */
static inline void
lane_of_locked(const lx_core *c, int64_t *call, int64_t *lane)
{
    int in_lane = c->stepping &&
                  atomic_load_explicit(&kernel_calls, memory_order_relaxed) > c->call_base &&
                  tl_lane.call > c->call_base;
    *call = in_lane ? tl_lane.call - c->call_base - 1 : -1;
    *lane = in_lane ? tl_lane.lane : -1;
}

/* ---- Across files -----------------------------------------------------------
 * Functions named lx_* take the core's lock; *_locked ones expect it held. */

/* core.c: the core's life and operations (what the front ends call) */
lx_core *lx_core_new(lx_upstream up, size_t limit, uint64_t evict_after, size_t event_cap,
                     size_t split_above);
void lx_core_destroy(lx_core *c);
void *lx_alloc(lx_core *c, size_t n, int zeroed, int *zero_filled, lx_status *status);
int lx_free(lx_core *c, void *ptr);
size_t lx_live_size(lx_core *c, void *ptr);
size_t lx_trim(lx_core *c, size_t max_cached);
void lx_set_limit(lx_core *c, size_t limit);
void lx_release_all(lx_core *c);
long lx_scope_enter(lx_core *c);
int lx_scope_exit(lx_core *c, size_t slot, lx_scope_figures *figures);

/* map.c: the ownership map (map_find is above) */
void map_put(lx_map *m, lx_block *b);
int map_reserve(lx_map *m, size_t n);
void map_remove(lx_map *m, const lx_block *b);

/* pool.c: the small pool (slabs, quick lists) and the split pool */
void unlink_free_locked(lx_core *c, lx_block *b);
void link_free_locked(lx_core *c, lx_block *b);
void release_locked(lx_core *c, lx_block *b);
void note_piece_locked(lx_core *c, lx_segment *seg, size_t size, int change);
lx_block *take_piece_locked(lx_core *c, lx_pool *pool, uint32_t bin, size_t size, int *no_record);
lx_block *take_quick_locked(lx_core *c, uint32_t bin);
lx_block *take_pooled_at_locked(lx_core *c, const void *ptr, uint32_t bin, size_t size);
void put_quick_locked(lx_core *c, lx_block *b);
void return_piece_locked(lx_core *c, lx_block *b);
void flush_quick_locked(lx_core *c, uint32_t from, uint32_t to);
size_t slab_bytes_locked(const lx_core *c, size_t size);
size_t trim_pools_locked(lx_core *c, size_t max_cached);
size_t trim_locked(lx_core *c, size_t max_cached);
size_t release_wholes_locked(lx_core *c, lx_pool *pool, uint64_t since);

/* plan.c: step plans, served */
void free_plan(lx_plan *p);
size_t drop_plan_locked(lx_core *c);
lx_plan *latest_plan_locked(const lx_core *c, uint32_t among);
void choose_plan_locked(lx_core *c, size_t size, int64_t call);
lx_block *take_planned_locked(lx_core *c, uint32_t bin, size_t size, int64_t call, int64_t lane,
                              int64_t rank);
lx_status lx_install_plan(lx_core *c, uint32_t k, lx_plan *p, size_t size, size_t first);
void lx_set_stand_ins(lx_core *c, uint32_t bits);

/* arena.c: a plan's arena */
int granules_free(const lx_arena *a, size_t from, size_t to);
size_t arena_offset(const lx_arena *a, const void *ptr);
size_t drop_arena_locked(lx_core *c, lx_arena *a);
lx_block *arena_block_locked(lx_core *c, lx_arena *a, size_t at, size_t size, uint32_t bin);
int free_run(const lx_arena *a, size_t size, size_t *at);
int free_run_above(const lx_arena *a, size_t size, size_t from, size_t *at);
int retired_locked(const lx_core *c, const lx_arena *a);
int in_an_arena_locked(const lx_core *c, const void *ptr);
void lx_place_next(const lx_core *c, const void *ptr);
int arena_ranges_free_locked(lx_core *c, const int64_t *ptrs, const int64_t *sizes, size_t n, int live_too,
                             uint64_t now);
void put_planned_locked(lx_core *c, lx_block *b);
lx_arena *new_arena_locked(lx_core *c, size_t size, size_t first, lx_status *status);
void grow_arena_locked(lx_core *c);
lx_status grow_arena_to_locked(lx_core *c, lx_arena *a, size_t size);

/* record.c: steps, their record, lanes */
void note_birth_locked(lx_core *c, lx_block *b, int64_t call, int64_t lane);
void note_death_locked(lx_core *c, lx_block *b);
void finish_record_locked(lx_core *c);
void lx_step_begin(lx_core *c);
void lx_step_end(lx_core *c);
int lx_take_record(lx_core *c, int64_t **rows, size_t *n, lx_record_info *info, int64_t **prev,
                   size_t *nprev);

/* figures.c: peaks, events, spans (record_locked is above) */
void open_span_locked(lx_core *c);
void close_span_locked(lx_core *c);
void note_peaks_locked(lx_core *c);
void lx_reset_peaks(lx_core *c);
lx_figures lx_figures_of(lx_core *c);

/* audit.c, failure.c, fork.c */
const char *audit_locked(lx_core *c);
long lx_stress_lock(lx_core *c, int threads, size_t blocks, size_t size);
void note_failure_locked(lx_core *c, lx_status status, size_t request);
void enlist_core(lx_core *c);
void unlist_core(lx_core *c);
int install_fork_handlers(void);

#endif /* LX_CORE_H */
