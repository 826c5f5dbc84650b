/* red family, CPU kernels (inference and the dtype rules: common/ops_red.c).
 * min/argmin are max/argmax's kernel with the order reversed (NaN still
 * wins, ties still pick the first index); var/std have their own loop.
 *
 * An f32 sum is accumulated in double and rounded to float once at the
 * end, an f64 sum in double, an i64 sum wraps modulo 2^64; mean is that
 * sum divided by the count, in double. Every output element is reduced
 * sequentially in the same order whichever loop shape is used, so results
 * are bit-identical from run to run. */
#include <math.h>
#include <string.h>

#include "cpu.h"
#include "kern_iter.h"
#include "ops_plan.h"
#include "par.h"

_Static_assert(DSP__OPS_IN_FAMILY(RED) == 8,
               "a new reduction needs a case in dsp__cpu_red and a row in "
               "the CPU support table (common/cpu/backend.c)");

/* ------------------------------------------------------------------ */

/* Loop plan: kept dims (outer, output order) and reduced dims (inner),
 * both as strided iterators over the input. */
typedef struct red_plan {
  dsp_iter outer, inner;
  int blocked;        /* input is [P][R][Q] with R reduced, Q > 1 */
  int64_t P, R, Q;
} red_plan;

static void red_plan_init(red_plan *p, const dsp_meta *x, const int *red) {
  int64_t cs[DSP_MAX_DIMS];
  dsp__contig_strides(x, cs);
  int64_t osh[DSP_MAX_DIMS], ish[DSP_MAX_DIMS];
  int64_t ost[1][DSP_MAX_DIMS], ist[1][DSP_MAX_DIMS];
  int no = 0, ni = 0;
  /* segments of consecutive non-trivial dims of the same kind */
  int nseg = 0, kind[DSP_MAX_DIMS];
  int64_t segsz[DSP_MAX_DIMS];
  for (int d = 0; d < x->ndim; d++) {
    if (red[d]) {
      ish[ni] = x->shape[d];
      ist[0][ni++] = cs[d];
    } else {
      osh[no] = x->shape[d];
      ost[0][no++] = cs[d];
    }
    if (x->shape[d] == 1) continue;
    if (nseg > 0 && kind[nseg - 1] == red[d]) {
      segsz[nseg - 1] *= x->shape[d];
    } else {
      kind[nseg] = red[d];
      segsz[nseg++] = x->shape[d];
    }
  }
  dsp__iter_strided(&p->outer, no, osh, ost, 1);
  dsp__iter_strided(&p->inner, ni, ish, ist, 1);
  p->blocked = 0;
  if (nseg == 2 && kind[0] == 1 && kind[1] == 0) {
    p->blocked = 1;
    p->P = 1, p->R = segsz[0], p->Q = segsz[1];
  } else if (nseg == 3 && kind[0] == 0 && kind[1] == 1 && kind[2] == 0) {
    p->blocked = 1;
    p->P = segsz[0], p->R = segsz[1], p->Q = segsz[2];
  }
}

#define RED_BLOCK 256

/* A blocked sum or mean ([P][R][Q] summed over R, as a bias gradient) is
 * cut into chunks of RED_COLS columns of one p that the backend's threads
 * share (par.h); each output still sums its R values in order, so the
 * bits are the same whoever sums it. */
#define RED_COLS 32

typedef struct red_job {
  dsp_ctx *ctx;
  const red_plan *pl;
  const void *px;
  void *po;
  double cnt;
  dsp_dtype dt;
  int mean;
  int64_t nqb; /* column chunks per p */
} red_job;

#define SUM_BLOCKED(T, ACC, FIN)                                             \
  do {                                                                       \
    const T *X_ = (const T *)j->px;                                          \
    T *O_ = (T *)j->po;                                                      \
    ACC acc[RED_COLS];                                                       \
    for (int64_t ch = lo; ch < hi; ch++) {                                   \
      const int64_t p = ch / j->nqb, q0 = (ch % j->nqb) * RED_COLS;          \
      const int64_t qb = pl->Q - q0 < RED_COLS ? pl->Q - q0 : RED_COLS;      \
      for (int64_t c = 0; c < qb; c++) acc[c] = 0;                           \
      for (int64_t r = 0; r < pl->R; r++) {                                  \
        const T *row = X_ + (p * pl->R + r) * pl->Q + q0;                    \
        for (int64_t c = 0; c < qb; c++) acc[c] += (ACC)row[c];              \
      }                                                                      \
      for (int64_t c = 0; c < qb; c++) O_[p * pl->Q + q0 + c] = FIN(acc[c]); \
      if (dsp__poll(j->ctx, &pw, qb * pl->R)) return 1;                      \
    }                                                                        \
  } while (0)

