/* Strided iteration setup: drop size-1 dims, merge contiguous ones. */
#include "kern_iter.h"

#include <string.h>

void dsp__contig_strides(const dsp_meta *m, int64_t *st) {
  int64_t s = 1;
  for (int d = m->ndim - 1; d >= 0; d--) {
    st[d] = s;
    s *= m->shape[d];
  }
}

void dsp__iter_strided(dsp_iter *it, int nd, const int64_t *shape,
                       int64_t st[][DSP_MAX_DIMS], int n) {
  memset(it, 0, sizeof *it);
  it->n = n;
  /* an empty iteration visits nothing: no rows, whatever the other dims
   * are (dsp_op skips empty outputs; this keeps any other caller from
   * walking the rows of a [2^40, 0] shape) */
  for (int d = 0; d < nd; d++)
    if (shape[d] == 0) {
      it->nd = 1;
      return; /* shape[0], inner and rows stay 0 */
    }
  int m = 0;
  for (int d = 0; d < nd; d++) {
    if (shape[d] == 1) continue; /* visits one element: stride irrelevant */
    int merge = m > 0;
    for (int k = 0; k < n && merge; k++)
      merge = it->st[k][m - 1] == st[k][d] * shape[d];
    if (merge) {
      it->shape[m - 1] *= shape[d];
      for (int k = 0; k < n; k++) it->st[k][m - 1] = st[k][d];
    } else {
      it->shape[m] = shape[d];
      for (int k = 0; k < n; k++) it->st[k][m] = st[k][d];
      m++;
    }
  }
  if (m == 0) {
    it->shape[0] = 1;
    m = 1;
  }
  it->nd = m;
  it->inner = it->shape[m - 1];
  it->rows = 1;
  for (int d = 0; d < m - 1; d++) it->rows *= it->shape[d];
}

void dsp__iter_bcast(dsp_iter *it, const dsp_meta *out,
                     const dsp_meta *const *in, int n) {
  int64_t st[DSP_ITER_MAX_OPS][DSP_MAX_DIMS];
  for (int k = 0; k < n; k++) {
    int64_t cs[DSP_MAX_DIMS];
    dsp__contig_strides(in[k], cs);
    for (int d = 0; d < out->ndim; d++) {
      int dk = in[k]->ndim - out->ndim + d;
      st[k][d] = (dk >= 0 && in[k]->shape[dk] != 1) ? cs[dk] : 0;
    }
  }
  dsp__iter_strided(it, out->ndim, out->shape, st, n);
}
