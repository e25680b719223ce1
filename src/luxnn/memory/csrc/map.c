/*
 * The ownership map: pointer -> block record. Its lookup (map_find) is inline
 * in core.h, for the free path; here are insertion, growth and removal. Every
 * function expects the core's lock held (the map is a field of the core).
 */
#include "core.h"

#include <stdlib.h>

/* ---- Ownership map ------------------------------------------------------
 *
 * Every block the core owns, live or free, has a record, found by its
 * pointer in an open-addressing hash map (linear probing, backward-shift
 * deletion, load <= 1/2). A pointer not in the map is not ours: the front
 * end hands it to the plain allocator instead of guessing.
 */

/* Insert a record whose pointer is not in the map; capacity must allow it. */
void
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
int
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
void
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
