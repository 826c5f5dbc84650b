/* Strided iteration for CPU kernels: walks an output in row-major order
 * while tracking the element offset of up to 3 operands, each with its own
 * element strides (0 on a broadcast dim, permuted strides for permute).
 *
 * Dims of size 1 are dropped and neighbouring dims that are contiguous for
 * every operand are merged, so [2,3]+[3] becomes 2 rows of 3 and a
 * same-shape op becomes one row. Kernels then run a tight loop over the
 * innermost (merged) dim and call dsp__iter_step once per row. Merging never
 * changes the order in which output elements are visited, so results do not
 * depend on it. */
#ifndef DSP_KERN_ITER_H
#define DSP_KERN_ITER_H

#include "dsp.h"

#define DSP_ITER_MAX_OPS 3

typedef struct dsp_iter {
  int nd; /* >= 1 after init */
  int n;  /* operands */
  int64_t shape[DSP_MAX_DIMS];
  int64_t st[DSP_ITER_MAX_OPS][DSP_MAX_DIMS];
  int64_t inner; /* shape[nd - 1] */
  int64_t rows;  /* product of the other dims */
} dsp_iter;

/* Operands broadcast to `out` (numpy rules, already checked by infer): each
 * in[k] is aligned to out's trailing dims and gets stride 0 where its size
 * is 1 or the dim is missing. */
void dsp__iter_bcast(dsp_iter *it, const dsp_meta *out,
                     const dsp_meta *const *in, int n);

/* Explicit strides: shape has nd dims, st[k][d] is operand k's element
 * stride along output dim d. */
void dsp__iter_strided(dsp_iter *it, int nd, const int64_t *shape,
                       int64_t st[][DSP_MAX_DIMS], int n);

/* Row-major element strides of a contiguous tensor of meta m. */
void dsp__contig_strides(const dsp_meta *m, int64_t *st);

/* Advances idx (the row index over dims 0..nd-2) by one row and moves the
 * operand offsets `off` with it. */
static inline void dsp__iter_step(const dsp_iter *it, int64_t *idx,
                                  int64_t *off) {
  for (int d = it->nd - 2; d >= 0; d--) {
    idx[d]++;
    for (int k = 0; k < it->n; k++) off[k] += it->st[k][d];
    if (idx[d] < it->shape[d]) return;
    for (int k = 0; k < it->n; k++) off[k] -= it->st[k][d] * it->shape[d];
    idx[d] = 0;
  }
}

/* Sets idx and off to where row `row` (0 <= row < it->rows) starts, as
 * if dsp__iter_step had been called `row` times from zero: a chunk of rows
 * starts there without walking the rows before it. */
static inline void dsp__iter_seek(const dsp_iter *it, int64_t row,
                                  int64_t *idx, int64_t *off) {
  for (int k = 0; k < it->n; k++) off[k] = 0;
  for (int d = it->nd - 2; d >= 0; d--) {
    idx[d] = row % it->shape[d];
    row /= it->shape[d];
    for (int k = 0; k < it->n; k++) off[k] += idx[d] * it->st[k][d];
  }
}

#endif
