/* Host-side plans of the CUDA kernels: which element of each operand the
 * flat index i of a kernel touches, and how a reduction splits its input.
 * Shared by the backend (the op files of common/cuda/) and by
 * tests/test_cuda_host.c, which replays the kernels on the host with these
 * plans and the math of cuda_math.h and compares with the CPU kernels.
 * Plain C (gcc only); every plan comes from the CPU's own iterator
 * (kern_iter.h), so both backends agree on the walk by construction. */
#ifndef DSP_CUDA_PLAN_H
#define DSP_CUDA_PLAN_H

#include <string.h>

#include "cuda_math.h"
#include "ops_plan.h"
#include "cpu/kern_iter.h"

static inline void dsp__cu_ix_from_iter(dsp__cu_index *ix, const dsp_iter *it) {
  memset(ix, 0, sizeof *ix);
  ix->nd = it->nd;
  ix->n = it->n;
  for (int d = 0; d < it->nd; d++) {
    ix->shape[d] = it->shape[d];
    for (int k = 0; k < it->n; k++) ix->st[k][d] = it->st[k][d];
  }
}

/* n inputs broadcast to out (binary ops, comparisons, where, broadcast_to) */
static inline void dsp__cu_plan_bcast(dsp__cu_index *ix, const dsp_meta *out,
                                      const dsp_meta *const *in, int n) {
  dsp_iter it;
  dsp__iter_bcast(&it, out, in, n);
  dsp__cu_ix_from_iter(ix, &it);
}

static inline void dsp__cu_plan_strided(dsp__cu_index *ix, int nd,
                                        const int64_t *shape,
                                        int64_t st[][DSP_MAX_DIMS], int n) {
  dsp_iter it;
  dsp__iter_strided(&it, nd, shape, st, n);
  dsp__cu_ix_from_iter(ix, &it);
}

/* Reduction of x over the dims marked in red[]: output element o reads
 * x[outer(o) + inner(r)] for r < *R, r in row-major order of the reduced
 * dims (the order argmax's ties refer to). */
static inline void dsp__cu_plan_red(const dsp_meta *x, const int *red,
                                    dsp__cu_index *outer, dsp__cu_index *inner,
                                    int64_t *R) {
  int64_t cs[DSP_MAX_DIMS], osh[DSP_MAX_DIMS], ish[DSP_MAX_DIMS];
  int64_t ost[1][DSP_MAX_DIMS], ist[1][DSP_MAX_DIMS];
  int no = 0, ni = 0;
  *R = 1;
  dsp__contig_strides(x, cs);
  for (int d = 0; d < x->ndim; d++) {
    if (red[d]) {
      ish[ni] = x->shape[d], ist[0][ni++] = cs[d];
      *R *= x->shape[d];
    } else {
      osh[no] = x->shape[d], ost[0][no++] = cs[d];
    }
  }
  dsp__cu_plan_strided(outer, no, osh, ost, 1);
  dsp__cu_plan_strided(inner, ni, ish, ist, 1);
}

/* permute/transpose: out element i reads x at off0(i) */
static inline void dsp__cu_plan_perm(dsp__cu_index *ix, const dsp_meta *x,
                                     const int *perm, const dsp_meta *out) {
  int64_t cs[DSP_MAX_DIMS], st[1][DSP_MAX_DIMS];
  dsp__contig_strides(x, cs);
  for (int d = 0; d < x->ndim; d++) st[0][d] = cs[perm[d]];
  dsp__cu_plan_strided(ix, out->ndim, out->shape, st, 1);
}

/* slice of `big` along dim (start s0, step): element i of the small
 * tensor is big[*base + off0(i)] */
static inline void dsp__cu_plan_slice(dsp__cu_index *ix, const dsp_meta *big,
                                      const dsp_meta *small, int dim,
                                      int64_t s0, int64_t step, int64_t *base) {
  int64_t cs[DSP_MAX_DIMS], st[1][DSP_MAX_DIMS];
  dsp__contig_strides(big, cs);
  for (int d = 0; d < big->ndim; d++) st[0][d] = cs[d];
  st[0][dim] = cs[dim] * step;
  *base = s0 * cs[dim];
  dsp__cu_plan_strided(ix, small->ndim, small->shape, st, 1);
}

/* cat/stack: element i of input `in` lands at out[*base + off0(i)]; pos is
 * the input's first index along dim (its number, for stack) */
static inline void dsp__cu_plan_cat(dsp__cu_index *ix, const dsp_meta *out,
                                    const dsp_meta *in, int dim, int stack,
                                    int64_t pos, int64_t *base) {
  int64_t cs[DSP_MAX_DIMS], st[1][DSP_MAX_DIMS];
  dsp__contig_strides(out, cs);
  for (int d = 0; d < in->ndim; d++) st[0][d] = cs[stack && d >= dim ? d + 1 : d];
  *base = pos * cs[dim];
  dsp__cu_plan_strided(ix, in->ndim, in->shape, st, 1);
}