#define FIN_F32(acc) ((float)(acc))
#define FIN_F32_MEAN(acc) ((float)((acc) / cnt))
#define FIN_ID(acc) (acc)
#define FIN_MEAN(acc) ((acc) / cnt)
#define FIN_I64(acc) ((int64_t)(acc))

/* chunks [lo, hi) of a blocked sum or mean (the dtypes dsp__cpu_red has
 * checked) */
static int sum_blocked(void *arg, int64_t lo, int64_t hi, int lane) {
  const red_job *j = arg;
  const red_plan *pl = j->pl;
  const double cnt = j->cnt;
  int64_t pw = 0;
  (void)lane;
  switch (j->dt) {
    case DSP_F32:
      if (j->mean) SUM_BLOCKED(float, double, FIN_F32_MEAN);
      else SUM_BLOCKED(float, double, FIN_F32);
      break;
    case DSP_F64:
      if (j->mean) SUM_BLOCKED(double, double, FIN_MEAN);
      else SUM_BLOCKED(double, double, FIN_ID);
      break;
    default: SUM_BLOCKED(int64_t, uint64_t, FIN_I64); break;
  }
  return 0;
}

/* Sum/mean: ACC is the accumulator type, FIN(acc) the stored value. */
#define SUM_KERNEL(T, ACC, FIN)                                              \
  do {                                                                       \
    const T *X_ = (const T *)px;                                             \
    T *O_ = (T *)po;                                                         \
    int64_t oidx[DSP_MAX_DIMS] = {0}, ooff[3] = {0, 0, 0}, o = 0;            \
    const int64_t ost = pl.outer.st[0][pl.outer.nd - 1];                     \
    const int64_t ist = pl.inner.st[0][pl.inner.nd - 1];                     \
    for (int64_t orow = 0; orow < pl.outer.rows && !stop; orow++) {          \
      for (int64_t oj = 0; oj < pl.outer.inner && !stop; oj++, o++) {        \
        const T *base = X_ + ooff[0] + oj * ost;                             \
        ACC acc = 0;                                                         \
        int64_t iidx[DSP_MAX_DIMS] = {0}, ioff[3] = {0, 0, 0};               \
        for (int64_t ir = 0; ir < pl.inner.rows; ir++) {                     \
          const T *q = base + ioff[0];                                       \
          if (ist == 1)                                                      \
            for (int64_t j = 0; j < pl.inner.inner; j++) acc += (ACC)q[j];   \
          else                                                               \
            for (int64_t j = 0; j < pl.inner.inner; j++)                     \
              acc += (ACC)q[j * ist];                                        \
          dsp__iter_step(&pl.inner, iidx, ioff);                             \
        }                                                                    \
        O_[o] = FIN(acc);                                                    \
        stop = dsp__poll(ctx, &pw, pl.inner.rows * pl.inner.inner);          \
      }                                                                      \
      dsp__iter_step(&pl.outer, oidx, ooff);                                 \
    }                                                                        \
  } while (0)

/* max/argmax: BETTER(v, best) says v replaces best; STORE(o, best, bi)
 * writes the output. The first element always initialises best. */
#define MAX_KERNEL(T, BETTER, STORE)                                         \
  do {                                                                       \
    const T *X_ = (const T *)px;                                             \
    if (pl.blocked) {                                                        \
      T best[RED_BLOCK];                                                     \
      int64_t bi[RED_BLOCK];                                                 \
      for (int64_t p = 0; p < pl.P && !stop; p++)                            \
        for (int64_t q0 = 0; q0 < pl.Q && !stop; q0 += RED_BLOCK) {          \
          int64_t qb = pl.Q - q0 < RED_BLOCK ? pl.Q - q0 : RED_BLOCK;        \
          const T *row0 = X_ + p * pl.R * pl.Q + q0;                         \
          for (int64_t j = 0; j < qb; j++) best[j] = row0[j], bi[j] = 0;     \
          for (int64_t r = 1; r < pl.R; r++) {                               \
            const T *row = row0 + r * pl.Q;                                  \
            for (int64_t j = 0; j < qb; j++) {                               \
              T v = row[j];                                                  \
              if (BETTER(v, best[j])) best[j] = v, bi[j] = r;                \
            }                                                                \
          }                                                                  \
          for (int64_t j = 0; j < qb; j++) STORE(p * pl.Q + q0 + j, best[j], bi[j]); \
          stop = dsp__poll(ctx, &pw, qb * pl.R);                             \
        }                                                                    \
      break;                                                                 \
    }                                                                        \
    int64_t oidx[DSP_MAX_DIMS] = {0}, ooff[3] = {0, 0, 0}, o = 0;            \
    const int64_t ost = pl.outer.st[0][pl.outer.nd - 1];                     \
    const int64_t ist = pl.inner.st[0][pl.inner.nd - 1];                     \
    for (int64_t orow = 0; orow < pl.outer.rows && !stop; orow++) {          \
      for (int64_t oj = 0; oj < pl.outer.inner && !stop; oj++, o++) {        \
        const T *base = X_ + ooff[0] + oj * ost;                             \
        T best = base[0];                                                    \
        int64_t bi = 0, k = 0;                                               \
        int64_t iidx[DSP_MAX_DIMS] = {0}, ioff[3] = {0, 0, 0};               \
        for (int64_t ir = 0; ir < pl.inner.rows; ir++) {                     \
          const T *q = base + ioff[0];                                       \
          for (int64_t j = 0; j < pl.inner.inner; j++, k++) {                \
            T v = q[j * ist];                                                \
            if (BETTER(v, best)) best = v, bi = k;                           \
          }                                                                  \
          dsp__iter_step(&pl.inner, iidx, ioff);                             \
        }                                                                    \
        STORE(o, best, bi);                                                  \
        stop = dsp__poll(ctx, &pw, pl.inner.rows * pl.inner.inner);          \
      }                                                                      \
      dsp__iter_step(&pl.outer, oidx, ooff);                                 \
    }                                                                        \
  } while (0)

