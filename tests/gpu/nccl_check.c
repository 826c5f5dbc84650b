/* The NCCL path of the group all-reduce on a GPU host (scripts/gpu.sh
 * test; written on a host without a GPU, where only its skip line and
 * its CPU half have run).
 *
 *   nccl_check [PLUGIN]
 *     loads dispatch-nccl.so (PLUGIN, else $DISPATCH_NCCL_PLUGIN, else
 *     ../../dispatch-nccl.so from this program: build/) and drives its
 *     table as the server's group thread does, on a one-rank communicator
 *     on cuda:0 (one GPU is lent, and NCCL refuses two ranks on one GPU):
 *     a unique id, a non-blocking init, then sum and mean of three
 *     tensors of each of f32, f64, f16 and bf16 in one ncclGroupStart/End,
 *     enqueued behind an upload still in flight on the same stream, each
 *     compared with the host's sum bit for bit; and an init on a device
 *     that does not exist, which must fail with one line, not abort.
 *     Without a GPU: "cuda: skipped (no GPU): REASON", exit 0.
 *
 *   nccl_check --server tcp://HOST:PORT [--half ok|refused]
 *     a group of the one server there (dispatch-server --mpi, a group of
 *     one: scripts/gpu.sh starts it with the one-rank MPI stand-in
 *     tests/gpu/mpi-single.so): tensors computed on the server's default
 *     device (x = a + b, still running when the all-reduce is sent),
 *     all-reduced (sum, then mean) and read back, equal to a + b; f16 and
 *     bf16 all-reduces succeed (--half ok: every member on CUDA with NCCL)
 *     or are refused with EDTYPE (--half refused: the host path).
 *
 *   nccl_check --server tcp://HOST:PORT --init-fails
 *     against a group of one whose NCCL init fails (the stand-in started
 *     with DISPATCH_MPI_SINGLE_SPOIL_NCCL_ID=1, on cuda:0): the first
 *     all-reduce is refused with DISPATCH_EGROUP naming the NCCL init, the
 *     tensor unchanged; the next ones take the host path (the CUDA tensor
 *     staged through host memory) and are right; f16 is refused since NCCL
 *     could not start for that device.
 * Exits 0 when every check passed, 1 otherwise. */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "group_mpi.h"
#include "group_nccl.h"

static int g_fail;
#define CHECK(cond, ...)                                                     \
  do {                                                                       \
    if (!(cond)) {                                                           \
      printf("nccl_check: FAILED: " __VA_ARGS__);                            \
      printf("\n");                                                          \
      g_fail = 1;                                                            \
    }                                                                        \
  } while (0)

/* exact in f16 and bf16: small integers */
static uint16_t f16_of_int(int k) {
  if (k == 0) return 0;
  uint16_t sign = k < 0 ? 0x8000 : 0;
  unsigned a = (unsigned)(k < 0 ? -k : k);
  int e = 31 - __builtin_clz(a);
  return (uint16_t)(sign | (unsigned)(e + 15) << 10 |
                    ((a << (10 - e)) & 0x3ff));
}
static uint16_t bf16_of_int(int k) {
  float f = (float)k;
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return (uint16_t)(u >> 16);
}

static size_t esize(int type) {
  return type == SV_MPI_F32 ? 4 : type == SV_MPI_F64 || type == SV_MPI_I64 ? 8 : 2;
}
static const char *tname(int type) {
  static const char *const n[] = {"f32", "f64", "i64", "f16", "bf16"};
  return n[type];
}
static void fill(int type, void *p, size_t n, int seed) {
  for (size_t i = 0; i < n; i++) {
    int k = (int)((i * 7919u + (unsigned)seed * 104729u) % 401u) - 200;
    switch (type) {
    case SV_MPI_F32: ((float *)p)[i] = (float)k * 0.375f; break;
    case SV_MPI_F64: ((double *)p)[i] = (double)k * 0.1; break;
    case SV_MPI_I64: ((int64_t *)p)[i] = k; break;
    case SV_NCCL_F16: ((uint16_t *)p)[i] = f16_of_int(k); break;
    default: ((uint16_t *)p)[i] = bf16_of_int(k); break;
    }
  }
}

