/* Fused scaled dot-product attention on the CPU, forward and backward
 * (inference: common/ops_attn.c).
 *
 *   out = softmax(scale q k^T + mask) v     per (batch, head)
 *
 * Conventions (the same on every backend):
 * - causal is top-left aligned: query i sees keys j <= i, as
 *   torch.tril(ones(Tq, Tk)) and F.scaled_dot_product_attention(
 *   is_causal=True) of PyTorch 2 (torch 1.13 has only the private
 *   F._scaled_dot_product_attention, whose is_causal is the same:
 *   python/tests/test_ops.py checks it); with Tq > Tk the last queries see
 *   every key.
 * - key_mask [B, Tk] (true = attend) drops keys for every head and query
 *   of its batch entry.
 * - A query that sees no key at all (every key masked, or Tk = 0) gets an
 *   output row of 0 and contributes 0 to every gradient. PyTorch gives NaN
 *   there (a softmax over nothing); the composition with a -inf mask in
 *   dispatch does too.
 *
 * Blocked, never a [Tq, Tk] matrix per head: the queries of a head go in
 * blocks of DSP_ATTN_QBLOCK (64) rows; for each block the scores of the
 * keys its last row sees (all Tk, or fewer under causal) are one BLAS
 * gemm, the row softmax is exact (row max, then the sum of exponentials,
 * in double), and P v is a second gemm straight into the output. Extra
 * memory, charged to the ctx's budget for the op's duration: forward
 * min(64, Tq) * Tk elements of the dtype (the block's scores, turned into
 * P in place); backward twice that (P and dP). Nothing is kept between
 * the forward and the backward: the backward recomputes each block's
 * scores and softmax, takes D_i = sum_j P_ij dP_ij (= dO_i . O_i) from the
 * block itself, and accumulates dk and dv over the query blocks in a
 * fixed order. f32 runs sgemm with f32 scratch and the softmax in double;
 * f64 dgemm. Results depend only on the inputs (fixed block order, one
 * gemm per product), so runs are bit-identical; the (batch, head) pairs
 * are shared out to the backend's threads (par.h), one scratch per
 * thread (so the extra memory above is per thread running the op), and a
 * head's result does not depend on which thread ran it. */
#include <cblas.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu.h"
#include "ops_plan.h"
#include "par.h"

/* C[m,n] = alpha op(A) op(B) + beta C (beta 0 or 1), row-major, in the
 * dtype (f64: double). An empty k gives beta C, so no BLAS call ever sees
 * a zero leading dimension. */
static void gemm(int f64, int ta, int tb, int m, int n, int k, double alpha,
                 const void *A, const void *B, double beta, void *C) {
  if (m == 0 || n == 0) return;
  if (k == 0) {
    if (beta == 0.0) memset(C, 0, (size_t)m * (size_t)n * (f64 ? 8u : 4u));
    return;
  }
  const int lda = ta ? m : k, ldb = tb ? k : n;
  const CBLAS_TRANSPOSE oa = ta ? CblasTrans : CblasNoTrans,
                        ob = tb ? CblasTrans : CblasNoTrans;
  if (f64)
    cblas_dgemm(CblasRowMajor, oa, ob, m, n, k, alpha, A, lda, B, ldb, beta,
                C, n);
  else
    cblas_sgemm(CblasRowMajor, oa, ob, m, n, k, (float)alpha, A, lda, B, ldb,
                (float)beta, C, n);
}

/* One head's operands and the block scratch. */
typedef struct attn_head {
  const dsp_attn_geo *g;
  int f64;
  size_t es;
  const char *q, *k, *v, *dout; /* this head's rows */
  const uint8_t *mask;          /* this batch entry's Tk flags, or NULL */
  char *S, *dP;                 /* [qb, nc] each */
} attn_head;

static int sees(const attn_head *h, int64_t j) {
  return !h->mask || h->mask[j];
}

/* Rows i0 .. i0+qb-1 of the scores S [qb, nc] become their softmax P over
 * the keys each row sees, 0 elsewhere; a row that sees none is all 0. */
static void block_softmax(const attn_head *h, int64_t i0, int qb, int nc) {
  for (int r = 0; r < qb; r++) {
    void *row = h->S + (size_t)r * (size_t)nc * h->es;
    int64_t ni = dsp__attn_nkeys(h->g, i0 + r);
    double mx = -INFINITY, s = 0.0;
    int any = 0;
    for (int64_t j = 0; j < ni; j++)
      if (sees(h, j)) {
        double v = dsp__ld(row, h->f64, j);
        if (!any || v > mx || isnan(v)) mx = v;
        any = 1;
      }
    if (isinf(mx) && mx < 0) mx = 0.0; /* as softmax: keep exp defined */
    for (int64_t j = 0; j < nc; j++) {
      double e = any && j < ni && sees(h, j)
                     ? exp(dsp__ld(row, h->f64, j) - mx)
                     : 0.0;
      s += e;
      dsp__st(row, h->f64, j, e);
    }
    double inv = any ? 1.0 / s : 0.0;
    for (int64_t j = 0; j < nc; j++)
      dsp__st(row, h->f64, j, dsp__ld(row, h->f64, j) * inv);
  }
}