/* matmul a @ b (numpy rules, already checked by infer): sizes m, k, n and
 * the broadcast batch walk; batch entry j of the output (row-major) uses
 * matrix off0(j) of a and off1(j) of b. */
static inline void dsp__cu_plan_matmul(const dsp_meta *ma, const dsp_meta *mb,
                                       int64_t *m, int64_t *k, int64_t *n,
                                       dsp__cu_index *ix) {
  *m = ma->ndim == 1 ? 1 : ma->shape[ma->ndim - 2];
  *k = ma->shape[ma->ndim - 1];
  *n = mb->ndim == 1 ? 1 : mb->shape[mb->ndim - 1];
  int nba = ma->ndim > 2 ? ma->ndim - 2 : 0, nbb = mb->ndim > 2 ? mb->ndim - 2 : 0;
  int nbo = nba > nbb ? nba : nbb;
  int64_t bshape[DSP_MAX_DIMS], st[2][DSP_MAX_DIMS], sa = 1, sb = 1;
  for (int d = nbo - 1; d >= 0; d--) {
    int da = d - (nbo - nba), db = d - (nbo - nbb);
    int64_t za = da >= 0 ? ma->shape[da] : 1, zb = db >= 0 ? mb->shape[db] : 1;
    bshape[d] = za > zb ? za : zb;
    st[0][d] = za == 1 ? 0 : sa;
    st[1][d] = zb == 1 ? 0 : sb;
    sa *= za, sb *= zb;
  }
  dsp__cu_plan_strided(ix, nbo, bshape, st, 2);
}

/* Geometry of conv2d and its backward ops, or of a pool op, from the
 * shared nn plan of inference (ops_plan.h: dsp__nn_plan), so the CUDA
 * kernels, the CPU kernels and inference agree on it by construction. 0 or
 * the plan's error (with the detail in ctx). */
static inline int dsp__cu_plan_nn(dsp_ctx *ctx, dsp_opcode op,
                                  const dsp_meta *in, int n_in,
                                  const dsp_attrs *a, dsp__cu_geo *g) {
  dsp_conv_geo cg;
  dsp_pool_geo pg;
  dsp_meta om;
  memset(&cg, 0, sizeof cg), memset(&pg, 0, sizeof pg);
  int rc = dsp__nn_plan(ctx, op, in, n_in, a, &om, &cg, &pg);
  if (rc < 0) return rc;
  memset(g, 0, sizeof *g);
  if (op == DSP_OP_CONV2D || op == DSP_OP_CONV2D_BIAS ||
      op == DSP_OP_CONV2D_BACKWARD_INPUT ||
      op == DSP_OP_CONV2D_BACKWARD_WEIGHT) {
    g->N = cg.N, g->C = cg.C, g->H = cg.H, g->W = cg.W, g->O = cg.O;
    g->KH = cg.KH, g->KW = cg.KW, g->OH = cg.OH, g->OW = cg.OW;
    g->sh = cg.sh, g->sw = cg.sw, g->ph = cg.ph, g->pw = cg.pw;
    g->dh = cg.dh, g->dw = cg.dw;
  } else {
    g->N = pg.N, g->C = g->O = pg.C, g->H = pg.H, g->W = pg.W;
    g->KH = pg.KH, g->KW = pg.KW, g->OH = pg.OH, g->OW = pg.OW;
    g->sh = pg.sh, g->sw = pg.sw, g->ph = pg.ph, g->pw = pg.pw;
    g->dh = g->dw = 1;
    g->exclude_pad = pg.exclude_pad;
  }
  return 0;
}

/* index_select_backward's rows by destination: a counting sort of the L
 * (checked) indices into start[0..S] and ks[0..L), ks listing for each s
 * the positions k with ix[k] == s in increasing order, so a gather adds
 * them in the CPU's order. */
static inline void dsp__cu_csr_build(const int64_t *ix, int64_t L, int64_t S,
                                     int64_t *start, int64_t *ks) {
  memset(start, 0, sizeof(int64_t) * (size_t)(S + 1));
  for (int64_t k = 0; k < L; k++) start[ix[k] + 1]++;
  for (int64_t s = 0; s < S; s++) start[s + 1] += start[s];
  for (int64_t k = 0; k < L; k++) ks[start[ix[k]]++] = k;
  for (int64_t s = S; s > 0; s--) start[s] = start[s - 1];
  start[0] = 0;
}

static inline int64_t dsp__cu_prod(const int64_t *s, int from, int to) {
  int64_t p = 1;
  for (int i = from; i < to; i++) p *= s[i];
  return p;
}

#endif
