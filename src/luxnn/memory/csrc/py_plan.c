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
PyStructSequence_Desc record_desc = {
    "luxnn.memory._core.Record", "A step's record for the planner (luxnn.memory.plan).",
    record_fields, 6,
};
PyTypeObject RecordType;

/* take_record() -> None, or the Record of the last cycle (record.c) when it
 * closed, no cycle is open, it made a split-pool request and nobody took it
 * yet (rows: empty when the record ran out of memory). */
PyObject *
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
 * plan.c: Step plans; the last six are buffers of native int64 of one length (which: 0
 * for the cycle's arena, 1 for the kept one; without call and lane, no slot is
 * a lane's). The slots out of lanes (call and lane -1) come first, sizes ascending; then the lanes' (call, lane >= 0), by
 * call and lane, each lane's in rank order. Returns "installed"; "later"
 * (nothing changed: the cycle arena to replace is in use, or there was no
 * memory to build the plan; try again later); or "no room" (the limit, out of
 * memory, or no memory for an arena's bitmap: the old plan is dropped). The
 * plan is built from the checked values here, with the GIL held, so that no
 * other thread can change a buffer between its check and its use. */
PyObject *
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