static const sv_nccl_api *load(const char *arg) {
  char path[PATH_MAX + 32];
  const char *env = getenv("DISPATCH_NCCL_PLUGIN");
  if (arg) snprintf(path, sizeof path, "%s", arg);
  else if (env && *env) snprintf(path, sizeof path, "%s", env);
  else {
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return NULL;
    exe[n] = '\0';
    *strrchr(exe, '/') = '\0';
    snprintf(path, sizeof path, "%s/../../%s", exe, SV_NCCL_FILE);
  }
  void *dl = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!dl) {
    printf("nccl_check: cannot load the NCCL plugin %s: %s\n", path, dlerror());
    return NULL;
  }
  sv_nccl_entry_fn fn = (sv_nccl_entry_fn)dlsym(dl, SV_NCCL_ENTRY);
  const sv_nccl_api *api = fn ? fn() : NULL;
  if (!api || api->abi != SV_NCCL_ABI) {
    printf("nccl_check: %s is not a dispatch NCCL plugin of ABI %d\n", path,
           SV_NCCL_ABI);
    return NULL;
  }
  printf("nccl_check: plugin %s (%s)\n", path, api->describe());
  return api;
}

static int plugin_checks(const char *arg) {
  int ndev = 0;
  cudaError_t ce = cudaGetDeviceCount(&ndev);
  const sv_nccl_api *api = load(arg);
  if (!api) return 1;
  if (ce != cudaSuccess || ndev <= 0) {
    printf("cuda: skipped (no GPU): %s\n",
           ce != cudaSuccess ? cudaGetErrorString(ce) : "no CUDA device");
    return 0;
  }
  char why[512];
  char id[SV_NCCL_ID_BYTES];
  void *comm = NULL;
  if (api->unique_id(id, why, sizeof why) < 0 ||
      api->comm_init(&comm, 0, 1, 0, id, 60, why, sizeof why) < 0) {
    printf("nccl_check: FAILED: %s\n", why);
    return 1;
  }
  printf("nccl_check: one-rank communicator on cuda:0\n");
  cudaStream_t st;
  CHECK(cudaStreamCreate(&st) == cudaSuccess, "cudaStreamCreate");
  const size_t counts[3] = {1, 1000, (1u << 20) + 3};
  const int types[4] = {SV_MPI_F32, SV_MPI_F64, SV_NCCL_F16, SV_NCCL_BF16};
  for (int ti = 0; ti < 4; ti++)
    for (int avg = 0; avg < 2; avg++) {
      int type = types[ti];
      void *host[3], *dev[3], *back[3];
      for (int i = 0; i < 3; i++) {
        size_t nb = counts[i] * esize(type);
        host[i] = malloc(nb);
        back[i] = malloc(nb);
        fill(type, host[i], counts[i], i + 3 * ti);
        CHECK(cudaMalloc(&dev[i], nb) == cudaSuccess, "cudaMalloc");
        CHECK(cudaMemsetAsync(dev[i], 0xff, nb, st) == cudaSuccess, "memset");
        /* pinned-less async upload: still in flight when the all-reduce
         * is enqueued behind it on the same stream */
        CHECK(cudaMemcpyAsync(dev[i], host[i], nb, cudaMemcpyHostToDevice,
                              st) == cudaSuccess, "upload");
      }
      int rc = api->allreduce(comm, 0, st, 3, dev, counts, type, avg, 60, why,
                              sizeof why);
      CHECK(rc == 0, "%s %s: %s", tname(type), avg ? "mean" : "sum", why);
      if (rc < 0) return 1; /* the communicator is gone */
      for (int i = 0; i < 3; i++) {
        size_t nb = counts[i] * esize(type);
        CHECK(cudaMemcpy(back[i], dev[i], nb, cudaMemcpyDeviceToHost) ==
                  cudaSuccess, "read back");
        /* one rank: the host sum (and mean) is the tensor itself */
        CHECK(memcmp(back[i], host[i], nb) == 0,
              "%s %s: tensor %d (%zu elements) differs from the host sum",
              tname(type), avg ? "mean" : "sum", i, counts[i]);
        cudaFree(dev[i]);
        free(host[i]);
        free(back[i]);
      }
      printf("nccl_check: %s %s of 3 tensors (1, 1000, 2^20+3 elements): "
             "%s\n", tname(type), avg ? "mean" : "sum", g_fail ? "FAILED" : "ok");
    }
  api->comm_destroy(comm, 0);
  cudaStreamDestroy(st);
  /* a device that does not exist: one line, no abort */
  void *bad = NULL;
  if (api->unique_id(id, why, sizeof why) == 0) {
    int rc = api->comm_init(&bad, ndev + 7, 1, 0, id, 10, why, sizeof why);
    CHECK(rc < 0 && bad == NULL && strchr(why, '\n') == NULL,
          "comm_init on cuda:%d did not fail with one line", ndev + 7);
    printf("nccl_check: init on cuda:%d refused: %s\n", ndev + 7, why);
  }
  return g_fail;
}

