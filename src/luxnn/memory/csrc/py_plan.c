/*
 * The planner's interface (luxnn/memory/plan.py): take_record hands a step's
 * record over, install_plan checks a plan and builds it for the core (plan.c).
 * Runs with the GIL held; the core's lock is taken by the lx_* calls.
 */
#include "py.h"

#include <stdlib.h>
#include <string.h>

static PyStructSequence_Field record_fields[] = {
    {"rows", "bytes of native int64 (size, born, died, call, lane, lane_born, lane_died) "
             "rows, one per request (call, lane: -1 out of a kernel's lanes; lane_died: -1 "
             "unless it died in its lane); empty when plannable is 0"},
    {"misses", "the step's recorded requests that the plan serving it missed"},
    {"plannable", "the step's recorded requests that make it planned: those above the split "
                  "threshold or above MATCH_ABOVE and those of a kernel's lanes (0: the step "
                  "is not planned, as when its rows are empty)"},
    {"plan", "the place of the plan that served the step (install_plan's), or -1: none"},
    {"installed", "the places that hold a plan now, as bits (bit k: place k)"},
    {"split_peak", "the most bytes the split pool held during the step"},
    {"large_peak", "the most bytes that live blocks above the split threshold held in it"},
    {"previous", "bytes of native int64 rows of rows' columns and next_died: the step "
                 "before's record, with the deaths in this step of its blocks that outlived it "
                 "(-1: alive at this step's end too); empty if not known, or plannable is 0"},
    {"arena_bytes", "the bytes of the plans' arena now (0: none)"},
    {"arena_cut", "the bytes of its first chunk (arena_bytes: one chunk)"},
    {"arena_live", "the bytes of the live blocks in it"},
    {NULL, NULL},
};
PyStructSequence_Desc record_desc = {
    "luxnn.memory._core.Record", "A step's record for the planner (luxnn.memory.plan).",
    record_fields, 11,
};
PyTypeObject RecordType;

/* take_record() -> None, or the Record of the last cycle (record.c) when it
 * closed, no cycle is open, it made a split-pool request and nobody took it
 * yet (rows: empty when the record ran out of memory). */
