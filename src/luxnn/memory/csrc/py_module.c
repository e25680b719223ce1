/*
 * The Python module luxnn.memory._core: the Core type (one per AllocCache),
 * its figures as a structseq, and the module functions. Runs with the GIL
 * held; the core's lock is taken by the lx_* calls (and here only around a
 * field or two, never while calling into Python).
 */
#include "py.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

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

/* Fill a new structseq with n new references (NULL: an error, all released). */
PyObject *
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
Core_set_limit(CoreObject *self, PyObject *arg)
{
    unsigned long long limit = PyLong_AsUnsignedLongLong(arg);
    if (limit == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (limit > LX_MAX_REQUEST) {
        return PyErr_Format(PyExc_ValueError, "limit %llu is above %zu bytes", limit,
                            LX_MAX_REQUEST);
    }
    lx_set_limit(self->core, (size_t)limit);
    Py_RETURN_NONE;
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
    lx_scope_figures f;
    if (slot < 0 || lx_scope_exit(self->core, (size_t)slot, &f)) {
        return PyErr_Format(PyExc_ValueError, "no open scope in slot %zd", slot);
    }
    return Py_BuildValue("(KKKKKLLLnn)", (unsigned long long)f.hits,
                         (unsigned long long)f.misses, (unsigned long long)f.upstream_allocs,
                         (unsigned long long)f.upstream_frees, (unsigned long long)f.scopes,
                         (long long)f.live_change, (long long)f.cached_change,
                         (long long)f.reserved_change, (Py_ssize_t)f.peak_live,
                         (Py_ssize_t)f.peak_reserved);
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
    lock_take(&self->core->lock);
    self->core->warm_up = on;
    lock_give(&self->core->lock);
    Py_RETURN_NONE;
}

static PyObject *
Core_set_stand_ins(CoreObject *self, PyObject *arg)
{
    unsigned long bits = PyLong_AsUnsignedLong(arg);
    if (bits == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (bits >> LX_PLANS) {
        return PyErr_Format(PyExc_ValueError, "set_stand_ins: bits of places below MAX_PLANS (%d) "
                            "expected, got %lu", LX_PLANS, bits);
    }
    lx_set_stand_ins(self->core, (uint32_t)bits);
    Py_RETURN_NONE;
}

static PyObject *
Core_drop_plan(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lock_take(&self->core->lock);
    drop_plan_locked(self->core);
    lock_give(&self->core->lock);
    Py_RETURN_NONE;
}

/* blocks() -> [(ptr, size, live, segment base, segment size, orphan)] for
 * every block the core owns, in no order: a piece is in its slab or segment
 * (a quick block is a free piece), a whole block is a segment of its own, a
 * plan's block is in its arena (orphan: a retired one; an arena's
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
    lock_take(&c->lock);
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
    lock_give(&c->lock);
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

/* stress_lock(threads, blocks, nbytes) -> the blocks found changed (audit.c: A
 * stress of the core's lock); the GIL released meanwhile. */
static PyObject *
Core_stress_lock(CoreObject *self, PyObject *args)
{
    int threads;
    Py_ssize_t blocks, nbytes;
    if (!PyArg_ParseTuple(args, "inn:stress_lock", &threads, &blocks, &nbytes)) {
        return NULL;
    }
    if (self->cuda) { /* its threads write into the blocks they take */
        return PyErr_Format(PyExc_TypeError, "stress_lock: this core serves device memory");
    }
    if (threads < 1 || threads > 64 || blocks < 0 || nbytes < 1) {
        return PyErr_Format(PyExc_ValueError,
                            "stress_lock: expected 1 to 64 threads, blocks >= 0 and nbytes >= 1, "
                            "got %d, %zd and %zd", threads, blocks, nbytes);
    }
    long changed;
    Py_BEGIN_ALLOW_THREADS
    changed = lx_stress_lock(self->core, threads, (size_t)blocks, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    if (changed < 0) {
        return PyErr_Format(PyExc_MemoryError, "stress_lock: a thread did not start or a "
                            "request of %zd bytes failed", nbytes);
    }
    return PyLong_FromLong(changed);
}

static PyObject *
Core_audit(CoreObject *self, PyObject *Py_UNUSED(ignored))
{
    lock_take(&self->core->lock);
    const char *broken = audit_locked(self->core);
    lock_give(&self->core->lock);
    if (broken != NULL) {
        PyErr_SetString(PyExc_AssertionError, broken);
        return NULL;
    }
    Py_RETURN_NONE;
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
    lock_take(&c->lock);
    uint64_t total = c->events_total;
    size_t n = total < cap ? (size_t)total : cap;
    for (size_t i = 0; i < n; i++) {
        copy[i] = c->events[(total - n + i) % cap];
    }
    lock_give(&c->lock);
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
    lock_take(&c->lock);
    size_t n = c->nspans;
    memcpy(copy, c->spans, n * sizeof(lx_span));
    lock_give(&c->lock);
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
    {"set_limit", (PyCFunction)Core_set_limit, METH_O,
     "set_limit(bytes): the limit of the requests from now on (0: none)"},
    {"release_all", (PyCFunction)Core_release_all, METH_NOARGS,
     "Release the free blocks now and the live ones when they die."},
    {"scope_enter", (PyCFunction)Core_scope_enter, METH_NOARGS,
     "Open a scope; returns its watcher slot."},
    {"install_plan", (PyCFunction)(void (*)(void))Core_install_plan, METH_VARARGS | METH_KEYWORDS,
     "install_plan(place, arena_bytes, sizes, even, odd, *, call=None, lane=None, cut=0, "
     "sequence=None) -> PLAN_INSTALLED, PLAN_LATER or PLAN_NO_ROOM"},
    {"scope_exit", (PyCFunction)Core_scope_exit, METH_O,
     "scope_exit(slot) -> the scope's figures, in ScopeStats' order (hits, misses, "
     "upstream_allocs, upstream_frees, scopes: counted while it was open; the changes of "
     "bytes_live, bytes_cached, bytes_reserved; peak_live, peak_reserved); evicts unused bins"},
    {"step_begin", (PyCFunction)Core_step_begin, METH_NOARGS,
     "A training step begins (one still open ends first): its requests are recorded"},
    {"step_end", (PyCFunction)Core_step_end, METH_NOARGS,
     "The training step ends: its record waits for take_record"},
    {"set_warm_up", (PyCFunction)Core_set_warm_up, METH_O,
     "set_warm_up(on): while on, a step's recorded requests that no plan serves (nor a "
     "free run of the arena) go upstream at their size and back when they die"},
    {"set_stand_ins", (PyCFunction)Core_set_stand_ins, METH_O,
     "set_stand_ins(bits): the places (bit k: place k) of the plans whose slots a step no plan "
     "follows may take (those whose blocks kept across steps are where every plan keeps "
     "them); a plan installed is one until this says otherwise"},
    {"drop_plan", (PyCFunction)Core_drop_plan, METH_NOARGS,
     "drop_plan(): no step plan serves any more (their arena goes upstream when idle)"},
    {"arena_ranges_free", (PyCFunction)Core_arena_ranges_free, METH_VARARGS,
     "arena_ranges_free(ptrs, sizes, live_too=False) -> whether every range lies in the plans' "
     "arena, free unless live_too (then the arena counts as used); ptrs, sizes: native int64 "
     "buffers of one length"},
    {"place_next", (PyCFunction)Core_place_next, METH_O,
     "place_next(ptr): this thread's next request of this core takes the bytes at ptr in the "
     "plans' arena where they are all free, or a pool's free block that starts there (else it "
     "is served as any)"},
    {"take_record", (PyCFunction)Core_take_record, METH_NOARGS,
     "take_record() -> None or the last step's Record (rows, misses, plannable, plan, installed, "
     "split_peak, large_peak, previous, arena_bytes, arena_cut, arena_live)"},
    {"blocks", (PyCFunction)Core_blocks, METH_NOARGS,
     "[(ptr, size, live, segment_base, segment_size, orphan)] of every block owned"},
    {"audit", (PyCFunction)Core_audit, METH_NOARGS,
     "Raise AssertionError unless the records, free lists and figures agree."},
    {"stress_lock", (PyCFunction)Core_stress_lock, METH_VARARGS,
     "stress_lock(threads, blocks, nbytes) -> blocks found changed: threads without the GIL "
     "allocating and freeing at once, each checking its own blocks (for the tests)"},
    {"numpy_handler", (PyCFunction)Core_numpy_handler, METH_NOARGS,
     "A new NEP 49 handler capsule allocating from this core."},
    {"bind_cuda", (PyCFunction)Core_bind_cuda, METH_VARARGS,
     "bind_cuda(mem_alloc, mem_free, ctx_push, ctx_pop, context): a CUDA core's driver "
     "functions (addresses of cuMemAlloc_v2, cuMemFree_v2, cuCtxPushCurrent_v2, "
     "cuCtxPopCurrent_v2) and primary context; once, before its first block"},
    {"timeline", (PyCFunction)Core_timeline, METH_NOARGS,
     "(event bytes, events dropped); each event is 4 int64: t_ns, live, reserved, kind"},
    {"timeline_spans", (PyCFunction)Core_timeline_spans, METH_NOARGS,
     "bytes of int64 rows: t_enter, t_exit, live_enter, reserved_enter, peak_live, "
     "peak_reserved, live_exit, reserved_exit, spans (merged in the row)"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "luxnn.memory._core.Core",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Core(limit=0, evict_after=0, timeline_capacity=0, upstream='host', "
              "split_above=SPLIT_ABOVE): the bookkeeping of one AllocCache (0 means none / "
              "never / not recording); upstream 'cuda' serves device memory once "
              "bind_cuda() is called; requests whose block is larger than split_above "
              "bytes are served by the split pool (above MAX_REQUEST: never), the others "
              "by slabs.",
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

/* kernel_call() -> the number of a threaded kernel call that begins (plan.c:
 * Step plans, Lanes), for enter_lane in each of its shares' threads. */
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
    if (call < 1 || call > atomic_load(&kernel_calls) || lane < 0) {
        return PyErr_Format(PyExc_ValueError,
                            "enter_lane: expected a call from kernel_call() (1 to %lld) and a "
                            "lane >= 0, got %lld and %lld",
                            (long long)atomic_load(&kernel_calls), call, lane);
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
    if (import_numpy() < 0 || PyType_Ready(&CoreType) < 0 || PyType_Ready(&HookType) < 0 ||
        (FiguresType.tp_name == NULL &&
         PyStructSequence_InitType2(&FiguresType, &figures_desc) < 0) ||
        (RecordType.tp_name == NULL &&
         PyStructSequence_InitType2(&RecordType, &record_desc) < 0)) {
        return NULL;
    }
    if (install_fork_handlers() != 0) {
        return PyErr_NoMemory();
    }
    PyObject *m = PyModule_Create(&core_module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Core", (PyObject *)&CoreType) < 0 ||
        PyModule_AddObjectRef(m, "CupyHook", (PyObject *)&HookType) < 0 ||
        PyModule_AddObjectRef(m, "Figures", (PyObject *)&FiguresType) < 0 ||
        PyModule_AddObjectRef(m, "Record", (PyObject *)&RecordType) < 0 ||
        PyModule_AddIntConstant(m, "BIN_DIVISIONS", LX_DIV) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_INSTALLED", LX_PLAN_INSTALLED) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_LATER", LX_PLAN_LATER) < 0 ||
        PyModule_AddIntConstant(m, "PLAN_NO_ROOM", LX_PLAN_NO_ROOM) < 0 ||
        PyModule_AddIntConstant(m, "MAX_PLANS", LX_PLANS) < 0 ||
        PyModule_AddIntConstant(m, "HUGE_PAGE_MIN", (long)LX_HUGE_MIN) < 0 ||
        PyModule_AddObject(m, "SPLIT_ABOVE", PyLong_FromSize_t(LX_SPLIT_ABOVE)) < 0 ||
        PyModule_AddObject(m, "MATCH_ABOVE", PyLong_FromSize_t(LX_MATCH_ABOVE)) < 0 ||
        PyModule_AddObject(m, "QUICK_MAX", PyLong_FromSize_t(LX_QUICK_MAX)) < 0 ||
        PyModule_AddObject(m, "SLAB_MIN", PyLong_FromSize_t(LX_SLAB_MIN)) < 0 ||
        PyModule_AddObject(m, "SLAB_MAX", PyLong_FromSize_t(LX_SLAB_MAX)) < 0 ||
        PyModule_AddObject(m, "MAX_REQUEST", PyLong_FromSize_t(LX_MAX_REQUEST)) < 0 ||
        PyModule_AddObject(m, "EVENT_KINDS",
                           Py_BuildValue("(sssssss)", "hit", "upstream", "return",
                                         "release", "scope_enter", "scope_exit", "plan")) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
