/* The conformance suite over the op table (ggml's test-backend-ops is the
 * model).
 *
 * For every backend present (g_backends: today the CPU; a backend that is
 * compiled in but finds no device prints "<name>: skipped (no GPU)" and is
 * never reported as passed) and every op of DSP_OP_MAP x every dtype, the
 * suite builds the op's cases (plain shapes, broadcasting shapes where the
 * op broadcasts, zero-size tensors where the op takes them; this library's
 * tensors are always contiguous, so there are no non-contiguous views to
 * test) with random inputs in the op's domain, and:
 * - asks inference: a dtype the op does not exist for is "-" in the table;
 *   a backend's supports_op must not claim it;
 * - asks supports_op: a pair it refuses must come back from dsp_op as
 *   DISPATCH_EUNSUPPORTED naming the op and the backend ("unsupported" in
 *   the table: listed, never skipped silently);
 * - runs every pair it claims on the backend and on the CPU backend with
 *   f64 as the reference (f32 results are compared by normalised mean
 *   square error against the f64 run, integer and bool results exactly),
 *   and, for ops with a gradient, compares the gradients of
 *   sum(op(x) * w) the same way.
 * It prints the table op x dtype for each backend and fails if any pair a
 * backend claims fails. On the CPU this checks the f32 kernels against the
 * f64 kernels, the support table against what really runs, and (below)
 * that a kernel reached with an op x dtype it has no loop for refuses it,
 * and that every pair gives the same bytes through a real dispatch-server
 * as in process. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsp.h"
#include "dsp_internal.h"
#include "half.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"
#include "ops_plan.h"
#if DSP_CUDA_BUILT
#include "cuda_plugin.h"
#endif

/* ------------------------------------------------------------------ */
/* backends under test                                                 */

/* A backend the suite runs: open gives 0 and the backend, 1 and a reason
 * when it is compiled in but cannot run here (no device), or < 0. */
typedef struct suite_backend {
  const char *name;
  int (*open)(const dsp_backend **be, char *why, size_t why_len);
  void (*close)(const dsp_backend *be);
} suite_backend;

static int open_cpu(const dsp_backend **be, char *why, size_t why_len) {
  (void)why, (void)why_len;
  *be = dsp_cpu_backend();
  return 0;
}

#if DSP_CUDA_BUILT
/* cuda:0 through the CUDA plugin when it is built (make builds
 * dispatch-cuda.so whenever nvcc is found; this suite loads the one next
 * to $DISPATCH_SERVER_BIN unless DISPATCH_CUDA_PLUGIN names another); 1
 * with the one-line reason when this machine has no usable GPU. */
static const dsp_cuda_plugin *g_cu;
static int open_cuda(const dsp_backend **be, char *why, size_t why_len) {
  dsp_backend *b = NULL;
  sp_use_build_plugin();
  int rc = dsp_cuda_plugin_open(0, &g_cu, &b, why, why_len);
  if (rc == DISPATCH_EUNSUPPORTED) return 1;
  if (rc < 0) return rc;
  *be = b;
  return 0;
}
static void close_cuda(const dsp_backend *be) {
  g_cu->backend_close((dsp_backend *)be);
}
#endif

/* One line per backend. A backend built in without a device here (open
 * gives 1) is printed as "NAME: skipped (no GPU): REASON" and never counts
 * as passed. */
static const suite_backend g_backends[] = {
    {"cpu", open_cpu, NULL},
#if DSP_CUDA_BUILT
    {"cuda", open_cuda, close_cuda},
#endif
};

/* A ctx whose ops run on be. */
static dsp_ctx *ctx_on(const dsp_backend *be) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cr_assert_not_null(ctx);
  ctx->backend = be;
  return ctx;
}

/* ------------------------------------------------------------------ */
/* cases                                                               */

#define MAXIN 5 /* attention_backward with its key mask */
typedef struct tcase {
  const char *what;
  dsp_opcode op;
  int n_in;
  dsp_meta in[MAXIN];
  char dom[MAXIN];   /* value domain, see fill_values */
  int64_t range[MAXIN];
  dsp_attrs a;
} tcase;

static void in_(tcase *c, dsp_dtype dt, char dom, int64_t range, int nd, ...) {
  dsp_meta *m = &c->in[c->n_in];
  memset(m, 0, sizeof *m);
  m->dtype = dt;
  m->ndim = nd;
  va_list ap;
  va_start(ap, nd);
  for (int d = 0; d < nd; d++) m->shape[d] = va_arg(ap, int);
  va_end(ap);
  c->dom[c->n_in] = dom;
  c->range[c->n_in] = range;
  c->n_in++;
}
static void ints_(tcase *c, int n, ...) {
  va_list ap;
  va_start(ap, n);
  for (int i = 0; i < n; i++) c->a.ints[i] = va_arg(ap, int);
  va_end(ap);
  c->a.n_ints = n;
}
static void fl_(tcase *c, int n, ...) {
  va_list ap;
  va_start(ap, n);
  for (int i = 0; i < n; i++) c->a.floats[i] = va_arg(ap, double);
  va_end(ap);
  c->a.n_floats = n;
}

static int is_ew_binary(dsp_opcode op) {
  return dsp__ew_is_arith(op) || dsp__ew_is_cmp(op);
}

/* Variant v of op on key dtype k (dsp__op_key_dtype): 0, or -1 when the op
 * has no variant v. Domains: r any, q small integers (ties for
 * comparisons), p positive, n nonzero, i an index in [0, range), b bool. */
