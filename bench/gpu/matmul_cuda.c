/* make bench-gpu: matmul 4096 x 4096 f32 through the CUDA backend (dsp_op
 * on a ctx bound to cuda:0, output allocated from the stream-ordered pool
 * each time) beside cublasSgemm called directly on preallocated buffers,
 * both timed on the GPU with the same stream synchronisation. Prints each
 * figure beside the goal (backend >= 90% of direct cuBLAS). With
 * DISPATCH_BENCH_REMOTE naming a dispatch-server-cuda whose first device
 * is cuda:0 (scripts/gpu.sh starts one), also the remote matmul: inputs
 * made on the server, one sample the matmul request plus a sync, the
 * product left there (goal: >= 90% of direct cuBLAS, measured in the same
 * run). Without a GPU: "cuda: skipped (no GPU): REASON", exit 0. */
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "cuda_plugin.h"

#define N 4096
#define REPS 20

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* The remote matmul row: 1 when it fails, 0 otherwise (also when no
 * server is named: the row says so). */
static int remote_row(double best_direct, double flop) {
  const char *spec = getenv("DISPATCH_BENCH_REMOTE");
  if (!spec || !*spec) {
    printf("matmul %dx%d f32 remote cuda:0:  n/a (DISPATCH_BENCH_REMOTE unset; "
           "scripts/gpu.sh bench sets it)\n", N, N);
    return 0;
  }
  char msg[512] = "", full[300];
  snprintf(full, sizeof full, "%s/cuda:0", spec);
  dispatch_device *dev = NULL;
  dispatch_tensor *a = NULL, *b = NULL, *c = NULL;
  int64_t shape[2] = {N, N};
  if (dispatch_device_open(full, NULL, &dev, msg, sizeof msg) < 0 ||
      dispatch_uniform(dev, DISPATCH_F32, 2, shape, -1, 1, 7, &a) < 0 ||
      dispatch_uniform(dev, DISPATCH_F32, 2, shape, -1, 1, 8, &b) < 0 ||
      dispatch_device_sync(dev) < 0) {
    printf("matmul remote: setup on %s failed: %s\n", full,
           dev ? dispatch_device_errmsg(dev) : msg);
    dispatch_device_close(dev);
    return 1;
  }
  double best = 1e30;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    int rc = dispatch_matmul(a, b, &c);
    if (rc == 0) rc = dispatch_device_sync(dev);
    double t = now() - t0;
    if (rc < 0) {
      printf("matmul remote: %s\n", dispatch_device_errmsg(dev));
      dispatch_device_close(dev);
      return 1;
    }
    dispatch_tensor_free(c);
    if (r > 0 && t < best) best = t;
  }
  printf("matmul %dx%d f32 remote cuda:0:  %8.3f ms  %8.1f GFLOP/s  %5.1f%% of direct (goal >= 90%%)\n",
         N, N, best * 1e3, flop / best * 1e-9, 100.0 * best_direct / best);
  dispatch_tensor_free(a);
  dispatch_tensor_free(b);
  dispatch_device_close(dev);
  return 0;
}

int main(void) {
  char why[2048] = "";
  dsp_backend *be = NULL;
  const dsp_cuda_plugin *cu = NULL;
  if (dsp_cuda_plugin_open(0, &cu, &be, why, sizeof why) < 0) {
    printf("cuda: skipped (no GPU): %s\n", why);
    return 0;
  }
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cu->ctx_use(ctx, be);
  dsp_attrs none = dsp_attrs_none();
  int64_t ints[4] = {DSP_F32, 7, N, N};
  dsp_attrs ua = dsp_attrs_ints(4, ints);
  ua.n_floats = 2, ua.floats[0] = -1, ua.floats[1] = 1;
  dsp_tensor *in[2] = {NULL, NULL}, *out = NULL;
  if (dsp_op(ctx, DSP_OP_UNIFORM, NULL, 0, &ua, &in[0]) < 0 ||
      dsp_op(ctx, DSP_OP_UNIFORM, NULL, 0, &ua, &in[1]) < 0) {
    printf("cuda bench: setup failed: %s\n", dsp_ctx_errmsg(ctx));
    return 1;
  }
  const double flop = 2.0 * N * N * (double)N;
  /* backend: warm up once, then REPS ops, each waited for */
  double best_be = 1e30, best_direct = 1e30;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    int rc = dsp_op(ctx, DSP_OP_MATMUL, in, 2, &none, &out);
    if (rc == 0) rc = cu->sync(be, ctx);
    double t = now() - t0;
    if (rc < 0) {
      printf("cuda bench: matmul failed: %s\n", dsp_ctx_errmsg(ctx));
      return 1;
    }
    dsp_tensor_unref(out);
    if (r > 0 && t < best_be) best_be = t;
  }
  /* cuBLAS direct on the same inputs into a preallocated output */
  cublasHandle_t h;
  float *c = NULL;
  cudaStream_t st;
  if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS ||
      cudaStreamCreate(&st) != cudaSuccess ||
      cudaMalloc((void **)&c, sizeof(float) * N * N) != cudaSuccess) {
    printf("cuda bench: direct cuBLAS setup failed\n");
    return 1;
  }
  cublasSetStream(h, st);
  const float one = 1, zero = 0;
  for (int r = 0; r < REPS + 1; r++) {
    double t0 = now();
    cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, N, N, N, &one,
                dsp_tensor_data(in[1]), N, dsp_tensor_data(in[0]), N, &zero, c, N);
    cudaStreamSynchronize(st);
    double t = now() - t0;
    if (r > 0 && t < best_direct) best_direct = t;
  }
  printf("matmul %dx%d f32 cuBLAS direct:  %8.3f ms  %8.1f GFLOP/s\n", N, N,
         best_direct * 1e3, flop / best_direct * 1e-9);
  printf("matmul %dx%d f32 CUDA backend:   %8.3f ms  %8.1f GFLOP/s  %5.1f%% of direct (goal >= 90%%)\n",
         N, N, best_be * 1e3, flop / best_be * 1e-9, 100.0 * best_direct / best_be);
  int rrc = remote_row(best_direct, flop);
  cudaFree(c);
  cudaStreamDestroy(st);
  cublasDestroy(h);
  dsp_tensor_unref(in[0]), dsp_tensor_unref(in[1]);
  dsp_ctx_free(ctx);
  cu->backend_close(be);
  return rrc;
}