/* a group of the one server at spec, or NULL with the failure printed */
static dispatch_group *open_one(const char *spec) {
  dispatch_group *grp;
  char err[512] = "";
  const char *specs[1] = {spec};
  if (dispatch_group_open(specs, 1, NULL, &grp, err, sizeof err) == 0)
    return grp;
  printf("nccl_check: FAILED: group_open %s: %s\n", spec, err);
  return NULL;
}

static int server_checks(const char *spec, int half_ok) {
  dispatch_group *grp = open_one(spec);
  if (!grp) return 1;
  dispatch_device *dev = dispatch_group_device(grp, 0);
  enum { N = 4099 };
  static float a[N], b[N], want[N], got[N];
  fill(SV_MPI_F32, a, N, 1);
  fill(SV_MPI_F32, b, N, 2);
  for (int i = 0; i < N; i++) want[i] = a[i] + b[i];
  int64_t shape[1] = {N};
  dispatch_tensor *ta, *tb, *x;
  CHECK(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, a, sizeof a, &ta) == 0 &&
            dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, b, sizeof b, &tb) == 0 &&
            dispatch_add(ta, tb, &x) == 0,
        "upload and add: %s", dispatch_device_errmsg(dev));
  const int reds[2] = {DISPATCH_REDUCE_SUM, DISPATCH_REDUCE_MEAN};
  for (int k = 0; k < 2 && !g_fail; k++) {
    int reduce = reds[k];
    CHECK(dispatch_group_allreduce(grp, &x, 1, reduce) == 0 &&
              dispatch_tensor_read(x, got, sizeof got) == 0,
          "all-reduce %s: %s", k ? "mean" : "sum",
          dispatch_device_errmsg(dev));
    CHECK(memcmp(got, want, sizeof got) == 0, "all-reduce %s: differs",
          k ? "mean" : "sum");
    printf("nccl_check: server f32 %s of a + b: %s\n", k ? "mean" : "sum",
           g_fail ? "FAILED" : "ok");
  }
  const dispatch_dtype halves[2] = {DISPATCH_F16, DISPATCH_BF16};
  for (int h = 0; h < 2; h++) {
    uint16_t v[N], r[N];
    fill(h ? SV_NCCL_BF16 : SV_NCCL_F16, v, N, 5);
    dispatch_tensor *t;
    CHECK(dispatch_tensor_from_data(dev, halves[h], 1, shape, v, sizeof v, &t) == 0,
          "upload half");
    int rc = dispatch_group_allreduce(grp, &t, 1, DISPATCH_REDUCE_SUM);
    if (rc == 0) rc = dispatch_device_sync(dev);
    if (half_ok) {
      CHECK(rc == 0 && dispatch_tensor_read(t, r, sizeof r) == 0 &&
                memcmp(r, v, sizeof v) == 0,
            "%s all-reduce: %d %s", h ? "bf16" : "f16", rc,
            dispatch_device_errmsg(dev));
    } else {
      CHECK(rc == DISPATCH_EDTYPE, "%s all-reduce on the host path: %d %s",
            h ? "bf16" : "f16", rc, dispatch_device_errmsg(dev));
      dispatch_device_clear_error(dev);
    }
    printf("nccl_check: server %s sum %s: %s\n", h ? "bf16" : "f16",
           half_ok ? "(NCCL)" : "refused (host path)", g_fail ? "FAILED" : "ok");
    dispatch_tensor_free(t);
  }
  dispatch_tensor_free(x);
  dispatch_tensor_free(ta);
  dispatch_tensor_free(tb);
  dispatch_group_close(grp);
  return g_fail;
}

