/* make test-gpu: every op x dtype the CUDA backend claims, run on the GPU
 * and on the CPU backend with the same random inputs (broadcasting where
 * the op has it), outputs compared (integers and bools exactly, floats to
 * a rounding tolerance). Prints one row per op x dtype: pass, FAIL or
 * unsupported (what supports_op refuses is listed, never skipped
 * silently). The half types f16 and bf16 run every op too: a row says
 * "pass" where the CUDA kernels take half natively and "pass(wide)" where
 * the op runner widens it (cast to f32, the f32 kernel, one rounding
 * back) on both backends; casts to and from half, on values that include
 * NaN, infinities, subnormals, ties and overflow, must match the CPU bit
 * for bit. Then out-of-memory handling: a tensor larger than the device
 * fails with DISPATCH_ENOMEM and the next op on the same ctx still runs;
 * then session views (a stream each, reused once given back) and an
 * upload and a read staged in parts across part boundaries.
 *
 * Without a usable GPU it prints "cuda: skipped (no GPU): REASON" and
 * exits 0, claiming nothing (with --probe: exits 2 after that line, 0
 * when cuda:0 opens). Exit 1 when any row fails.
 *
 * DSP_CUDA_OPS_ON_CPU=1 runs the same table with the CPU backend in the
 * GPU's place (a check of the cases themselves, no GPU claim); it also
 * prints the cases that the CPU's inference refuses, so a mistyped case
 * cannot drop out of the table unseen. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsp.h"
#include "cuda_plugin.h"
#include "half.h"
#include "rng.h"

static dsp_ctx *cpu, *gpu;
static dsp_backend *be;
/* the CUDA plugin (dispatch-cuda.so) be comes from; NULL on the CPU */
static const dsp_cuda_plugin *cu;
static uint64_t g_ctr;
static int n_pass, n_fail, n_unsup, on_cpu;

static dsp_meta meta(dsp_dtype dt, int nd, const int64_t *sh) {
  dsp_meta m;
  memset(&m, 0, sizeof m);
  m.dtype = dt, m.ndim = nd;
  for (int d = 0; d < nd; d++) m.shape[d] = sh[d];
  return m;
}

/* kind 4's values: the edges of every conversion to and from half (NaN,
 * infinities, f16's largest value and the midpoint above it, subnormals of
 * both half types and of f32, a tie of each, f64 values just past a tie
 * (through f32 they would round twice), a value past f16's range) */
static double edge_value(uint64_t i, double u) {
  static const double E[] = {NAN, -NAN, INFINITY, -INFINITY, 0.0, -0.0, 65504.0,
                             65520.0, -65519.0, 0x1p-24, 0x1p-25, 0x1.8p-24, 0x1p-14,
                             0x1p-133, 0x1p-149, 1.0 + 0x1p-11, 1.0 + 0x1p-8,
                             1.0 + 0x1.8p-8,
                             1.0 + 0x1p-11 + 0x1p-40, -1.0 - 0x1p-8 - 0x1p-40, 3e38, 1e39,
                             0.1, 2.5, -7.5};
  const size_t n = sizeof E / sizeof E[0];
  return i % 2 ? E[(i / 2) % n] : (u - 0.5) * 1e5 * u;
}

/* host bytes of a random tensor; kind 1: nonzero ints, 2: values in
 * [0, lim) (labels, indices), 3: positive floats, 4: conversion edges
 * (edge_value; i64: around 2^53 and 2^62 too) */
static void *rand_bytes(const dsp_meta *m, int kind, int64_t lim, int64_t *n) {
  int64_t k = 1;
  for (int d = 0; d < m->ndim; d++) k *= m->shape[d];
  *n = k;
  size_t es = dsp_dtype_size(m->dtype);
  void *p = calloc((size_t)(k ? k : 1), es);
  for (int64_t i = 0; i < k; i++) {
    double u = dsp_rng_uniform01(77, g_ctr++);
    double v = kind == 3 ? 0.1 + 2 * u : kind == 4 ? edge_value((uint64_t)i, u) : (u - 0.5) * 6;
    switch (m->dtype) {
      case DSP_F32: ((float *)p)[i] = (float)v; break;
      case DSP_F64: ((double *)p)[i] = v; break;
      case DSP_F16: ((uint16_t *)p)[i] = dsp_f64_to_f16(v); break;
      case DSP_BF16: ((uint16_t *)p)[i] = dsp_f64_to_bf16(v); break;
      case DSP_I64: {
        int64_t x = kind == 2 ? (int64_t)(u * (double)lim) : (int64_t)floor(v * 3);
        if (kind == 1 && x == 0) x = 2;
        if (kind == 4) /* i64 -> half: values past f16 and around 2^53, 2^62 */
          x = (int64_t)((u - 0.5) * 2e5) +
              (i % 3 == 1 ? (INT64_C(1) << 53) : i % 3 == 2 ? (INT64_C(1) << 62) : 0);
        ((int64_t *)p)[i] = x;
        break;
      }
      default: ((uint8_t *)p)[i] = u < 0.5; break;
    }
  }
  return p;
}

