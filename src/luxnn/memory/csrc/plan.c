/*
 * Step plans, served: a recorded request takes the slot of its plan (by lane
 * and rank, or by bin and rank), else a free run of the arena; installing a
 * plan (reusing the arena in use where it fits) and dropping one. The plans
 * themselves are made in Python (luxnn/memory/plan.py) from the record
 * (record.c); their memory is an arena (arena.c). Every function but
 * lx_install_plan expects the core's lock held.
 */
#include "core.h"

#include <stdlib.h>

/* ---- Step plans ---------------------------------------------------------
 *
 * Decision: a training loop repeats one step, the same requests with the same
 * lifetimes, so its large blocks are placed by a plan made from earlier steps
 * rather than online. Online placement (pool.c) cannot know which block dies
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
 *   record.c): the kernel call (numbered from the step's beginning), the share,
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

void
free_plan(lx_plan *p)
{
    if (p != NULL) {
        free(p->slots);
        free(p->lanes);
        free(p);
    }
}

/* The plan serves no more: its arenas are dropped. Returns the bytes released now. */
size_t
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
lx_block *
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

/*
 * Install plan p (Step plans, above), built by the caller (slots, first, count), whose
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
lx_status
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
