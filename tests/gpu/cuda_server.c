/* make test-gpu, the server half: dispatch-server --device all on a GPU, through
 * the client library, as a user would reach it (scripts/gpu.sh starts the
 * server on 127.0.0.1 and names it in DISPATCH_GPU_REMOTE; the device is
 * DISPATCH_GPU_DEVICE, default cuda:0).
 *   1. uploads and reads of sizes around the 4 MiB staging parts (empty,
 *      one element, one part, one part and a few bytes, several parts)
 *      come back bit for bit;
 *   2. four connections at once (four sessions, four streams), each a
 *      chain of i64 ops with reads in between: every read is exact, so
 *      each session kept its order while they overlapped;
 *   3. a peer on cpu:0: moves cuda:0 -> cpu:0 -> cuda:0 inside the server
 *      keep the bytes, and the device's free memory drops while it holds
 *      a tensor.
 * Prints one line per check, PASS or FAIL, and exits 1 on any FAIL.
 * Pointed at a plain dispatch-server with DISPATCH_GPU_DEVICE=cpu:1 (and
 * cpu:0, cpu:1 devices) it checks the same logic without a GPU, claiming
 * nothing about one. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"

static const char *g_remote, *g_device;
static int g_fail;

static void report(const char *what, int ok, const char *detail) {
  printf("%s: %s%s%s\n", ok ? "PASS" : "FAIL", what, detail && *detail ? ": " : "",
         detail ? detail : "");
  if (!ok) g_fail = 1;
}

static dispatch_device *open_dev(char *msg, size_t len) {
  char spec[300];
  snprintf(spec, sizeof spec, "%s/%s", g_remote, g_device);
  dispatch_device *dev = NULL;
  if (dispatch_device_open(spec, NULL, &dev, msg, len) < 0) return NULL;
  return dev;
}

static void round_trips(void) {
  const size_t part = (size_t)4 << 20;
  const size_t sizes[] = {0, 1, part, part + 3, 3 * part + 5, 9 * part};
  char msg[512] = "";
  dispatch_device *dev = open_dev(msg, sizeof msg);
  if (!dev) {
    report("round trips: open", 0, msg);
    return;
  }
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    size_t n = sizes[i];
    unsigned char *v = malloc(n ? n : 1), *back = malloc(n ? n : 1);
    for (size_t k = 0; k < n; k++) v[k] = (unsigned char)(k * 2654435761u >> 13);
    for (size_t k = 0; k < n; k++) v[k] &= 1; /* bool bytes */
    memset(back, 0xEE, n);
    int64_t shape[1] = {(int64_t)n};
    dispatch_tensor *t = NULL;
    int rc = dispatch_tensor_from_data(dev, DISPATCH_BOOL, 1, shape, v, n, &t);
    if (rc == 0) rc = dispatch_tensor_read(t, back, n);
    char what[96];
    snprintf(what, sizeof what, "upload and read %zu bytes on %s", n, g_device);
    report(what, rc == 0 && memcmp(v, back, n) == 0,
           rc ? dispatch_device_errmsg(dev) : "");
    dispatch_tensor_free(t);
    free(v);
    free(back);
  }
  dispatch_device_close(dev);
}

enum { SESSIONS = 4, STEPS = 60, LEN = 1 << 16 };

typedef struct job {
  int id, ok;
  char why[512];
} job;

/* x <- x * 3 + id, read back every 10 steps against the same arithmetic
 * here (i64 wraps alike everywhere, so equality is exact). */