/* Reads a tensor of either backend into a new host buffer. */
static void *host_copy(const dsp_tensor *t) {
  size_t nb = dsp_tensor_nbytes(t);
  void *h = malloc(nb ? nb : 1);
  const dsp_backend *b = t->storage->backend;
  if (b->copy_out(b->bctx, h, dsp_tensor_data(t), nb) < 0) {
    free(h);
    return NULL;
  }
  return h;
}

/* Tolerances, relative to max(|cpu|, 1). f32 and f64: the kernels'
 * rounding differences. A half result: both backends compute from the
 * same half inputs in f32 and round once to half, so two results differ by
 * the f32 difference (1e-5) plus the one step of half a boundary between
 * them can cost: 2^-10 for f16 and 2^-7 for bf16 (one unit in the last
 * place, relative), times `ulps` for a chain of ops (autodiff) where each
 * op's output is rounded. exact: every result bit for bit (casts). */
static int close_enough(dsp_dtype dt, const void *g, const void *w, int64_t n,
                        int ulps, int exact, int64_t *bad) {
  for (int64_t i = 0; i < n; i++) {
    double a, b, tol;
    if (exact) {
      size_t es = dsp_dtype_size(dt);
      if (memcmp((char *)g + i * es, (char *)w + i * es, es)) return *bad = i, 0;
      continue;
    }
    if (dt == DSP_F32) a = ((float *)g)[i], b = ((float *)w)[i], tol = 1e-5;
    else if (dt == DSP_F64) a = ((double *)g)[i], b = ((double *)w)[i], tol = 1e-12;
    else if (dt == DSP_F16)
      a = dsp_f16_to_f32(((uint16_t *)g)[i]), b = dsp_f16_to_f32(((uint16_t *)w)[i]),
      tol = 1e-5 + ulps * 0x1p-10;
    else if (dt == DSP_BF16)
      a = dsp_bf16_to_f32(((uint16_t *)g)[i]), b = dsp_bf16_to_f32(((uint16_t *)w)[i]),
      tol = 1e-5 + ulps * 0x1p-7;
    else {
      size_t es = dsp_dtype_size(dt);
      if (memcmp((char *)g + i * es, (char *)w + i * es, es)) return *bad = i, 0;
      continue;
    }
    if (isnan(a) && isnan(b)) continue;
    if (isinf(a) || isinf(b)) {
      if (a != b) return *bad = i, 0;
      continue;
    }
    if (!(fabs(a - b) <= tol * (fabs(b) > 1 ? fabs(b) : 1))) return *bad = i, 0;
  }
  return 1;
}

typedef struct tcase {
  dsp_opcode op;
  int n_in;
  dsp_meta in[5]; /* attention_backward with a key mask takes 5 */
  int kind[5];
  int64_t lim[5];
  dsp_attrs a;
  int exact; /* compare bit for bit (casts) */
} tcase;

static void row(const tcase *c, const char *res, const char *detail) {
  char what[40];
  snprintf(what, sizeof what, "%s%s%s", dsp_op_lookup((int)c->op)->name,
           c->op == DSP_OP_CAST ? " to " : "",
           c->op == DSP_OP_CAST ? dsp_dtype_name((dsp_dtype)c->a.ints[0]) : "");
  printf("%-24s %-4s %-12s %s\n", what,
         dsp_dtype_name(c->n_in ? c->in[0].dtype : (dsp_dtype)c->a.ints[0]), res,
         detail);
}

/* the dtype of the half type a case involves (an input's or the
 * output's), or -1 */
static int half_of(const tcase *c, const dsp_meta *om) {
  for (int i = 0; i < c->n_in; i++)
    if (dsp_dtype_is_half(c->in[i].dtype)) return (int)c->in[i].dtype;
  return dsp_dtype_is_half(om->dtype) ? (int)om->dtype : -1;
}

static void run_case(const tcase *c) {
  dsp_tensor *ci[5] = {0}, *gi[5] = {0}, *co = NULL, *go = NULL;
  dsp_meta om;
  if (dsp_op_infer(cpu, c->op, c->in, c->n_in, &c->a, &om) < 0) {
    if (on_cpu) row(c, "n/a", dsp_ctx_errmsg(cpu));
    return;
  }
  /* a half op the kernels lack still runs: the op runner widens it */
  const int native = be->supports_op(be->bctx, c->op, c->in, c->n_in, &om);
  if (!native && half_of(c, &om) < 0) {
    row(c, "unsupported", "");
    n_unsup++;
    return;
  }
  for (int i = 0; i < c->n_in; i++) {
    int64_t n;
    void *h = rand_bytes(&c->in[i], c->kind[i], c->lim[i], &n);
    size_t nb = (size_t)n * dsp_dtype_size(c->in[i].dtype);
    dsp_tensor_from_data(cpu, &c->in[i], h, nb, &ci[i]);
    dsp_tensor_from_data(gpu, &c->in[i], h, nb, &gi[i]);
    free(h);
  }
  int rc1 = dsp_op(cpu, c->op, ci, c->n_in, &c->a, &co);
  int rc2 = dsp_op(gpu, c->op, gi, c->n_in, &c->a, &go);
  char detail[600] = "";
  int ok = rc1 == 0 && rc2 == 0;
  if (!ok) {
    snprintf(detail, sizeof detail, "cpu rc %d, cuda rc %d: %s", rc1, rc2,
             dsp_ctx_errmsg(rc2 ? gpu : cpu));
  } else {
    /* in-place optimizer ops: the parameter is the output */
    void *hg = host_copy(go), *hc = host_copy(co);
    int64_t bad = -1;
    ok = hg && hc && close_enough(co->meta.dtype, hg, hc, co->numel, 1, c->exact, &bad);
    if (!ok) {
      int sync = on_cpu ? 0 : cu->sync(be, gpu);
      snprintf(detail, sizeof detail, "element %lld differs%s%s", (long long)bad,
               sync ? "; " : "", sync ? dsp_ctx_errmsg(gpu) : "");
    }
    free(hg), free(hc);
  }
  row(c, !ok ? "FAIL" : native ? "pass" : "pass(wide)", detail);
  ok ? n_pass++ : n_fail++;
  dsp_tensor_unref(co), dsp_tensor_unref(go);
  for (int i = 0; i < c->n_in; i++) dsp_tensor_unref(ci[i]), dsp_tensor_unref(gi[i]);
}

