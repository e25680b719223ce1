/*
 * Steps and their record (plan.c: Step plans): the training verbs begin and
 * end a step, which is a cycle; the cycle's requests are recorded (size,
 * birth, death, lane) for the planner
 * (luxnn/memory/plan.py), and a record's blocks that outlive it are carried
 * into the next. Lanes: which share of a threaded kernel call this thread's
 * requests are made in. Functions named lx_* take the core's lock; the others
 * expect it held.
 */
#include "core.h"

#include <stdlib.h>
#include <string.h>

_Thread_local lx_lane tl_lane;
_Atomic int64_t kernel_calls; /* threaded kernel calls begun, in every thread */

/* The open cycle's record: a block was allocated in lane (call, lane) of it
 * (lane_of_locked's), or died. */
void
note_birth_locked(lx_core *c, lx_block *b, int64_t call, int64_t lane)
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
    /* A step is planned once it has a request a plan is matched by (above LX_MATCH_ABOVE),
     * a split pool's or a lane's: slabs alone, placing online, may take steps to settle
     * (a bidirectional LSTM's 20-48 KiB blocks took a new slab on its fourth step). */
    c->cycle_plannable += b->bin >= c->split_bin || call >= 0 || b->size > LX_MATCH_ABOVE;
    c->rec[c->nrec] = (lx_request){(int64_t)b->size, c->tick++, -1, call, lane,
                                   call >= 0 ? tl_lane.tick++ : -1, -1, b};
    b->rec = ++c->nrec;
}

void
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
void
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

/* A cycle opens: a fresh record, every slot free to take, every plan a
 * candidate to serve it (the most recently used first, until its requests
 * choose), and while plans serve, no whole free segment of the split pool that
 * served nothing since the latest plan came stays (what the plans replaced;
 * misses' segments are kept, and evicted as usual). */
static void
open_cycle_locked(lx_core *c)
{
    if (!c->finished) {
        finish_record_locked(c); /* nobody took it, or it holds no request */
    }
    c->finished = 0;
    c->cycle++;
    /* Parity: a block that outlives its step sits at its slot's place of the step's
     * parity, and the next step's block of the slot takes the other place, as the plans'
     * temporaries expect. So the cycle's parity is the other than that of the places most
     * blocks alive now hold (those carried in), however many cycles went by since they
     * were made: a step of small arrays only, an evaluation pass, a step that kept its
     * results (another parity for each would leave the next training step's results on
     * its own blocks' places, and each next one's). Where as many of each are alive (none,
     * as after a step whose results missed their places), it flips. */
    if (c->arena != NULL) {
        const size_t *held = c->arena->phase_live;
        c->parity = c->cycle == c->arena->from_cycle ? 0 : held[0] != held[1] ? held[0] > held[1] : !c->parity;
    }
    memset(c->rank, 0, sizeof(c->rank));
    c->matched = 0;
    c->candidates = 0;
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        c->candidates |= (uint32_t)(c->plans[k] != NULL) << k;
    }
    c->serving = latest_plan_locked(c, c->candidates);
    if (c->arena != NULL) {
        if (c->cycle > c->arena->from_cycle) {
            grow_arena_locked(c); /* a warm-up block outlived the first planned step */
        }
        /* Blocks that outlived the last cycle may have died since it closed. */
        release_wholes_locked(c, &c->split, c->plans_since);
    }
    else if (c->warm_up) {
        /* The warm-up holds nothing: what the split pool served before it (an optimizer's
         * first state, made outside a step) goes back once it died, and so do the slabs
         * once a step had requests a plan is made for (plan.c: Warm-up). */
        release_wholes_locked(c, &c->split, UINT64_MAX);
        if (c->cycle_plannable > 0) {
            release_wholes_locked(c, &c->small, UINT64_MAX);
        }
    }
    c->warm_small = c->cycle_plannable > 0;
    c->cycle_misses = 0;
    c->cycle_plannable = 0;
    c->large_peak = c->large_live;
    c->split_peak = c->split.held;
    c->nrec = 0;
    c->tick = 0;
    c->rec_lost = 0;
}

