/* A persistent thread team for the decode step: N - 1 worker threads that live as long as the team,
 * and a job made of phases that every member walks in order.
 *
 * Work is claimed, not assigned: a phase is a count of chunks, and each member takes the next
 * unclaimed chunk with one compare-and-swap until none is left. A phase is complete when all its
 * chunks are done, not when every member has arrived, so a member the OS has descheduled (another
 * process on the same cores) holds up the others only while it holds a chunk: the members that run
 * take the rest. Between phases a member spins briefly on the phase's done count, then sleeps on a
 * futex; any member finishing a phase wakes the sleepers.
 *
 * Counters count down and carry the job's 32-bit tag in their high half, so a member that falls behind
 * (still in an old job when the next one starts) sees a foreign tag and leaves that job without touching
 * the new one's counts, and never needs the job's sizes, which the next job overwrites.
 *
 * What a chunk computes never depends on which member runs it, so results do not depend on the thread
 * count or on the order chunks are claimed. */
#ifndef BASERT_TEAM_H
#define BASERT_TEAM_H

#include <errno.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define BASERT_TEAM_MAX_THREADS 256
#define BASERT_TEAM_MAX_PHASES 1024

/* How long a member spins on a condition before it sleeps: long enough to cover the gap between the
 * phases of one step, short enough that a member whose partner lost its core hands the core back. */
#define BASERT_TEAM_SPIN_NS 50000
/* How long an idle member spins for the next job before it sleeps (the caller's work between steps). */
#define BASERT_TEAM_IDLE_SPIN_NS 200000

/* One phase's work: chunk c of n_chunks, run by member `member` (0 is the caller). */
typedef void (*basert_phase_fn)(void *ctx, int phase, int chunk, int member);
/* Called once by a member before its first chunk of a phase (per-member preparation). */
typedef void (*basert_phase_prologue_fn)(void *ctx, int phase, int member);

typedef struct {
    _Alignas(64) uint64_t claim; /* tag << 32 | chunks not yet claimed (claimed from the last down) */
    _Alignas(64) uint64_t done;  /* tag << 32 | chunks not yet done */
} basert_phase_counter;

/* Where a member's time in jobs went: waiting at phase boundaries (spinning or asleep), and in all. */
typedef struct {
    _Alignas(64) uint64_t wait_ns;
    uint64_t waits;
} basert_member_stats;

typedef struct basert_team {
    int n_threads;
    basert_member_stats stats[BASERT_TEAM_MAX_THREADS];
    uint64_t jobs, job_ns; /* jobs run and their wall time, as the caller saw it */
    pthread_t threads[BASERT_TEAM_MAX_THREADS];
    /* The job being run (valid while its tag is current). */
    void *ctx;
    basert_phase_fn fn;
    basert_phase_prologue_fn prologue;
    int n_phases;
    basert_phase_counter *counters; /* n_phases, 64-byte aligned */
    _Alignas(64) uint32_t tag;      /* current job; 0 before the first */
    _Alignas(64) uint32_t progress; /* futex word: bumped when a job starts, a phase completes, or the team stops */
    _Alignas(64) int32_t sleepers;
    int stop;
    int started; /* workers created */
} basert_team;

static inline uint64_t bt_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static inline void bt_pause(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static inline void bt_futex_wait(uint32_t *word, uint32_t seen) {
    syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
}

static inline void bt_futex_wake_all(uint32_t *word) { syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0); }

/* Bump the progress word and wake whoever sleeps on it. */
static inline void bt_announce(basert_team *t) {
    __atomic_fetch_add(&t->progress, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&t->sleepers, __ATOMIC_SEQ_CST) > 0) bt_futex_wake_all(&t->progress);
}

/* Wait until ready(t, arg) holds: spin for spin_ns, then sleep on the progress word between checks.
 * Returns when the wait began (0 when it was not needed). */
static inline uint64_t bt_wait(basert_team *t, int (*ready)(basert_team *, const void *), const void *arg, uint64_t spin_ns) {
    if (ready(t, arg)) return 0;
    const uint64_t began = bt_now_ns(), deadline = began + spin_ns;
    for (unsigned i = 1;; i++) {
        bt_pause();
        if (ready(t, arg)) return began;
        if ((i & 63) == 0 && bt_now_ns() > deadline) break;
    }
    for (;;) {
        __atomic_fetch_add(&t->sleepers, 1, __ATOMIC_SEQ_CST);
        uint32_t seen = __atomic_load_n(&t->progress, __ATOMIC_SEQ_CST);
        if (ready(t, arg)) {
            __atomic_fetch_sub(&t->sleepers, 1, __ATOMIC_SEQ_CST);
            return began;
        }
        bt_futex_wait(&t->progress, seen);
        __atomic_fetch_sub(&t->sleepers, 1, __ATOMIC_SEQ_CST);
        if (ready(t, arg)) return began;
    }
}

/* A wait at a phase boundary, counted in the member's stats. */
static inline void bt_wait_phase(basert_team *t, int member, int (*ready)(basert_team *, const void *), const void *arg) {
    const uint64_t began = bt_wait(t, ready, arg, BASERT_TEAM_SPIN_NS);
    if (began) {
        t->stats[member].wait_ns += bt_now_ns() - began;
        t->stats[member].waits++;
    }
}

typedef struct {
    uint32_t tag;
    int phase;
} bt_phase_ref;