static tcase mkcase(dsp_opcode op, int n_in, dsp_dtype dt, int nd0,
                    const int64_t *s0, int nd1, const int64_t *s1) {
  tcase c;
  memset(&c, 0, sizeof c);
  c.op = op, c.n_in = n_in;
  c.a = dsp_attrs_none();
  for (int i = 0; i < n_in && i < 4; i++)
    c.in[i] = i == 0 ? meta(dt, nd0, s0) : meta(dt, nd1, s1);
  return c;
}

/* A two-layer MLP step through autodiff on both backends: forward
 * (matmul, relu, cross entropy), backward, and the gradients of both
 * weights compared. */
static void mlp_backward_case(dsp_dtype dt) {
  static const int64_t XS[] = {8, 16}, W1[] = {16, 12}, W2[] = {12, 10}, LS[] = {8};
  const dsp_meta mx = meta(dt, 2, XS), m1 = meta(dt, 2, W1), m2 = meta(dt, 2, W2),
                 ml = meta(DSP_I64, 1, LS);
  const dsp_meta *ms[4] = {&mx, &m1, &m2, &ml};
  dsp_ctx *cx[2] = {cpu, gpu};
  dsp_tensor *t[2][4] = {{0}}, *g[2][2] = {{0}};
  void *h[4];
  int64_t n;
  int rc = 0;
  for (int i = 0; i < 4; i++) h[i] = rand_bytes(ms[i], i == 3 ? 2 : 0, 10, &n);
  for (int b = 0; b < 2 && rc == 0; b++) {
    dsp_ctx *c = cx[b];
    for (int i = 0; i < 4; i++) {
      size_t nb = dsp_dtype_size(ms[i]->dtype);
      for (int d = 0; d < ms[i]->ndim; d++) nb *= (size_t)ms[i]->shape[d];
      rc = rc ? rc : dsp_tensor_from_data(c, ms[i], h[i], nb, &t[b][i]);
    }
    rc = rc ? rc : dsp_track(c, t[b][1]);
    rc = rc ? rc : dsp_track(c, t[b][2]);
    dsp_tensor *h1 = NULL, *a1 = NULL, *lo = NULL, *loss = NULL;
    dsp_tensor *p1[2] = {t[b][0], t[b][1]};
    rc = rc ? rc : dsp_op(c, DSP_OP_MATMUL, p1, 2, NULL, &h1);
    rc = rc ? rc : dsp_op(c, DSP_OP_RELU, &h1, 1, NULL, &a1);
    dsp_tensor *p2[2] = {a1, t[b][2]};
    rc = rc ? rc : dsp_op(c, DSP_OP_MATMUL, p2, 2, NULL, &lo);
    dsp_tensor *p3[2] = {lo, t[b][3]};
    rc = rc ? rc : dsp_op(c, DSP_OP_CROSS_ENTROPY, p3, 2, NULL, &loss);
    dsp_grads *gr = NULL;
    rc = rc ? rc : dsp_backward(c, loss, 0, &gr);
    rc = rc ? rc : dsp_grads_get(c, gr, t[b][1], &g[b][0]);
    rc = rc ? rc : dsp_grads_get(c, gr, t[b][2], &g[b][1]);
    if (rc) printf("mlp_backward %s on %s: %s\n", dsp_dtype_name(dt), b ? "cuda" : "cpu",
                   dsp_ctx_errmsg(c));
    dsp_grads_free(gr);
    dsp_tensor_unref(h1), dsp_tensor_unref(a1), dsp_tensor_unref(lo), dsp_tensor_unref(loss);
  }
  int ok = rc == 0;
  int64_t bad = -1;
  for (int k = 0; k < 2 && ok; k++) {
    void *hg = host_copy(g[1][k]), *hc = host_copy(g[0][k]);
    ok = hg && hc && close_enough(dt, hg, hc, g[0][k]->numel, 4, 0, &bad);
    free(hg), free(hc);
  }
  printf("%-24s %-4s %-12s %s\n", "mlp_backward (autodiff)", dsp_dtype_name(dt),
         ok ? "pass" : "FAIL", ok ? "" : "gradients differ");
  ok ? n_pass++ : n_fail++;
  for (int b = 0; b < 2; b++) {
    for (int i = 0; i < 4; i++) dsp_tensor_unref(t[b][i]);
    dsp_tensor_unref(g[b][0]), dsp_tensor_unref(g[b][1]);
  }
  for (int i = 0; i < 4; i++) free(h[i]);
}