PyObject *
Core_take_record(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    int64_t *rows, *prev;
    size_t n, nprev;
    lx_record_info info;
    if (!lx_take_record(self->core, &rows, &n, &info, &prev, &nprev)) {
        Py_RETURN_NONE;
    }
    PyObject *record = PyStructSequence_New(&RecordType);
    PyObject *items[] = {
        PyBytes_FromStringAndSize(rows != NULL ? (const char *)rows : "",
                                  (Py_ssize_t)(LX_REQUEST_COLUMNS * n * sizeof(int64_t))),
        PyLong_FromUnsignedLongLong(info.misses), PyLong_FromUnsignedLongLong(info.plannable),
        PyLong_FromLong(info.plan),
        PyLong_FromUnsignedLong(info.installed), PyLong_FromSize_t(info.split_peak),
        PyLong_FromSize_t(info.large_peak),
        PyBytes_FromStringAndSize(prev != NULL ? (const char *)prev : "",
                                  (Py_ssize_t)((LX_REQUEST_COLUMNS + 1) * nprev * sizeof(int64_t))),
        PyLong_FromSize_t(info.arena_size), PyLong_FromSize_t(info.arena_first),
        PyLong_FromSize_t(info.arena_live),
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

/* arena_ranges_free(ptrs, sizes, live_too=False) -> bool: arena.c,
 * arena_ranges_free_locked; ptrs and sizes are buffers of native int64 of one length. */
PyObject *
Core_arena_ranges_free(CoreObject *self, PyObject *args)
{
    Py_buffer ptrs = {0}, sizes = {0};
    int live_too = 0;
    if (!PyArg_ParseTuple(args, "y*y*|p:arena_ranges_free", &ptrs, &sizes, &live_too)) {
        return NULL;
    }
    PyObject *result = NULL;
    size_t n = (size_t)ptrs.len / sizeof(int64_t);
    int64_t *values = NULL;
    if (ptrs.len != sizes.len || ptrs.len % (Py_ssize_t)sizeof(int64_t) != 0) {
        PyErr_SetString(PyExc_ValueError, "arena_ranges_free: ptrs and sizes must be int64 buffers of one length");
    }
    else if ((values = malloc(2 * (n ? n : 1) * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
    }
    else {
        for (size_t i = 0; i < n; i++) {
            values[i] = int64_at(&ptrs, i);
            values[n + i] = int64_at(&sizes, i);
        }
        lx_core *c = self->core;
        lock_take(&c->lock);
        int all_free = arena_ranges_free_locked(c, values, values + n, n, live_too, c->fig.scopes);
        lock_give(&c->lock);
        result = PyBool_FromLong(all_free);
    }
    free(values);
    PyBuffer_Release(&ptrs);
    PyBuffer_Release(&sizes);
    return result;
}

/* place_next(ptr): core.c, lx_place_next. */
PyObject *
Core_place_next(CoreObject *self, PyObject *ptr)
{
    void *at = PyLong_AsVoidPtr(ptr);
    if (at == NULL && PyErr_Occurred()) {
        return NULL;
    }
    lx_place_next(self->core, at);
    Py_RETURN_NONE;
}

/* install_plan(place, arena_bytes, sizes, even, odd, *, call=None, lane=None,
 * cut=0, sequence=None): plan.c, Step plans. sizes, even, odd, call and lane are
 * buffers of native int64 of one length, a slot each (without call and lane, no
 * slot is a lane's): the slots out of lanes (call and lane -1) first, sizes
 * ascending; then the lanes' (call, lane >= 0), by call and lane, each lane's in
 * rank order; every slot within arena_bytes, none across `cut` (0: one chunk).
 * sequence: native int64 sizes, those of the recorded step's requests out of
 * lanes in the order they came (the first LX_MATCH choose a step's plan). Place
 * (0 <= place < MAX_PLANS) is where the plan goes, replacing the one there.
 * Returns PLAN_INSTALLED; PLAN_LATER (nothing changed: the arena must grow
 * while a block lives where it grows, or is cut elsewhere, or there was no
 * memory to build the plan; try again later); or PLAN_NO_ROOM (nothing changed:
 * the limit, out of memory, or no memory for an arena's bitmap). The plan is
 * built from the checked values here, with the GIL held, so that no other
 * thread can change a buffer between its check and its use. */
PyObject *
Core_install_plan(CoreObject *self, PyObject *args, PyObject *kwargs)
{
    enum { SIZES, EVEN, ODD, CALL, LANE, SEQUENCE, NBUF };
    static char *keywords[] = {"place", "arena_bytes", "sizes", "even", "odd", "call", "lane",
                               "cut", "sequence", NULL};
    unsigned int place;
    unsigned long long arena, cut = 0;
    Py_buffer buf[NBUF] = {{0}};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "IKy*y*y*|$y*y*Ky*:install_plan", keywords,
                                     &place, &arena, &buf[SIZES], &buf[EVEN], &buf[ODD],
                                     &buf[CALL], &buf[LANE], &cut, &buf[SEQUENCE])) {
        return NULL;
    }
    int lanes = buf[CALL].obj != NULL || buf[LANE].obj != NULL; /* else: none in lanes */
    size_t n = (size_t)buf[SIZES].len / sizeof(int64_t), nlanes = 0;
    size_t nsequence = (size_t)buf[SEQUENCE].len / sizeof(int64_t);
    nsequence = nsequence < LX_MATCH ? nsequence : LX_MATCH;
    const size_t quantum = (size_t)1 << LX_QUANTUM_LOG2;
    const char *bad = NULL;
    lx_plan *p = NULL;
    if (place >= LX_PLANS) {
        bad = "place must be at least 0 and below MAX_PLANS";
    }
    else if (buf[SIZES].len % sizeof(int64_t) || n == 0 || n >= UINT32_MAX ||
             buf[SEQUENCE].len % sizeof(int64_t)) {
        bad = "sizes, even, odd, call and lane must be int64 arrays of one length, at least 1, "
              "and sequence one of int64";
    }
    for (int k = EVEN; bad == NULL && k < (lanes ? SEQUENCE : CALL); k++) {
        if (buf[k].len != buf[SIZES].len) {
            bad = "sizes, even, odd, call and lane must be int64 arrays of one length, at least 1, "
                  "and sequence one of int64";
        }
    }
    if (bad == NULL && (arena % quantum || arena > LX_MAX_REQUEST || arena == 0)) {
        bad = "the arena's bytes must be a positive multiple of 512";
    }
    else if (bad == NULL && (cut % quantum || cut > LX_MAX_REQUEST)) {
        bad = "the cut must be a multiple of 512 bytes";
    }
    int64_t last_call = -1, last_lane = -1;
    for (size_t i = 0, last = 0; bad == NULL && i < n; i++) { /* check every slot */
        int64_t size = int64_at(&buf[SIZES], i), even = int64_at(&buf[EVEN], i),
                odd = int64_at(&buf[ODD], i), call = lanes ? int64_at(&buf[CALL], i) : -1,
                lane = lanes ? int64_at(&buf[LANE], i) : -1;
        if (size <= 0 || (size_t)size > arena || bin_bytes(bin_of((size_t)size)) != (size_t)size ||
            (call < 0 && (size_t)size < last)) {
            bad = "sizes must be block sizes, each within the arena, and ascending out of lanes";
        }
        else if (even < 0 || odd < 0 || (size_t)even % quantum || (size_t)odd % quantum ||
                 (size_t)even > arena - (size_t)size || (size_t)odd > arena - (size_t)size) {
            bad = "every offset must be a multiple of 512 bytes with its block inside the arena";
        }
        else if (((size_t)even < cut && (size_t)(even + size) > cut) ||
                 ((size_t)odd < cut && (size_t)(odd + size) > cut)) {
            bad = "no block may straddle the arena's cut";
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
    for (size_t i = 0; bad == NULL && i < nsequence; i++) {
        int64_t size = int64_at(&buf[SEQUENCE], i);
        if (size <= 0 || (size_t)size > LX_MAX_REQUEST || bin_bytes(bin_of((size_t)size)) != (size_t)size) {
            bad = "the sequence's sizes must be block sizes";
        }
    }
    if (bad == NULL && ((p = calloc(1, sizeof(lx_plan))) == NULL ||
                        (p->nslots = n, p->slots = calloc(n, sizeof(lx_slot))) == NULL ||
                        (nlanes > 0 && (p->lanes = calloc(nlanes, sizeof(lx_lane_slots))) == NULL) ||
                        (p->sequence = calloc(nsequence + 1, sizeof(size_t))) == NULL)) {
        free_plan(p);
        p = NULL;
    }
    for (size_t i = 0; p != NULL && i < nsequence; i++) {
        p->sequence[i] = (size_t)int64_at(&buf[SEQUENCE], i);
    }
    if (p != NULL) {
        p->nsequence = (uint32_t)nsequence;
    }
    for (size_t i = 0; p != NULL && i < n; i++) { /* then build the plan from them */
        size_t size = (size_t)int64_at(&buf[SIZES], i);
        uint32_t b = bin_of(size);
        int64_t call = lanes ? int64_at(&buf[CALL], i) : -1;
        int64_t lane = lanes ? int64_at(&buf[LANE], i) : -1;
        p->slots[i] = (lx_slot){{(size_t)int64_at(&buf[EVEN], i), (size_t)int64_at(&buf[ODD], i)},
                                b, 0};
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
        Py_BEGIN_ALLOW_THREADS
        status = lx_install_plan(self->core, place, p, (size_t)arena, (size_t)cut);
        Py_END_ALLOW_THREADS
    }
    return PyLong_FromLong(status == LX_OK     ? LX_PLAN_INSTALLED
                           : status == LX_BUSY ? LX_PLAN_LATER
                                               : LX_PLAN_NO_ROOM);
}
