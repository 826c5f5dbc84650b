/* Backward rules: one switch with a case per op of DSP_OP_MAP (no default,
 * so a new op in the table does not compile until it gets a decision
 * here). Each rule maps g = d loss / d out to d loss / d input, using only
 * dsp_op, so it runs on any backend.
 *
 * Tie conventions (gradients at non-differentiable points):
 * - maximum(a, b) and minimum(a, b) split the gradient evenly where a == b
 *   (g/2 to each) and give it whole to the larger (smaller) input
 *   elsewhere, as PyTorch does;
 * - max and min over dims split the gradient evenly between tied maxima
 *   (minima);
 * - clamp passes the gradient where lo <= x <= hi (both ends inclusive, as
 *   PyTorch) and gives 0 outside;
 * - relu and abs have gradient 0 at 0 (the relu_backward and sign ops);
 * - sign has gradient 0 everywhere. */
#include <string.h>

#include "autodiff.h"

/* A rule's scratch: every intermediate tensor lands in tmp and is dropped
 * when the rule ends; the first error sticks in rc and makes every later
 * step a no-op returning NULL, so rules read as straight-line formulas. */
#define RB_MAX (2 * DSP_MAX_INPUTS + 32)
typedef struct rb {
  dsp_ctx *ctx;
  int rc;
  int n;
  dsp_tensor *tmp[RB_MAX];
} rb;

static dsp_tensor *rb_keep(rb *r, dsp_tensor *t) {
  if (r->n == RB_MAX) {
    dsp_tensor_unref(t);
    r->rc = dsp_seterr(r->ctx, DISPATCH_EINTERNAL, "backward: rule scratch full");
    return NULL;
  }
  r->tmp[r->n++] = t;
  return t;
}

static dsp_tensor *rb_op(rb *r, dsp_opcode op, const dsp_attrs *a, int n,
                         dsp_tensor *x, dsp_tensor *y, dsp_tensor *z) {
  if (r->rc < 0) return NULL;
  dsp_tensor *in[3] = {x, y, z}, *out;
  int rc = dsp_op(r->ctx, op, in, n, a, &out);
  if (rc < 0) {
    r->rc = rc;
    return NULL;
  }
  return rb_keep(r, out);
}

/* rb_op for an op of up to DSP_MAX_INPUTS inputs. */
static dsp_tensor *rb_opn(rb *r, dsp_opcode op, const dsp_attrs *a, int n,
                          dsp_tensor *const *in) {
  if (r->rc < 0) return NULL;
  dsp_tensor *out;
  int rc = dsp_op(r->ctx, op, in, n, a, &out);
  if (rc < 0) {
    r->rc = rc;
    return NULL;
  }
  return rb_keep(r, out);
}

static dsp_tensor *un(rb *r, dsp_opcode op, dsp_tensor *x) {
  return rb_op(r, op, NULL, 1, x, NULL, NULL);
}
static dsp_tensor *bin(rb *r, dsp_opcode op, dsp_tensor *x, dsp_tensor *y) {
  return rb_op(r, op, NULL, 2, x, y, NULL);
}
static dsp_tensor *sc(rb *r, dsp_opcode op, dsp_tensor *x, double s) {
  dsp_attrs a = dsp_attrs_f1(s);
  return rb_op(r, op, &a, 1, x, NULL, NULL);
}

static dsp_attrs shape_attrs(const dsp_meta *m, int first, int64_t lead) {
  dsp_attrs a = dsp_attrs_none();
  if (first) a.ints[0] = lead;
  for (int i = 0; i < m->ndim; i++) a.ints[first + i] = m->shape[i];
  a.n_ints = first + m->ndim;
  return a;
}

/* x viewed with m's shape (x itself when the shape already matches). */
static dsp_tensor *reshape(rb *r, dsp_tensor *x, const dsp_meta *m) {
  if (r->rc < 0) return NULL;
  if (x->meta.ndim == m->ndim) {
    int same = 1;
    for (int i = 0; i < m->ndim; i++) same &= x->meta.shape[i] == m->shape[i];
    if (same) return x;
  }
  dsp_attrs a = shape_attrs(m, 0, 0);
  return rb_op(r, DSP_OP_RESHAPE, &a, 1, x, NULL, NULL);
}

