/* bench attention: one forward and backward of causal self-attention on
 * the LOCAL kind, the fused op (dispatch_attention, its backward fused
 * too) against the unfused composition in dispatch itself (matmul with
 * k^T, scale, add a causal -inf bias, softmax, matmul with v; its backward
 * through the same autodiff), at T = 64, 256, 1024 (B = 4, 2, 1; H = 4,
 * d = 32, f32), with the gradients of q, k and v taken each time.
 *
 * Rows per size: the time of one forward+backward (medians over paired
 * repetitions in rotating order, bench.h), and the peak memory of one:
 * the process's peak resident set (VmHWM, reset through
 * /proc/self/clear_refs before each variant) above its resident set just
 * before, with the LOCAL storage cache off and glibc's mmap threshold
 * fixed at 64 KiB so large blocks go back to the system when freed. The
 * unfused graph holds several [B, H, T, T] tensors (scores, scaled,
 * biased, softmax, and their gradients); the fused op min(64, T) * T
 * scores per head at a time. No goals: the rows report. */
#include <malloc.h>

#include "bench.h"

#define MIN_REPS 5
#define MAX_REPS 15
#define BUDGET_S 20.0

typedef struct shape {
  int64_t B, H, T, d;
} shape;

/* the host values of q, k, v and the causal bias (uploaded once) */
typedef struct inputs {
  dispatch_device *dev;
  shape s;
  float *h[3];
  dispatch_tensor *bias;
} inputs;

static float *rand_f32(size_t n, unsigned seed) {
  float *p = malloc(n * sizeof *p);
  if (!p) {
    fprintf(stderr, "attention: out of memory\n");
    exit(1);
  }
  for (size_t i = 0; i < n; i++) {
    seed = seed * 1103515245u + 12345u;
    p[i] = (float)((seed >> 8) & 0xffff) / 65536.0f - 0.5f;
  }
  return p;
}

static int make_inputs(dispatch_device *dev, shape s, inputs *in) {
  memset(in, 0, sizeof *in);
  in->dev = dev, in->s = s;
  int64_t bs[2] = {s.T, s.T};
  size_t n = (size_t)(s.B * s.H * s.T * s.d);
  for (int i = 0; i < 3; i++) in->h[i] = rand_f32(n, 7u + (unsigned)i);
  float *b = malloc((size_t)(s.T * s.T) * sizeof *b);
  if (!b) return DISPATCH_ENOMEM;
  for (int64_t i = 0; i < s.T; i++)
    for (int64_t j = 0; j < s.T; j++) b[i * s.T + j] = j <= i ? 0.0f : -INFINITY;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F32, 2, bs, b,
                                     (size_t)(s.T * s.T) * sizeof *b, &in->bias);
  free(b);
  return rc;
}

static void free_inputs(inputs *in) {
  for (int i = 0; i < 3; i++) free(in->h[i]);
  dispatch_tensor_free(in->bias);
}

/* Fresh tracked leaves q, k, v (a leaf is wrapped once), made before a
 * step's clock starts; 0 or the error. */
static int leaves(const inputs *in, dispatch_tensor *x[3]) {
  const shape s = in->s;
  int64_t sh[4] = {s.B, s.H, s.T, s.d};
  size_t nb = (size_t)(s.B * s.H * s.T * s.d) * sizeof(float);
  int rc = 0;
  for (int i = 0; i < 3; i++) x[i] = NULL;
  for (int i = 0; i < 3 && rc == 0; i++) {
    dispatch_tensor *t = NULL;
    rc = dispatch_tensor_from_data(in->dev, DISPATCH_F32, 4, sh, in->h[i], nb, &t);
    if (rc == 0) rc = dispatch_autodiff(t, &x[i]);
    dispatch_tensor_free(t);
  }
  return rc;
}

/* softmax(q k^T / sqrt(d) + bias) v from the library's own ops */
static int unfused(const inputs *in, dispatch_tensor *q, dispatch_tensor *k,
                   dispatch_tensor *v, dispatch_tensor **out) {
  dispatch_tensor *kt = NULL, *s = NULL, *ss = NULL, *sb = NULL, *p = NULL;
  int rc = dispatch_transpose(k, -2, -1, &kt);
  if (rc == 0) rc = dispatch_matmul(q, kt, &s);
  if (rc == 0) rc = dispatch_mul_scalar(s, 1.0 / sqrt((double)in->s.d), &ss);
  if (rc == 0) rc = dispatch_add(ss, in->bias, &sb);
  if (rc == 0) rc = dispatch_softmax(sb, -1, &p);
  if (rc == 0) rc = dispatch_matmul(p, v, out);
  dispatch_tensor *tmp[] = {kt, s, ss, sb, p};
  for (size_t i = 0; i < sizeof tmp / sizeof tmp[0]; i++)
    dispatch_tensor_free(tmp[i]);
  return rc;
}

/* One forward and backward (fused or not) from the leaves x, with the
 * three gradients fetched; 0 or the error. */
static int step(const inputs *in, int fused, dispatch_tensor *const x[3]) {
  dispatch_tensor *o = NULL, *l = NULL, *g = NULL;
  dispatch_grads *gr = NULL;
  int rc = fused ? dispatch_attention(x[0], x[1], x[2], NULL, 1, 0.0, &o)
                 : unfused(in, x[0], x[1], x[2], &o);
  if (rc == 0) rc = dispatch_sum(o, 0, NULL, 0, &l);
  if (rc == 0) rc = dispatch_backward(l, &gr);
  for (int i = 0; i < 3 && rc == 0; i++) {
    rc = dispatch_grad(gr, x[i], &g);
    dispatch_tensor_free(g);
    g = NULL;
  }
  dispatch_grads_free(gr);
  dispatch_tensor_free(l);
  dispatch_tensor_free(o);
  return rc;
}