static int init_fails_checks(const char *spec) {
  dispatch_group *grp = open_one(spec);
  if (!grp) return 1;
  dispatch_device *dev = dispatch_group_device(grp, 0);
  enum { N = 1031 };
  static float a[N], got[N];
  fill(SV_MPI_F32, a, N, 9);
  int64_t shape[1] = {N};
  dispatch_tensor *t;
  CHECK(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, a, sizeof a, &t) == 0,
        "upload");
  int rc = dispatch_group_allreduce(grp, &t, 1, DISPATCH_REDUCE_SUM);
  if (rc == 0) rc = dispatch_device_sync(dev);
  CHECK(rc == DISPATCH_EGROUP && strstr(dispatch_device_errmsg(dev), "NCCL init"),
        "first all-reduce: want DISPATCH_EGROUP naming the NCCL init, got %d %s",
        rc, dispatch_device_errmsg(dev));
  printf("nccl_check: refused alike: %s\n", dispatch_device_errmsg(dev));
  dispatch_device_clear_error(dev);
  CHECK(dispatch_tensor_read(t, got, sizeof got) == 0 &&
            memcmp(got, a, sizeof a) == 0, "the refused tensor changed");
  for (int k = 0; k < 2; k++) {
    int reduce = k ? DISPATCH_REDUCE_MEAN : DISPATCH_REDUCE_SUM;
    rc = dispatch_group_allreduce(grp, &t, 1, reduce);
    CHECK(rc == 0 && dispatch_tensor_read(t, got, sizeof got) == 0 &&
              memcmp(got, a, sizeof a) == 0,
          "host path %s: %d %s", k ? "mean" : "sum", rc,
          dispatch_device_errmsg(dev));
  }
  printf("nccl_check: then the host path, the CUDA tensor staged: %s\n",
         g_fail ? "FAILED" : "ok");
  uint16_t v[N];
  fill(SV_NCCL_F16, v, N, 4);
  dispatch_tensor *h;
  CHECK(dispatch_tensor_from_data(dev, DISPATCH_F16, 1, shape, v, sizeof v, &h) == 0,
        "upload f16");
  rc = dispatch_group_allreduce(grp, &h, 1, DISPATCH_REDUCE_SUM);
  if (rc == 0) rc = dispatch_device_sync(dev);
  CHECK(rc == DISPATCH_EDTYPE &&
            strstr(dispatch_device_errmsg(dev), "NCCL could not start"),
        "f16 after the failed init: %d %s", rc, dispatch_device_errmsg(dev));
  dispatch_device_clear_error(dev);
  dispatch_tensor_free(h);
  dispatch_tensor_free(t);
  dispatch_group_close(grp);
  return g_fail;
}

int main(int argc, char **argv) {
  if (argc >= 4 && strcmp(argv[1], "--server") == 0 &&
      strcmp(argv[3], "--init-fails") == 0) {
    int rc = init_fails_checks(argv[2]);
    printf("nccl_check --init-fails: %s\n", rc ? "FAILED" : "passed");
    return rc ? 1 : 0;
  }
  if (argc >= 3 && strcmp(argv[1], "--server") == 0) {
    int half_ok = !(argc >= 5 && strcmp(argv[3], "--half") == 0 &&
                    strcmp(argv[4], "refused") == 0);
    int rc = server_checks(argv[2], half_ok);
    printf("nccl_check --server: %s\n", rc ? "FAILED" : "passed");
    return rc ? 1 : 0;
  }
  int rc = plugin_checks(argc >= 2 ? argv[1] : NULL);
  printf("nccl_check: %s\n", rc ? "FAILED" : "done");
  return rc ? 1 : 0;
}
