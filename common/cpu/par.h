/* The CPU backend's thread pool (common/cpu/par.c): one small set of
 * helper threads that every CPU kernel shares, never a thread per call.
 *
 * A kernel cuts its work into chunks of a FIXED size (a constant of the
 * kernel, never derived from the thread count): chunk k is the range
 * [k * grain, min((k + 1) * grain, n)). Each chunk writes its own part of
 * the output, or its own partial result that the caller then combines in
 * chunk order, so the result is the same bits whether one thread ran
 * every chunk or sixteen shared them, on any machine: LOCAL and REMOTE
 * agree, and so do a 2-core laptop and a 64-core server.
 *
 * The caller runs chunks too, and waits only for chunks a helper has
 * already taken; a pool that is busy with another caller's job (two
 * server workers at once), or has no helpers, leaves every chunk to the
 * caller. Chunk functions run on other threads: they must not touch the
 * ctx other than through dsp__poll / dsp_ctx_cancelled, set no error and
 * allocate nothing (the caller allocates scratch, per lane, beforehand).
 *
 * Threads: DISPATCH_CPU_THREADS (1 to 256) when set, else the CPUs this
 * process may run on; the caller is one of them, so a 2-core machine has
 * one helper. The helpers start at the first job with more than one
 * chunk, spin for a few tens of microseconds after a job (the next
 * kernel usually follows at once), then sleep on a condition variable. */
#ifndef DSP_CPU_PAR_H
#define DSP_CPU_PAR_H

#include "dsp_internal.h"

/* One chunk: [lo, hi) of the kernel's range, run on lane `lane` (0 the
 * caller, 1.. the helpers; below dsp__par_lanes). 0, or non-zero to stop
 * the job (cancelled: no chunk not yet started runs). */
typedef int (*dsp_par_fn)(void *arg, int64_t lo, int64_t hi, int lane);

/* Runs fn over [0, n) in chunks of `grain` (>= 1). 0 when every chunk
 * ran and returned 0; 1 when the ctx was cancelled before a chunk or a
 * chunk returned non-zero (some chunks then did not run). */
int dsp__par_for(dsp_ctx *ctx, int64_t n, int64_t grain, dsp_par_fn fn,
                 void *arg);

/* How many lanes a dsp__par_for over `chunks` chunks may use: the size of
 * a per-lane scratch array (at least 1, at most chunks when chunks >= 1).
 * Starts the pool when it is not started yet, so that the count does not
 * change between this call and the job. */
int dsp__par_lanes(int64_t chunks);

/* At most n threads (the caller included) for the jobs that start from
 * now on; 0 lifts the cap. The pool's size stays what it is. For tests
 * and benchmarks that compare thread counts in one process. */
void dsp__par_set_threads(int n);

/* Makes OpenBLAS single-threaded again if something set it otherwise: the
 * pool is the backend's only parallelism, BLAS runs inside its chunks
 * (OpenBLAS's own threads cut a product by their number, which changes
 * the rounding). Kernels call it before their BLAS calls; the pool's start
 * does it too. */
void dsp__par_blas_single(void);

/* Number of chunks of [0, n) in steps of grain. */
static inline int64_t dsp__par_nchunks(int64_t n, int64_t grain) {
  return n <= 0 ? 0 : (n + grain - 1) / grain;
}

#endif
