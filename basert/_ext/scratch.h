#ifndef BASERT_SCRATCH_H
#define BASERT_SCRATCH_H

#include <stdlib.h>

/* Scratch kept from one call to the next (grown, never shrunk), 64-byte aligned: once it has grown, a call allocates
 * nothing, where a fresh buffer of a prefill's size would take a page fault per 4 KiB on every call (the engine has
 * glibc map every block of 128 KiB or more on its own, given back when freed). A call made while another thread holds
 * the pool gets a buffer of its own. Zero-initialised pools are empty. */
typedef struct {
    void *data;
    size_t bytes;
    char busy;
} basert_scratch_pool;

static inline void *basert_scratch_take(basert_scratch_pool *pool, size_t n, int *owned) {
    n = n ? (n + 63) & ~(size_t)63 : 64;
    if (!__atomic_test_and_set(&pool->busy, __ATOMIC_ACQUIRE)) {
        if (pool->bytes < n) {
            const size_t grown = (n + n / 2 + 63) & ~(size_t)63;
            free(pool->data);
            pool->data = aligned_alloc(64, grown);
            pool->bytes = pool->data ? grown : 0;
        }
        if (pool->data) {
            *owned = 0;
            return pool->data;
        }
        __atomic_clear(&pool->busy, __ATOMIC_RELEASE);
    }
    *owned = 1;
    return aligned_alloc(64, n);
}

static inline void basert_scratch_give(basert_scratch_pool *pool, void *scratch, int owned) {
    if (owned)
        free(scratch);
    else
        __atomic_clear(&pool->busy, __ATOMIC_RELEASE);
}

#endif