/* The block's P in h->S: scores by gemm, then the masked row softmax. */
static void block_probs(const attn_head *h, int64_t i0, int qb, int nc) {
  const dsp_attn_geo *g = h->g;
  gemm(h->f64, 0, 1, qb, nc, (int)g->d, g->scale,
       h->q + (size_t)(i0 * g->d) * h->es, h->k, 0.0, h->S);
  block_softmax(h, i0, qb, nc);
}

/* Forward of one head into o [Tq, dv]. */
static int head_forward(dsp_ctx *ctx, const attn_head *h, char *o,
                        int64_t *pw) {
  const dsp_attn_geo *g = h->g;
  for (int64_t i0 = 0; i0 < g->Tq; i0 += DSP_ATTN_QBLOCK) {
    int qb = (int)(g->Tq - i0 < DSP_ATTN_QBLOCK ? g->Tq - i0 : DSP_ATTN_QBLOCK);
    int nc = (int)dsp__attn_nkeys(g, i0 + qb - 1);
    if (dsp__poll(ctx, pw, (int64_t)qb * (nc + 1) * (g->d + g->dv + 3)))
      return 1;
    block_probs(h, i0, qb, nc);
    gemm(h->f64, 0, 0, qb, (int)g->dv, nc, 1.0, h->S, h->v, 0.0,
         o + (size_t)(i0 * g->dv) * h->es);
  }
  return 0;
}

/* dS = P (dP - D) in place of dP, D_i = sum_j P_ij dP_ij; masked entries
 * have P = 0, so their dS is 0. */
static void block_dscores(const attn_head *h, int qb, int nc) {
  for (int r = 0; r < qb; r++) {
    const void *p = h->S + (size_t)r * (size_t)nc * h->es;
    void *dp = h->dP + (size_t)r * (size_t)nc * h->es;
    double D = 0.0;
    for (int64_t j = 0; j < nc; j++)
      D += dsp__ld(p, h->f64, j) * dsp__ld(dp, h->f64, j);
    for (int64_t j = 0; j < nc; j++)
      dsp__st(dp, h->f64, j,
              dsp__ld(p, h->f64, j) * (dsp__ld(dp, h->f64, j) - D));
  }
}

/* Backward of one head: dq [Tq, d] written, dk [Tk, d] and dv [Tk, dv]
 * set to the sum over the query blocks. */
static int head_backward(dsp_ctx *ctx, const attn_head *h, char *dq, char *dk,
                         char *dv, int64_t *pw) {
  const dsp_attn_geo *g = h->g;
  memset(dk, 0, (size_t)(g->Tk * g->d) * h->es);
  memset(dv, 0, (size_t)(g->Tk * g->dv) * h->es);
  for (int64_t i0 = 0; i0 < g->Tq; i0 += DSP_ATTN_QBLOCK) {
    int qb = (int)(g->Tq - i0 < DSP_ATTN_QBLOCK ? g->Tq - i0 : DSP_ATTN_QBLOCK);
    int nc = (int)dsp__attn_nkeys(g, i0 + qb - 1);
    if (dsp__poll(ctx, pw, (int64_t)qb * (nc + 1) * (3 * g->d + 2 * g->dv + 4)))
      return 1;
    const char *qi = h->q + (size_t)(i0 * g->d) * h->es;
    const char *doi = h->dout + (size_t)(i0 * g->dv) * h->es;
    block_probs(h, i0, qb, nc);
    gemm(h->f64, 0, 1, qb, nc, (int)g->dv, 1.0, doi, h->v, 0.0, h->dP);
    block_dscores(h, qb, nc);
    gemm(h->f64, 0, 0, qb, (int)g->d, nc, g->scale, h->dP, h->k, 0.0,
         dq + (size_t)(i0 * g->d) * h->es);
    gemm(h->f64, 1, 0, nc, (int)g->d, qb, g->scale, h->dP, qi, 1.0, dk);
    gemm(h->f64, 1, 0, nc, (int)g->dv, qb, 1.0, h->S, doi, 1.0, dv);
  }
  return 0;
}