static int make_case(dsp_opcode op, dsp_dtype k, int v, tcase *c) {
  memset(c, 0, sizeof *c);
  c->op = op;
  const dsp_dtype I = DSP_I64, B = DSP_BOOL;
  if (is_ew_binary(op)) {
    char d0 = dsp__ew_is_cmp(op) ? 'q' : 'r';
    char d1 = op == DSP_OP_DIV ? 'n' : d0;
    switch (v) {
      case 0: c->what = "same shape"; in_(c, k, d0, 0, 2, 3, 4); in_(c, k, d1, 0, 2, 3, 4); return 0;
      case 1: c->what = "broadcast [2,3,4] x [4]"; in_(c, k, d0, 0, 3, 2, 3, 4); in_(c, k, d1, 0, 1, 4); return 0;
      case 2: c->what = "broadcast [3,1] x [1,4]"; in_(c, k, d0, 0, 2, 3, 1); in_(c, k, d1, 0, 2, 1, 4); return 0;
      case 3: c->what = "scalar x [5]"; in_(c, k, d0, 0, 0); in_(c, k, d1, 0, 1, 5); return 0;
      case 4: c->what = "zero-size [0,4] x [4]"; in_(c, k, d0, 0, 2, 0, 4); in_(c, k, d1, 0, 1, 4); return 0;
      default: return -1;
    }
  }
  if (dsp__ew_is_scalar(op)) {
    char d = op == DSP_OP_POW_SCALAR ? 'p' : op == DSP_OP_RDIV_SCALAR ? 'n' : 'r';
    double s = op == DSP_OP_DIV_SCALAR ? 2.5 : op == DSP_OP_POW_SCALAR ? 1.5 : 3.0;
    switch (v) {
      case 0: c->what = "[3,4]"; in_(c, k, d, 0, 2, 3, 4); fl_(c, 1, s); return 0;
      case 1: c->what = "zero-size [2,0]"; in_(c, k, d, 0, 2, 2, 0); fl_(c, 1, s); return 0;
      case 2:
        if (op != DSP_OP_POW_SCALAR) return -1;
        c->what = "[5] ^ 2"; in_(c, k, 'r', 0, 1, 5); fl_(c, 1, 2.0); return 0;
      default: return -1;
    }
  }
  switch (op) {
    case DSP_OP_WHERE:
      switch (v) {
        case 0: c->what = "same shape"; in_(c, B, 'b', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 3, 4); return 0;
        case 1: c->what = "broadcast [3,1] [1,4] [4]"; in_(c, B, 'b', 0, 2, 3, 1); in_(c, k, 'r', 0, 2, 1, 4); in_(c, k, 'r', 0, 1, 4); return 0;
        case 2: c->what = "zero-size"; in_(c, B, 'b', 0, 2, 0, 4); in_(c, k, 'r', 0, 1, 4); in_(c, k, 'r', 0, 1, 1); return 0;
        default: return -1;
      }
    case DSP_OP_NEG: case DSP_OP_EXP: case DSP_OP_LOG: case DSP_OP_SQRT:
    case DSP_OP_ABS: case DSP_OP_SIGN: case DSP_OP_RELU: case DSP_OP_SIGMOID:
    case DSP_OP_TANH: case DSP_OP_GELU: case DSP_OP_SILU:
    case DSP_OP_SOFTPLUS: case DSP_OP_GELU_TANH: {
      char d = (op == DSP_OP_LOG || op == DSP_OP_SQRT) ? 'p' : 'r';
      switch (v) {
        case 0: c->what = "[3,4]"; in_(c, k, d, 0, 2, 3, 4); return 0;
        case 1: c->what = "zero-size [2,0]"; in_(c, k, d, 0, 2, 2, 0); return 0;
        default: return -1;
      }
    }
    case DSP_OP_CLAMP: /* integral bounds, so i64 takes them too */
      switch (v) {
        case 0: c->what = "[3,4] to [-1, 1]"; in_(c, k, 'r', 0, 2, 3, 4); fl_(c, 2, -1.0, 1.0); return 0;
        case 1: c->what = "[3,4] to [-inf, 0]"; in_(c, k, 'r', 0, 2, 3, 4); fl_(c, 2, -INFINITY, 0.0); return 0;
        case 2: c->what = "[5] lo > hi"; in_(c, k, 'r', 0, 1, 5); fl_(c, 2, 2.0, -2.0); return 0;
        case 3: c->what = "zero-size [2,0]"; in_(c, k, 'r', 0, 2, 2, 0); fl_(c, 2, -1.0, 1.0); return 0;
        default: return -1;
      }
    case DSP_OP_MASKED_FILL:
      switch (v) {
        case 0: c->what = "same shape"; in_(c, k, 'r', 0, 2, 3, 4); in_(c, B, 'b', 0, 2, 3, 4); fl_(c, 1, -3.0); return 0;
        case 1: c->what = "mask [3,1] to [2,3,4]"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, B, 'b', 0, 2, 3, 1); fl_(c, 1, 4.0); return 0;
        case 2: c->what = "zero-size"; in_(c, k, 'r', 0, 2, 0, 4); in_(c, B, 'b', 0, 1, 4); fl_(c, 1, 1.0); return 0;
        default: return -1;
      }
    case DSP_OP_VAR: case DSP_OP_STD:
      switch (v) {
        case 0: c->what = "[3,4,5] dim 1"; in_(c, k, 'r', 0, 3, 3, 4, 5); ints_(c, 1, 1); return 0;
        case 1: c->what = "[3,4,5] dims 0,2 keepdim correction 0"; in_(c, k, 'r', 0, 3, 3, 4, 5); ints_(c, 2, 0, 2); fl_(c, 2, 1.0, 0.0); return 0;
        case 2: c->what = "all dims correction 2"; in_(c, k, 'r', 0, 2, 4, 6); fl_(c, 2, 0.0, 2.0); return 0;
        case 3: c->what = "zero-size [0,4] dim 1"; in_(c, k, 'r', 0, 2, 0, 4); ints_(c, 1, 1); return 0;
        default: return -1;
      }
    case DSP_OP_RELU_BACKWARD: case DSP_OP_GELU_BACKWARD:
    case DSP_OP_SOFTPLUS_BACKWARD: case DSP_OP_GELU_TANH_BACKWARD:
      switch (v) {
        case 0: c->what = "[3,4]"; in_(c, k, 'r', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 3, 4); return 0;
        case 1: c->what = "zero-size"; in_(c, k, 'r', 0, 1, 0); in_(c, k, 'r', 0, 1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_SUM: case DSP_OP_MEAN: case DSP_OP_MAX: case DSP_OP_ARGMAX:
    case DSP_OP_MIN: case DSP_OP_ARGMIN:
      switch (v) {
        case 0: c->what = "[3,4,5] dim 1"; in_(c, k, 'r', 0, 3, 3, 4, 5); ints_(c, 1, 1); return 0;
        case 1:
          c->what = "[3,4,5] dims 0,2 keepdim"; in_(c, k, 'r', 0, 3, 3, 4, 5);
          if (op == DSP_OP_ARGMAX || op == DSP_OP_ARGMIN) { c->what = "[3,4,5] dim -1 keepdim"; ints_(c, 1, -1); }
          else ints_(c, 2, 0, 2);
          fl_(c, 1, 1.0);
          return 0;
        case 2: c->what = "all dims"; in_(c, k, 'r', 0, 2, 4, 6); return 0;
        case 3: c->what = "zero-size [0,4] dim 1"; in_(c, k, 'r', 0, 2, 0, 4); ints_(c, 1, 1); return 0;
        default: return -1;
      }
    case DSP_OP_RESHAPE:
      switch (v) {
        case 0: c->what = "[3,4] -> [2,-1,2]"; in_(c, k, 'r', 0, 2, 3, 4); ints_(c, 3, 2, -1, 2); return 0;
        case 1: c->what = "zero-size [0,4] -> [4,0]"; in_(c, k, 'r', 0, 2, 0, 4); ints_(c, 2, 4, 0); return 0;
        default: return -1;
      }
    case DSP_OP_PERMUTE:
      switch (v) {
        case 0: c->what = "[2,3,4] (2,0,1)"; in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 3, 2, 0, 1); return 0;
        case 1: c->what = "zero-size [2,0,3]"; in_(c, k, 'r', 0, 3, 2, 0, 3); ints_(c, 3, 1, 2, 0); return 0;
        default: return -1;
      }
    case DSP_OP_TRANSPOSE:
      switch (v) {
        case 0: c->what = "[3,4] (0,1)"; in_(c, k, 'r', 0, 2, 3, 4); ints_(c, 2, 0, 1); return 0;
        case 1: c->what = "[2,3,4] (-1,0)"; in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 2, -1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_SLICE:
      switch (v) {
        case 0: c->what = "[5,4] dim 0 1:5:2"; in_(c, k, 'r', 0, 2, 5, 4); ints_(c, 4, 0, 1, 5, 2); return 0;
        case 1: c->what = "[5,4] dim 1 -3:10"; in_(c, k, 'r', 0, 2, 5, 4); ints_(c, 4, 1, -3, 10, 1); return 0;
        case 2: c->what = "empty slice"; in_(c, k, 'r', 0, 2, 5, 4); ints_(c, 4, 0, 3, 3, 1); return 0;
        default: return -1;
      }
    case DSP_OP_CAT:
      switch (v) {
        case 0: c->what = "dim 0 of 3"; in_(c, k, 'r', 0, 2, 2, 3); in_(c, k, 'r', 0, 2, 4, 3); in_(c, k, 'r', 0, 2, 1, 3); ints_(c, 1, 0); return 0;
        case 1: c->what = "dim -1 of 3"; in_(c, k, 'r', 0, 2, 2, 1); in_(c, k, 'r', 0, 2, 2, 3); in_(c, k, 'r', 0, 2, 2, 2); ints_(c, 1, -1); return 0;
        case 2: c->what = "with an empty input"; in_(c, k, 'r', 0, 2, 0, 3); in_(c, k, 'r', 0, 2, 2, 3); ints_(c, 1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_STACK:
      switch (v) {
        case 0: c->what = "3 x [2,3] dim 1"; for (int i = 0; i < 3; i++) in_(c, k, 'r', 0, 2, 2, 3); ints_(c, 1, 1); return 0;
        case 1: c->what = "zero-size"; for (int i = 0; i < 2; i++) in_(c, k, 'r', 0, 2, 0, 3); ints_(c, 1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_BROADCAST_TO:
      switch (v) {
        case 0: c->what = "[3,1] -> [2,3,4]"; in_(c, k, 'r', 0, 2, 3, 1); ints_(c, 3, 2, 3, 4); return 0;
        case 1: c->what = "[4] -> [3,4]"; in_(c, k, 'r', 0, 1, 4); ints_(c, 2, 3, 4); return 0;
        case 2: c->what = "zero-size [1,4] -> [0,4]"; in_(c, k, 'r', 0, 2, 1, 4); ints_(c, 2, 0, 4); return 0;
        default: return -1;
      }
    case DSP_OP_INDEX_SELECT:
      switch (v) {
        case 0: c->what = "[5,3] dim 0"; in_(c, k, 'r', 0, 2, 5, 3); in_(c, I, 'i', 5, 1, 4); ints_(c, 1, 0); return 0;
        case 1: c->what = "[2,6] dim 1"; in_(c, k, 'r', 0, 2, 2, 6); in_(c, I, 'i', 6, 1, 3); ints_(c, 1, 1); return 0;
        case 2: c->what = "no indices"; in_(c, k, 'r', 0, 2, 5, 3); in_(c, I, 'i', 5, 1, 0); ints_(c, 1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_CAST:
      if (v >= DSP_NDTYPES + 1) return -1;
      if (v == DSP_NDTYPES) {
        c->what = "zero-size to f32"; in_(c, k, 'r', 0, 2, 0, 3); ints_(c, 1, DSP_F32); return 0;
      }
      c->what = v == 0 ? "to f32" : v == 1 ? "to f64" : v == 2 ? "to i64"
                : v == 3 ? "to bool" : v == 4 ? "to f16" : "to bf16";
      in_(c, k, 'r', 0, 2, 3, 4);
      ints_(c, 1, v);
      return 0;
    case DSP_OP_SLICE_BACKWARD:
      switch (v) {
        case 0: c->what = "into [5,4] dim 1 0:4:2"; in_(c, k, 'r', 0, 2, 5, 2); ints_(c, 6, 1, 0, 4, 2, 5, 4); return 0;
        case 1: c->what = "zero-size"; in_(c, k, 'r', 0, 2, 0, 2); ints_(c, 6, 1, 0, 4, 2, 0, 4); return 0;
        default: return -1;
      }
    case DSP_OP_INDEX_SELECT_BACKWARD:
      switch (v) {
        case 0: c->what = "[4,3] into 5 rows"; in_(c, k, 'r', 0, 2, 4, 3); in_(c, I, 'i', 5, 1, 4); ints_(c, 2, 0, 5); return 0;
        case 1: c->what = "no indices"; in_(c, k, 'r', 0, 2, 0, 3); in_(c, I, 'i', 5, 1, 0); ints_(c, 2, 0, 5); return 0;
        default: return -1;
      }
    case DSP_OP_MATMUL:
      switch (v) {
        case 0: c->what = "[3,4] @ [4,5]"; in_(c, k, 'r', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 4, 5); return 0;
        case 1: c->what = "[2,3,4] @ [4,5]"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 2, 4, 5); return 0;
        case 2: c->what = "[4] @ [2,4,3]"; in_(c, k, 'r', 0, 1, 4); in_(c, k, 'r', 0, 3, 2, 4, 3); return 0;
        case 3: c->what = "batch broadcast [2,1,3,4] @ [3,4,2]"; in_(c, k, 'r', 0, 4, 2, 1, 3, 4); in_(c, k, 'r', 0, 3, 3, 4, 2); return 0;
        case 4: c->what = "zero-size [0,4] @ [4,5]"; in_(c, k, 'r', 0, 2, 0, 4); in_(c, k, 'r', 0, 2, 4, 5); return 0;
        case 5: c->what = "empty inner [3,0] @ [0,5]"; in_(c, k, 'r', 0, 2, 3, 0); in_(c, k, 'r', 0, 2, 0, 5); return 0;
        /* the attributes {ta, tb}: op(a) @ op(b) with x^T where set */
        case 6: c->what = "a^T [4,3]^T @ [4,5]"; in_(c, k, 'r', 0, 2, 4, 3); in_(c, k, 'r', 0, 2, 4, 5); ints_(c, 2, 1, 0); return 0;
        case 7: c->what = "b^T [3,4] @ [5,4]^T"; in_(c, k, 'r', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 5, 4); ints_(c, 2, 0, 1); return 0;
        case 8: c->what = "both batched [2,4,3]^T @ [2,5,4]^T"; in_(c, k, 'r', 0, 3, 2, 4, 3); in_(c, k, 'r', 0, 3, 2, 5, 4); ints_(c, 2, 1, 1); return 0;
        case 9: c->what = "a^T batched, b shared [2,4,3]^T @ [4,5]"; in_(c, k, 'r', 0, 3, 2, 4, 3); in_(c, k, 'r', 0, 2, 4, 5); ints_(c, 2, 1, 0); return 0;
        case 10: c->what = "b^T shared [2,3,4] @ [5,4]^T"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 2, 5, 4); ints_(c, 2, 0, 1); return 0;
        case 11: c->what = "b^T, 1-D a [4] @ [2,3,4]^T"; in_(c, k, 'r', 0, 1, 4); in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 2, 0, 1); return 0;
        case 12: c->what = "empty inner a^T [0,3]^T @ [0,5]"; in_(c, k, 'r', 0, 2, 0, 3); in_(c, k, 'r', 0, 2, 0, 5); ints_(c, 2, 1, 0); return 0;
        default: return -1;
      }
    case DSP_OP_SOFTMAX: case DSP_OP_LOG_SOFTMAX:
      switch (v) {
        case 0: c->what = "[3,5] dim 1"; in_(c, k, 'r', 0, 2, 3, 5); ints_(c, 1, 1); return 0;
        case 1: c->what = "[2,3,4] dim 0"; in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 1, 0); return 0;
        case 2: c->what = "zero-size [0,5]"; in_(c, k, 'r', 0, 2, 0, 5); ints_(c, 1, 1); return 0;
        default: return -1;
      }
    case DSP_OP_SOFTMAX_BACKWARD: case DSP_OP_LOG_SOFTMAX_BACKWARD:
      switch (v) {
        case 0: c->what = "[3,5] dim 1"; in_(c, k, 'r', 0, 2, 3, 5); in_(c, k, 'r', 0, 2, 3, 5); ints_(c, 1, 1); return 0;
        case 1: c->what = "[2,3,4] dim -2"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 1, -2); return 0;
        default: return -1;
      }
    case DSP_OP_CROSS_ENTROPY:
      if (v) return -1;
      c->what = "[4,5]"; in_(c, k, 'r', 0, 2, 4, 5); in_(c, I, 'i', 5, 1, 4);
      return 0;
    case DSP_OP_CROSS_ENTROPY_BACKWARD:
      if (v) return -1;
      c->what = "[4,5]"; in_(c, k, 'r', 0, 0); in_(c, k, 'r', 0, 2, 4, 5); in_(c, I, 'i', 5, 1, 4);
      return 0;
    /* issue 23: ignore_index 2 or 1 is a class, so random labels hit it */
    case DSP_OP_CROSS_ENTROPY_EX:
      switch (v) {
        case 0: c->what = "[4,5] mean, ignore 2, smoothing 0.1"; in_(c, k, 'r', 0, 2, 4, 5); in_(c, I, 'i', 5, 1, 4); ints_(c, 2, 2, 2); fl_(c, 1, 0.1); return 0;
        case 1: c->what = "[2,3,2,2] none, ignore 1"; in_(c, k, 'r', 0, 4, 2, 3, 2, 2); in_(c, I, 'i', 3, 3, 2, 2, 2); ints_(c, 2, 1, 0); fl_(c, 1, 0.0); return 0;
        case 2: c->what = "[3,4,5] sum, smoothing 0.3"; in_(c, k, 'r', 0, 3, 3, 4, 5); in_(c, I, 'i', 4, 2, 3, 5); ints_(c, 2, -100, 1); fl_(c, 1, 0.3); return 0;
        case 3: c->what = "zero-size [0,5] none"; in_(c, k, 'r', 0, 2, 0, 5); in_(c, I, 'i', 5, 1, 0); ints_(c, 2, -100, 0); fl_(c, 1, 0.0); return 0;
        default: return -1;
      }
    case DSP_OP_CROSS_ENTROPY_EX_BACKWARD:
      switch (v) {
        case 0: c->what = "[4,5] mean, ignore 2, smoothing 0.1"; in_(c, k, 'r', 0, 0); in_(c, k, 'r', 0, 2, 4, 5); in_(c, I, 'i', 5, 1, 4); ints_(c, 2, 2, 2); fl_(c, 1, 0.1); return 0;
        case 1: c->what = "[2,3,2,2] none, ignore 1"; in_(c, k, 'r', 0, 3, 2, 2, 2); in_(c, k, 'r', 0, 4, 2, 3, 2, 2); in_(c, I, 'i', 3, 3, 2, 2, 2); ints_(c, 2, 1, 0); fl_(c, 1, 0.2); return 0;
        default: return -1;
      }
    case DSP_OP_MSE:
      if (v) return -1;
      c->what = "[3,4]"; in_(c, k, 'r', 0, 2, 3, 4); in_(c, k, 'r', 0, 2, 3, 4);
      return 0;
    case DSP_OP_CONV2D:
      switch (v) {
        case 0: c->what = "[2,3,6,6] * [4,3,3,3]"; in_(c, k, 'r', 0, 4, 2, 3, 6, 6); in_(c, k, 'r', 0, 4, 4, 3, 3, 3); return 0;
        case 1: c->what = "stride 2,1 pad 1,0 dil 1,2"; in_(c, k, 'r', 0, 4, 1, 2, 7, 7); in_(c, k, 'r', 0, 4, 3, 2, 3, 2); ints_(c, 6, 2, 1, 1, 0, 1, 2); return 0;
        case 2: c->what = "zero-size batch"; in_(c, k, 'r', 0, 4, 0, 3, 6, 6); in_(c, k, 'r', 0, 4, 4, 3, 3, 3); return 0;
        default: return -1;
      }
    case DSP_OP_CONV2D_BIAS: /* issue 23 */
      switch (v) {
        case 0: c->what = "[2,3,6,6] * [4,3,3,3] + [4]"; in_(c, k, 'r', 0, 4, 2, 3, 6, 6); in_(c, k, 'r', 0, 4, 4, 3, 3, 3); in_(c, k, 'r', 0, 1, 4); return 0;
        case 1: c->what = "stride 2,1 pad 1,0 dil 1,2 + bias"; in_(c, k, 'r', 0, 4, 1, 2, 7, 7); in_(c, k, 'r', 0, 4, 3, 2, 3, 2); in_(c, k, 'r', 0, 1, 3); ints_(c, 6, 2, 1, 1, 0, 1, 2); return 0;
        case 2: c->what = "zero-size batch"; in_(c, k, 'r', 0, 4, 0, 3, 6, 6); in_(c, k, 'r', 0, 4, 4, 3, 3, 3); in_(c, k, 'r', 0, 1, 4); return 0;
        default: return -1;
      }
    case DSP_OP_CONV2D_BACKWARD_INPUT:
      if (v) return -1;
      c->what = "grad [2,4,4,4], w [4,3,3,3]"; in_(c, k, 'r', 0, 4, 2, 4, 4, 4); in_(c, k, 'r', 0, 4, 4, 3, 3, 3);
      ints_(c, 10, 1, 1, 0, 0, 1, 1, 2, 3, 6, 6);
      return 0;
    case DSP_OP_CONV2D_BACKWARD_WEIGHT:
      if (v) return -1;
      c->what = "grad [2,4,4,4], x [2,3,6,6]"; in_(c, k, 'r', 0, 4, 2, 4, 4, 4); in_(c, k, 'r', 0, 4, 2, 3, 6, 6);
      ints_(c, 10, 1, 1, 0, 0, 1, 1, 4, 3, 3, 3);
      return 0;
    case DSP_OP_MAX_POOL2D: case DSP_OP_AVG_POOL2D:
      switch (v) {
        case 0: c->what = "[2,3,6,6] 2x2"; in_(c, k, 'r', 0, 4, 2, 3, 6, 6); ints_(c, 2, 2, 2); return 0;
        case 1: c->what = "3x3 stride 2 pad 1"; in_(c, k, 'r', 0, 4, 1, 2, 7, 6); ints_(c, 6, 3, 3, 2, 2, 1, 1); return 0;
        case 2: c->what = "zero-size batch"; in_(c, k, 'r', 0, 4, 0, 3, 4, 4); ints_(c, 2, 2, 2); return 0;
        default: return -1;
      }
    case DSP_OP_MAX_POOL2D_BACKWARD: case DSP_OP_AVG_POOL2D_BACKWARD:
      if (v == 1 && op == DSP_OP_AVG_POOL2D_BACKWARD) { /* issue 23 */
        c->what = "count_include_pad 0, 3x3 stride 2 pad 1"; in_(c, k, 'r', 0, 4, 1, 2, 4, 3); in_(c, k, 'r', 0, 4, 1, 2, 7, 6);
        ints_(c, 7, 3, 3, 2, 2, 1, 1, 0);
        return 0;
      }
      if (v) return -1;
      c->what = "grad [2,3,3,3], x [2,3,6,6]"; in_(c, k, 'r', 0, 4, 2, 3, 3, 3); in_(c, k, 'r', 0, 4, 2, 3, 6, 6);
      ints_(c, 2, 2, 2);
      return 0;
    /* issue 23: count_include_pad 0 and 1, stride 0 = kernel */
    case DSP_OP_AVG_POOL2D_EX:
      switch (v) {
        case 0: c->what = "3x3 stride 2 pad 1, count_include_pad 0"; in_(c, k, 'r', 0, 4, 1, 2, 7, 6); ints_(c, 7, 3, 3, 2, 2, 1, 1, 0); return 0;
        case 1: c->what = "3x2 stride 0 pad 1,0, count_include_pad 1"; in_(c, k, 'r', 0, 4, 2, 3, 6, 6); ints_(c, 7, 3, 2, 0, 0, 1, 0, 1); return 0;
        case 2: c->what = "zero-size batch"; in_(c, k, 'r', 0, 4, 0, 3, 4, 4); ints_(c, 7, 2, 2, 0, 0, 0, 0, 0); return 0;
        default: return -1;
      }
    case DSP_OP_DROPOUT:
      switch (v) {
        case 0: c->what = "[6,7] p 0.3"; in_(c, k, 'r', 0, 2, 6, 7); ints_(c, 1, 42); fl_(c, 1, 0.3); return 0;
        case 1: c->what = "zero-size"; in_(c, k, 'r', 0, 2, 0, 7); ints_(c, 1, 42); fl_(c, 1, 0.3); return 0;
        default: return -1;
      }
    /* issue 23 embedding/norm: ints as in dsp.h, INT64_MIN = no padding */
    case DSP_OP_EMBEDDING:
      switch (v) {
        case 0: c->what = "[5,3] idx [2,4]"; in_(c, k, 'r', 0, 2, 5, 3); in_(c, I, 'i', 5, 2, 2, 4); c->a.ints[0] = INT64_MIN; c->a.n_ints = 1; return 0;
        case 1: c->what = "padding_idx 2, idx [7]"; in_(c, k, 'r', 0, 2, 5, 3); in_(c, I, 'i', 5, 1, 7); ints_(c, 1, 2); return 0;
        case 2: c->what = "no indices"; in_(c, k, 'r', 0, 2, 5, 3); in_(c, I, 'i', 5, 1, 0); ints_(c, 1, -1); return 0;
        default: return -1;
      }
    case DSP_OP_EMBEDDING_BACKWARD:
      switch (v) {
        case 0: c->what = "[2,4,3] into 5 rows"; in_(c, k, 'r', 0, 3, 2, 4, 3); in_(c, I, 'i', 5, 2, 2, 4); c->a.ints[0] = 5; c->a.ints[1] = INT64_MIN; c->a.n_ints = 2; return 0;
        case 1: c->what = "padding_idx -1"; in_(c, k, 'r', 0, 2, 9, 3); in_(c, I, 'i', 5, 1, 9); ints_(c, 2, 5, -1); return 0;
        default: return -1;
      }
    case DSP_OP_LAYER_NORM:
      switch (v) {
        case 0: c->what = "[4,6] affine"; in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 1, 6); in_(c, k, 'r', 0, 1, 6); ints_(c, 3, 1, 1, 1); fl_(c, 1, 1e-5); return 0;
        case 1: c->what = "[2,3,4] nlast 2"; in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 3, 2, 0, 0); fl_(c, 1, 1e-5); return 0;
        case 2: c->what = "[3,5] weight only"; in_(c, k, 'r', 0, 2, 3, 5); in_(c, k, 'r', 0, 1, 5); ints_(c, 3, 1, 1, 0); fl_(c, 1, 0.1); return 0;
        case 3: c->what = "zero-size [0,5] bias"; in_(c, k, 'r', 0, 2, 0, 5); in_(c, k, 'r', 0, 1, 5); ints_(c, 3, 1, 0, 1); fl_(c, 1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_LAYER_NORM_BACKWARD:
      switch (v) {
        case 0: c->what = "[4,6] affine"; in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 1, 6); ints_(c, 3, 1, 1, 1); fl_(c, 1, 1e-5); return 0;
        case 1: c->what = "[2,3,4] nlast 2"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 3, 2, 0, 0); fl_(c, 1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_RMS_NORM:
      switch (v) {
        case 0: c->what = "[4,6] weight"; in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 1, 6); ints_(c, 2, 1, 1); fl_(c, 1, 1e-5); return 0;
        case 1: c->what = "[2,3,4] nlast 2"; in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 2, 2, 0); fl_(c, 1, 1e-5); return 0;
        case 2: c->what = "zero-size [0,5]"; in_(c, k, 'r', 0, 2, 0, 5); ints_(c, 2, 1, 0); fl_(c, 1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_RMS_NORM_BACKWARD:
      switch (v) {
        case 0: c->what = "[4,6] weight"; in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 2, 4, 6); in_(c, k, 'r', 0, 1, 6); ints_(c, 2, 1, 1); fl_(c, 1, 1e-5); return 0;
        case 1: c->what = "[2,3,4] nlast 3"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 3, 2, 3, 4); ints_(c, 2, 3, 0); fl_(c, 1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_BATCH_NORM:
      switch (v) {
        case 0: c->what = "[4,3,5] training affine"; in_(c, k, 'r', 0, 3, 4, 3, 5); in_(c, k, 'r', 0, 1, 3); in_(c, k, 'r', 0, 1, 3); ints_(c, 4, 1, 0, 1, 1); fl_(c, 2, 0.1, 1e-5); return 0;
        case 1: c->what = "[6,2] training, running stats"; in_(c, k, 'r', 0, 2, 6, 2); in_(c, k, 'r', 0, 1, 2); in_(c, k, 'p', 0, 1, 2); ints_(c, 4, 1, 1, 0, 0); fl_(c, 2, 0.3, 1e-5); return 0;
        case 2: c->what = "[2,3,4] evaluation weight"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 1, 3); in_(c, k, 'p', 0, 1, 3); in_(c, k, 'r', 0, 1, 3); ints_(c, 4, 0, 1, 1, 0); fl_(c, 2, 0.1, 1e-5); return 0;
        case 3: c->what = "zero-size [0,3,4] evaluation"; in_(c, k, 'r', 0, 3, 0, 3, 4); in_(c, k, 'r', 0, 1, 3); in_(c, k, 'p', 0, 1, 3); ints_(c, 4, 0, 1, 0, 0); fl_(c, 2, 0.1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_BATCH_NORM_BACKWARD:
      switch (v) {
        case 0: c->what = "[4,3,5] training affine"; in_(c, k, 'r', 0, 3, 4, 3, 5); in_(c, k, 'r', 0, 3, 4, 3, 5); in_(c, k, 'r', 0, 1, 3); ints_(c, 4, 1, 0, 1, 1); fl_(c, 2, 0.1, 1e-5); return 0;
        case 1: c->what = "[2,3,4] evaluation bias"; in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 3, 2, 3, 4); in_(c, k, 'r', 0, 1, 3); in_(c, k, 'p', 0, 1, 3); ints_(c, 4, 0, 1, 0, 1); fl_(c, 2, 0.1, 1e-5); return 0;
        default: return -1;
      }
    case DSP_OP_ATTENTION:
      switch (v) {
        case 0: c->what = "q [2,2,5,3] k [2,2,4,3] v [2,2,4,2]"; in_(c, k, 'r', 0, 4, 2, 2, 5, 3); in_(c, k, 'r', 0, 4, 2, 2, 4, 3); in_(c, k, 'r', 0, 4, 2, 2, 4, 2); ints_(c, 2, 0, 0); fl_(c, 1, 0.0); return 0;
        case 1: c->what = "causal, key mask, scale 0.5, Tq 3 < Tk 6"; in_(c, k, 'r', 0, 4, 2, 1, 3, 4); in_(c, k, 'r', 0, 4, 2, 1, 6, 4); in_(c, k, 'r', 0, 4, 2, 1, 6, 3); in_(c, B, 'b', 0, 2, 2, 6); ints_(c, 2, 1, 1); fl_(c, 1, 0.5); return 0;
        case 2: c->what = "zero-size Tq"; in_(c, k, 'r', 0, 4, 1, 2, 0, 3); in_(c, k, 'r', 0, 4, 1, 2, 4, 3); in_(c, k, 'r', 0, 4, 1, 2, 4, 2); ints_(c, 2, 1, 0); fl_(c, 1, 0.0); return 0;
        default: return -1;
      }
    case DSP_OP_ATTENTION_BACKWARD:
      switch (v) {
        case 0: c->what = "grad [2,2,5,2]"; in_(c, k, 'r', 0, 4, 2, 2, 5, 2); in_(c, k, 'r', 0, 4, 2, 2, 5, 3); in_(c, k, 'r', 0, 4, 2, 2, 4, 3); in_(c, k, 'r', 0, 4, 2, 2, 4, 2); ints_(c, 2, 0, 0); fl_(c, 1, 0.0); return 0;
        case 1: c->what = "causal, key mask, Tq 7 > Tk 5"; in_(c, k, 'r', 0, 4, 2, 1, 7, 3); in_(c, k, 'r', 0, 4, 2, 1, 7, 4); in_(c, k, 'r', 0, 4, 2, 1, 5, 4); in_(c, k, 'r', 0, 4, 2, 1, 5, 3); in_(c, B, 'b', 0, 2, 2, 5); ints_(c, 2, 1, 1); fl_(c, 1, 0.0); return 0;
        default: return -1;
      }
    case DSP_OP_ZEROS: case DSP_OP_ONES: case DSP_OP_FULL:
      switch (v) {
        case 0: c->what = "[3,4]"; ints_(c, 3, k, 3, 4); break;
        case 1: c->what = "zero-size [0,4]"; ints_(c, 3, k, 0, 4); break;
        default: return -1;
      }
      if (op == DSP_OP_FULL) fl_(c, 1, 2.0);
      return 0;
    case DSP_OP_ARANGE:
      switch (v) {
        case 0: c->what = "1:10:2"; ints_(c, 1, k); fl_(c, 3, 1.0, 10.0, 2.0); return 0;
        case 1: c->what = "empty 5:5"; ints_(c, 1, k); fl_(c, 3, 5.0, 5.0, 1.0); return 0;
        default: return -1;
      }
    case DSP_OP_UNIFORM: case DSP_OP_NORMAL:
      switch (v) {
        case 0: c->what = "[5,7]"; ints_(c, 4, k, 7, 5, 7); break;
        case 1: c->what = "zero-size"; ints_(c, 4, k, 7, 0, 7); break;
        default: return -1;
      }
      if (op == DSP_OP_UNIFORM) fl_(c, 2, -1.0, 2.0);
      else fl_(c, 2, 0.5, 2.0);
      return 0;
    case DSP_OP_SGD_STEP:
      if (v) return -1;
      c->what = "[3,4]"; for (int i = 0; i < 3; i++) in_(c, k, 'r', 0, 2, 3, 4);
      fl_(c, 3, 0.1, 0.9, 0.01);
      return 0;
    case DSP_OP_ADAM_STEP:
      if (v) return -1;
      c->what = "[3,4]"; for (int i = 0; i < 3; i++) in_(c, k, 'r', 0, 2, 3, 4);
      in_(c, k, 'p', 0, 2, 3, 4);
      fl_(c, 4, 0.01, 0.9, 0.999, 1e-8);
      ints_(c, 1, 3);
      return 0;
    case DSP_OP_ADAMW_STEP: /* decay, then with a clip's gradient scale */
      if (v > 1) return -1;
      c->what = v ? "[3,4] scale 0.5" : "[3,4]";
      for (int i = 0; i < 3; i++) in_(c, k, 'r', 0, 2, 3, 4);
      in_(c, k, 'p', 0, 2, 3, 4);
      if (v) fl_(c, 6, 0.01, 0.9, 0.999, 1e-8, 0.1, 0.5);
      else fl_(c, 5, 0.01, 0.9, 0.999, 1e-8, 0.1);
      ints_(c, 1, 3);
      return 0;
    default:
      /* an op without cases fails the suite (see run_pair) */
      return -1;
  }
}

/* ------------------------------------------------------------------ */
/* values                                                              */

static uint64_t g_rng;
static double rnd01(void) {
  g_rng ^= g_rng << 13;
  g_rng ^= g_rng >> 7;
  g_rng ^= g_rng << 17;
  return (double)(g_rng >> 11) * 0x1p-53;
}

/* n values of domain dom as doubles, exactly representable in dt. */
static void fill_values(dsp_dtype dt, char dom, int64_t range, int64_t n,
                        double *v) {
  for (int64_t i = 0; i < n; i++) {
    double x;
    switch (dom) {
      case 'p': x = 0.5 + 1.5 * rnd01(); break;
      case 'n': x = (0.5 + 1.5 * rnd01()) * (rnd01() < 0.5 ? -1 : 1); break;
      case 'q': x = floor(rnd01() * 7) - 3; break;
      case 'i': x = floor(rnd01() * (double)range); break;
      case 'b': x = rnd01() < 0.5; break;
      default: x = 4 * rnd01() - 2; break;
    }
    if (dt == DSP_I64) {
      x = dom == 'i' ? x : dom == 'p' ? 1 + floor(4 * rnd01())
          : dom == 'n' ? (1 + floor(4 * rnd01())) * (rnd01() < 0.5 ? -1 : 1)
                       : floor(11 * rnd01()) - 5;
    } else if (dt == DSP_BOOL) {
      x = rnd01() < 0.5;
    } else if (dt == DSP_F32) {
      x = (double)(float)x;
    }
    v[i] = x;
  }
}

static void to_bytes(dsp_dtype dt, const double *v, int64_t n, void *out) {
  for (int64_t i = 0; i < n; i++) switch (dt) {
      case DSP_F32: ((float *)out)[i] = (float)v[i]; break;
      case DSP_F64: ((double *)out)[i] = v[i]; break;
      case DSP_I64: ((int64_t *)out)[i] = (int64_t)v[i]; break;
      case DSP_F16: ((uint16_t *)out)[i] = dsp_f64_to_f16(v[i]); break;
      case DSP_BF16: ((uint16_t *)out)[i] = dsp_f64_to_bf16(v[i]); break;
      default: ((uint8_t *)out)[i] = v[i] != 0; break;
    }
}

static double from_bytes(dsp_dtype dt, const void *p, int64_t i) {
  switch (dt) {
    case DSP_F32: return ((const float *)p)[i];
    case DSP_F64: return ((const double *)p)[i];
    case DSP_I64: return (double)((const int64_t *)p)[i];
    case DSP_F16: return dsp_f16_to_f32(((const uint16_t *)p)[i]);
    case DSP_BF16: return dsp_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return ((const uint8_t *)p)[i];
  }
}

static int64_t numel_of(const dsp_meta *m) {
  int64_t n = 1;
  for (int d = 0; d < m->ndim; d++) n *= m->shape[d];
  return n;
}

/* ------------------------------------------------------------------ */
/* running a case                                                      */

/* A result read back to the host, as doubles (exact for every dtype the
 * values take here). */
typedef struct hostval {
  int present;
  dsp_meta meta;
  int64_t n;
  double *v;
} hostval;

typedef struct run_out {
  int rc;
  char msg[600];
  hostval out;
  hostval state[2];   /* optimizer states after the step */
  int grad_rc;        /* 0, or the error of the backward pass */
  char grad_msg[600];
  int has_grads;      /* the output was tracked: gradients were taken */
  hostval grad[MAXIN];
} run_out;

static void hv_free(hostval *h) {
  free(h->v);
  memset(h, 0, sizeof *h);
}
static void ro_free(run_out *r) {
  hv_free(&r->out);
  for (int i = 0; i < 2; i++) hv_free(&r->state[i]);
  for (int i = 0; i < MAXIN; i++) hv_free(&r->grad[i]);
}

/* Reads t through its backend's copy_out. */
static void read_back(const dsp_tensor *t, hostval *h) {
  h->present = 1;
  h->meta = t->meta;
  h->n = t->numel;
  h->v = calloc((size_t)(h->n ? h->n : 1), sizeof(double));
  size_t nb = dsp_tensor_nbytes(t);
  void *buf = malloc(nb ? nb : 1);
  cr_assert(h->v && buf);
  if (nb) {
    const dsp_backend *be = t->storage->backend;
    cr_assert_eq(be->copy_out(be->bctx, buf, t->storage->data, nb), 0);
  }
  for (int64_t i = 0; i < h->n; i++) h->v[i] = from_bytes(t->meta.dtype, buf, i);
  free(buf);
}

/* The case with every input and attribute of dtype `from` moved to `to`:
 * the f64 reference of an f32 case. */
static tcase widen(const tcase *c, dsp_dtype from, dsp_dtype to) {
  tcase w = *c;
  for (int i = 0; i < w.n_in; i++)
    if (w.in[i].dtype == from) w.in[i].dtype = to;
  if (w.n_in == 0 && w.a.n_ints > 0 && w.a.ints[0] == from) w.a.ints[0] = to;
  return w;
}

/* Runs case c on be with input values vals[i] (doubles) and, when wv is
 * given and the output is a tracked float tensor, the gradients of
 * sum(out * w) with w's values from wv (as many as the output has). */
static void run_case(const dsp_backend *be, const tcase *c, double *const *vals,
                     const double *wv, run_out *r) {
  memset(r, 0, sizeof *r);
  dsp_ctx *ctx = ctx_on(be);
  dsp_tensor *in[MAXIN] = {0};
  int tracked = 0;
  for (int i = 0; i < c->n_in; i++) {
    int64_t n = numel_of(&c->in[i]);
    size_t nb = (size_t)n * dsp_dtype_size(c->in[i].dtype);
    void *buf = malloc(nb ? nb : 1);
    to_bytes(c->in[i].dtype, vals[i], n, buf);
    cr_assert_eq(dsp_tensor_from_data(ctx, &c->in[i], buf, nb, &in[i]), 0,
                 "%s", dsp_ctx_errmsg(ctx));
    free(buf);
    if (dsp_dtype_is_float(c->in[i].dtype) &&
        dsp_op_lookup((int)c->op)->family != DSP_FAM_OPTIM) {
      cr_assert_eq(dsp_track(ctx, in[i]), 0);
      tracked = 1;
    }
  }
  dsp_tensor *out = NULL;
  r->rc = dsp_op(ctx, c->op, in, c->n_in, &c->a, &out);
  snprintf(r->msg, sizeof r->msg, "%s", r->rc ? dsp_ctx_errmsg(ctx) : "");
  if (r->rc == 0) {
    read_back(out, &r->out);
    if (dsp_op_lookup((int)c->op)->family == DSP_FAM_OPTIM)
      for (int s = 2; s < c->n_in; s++) read_back(in[s], &r->state[s - 2]);
    if (wv && tracked && dsp_is_tracked(out)) {
      r->has_grads = 1;
      dsp_tensor *w = NULL, *pw = NULL, *loss = NULL;
      size_t nb = dsp_tensor_nbytes(out);
      void *buf = malloc(nb ? nb : 1);
      to_bytes(out->meta.dtype, wv, out->numel, buf);
      dsp_grads *g = NULL;
      int rc = dsp_tensor_from_data(ctx, &out->meta, buf, nb, &w);
      free(buf);
      dsp_tensor *mul_in[2] = {out, w};
      if (rc == 0) rc = dsp_op(ctx, DSP_OP_MUL, mul_in, 2, NULL, &pw);
      dsp_attrs none = dsp_attrs_none();
      if (rc == 0) rc = dsp_op(ctx, DSP_OP_SUM, &pw, 1, &none, &loss);
      if (rc == 0) rc = dsp_backward(ctx, loss, 0, &g);
      r->grad_rc = rc;
      snprintf(r->grad_msg, sizeof r->grad_msg, "%s", rc ? dsp_ctx_errmsg(ctx) : "");
      for (int i = 0; rc == 0 && i < c->n_in; i++) {
        if (!dsp_is_tracked(in[i])) continue;
        dsp_tensor *gi = NULL;
        if (dsp_grads_get(ctx, g, in[i], &gi) == 0) {
          read_back(gi, &r->grad[i]);
          dsp_tensor_unref(gi);
        }
      }
      dsp_grads_free(g);
      dsp_tensor_unref(loss);
      dsp_tensor_unref(pw);
      dsp_tensor_unref(w);
    }
  }
  dsp_tensor_unref(out);
  for (int i = 0; i < c->n_in; i++) dsp_tensor_unref(in[i]);
  dsp_ctx_free(ctx);
}

/* Compares got (computed in dtype dt) with the reference: exactly for
 * integer and bool results, by normalised mean square error for floats
 * (NaN and infinities must sit at the same places). 0 or 1 with why. */
static int compare(const char *what, dsp_dtype dt, const hostval *got,
                   const hostval *ref, char *why, size_t len) {
  if (!got->present || !ref->present) {
    snprintf(why, len, "%s: missing (%d/%d)", what, got->present, ref->present);
    return 1;
  }
  if (got->meta.ndim != ref->meta.ndim || got->n != ref->n ||
      memcmp(got->meta.shape, ref->meta.shape,
             sizeof(int64_t) * (size_t)got->meta.ndim) != 0) {
    char s1[128], s2[128];
    snprintf(why, len, "%s: shape %s, reference %s", what,
             dsp_shape_str(&got->meta, s1, sizeof s1),
             dsp_shape_str(&ref->meta, s2, sizeof s2));
    return 1;
  }
  if (!dsp_dtype_is_float(dt)) {
    for (int64_t i = 0; i < got->n; i++)
      if (got->v[i] != ref->v[i]) {
        snprintf(why, len, "%s: element %lld is %.17g, reference %.17g", what,
                 (long long)i, got->v[i], ref->v[i]);
        return 1;
      }
    return 0;
  }
  double num = 0, den = 0;
  for (int64_t i = 0; i < got->n; i++) {
    double a = got->v[i], b = ref->v[i];
    if (!isfinite(a) || !isfinite(b)) {
      if (!((isnan(a) && isnan(b)) || a == b)) {
        snprintf(why, len, "%s: element %lld is %g, reference %g", what,
                 (long long)i, a, b);
        return 1;
      }
      continue;
    }
    num += (a - b) * (a - b);
    den += b * b;
  }
  double nmse = den > 0 ? num / den : num;
  double tol = dt == DSP_F32 ? 1e-7 : 1e-14;
  if (nmse > tol) {
    snprintf(why, len, "%s: normalised mean square error %.3g over %.0g", what,
             nmse, tol);
    return 1;
  }
  return 0;
}


/* ------------------------------------------------------------------ */
/* an independent oracle                                               */

/* The CPU compared with itself cannot see a kernel that is wrong the same
 * way for every dtype (a case that falls through to a default and leaves
 * the zeroed output). For the families where that pattern lived
 * (elementwise, reductions) and for cast, the suite also computes each
 * result here, in double, straight from the op's definition in dsp.h. */

/* Offset of output element coordinates oc (rank on) in an input of meta m
 * broadcast to that output. */
static int64_t bcast_off(const dsp_meta *m, const int64_t *oc, int on) {
  int64_t off = 0;
  for (int d = 0; d < m->ndim; d++) {
    int od = on - m->ndim + d;
    off = off * m->shape[d] + (m->shape[d] == 1 ? 0 : oc[od]);
  }
  return off;
}

static void unflat(const dsp_meta *m, int64_t i, int64_t *c) {
  for (int d = m->ndim - 1; d >= 0; d--) {
    c[d] = m->shape[d] ? i % m->shape[d] : 0;
    if (m->shape[d]) i /= m->shape[d];
  }
}

static double phi_cdf(double x) { return 0.5 * (1 + erf(x / sqrt(2.0))); }

static double ew1(dsp_opcode op, dsp_dtype dt, double x, double y, double s) {
  int i64 = dt == DSP_I64;
  switch (op) {
    case DSP_OP_ADD: return x + y;
    case DSP_OP_SUB: return x - y;
    case DSP_OP_MUL: return x * y;
    case DSP_OP_DIV: return i64 ? trunc(x / y) : x / y;
    case DSP_OP_MAXIMUM: return x > y ? x : y;
    case DSP_OP_MINIMUM: return x < y ? x : y;
    case DSP_OP_EQ: return x == y;
    case DSP_OP_NE: return x != y;
    case DSP_OP_LT: return x < y;
    case DSP_OP_LE: return x <= y;
    case DSP_OP_GT: return x > y;
    case DSP_OP_GE: return x >= y;
    case DSP_OP_ADD_SCALAR: return x + s;
    case DSP_OP_SUB_SCALAR: return x - s;
    case DSP_OP_MUL_SCALAR: return x * s;
    case DSP_OP_DIV_SCALAR: return x / s;
    case DSP_OP_POW_SCALAR: return pow(x, s);
    case DSP_OP_RSUB_SCALAR: return s - x;
    case DSP_OP_RDIV_SCALAR: return s / x;
    case DSP_OP_NEG: return -x;
    case DSP_OP_EXP: return exp(x);
    case DSP_OP_LOG: return log(x);
    case DSP_OP_SQRT: return sqrt(x);
    case DSP_OP_ABS: return fabs(x);
    case DSP_OP_SIGN: return x > 0 ? 1 : x < 0 ? -1 : 0;
    case DSP_OP_RELU: return x > 0 ? x : 0;
    case DSP_OP_SIGMOID: return 1 / (1 + exp(-x));
    case DSP_OP_TANH: return tanh(x);
    case DSP_OP_GELU: return x * phi_cdf(x);
    case DSP_OP_SILU: return x / (1 + exp(-x));
    case DSP_OP_SOFTPLUS: return x > 20 ? x : log(1 + exp(x));
    case DSP_OP_GELU_TANH:
      return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
    /* (grad, x): x is y here */
    case DSP_OP_RELU_BACKWARD: return y > 0 ? x : 0;
    case DSP_OP_GELU_BACKWARD:
      return x * (phi_cdf(y) + y * exp(-0.5 * y * y) / sqrt(2 * M_PI));
    case DSP_OP_SOFTPLUS_BACKWARD: return y > 20 ? x : x / (1 + exp(-y));
    case DSP_OP_GELU_TANH_BACKWARD: {
      /* d/dy of 0.5 y (1 + tanh(u)), u = sqrt(2/pi) (y + 0.044715 y^3) */
      double k = sqrt(2 / M_PI), t = tanh(k * (y + 0.044715 * y * y * y));
      return x * (0.5 * (1 + t) +
                  0.5 * y * (1 - t * t) * k * (1 + 3 * 0.044715 * y * y));
    }
    default: return NAN;
  }
}

/* 1 and *o when the oracle knows op; 0 otherwise. */
static int oracle(const tcase *c, double *const *vals, hostval *o) {
  dsp_opcode op = c->op;
  dsp_op_family fam = dsp_op_lookup((int)op)->family;
  if (fam != DSP_FAM_EW && fam != DSP_FAM_RED && op != DSP_OP_CAST) return 0;
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta om;
  cr_assert_eq(dsp_op_infer(ctx, op, c->in, c->n_in, &c->a, &om), 0);
  dsp_ctx_free(ctx);
  memset(o, 0, sizeof *o);
  o->present = 1;
  o->meta = om;
  o->n = numel_of(&om);
  o->v = calloc((size_t)(o->n ? o->n : 1), sizeof(double));
  cr_assert_not_null(o->v);
  int64_t oc[DSP_MAX_DIMS];
  if (fam == DSP_FAM_EW || op == DSP_OP_CAST) {
    double s = c->a.n_floats ? c->a.floats[0] : 0;
    dsp_dtype dt = c->in[op == DSP_OP_WHERE ? 1 : 0].dtype;
    for (int64_t i = 0; i < o->n; i++) {
      unflat(&om, i, oc);
      double x = vals[0][bcast_off(&c->in[0], oc, om.ndim)];
      double y = c->n_in > 1 ? vals[1][bcast_off(&c->in[1], oc, om.ndim)] : 0;
      if (op == DSP_OP_WHERE)
        o->v[i] = x ? y : vals[2][bcast_off(&c->in[2], oc, om.ndim)];
      else if (op == DSP_OP_MASKED_FILL) /* (x, mask) */
        o->v[i] = y ? (dt == DSP_F32 ? (double)(float)s : s) : x;
      else if (op == DSP_OP_CLAMP) {
        double lo = c->a.floats[0], hi = c->a.floats[1];
        o->v[i] = fmin(fmax(x, lo), hi);
      }
      else if (op == DSP_OP_CAST)
        o->v[i] = om.dtype == DSP_BOOL ? x != 0
                  : om.dtype == DSP_I64 ? trunc(x)
                  : om.dtype == DSP_F32 ? (double)(float)x
                  : om.dtype == DSP_F16 ? dsp_f16_to_f32(dsp_f64_to_f16(x))
                  : om.dtype == DSP_BF16 ? dsp_bf16_to_f32(dsp_f64_to_bf16(x)) : x;
      else
        o->v[i] = ew1(op, dt, x, y, s);
    }
    return 1;
  }
  /* reductions: walk the input in row-major order; the output index
   * drops (or keeps as 0) the reduced coordinates, k counts positions
   * within the reduced dims in row-major order */
  const dsp_meta *x = &c->in[0];
  int red[DSP_MAX_DIMS] = {0};
  if (c->a.n_ints == 0)
    for (int d = 0; d < x->ndim; d++) red[d] = 1;
  for (int i = 0; i < c->a.n_ints; i++)
    red[(c->a.ints[i] + x->ndim) % x->ndim] = 1;
  double *best = calloc((size_t)(o->n ? o->n : 1), sizeof(double));
  int64_t *cnt = calloc((size_t)(o->n ? o->n : 1), sizeof(int64_t));
  int64_t xn = numel_of(x), xc[DSP_MAX_DIMS];
  for (int64_t i = 0; i < xn; i++) {
    unflat(x, i, xc);
    int64_t oi = 0, k = 0;
    for (int d = 0; d < x->ndim; d++) {
      if (red[d]) k = k * x->shape[d] + xc[d];
      else oi = oi * x->shape[d] + xc[d];
    }
    double v = vals[0][i];
    int mn = op == DSP_OP_MIN || op == DSP_OP_ARGMIN;
    if (op == DSP_OP_SUM || op == DSP_OP_MEAN || op == DSP_OP_VAR ||
        op == DSP_OP_STD)
      o->v[oi] += v;
    else if (cnt[oi] == 0 || (mn ? v < best[oi] : v > best[oi])) {
      best[oi] = v;
      o->v[oi] = (op == DSP_OP_MAX || op == DSP_OP_MIN) ? v : (double)k;
    }
    cnt[oi]++;
  }
  if (op == DSP_OP_MEAN || op == DSP_OP_VAR || op == DSP_OP_STD)
    for (int64_t i = 0; i < o->n; i++) o->v[i] = cnt[i] ? o->v[i] / (double)cnt[i] : NAN;
  if (op == DSP_OP_VAR || op == DSP_OP_STD) {
    /* a second walk: the squared deviations from those means, over
     * max(0, N - correction) */
    double *ss = calloc((size_t)(o->n ? o->n : 1), sizeof(double));
    cr_assert_not_null(ss);
    for (int64_t i = 0; i < xn; i++) {
      unflat(x, i, xc);
      int64_t oi = 0;
      for (int d = 0; d < x->ndim; d++)
        if (!red[d]) oi = oi * x->shape[d] + xc[d];
      double dv = vals[0][i] - o->v[oi];
      ss[oi] += dv * dv;
    }
    double corr = c->a.n_floats > 1 ? c->a.floats[1] : 1;
    for (int64_t i = 0; i < o->n; i++) {
      double den = fmax(0.0, (double)cnt[i] - corr);
      double var = cnt[i] ? ss[i] / den : NAN;
      o->v[i] = op == DSP_OP_STD ? sqrt(var) : var;
    }
    free(ss);
  }
  free(best);
  free(cnt);
  return 1;
}

/* ------------------------------------------------------------------ */
/* the walk                                                            */

enum { ST_NA, ST_PASS, ST_FWD, ST_UNSUP, ST_FAIL };
static const char *st_name[] = {"-", "pass", "pass(fwd)", "unsupported", "FAIL"};

typedef struct walk {
  const char *backend;
  int counts[5];
  char fails[8192];
  size_t flen;
  char unsup[4096];
  size_t ulen;
} walk;

static void note_fail(walk *w, const char *op, dsp_dtype dt, const char *what,
                      const char *why) {
  if (w->flen < sizeof w->fails - 1)
    w->flen += (size_t)snprintf(w->fails + w->flen, sizeof w->fails - w->flen,
                                "  %s %s x %s [%s]: %s\n", w->backend, op,
                                dsp_dtype_name(dt), what, why);
}

static const dsp_dtype g_dtypes[] = {DSP_F32, DSP_F64, DSP_I64, DSP_BOOL};
#define NDT 4

/* Runs every case of (op, k) on be; returns its table status. */
static int run_pair(walk *w, const dsp_backend *be, dsp_opcode op, dsp_dtype k) {
  const char *name = dsp_op_lookup((int)op)->name;
  tcase c;
  if (make_case(op, k, 0, &c) < 0) {
    note_fail(w, name, k, "-", "the suite has no case for this op");
    return ST_FAIL;
  }
  dsp_ctx *ictx = dsp_ctx_new(dsp_cpu_backend());
  dsp_meta om;
  int valid = dsp_op_infer(ictx, op, c.in, c.n_in, &c.a, &om) == 0;
  char imsg[600];
  snprintf(imsg, sizeof imsg, "%s", dsp_ctx_errmsg(ictx));
  int claim = valid ? be->supports_op(be->bctx, op, c.in, c.n_in, &om) : 0;
  if (!valid) {
    /* the op does not exist for this dtype: inference says so with a
     * dtype error, and no backend may claim it */
    dsp_meta fake = c.n_in ? c.in[0] : (dsp_meta){k, 0, {0}};
    int claims = be->supports_op(be->bctx, op, c.in, c.n_in, &fake);
    dsp_ctx_free(ictx);
    if (claims) {
      char why[700];
      snprintf(why, sizeof why, "supports_op claims a pair inference refuses (%s)", imsg);
      note_fail(w, name, k, c.what, why);
      return ST_FAIL;
    }
    return ST_NA;
  }
  dsp_ctx_free(ictx);
  int status = ST_PASS, any_grad = 0, grad_unsup = 0;
  for (int v = 0; make_case(op, k, v, &c) == 0; v++) {
    g_rng = 0x9E3779B97F4A7C15ull ^ ((uint64_t)op << 32) ^ ((uint64_t)k << 16) ^ (uint64_t)v;
    dsp_meta cm;
    dsp_ctx *cctx = dsp_ctx_new(dsp_cpu_backend());
    int crc = dsp_op_infer(cctx, op, c.in, c.n_in, &c.a, &cm);
    if (crc < 0) {
      char why[700];
      snprintf(why, sizeof why, "inference refuses the case: %s", dsp_ctx_errmsg(cctx));
      dsp_ctx_free(cctx);
      note_fail(w, name, k, c.what, why);
      return ST_FAIL;
    }
    dsp_ctx_free(cctx);
    if (be->supports_op(be->bctx, op, c.in, c.n_in, &cm) != claim) {
      note_fail(w, name, k, c.what, "supports_op answers differently for the same dtypes");
      return ST_FAIL;
    }
    double *vals[MAXIN] = {0};
    for (int i = 0; i < c.n_in; i++) {
      int64_t n = numel_of(&c.in[i]);
      vals[i] = malloc(sizeof(double) * (size_t)(n ? n : 1));
      fill_values(c.in[i].dtype, c.dom[i], c.range[i], n, vals[i]);
    }
    int64_t on = numel_of(&cm);
    double *wv = malloc(sizeof(double) * (size_t)(on ? on : 1));
    fill_values(dsp_dtype_is_float(cm.dtype) ? cm.dtype : DSP_F64, 'r', 0, on, wv);
    run_out got, ref;
    run_case(be, &c, vals, wv, &got);
    char why[1200] = "";
    int bad = 0;
    if (!claim) {
      /* refused: dsp_op must say so, naming the op and the backend */
      if (got.rc != DISPATCH_EUNSUPPORTED || !strstr(got.msg, name) ||
          !strstr(got.msg, be->name)) {
        snprintf(why, sizeof why, "refused by supports_op but dsp_op gave %d (%s)",
                 got.rc, got.msg);
        bad = 1;
      }
    } else if (got.rc != 0) {
      snprintf(why, sizeof why, "claimed but failed: %d (%s)", got.rc, got.msg);
      bad = 1;
    } else {
      /* the reference: the CPU backend, f64 in place of f32 */
      tcase rc = k == DSP_F32 ? widen(&c, DSP_F32, DSP_F64) : c;
      run_case(dsp_cpu_backend(), &rc, vals, wv, &ref);
      dsp_dtype odt = got.out.meta.dtype;
      if (ref.rc != 0) {
        snprintf(why, sizeof why, "the CPU reference failed: %s", ref.msg);
        bad = 1;
      } else if (compare("output", odt, &got.out, &ref.out, why, sizeof why)) {
        bad = 1;
      }
      hostval orc;
      if (!bad && oracle(&c, vals, &orc)) {
        char why2[600];
        if (compare("output against the oracle", odt, &got.out, &orc, why2,
                    sizeof why2)) {
          snprintf(why, sizeof why, "%s", why2);
          bad = 1;
        }
        hv_free(&orc);
      }
      for (int s = 0; !bad && s < 2; s++)
        if (got.state[s].present &&
            compare(s ? "second state" : "first state", odt, &got.state[s],
                    &ref.state[s], why, sizeof why))
          bad = 1;
      if (!bad && got.has_grads) {
        if (got.grad_rc == DISPATCH_EUNSUPPORTED && ref.grad_rc == DISPATCH_EUNSUPPORTED) {
          /* a backward helper: no higher-order gradients (stated) */
        } else if (got.grad_rc == DISPATCH_EUNSUPPORTED && ref.grad_rc == 0) {
          /* the backward pass needs an op x dtype the backend refuses:
           * listed with the refusals */
          grad_unsup = 1;
        } else if (got.grad_rc != 0 || ref.grad_rc != 0) {
          snprintf(why, sizeof why, "backward: %d (%.300s), reference %d (%.300s)",
                   got.grad_rc, got.grad_msg, ref.grad_rc, ref.grad_msg);
          bad = 1;
        } else {
          any_grad = 1;
          for (int i = 0; !bad && i < c.n_in; i++) {
            if (!got.grad[i].present && !ref.grad[i].present) continue;
            char what[32];
            snprintf(what, sizeof what, "gradient of input %d", i);
            bad = compare(what, got.grad[i].present ? got.grad[i].meta.dtype : odt,
                          &got.grad[i], &ref.grad[i], why, sizeof why);
          }
        }
      }
      ro_free(&ref);
    }
    ro_free(&got);
    for (int i = 0; i < c.n_in; i++) free(vals[i]);
    free(wv);
    if (bad) {
      note_fail(w, name, k, c.what, why);
      return ST_FAIL;
    }
    if (!claim) status = ST_UNSUP;
  }
  if (grad_unsup && status != ST_UNSUP && w->ulen < sizeof w->unsup - 1)
    w->ulen += (size_t)snprintf(w->unsup + w->ulen, sizeof w->unsup - w->ulen,
                                " %s:%s(gradient)", name, dsp_dtype_name(k));
  if (status == ST_UNSUP) {
    if (w->ulen < sizeof w->unsup - 1)
      w->ulen += (size_t)snprintf(w->unsup + w->ulen, sizeof w->unsup - w->ulen,
                                  " %s:%s", name, dsp_dtype_name(k));
    return ST_UNSUP;
  }
  return any_grad ? ST_PASS : ST_FWD;
}

/* Walks the whole op table on be, prints the table, returns the walk. */
static void walk_backend(const dsp_backend *be, walk *w) {
  memset(w, 0, sizeof *w);
  w->backend = be->name;
  static const dsp_opcode ops[] = {
#define OPCODE_(NAME, ...) DSP_OP_##NAME,
      DSP_OP_MAP(OPCODE_)
#undef OPCODE_
  };
  _Static_assert(sizeof ops / sizeof ops[0] == DSP__OP_COUNT, "op table walk");
  fprintf(stderr,
          "\nbackend %s (%s): op x dtype against the CPU backend, f64 as the reference\n"
          "  pass: forward and gradients match; pass(fwd): forward matches, no gradient\n"
          "  to check (integer or bool dtype, an op without one, or listed below as\n"
          "  OP:DTYPE(gradient) when the backward pass needs a pair the backend\n"
          "  refuses); unsupported: supports_op refuses and dsp_op says\n"
          "  DISPATCH_EUNSUPPORTED; -: inference refuses the dtype (not an op on it).\n"
          "  Cases: plain, broadcasting and zero-size shapes; tensors here are always\n"
          "  contiguous, so there are no non-contiguous views to test.\n",
          be->name, be->device);
  fprintf(stderr, "  %-24s", "op");
  for (int d = 0; d < NDT; d++) fprintf(stderr, " %-12s", dsp_dtype_name(g_dtypes[d]));
  fprintf(stderr, "\n");
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    fprintf(stderr, "  %-24s", dsp_op_lookup((int)ops[i])->name);
    for (int d = 0; d < NDT; d++) {
      int st = run_pair(w, be, ops[i], g_dtypes[d]);
      w->counts[st]++;
      fprintf(stderr, " %-12s", st_name[st]);
    }
    fprintf(stderr, "\n");
  }
  fprintf(stderr, "  %s: %d pass, %d pass(fwd), %d unsupported, %d FAIL, %d -\n",
          be->name, w->counts[ST_PASS], w->counts[ST_FWD], w->counts[ST_UNSUP],
          w->counts[ST_FAIL], w->counts[ST_NA]);
  if (w->ulen) fprintf(stderr, "  %s unsupported:%s\n", be->name, w->unsup);
  if (w->flen) fprintf(stderr, "  failures:\n%s", w->fails);
}

Test(backend_ops, conformance, .timeout = 300) {
  int ran = 0;
  for (size_t b = 0; b < sizeof g_backends / sizeof g_backends[0]; b++) {
    const dsp_backend *be = NULL;
    char why[256] = "";
    int rc = g_backends[b].open(&be, why, sizeof why);
    if (rc == 1) {
      fprintf(stderr, "\n%s: skipped (no GPU): %s\n", g_backends[b].name, why);
      continue;
    }
    cr_assert_eq(rc, 0, "%s: open failed: %s", g_backends[b].name, why);
    walk w;
    walk_backend(be, &w);
    if (g_backends[b].close) g_backends[b].close(be);
    cr_expect_eq(w.counts[ST_FAIL], 0, "%s: %d op x dtype pairs failed:\n%s",
                 g_backends[b].name, w.counts[ST_FAIL], w.fails);
    cr_expect_gt(w.counts[ST_PASS], 0, "%s: nothing passed", g_backends[b].name);
    ran++;
  }
  cr_assert_gt(ran, 0, "no backend ran");
}

/* ------------------------------------------------------------------ */
/* refusals are listed, not skipped                                    */

/* A test double: the CPU kernels behind a table that refuses every pair
 * whose key dtype is f64, as a backend without double support would. */
static int no_f64_supports(void *bctx, dsp_opcode op, const dsp_meta *in,
                           int n_in, const dsp_meta *out) {
  if (dsp__op_key_dtype(op, in, n_in, out) == DSP_F64) return 0;
  const dsp_backend *cpu = dsp_cpu_backend();
  return cpu->supports_op(bctx, op, in, n_in, out);
}

Test(backend_ops, refusals_are_listed_and_refused_by_dsp_op, .timeout = 300) {
  dsp_backend nof64 = *dsp_cpu_backend();
  nof64.name = "cpu-no-f64";
  nof64.device = "test double: the CPU kernels without f64";
  nof64.supports_op = no_f64_supports;
  walk w, cpu;
  walk_backend(&nof64, &w);
  walk_backend(dsp_cpu_backend(), &cpu);
  cr_assert_eq(w.counts[ST_FAIL], 0, "%s", w.fails);
  /* every f64 pair the CPU runs is listed as unsupported, the rest pass */
  int f64_pairs = 0;
  static const dsp_opcode ops[] = {
#define OPCODE_(NAME, ...) DSP_OP_##NAME,
      DSP_OP_MAP(OPCODE_)
#undef OPCODE_
  };
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    tcase c;
    make_case(ops[i], DSP_F64, 0, &c);
    dsp_meta om;
    dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
    f64_pairs += dsp_op_infer(ctx, ops[i], c.in, c.n_in, &c.a, &om) == 0;
    dsp_ctx_free(ctx);
  }
  cr_assert_gt(f64_pairs, 0);
  cr_assert_eq(w.counts[ST_UNSUP], f64_pairs);
  cr_assert_eq(w.counts[ST_PASS] + w.counts[ST_FWD] + w.counts[ST_UNSUP],
               cpu.counts[ST_PASS] + cpu.counts[ST_FWD]);
  cr_assert(strstr(w.unsup, " matmul:f64") && strstr(w.unsup, " zeros:f64"),
            "%s", w.unsup);
  /* the message names the op, the dtypes and the backend */
  dsp_ctx *ctx = ctx_on(&nof64);
  int64_t sh[2] = {2, 3};
  double d[6] = {1, 2, 3, 4, 5, 6};
  dsp_meta m = {DSP_F64, 2, {2, 3}};
  dsp_tensor *x = NULL, *y = NULL;
  cr_assert_eq(dsp_tensor_from_data(ctx, &m, d, sizeof d, &x), 0);
  dsp_tensor *in2[2] = {x, x};
  int rc = dsp_op(ctx, DSP_OP_ADD, in2, 2, NULL, &y);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED);
  cr_assert_null(y);
  cr_assert_str_eq(dsp_ctx_errmsg(ctx),
                   "add: backend cpu-no-f64 has no kernel for inputs (f64, "
                   "f64) -> f64");
  (void)sh;
  dsp_tensor_unref(x);
  dsp_ctx_free(ctx);
}

