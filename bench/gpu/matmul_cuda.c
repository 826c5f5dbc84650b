/* make bench-gpu: matmul through the CUDA backend (dsp_op on a ctx bound
 * to cuda:0, output allocated from the stream-ordered pool each time)
 * beside cuBLAS called directly on preallocated buffers, both timed on the
 * GPU with the same stream synchronisation, in two sizes and dtypes:
 * 4096 x 4096 f32 (cublasSgemm) and 8192 x 8192 bf16 (cublasGemmEx with
 * CUBLAS_COMPUTE_32F on the tensor cores, the handle set as the backend
 * sets its own: no half-precision split-K reductions). Prints each figure
 * beside the goal (backend >= 90% of direct cuBLAS). With
 * DISPATCH_BENCH_REMOTE naming a dispatch-server whose devices include
 * cuda:0 (scripts/gpu.sh starts one), also the remote matmul of each: inputs
 * made on the server (bf16: uniform f32 cast there), one sample the matmul
 * request plus a sync, the product left there (goal: >= 90% of direct
 * cuBLAS, measured in the same run). Without a GPU: "cuda: skipped (no
 * GPU): REASON", exit 0. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "cuda_plugin.h"

#define REPS 20

/* one row of the bench: its size and dtype */
typedef struct mm_size {
  int n;
  dsp_dtype dt;
} mm_size;

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The remote matmul row of size s: 1 when it fails, 0 otherwise (also
 * when no server is named: the row says so). */
static int remote_row(const mm_size *s, double best_direct, double flop) {
  const char *spec = getenv("DISPATCH_BENCH_REMOTE");
  const char *dn = dsp_dtype_name(s->dt);
  if (!spec || !*spec) {
    printf("matmul %dx%d %s remote cuda:0:  n/a (DISPATCH_BENCH_REMOTE unset; "
           "scripts/gpu.sh bench sets it)\n", s->n, s->n, dn);
    return 0;
  }
  char msg[512] = "", full[300];
  snprintf(full, sizeof full, "%s/cuda:0", spec);
  dispatch_device *dev = NULL;
  dispatch_tensor *a = NULL, *b = NULL, *c = NULL, *a32 = NULL, *b32 = NULL;
  int64_t shape[2] = {s->n, s->n};
  int rc = dispatch_device_open(full, NULL, &dev, msg, sizeof msg);
  if (rc == 0) rc = dispatch_uniform(dev, DISPATCH_F32, 2, shape, -1, 1, 7, &a32);
  if (rc == 0) rc = dispatch_uniform(dev, DISPATCH_F32, 2, shape, -1, 1, 8, &b32);
  if (rc == 0 && s->dt == DSP_F32) a = a32, b = b32, a32 = b32 = NULL;
  else if (rc == 0) {
    rc = dispatch_cast(a32, (dispatch_dtype)s->dt, &a);
    if (rc == 0) rc = dispatch_cast(b32, (dispatch_dtype)s->dt, &b);
  }
  if (rc == 0) rc = dispatch_device_sync(dev);
  dispatch_tensor_free(a32);
  dispatch_tensor_free(b32);
  if (rc < 0) {
    printf("matmul %s remote: setup on %s failed: %s\n", dn, full,
           dev ? dispatch_device_errmsg(dev) : msg);
    dispatch_tensor_free(a);
    dispatch_tensor_free(b);
    dispatch_device_close(dev);
    return 1;
  }
  double best = 1e30;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    rc = dispatch_matmul(a, b, &c);
    if (rc == 0) rc = dispatch_device_sync(dev);
    double t = now() - t0;
    if (rc < 0) {
      printf("matmul %s remote: %s\n", dn, dispatch_device_errmsg(dev));
      dispatch_device_close(dev);
      return 1;
    }
    dispatch_tensor_free(c);
    if (r > 0 && t < best) best = t;
  }
  printf("matmul %dx%d %s remote cuda:0:  %8.3f ms  %8.1f GFLOP/s  %5.1f%% of direct (goal >= 90%%)\n",
         s->n, s->n, dn, best * 1e3, flop / best * 1e-9, 100.0 * best_direct / best);
  dispatch_tensor_free(a);
  dispatch_tensor_free(b);
  dispatch_device_close(dev);
  return 0;
}

/* cuBLAS on the backend's inputs into c: Sgemm for f32, GemmEx (f32
 * compute) for the half types; the same column-major call as the backend's
 * row-major product */
static cublasStatus_t direct_gemm(cublasHandle_t h, const mm_size *s,
                                  const void *a, const void *b, void *c) {
  const float one = 1, zero = 0;
  const int n = s->n;
  if (s->dt == DSP_F32)
    return cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, n, a, n,
                       &zero, c, n);
  const cudaDataType_t t = s->dt == DSP_F16 ? CUDA_R_16F : CUDA_R_16BF;
  return cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, b, t, n, a,
                      t, n, &zero, c, t, n, CUBLAS_COMPUTE_32F,
                      CUBLAS_GEMM_DEFAULT);
}

