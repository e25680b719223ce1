/*
 * The figures over time: the peaks (the core's, each open scope's, the
 * timeline's open span's), the ring of the last events and the spans of the
 * whole run. Functions named lx_* take the core's lock; the others expect it
 * held.
 */
#include "core.h"

#include <time.h>

static int64_t
now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The event of `kind` into the ring (record_locked, in core.h, calls it while recording). */
void
record_event_locked(lx_core *c, int kind)
{
    lx_event *e = &c->events[c->events_total % c->event_cap];
    e->t_ns = now_ns();
    e->bytes_live = (int64_t)c->fig.bytes_live;
    e->bytes_reserved = (int64_t)(c->fig.bytes_live + c->fig.bytes_cached);
    e->kind = kind;
    c->events_total++;
}

void
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

void
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
void
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

void
lx_reset_peaks(lx_core *c)
{
    lock_take(&c->lock);
    c->fig.peak_live = c->fig.bytes_live;
    c->fig.peak_reserved = c->fig.bytes_live + c->fig.bytes_cached;
    lock_give(&c->lock);
}

lx_figures
lx_figures_of(lx_core *c)
{
    lock_take(&c->lock);
    lx_figures f = c->fig;
    lock_give(&c->lock);
    return f;
}