/* ------------------------------------------------------------------ */
/* a kernel reached without a loop refuses                             */

/* Every op x dtype the CPU table refuses, handed straight to the CPU
 * backend's run_op (past inference and supports_op, as a bug in either
 * would): the kernel must fail, never succeed with the zeroed output.
 * Before, elementwise kernels ended in `default: break; ... return 0`: exp,
 * log, sqrt, sigmoid, tanh, gelu and the float-only scalar forms on i64
 * or bool, the arithmetic ops on bool, and mean on i64 (run as a sum)
 * all returned 0. */
#if DSP_CUDA_BUILT
/* The CUDA backend's own op x dtype table (common/cuda/supports.c),
 * checked on any host that built it, GPU or not: it claims no pair that
 * inference refuses, and none the CPU does not run (the GPU conformance
 * walk needs the CPU's result as its reference). Pairs the CPU runs and
 * CUDA does not are listed. */
Test(backend_ops, cuda_table_claims_only_valid_pairs) {
  static const dsp_opcode ops[] = {
#define OPCODE_(NAME, ...) DSP_OP_##NAME,
      DSP_OP_MAP(OPCODE_)
#undef OPCODE_
  };
  const dsp_backend *cpu = dsp_cpu_backend();
  const dsp_cuda_plugin *cu;
  char why[1600];
  sp_use_build_plugin();
  cr_assert_eq(dsp_cuda_plugin_load(&cu, why, sizeof why), 0, "%s", why);
  int claimed = 0;
  char cpu_only[1024] = "";
  size_t cl = 0;
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    for (int d = 0; d < NDT; d++) {
      dsp_opcode op = ops[i];
      dsp_dtype k = g_dtypes[d];
      const char *name = dsp_op_lookup((int)op)->name;
      tcase c;
      cr_assert_eq(make_case(op, k, 0, &c), 0);
      dsp_ctx *ictx = dsp_ctx_new(dsp_cpu_backend());
      dsp_meta om = {k, 0, {0}};
      int valid = dsp_op_infer(ictx, op, c.in, c.n_in, &c.a, &om) == 0;
      dsp_ctx_free(ictx);
      if (!valid) om = (dsp_meta){k, 0, {0}};
      int cu_has = cu->has_kernel(op, dsp__op_key_dtype(op, c.in, c.n_in, &om));
      int cp = valid && cpu->supports_op(cpu->bctx, op, c.in, c.n_in, &om);
      cr_assert(!cu_has || valid, "cuda claims %s x %s, which inference refuses",
                name, dsp_dtype_name(k));
      cr_assert(!cu_has || cp, "cuda claims %s x %s, which the CPU does not run",
                name, dsp_dtype_name(k));
      claimed += cu_has;
      if (cp && !cu_has && cl < sizeof cpu_only)
        cl += (size_t)snprintf(cpu_only + cl, sizeof cpu_only - cl, " %s:%s",
                               name, dsp_dtype_name(k));
    }
  cr_assert_gt(claimed, 0);
  fprintf(stderr, "\ncuda table: %d op x dtype pairs claimed, all valid and "
          "run by the CPU too; CPU only:%s\n", claimed,
          cl ? cpu_only : " none");
}
#endif