static dsp_tensor *bcast(rb *r, dsp_tensor *x, const dsp_meta *m) {
  if (r->rc < 0) return NULL;
  dsp_meta want = *m;
  want.dtype = x->meta.dtype;
  if (dsp_meta_equal(&x->meta, &want)) return x;
  dsp_attrs a = shape_attrs(m, 0, 0);
  return rb_op(r, DSP_OP_BROADCAST_TO, &a, 1, x, NULL, NULL);
}

/* Sums g over the dims along which m was broadcast to g's shape, giving a
 * tensor of m's shape: the gradient of an input that was broadcast. */
static dsp_tensor *sum_to(rb *r, dsp_tensor *g, const dsp_meta *m) {
  if (r->rc < 0) return NULL;
  int nd = g->meta.ndim, lead = nd - m->ndim;
  dsp_attrs a = dsp_attrs_none();
  for (int i = 0; i < nd; i++)
    if (i < lead || (m->shape[i - lead] == 1 && g->meta.shape[i] != 1))
      a.ints[a.n_ints++] = i;
  if (a.n_ints == 0) return reshape(r, g, m);
  a.n_floats = 1; /* floats[0] = 0: no keepdim */
  return reshape(r, rb_op(r, DSP_OP_SUM, &a, 1, g, NULL, NULL), m);
}

static dsp_tensor *zeros_like(rb *r, const dsp_meta *m) {
  dsp_attrs a = shape_attrs(m, 1, m->dtype);
  return rb_op(r, DSP_OP_ZEROS, &a, 0, NULL, NULL, NULL);
}

static dsp_tensor *zero_scalar(rb *r, dsp_dtype dt) {
  dsp_meta m = {dt, 0, {0}};
  return zeros_like(r, &m);
}

static dsp_tensor *slice(rb *r, dsp_tensor *x, int dim, int64_t start,
                         int64_t end) {
  int64_t v[4] = {dim, start, end, 1};
  dsp_attrs a = dsp_attrs_ints(4, v);
  return rb_op(r, DSP_OP_SLICE, &a, 1, x, NULL, NULL);
}

static dsp_tensor *transpose_last2(rb *r, dsp_tensor *x) {
  int64_t v[2] = {-2, -1};
  dsp_attrs a = dsp_attrs_ints(2, v);
  return rb_op(r, DSP_OP_TRANSPOSE, &a, 1, x, NULL, NULL);
}

/* op(a) @ op(b), op(x) = x^T (last two dims) where the flag is set. Two
 * 2-D operands are one MATMUL with the flags as its attributes (one gemm
 * with BLAS's transpose flags on the CPU, no transposing copy); batched
 * ones copy the transpose and multiply, which keeps their results the
 * bits they have always been. */
static dsp_tensor *matmul_t(rb *r, dsp_tensor *a, int ta, dsp_tensor *b,
                            int tb) {
  if (r->rc < 0) return NULL;
  if (a->meta.ndim == 2 && b->meta.ndim == 2 && (ta || tb)) {
    int64_t v[2] = {ta, tb};
    dsp_attrs at = dsp_attrs_ints(2, v);
    return rb_op(r, DSP_OP_MATMUL, &at, 2, a, b, NULL);
  }
  return bin(r, DSP_OP_MATMUL, ta ? transpose_last2(r, a) : a,
             tb ? transpose_last2(r, b) : b);
}

/* Where mask holds, v; elsewhere 0. */
static dsp_tensor *keep_where(rb *r, dsp_tensor *mask, dsp_tensor *v) {
  if (r->rc < 0) return NULL;
  return rb_op(r, DSP_OP_WHERE, NULL, 3, mask, v,
               zero_scalar(r, v->meta.dtype));
}
static dsp_tensor *drop_where(rb *r, dsp_tensor *mask, dsp_tensor *v) {
  if (r->rc < 0) return NULL;
  return rb_op(r, DSP_OP_WHERE, NULL, 3, mask,
               zero_scalar(r, v->meta.dtype), v);
}

/* Shape of a reduction's input with the reduced dims kept as size 1, and
 * the attrs that reduce exactly those dims with keepdim. */
static void reduced_keep(const dsp_node *n, dsp_meta *keep, dsp_attrs *a) {
  const dsp_meta *xm = &n->in[0]->meta;
  int red[DSP_MAX_DIMS] = {0};
  if (n->attrs.n_ints == 0)
    for (int i = 0; i < xm->ndim; i++) red[i] = 1;
  for (int i = 0; i < n->attrs.n_ints; i++) {
    int64_t d = n->attrs.ints[i];
    if (d < 0) d += xm->ndim;
    if (d >= 0 && d < xm->ndim) red[d] = 1;
  }
  *keep = *xm;
  *a = dsp_attrs_none();
  for (int i = 0; i < xm->ndim; i++)
    if (red[i]) {
      keep->shape[i] = 1;
      a->ints[a->n_ints++] = i;
    }
  a->floats[0] = 1;
  a->n_floats = 1;
}

