/*
 * Fork safety: every core lock taken before fork(), released after it in the
 * parent and the child; in the child, the scopes and step of threads it has
 * not are closed (note below). Its own lock, cores_lock, guards the list of
 * cores (lx_core.fork_prev/fork_next).
 */
#include "core.h"

/* ---- Fork ---------------------------------------------------------------
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

void
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

void
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
        lock_take(&c->lock);
    }
}

static void
after_fork_in_parent(void)
{
    for (lx_core *c = cores; c != NULL; c = c->fork_next) {
        lock_give(&c->lock);
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
        lock_give(&c->lock);
    }
    pthread_mutex_unlock(&cores_lock);
}

/* Register the fork handlers, once per process; -1 if pthread_atfork fails. */
int
install_fork_handlers(void)
{
    static int installed;
    if (!installed) {
        if (pthread_atfork(before_fork, after_fork_in_parent, after_fork_in_child) != 0) {
            return -1;
        }
        installed = 1;
    }
    return 0;
}
