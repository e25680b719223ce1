/*
 * Step plans, served: a step's first requests choose which of the plans serves
 * it; a recorded request takes the slot of that plan (by lane and rank, or by
 * bin and rank), else a free run of the arena; installing a plan (in the one
 * arena of all the plans, which grows or is made one chunk where it must) and
 * dropping them. The plans
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
 *   records every request, the smallest too (a bias and its moments, made
 *   anew each step out of place, left in a slab beside the last step's, kept
 *   the slab's other bytes idle over the step's peak), and its lane (below): the
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
 *   second once the first plan's first cycle is over (grow_arena_locked), so
 *   that the first planned step, whose step before kept its results outside
 *   the arena, holds only the first. A plan widened later (threads interleave
 *   beyond it) is repacked into the arena.
 * - Several plans (shapes that vary: a short last batch, lengths in buckets, an
 *   evaluation pass): up to LX_PLANS, one per request-size signature, in places
 *   0 .. LX_PLANS - 1 that the planner chooses (it replaces the least recently
 *   used), all in the one arena, sized for the largest: a plan beyond it grows
 *   the arena's second chunk while no block lives there, or, with no block
 *   alive in the arena, one chunk as large replaces it; else it waits
 *   (LX_BUSY). A plan keeps the sizes of its step's first LX_MATCH recorded
 *   requests out of lanes above LX_MATCH_ABOVE (its sequence; smaller ones are
 *   alike in every shape): each such request of a cycle keeps
 *   as candidates the plans that follow it, and the plan serving the cycle is
 *   a candidate, else the most recently used one (a plan with no sequence
 *   follows every step). No plan follows the cycle's first such request: none
 *   serves the cycle (its requests take the slots of their bin and rank in a
 *   stand-in plan, where those are free, so that the blocks it keeps, of sizes
 *   that do not vary with the shapes, sit where every plan keeps them; else
 *   free runs of the arena, else where a cycle's without plans go); none
 *   follows a later one: the plan serving goes on. A wrong choice costs
 *   misses, never an overlap.
 * - Parity: slots have places in the arena's even and odd cycles, so that
 *   blocks one plan's cycle carries into another's sit where that one expects
 *   them (the planner gives kept blocks the same places in every plan). The
 *   arena's first cycle is even; each later one takes the other parity than
 *   the places most of the arena's live blocks hold as it opens (record.c), so
 *   that a cycle carrying nothing in between (small arrays only, an evaluation
 *   pass) shifts nothing. A slot whose place is held misses: its other place
 *   is where the next cycle's temporaries expect its block gone (taking it
 *   left a block out of phase, and each next one of its slot, for good).
 * - Warm-up (set_warm_up, luxnn/memory/plan.py: WarmUp): while it is on, a
 *   step's recorded requests that no plan serves (before any plan, a step no
 *   plan follows or the misses of one) go upstream at their size, as
 *   whole blocks marked orphan and direct, and back when they die (those
 *   of a step no plan follows try a free run of the arena first, a plan's
 *   misses one above the plan's slots): the steps a
 *   plan is made from reserve what they use, nothing more, and a miss is not
 *   left where the next step's plan places its own; what the split pool served
 *   before a warm-up step (an optimizer's first state) goes back when the step
 *   begins, if it died. Small requests out of lanes are planned too, but
 *   only in a step with larger ones, ones above LX_MATCH_ABOVE or lanes'
 *   (Record.plannable; slabs placing online may take steps to settle on
 *   a step's blocks of tens of KiB): a step's go
 *   upstream too once it or the step before had such requests (warm_small),
 *   after its first request above LX_MATCH_ABOVE, so that no slab holds a
 *   step's small results or gradients over the next step's peak; before
 *   that they take slabs (the first step cannot know yet), and the slabs left
 *   whole and free go back as each step begins once one had such requests.
 *   A step with nothing to plan ends the warm-up (WarmUp.end): a loop of
 *   requests of at most LX_MATCH_ABOVE only is served by its slabs.
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
 *   k-th slot if all its bytes are free now; where a request of this cycle
 *   took the k-th slot (a request from another thread came first), the
 *   (k+1)-th or (k-1)-th, if not taken in this cycle and free. A k-th slot
 *   not taken whose bytes are held (a block carried in from a step of other
 *   shapes, or kept longer) is a miss, and the neighbours keep their slots:
 *   taken, it pushed each later request of the bin into the next one's slot,
 *   and the last, often a result the step keeps, out of every plan's places
 *   (above the plan serving, in a larger plan's slots, where the next step of
 *   that plan then missed its largest block). Otherwise it is
 *   a plan miss and goes to a free run of the arena above the plan's slots
 *   (its span), the highest: plans pack from the arena's start, so there it
 *   takes no place of a later request of the plan, nor, from the top, of a
 *   plan of a larger shape before the smaller ones'. (A miss placed at the
 *   first gap pushed that slot's own request out, and so on, and the blocks
 *   it carried into the next step pushed out that step's: in a loop of
 *   bucketed lengths, a bucket's first planned step after another's sent
 *   most of its requests upstream, beside the whole arena.) Else (after the
 *   warm-up) any free run of the arena that fits, else the split pool or a
 *   slab, as every request of a cycle without a plan does. A request of
 *   LX_MATCH_ABOVE or less out of lanes takes only its own slot (or a
 *   neighbour's), once a larger request of its cycle came (before, the
 *   cycle's plan is not chosen yet), else the pools': a small block at a
 *   stand-in's slot or in a free run sat on bytes that the next step's plan
 *   gives a larger block, for as long as it lived.
 * - Safety does not rest on the plan: a bitmap of each arena's 512-B
 *   granules marks the bytes of its live blocks, and a slot serves only when
 *   all of its bytes are free. A cycle unlike the recorded ones (other
 *   shapes, another interleaving of threads, an array kept longer) costs
 *   misses, never an overlap.
 * - An arena's bytes not in use are cached bytes; a plan hit is a hit. While
 *   plans serve, the whole free segments of the split pool that served no
 *   request since the latest of them was installed are released when a cycle
 *   opens or closes: they are what the plans replaced (the segments of
 *   misses are kept, and evicted as usual). Freed, trimmed or evicted (no plan
 *   served for evict_after scopes), the plans' arena goes upstream at once if
 *   no block lives in it, else when its last block dies (a retired arena).
 */