/* Session views (a stream each) and staging in parts, in process: two
 * views are two queues of one device, a view given back is handed out
 * again, an upload staged and committed part by part and a read sent
 * part by part (dsp_pin_avail, as the server's writer does) keep every
 * byte, across part boundaries. */
static void check(const char *what, int ok) {
  printf("%-24s %-4s %-12s\n", what, "u8", ok ? "pass" : "FAIL");
  ok ? n_pass++ : n_fail++;
}
static void views_and_staging(void) {
  char why[256] = "";
  dsp_backend *v1 = NULL, *v2 = NULL, *v3 = NULL;
  int ok = cu->session_open(be, &v1, why, sizeof why) == 0 &&
           cu->session_open(be, &v2, why, sizeof why) == 0 &&
           v1 != v2 && v1 != be && strcmp(v1->name, be->name) == 0;
  if (ok) {
    cu->session_close(v2);
    ok = cu->session_open(be, &v3, why, sizeof why) == 0 && v3 == v2;
  }
  check("session_views", ok);
  if (!v1) return;
  const size_t n = 9 * DSP_STAGE_CHUNK / 4 + 3; /* parts and a short tail */
  unsigned char *src = malloc(n), *back = malloc(n);
  for (size_t i = 0; i < n; i++) src[i] = (unsigned char)((i * 40503u) >> 7) & 1;
  dsp_ctx *vc = dsp_ctx_new(dsp_cpu_backend());
  cu->ctx_use(vc, v1);
  int64_t shape[1] = {(int64_t)n};
  dsp_meta m = meta(DSP_BOOL, 1, shape);
  dsp_tensor *t = NULL;
  dsp_stage st;
  ok = dsp_tensor_new_uninit(vc, &m, &t) == 0 &&
       dsp_tensor_stage_in(vc, t, &st) == 0;
  if (ok) {
    for (size_t got = 0; got < n;) {
      size_t k = n - got < 1000003 ? n - got : 1000003;
      memcpy((unsigned char *)st.host + got, src + got, k);
      got += k;
      dsp_stage_progress(&st, got);
    }
    ok = st.committed == n && dsp_stage_commit(vc, &st) == 0;
    dsp_stage_release(&st);
    ok = ok && dsp_tensor_read(vc, t, back, n) == 0 && memcmp(src, back, n) == 0;
  }
  check("upload_in_parts", ok);
  dsp_pin *p = NULL;
  ok = t && dsp_tensor_pin(vc, t, &p) == 0;
  for (size_t off = 0; ok && off < n;) {
    size_t want = n - off < (3u << 20) ? n - off : (3u << 20);
    size_t k = dsp_pin_avail(p, off, want);
    ok = k > 0 && k <= want &&
         memcmp((const unsigned char *)dsp_pin_data(p) + off, src + off, k) == 0;
    off += k;
  }
  check("read_in_parts", ok);
  dsp_pin_release(p);
  dsp_tensor_unref(t);
  dsp_ctx_free(vc);
  cu->session_close(v1);
  cu->session_close(v3);
  free(src);
  free(back);
}