/* var/std: per output, the mean in double, then the squared deviations
 * from it summed in double, over max(0, N - correction) (0/0 = NaN or
 * x/0 = inf where that is 0, as PyTorch); std is the root of that. Both
 * passes walk the reduced elements in row-major order. */
#define VAR_KERNEL(T)                                                        \
  do {                                                                       \
    const T *X_ = (const T *)px;                                             \
    T *O_ = (T *)po;                                                         \
    double den = cnt - corr > 0 ? cnt - corr : 0.0;                          \
    int64_t oidx[DSP_MAX_DIMS] = {0}, ooff[3] = {0, 0, 0}, o = 0;            \
    const int64_t ost = pl.outer.st[0][pl.outer.nd - 1];                     \
    const int64_t ist = pl.inner.st[0][pl.inner.nd - 1];                     \
    for (int64_t orow = 0; orow < pl.outer.rows && !stop; orow++) {          \
      for (int64_t oj = 0; oj < pl.outer.inner && !stop; oj++, o++) {        \
        const T *base = X_ + ooff[0] + oj * ost;                             \
        double acc = 0, ss = 0;                                              \
        for (int pass = 0; pass < 2; pass++) {                               \
          const double mean = acc / cnt;                                     \
          int64_t iidx[DSP_MAX_DIMS] = {0}, ioff[3] = {0, 0, 0};             \
          for (int64_t ir = 0; ir < pl.inner.rows; ir++) {                   \
            const T *q = base + ioff[0];                                     \
            for (int64_t j = 0; j < pl.inner.inner; j++) {                   \
              double v = (double)q[j * ist];                                 \
              if (pass == 0) acc += v;                                       \
              else ss += (v - mean) * (v - mean);                            \
            }                                                                \
            dsp__iter_step(&pl.inner, iidx, ioff);                           \
          }                                                                  \
        }                                                                    \
        double var = ss / den;                                               \
        O_[o] = (T)(op == DSP_OP_STD ? sqrt(var) : var);                     \
        stop = dsp__poll(ctx, &pw, 2 * pl.inner.rows * pl.inner.inner);      \
      }                                                                      \
      dsp__iter_step(&pl.outer, oidx, ooff);                                 \
    }                                                                        \
  } while (0)

#define F_BETTER(v, b) ((v) > (b) || ((v) != (v) && (b) == (b)))
#define I_BETTER(v, b) ((v) > (b))
#define F_LESS(v, b) ((v) < (b) || ((v) != (v) && (b) == (b)))
#define I_LESS(v, b) ((v) < (b))
#define STORE_MAX(o, b, i) (O_[o] = (b), (void)(i))
#define STORE_ARG(o, b, i) (OI_[o] = (i))
/* min, argmin, max or argmax by x's dtype, then return: O_ (the values)
 * and OI_ (the indices) both view po, STORE writes one of them */
#define EXTREME_CASE(T, BETTER, STORE)                                      \
  {                                                                         \
    T *O_ = po;                                                             \
    int64_t *OI_ = po;                                                      \
    (void)O_, (void)OI_;                                                    \
    MAX_KERNEL(T, BETTER, STORE);                                           \
    break;                                                                  \
  }