/* The heads are independent: chunks of ATTN_GRAIN (batch, head) pairs go
 * to the backend's threads (par.h), each with its own lane of scratch, and
 * a head's arithmetic is the same whichever thread runs it. */
#define ATTN_GRAIN 1

typedef struct attn_job {
  dsp_ctx *ctx; /* for dsp__poll only */
  attn_head h; /* geometry and dtype; the head's pointers are per chunk */
  int bw;
  const char *Q, *K, *V, *G;
  const uint8_t *M;
  char *o, *dk0, *dv0, *scratch;
  size_t qs, ks, vs, os, blk, lane_bytes;
} attn_job;

static int attn_chunk(void *arg, int64_t lo, int64_t hi, int lane) {
  const attn_job *j = arg;
  const dsp_attn_geo *g = j->h.g;
  attn_head h = j->h;
  h.S = j->scratch + (size_t)lane * j->lane_bytes;
  h.dP = j->bw ? h.S + j->blk : NULL;
  int64_t pw = 0;
  for (int64_t bh = lo; bh < hi; bh++) {
    h.q = j->Q + (size_t)bh * j->qs, h.k = j->K + (size_t)bh * j->ks;
    h.v = j->V + (size_t)bh * j->vs;
    h.mask = j->M ? j->M + (size_t)((bh / g->H) * g->Tk) : NULL;
    int stop;
    if (!j->bw) {
      stop = head_forward(j->ctx, &h, j->o + (size_t)bh * j->os, &pw);
    } else {
      h.dout = j->G + (size_t)bh * j->os;
      stop = head_backward(j->ctx, &h, j->o + (size_t)bh * j->qs,
                           j->dk0 + (size_t)bh * j->ks,
                           j->dv0 + (size_t)bh * j->vs, &pw);
    }
    if (stop) return 1;
  }
  return 0;
}

int dsp__cpu_attn(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in,
                  int n_in, const dsp_attrs *a, dsp_tensor *out) {
  dsp_meta metas[DSP_MAX_INPUTS], om;
  dsp_attn_geo g;
  if (n_in < 1 || n_in > 5)
    return dsp__no_kernel(ctx, op, in, n_in, out);
  for (int i = 0; i < n_in; i++) metas[i] = in[i]->meta;
  int rc = dsp__attn_plan(ctx, op, metas, n_in, a, &om, &g);
  if (rc < 0) return rc;
  const int bw = op == DSP_OP_ATTENTION_BACKWARD;
  const dsp_dtype dt = in[bw]->meta.dtype;
  if (dt != DSP_F32 && dt != DSP_F64)
    return dsp__no_kernel(ctx, op, in, n_in, out);
  attn_job j = {.h = {.g = &g, .f64 = dt == DSP_F64, .es = dsp_dtype_size(dt)},
                .bw = bw, .ctx = ctx};
  const int64_t rows = g.Tq < DSP_ATTN_QBLOCK ? g.Tq : DSP_ATTN_QBLOCK;
  j.blk = (size_t)(rows * g.Tk) * j.h.es;
  j.lane_bytes = j.blk * (bw ? 2u : 1u);
  const int64_t nheads = g.B * g.H;
  dsp__par_blas_single();
  const int lanes = dsp__par_lanes(dsp__par_nchunks(nheads, ATTN_GRAIN));
  const size_t sn = j.lane_bytes * (size_t)lanes;
  void *scratch = NULL;
  if (sn && (rc = dsp__scratch_alloc(ctx, sn, "attention scores", &scratch)) < 0)
    return rc;
  j.scratch = scratch;
  j.Q = dsp_tensor_data(in[bw]), j.K = dsp_tensor_data(in[bw + 1]);
  j.V = dsp_tensor_data(in[bw + 2]);
  j.M = g.has_mask ? dsp_tensor_data(in[bw + 3]) : NULL;
  j.G = bw ? dsp_tensor_data(in[0]) : NULL;
  j.o = dsp_tensor_data(out);
  j.qs = (size_t)(g.Tq * g.d) * j.h.es, j.ks = (size_t)(g.Tk * g.d) * j.h.es;
  j.vs = (size_t)(g.Tk * g.dv) * j.h.es, j.os = (size_t)(g.Tq * g.dv) * j.h.es;
  j.dk0 = j.o + (size_t)nheads * j.qs;
  j.dv0 = j.dk0 + (size_t)nheads * j.ks;
  int stop = dsp__par_for(ctx, nheads, ATTN_GRAIN, attn_chunk, &j);
  if (scratch) dsp__scratch_free(ctx, scratch, sn);
  return stop ? dsp__cancelled_err(ctx, op) : 0;
}