Test(backend_ops, kernels_refuse_what_they_have_no_loop_for) {
  const dsp_backend *be = dsp_cpu_backend();
  static const dsp_opcode ops[] = {
#define OPCODE_(NAME, ...) DSP_OP_##NAME,
      DSP_OP_MAP(OPCODE_)
#undef OPCODE_
  };
  int checked = 0, unsupported = 0;
  char bad[4096] = "";
  size_t blen = 0;
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    for (int d = 0; d < NDT; d++) {
      dsp_dtype k = g_dtypes[d];
      tcase c;
      cr_assert_eq(make_case(ops[i], DSP_F32, 0, &c), 0);
      dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
      dsp_meta om;
      cr_assert_eq(dsp_op_infer(ctx, ops[i], c.in, c.n_in, &c.a, &om), 0);
      tcase kc = widen(&c, DSP_F32, k);
      if (om.dtype == DSP_F32) om.dtype = k;
      if (be->supports_op(be->bctx, ops[i], kc.in, kc.n_in, &om)) {
        dsp_ctx_free(ctx);
        continue;
      }
      dsp_tensor *in[MAXIN] = {0}, *out = NULL;
      for (int j = 0; j < kc.n_in; j++)
        cr_assert_eq(dsp_tensor_new(ctx, &kc.in[j], &in[j]), 0);
      cr_assert_eq(dsp_tensor_new(ctx, &om, &out), 0);
      /* valid values where a kernel checks them (indexes, labels: 0) */
      int rc = be->run_op(be->bctx, ctx, ops[i], in, kc.n_in, &kc.a, out);
      checked++;
      unsupported += rc == DISPATCH_EUNSUPPORTED;
      if (rc >= 0 && blen < sizeof bad - 1)
        blen += (size_t)snprintf(bad + blen, sizeof bad - blen, " %s:%s",
                                 dsp_op_lookup((int)ops[i])->name,
                                 dsp_dtype_name(k));
      for (int j = 0; j < kc.n_in; j++) dsp_tensor_unref(in[j]);
      dsp_tensor_unref(out);
      dsp_ctx_free(ctx);
    }
  fprintf(stderr, "\nCPU kernels reached with %d refused op x dtype pairs: "
          "%d DISPATCH_EUNSUPPORTED, %d other errors, succeeded:%s\n",
          checked, unsupported, checked - unsupported, blen ? bad : " none");
  cr_assert_gt(checked, 0);
  cr_assert_eq(blen, 0, "kernels succeeded without a loop:%s", bad);
}