void
free_plan(lx_plan *p)
{
    if (p != NULL) {
        free(p->slots);
        free(p->lanes);
        free(p->sequence);
        free(p);
    }
}

/* Plan k serves no more (its blocks stay where they are until they die). */
static void
remove_plan_locked(lx_core *c, uint32_t k)
{
    if (c->serving == c->plans[k]) {
        c->serving = NULL;
    }
    c->candidates &= ~((uint32_t)1 << k);
    c->stand_ins &= ~((uint32_t)1 << k);
    free_plan(c->plans[k]);
    c->plans[k] = NULL;
}

/* No plan serves any more: the plans and their arena are dropped. Returns the
 * bytes released now. */
size_t
drop_plan_locked(lx_core *c)
{
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        remove_plan_locked(c, k);
    }
    lx_arena *a = c->arena;
    c->arena = NULL;
    return drop_arena_locked(c, a);
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

/* Whether plan p keeps `size` as the r-th recorded request out of lanes (a plan
 * that keeps no sequence follows every step). */
static inline int
plan_follows(const lx_plan *p, uint32_t r, size_t size)
{
    return p->nsequence == 0 || (r < p->nsequence && p->sequence[r] == size);
}

/* The most recently used plan among those of bits `among`, or NULL. */
lx_plan *
latest_plan_locked(const lx_core *c, uint32_t among)
{
    lx_plan *best = NULL;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        lx_plan *p = c->plans[k];
        if ((among >> k) & 1 && p != NULL && (best == NULL || p->last_cycle > best->last_cycle)) {
            best = p;
        }
    }
    return best;
}