static int norm_dim(int64_t d, int ndim) {
  return (int)(d < 0 ? d + ndim : d);
}

static void set_grad(rb *r, dsp_tensor **gin, int i, dsp_tensor *t) {
  if (r->rc == 0 && t) gin[i] = dsp_tensor_ref(t);
}

/* var: 2 (x - mean) g / (N - correction); std: var's over 2 std, so
 * (x - mean) g / ((N - correction) std). N - correction is taken as
 * max(0, .) as the forward does, and 0 gives inf/NaN there too. */
static void var_grad(rb *R, const dsp_node *n, dsp_tensor *g,
                     dsp_tensor **gin) {
  dsp_tensor *x = n->in[0];
  if (x->node == NULL) return;
  dsp_meta keep;
  dsp_attrs ka;
  reduced_keep(n, &keep, &ka);
  double N = 1;
  for (int i = 0; i < ka.n_ints; i++) N *= (double)x->meta.shape[ka.ints[i]];
  double corr = n->attrs.n_floats > 1 ? n->attrs.floats[1] : 1.0;
  double den = N - corr > 0 ? N - corr : 0.0;
  dsp_tensor *d = bin(R, DSP_OP_SUB, x, rb_op(R, DSP_OP_MEAN, &ka, 1, x,
                                              NULL, NULL));
  dsp_tensor *gk = reshape(R, g, &keep), *q;
  if (n->op == DSP_OP_VAR)
    q = sc(R, DSP_OP_MUL_SCALAR, gk, 2.0 / den);
  else
    q = bin(R, DSP_OP_DIV, gk,
            sc(R, DSP_OP_MUL_SCALAR, reshape(R, n->out, &keep), den));
  set_grad(R, gin, 0, bin(R, DSP_OP_MUL, d, q));
}

int dsp__autodiff_saves_output(dsp_opcode op) {
  switch (op) {
    case DSP_OP_EXP:
    case DSP_OP_SQRT:
    case DSP_OP_SIGMOID:
    case DSP_OP_TANH:
    case DSP_OP_SOFTMAX:
    case DSP_OP_LOG_SOFTMAX:
    case DSP_OP_MAX:
    case DSP_OP_MIN:
    case DSP_OP_CLAMP:
    case DSP_OP_STD:
      return 1;
    default:
      return 0;
  }
}