static void *chain(void *arg) {
  job *j = arg;
  dispatch_device *dev = open_dev(j->why, sizeof j->why);
  if (!dev) return NULL;
  int64_t *want = malloc(LEN * sizeof *want), *got = malloc(LEN * sizeof *got);
  for (int k = 0; k < LEN; k++) want[k] = k - LEN / 2;
  int64_t shape[1] = {LEN};
  dispatch_tensor *x = NULL;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_I64, 1, shape, want,
                                     LEN * sizeof *want, &x);
  j->ok = rc == 0;
  for (int s = 1; s <= STEPS && j->ok; s++) {
    dispatch_tensor *m = NULL, *y = NULL;
    rc = dispatch_mul_scalar(x, 3, &m);
    if (rc == 0) rc = dispatch_add_scalar(m, j->id, &y);
    dispatch_tensor_free(m);
    dispatch_tensor_free(x);
    x = y;
    for (int k = 0; k < LEN; k++)
      want[k] = (int64_t)((uint64_t)want[k] * 3u + (uint64_t)j->id);
    if (rc == 0 && s % 10 == 0) {
      rc = dispatch_tensor_read(x, got, LEN * sizeof *got);
      if (rc == 0 && memcmp(got, want, LEN * sizeof *got) != 0) {
        snprintf(j->why, sizeof j->why, "step %d: values out of order", s);
        j->ok = 0;
      }
    }
    if (rc < 0) {
      snprintf(j->why, sizeof j->why, "step %d: %s", s,
               dispatch_device_errmsg(dev));
      j->ok = 0;
    }
  }
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  free(want);
  free(got);
  return NULL;
}

static void sessions_at_once(void) {
  pthread_t th[SESSIONS];
  job jobs[SESSIONS];
  for (int i = 0; i < SESSIONS; i++) {
    jobs[i] = (job){.id = i + 1};
    pthread_create(&th[i], NULL, chain, &jobs[i]);
  }
  for (int i = 0; i < SESSIONS; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < SESSIONS; i++) {
    char what[96];
    snprintf(what, sizeof what, "session %d of %d at once on %s keeps its order",
             i + 1, SESSIONS, g_device);
    report(what, jobs[i].ok, jobs[i].why);
  }
}

static uint64_t free_of(dispatch_device *dev, const char *name) {
  dispatch_device_info info[16];
  int n = 0;
  if (dispatch_device_list(dev, info, 16, &n) < 0) return 0;
  for (int i = 0; i < n && i < 16; i++)
    if (strcmp(info[i].name, name) == 0) return info[i].free_memory;
  return 0;
}

static void peer_moves(void) {
  char msg[512] = "";
  dispatch_device *d0 = open_dev(msg, sizeof msg), *cpu = NULL;
  if (!d0 || dispatch_device_open_peer(d0, "cpu:0", &cpu) < 0) {
    report("peer cpu:0", 0, d0 ? dispatch_device_errmsg(d0) : msg);
    dispatch_device_close(d0);
    return;
  }
  enum { M = 3 << 20 }; /* 12 MiB of f32: three staging parts */
  float *v = malloc(M * sizeof *v), *back = malloc(M * sizeof *v);
  for (int k = 0; k < M; k++) v[k] = (float)k * 0.5f - 3.0f;
  int64_t shape[1] = {M};
  uint64_t before = free_of(d0, g_device);
  dispatch_tensor *a = NULL, *b = NULL, *c = NULL;
  int rc = dispatch_tensor_from_data(d0, DISPATCH_F32, 1, shape, v,
                                     M * sizeof *v, &a);
  if (rc == 0) rc = dispatch_device_sync(d0);
  uint64_t holding = free_of(d0, g_device);
  if (rc == 0) rc = dispatch_to_device(a, cpu, &b);
  if (rc == 0) rc = dispatch_to_device(b, d0, &c);
  if (rc == 0) rc = dispatch_tensor_read(c, back, M * sizeof *v);
  report("move cuda -> cpu:0 -> back inside the server keeps the bytes",
         rc == 0 && memcmp(v, back, M * sizeof *v) == 0,
         rc ? dispatch_device_errmsg(d0) : "");
  report("the device's free memory counts the tensor it holds",
         before >= holding + M * sizeof *v, "");
  dispatch_tensor_free(c);
  dispatch_tensor_free(b);
  dispatch_tensor_free(a);
  dispatch_device_close(cpu);
  dispatch_device_close(d0);
  free(v);
  free(back);
}

int main(void) {
  g_remote = getenv("DISPATCH_GPU_REMOTE");
  g_device = getenv("DISPATCH_GPU_DEVICE");
  if (!g_device || !*g_device) g_device = "cuda:0";
  if (!g_remote || !*g_remote) {
    printf("cuda_server: DISPATCH_GPU_REMOTE unset (scripts/gpu.sh test "
           "starts dispatch-server --device all and sets it)\n");
    return 1;
  }
  round_trips();
  sessions_at_once();
  peer_moves();
  printf("cuda_server: %s\n", g_fail ? "FAILED" : "all passed");
  return g_fail;
}