/* The phase is complete, or the job it belongs to is over. */
static int bt_phase_finished(basert_team *t, const void *arg) {
    const bt_phase_ref *ref = (const bt_phase_ref *)arg;
    uint64_t v = __atomic_load_n(&t->counters[ref->phase].done, __ATOMIC_ACQUIRE);
    return (uint32_t)(v >> 32) != ref->tag || (uint32_t)v == 0;
}

/* Walk the job tagged `tag` as member `member`; returns early when that job is over. */
static void bt_walk(basert_team *t, uint32_t tag, int member) {
    const int n_phases = t->n_phases;
    for (int p = 0; p < n_phases; p++) {
        if (p > 0) {
            bt_phase_ref ref = {tag, p - 1};
            bt_wait_phase(t, member, bt_phase_finished, &ref);
        }
        basert_phase_counter *c = &t->counters[p];
        int prepared = 0;
        for (;;) {
            uint64_t v = __atomic_load_n(&c->claim, __ATOMIC_ACQUIRE);
            if ((uint32_t)(v >> 32) != tag) return;
            if ((uint32_t)v == 0) break;
            if (!__atomic_compare_exchange_n(&c->claim, &v, v - 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) continue;
            /* The claim succeeded with this job's tag, so the job is still running: its ctx is current. */
            if (!prepared && t->prologue) t->prologue(t->ctx, p, member);
            prepared = 1;
            t->fn(t->ctx, p, (int)((uint32_t)v - 1), member);
            uint64_t after = __atomic_sub_fetch(&c->done, 1, __ATOMIC_ACQ_REL);
            if ((uint32_t)after == 0) bt_announce(t);
        }
    }
}

typedef struct {
    basert_team *team;
    int member;
} bt_worker_arg;

static int bt_job_changed(basert_team *t, const void *arg) {
    return __atomic_load_n(&t->tag, __ATOMIC_ACQUIRE) != *(const uint32_t *)arg || __atomic_load_n(&t->stop, __ATOMIC_ACQUIRE);
}

static void *bt_worker(void *p) {
    bt_worker_arg arg = *(bt_worker_arg *)p;
    free(p);
    basert_team *t = arg.team;
    uint32_t last = 0;
    for (;;) {
        bt_wait(t, bt_job_changed, &last, BASERT_TEAM_IDLE_SPIN_NS);
        if (__atomic_load_n(&t->stop, __ATOMIC_ACQUIRE)) return NULL;
        last = __atomic_load_n(&t->tag, __ATOMIC_ACQUIRE);
        bt_walk(t, last, arg.member);
    }
}

/* A team of n_threads members (the caller counts as one); NULL without memory or threads. */
static basert_team *basert_team_new(int n_threads) {
    if (n_threads < 1) n_threads = 1;
    if (n_threads > BASERT_TEAM_MAX_THREADS) n_threads = BASERT_TEAM_MAX_THREADS;
    basert_team *t = (basert_team *)aligned_alloc(64, (sizeof(basert_team) + 63) & ~(size_t)63);
    if (!t) return NULL;
    memset(t, 0, sizeof *t);
    t->counters = (basert_phase_counter *)aligned_alloc(64, sizeof(basert_phase_counter) * BASERT_TEAM_MAX_PHASES);
    if (!t->counters) {
        free(t);
        return NULL;
    }
    memset(t->counters, 0, sizeof(basert_phase_counter) * BASERT_TEAM_MAX_PHASES);
    t->n_threads = n_threads;
    for (int i = 1; i < n_threads; i++) {
        bt_worker_arg *arg = (bt_worker_arg *)malloc(sizeof *arg);
        if (!arg) break;
        arg->team = t;
        arg->member = i;
        if (pthread_create(&t->threads[i], NULL, bt_worker, arg) != 0) {
            free(arg);
            break;
        }
        t->started = i;
    }
    t->n_threads = t->started + 1;
    return t;
}

static void basert_team_free(basert_team *t) {
    if (!t) return;
    __atomic_store_n(&t->stop, 1, __ATOMIC_RELEASE);
    bt_announce(t);
    for (int i = 1; i <= t->started; i++) pthread_join(t->threads[i], NULL);
    free(t->counters);
    free(t);
}

/* Run a job of n_phases phases (chunks[p] chunks each; phase p starts when p - 1 is complete) on the
 * team; the caller takes part as member 0 and returns when the last phase is complete. Not reentrant:
 * one job at a time per team. */
static void basert_team_run(basert_team *t, void *ctx, basert_phase_fn fn, basert_phase_prologue_fn prologue,
                            int n_phases, const int32_t *chunks) {
    if (n_phases <= 0) return;
    const uint64_t began = bt_now_ns();
    uint32_t tag = t->tag + 1;
    if (tag == 0) tag = 1;
    t->ctx = ctx;
    t->fn = fn;
    t->prologue = prologue;
    t->n_phases = n_phases;
    for (int p = 0; p < n_phases; p++) {
        const uint64_t start = (uint64_t)tag << 32 | (uint32_t)(chunks[p] > 0 ? chunks[p] : 0);
        __atomic_store_n(&t->counters[p].claim, start, __ATOMIC_RELAXED);
        __atomic_store_n(&t->counters[p].done, start, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&t->tag, tag, __ATOMIC_SEQ_CST);
    if (t->n_threads > 1) bt_announce(t);
    bt_walk(t, tag, 0);
    bt_phase_ref last = {tag, n_phases - 1};
    bt_wait_phase(t, 0, bt_phase_finished, &last);
    t->jobs++;
    t->job_ns += bt_now_ns() - began;
}

#endif