/* The open step ends: its record waits for the planner if it holds a request
 * (a step with none is no cycle to plan). */
static void
end_step_locked(lx_core *c)
{
    c->stepping = 0;
    if (c->arena != NULL && c->cycle >= c->arena->from_cycle && c->direct_live == 0) {
        grow_arena_locked(c); /* no block of the steps before it is alive outside */
    }
    if (c->nrec > 0 || c->rec_lost) {
        c->pending = 1;
        if (c->arena != NULL) {
            release_wholes_locked(c, &c->split, c->plans_since);
        }
    }
}

/* A training step begins (one still open ends first): a cycle opens. */
void
lx_step_begin(lx_core *c)
{
    lock_take(&c->lock);
    if (c->stepping) {
        end_step_locked(c);
    }
    open_cycle_locked(c);
    c->stepping = 1;
    c->step_owner = pthread_self();
    c->call_base = atomic_load(&kernel_calls);
    lock_give(&c->lock);
}

/* The training step ends, if one is open. */
void
lx_step_end(lx_core *c)
{
    lock_take(&c->lock);
    if (c->stepping) {
        end_step_locked(c);
    }
    lock_give(&c->lock);
}

/* The record of the last cycle, if it closed, no cycle is open and it holds a
 * request: n rows of (size, born, died, ...) in *rows (malloc'd for the caller;
 * NULL with n 0 when the record is incomplete or has no request a plan is made
 * for), what else the planner learns of it in *info, and in *prev (malloc'd;
 * NULL likewise) the *nprev rows of the record before it with their next
 * deaths. Returns whether there was a record to take. */
int
lx_take_record(lx_core *c, int64_t **rows, size_t *n, lx_record_info *info, int64_t **prev,
               size_t *nprev)
{
    lock_take(&c->lock);
    int pending = c->pending && !c->stepping && (c->nrec > 0 || c->rec_lost);
    *rows = NULL;
    *n = 0;
    *info = (lx_record_info){.misses = c->cycle_misses, .plannable = c->cycle_plannable,
                             .plan = -1, .split_peak = c->split_peak,
                             .large_peak = c->large_peak};
    for (uint32_t k = 0; k < LX_PLANS; k++) {
        info->installed |= (uint32_t)(c->plans[k] != NULL) << k;
        info->plan = c->plans[k] != NULL && c->plans[k] == c->serving ? (int)k : info->plan;
    }
    if (c->arena != NULL) {
        info->arena_size = c->arena->size;
        info->arena_first = c->arena->first;
        info->arena_live = c->arena->live_bytes;
    }
    *prev = NULL;
    *nprev = 0;
    const size_t columns = LX_REQUEST_COLUMNS;
    /* A step with no request a plan is made for is not planned: no rows to hand over
     * (most steps of a loop of small arrays only; its record is carried all the same). */
    int with_rows = pending && info->plannable > 0;
    if (with_rows && c->nprev > 0 &&
        (*prev = malloc(c->nprev * (columns + 1) * sizeof(int64_t))) != NULL) {
        for (size_t i = 0; i < c->nprev; i++) {
            memcpy(*prev + (columns + 1) * i, &c->prev[i].r, columns * sizeof(int64_t));
            (*prev)[(columns + 1) * i + columns] = c->prev[i].next_died;
        }
        *nprev = c->nprev;
    }
    if (pending) {
        finish_record_locked(c);
    }
    if (with_rows) {
        *rows = c->rec_lost ? NULL : malloc((c->nrec ? c->nrec : 1) * columns * sizeof(int64_t));
        for (size_t i = 0; *rows != NULL && i < c->nrec; i++) {
            memcpy(*rows + columns * i, &c->rec[i], columns * sizeof(int64_t));
        }
        *n = *rows != NULL ? c->nrec : 0;
        info->plannable = *n > 0 ? info->plannable : 0; /* an incomplete record: no plan */
    }
    lock_give(&c->lock);
    return pending;
}