/* ------------------------------------------------------------------ */
/* through dispatch-server                                             */

/* Every pair the CPU claims, every case, through a real dispatch-server on
 * 127.0.0.1: the inputs are uploaded, the op runs on the server's backend,
 * the result comes back by a Read, and its bytes must equal the in-process
 * run's (the same kernels, so bit for bit). The optimizer ops travel as
 * Step requests over a gradients container, not as Op; they are listed
 * and left to test_server_*. */
Test(backend_ops, every_claimed_pair_through_dispatch_server, .timeout = 300) {
  sp_server srv;
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&srv, args), 0, "server did not start");
  wire_conn w;
  cr_assert_eq(wire_connect(&w, srv.port), 0);
  cr_assert_eq(wire_hello(&w, "backend-ops"), 0);
  const dsp_backend *be = dsp_cpu_backend();
  static const dsp_opcode ops[] = {
#define OPCODE_(NAME, ...) DSP_OP_##NAME,
      DSP_OP_MAP(OPCODE_)
#undef OPCODE_
  };
  int pairs = 0, cases = 0;
  char left[512] = "";
  size_t llen = 0;
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++)
    for (int d = 0; d < NDT; d++) {
      dsp_opcode op = ops[i];
      dsp_dtype k = g_dtypes[d];
      const char *name = dsp_op_lookup((int)op)->name;
      tcase c;
      cr_assert_eq(make_case(op, k, 0, &c), 0);
      dsp_ctx *ictx = dsp_ctx_new(dsp_cpu_backend());
      dsp_meta om;
      int valid = dsp_op_infer(ictx, op, c.in, c.n_in, &c.a, &om) == 0;
      dsp_ctx_free(ictx);
      if (!valid || !be->supports_op(be->bctx, op, c.in, c.n_in, &om)) continue;
      if (dsp_op_lookup((int)op)->family == DSP_FAM_OPTIM) {
        llen += (size_t)snprintf(left + llen, sizeof left - llen, " %s:%s",
                                 name, dsp_dtype_name(k));
        continue;
      }
      pairs++;
      for (int v = 0; make_case(op, k, v, &c) == 0; v++) {
        g_rng = 0x51ED2701ull ^ ((uint64_t)op << 32) ^ ((uint64_t)k << 16) ^ (uint64_t)v;
        double *vals[MAXIN] = {0};
        uint64_t ids[MAXIN];
        for (int j = 0; j < c.n_in; j++) {
          int64_t n = numel_of(&c.in[j]);
          size_t nb = (size_t)n * dsp_dtype_size(c.in[j].dtype);
          vals[j] = malloc(sizeof(double) * (size_t)(n ? n : 1));
          fill_values(c.in[j].dtype, c.dom[j], c.range[j], n, vals[j]);
          void *buf = malloc(nb ? nb : 1);
          to_bytes(c.in[j].dtype, vals[j], n, buf);
          ids[j] = (uint64_t)j + 1;
          cr_assert_neq(wire_upload(&w, ids[j], c.in[j].dtype, c.in[j].ndim,
                                    c.in[j].shape, buf, nb), 0);
          free(buf);
        }
        wire_op(&w, op, ids, c.n_in, 10, c.a.ints, c.a.n_ints, c.a.floats,
                c.a.n_floats);
        char msg[700] = "";
        int rc = wire_sync_check(&w, msg, sizeof msg, NULL);
        cr_assert_eq(rc, 0, "%s x %s [%s]: remote: %d %s", name,
                     dsp_dtype_name(k), c.what, rc, msg);
        void *data = NULL;
        size_t nb = 0;
        int ndim = -1;
        int64_t shape[DSP_MAX_DIMS];
        cr_assert_eq(wire_read_tensor(&w, 10, &data, &nb, &ndim, shape), 0);
        run_out loc;
        run_case(be, &c, vals, NULL, &loc);
        cr_assert_eq(loc.rc, 0, "%s: %s", name, loc.msg);
        cr_assert_eq(ndim, loc.out.meta.ndim, "%s [%s]: rank", name, c.what);
        cr_assert_eq(nb, (size_t)loc.out.n * dsp_dtype_size(loc.out.meta.dtype),
                     "%s x %s [%s]: bytes", name, dsp_dtype_name(k), c.what);
        for (int dd = 0; dd < ndim; dd++)
          cr_assert_eq(shape[dd], loc.out.meta.shape[dd]);
        for (int64_t e = 0; e < loc.out.n; e++) {
          double r = from_bytes(loc.out.meta.dtype, data, e), l = loc.out.v[e];
          cr_assert(r == l || (isnan(r) && isnan(l)),
                    "%s x %s [%s]: element %lld is %.17g remote, %.17g local",
                    name, dsp_dtype_name(k), c.what, (long long)e, r, l);
        }
        ro_free(&loc);
        free(data);
        uint64_t all[MAXIN + 1] = {10};
        for (int j = 0; j < c.n_in; j++) all[j + 1] = ids[j];
        wire_free(&w, all, c.n_in + 1, NULL, 0);
        for (int j = 0; j < c.n_in; j++) free(vals[j]);
        cases++;
      }
    }
  cr_assert_eq(wire_sync_check(&w, NULL, 0, NULL), 0);
  fprintf(stderr, "\nthrough dispatch-server: %d op x dtype pairs (%d cases) "
          "match the in-process run bit for bit; left to test_server_* (sent "
          "as Step):%s\n", pairs, cases, left);
  wire_close(&w);
  cr_assert_eq(sp_stop(&srv), 0, "server exit status");
}
