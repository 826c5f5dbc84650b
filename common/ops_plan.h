/* Internal to common/: the plans shape inference derives from an op's
 * metas and attributes, for every backend's kernels to reuse, so that
 * inference and each kernel agree on the geometry by construction.
 * Inference lives in common/ops_<family>.c; the CPU kernels in
 * common/cpu/<family>.c call the same functions (a kernel re-derives its
 * plan from the attributes rather than trusting a cached copy). */
#ifndef DSP_OPS_PLAN_H
#define DSP_OPS_PLAN_H

#include "dsp.h"

static inline const char *dsp__opname(dsp_opcode op) {
  const dsp_op_info *i = dsp_op_lookup((int)op);
  return i ? i->name : "?";
}

/* Op counts as integer constant expressions, for _Static_assert guards
 * beside every switch or table over ops (the ggml habit): a new row in
 * DSP_OP_MAP breaks the build wherever a decision about it is owed (a
 * kernel case, a support-table row, a backward rule), instead of falling
 * through to a default at run time. */
#define DSP__OPROW_ALL_(N, ...) +1
#define DSP__OP_COUNT (0 DSP_OP_MAP(DSP__OPROW_ALL_))
#define DSP__FAMROW_EW(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_EW)
#define DSP__FAMROW_RED(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_RED)
#define DSP__FAMROW_SHAPE(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_SHAPE)
#define DSP__FAMROW_LINALG(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_LINALG)
#define DSP__FAMROW_NN(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_NN)
#define DSP__FAMROW_CREATE(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_CREATE)
#define DSP__FAMROW_OPTIM(N, c, s, n, f, ...) +(DSP_FAM_##f == DSP_FAM_OPTIM)
#define DSP__OPS_IN_FAMILY(F) (0 DSP_OP_MAP(DSP__FAMROW_##F))

/* The dtype an op's kernels are chosen by, for support tables: the
 * output's for a creation op (it has no inputs), where's values (in[1])
 * rather than its bool mask, else the first input's (cross entropy's
 * logits or grad, index_select's data, cast's source). */
static inline dsp_dtype dsp__op_key_dtype(dsp_opcode op, const dsp_meta *in,
                                          int n_in, const dsp_meta *out) {
  if (n_in == 0) return out->dtype;
  if (op == DSP_OP_WHERE && n_in == 3) return in[1].dtype;
  return in[0].dtype;
}

/* ew: the classes of elementwise ops (codes are contiguous per class). */
static inline int dsp__ew_is_arith(dsp_opcode op) {
  return op >= DSP_OP_ADD && op <= DSP_OP_MINIMUM;
}
static inline int dsp__ew_is_cmp(dsp_opcode op) {
  return op >= DSP_OP_EQ && op <= DSP_OP_GE;
}
static inline int dsp__ew_is_scalar(dsp_opcode op) {
  return op >= DSP_OP_ADD_SCALAR && op <= DSP_OP_RDIV_SCALAR;
}

/* red: marks the reduced dims of a rank-nd input in red[] (all dims when
 * there are no ints); returns their count, or DISPATCH_EDIM. */
int dsp__red_dims(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int nd,
                  int *red);

/* linalg: the matrix view of one matmul operand. */
typedef struct dsp_mm_view {
  int nbatch;
  int64_t batch[DSP_MAX_DIMS];
  int64_t rows, cols;
} dsp_mm_view;
/* Validates matmul(a, b), computes the output meta and hands back the
 * operand views and the broadcast batch shape. */
int dsp__mm_plan(dsp_ctx *ctx, const dsp_meta *a, const dsp_meta *b,
                 dsp_mm_view *va, dsp_mm_view *vb, dsp_meta *bshape,
                 dsp_meta *out);

/* linalg: matmul's attributes, none (a @ b) or ints {ta, tb}, each 0 or
 * 1: op(a) @ op(b) with op(x) = x^T (its last two dims swapped, so a
 * flagged operand needs rank >= 2) where the flag is set. Checks them
 * (DISPATCH_EINVAL naming the bad value) and gives the flags and the
 * metas of op(a) and op(b), which dsp__mm_plan takes. */
int dsp__mm_attrs(dsp_ctx *ctx, const dsp_attrs *a, const dsp_meta *in,
                  int *ta, int *tb, dsp_meta eff[2]);