/* The open cycle's recorded request of `size` bytes out of lanes (call < 0) picks
 * its plan: of the plans whose first requests were the cycle's so far, the one
 * serving, else the most recently used. No plan follows the cycle's first request:
 * none serves it; none follows a later one: the one serving goes on (a request
 * in another order costs misses, never an overlap). */
void
choose_plan_locked(lx_core *c, size_t size, int64_t call)
{
    if (call >= 0 || size <= LX_MATCH_ABOVE || c->matched >= LX_MATCH) {
        return;
    }
    uint32_t r = c->matched++, follow = 0;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        if ((c->candidates >> k) & 1 && plan_follows(c->plans[k], r, size)) {
            follow |= (uint32_t)1 << k;
        }
    }
    c->candidates = follow;
    if (follow == 0) {
        c->serving = r == 0 ? NULL : c->serving;
        return;
    }
    int serving_follows = 0;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        serving_follows |= (follow >> k) & 1 && c->plans[k] == c->serving;
    }
    if (!serving_follows) {
        c->serving = latest_plan_locked(c, follow);
    }
}

/* The slot of plan p for a recorded request of `size` bytes (bin `bin`), if all
 * of its bytes are free: that of its lane and rank there (call >= 0), else of
 * rank `rank` among the bin's requests out of lanes, or (`neighbours`) the
 * (rank+1)-th's or the (rank-1)-th's (another thread may have made a request of
 * the size first). NULL: none (its own slot held and not taken: a miss, the
 * neighbours keep theirs), or no memory for the block's bookkeeping. */
static lx_block *
take_slot_locked(lx_core *c, lx_plan *p, uint32_t bin, size_t size, int64_t call, int64_t lane,
                 int64_t rank, int neighbours)
{
    lx_arena *a = c->arena;
    uint32_t first, count;
    if (call >= 0) {
        const lx_lane_slots *l = lane_slots(p, call, lane);
        first = l != NULL ? l->first : 0;
        count = l != NULL ? l->count : 0;
    }
    else {
        first = p->first[bin];
        count = p->count[bin];
    }
    int tries = call < 0 && neighbours ? 3 : 1;
    uint32_t own = rank < (int64_t)count ? (uint32_t)rank : count;
    uint32_t ranks[3] = {own, own + 1, own - 1};
    int parity = c->parity;
    for (int k = 0; k < tries && own < count; k++) {
        if (ranks[k] >= count) { /* also own - 1 for rank 0 */
            continue;
        }
        lx_slot *s = &p->slots[first + ranks[k]];
        if (s->taken == c->cycle || s->bin != bin) {
            continue;
        }
        size_t at = s->offset[parity];
        if (!arena_serves(a, at, size) ||
            !granules_free(a, at >> LX_QUANTUM_LOG2, (at + size) >> LX_QUANTUM_LOG2)) {
            if (k == 0) {
                break; /* its own slot held, not taken: a miss, the neighbours keep theirs */
            }
            continue;
        }
        lx_block *b = arena_block_locked(c, a, at, size, bin);
        if (b != NULL) {
            s->taken = c->cycle;
            b->phase = (uint8_t)(1 + parity);
            a->phase_live[parity]++;
        }
        return b;
    }
    return NULL;
}

/* In a cycle no plan follows, the plan whose slots a request out of lanes of bin
 * `bin` takes by rank: of the stand-ins (lx_set_stand_ins), the one with the
 * fewest slots of the bin (the most recently used of those), whose slots of the
 * bin are the least likely to be a shape's; NULL: none has one. */
static lx_plan *
stand_in_locked(const lx_core *c, uint32_t bin)
{
    lx_plan *best = NULL;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        lx_plan *q = c->plans[k];
        if (q != NULL && (c->stand_ins >> k) & 1 && q->count[bin] > 0 && c->cycle >= q->from_cycle &&
            (best == NULL || q->count[bin] < best->count[bin] ||
             (q->count[bin] == best->count[bin] && q->last_cycle > best->last_cycle))) {
            best = q;
        }
    }
    return best;
}

