/* A dsp allocator for tests: fails the N-th allocation (malloc or realloc)
 * after installation and counts live blocks, so a test can walk every
 * allocation of a code path, check each failure comes back as
 * DISPATCH_ENOMEM, and check nothing leaked afterwards. */
#ifndef FAILALLOC_H
#define FAILALLOC_H

/* Installs the allocator with dsp_set_allocator and resets the counters.
 * fail_at = N > 0 fails only the N-th allocation; 0 never fails. Install it
 * only while no dsp memory is live (the live count starts at zero). */
void failalloc_install(long fail_at);
/* Restores the default allocator. */
void failalloc_remove(void);
/* Allocations attempted since installation (including the failed one). */
long failalloc_count(void);
/* Blocks allocated through it and not yet freed. */
long failalloc_live(void);
/* How many allocations it made fail (0 or 1). */
long failalloc_failed(void);

/* Walks every allocation of one op: for N = 1, 2, ... it installs the
 * allocator failing the N-th allocation, makes a ctx and zeroed inputs of
 * the given metas, runs op with attrs a, and asserts (Criterion) that the
 * run fails with DISPATCH_ENOMEM and a NULL output, or succeeds, and that
 * nothing is left allocated afterwards. Stops at the first success and
 * returns how many runs failed with DISPATCH_ENOMEM. */
struct dsp_meta;
struct dsp_attrs;
int failalloc_walk_op(int op, int n_in, const struct dsp_meta *in,
                      const struct dsp_attrs *a);

#endif