int main(int argc, char **argv) {
  char why[2048] = "";
  if (argc > 1 && strcmp(argv[1], "--probe") == 0) {
    /* make test-gpu asks first: 0 when cuda:0 opens, else the skip line
     * and 2, so nothing after it runs or reports a pass */
    if (dsp_cuda_plugin_open(0, &cu, &be, why, sizeof why) < 0) {
      printf("cuda: skipped (no GPU): %s\n", why);
      return 2;
    }
    cu->backend_close(be);
    return 0;
  }
  on_cpu = getenv("DSP_CUDA_OPS_ON_CPU") != NULL;
  if (on_cpu) {
    be = (dsp_backend *)dsp_cpu_backend();
  } else if (dsp_cuda_plugin_open(0, &cu, &be, why, sizeof why) < 0) {
    printf("cuda: skipped (no GPU): %s\n", why);
    return 0;
  }
  printf("%s on %s\n", on_cpu ? "self-check of the cases (CPU vs CPU, no GPU claim)"
                               : "cuda conformance", be->device);
  cpu = dsp_ctx_new(dsp_cpu_backend());
  gpu = dsp_ctx_new(dsp_cpu_backend());
  if (!on_cpu) cu->ctx_use(gpu, be);
  static const dsp_dtype DT[] = {DSP_F32, DSP_F64, DSP_I64, DSP_BOOL, DSP_F16, DSP_BF16};
  static const int64_t A[] = {4, 1, 3}, B[] = {5, 1}, C[] = {4, 5, 3}, M1[] = {2, 3, 4},
                       M2[] = {4, 5}, M3[] = {3, 4}, M4[] = {2, 4, 5}, L6[] = {6},
                       N2[] = {6, 10}, NN[] = {6};
  for (size_t di = 0; di < sizeof DT / sizeof DT[0]; di++) {
    dsp_dtype dt = DT[di];
    for (int op = DSP_OP_ADD; op <= DSP_OP_GE; op++) {
      tcase c = mkcase((dsp_opcode)op, 2, dt, 3, A, 2, B);
      c.kind[1] = op == DSP_OP_DIV ? 1 : 0;
      run_case(&c);
    }
    tcase w = mkcase(DSP_OP_WHERE, 3, dt, 3, A, 2, B);
    w.in[0].dtype = DSP_BOOL, w.in[2] = meta(dt, 3, C);
    run_case(&w);
    for (int op = DSP_OP_ADD_SCALAR; op <= DSP_OP_GELU_TANH_BACKWARD; op++) {
      if (op == DSP_OP_CLAMP || op == DSP_OP_MASKED_FILL) continue; /* below */
      tcase c = mkcase((dsp_opcode)op, dsp_op_lookup(op)->n_inputs, dt, 3, C, 3, C);
      if (op <= DSP_OP_RDIV_SCALAR) c.a = dsp_attrs_f1(op == DSP_OP_POW_SCALAR ? 1.5 : 3);
      if (op == DSP_OP_LOG || op == DSP_OP_SQRT || op == DSP_OP_POW_SCALAR) c.kind[0] = 3;
      run_case(&c);
    }
    /* clamp to [-1, 2] and [3, -3] (lo > hi); masked_fill with a mask
     * broadcast from [5, 1] */
    for (int k = 0; k < 2; k++) {
      tcase cl = mkcase(DSP_OP_CLAMP, 1, dt, 3, C, 0, NULL);
      cl.a.n_floats = 2, cl.a.floats[0] = k ? 3 : -1, cl.a.floats[1] = k ? -3 : 2;
      run_case(&cl);
    }
    tcase mf = mkcase(DSP_OP_MASKED_FILL, 2, dt, 3, C, 2, B);
    mf.in[1].dtype = DSP_BOOL, mf.a = dsp_attrs_f1(-4);
    run_case(&mf);
    for (int op = DSP_OP_SUM; op <= DSP_OP_ARGMIN; op++) {
      tcase c = mkcase((dsp_opcode)op, 1, dt, 3, C, 0, NULL);
      run_case(&c);
      int64_t d = 1;
      c.a = dsp_attrs_ints(1, &d);
      run_case(&c);
    }
    /* var and std: every dim (correction 1), dims {0, 2} with correction 0 */
    for (int op = DSP_OP_VAR; op <= DSP_OP_STD; op++) {
      tcase c = mkcase((dsp_opcode)op, 1, dt, 3, C, 0, NULL);
      run_case(&c);
      int64_t d02[2] = {0, 2};
      c.a = dsp_attrs_ints(2, d02);
      c.a.n_floats = 2, c.a.floats[0] = 1, c.a.floats[1] = 0;
      run_case(&c);
    }
    /* shape ops */
    {
      int64_t rs[2] = {-1, 3}, pm[3] = {2, 0, 1}, tr[2] = {0, 2}, sl[4] = {1, 1, 5, 2},
              bt[4] = {2, 4, 5, 3}, dim1 = 1, cst = DSP_F64;
      tcase c = mkcase(DSP_OP_RESHAPE, 1, dt, 3, C, 0, NULL);
      c.a = dsp_attrs_ints(2, rs), run_case(&c);
      c.op = DSP_OP_PERMUTE, c.a = dsp_attrs_ints(3, pm), run_case(&c);
      c.op = DSP_OP_TRANSPOSE, c.a = dsp_attrs_ints(2, tr), run_case(&c);
      c.op = DSP_OP_SLICE, c.a = dsp_attrs_ints(4, sl), run_case(&c);
      c.op = DSP_OP_BROADCAST_TO, c.a = dsp_attrs_ints(4, bt), run_case(&c);
      c.op = DSP_OP_CAST, c.a = dsp_attrs_ints(1, &cst), run_case(&c);
      /* issue 24: this dtype to and from each half type, bit for bit, on
       * the conversions' edge values */
      for (int64_t h = DSP_F16; h <= DSP_BF16; h++) {
        tcase cc = mkcase(DSP_OP_CAST, 1, dt, 3, C, 0, NULL);
        cc.kind[0] = 4, cc.exact = 1, cc.a = dsp_attrs_ints(1, &h);
        if (h != dt) run_case(&cc);
        if (dsp_dtype_is_half(dt)) continue;
        int64_t back = dt;
        cc.in[0].dtype = (dsp_dtype)h, cc.a = dsp_attrs_ints(1, &back);
        run_case(&cc);
      }
      tcase cs = mkcase(DSP_OP_CAT, 3, dt, 3, C, 3, C);
      cs.in[2] = meta(dt, 3, C);
      cs.a = dsp_attrs_ints(1, &dim1), run_case(&cs);
      cs.op = DSP_OP_STACK, run_case(&cs);
      tcase ix = mkcase(DSP_OP_INDEX_SELECT, 2, dt, 3, C, 1, L6);
      ix.in[1].dtype = DSP_I64, ix.kind[1] = 2, ix.lim[1] = 5;
      ix.a = dsp_attrs_ints(1, &dim1), run_case(&ix);
      int64_t sb[7] = {1, 1, 5, 2, 4, 5, 3}, ib[2] = {1, 5}, S2[3] = {4, 2, 3};
      tcase sbc = mkcase(DSP_OP_SLICE_BACKWARD, 1, dt, 3, S2, 0, NULL);
      sbc.a = dsp_attrs_ints(7, sb), run_case(&sbc);
      tcase ibc = mkcase(DSP_OP_INDEX_SELECT_BACKWARD, 2, dt, 3, (int64_t[]){4, 6, 3}, 1, L6);
      ibc.in[1].dtype = DSP_I64, ibc.kind[1] = 2, ibc.lim[1] = 5;
      ibc.a = dsp_attrs_ints(2, ib), run_case(&ibc);
    }
    tcase mm = mkcase(DSP_OP_MATMUL, 2, dt, 3, M1, 2, M2);
    run_case(&mm);
    mm = mkcase(DSP_OP_MATMUL, 2, dt, 2, M3, 3, M4);
    run_case(&mm);
    /* nn */
    int64_t d1 = 1;
    for (int op = DSP_OP_SOFTMAX; op <= DSP_OP_LOG_SOFTMAX_BACKWARD; op++) {
      tcase c = mkcase((dsp_opcode)op, dsp_op_lookup(op)->n_inputs, dt, 3, C, 3, C);
      c.a = dsp_attrs_ints(1, &d1);
      run_case(&c);
    }
    tcase ce = mkcase(DSP_OP_CROSS_ENTROPY, 2, dt, 2, N2, 1, NN);
    ce.in[1].dtype = DSP_I64, ce.kind[1] = 2, ce.lim[1] = 10;
    run_case(&ce);
    tcase ceb = mkcase(DSP_OP_CROSS_ENTROPY_BACKWARD, 3, dt, 0, NULL, 2, N2);
    ceb.in[2] = meta(DSP_I64, 1, NN), ceb.kind[2] = 2, ceb.lim[2] = 10;
    run_case(&ceb);
    /* issue 23: cross_entropy_ex, [6,10] and [2,5,3,4], ignore_index 3 (a
     * class, so random labels hit it), smoothing 0.1, each reduction */
    static const int64_t X5[] = {2, 5, 3, 4}, L5[] = {2, 3, 4};
    for (int r = 0; r < 3; r++) {
      int64_t cv2[2] = {3, r};
      tcase cx = mkcase(DSP_OP_CROSS_ENTROPY_EX, 2, dt, 2, N2, 1, NN);
      cx.in[1].dtype = DSP_I64, cx.kind[1] = 2, cx.lim[1] = 10;
      cx.a = dsp_attrs_ints(2, cv2), cx.a.n_floats = 1, cx.a.floats[0] = 0.1;
      run_case(&cx);
      tcase cs = mkcase(DSP_OP_CROSS_ENTROPY_EX, 2, dt, 4, X5, 3, L5);
      cs.in[1].dtype = DSP_I64, cs.kind[1] = 2, cs.lim[1] = 5, cs.a = cx.a;
      run_case(&cs);
      tcase cb = mkcase(DSP_OP_CROSS_ENTROPY_EX_BACKWARD, 3, dt, r ? 0 : 3, L5, 4, X5);
      cb.in[2] = meta(DSP_I64, 3, L5), cb.kind[2] = 2, cb.lim[2] = 5, cb.a = cx.a;
      run_case(&cb);
    }
    tcase mse = mkcase(DSP_OP_MSE, 2, dt, 3, C, 3, C);
    run_case(&mse);
    tcase dr = mkcase(DSP_OP_DROPOUT, 1, dt, 3, C, 0, NULL);
    int64_t seed = 5;
    dr.a = dsp_attrs_ints(1, &seed), dr.a.n_floats = 1, dr.a.floats[0] = 0.25;
    run_case(&dr);
    /* conv (stride 2, padding 1) and its backward ops; pools */
    static const int64_t X4[] = {2, 3, 8, 8}, W4[] = {4, 3, 3, 3}, Y4[] = {2, 4, 4, 4},
                         P4[] = {2, 3, 4, 4};
    int64_t ci[4] = {2, 2, 1, 1}, cx[8] = {2, 2, 1, 1, 2, 3, 8, 8},
            cw[8] = {2, 2, 1, 1, 4, 3, 3, 3};
    tcase cv = mkcase(DSP_OP_CONV2D, 2, dt, 4, X4, 4, W4);
    cv.a = dsp_attrs_ints(4, ci), run_case(&cv);
    /* issue 23: conv2d_bias (the same conv, bias [4]) */
    static const int64_t B4[] = {4};
    tcase cvb = mkcase(DSP_OP_CONV2D_BIAS, 3, dt, 4, X4, 4, W4);
    cvb.in[2] = meta(dt, 1, B4), cvb.a = cv.a, run_case(&cvb);
    tcase cbi = mkcase(DSP_OP_CONV2D_BACKWARD_INPUT, 2, dt, 4, Y4, 4, W4);
    cbi.a = dsp_attrs_ints(8, cx), run_case(&cbi);
    tcase cbw = mkcase(DSP_OP_CONV2D_BACKWARD_WEIGHT, 2, dt, 4, Y4, 4, X4);
    cbw.a = dsp_attrs_ints(8, cw), run_case(&cbw);
    int64_t pk[2] = {2, 2};
    tcase pl = mkcase(DSP_OP_MAX_POOL2D, 1, dt, 4, X4, 0, NULL);
    pl.a = dsp_attrs_ints(2, pk), run_case(&pl);
    pl.op = DSP_OP_AVG_POOL2D, run_case(&pl);
    tcase pb = mkcase(DSP_OP_MAX_POOL2D_BACKWARD, 2, dt, 4, P4, 4, X4);
    pb.a = dsp_attrs_ints(2, pk), run_case(&pb);
    pb.op = DSP_OP_AVG_POOL2D_BACKWARD, run_case(&pb);
    /* issue 23: embedding (a repeated index, padding row 1) and the norms
     * over rows longer than a block */
    {
      static const int64_t TV[] = {5, 3}, IX[] = {2, 4}, G3[] = {2, 4, 3},
                           XN[] = {3, 300}, WN[] = {300};
      int64_t pad = 1, ebv[2] = {5, 1}, lnv[3] = {1, 1, 1}, rmv[2] = {1, 1};
      tcase em = mkcase(DSP_OP_EMBEDDING, 2, dt, 2, TV, 2, IX);
      em.in[1].dtype = DSP_I64, em.kind[1] = 2, em.lim[1] = 5;
      em.a = dsp_attrs_ints(1, &pad), run_case(&em);
      tcase eb = mkcase(DSP_OP_EMBEDDING_BACKWARD, 2, dt, 3, G3, 2, IX);
      eb.in[1].dtype = DSP_I64, eb.kind[1] = 2, eb.lim[1] = 5;
      eb.a = dsp_attrs_ints(2, ebv), run_case(&eb);
      tcase ln = mkcase(DSP_OP_LAYER_NORM, 3, dt, 2, XN, 1, WN);
      ln.in[2] = meta(dt, 1, WN);
      ln.a = dsp_attrs_ints(3, lnv), ln.a.n_floats = 1, ln.a.floats[0] = 1e-5;
      run_case(&ln);
      tcase lb = mkcase(DSP_OP_LAYER_NORM_BACKWARD, 3, dt, 2, XN, 2, XN);
      lb.in[2] = meta(dt, 1, WN), lb.a = ln.a, run_case(&lb);
      tcase rm = mkcase(DSP_OP_RMS_NORM, 2, dt, 2, XN, 1, WN);
      rm.a = dsp_attrs_ints(2, rmv), rm.a.n_floats = 1, rm.a.floats[0] = 1e-5;
      run_case(&rm);
      tcase rb = mkcase(DSP_OP_RMS_NORM_BACKWARD, 3, dt, 2, XN, 2, XN);
      rb.in[2] = meta(dt, 1, WN), rb.a = rm.a, run_case(&rb);
      /* batch_norm: training with running statistics (updated in place
       * on both sides; the output compared), evaluation, backward */
      static const int64_t XB[] = {8, 3, 40}, CB[] = {3};
      int64_t trv[4] = {1, 1, 1, 0}; /* (x, rm, rv, w): a case holds 4 */
      tcase bn = mkcase(DSP_OP_BATCH_NORM, 4, dt, 3, XB, 1, CB);
      bn.kind[2] = 3;
      bn.a = dsp_attrs_ints(4, trv), bn.a.n_floats = 2;
      bn.a.floats[0] = 0.1, bn.a.floats[1] = 1e-5;
      run_case(&bn);
      bn.a.ints[0] = 0, run_case(&bn);
      tcase bb = mkcase(DSP_OP_BATCH_NORM_BACKWARD, 3, dt, 3, XB, 3, XB);
      bb.in[2] = meta(dt, 1, CB), bb.a = bn.a, bb.a.ints[0] = 1;
      run_case(&bb);
    }
    /* issue 23: attention plain, then causal with a key mask, Tq > Tk and
     * dv over one 256-dim pass of the kernels; the backward op on both */
    static const int64_t AQ[] = {2, 3, 70, 16}, AK[] = {2, 3, 50, 16},
                         AV[] = {2, 3, 50, 8}, AO[] = {2, 3, 70, 8},
                         BQ[] = {2, 2, 33, 5}, BK[] = {2, 2, 20, 5},
                         BV[] = {2, 2, 20, 300}, BO[] = {2, 2, 33, 300},
                         BM[] = {2, 20};
    for (int variant = 0; variant < 2; variant++) {
      const int64_t *q = variant ? BQ : AQ, *k = variant ? BK : AK,
                    *v = variant ? BV : AV, *o = variant ? BO : AO;
      for (int bw = 0; bw < 2; bw++) {
        tcase at = mkcase(bw ? DSP_OP_ATTENTION_BACKWARD : DSP_OP_ATTENTION,
                          3 + bw + variant, dt, 4, q, 4, k);
        if (bw) at.in[0] = meta(dt, 4, o), at.in[1] = meta(dt, 4, q);
        at.in[1 + bw] = meta(dt, 4, k), at.in[2 + bw] = meta(dt, 4, v);
        if (variant) at.in[3 + bw] = meta(DSP_BOOL, 2, BM);
        at.a = dsp_attrs_f1(variant ? 0.3 : 0.0);
        at.a.ints[0] = variant, at.a.ints[1] = variant, at.a.n_ints = 2;
        run_case(&at);
      }
    }
    /* issue 23: avg_pool2d_ex (3x3 stride 2 pad 1) with count_include_pad
     * 0 and 1, and the backward op with its 7th int */
    static const int64_t P5[] = {2, 3, 4, 4};
    for (int cip = 0; cip < 2; cip++) {
      int64_t pe[7] = {3, 3, 2, 2, 1, 1, cip};
      tcase pex = mkcase(DSP_OP_AVG_POOL2D_EX, 1, dt, 4, X4, 0, NULL);
      pex.a = dsp_attrs_ints(7, pe), run_case(&pex);
      tcase pbx = mkcase(DSP_OP_AVG_POOL2D_BACKWARD, 2, dt, 4, P5, 4, X4);
      pbx.a = pex.a, run_case(&pbx);
    }
    /* creation */
    for (int op = DSP_OP_ZEROS; op <= DSP_OP_NORMAL; op++) {
      tcase c = mkcase((dsp_opcode)op, 0, dt, 0, NULL, 0, NULL);
      int64_t ints[5] = {dt, 3, 4, 5, 0};
      int ni = 3;
      if (op == DSP_OP_ARANGE) ni = 1, c.a.n_floats = 3, c.a.floats[0] = -2,
                               c.a.floats[1] = 40, c.a.floats[2] = 3;
      if (op >= DSP_OP_UNIFORM) ints[1] = 11, ints[2] = 3, ints[3] = 5, ni = 4,
                                c.a.n_floats = 2, c.a.floats[0] = -1, c.a.floats[1] = 2;
      if (op == DSP_OP_FULL) c.a.n_floats = 1, c.a.floats[0] = 7;
      dsp_attrs keep = c.a;
      c.a = dsp_attrs_ints(ni, ints);
      c.a.n_floats = keep.n_floats;
      memcpy(c.a.floats, keep.floats, sizeof c.a.floats);
      run_case(&c);
    }
    /* optimizer steps (in place) */
    tcase sg = mkcase(DSP_OP_SGD_STEP, 3, dt, 3, C, 3, C);
    sg.in[2] = meta(dt, 3, C);
    sg.a.n_floats = 3, sg.a.floats[0] = 0.1, sg.a.floats[1] = 0.9, sg.a.floats[2] = 0.01;
    run_case(&sg);
    tcase ad = mkcase(DSP_OP_ADAM_STEP, 4, dt, 3, C, 3, C);
    ad.in[2] = ad.in[3] = meta(dt, 3, C), ad.kind[3] = 3;
    int64_t t = 2;
    ad.a = dsp_attrs_ints(1, &t);
    ad.a.n_floats = 4, ad.a.floats[0] = 0.01, ad.a.floats[1] = 0.9,
    ad.a.floats[2] = 0.999, ad.a.floats[3] = 1e-8;
    run_case(&ad);
    /* adamw: decay 0.1, then with a clip's gradient scale 0.4 */
    tcase aw = ad;
    aw.op = DSP_OP_ADAMW_STEP;
    aw.a.n_floats = 5, aw.a.floats[4] = 0.1;
    run_case(&aw);
    aw.a.n_floats = 6, aw.a.floats[5] = 0.4;
    run_case(&aw);
  }
  mlp_backward_case(DSP_F32);
  mlp_backward_case(DSP_F64);
  mlp_backward_case(DSP_F16);
  mlp_backward_case(DSP_BF16);
  /* out of device memory: ENOMEM, then the ctx goes on */
  int64_t huge[2] = {(int64_t)1 << 22, (int64_t)1 << 22}; /* 64 TiB of f32 */
  dsp_meta hm = meta(DSP_F32, 2, huge);
  dsp_tensor *h = NULL;
  int rc = dsp_tensor_new(gpu, &hm, &h);
  int oom_ok = rc == DISPATCH_ENOMEM && h == NULL;
  dsp_tensor *x = NULL, *y = NULL;
  int64_t one[1] = {8};
  dsp_meta sm = meta(DSP_F32, 1, one);
  float xs[8] = {1, 2, 3, 4, 5, 6, 7, 8}, ys[8];
  dsp_tensor_from_data(gpu, &sm, xs, sizeof xs, &x);
  dsp_attrs s2 = dsp_attrs_f1(2);
  oom_ok = oom_ok && x && dsp_op(gpu, DSP_OP_MUL_SCALAR, &x, 1, &s2, &y) == 0 &&
           be->copy_out(be->bctx, ys, dsp_tensor_data(y), sizeof ys) == 0 && ys[7] == 16;
  printf("%-24s %-4s %-12s rc %d (%s)\n", "out_of_memory", "f32",
         oom_ok ? "pass" : "FAIL", rc, dispatch_err_name(rc));
  oom_ok ? n_pass++ : n_fail++;
  dsp_tensor_unref(x), dsp_tensor_unref(y);
  if (!on_cpu) views_and_staging();
  printf("%s: %d pass, %d FAIL, %d unsupported (pool in use after the run: %llu bytes)\n",
         on_cpu ? "self-check" : "cuda", n_pass, n_fail, n_unsup,
         (unsigned long long)(on_cpu ? 0 : cu->pool_used(be)));
  dsp_ctx_free(gpu);
  dsp_ctx_free(cpu);
  if (!on_cpu) cu->backend_close(be);
  return n_fail ? 1 : 0;
}