/* A recorded request of `size` bytes (bin `bin`) at its planned place: its slot in
 * the plan serving the cycle (take_slot_locked); in a cycle no plan follows, a
 * request out of lanes takes the slot of its bin and rank in a stand-in plan
 * (stand_in_locked): the blocks a step keeps (new parameters and optimizer state)
 * have the same sizes whatever the shapes, and every plan keeps them at the same
 * places, so a step of shapes not planned yet leaves its results where the next
 * step's plan expects them, not in the bytes of its temporaries. Else (a plan
 * miss, or a request of a cycle no plan serves) a free run of the arena; NULL:
 * served elsewhere. */
lx_block *
take_planned_locked(lx_core *c, uint32_t bin, size_t size, int64_t call, int64_t lane,
                    int64_t rank)
{
    lx_plan *p = c->serving;
    lx_arena *a = c->arena;
    int small = size <= LX_MATCH_ABOVE && call < 0; /* a lane's: as any size (Matching) */
    if (small && c->matched == 0) {
        return NULL; /* no larger request picked the cycle's plan yet: the pools' */
    }
    if (p != NULL && c->cycle >= p->from_cycle) {
        lx_block *b = take_slot_locked(c, p, bin, size, call, lane, rank, 1);
        if (b != NULL) {
            p->last_cycle = c->cycle;
            c->fig.plan_hits++;
            return b;
        }
    }
    if (small) { /* its slot or the pools (Matching, above) */
        c->fig.plan_misses += p != NULL;
        c->cycle_misses += p != NULL;
        return NULL;
    }
    lx_plan *q = p == NULL && call < 0 ? stand_in_locked(c, bin) : NULL;
    lx_block *b = q != NULL ? take_slot_locked(c, q, bin, size, call, lane, rank, 0) : NULL;
    if (b != NULL) {
        return b; /* a hit, not at a place planned for it */
    }
    size_t at;
    if (p != NULL) {
        c->fig.plan_misses++;
        c->cycle_misses++;
        /* Above the plan's slots, the highest (Matching, above). */
        if (free_run_above(a, size, p->span, &at)) {
            return arena_block_locked(c, a, at, size, bin);
        }
        if (c->warm_up) {
            return NULL; /* upstream at its size: not where the next step's plan places its own */
        }
    }
    /* A miss (the planner widens or makes a plan from it): any free run of the arena
     * that fits, before the pools (threads' temporaries of one size swap places from
     * step to step; a step of other shapes fits between the blocks that live there);
     * the bitmap keeps it clear of every live block. */
    int found = free_run(a, size, &at);
    return found ? arena_block_locked(c, a, at, size, bin) : NULL;
}

/* The plans that may stand in for a cycle no plan follows: those of places
 * `bits` (bit k: place k) that hold a plan; a plan installed is one until this
 * says otherwise. The planner names those whose blocks kept across steps are
 * where every plan keeps them (luxnn/memory/plan.py). */
void
lx_set_stand_ins(lx_core *c, uint32_t bits)
{
    lock_take(&c->lock);
    c->stand_ins = 0;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        c->stand_ins |= (uint32_t)(c->plans[k] != NULL && (bits >> k) & 1) << k;
    }
    lock_give(&c->lock);
}

/* Whether a slot of plan p lies across offset `cut`. */
static int
plan_straddles(const lx_plan *p, size_t cut)
{
    for (size_t i = 0; i < p->nslots; i++) {
        size_t size = bin_bytes(p->slots[i].bin);
        for (int k = 0; k < 2; k++) {
            if (p->slots[i].offset[k] < cut && p->slots[i].offset[k] + size > cut) {
                return 1;
            }
        }
    }
    return 0;
}