/* leaves, then one timed step; seconds, or NAN with the error in *rc */
static double timed_step(const inputs *in, int fused, int *rc) {
  dispatch_tensor *x[3];
  double t = NAN;
  *rc = leaves(in, x);
  if (*rc == 0) {
    double t0 = bench_now();
    *rc = step(in, fused, x);
    t = bench_now() - t0;
  }
  for (int i = 0; i < 3; i++) dispatch_tensor_free(x[i]);
  return *rc == 0 ? t : NAN;
}

/* kB field `key` of /proc/self/status as bytes, or -1 */
static long long status_bytes(const char *key) {
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return -1;
  char line[256];
  long long v = -1;
  size_t kl = strlen(key);
  while (fgets(line, sizeof line, f))
    if (strncmp(line, key, kl) == 0 && line[kl] == ':') {
      v = strtoll(line + kl + 1, NULL, 10) * 1024;
      break;
    }
  fclose(f);
  return v;
}

/* Peak resident bytes one step adds, or NAN with why set. */
static double peak_of(const inputs *in, int fused, char *why, size_t wl) {
  if (why[0]) return NAN;
  long long base = status_bytes("VmRSS");
  FILE *f = fopen("/proc/self/clear_refs", "w");
  int ok = f && fputs("5", f) >= 0;
  if (f) ok = fclose(f) == 0 && ok;
  if (!ok || base < 0) {
    snprintf(why, wl, "cannot reset the peak RSS (/proc/self/clear_refs)");
    return NAN;
  }
  int rc;
  timed_step(in, fused, &rc);
  long long hwm = status_bytes("VmHWM");
  if (rc < 0) {
    snprintf(why, wl, "%s: %s", dispatch_err_name(rc),
             dispatch_device_errmsg(in->dev));
    return NAN;
  }
  return hwm < base ? 0.0 : (double)(hwm - base) / 1048576.0;
}

static void bench_size(dispatch_device *dev, shape s) {
  char why[600] = "", metric[160];
  inputs in;
  int rc = make_inputs(dev, s, &in);
  if (rc < 0)
    snprintf(why, sizeof why, "inputs: %s: %s", dispatch_err_name(rc),
             dispatch_device_errmsg(dev));
  /* one of each first: the BLAS threads and the allocator warm up */
  for (int f = 0; f < 2 && !why[0]; f++)
    if (timed_step(&in, f, &rc), rc < 0)
      snprintf(why, sizeof why, "%s: %s: %s", f ? "fused" : "unfused",
               dispatch_err_name(rc), dispatch_device_errmsg(dev));
  double ours[MAX_REPS], ref[MAX_REPS];
  int n = 0;
  const int max_reps = bench_quick() ? 2 : MAX_REPS,
            min_reps = bench_quick() ? 1 : MIN_REPS;
  double t_start = bench_now();
  while (!why[0] && bench_more(n, min_reps, max_reps, bench_now() - t_start,
                               BUDGET_S, 0)) {
    for (int k = 0; k < 2; k++) {
      int fused = bench_turn(n, k, 2);
      double t = timed_step(&in, fused, &rc);
      if (rc < 0) {
        snprintf(why, sizeof why, "%s: %s", dispatch_err_name(rc),
                 dispatch_device_errmsg(dev));
        break;
      }
      (fused ? ours : ref)[n] = t * 1e3;
    }
    if (!why[0]) n++;
  }
  if (why[0] || n == 0) {
    ours[0] = ref[0] = NAN;
    n = 1;
  }
  snprintf(metric, sizeof metric,
           "fwd+bwd causal B%lld H%lld T%lld d%lld f32 local: fused",
           (long long)s.B, (long long)s.H, (long long)s.T, (long long)s.d);
  bench_def d = {"attention", metric, "ms", 1,
                 "unfused matmul-softmax-matmul", 0, BENCH_GOAL_NONE, 0};
  bench_emit(&d, ours, ref, n, why[0] ? "%s" : NULL, why);
  double pf = peak_of(&in, 1, why, sizeof why);
  double pu = peak_of(&in, 0, why, sizeof why);
  snprintf(metric, sizeof metric,
           "peak memory fwd+bwd causal B%lld H%lld T%lld d%lld: fused",
           (long long)s.B, (long long)s.H, (long long)s.T, (long long)s.d);
  bench_def m = {"attention", metric, "MiB", 1,
                 "unfused matmul-softmax-matmul", 0, BENCH_GOAL_NONE, 0};
  char note[700];
  snprintf(note, sizeof note, "%s",
           why[0] ? why : "peak RSS of one step above the RSS before it");
  bench_emit1(&m, pf, pu, note);
  free_inputs(&in);
}

int main(void) {
  /* large blocks always mmapped and returned at free, so the peak of a
   * step is not hidden in (or inflated by) memory an earlier one left */
  mallopt(M_MMAP_THRESHOLD, 64 * 1024);
  char why[512] = "";
  dispatch_device *dev = bench_open("local", why, sizeof why);
  if (dev) dispatch_device_set_cache(dev, 0);
  static const shape full[3] = {{4, 4, 64, 32}, {2, 4, 256, 32}, {1, 4, 1024, 32}};
  /* quick: still large enough that the unfused scores are mmapped blocks */
  static const shape quick[3] = {{2, 4, 64, 32}, {1, 4, 128, 32}, {1, 4, 256, 32}};
  for (int i = 0; i < 3; i++) {
    if (!dev) {
      fprintf(stderr, "attention: %s\n", why);
      break;
    }
    bench_size(dev, bench_quick() ? quick[i] : full[i]);
  }
  dispatch_device_close(dev);
  return dev ? 0 : 1;
}
