# Scratch pools kept between calls (scratch.h).
cdef extern from "scratch.h" nogil:
    ctypedef struct basert_scratch_pool:
        pass
    void *basert_scratch_take(basert_scratch_pool *pool, size_t n, int *owned)
    void basert_scratch_give(basert_scratch_pool *pool, void *scratch, int owned)