/* shape: {dim, start, end, step} against x: the normalised dim, first
 * index and length (python-style clamping). */
int dsp__slice_params(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *x,
                      const int64_t *ints, int *dim, int64_t *s0,
                      int64_t *len);
/* shape: perm[] of permute/transpose of a rank-nd tensor. */
int dsp__perm_params(dsp_ctx *ctx, dsp_opcode op, const dsp_attrs *a, int nd,
                     int *perm);

/* nn: conv2d(x [N,C,H,W], w [O,C,KH,KW]) -> [N,O,OH,OW]; every size has
 * been validated, and C*KH*KW, OH*OW and O fit in an int. */
typedef struct dsp_conv_geo {
  int64_t N, C, H, W, O, KH, KW, OH, OW;
  int64_t sh, sw, ph, pw, dh, dw;
} dsp_conv_geo;
/* nn: pool on [N,C,H,W] with a KHxKW window -> [N,C,OH,OW] */
typedef struct dsp_pool_geo {
  int64_t N, C, H, W, KH, KW, OH, OW;
  int64_t sh, sw, ph, pw;
} dsp_pool_geo;
/* nn: full validation of an nn op (as dsp__infer_nn) that also gives the
 * conv geometry (conv ops) or pool geometry (pool ops). */
int dsp__nn_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                 const dsp_attrs *a, dsp_meta *out, dsp_conv_geo *cg,
                 dsp_pool_geo *pg);

/* nn, issue 23 embedding/norm (common/ops_norm.c): embedding, layer_norm,
 * rms_norm and their backward ops. The nn files hand these ops to
 * ops_norm.c, cpu/norm.c and cuda/norm.c, so the family's static
 * assertions count them apart (DSP__N_NORM_OPS). */
static inline int dsp__is_norm_op(dsp_opcode op) {
  switch (op) {
    case DSP_OP_EMBEDDING:
    case DSP_OP_EMBEDDING_BACKWARD:
    case DSP_OP_LAYER_NORM:
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM:
    case DSP_OP_RMS_NORM_BACKWARD:
      return 1;
    default:
      return 0;
  }
}
#define DSP__N_NORM_OPS 6
/* The plan of an embedding/norm op. Embedding: rows = numel(idx), D the
 * row width, V the table's rows, pad the normalised padding index (-1:
 * none). Norms: rows x D is x viewed as [rows, D] (D = product of the
 * last nlast dims), has_w / has_b the affine inputs, centered 1 for
 * layer_norm (mean subtracted), 0 for rms_norm. */
typedef struct dsp_norm_geo {
  int64_t rows, D, V, pad;
  int has_w, has_b, centered;
  double eps;
} dsp_norm_geo;
/* Full validation of an embedding/norm op (as dsp__infer_nn) giving its
 * plan. */
int dsp__norm_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                   const dsp_attrs *a, dsp_meta *out, dsp_norm_geo *g);
/* nn: attention's geometry (common/ops_attn.c). q [B,H,Tq,d], k [B,H,Tk,d],
 * v [B,H,Tk,dv], mask bool [B,Tk] when has_mask; every size fits an int and
 * scale is the one the kernels use (floats[0], or 1/sqrt(d) for 0). The
 * backward op's inputs are the forward's shifted by one (grad first). */
typedef struct dsp_attn_geo {
  int64_t B, H, Tq, Tk, d, dv;
  int causal, has_mask;
  double scale;
} dsp_attn_geo;
/* nn: validates attention or attention_backward (as dsp__infer_nn) and
 * gives the geometry. */
int dsp__attn_plan(dsp_ctx *ctx, dsp_opcode op, const dsp_meta *in, int n_in,
                   const dsp_attrs *a, dsp_meta *out, dsp_attn_geo *g);
/* How many query rows the kernels take at once (their scores scratch is
 * this many rows of Tk). */
#define DSP_ATTN_QBLOCK 64
/* The keys query i of a block sees, counting from key 0 (causal: j <= i,
 * top-left aligned, as torch.tril(ones(Tq, Tk))); a key_mask can drop some
 * of these. */
static inline int64_t dsp__attn_nkeys(const dsp_attn_geo *g, int64_t i) {
  return g->causal && i + 1 < g->Tk ? i + 1 : g->Tk;
}

#endif