#define EXTREME_KERNEL(FBETTER, IBETTER, STORE)                             \
  do {                                                                      \
    switch (x->meta.dtype) {                                                \
      case DSP_F32: EXTREME_CASE(float, FBETTER, STORE)                     \
      case DSP_F64: EXTREME_CASE(double, FBETTER, STORE)                    \
      case DSP_I64: EXTREME_CASE(int64_t, IBETTER, STORE)                   \
      default: return dsp__no_kernel(ctx, op, in, n_in, out);               \
    }                                                                       \
    return stop ? dsp__cancelled_err(ctx, op) : 0;                          \
  } while (0)
int dsp__cpu_red(dsp_ctx *ctx, dsp_opcode op, dsp_tensor *const *in, int n_in,
                 const dsp_attrs *a, dsp_tensor *out) {
  const dsp_tensor *x = in[0];
  int red[DSP_MAX_DIMS];
  const dsp_dtype dt = x->meta.dtype;
  /* the kernels below: sum/max/argmax/min/argmin on f32, f64, i64;
   * mean, var and std on floats */
  const int float_only =
      op == DSP_OP_MEAN || op == DSP_OP_VAR || op == DSP_OP_STD;
  if ((op != DSP_OP_SUM && op != DSP_OP_MAX && op != DSP_OP_ARGMAX &&
       op != DSP_OP_MIN && op != DSP_OP_ARGMIN && !float_only) ||
      !(dt == DSP_F32 || dt == DSP_F64 || (dt == DSP_I64 && !float_only)))
    return dsp__no_kernel(ctx, op, in, n_in, out);
  int rc = dsp__red_dims(ctx, op, a, x->meta.ndim, red);
  if (rc < 0) return rc;
  if (out->numel == 0) return 0;
  red_plan pl;
  red_plan_init(&pl, &x->meta, red);
  const void *px = dsp_tensor_data(x);
  void *po = dsp_tensor_data(out);
  int stop = 0;   /* set by the kernels when ctx was cancelled */
  int64_t pw = 0; /* work since the last look at the cancel flag */
  double cnt = 1;
  for (int d = 0; d < x->meta.ndim; d++)
    if (red[d]) cnt *= (double)x->meta.shape[d];
  if (op == DSP_OP_SUM || op == DSP_OP_MEAN) {
    int mean = op == DSP_OP_MEAN;
    /* an empty reduction gives 0 (sum) or 0/0 = NaN (mean) */
    if (cnt == 0) {
      for (int64_t i = 0; i < out->numel; i++) {
        if (x->meta.dtype == DSP_F32) ((float *)po)[i] = mean ? NAN : 0.0f;
        else if (x->meta.dtype == DSP_F64) ((double *)po)[i] = mean ? NAN : 0.0;
        else ((int64_t *)po)[i] = 0;
      }
      return 0;
    }
    if (pl.blocked) {
      red_job j = {.ctx = ctx, .pl = &pl, .px = px, .po = po, .cnt = cnt,
                   .dt = x->meta.dtype, .mean = mean,
                   .nqb = dsp__par_nchunks(pl.Q, RED_COLS)};
      if (j.dt != DSP_F32 && j.dt != DSP_F64 && j.dt != DSP_I64)
        return dsp__no_kernel(ctx, op, in, n_in, out);
      return dsp__par_for(ctx, pl.P * j.nqb, 1, sum_blocked, &j)
                 ? dsp__cancelled_err(ctx, op)
                 : 0;
    }
    switch (x->meta.dtype) {
      case DSP_F32:
        if (mean) SUM_KERNEL(float, double, FIN_F32_MEAN);
        else SUM_KERNEL(float, double, FIN_F32);
        break;
      case DSP_F64:
        if (mean) SUM_KERNEL(double, double, FIN_MEAN);
        else SUM_KERNEL(double, double, FIN_ID);
        break;
      case DSP_I64: SUM_KERNEL(int64_t, uint64_t, FIN_I64); break;
      default: return dsp__no_kernel(ctx, op, in, n_in, out);
    }
    return stop ? dsp__cancelled_err(ctx, op) : 0;
  }
  if (op == DSP_OP_VAR || op == DSP_OP_STD) {
    const double corr = a->n_floats > 1 ? a->floats[1] : 1.0;
    if (dt == DSP_F32) VAR_KERNEL(float);
    else VAR_KERNEL(double);
    return stop ? dsp__cancelled_err(ctx, op) : 0;
  }
  if (op == DSP_OP_MIN) EXTREME_KERNEL(F_LESS, I_LESS, STORE_MAX);
  if (op == DSP_OP_ARGMIN) EXTREME_KERNEL(F_LESS, I_LESS, STORE_ARG);
  if (op == DSP_OP_MAX) EXTREME_KERNEL(F_BETTER, I_BETTER, STORE_MAX);
  EXTREME_KERNEL(F_BETTER, I_BETTER, STORE_ARG);
}
