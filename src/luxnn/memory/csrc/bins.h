/*
 * Size bins: which byte sizes share a free list. Pure arithmetic on sizes, no
 * state and no lock; static inline, since the malloc/free fast path of every
 * pool uses it.
 */
#ifndef LX_BINS_H
#define LX_BINS_H

#include <stddef.h>
#include <stdint.h>

/* ---- Size bins ----------------------------------------------------------
 *
 * A request of n bytes is served by a block of bin_bytes(bin_of(n)) >= n
 * bytes. Up to LX_SPLIT_ABOVE a free block is reused only for requests of
 * the same bin; above, blocks are pieces cut from free segments (pool.c: Split pool).
 *
 *   n <= 8 KiB:       multiples of 512 B (16 classes)
 *   2^k < n <= 2^(k+1): LX_DIV classes per power of two, a step of 2^k / LX_DIV
 *
 * so a block wastes less than 512 B on a small request and less than
 * 1/LX_DIV (6.25 %) of a large one: within the 1.1x reserved/live budget for
 * any shape. LX_DIV trades that slack against reuse across nearby sizes
 * (variable batch or sequence lengths), chosen by measurement: see the
 * module docstring of luxnn/memory/cache.py (benchmarks/allocator.py --sweep).
 *
 * Requests above 2^LX_MAX_LOG2 bytes (128 TiB) are not binned: they fail as
 * out of memory, which they are on any machine.
 */
#define LX_DIV_LOG2 4
#define LX_DIV (1u << LX_DIV_LOG2)
#define LX_QUANTUM_LOG2 9
#define LX_LINEAR_LOG2 (LX_QUANTUM_LOG2 + LX_DIV_LOG2) /* linear classes up to 2^this */
#define LX_MAX_LOG2 47
#define LX_MAX_REQUEST ((size_t)1 << LX_MAX_LOG2)
#define LX_NBINS (LX_DIV * (LX_MAX_LOG2 - LX_LINEAR_LOG2 + 1))

/* The bin of a request of 1 <= n <= LX_MAX_REQUEST bytes. */
static inline uint32_t
bin_of(size_t n)
{
    uint64_t m = (uint64_t)n - 1;
    if (m < ((uint64_t)1 << LX_LINEAR_LOG2)) {
        return (uint32_t)(m >> LX_QUANTUM_LOG2);
    }
    int k = 63 - __builtin_clzll(m); /* 2^k <= m < 2^(k+1), so 2^k < n <= 2^(k+1) */
    uint32_t sub = (uint32_t)((m - ((uint64_t)1 << k)) >> (k - LX_DIV_LOG2));
    return LX_DIV * (uint32_t)(k - LX_LINEAR_LOG2 + 1) + sub;
}

/* The block size of a bin: the largest request it serves. */
static inline size_t
bin_bytes(uint32_t bin)
{
    if (bin < LX_DIV) {
        return (size_t)(bin + 1) << LX_QUANTUM_LOG2;
    }
    int k = (int)(bin / LX_DIV) - 1 + LX_LINEAR_LOG2;
    size_t sub = bin % LX_DIV;
    return ((size_t)1 << k) + ((sub + 1) << (k - LX_DIV_LOG2));
}

/* The largest bin whose block fits in s bytes, for s a positive multiple of
 * 512 B (every bin's size is one): where a free piece of s bytes is listed, so
 * that every piece listed in bin f or above can serve a request of bin f. */
static inline uint32_t
floor_bin(size_t s)
{
    uint32_t b = bin_of(s);
    return bin_bytes(b) == s ? b : b - 1;
}

#endif /* LX_BINS_H */