/* The rows of size s: backend, direct, remote. 1 when one fails. */
static int bench_size(const dsp_cuda_plugin *cu, dsp_backend *be,
                      const mm_size *s) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cu->ctx_use(ctx, be);
  const char *dn = dsp_dtype_name(s->dt);
  const int N = s->n;
  dsp_attrs none = dsp_attrs_none();
  int64_t cast_to = s->dt;
  const dsp_attrs ca = dsp_attrs_ints(1, &cast_to);
  dsp_tensor *in[2] = {NULL, NULL}, *out = NULL;
  int rc = 0;
  /* inputs uniform in [-1, 1) (seeds 7 and 8), made in f32 and cast */
  for (int i = 0; i < 2 && rc == 0; i++) {
    dsp_tensor *u = NULL;
    int64_t ints[4] = {DSP_F32, 7 + i, N, N};
    dsp_attrs ua = dsp_attrs_ints(4, ints);
    ua.n_floats = 2, ua.floats[0] = -1, ua.floats[1] = 1;
    rc = dsp_op(ctx, DSP_OP_UNIFORM, NULL, 0, &ua, &u);
    if (rc == 0 && s->dt != DSP_F32) rc = dsp_op(ctx, DSP_OP_CAST, &u, 1, &ca, &in[i]);
    else if (rc == 0) in[i] = u, u = NULL;
    dsp_tensor_unref(u);
  }
  if (rc < 0) {
    printf("cuda bench %s: setup failed: %s\n", dn, dsp_ctx_errmsg(ctx));
    dsp_ctx_free(ctx);
    return 1;
  }
  const double flop = 2.0 * N * N * (double)N;
  /* backend: warm up once, then REPS ops, each waited for */
  double best_be = 1e30, best_direct = 1e30;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    rc = dsp_op(ctx, DSP_OP_MATMUL, in, 2, &none, &out);
    if (rc == 0) rc = cu->sync(be, ctx);
    double t = now() - t0;
    if (rc < 0) {
      printf("cuda bench %s: matmul failed: %s\n", dn, dsp_ctx_errmsg(ctx));
      return 1;
    }
    dsp_tensor_unref(out);
    if (r > 0 && t < best_be) best_be = t;
  }
  /* cuBLAS direct on the same inputs into a preallocated output */
  cublasHandle_t h;
  void *c = NULL;
  cudaStream_t st;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
      cudaStreamCreate(&st) != cudaSuccess ||
      cudaMalloc(&c, dsp_dtype_size(s->dt) * (size_t)N * (size_t)N) != cudaSuccess) {
    printf("cuda bench %s: direct cuBLAS setup failed\n", dn);
    return 1;
  }
  cublasSetStream(h, st);
  cublasSetMathMode(h, (cublasMath_t)(CUBLAS_DEFAULT_MATH |
                                      CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION));
  int bad = 0;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    bad |= direct_gemm(h, s, dsp_tensor_data(in[0]), dsp_tensor_data(in[1]), c) !=
           CUBLAS_STATUS_SUCCESS;
    cudaStreamSynchronize(st);
    double t = now() - t0;
    if (r > 0 && t < best_direct) best_direct = t;
  }
  const char *api = s->dt == DSP_F32 ? "cublasSgemm " : "cublasGemmEx";
  if (bad) printf("matmul %dx%d %s %s direct: failed\n", N, N, dn, api);
  else
    printf("matmul %dx%d %s %s direct:  %8.3f ms  %8.1f GFLOP/s\n", N, N, dn, api,
           best_direct * 1e3, flop / best_direct * 1e-9);
  printf("matmul %dx%d %s CUDA backend:   %8.3f ms  %8.1f GFLOP/s  %5.1f%% of direct (goal >= 90%%)\n",
         N, N, dn, best_be * 1e3, flop / best_be * 1e-9, 100.0 * best_direct / best_be);
  cudaFree(c);
  cudaStreamDestroy(st);
  cublasDestroy(h);
  dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  dsp_ctx_free(ctx);
  return bad | remote_row(s, best_direct, flop);
}

int main(void) {
  char why[2048] = "";
  dsp_backend *be = NULL;
  const dsp_cuda_plugin *cu = NULL;
  if (dsp_cuda_plugin_open(0, &cu, &be, why, sizeof why) < 0) {
    printf("cuda: skipped (no GPU): %s\n", why);
    return 0;
  }
  static const mm_size sizes[] = {{4096, DSP_F32}, {8192, DSP_BF16}};
  int rc = 0;
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
    rc |= bench_size(cu, be, &sizes[i]);
  cu->backend_close(be);
  return rc;
}