/* The rules. `need(i)` skips work for inputs nobody asked a gradient of. */
int dsp__autodiff_rule(dsp_ctx *ctx, const dsp_node *n, dsp_tensor *g,
                       dsp_tensor **gin) {
  rb r = {.ctx = ctx, .rc = 0, .n = 0};
  rb *R = &r;
  dsp_tensor *const *in = n->in;
  dsp_tensor *x = in[0], *y = n->out;
  const dsp_attrs *at = &n->attrs;
  double s = at->n_floats > 0 ? at->floats[0] : 0.0;
  const char *name = dsp_op_lookup((int)n->op)->name;
#define need(i) (in[i]->node != NULL)
#define GRAD(i, expr)                  \
  do {                                 \
    if (need(i)) set_grad(R, gin, i, (expr)); \
  } while (0)

  switch (n->op) {
    /* ---------------------------------------------- elementwise binary */
    case DSP_OP_ADD:
      GRAD(0, sum_to(R, g, &in[0]->meta));
      GRAD(1, sum_to(R, g, &in[1]->meta));
      break;
    case DSP_OP_SUB:
      GRAD(0, sum_to(R, g, &in[0]->meta));
      GRAD(1, sum_to(R, un(R, DSP_OP_NEG, g), &in[1]->meta));
      break;
    case DSP_OP_MUL:
      GRAD(0, sum_to(R, bin(R, DSP_OP_MUL, g, in[1]), &in[0]->meta));
      GRAD(1, sum_to(R, bin(R, DSP_OP_MUL, g, in[0]), &in[1]->meta));
      break;
    case DSP_OP_DIV: {
      /* d(a/b)/da = 1/b, d(a/b)/db = -a/b^2 */
      dsp_tensor *gb = bin(R, DSP_OP_DIV, g, in[1]);
      GRAD(0, sum_to(R, gb, &in[0]->meta));
      GRAD(1, sum_to(R, un(R, DSP_OP_NEG, bin(R, DSP_OP_DIV,
                                                bin(R, DSP_OP_MUL, gb, in[0]),
                                                in[1])),
                     &in[1]->meta));
      break;
    }
    case DSP_OP_MAXIMUM:
    case DSP_OP_MINIMUM: {
      /* PyTorch's form: g/2 where a == b, g elsewhere, then 0 for the
       * input that lost (a < b for maximum's a, a > b for its b) */
      int mx = n->op == DSP_OP_MAXIMUM;
      dsp_tensor *split =
          rb_op(R, DSP_OP_WHERE, NULL, 3, bin(R, DSP_OP_EQ, in[0], in[1]),
                sc(R, DSP_OP_MUL_SCALAR, g, 0.5), g);
      dsp_tensor *a_lost = bin(R, mx ? DSP_OP_LT : DSP_OP_GT, in[0], in[1]);
      dsp_tensor *b_lost = bin(R, mx ? DSP_OP_GT : DSP_OP_LT, in[0], in[1]);
      GRAD(0, sum_to(R, drop_where(R, a_lost, split), &in[0]->meta));
      GRAD(1, sum_to(R, drop_where(R, b_lost, split), &in[1]->meta));
      break;
    }
    case DSP_OP_WHERE: /* the bool mask (input 0) is never tracked */
      GRAD(1, sum_to(R, keep_where(R, in[0], g), &in[1]->meta));
      GRAD(2, sum_to(R, drop_where(R, in[0], g), &in[2]->meta));
      break;

    /* ---------------------------------------------- scalar forms */
    case DSP_OP_ADD_SCALAR:
    case DSP_OP_SUB_SCALAR:
      GRAD(0, g);
      break;
    case DSP_OP_MUL_SCALAR:
      GRAD(0, sc(R, DSP_OP_MUL_SCALAR, g, s));
      break;
    case DSP_OP_DIV_SCALAR:
      GRAD(0, sc(R, DSP_OP_DIV_SCALAR, g, s));
      break;
    case DSP_OP_POW_SCALAR: /* s * x^(s-1); exactly 0 for s = 0 */
      if (s == 0.0)
        GRAD(0, sc(R, DSP_OP_MUL_SCALAR, g, 0.0));
      else
        GRAD(0, bin(R, DSP_OP_MUL, g,
                    sc(R, DSP_OP_MUL_SCALAR,
                       sc(R, DSP_OP_POW_SCALAR, x, s - 1.0), s)));
      break;
    case DSP_OP_RSUB_SCALAR:
      GRAD(0, un(R, DSP_OP_NEG, g));
      break;
    case DSP_OP_RDIV_SCALAR: /* d(s/x)/dx = -s/x^2 */
      GRAD(0, bin(R, DSP_OP_MUL, g,
                  sc(R, DSP_OP_RDIV_SCALAR, bin(R, DSP_OP_MUL, x, x), -s)));
      break;

    /* ---------------------------------------------- unary */
    case DSP_OP_NEG:
      GRAD(0, un(R, DSP_OP_NEG, g));
      break;
    case DSP_OP_EXP:
      GRAD(0, bin(R, DSP_OP_MUL, g, y));
      break;
    case DSP_OP_LOG:
      GRAD(0, bin(R, DSP_OP_DIV, g, x));
      break;
    case DSP_OP_SQRT: /* 1 / (2 sqrt(x)) */
      GRAD(0, bin(R, DSP_OP_DIV, g, sc(R, DSP_OP_MUL_SCALAR, y, 2.0)));
      break;
    case DSP_OP_ABS:
      GRAD(0, bin(R, DSP_OP_MUL, g, un(R, DSP_OP_SIGN, x)));
      break;
    case DSP_OP_SIGN:
      GRAD(0, zeros_like(R, &x->meta));
      break;
    case DSP_OP_RELU:
      GRAD(0, bin(R, DSP_OP_RELU_BACKWARD, g, x));
      break;
    case DSP_OP_SIGMOID: /* y (1 - y) */
      GRAD(0, bin(R, DSP_OP_MUL, g,
                  bin(R, DSP_OP_MUL, y, sc(R, DSP_OP_RSUB_SCALAR, y, 1.0))));
      break;
    case DSP_OP_TANH: /* 1 - y^2 */
      GRAD(0, bin(R, DSP_OP_MUL, g,
                  sc(R, DSP_OP_RSUB_SCALAR, bin(R, DSP_OP_MUL, y, y), 1.0)));
      break;
    case DSP_OP_GELU:
      GRAD(0, bin(R, DSP_OP_GELU_BACKWARD, g, x));
      break;
    case DSP_OP_SILU: { /* s (1 + x (1 - s)), s = sigmoid(x) */
      dsp_tensor *s = un(R, DSP_OP_SIGMOID, x);
      dsp_tensor *xs = bin(R, DSP_OP_MUL, x, sc(R, DSP_OP_RSUB_SCALAR, s, 1.0));
      GRAD(0, bin(R, DSP_OP_MUL, g,
                  bin(R, DSP_OP_MUL, s, sc(R, DSP_OP_ADD_SCALAR, xs, 1.0))));
      break;
    }
    case DSP_OP_SOFTPLUS:
      GRAD(0, bin(R, DSP_OP_SOFTPLUS_BACKWARD, g, x));
      break;
    case DSP_OP_GELU_TANH:
      GRAD(0, bin(R, DSP_OP_GELU_TANH_BACKWARD, g, x));
      break;
    case DSP_OP_CLAMP: /* inside [lo, hi] exactly where clamp kept x */
      if (at->floats[0] > at->floats[1])
        GRAD(0, zeros_like(R, &x->meta));
      else
        GRAD(0, keep_where(R, bin(R, DSP_OP_EQ, y, x), g));
      break;
    case DSP_OP_MASKED_FILL: /* the bool mask (input 1) is never tracked */
      GRAD(0, drop_where(R, in[1], g));
      break;

    /* ---------------------------------------------- reductions */
    case DSP_OP_SUM:
    case DSP_OP_MEAN: {
      dsp_meta keep;
      dsp_attrs ka;
      reduced_keep(n, &keep, &ka);
      dsp_tensor *gk = reshape(R, g, &keep);
      if (n->op == DSP_OP_MEAN && g->numel > 0 && x->numel > 0)
        gk = sc(R, DSP_OP_DIV_SCALAR, gk,
                (double)x->numel / (double)g->numel);
      GRAD(0, bcast(R, gk, &x->meta));
      break;
    }
    case DSP_OP_VAR:
    case DSP_OP_STD:
      var_grad(R, n, g, gin);
      break;
    case DSP_OP_MAX:
    case DSP_OP_MIN: {
      /* every position equal to its slice's max (min) shares that slice's
       * gradient evenly */
      dsp_meta keep;
      dsp_attrs ka;
      reduced_keep(n, &keep, &ka);
      dsp_tensor *mask = bin(R, DSP_OP_EQ, x, bcast(R, reshape(R, y, &keep),
                                                    &x->meta));
      int64_t dt = x->meta.dtype;
      dsp_attrs ca = dsp_attrs_ints(1, &dt);
      dsp_tensor *cnt = rb_op(R, DSP_OP_SUM, &ka, 1,
                              rb_op(R, DSP_OP_CAST, &ca, 1, mask, NULL, NULL),
                              NULL, NULL);
      dsp_tensor *share = bin(R, DSP_OP_DIV, reshape(R, g, &keep), cnt);
      GRAD(0, keep_where(R, mask, bcast(R, share, &x->meta)));
      break;
    }

    /* ---------------------------------------------- shape */
    case DSP_OP_RESHAPE:
      GRAD(0, reshape(R, g, &x->meta));
      break;
    case DSP_OP_PERMUTE: {
      dsp_attrs a = dsp_attrs_none();
      int nd = x->meta.ndim;
      for (int i = 0; i < at->n_ints && i < nd; i++)
        a.ints[norm_dim(at->ints[i], nd)] = i;
      a.n_ints = nd;
      GRAD(0, rb_op(R, DSP_OP_PERMUTE, &a, 1, g, NULL, NULL));
      break;
    }
    case DSP_OP_TRANSPOSE:
      GRAD(0, rb_op(R, DSP_OP_TRANSPOSE, at, 1, g, NULL, NULL));
      break;
    case DSP_OP_SLICE: {
      dsp_attrs a = shape_attrs(&x->meta, 4, 0);
      for (int i = 0; i < 4; i++) a.ints[i] = at->ints[i];
      GRAD(0, rb_op(R, DSP_OP_SLICE_BACKWARD, &a, 1, g, NULL, NULL));
      break;
    }
    case DSP_OP_CAT: {
      int d = norm_dim(at->ints[0], x->meta.ndim);
      int64_t off = 0;
      for (int i = 0; i < n->n_in; i++) {
        int64_t len = in[i]->meta.shape[d];
        GRAD(i, slice(R, g, d, off, off + len));
        off += len;
      }
      break;
    }
    case DSP_OP_STACK: {
      int d = norm_dim(at->ints[0], x->meta.ndim + 1);
      for (int i = 0; i < n->n_in; i++)
        GRAD(i, reshape(R, slice(R, g, d, i, i + 1), &in[i]->meta));
      break;
    }
    case DSP_OP_BROADCAST_TO:
      GRAD(0, sum_to(R, g, &x->meta));
      break;
    case DSP_OP_INDEX_SELECT: {
      int d = norm_dim(at->ints[0], x->meta.ndim);
      int64_t v[2] = {d, x->meta.shape[d]};
      dsp_attrs a = dsp_attrs_ints(2, v);
      GRAD(0, rb_op(R, DSP_OP_INDEX_SELECT_BACKWARD, &a, 2, g, in[1], NULL));
      break;
    }
    case DSP_OP_CAST: {
      int64_t dt = x->meta.dtype;
      dsp_attrs a = dsp_attrs_ints(1, &dt);
      GRAD(0, rb_op(R, DSP_OP_CAST, &a, 1, g, NULL, NULL));
      break;
    }

    /* ---------------------------------------------- linalg */
    case DSP_OP_MATMUL: {
      /* promote 1-D operands to matrices as numpy does ([k] -> [1,k] on
       * the left, [k,1] on the right), differentiate the batched matrix
       * product, sum the broadcast batch dims away and drop the added
       * dims again. With the attributes {ta, tb} the product is
       * op(a) @ op(b) (a flagged operand has rank >= 2, so only an
       * unflagged one is promoted): d op(a) = g op(b)^T and
       * d op(b) = op(a)^T g, transposed back where the flag is set. */
      const int ta = at->n_ints == 2 && at->ints[0] == 1,
                tb = at->n_ints == 2 && at->ints[1] == 1;
      dsp_meta am = in[0]->meta, bm = in[1]->meta;
      if (am.ndim == 1) am = (dsp_meta){am.dtype, 2, {1, am.shape[0]}};
      if (bm.ndim == 1) bm = (dsp_meta){bm.dtype, 2, {bm.shape[0], 1}};
      dsp_meta ab = {am.dtype, am.ndim - 2, {0}}, bb = {bm.dtype, bm.ndim - 2, {0}};
      memcpy(ab.shape, am.shape, sizeof(int64_t) * (size_t)ab.ndim);
      memcpy(bb.shape, bm.shape, sizeof(int64_t) * (size_t)bb.ndim);
      dsp_meta gm;
      r.rc = dsp_broadcast_shapes(ctx, "matmul backward", &ab, &bb, &gm);
      if (r.rc < 0) break;
      gm.shape[gm.ndim++] = am.shape[am.ndim - 2 + ta];
      gm.shape[gm.ndim++] = bm.shape[bm.ndim - 1 - tb];
      dsp_tensor *g1 = reshape(R, g, &gm);
      dsp_tensor *a1 = reshape(R, in[0], &am), *b1 = reshape(R, in[1], &bm);
      GRAD(0, reshape(R, sum_to(R, ta ? matmul_t(R, b1, tb, g1, 1)
                                      : matmul_t(R, g1, 0, b1, !tb),
                                &am),
                      &in[0]->meta));
      GRAD(1, reshape(R, sum_to(R, tb ? matmul_t(R, g1, 1, a1, ta)
                                      : matmul_t(R, a1, !ta, g1, 0),
                                &bm),
                      &in[1]->meta));
      break;
    }

    /* ---------------------------------------------- nn */
    case DSP_OP_SOFTMAX:
      GRAD(0, rb_op(R, DSP_OP_SOFTMAX_BACKWARD, at, 2, g, y, NULL));
      break;
    case DSP_OP_LOG_SOFTMAX:
      GRAD(0, rb_op(R, DSP_OP_LOG_SOFTMAX_BACKWARD, at, 2, g, y, NULL));
      break;
    case DSP_OP_CROSS_ENTROPY: /* labels (input 1) are i64, never tracked */
      GRAD(0, rb_op(R, DSP_OP_CROSS_ENTROPY_BACKWARD, at, 3, g, in[0], in[1]));
      break;
    case DSP_OP_CROSS_ENTROPY_EX: /* the fused backward op, same attrs */
      GRAD(0, rb_op(R, DSP_OP_CROSS_ENTROPY_EX_BACKWARD, at, 3, g, in[0],
                    in[1]));
      break;
    case DSP_OP_MSE: { /* d/da mean((a-b)^2) = 2 (a-b) / N */
      double k = x->numel > 0 ? 2.0 / (double)x->numel : 0.0;
      dsp_tensor *ga = bin(R, DSP_OP_MUL,
                           sc(R, DSP_OP_MUL_SCALAR,
                              bin(R, DSP_OP_SUB, in[0], in[1]), k),
                           g);
      GRAD(0, ga);
      GRAD(1, un(R, DSP_OP_NEG, ga));
      break;
    }
    case DSP_OP_CONV2D:
    case DSP_OP_CONV2D_BIAS: {
      static const int64_t defs[6] = {1, 1, 0, 0, 1, 1};
      dsp_attrs ai = dsp_attrs_none(), aw;
      for (int i = 0; i < 6; i++) ai.ints[i] = i < at->n_ints ? at->ints[i] : defs[i];
      ai.n_ints = 10;
      aw = ai;
      for (int i = 0; i < 4; i++) {
        ai.ints[6 + i] = in[0]->meta.shape[i];
        aw.ints[6 + i] = in[1]->meta.shape[i];
      }
      GRAD(0, rb_op(R, DSP_OP_CONV2D_BACKWARD_INPUT, &ai, 2, g, in[1], NULL));
      GRAD(1, rb_op(R, DSP_OP_CONV2D_BACKWARD_WEIGHT, &aw, 2, g, in[0], NULL));
      if (n->op == DSP_OP_CONV2D_BIAS) { /* d bias[o] = sum of g[:, o] */
        static const int64_t nhw[3] = {0, 2, 3};
        dsp_attrs ar = dsp_attrs_ints(3, nhw);
        GRAD(2, rb_op(R, DSP_OP_SUM, &ar, 1, g, NULL, NULL));
      }
      break;
    }
    case DSP_OP_MAX_POOL2D:
    case DSP_OP_AVG_POOL2D: {
      /* spell out the defaulted stride and padding for the backward op */
      dsp_attrs a = dsp_attrs_none();
      for (int i = 0; i < 6; i++)
        a.ints[i] = i < at->n_ints ? at->ints[i]
                    : i < 4        ? a.ints[i - 2]
                                   : 0;
      a.n_ints = 6;
      GRAD(0, rb_op(R, n->op == DSP_OP_MAX_POOL2D ? DSP_OP_MAX_POOL2D_BACKWARD
                                                  : DSP_OP_AVG_POOL2D_BACKWARD,
                    &a, 2, g, x, NULL));
      break;
    }
    case DSP_OP_AVG_POOL2D_EX: /* all 7 ints, count_include_pad last */
      GRAD(0, rb_op(R, DSP_OP_AVG_POOL2D_BACKWARD, at, 2, g, x, NULL));
      break;
    case DSP_OP_DROPOUT: /* the same seed gives the same mask and scale */
      GRAD(0, rb_op(R, DSP_OP_DROPOUT, at, 1, g, NULL, NULL));
      break;
    case DSP_OP_ATTENTION: {
      /* one backward op gives [dq | dk | dv] flat; the bool key_mask
       * (input 3) is never tracked */
      dsp_tensor *bin_in[5] = {g, in[0], in[1], in[2], n->n_in > 3 ? in[3] : NULL};
      dsp_tensor *all = rb_opn(R, DSP_OP_ATTENTION_BACKWARD, at, n->n_in + 1,
                               bin_in);
      int64_t off = 0;
      for (int i = 0; i < 3; i++) {
        GRAD(i, reshape(R, slice(R, all, 0, off, off + in[i]->numel),
                        &in[i]->meta));
        off += in[i]->numel; /* q, then k, then v */
      }
      break;
    }

    /* ---------------------------------------------- issue 23 embedding/norm */
    case DSP_OP_EMBEDDING: { /* idx (input 1) is i64, never tracked */
      int64_t v[2] = {x->meta.shape[0], at->ints[0]};
      dsp_attrs a = dsp_attrs_ints(2, v);
      GRAD(0, rb_op(R, DSP_OP_EMBEDDING_BACKWARD, &a, 2, g, in[1], NULL));
      break;
    }
    case DSP_OP_LAYER_NORM:
    case DSP_OP_RMS_NORM: {
      /* one fused op gives dx, dweight and dbias flat, sliced apart here */
      const int ln = n->op == DSP_OP_LAYER_NORM;
      const int hw = (int)at->ints[1], hb = ln ? (int)at->ints[2] : 0;
      dsp_tensor *flat = rb_op(R, ln ? DSP_OP_LAYER_NORM_BACKWARD
                                     : DSP_OP_RMS_NORM_BACKWARD,
                               at, 2 + hw, g, x, hw ? in[1] : NULL);
      int64_t off = x->numel;
      GRAD(0, reshape(R, slice(R, flat, 0, 0, off), &x->meta));
      for (int i = 1; i <= hw + hb; i++) {
        GRAD(i, reshape(R, slice(R, flat, 0, off, off + in[i]->numel),
                        &in[i]->meta));
        off += in[i]->numel; /* the weight, then the bias */
      }
      break;
    }
    case DSP_OP_BATCH_NORM: {
      /* (grad, x[, running stats in evaluation][, weight]); the running
       * statistics get no gradient (buffers, as in PyTorch) */
      const int train = (int)at->ints[0], run = (int)at->ints[1];
      const int hw = (int)at->ints[2], hb = (int)at->ints[3];
      dsp_tensor *bi[5] = {g, x};
      int nb = 2, k = 1 + 2 * run;
      if (run && !train) bi[nb++] = in[1], bi[nb++] = in[2];
      if (hw) bi[nb++] = in[k];
      dsp_tensor *flat = rb_opn(R, DSP_OP_BATCH_NORM_BACKWARD, at, nb, bi);
      int64_t off = x->numel;
      GRAD(0, reshape(R, slice(R, flat, 0, 0, off), &x->meta));
      for (int i = k; i < k + hw + hb; i++) {
        GRAD(i, reshape(R, slice(R, flat, 0, off, off + in[i]->numel),
                        &in[i]->meta));
        off += in[i]->numel; /* the weight, then the bias (batch) */
      }
      break;
    }

    /* ---------------------------------------------- no gradient */
    case DSP_OP_EQ:
    case DSP_OP_NE:
    case DSP_OP_LT:
    case DSP_OP_LE:
    case DSP_OP_GT:
    case DSP_OP_GE:
    case DSP_OP_ARGMAX:
    case DSP_OP_ARGMIN:
    case DSP_OP_ZEROS:
    case DSP_OP_ONES:
    case DSP_OP_FULL:
    case DSP_OP_ARANGE:
    case DSP_OP_UNIFORM:
    case DSP_OP_NORMAL:
    case DSP_OP_SGD_STEP:
    case DSP_OP_ADAM_STEP:
    case DSP_OP_ADAMW_STEP:
      /* never recorded: non-float outputs, no inputs, or in place */
      r.rc = dsp_seterr(ctx, DISPATCH_EINTERNAL,
                        "backward: %s should never be on the tape", name);
      break;
    case DSP_OP_RELU_BACKWARD:
    case DSP_OP_GELU_BACKWARD:
    case DSP_OP_SOFTPLUS_BACKWARD:
    case DSP_OP_GELU_TANH_BACKWARD:
    case DSP_OP_SLICE_BACKWARD:
    case DSP_OP_INDEX_SELECT_BACKWARD:
    case DSP_OP_SOFTMAX_BACKWARD:
    case DSP_OP_LOG_SOFTMAX_BACKWARD:
    case DSP_OP_CROSS_ENTROPY_BACKWARD:
    case DSP_OP_CROSS_ENTROPY_EX_BACKWARD:
    case DSP_OP_CONV2D_BACKWARD_INPUT:
    case DSP_OP_CONV2D_BACKWARD_WEIGHT:
    case DSP_OP_MAX_POOL2D_BACKWARD:
    case DSP_OP_AVG_POOL2D_BACKWARD:
    case DSP_OP_EMBEDDING_BACKWARD:
    case DSP_OP_LAYER_NORM_BACKWARD:
    case DSP_OP_RMS_NORM_BACKWARD:
    case DSP_OP_BATCH_NORM_BACKWARD:
    case DSP_OP_ATTENTION_BACKWARD:
      r.rc = dsp_seterr(ctx, DISPATCH_EUNSUPPORTED,
                        "backward: %s has no gradient rule (higher-order "
                        "gradients are not supported)", name);
      break;
  }
#undef GRAD
#undef need
  for (int i = 0; i < r.n; i++) dsp_tensor_unref(r.tmp[i]);
  return r.rc;
}