/* A new arena for the plans: `size` bytes, of which the first `first` now (the
 * rest once its first cycle is over), its first cycle, an even one, cycle
 * `from_cycle` (the split pool's whole free segments first go back: the
 * plans replace them). NULL with the reason in *status. */
static lx_arena *
plans_arena_locked(lx_core *c, size_t size, size_t first, uint64_t from_cycle, lx_status *status)
{
    release_wholes_locked(c, &c->split, UINT64_MAX);
    lx_arena *a = new_arena_locked(c, size, first, status);
    if (a != NULL) {
        a->from_cycle = from_cycle;
        a->last_used = c->fig.scopes;
        c->arena = a;
    }
    return a;
}

/*
 * Install plan p (Step plans, above), built by the caller (slots, first, count,
 * sequence), in place k (the plan there serves no more), its slots within
 * `size` bytes of the plans' arena. With no arena yet, one comes from upstream,
 * in two chunks: `first` bytes now (0, or as much as size: one chunk), the rest
 * once the plan's first cycle is over; its first cycle, an even one, is the
 * next to open, so that the first needs the first chunk only (and the whole
 * free slabs go back before it: the plans now serve the recorded small
 * requests). An arena that is too small,
 * or cut where a slot lies across, is replaced by one chunk large enough for
 * both if no block lives in it; else, if no slot lies across its cut, its second
 * chunk grows (grow_arena_to_locked). The plan serves from the next cycle to
 * open. The core takes p in any case. Returns LX_OK; LX_BUSY, nothing changed:
 * a block lives where the arena must change; or why there is no room for it:
 * LX_OVER_LIMIT, LX_OUT_OF_MEMORY, LX_FALLBACK (no memory for the bookkeeping),
 * nothing changed (but an idle arena whose larger stead cannot be had is gone,
 * and the other plans with it).
 */
lx_status
lx_install_plan(lx_core *c, uint32_t k, lx_plan *p, size_t size, size_t first)
{
    lock_take(&c->lock);
    lx_arena *a = c->arena;
    lx_status status = LX_OK;
    if (a == NULL) {
        first = first == 0 || first > size ? size : first;
        /* The whole free slabs go first (the plans now serve the recorded small requests),
         * so that the arena is never held beside them. */
        flush_quick_locked(c, 0, c->quick_bin);
        release_wholes_locked(c, &c->small, UINT64_MAX);
        plans_arena_locked(c, size, first, c->cycle + 1, &status);
    }
    else if (plan_straddles(p, a->first) || size > a->size) {
        if (a->live == 0) { /* one chunk for all the plans, in the idle one's stead */
            size_t whole = size > a->size ? size : a->size;
            uint64_t from_cycle = a->from_cycle;
            c->arena = NULL;
            drop_arena_locked(c, a);
            if (plans_arena_locked(c, whole, whole, from_cycle, &status) == NULL) {
                drop_plan_locked(c); /* the others' arena went */
            }
        }
        else if (!plan_straddles(p, a->first)) {
            release_wholes_locked(c, &c->split, UINT64_MAX);
            status = grow_arena_to_locked(c, a, size);
        }
        else {
            status = LX_BUSY;
        }
    }
    if (status != LX_OK) {
        lock_give(&c->lock);
        free_plan(p);
        return status;
    }
    remove_plan_locked(c, k);
    p->span = 0;
    for (size_t i = 0; i < p->nslots; i++) {
        for (int j = 0; j < 2; j++) {
            size_t end = p->slots[i].offset[j] + bin_bytes(p->slots[i].bin);
            p->span = end > p->span ? end : p->span;
        }
    }
    p->from_cycle = c->cycle + 1; /* the next to open: one open now was not planned for */
    p->last_cycle = c->cycle + 1; /* the latest: made from the steps just seen */
    c->plans[k] = p;
    c->stand_ins |= (uint32_t)1 << k;
    c->plans_since = c->fig.scopes + 1; /* the next scope's clock */
    c->fig.plans++;
    lock_give(&c->lock);
    return LX_OK;
}
