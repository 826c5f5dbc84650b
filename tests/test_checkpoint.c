/* Checkpoints (dispatch_save / dispatch_load, safetensors format) on LOCAL
 * and on REMOTE through a real dispatch-server on 127.0.0.1: bit-identical
 * round trips (chunked reads of large tensors included), every malformed
 * file refused with its code and message and no tensor left behind, files
 * exchanged with an independent json + numpy reader and writer
 * (tests/helpers/safetensors_py.py, run by /usr/bin/python3), and a
 * training run stopped, saved, loaded into a fresh server and resumed that
 * ends bit-identical to an uninterrupted one. */
#include <criterion/criterion.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

static sp_server g_srv;
static char g_dir[256];

static void setup_dir(void) {
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp_ckpt_XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
}

static void teardown(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  if (g_dir[0]) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_assert_eq(system(cmd), 0);
  }
}

static int have_server(void) {
  const char *b = getenv("DISPATCH_SERVER_BIN");
  return b && *b;
}

static void start_server(const char *const *args) {
  if (!have_server()) cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
  cr_assert_eq(sp_start(&g_srv, args), 0, "dispatch-server did not start");
}

static dispatch_device *open_kind(const char *kind) {
  char spec[64], msg[256] = "";
  if (strcmp(kind, "local") == 0)
    snprintf(spec, sizeof spec, "local");
  else
    snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

static void path_in_dir(char *out, size_t len, const char *name) {
  snprintf(out, len, "%s/%s", g_dir, name);
}

static uint64_t live_tensors(dispatch_device *dev) {
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  return st.tensors;
}

static void *read_all(dispatch_tensor *t, size_t *n) {
  *n = dispatch_tensor_nbytes(t);
  void *p = malloc(*n ? *n : 1);
  OK(dispatch_tensor_device(t), dispatch_tensor_read(t, p, *n));
  return p;
}

/* ------------------------------------------------------------------ */
/* round trips                                                         */

#define N_RT 9
static const char *const rt_names[N_RT] = {
    "layer.0.weight", "layer.0.bias", "steps",
    "mask",           "scalar",       "empty",
    "big.rows",       "big.row",      "ünïcode \"quoted\"/name"};

/* Tensors of every dtype, a scalar, a zero-size one, one of 2.8 MiB (read
 * in chunks of whole rows) and one whose single row passes the chunk. */
static void make_rt(dispatch_device *dev, dispatch_tensor **t) {
  int64_t s0[2] = {3, 5}, s1[1] = {5}, s2[2] = {2, 3}, s3[1] = {9};
  int64_t s5[3] = {2, 0, 3}, s6[2] = {700, 1000}, s7[2] = {2, 150000};
  int64_t s8[1] = {4};
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 2, s0, 0, 1, 11, &t[0]));
  OK(dev, dispatch_normal(dev, DISPATCH_F64, 1, s1, 0, 1, 12, &t[1]));
  int64_t iv[6] = {-1, 0, 1, INT64_MAX, INT64_MIN, 1234567890123LL};
  OK(dev,
     dispatch_tensor_from_data(dev, DISPATCH_I64, 2, s2, iv, sizeof iv, &t[2]));
  uint8_t bv[9] = {1, 0, 0, 1, 1, 0, 1, 0, 1};
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_BOOL, 1, s3, bv, sizeof bv,
                                    &t[3]));
  float sv = -0.0f;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 0, NULL, &sv, 4, &t[4]));
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 3, s5, &t[5]));
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, s6, -1, 1, 13, &t[6]));
  OK(dev, dispatch_uniform(dev, DISPATCH_F64, 2, s7, -1, 1, 14, &t[7]));
  OK(dev, dispatch_arange(dev, DISPATCH_F32, 0, 4, 1, &t[8]));
  (void)s8;
}

static void round_trip(const char *save_kind, const char *load_kind) {
  setup_dir();
  if (strcmp(save_kind, "remote") == 0 || strcmp(load_kind, "remote") == 0)
    start_server(NULL);
  dispatch_device *sd = open_kind(save_kind);
  dispatch_tensor *t[N_RT];
  make_rt(sd, t);
  /* an AUTODIFF tensor saves its inner */
  dispatch_tensor *w;
  OK(sd, dispatch_autodiff(t[0], &w));
  dispatch_tensor *arg[N_RT];
  memcpy(arg, t, sizeof arg);
  arg[0] = w;
  char path[300];
  path_in_dir(path, sizeof path, "rt.safetensors");
  uint64_t before = live_tensors(sd);
  OK(sd, dispatch_save(sd, path, rt_names, arg, N_RT, NULL));
  /* the chunk slices are freed as they are read */
  cr_assert_eq(live_tensors(sd), before, "save left tensors on the device");
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_assert_gt(st.st_size, 700 * 1000 * 4 + 2 * 150000 * 8);

  dispatch_device *ld =
      strcmp(save_kind, load_kind) == 0 ? sd : open_kind(load_kind);
  dispatch_checkpoint *ck = NULL;
  OK(ld, dispatch_load(ld, path, &ck));
  cr_assert_eq(dispatch_checkpoint_count(ck), N_RT);
  for (int i = 0; i < N_RT; i++) {
    /* data order is the order given to save */
    cr_assert_str_eq(dispatch_checkpoint_name(ck, i), rt_names[i]);
    dispatch_tensor *got = dispatch_checkpoint_get(ck, rt_names[i]);
    cr_assert_eq(got, dispatch_checkpoint_tensor(ck, i));
    cr_assert_eq(dispatch_kind(got), strcmp(load_kind, "local") == 0
                                         ? DISPATCH_KIND_LOCAL
                                         : DISPATCH_KIND_REMOTE);
    check_same(t[i], got, rt_names[i]);
  }
  cr_assert_null(dispatch_checkpoint_get(ck, "nope"));
  cr_assert_str_eq(dispatch_checkpoint_meta(ck, "format"), "dispatch");
  dispatch_checkpoint_free(ck);
  dispatch_tensor_free(w);
  for (int i = 0; i < N_RT; i++) dispatch_tensor_free(t[i]);
  if (ld != sd) dispatch_device_close(ld);
  dispatch_device_close(sd);
}

Test(checkpoint, round_trip_local, .fini = teardown) {
  round_trip("local", "local");
}
Test(checkpoint, round_trip_remote, .fini = teardown) {
  round_trip("remote", "remote");
}
Test(checkpoint, round_trip_remote_to_local, .fini = teardown) {
  round_trip("remote", "local");
}

/* A save refused before it writes leaves the old file and no temporary. */
Test(checkpoint, save_refusals_keep_old_file, .fini = teardown) {
  setup_dir();
  dispatch_device *dev = open_kind("local");
  dispatch_tensor *a, *b;
  int64_t s[1] = {3};
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &a));
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 1, s, &b));
  char path[300];
  path_in_dir(path, sizeof path, "keep.safetensors");
  const char *n1[1] = {"a"};
  OK(dev, dispatch_save(dev, path, n1, &a, 1, NULL));
  struct stat st0;
  cr_assert_eq(stat(path, &st0), 0);

  const char *dup[2] = {"x", "x"};
  dispatch_tensor *ab[2] = {a, b};
  int rc = dispatch_save(dev, path, dup, ab, 2, NULL);
  cr_assert_eq(rc, DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "\"x\" appears twice"), "%s",
            dispatch_device_errmsg(dev));
  const char *res[2] = {"a", "__metadata__"};
  cr_assert_eq(dispatch_save(dev, path, res, ab, 2, NULL), DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "reserved"));
  const char *bad_utf8[1] = {"caf\xe9"}; /* Latin-1, not UTF-8 */
  cr_assert_eq(dispatch_save(dev, path, bad_utf8, &a, 1, NULL),
               DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "not valid UTF-8"));

  char missing[300];
  path_in_dir(missing, sizeof missing, "no/such/dir/x.safetensors");
  cr_assert_eq(dispatch_save(dev, missing, n1, &a, 1, NULL), DISPATCH_EIO);
  cr_assert(strstr(dispatch_device_errmsg(dev), "cannot create"), "%s",
            dispatch_device_errmsg(dev));

  dispatch_checkpoint *ck;
  OK(dev, dispatch_load(dev, path, &ck));
  cr_assert_eq(dispatch_checkpoint_count(ck), 1);
  check_same(a, dispatch_checkpoint_get(ck, "a"), "a");
  dispatch_checkpoint_free(ck);
  char cmd[400];
  snprintf(cmd, sizeof cmd, "test $(ls '%s' | wc -l) -eq 1", g_dir);
  cr_assert_eq(system(cmd), 0, "a temporary file was left in %s", g_dir);
  dispatch_tensor_free(a);
  dispatch_tensor_free(b);
  dispatch_device_close(dev);
}

/* A deferred server error (a gradient the backward did not reach)
 * surfaces at the save's first read, as at any wait: the save fails with
 * it, and neither the file nor a temporary is left. */
Test(checkpoint, save_deferred_error_remote, .fini = teardown) {
  setup_dir();
  start_server(NULL);
  dispatch_device *dev = open_kind("remote");
  int64_t s[1] = {4};
  dispatch_tensor *x, *w, *xa, *wa, *loss, *g;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &x));
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, s, &w));
  OK(dev, dispatch_autodiff(x, &xa));
  OK(dev, dispatch_autodiff(w, &wa));
  OK(dev, dispatch_sum(xa, 0, NULL, 0, &loss));
  dispatch_grads *gr;
  OK(dev, dispatch_backward(loss, &gr));
  OK(dev, dispatch_grad(gr, wa, &g)); /* w is not reached: deferred */
  char path[300];
  path_in_dir(path, sizeof path, "poisoned.safetensors");
  const char *names[2] = {"x", "g"};
  dispatch_tensor *ts[2] = {x, g};
  int rc = dispatch_save(dev, path, names, ts, 2, NULL);
  cr_assert_eq(rc, DISPATCH_ENOGRAD, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "backward did not reach"), "%s",
            dispatch_device_errmsg(dev));
  char cmd[400];
  snprintf(cmd, sizeof cmd, "test -z \"$(ls -A '%s')\"", g_dir);
  cr_assert_eq(system(cmd), 0, "files left in %s", g_dir);
  dispatch_tensor *all[] = {x, w, xa, wa, loss, g};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    dispatch_tensor_free(all[i]);
  dispatch_grads_free(gr);
  dispatch_device_close(dev);
}

/* ------------------------------------------------------------------ */
/* memory: a REMOTE save streams                                        */

/* A dsp allocator that counts the live bytes of the process's dsp memory
 * (malloc_usable_size, so blocks from before it was installed free
 * cleanly) and their peak. */
static size_t g_live, g_peak;
static void *cnt_malloc(size_t n, void *ud) {
  void *p = malloc(n);
  if (p && (g_live += malloc_usable_size(p)) > g_peak) g_peak = g_live;
  return p;
}
static void *cnt_realloc(void *old, size_t n, void *ud) {
  size_t was = old ? malloc_usable_size(old) : 0;
  void *p = realloc(old, n);
  if (p) {
    g_live = g_live - was + malloc_usable_size(p);
    if (g_live > g_peak) g_peak = g_live;
  }
  return p;
}
static void cnt_free(void *p, void *ud) {
  if (p) g_live -= malloc_usable_size(p);
  free(p);
}

/* 32 MiB of REMOTE parameters (made by the server: no bytes travel) saved
 * and loaded back: the client's dsp memory peaks at the 1 MiB read chunk
 * plus its connection buffers while saving, and at one tensor (8 MiB) plus
 * those while loading, never at the model's size. */
Test(checkpoint, remote_save_streams, .fini = teardown) {
  setup_dir();
  start_server(NULL);
  dsp_allocator a = {cnt_malloc, cnt_realloc, cnt_free, NULL};
  dsp_set_allocator(&a);
  dispatch_device *dev = open_kind("remote");
  dispatch_tensor *t[4];
  const char *names[4] = {"l0", "l1", "l2", "l3"};
  int64_t s[2] = {2048, 1024}; /* 8 MiB each */
  for (int i = 0; i < 4; i++)
    OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, s, -1, 1, 30 + i, &t[i]));
  OK(dev, dispatch_device_sync(dev));
  char path[300];
  path_in_dir(path, sizeof path, "big.safetensors");
  size_t base = g_live;
  g_peak = g_live;
  OK(dev, dispatch_save(dev, path, names, t, 4, NULL));
  size_t save_peak = g_peak - base;
  cr_log_info("REMOTE save of 32 MiB: client dsp memory peak +%zu bytes",
              save_peak);
  cr_assert_lt(save_peak, (size_t)4 << 20, "save held %zu bytes", save_peak);
  dispatch_checkpoint *ck;
  base = g_live;
  g_peak = g_live;
  OK(dev, dispatch_load(dev, path, &ck));
  size_t load_peak = g_peak - base;
  cr_log_info("REMOTE load of 32 MiB: client dsp memory peak +%zu bytes",
              load_peak);
  cr_assert_lt(load_peak, (size_t)12 << 20, "load held %zu bytes", load_peak);
  check_same(t[3], dispatch_checkpoint_get(ck, "l3"), "l3");
  dispatch_checkpoint_free(ck);
  for (int i = 0; i < 4; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
  dsp_set_allocator(NULL);
}

/* ------------------------------------------------------------------ */
/* malformed files                                                     */

/* Writes [len][json padded to hlen or as is][data] to path. hlen_override:
 * the length field when not UINT64_MAX. */
static void write_file(const char *path, const char *json,
                       uint64_t hlen_override, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f);
  uint64_t hl = hlen_override != UINT64_MAX ? hlen_override : strlen(json);
  uint8_t lb[8];
  for (int i = 0; i < 8; i++) lb[i] = (uint8_t)(hl >> (8 * i));
  cr_assert_eq(fwrite(lb, 1, 8, f), 8);
  cr_assert_eq(fwrite(json, 1, strlen(json), f), strlen(json));
  if (n) cr_assert_eq(fwrite(data, 1, n, f), n);
  cr_assert_eq(fclose(f), 0);
}

typedef struct bad_case {
  const char *what;
  const char *json;
  uint64_t hlen; /* UINT64_MAX: strlen(json) */
  size_t data_len;
  int code;
  const char *msg; /* a substring of the detail message */
} bad_case;

static const bad_case k_bad[] = {
    {"data truncated",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}",
     UINT64_MAX, 12, DISPATCH_EINVAL,
     "truncated: the offsets need 16 data bytes, the file has 12"},
    {"header truncated", "{\"a\":{}}", 4096, 0, DISPATCH_EINVAL,
     "truncated: header length 4096"},
    {"header over the limit", "{}", (uint64_t)100 << 20 | 1, 0,
     DISPATCH_ETOOLARGE, "passes the limit of 104857600 bytes"},
    {"header length 2^64-2", "{}", UINT64_MAX - 1, 0, DISPATCH_ETOOLARGE,
     "passes the limit"},
    {"overlap",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
     UINT64_MAX, 12, DISPATCH_EINVAL,
     "\"b\" starts at 4, overlapping data that runs to 8"},
    {"gap",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
     "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[12,20]}}",
     UINT64_MAX, 20, DISPATCH_EINVAL,
     "\"b\" starts at 12, leaving a gap after data that ends at 8"},
    {"first tensor not at 0",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     UINT64_MAX, 8, DISPATCH_EINVAL, "leaving a gap"},
    {"past the end",
     "{\"a\":{\"dtype\":\"F64\",\"shape\":[1000],\"data_offsets\":[0,8000]}}",
     UINT64_MAX, 8, DISPATCH_EINVAL, "truncated"},
    {"trailing bytes",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
     UINT64_MAX, 9, DISPATCH_EINVAL, "5 bytes after the last tensor"},
    {"unknown dtype",
     "{\"a\":{\"dtype\":\"F8_E4M3\",\"shape\":[2],\"data_offsets\":[0,2]}}",
     UINT64_MAX, 2, DISPATCH_EDTYPE, "dtype \"F8_E4M3\" is not supported"},
    {"half size mismatch: 2 bytes an element, not 4",
     "{\"a\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[0,12]}}",
     UINT64_MAX, 12, DISPATCH_ESHAPE,
     "BF16 [3] needs 6 bytes, data_offsets [0, 12] hold 12"},
    {"shape/size mismatch",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[2,3],\"data_offsets\":[0,20]}}",
     UINT64_MAX, 20, DISPATCH_ESHAPE,
     "F32 [2, 3] needs 24 bytes, data_offsets [0, 20] hold 20"},
    {"shape overflow",
     "{\"a\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296],"
     "\"data_offsets\":[0,0]}}",
     UINT64_MAX, 0, DISPATCH_EOVERFLOW, "tensor \"a\""},
    {"rank over 8",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1,1,1],"
     "\"data_offsets\":[0,4]}}",
     UINT64_MAX, 4, DISPATCH_EDIM, "rank 9 passes 8"},
    {"duplicate names",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
     UINT64_MAX, 8, DISPATCH_EINVAL, "the name \"a\" appears twice"},
    {"non-object JSON", "[1, 2, 3]", UINT64_MAX, 0, DISPATCH_EINVAL,
     "the header is not a JSON object"},
    {"invalid JSON", "{\"a\": {", UINT64_MAX, 0, DISPATCH_EINVAL,
     "not valid JSON"},
    {"two JSON values", "{} {}", UINT64_MAX, 0, DISPATCH_EINVAL,
     "bytes after its JSON value"},
    {"entry not an object", "{\"a\": 3}", UINT64_MAX, 0, DISPATCH_EINVAL,
     "entry is not a JSON object"},
    {"missing offsets", "{\"a\":{\"dtype\":\"F32\",\"shape\":[]}}", UINT64_MAX,
     4, DISPATCH_EINVAL, "needs a string \"dtype\""},
    {"negative offset",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}",
     UINT64_MAX, 0, DISPATCH_EINVAL, "data_offsets must be"},
    {"fractional dim",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1.5],\"data_offsets\":[0,4]}}",
     UINT64_MAX, 4, DISPATCH_EINVAL, "shape[0] is not a whole number"},
    {"header not UTF-8", "{\"a\xff\":{}}", UINT64_MAX, 0, DISPATCH_EINVAL,
     "not valid UTF-8"},
    {"metadata not strings", "{\"__metadata__\":{\"k\":1}}", UINT64_MAX, 0,
     DISPATCH_EINVAL, "__metadata__ \"k\" is not a string"},
    {"bool byte 2 in the last tensor",
     "{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
     "\"m\":{\"dtype\":\"BOOL\",\"shape\":[3],\"data_offsets\":[4,7]}}",
     UINT64_MAX, 7, DISPATCH_EINVAL, "tensor \"m\""},
};

/* Each case on dev: the code, the message, and the device's tensor count
 * as before (nothing half-loaded). */
static void run_bad_cases(dispatch_device *dev) {
  uint8_t data[64];
  memset(data, 0, sizeof data);
  data[6] = 2; /* the BOOL case's third byte */
  char path[300];
  path_in_dir(path, sizeof path, "bad.safetensors");
  uint64_t base = live_tensors(dev);
  for (size_t i = 0; i < sizeof k_bad / sizeof k_bad[0]; i++) {
    const bad_case *c = &k_bad[i];
    write_file(path, c->json, c->hlen, data, c->data_len);
    dispatch_checkpoint *ck = (dispatch_checkpoint *)1;
    int rc = dispatch_load(dev, path, &ck);
    cr_assert_eq(rc, c->code, "%s: got %s (%s), want %s", c->what,
                 dispatch_err_name(rc), dispatch_device_errmsg(dev),
                 dispatch_err_name(c->code));
    cr_assert_null(ck, "%s: *out not NULL", c->what);
    cr_assert(strstr(dispatch_device_errmsg(dev), c->msg),
              "%s: message \"%s\" lacks \"%s\"", c->what,
              dispatch_device_errmsg(dev), c->msg);
    cr_assert(strstr(dispatch_device_errmsg(dev), path),
              "%s: message \"%s\" does not name the file", c->what,
              dispatch_device_errmsg(dev));
    cr_assert_eq(live_tensors(dev), base, "%s: tensors left behind", c->what);
  }
  /* shorter than the length field */
  FILE *f = fopen(path, "wb");
  cr_assert_eq(fwrite("abc", 1, 3, f), 3);
  fclose(f);
  dispatch_checkpoint *ck;
  cr_assert_eq(dispatch_load(dev, path, &ck), DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "truncated: 3 bytes"));
  path_in_dir(path, sizeof path, "missing.safetensors");
  cr_assert_eq(dispatch_load(dev, path, &ck), DISPATCH_EIO);
  cr_assert(strstr(dispatch_device_errmsg(dev), "No such file"));
  cr_assert_eq(dispatch_load(dev, g_dir, &ck), DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "not a regular file"));
  /* the device still works */
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(live_tensors(dev), base);
}

Test(checkpoint, malformed_local, .fini = teardown) {
  setup_dir();
  dispatch_device *dev = open_kind("local");
  run_bad_cases(dev);
  dispatch_device_close(dev);
}

Test(checkpoint, malformed_remote, .fini = teardown) {
  setup_dir();
  start_server(NULL);
  dispatch_device *dev = open_kind("remote");
  run_bad_cases(dev);
  dispatch_device_close(dev);
}

/* A server that refuses the third upload (session quota): the load fails
 * with the server's error and frees the two tensors it had made. */
Test(checkpoint, remote_quota_all_or_nothing, .fini = teardown) {
  setup_dir();
  const char *args[] = {"--max-session-bytes", "3000000", NULL};
  start_server(args);
  dispatch_device *dev = open_kind("remote");
  char path[300];
  path_in_dir(path, sizeof path, "quota.safetensors");
  {
    dispatch_device *ld = open_kind("local");
    dispatch_tensor *t[3];
    int64_t s[1] = {250000}; /* 1 MB each */
    for (int i = 0; i < 3; i++)
      OK(ld, dispatch_full(ld, DISPATCH_F32, 1, s, i, &t[i]));
    const char *names[3] = {"a", "b", "c"};
    OK(ld, dispatch_save(ld, path, names, t, 3, NULL));
    for (int i = 0; i < 3; i++) dispatch_tensor_free(t[i]);
    dispatch_device_close(ld);
  }
  uint64_t base = live_tensors(dev);
  dispatch_checkpoint *ck;
  int rc = dispatch_load(dev, path, &ck);
  cr_assert_eq(rc, DISPATCH_EQUOTA, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "--max-session-bytes"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_null(ck);
  cr_assert_eq(live_tensors(dev), base, "tensors left on the server");
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  cr_assert_lt(st.bytes, 1000000, "server still holds %llu bytes",
               (unsigned long long)st.bytes);
  dispatch_device_close(dev);
}

/* ------------------------------------------------------------------ */
/* the Python reader and writer                                        */

/* The tensors of safetensors_py.py's expected(). */
#define N_INTEROP 8
static void interop_tensors(dispatch_device *dev, dispatch_tensor **t,
                            const char **names) {
  float w[12];
  for (int i = 0; i < 12; i++) w[i] = (float)((i - 5) * 0.25);
  double b[5];
  for (int i = 0; i < 5; i++) b[i] = i / 3.0;
  int64_t idx[6];
  for (int i = 0; i < 6; i++) idx[i] = (int64_t)i * 1000003 - 7;
  uint8_t mask[7];
  for (int i = 0; i < 7; i++) mask[i] = i % 3 == 0;
  float sc = 42.5f;
  int64_t sw[2] = {3, 4}, sb[1] = {5}, si[2] = {2, 3}, sm[1] = {7},
          se[2] = {0, 4};
  /* f16: 1, -2.5, 65504, 2^-24 (subnormal), -0, inf, NaN, 1/3 rounded;
   * bf16: 1, -3.140625, the largest finite, -inf (the bits numpy's float16
   * and torch.bfloat16 give; safetensors_py.py checks them) */
  static const uint16_t hb[8] = {0x3c00, 0xc100, 0x7bff, 0x0001,
                                 0x8000, 0x7c00, 0x7e00, 0x3555};
  static const uint16_t bb[4] = {0x3f80, 0xc049, 0x7f7f, 0xff80};
  int64_t sh[2] = {2, 4}, sbb[1] = {4};
  const char *n[N_INTEROP] = {"w",     "b",      "idx",  "mask",
                              "empty", "scalar", "half", "brain"};
  memcpy(names, n, sizeof n);
  OK(dev,
     dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sw, w, sizeof w, &t[0]));
  OK(dev,
     dispatch_tensor_from_data(dev, DISPATCH_F64, 1, sb, b, sizeof b, &t[1]));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 2, si, idx, sizeof idx,
                                    &t[2]));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_BOOL, 1, sm, mask,
                                    sizeof mask, &t[3]));
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 2, se, &t[4]));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 0, NULL, &sc, 4, &t[5]));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F16, 2, sh, hb, sizeof hb,
                                    &t[6]));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_BF16, 1, sbb, bb, sizeof bb,
                                    &t[7]));
}

/* Runs safetensors_py.py MODE path; returns its exit status. */
static int run_python(const char *mode, const char *path) {
  if (access("/usr/bin/python3", X_OK) != 0)
    cr_skip_test("/usr/bin/python3 is not installed");
  if (system("/usr/bin/python3 -c 'import numpy' 2>/dev/null") != 0)
    cr_skip_test("numpy is not installed for /usr/bin/python3");
  char script[256], cmd[800];
  /* the suites run from the repository root; __FILE__ is tests/... */
  snprintf(script, sizeof script, "%s", __FILE__);
  char *slash = strrchr(script, '/');
  snprintf(slash ? slash + 1 : script,
           sizeof script - (size_t)(slash ? slash + 1 - script : 0),
           "helpers/safetensors_py.py");
  snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' %s '%s'", script, mode,
           path);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void python_reads(const char *kind) {
  setup_dir();
  if (strcmp(kind, "remote") == 0) start_server(NULL);
  dispatch_device *dev = open_kind(kind);
  dispatch_tensor *t[N_INTEROP];
  const char *names[N_INTEROP];
  interop_tensors(dev, t, names);
  char path[300];
  path_in_dir(path, sizeof path, "to_python.safetensors");
  OK(dev, dispatch_save(dev, path, names, t, N_INTEROP, NULL));
  cr_assert_eq(run_python("read", path), 0,
               "the json + numpy reader refused dispatch's file");
  for (int i = 0; i < N_INTEROP; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
}

static void python_writes(const char *kind) {
  setup_dir();
  if (strcmp(kind, "remote") == 0) start_server(NULL);
  dispatch_device *dev = open_kind(kind);
  char path[300];
  path_in_dir(path, sizeof path, "from_python.safetensors");
  cr_assert_eq(run_python("write", path), 0, "the python writer failed");
  dispatch_checkpoint *ck;
  OK(dev, dispatch_load(dev, path, &ck));
  cr_assert_str_eq(dispatch_checkpoint_meta(ck, "writer"), "numpy");
  dispatch_tensor *t[N_INTEROP];
  const char *names[N_INTEROP];
  interop_tensors(dev, t, names);
  cr_assert_eq(dispatch_checkpoint_count(ck), N_INTEROP);
  for (int i = 0; i < N_INTEROP; i++) {
    dispatch_tensor *got = dispatch_checkpoint_get(ck, names[i]);
    cr_assert_not_null(got, "no tensor %s", names[i]);
    check_same(t[i], got, names[i]);
    dispatch_tensor_free(t[i]);
  }
  /* the writer put the data in reverse name order: data order is kept */
  cr_assert_str_eq(dispatch_checkpoint_name(ck, 0), "w");
  dispatch_checkpoint_free(ck);
  dispatch_device_close(dev);
}

Test(checkpoint, python_reads_local, .fini = teardown) {
  python_reads("local");
}
Test(checkpoint, python_reads_remote, .fini = teardown) {
  python_reads("remote");
}
Test(checkpoint, python_writes_local, .fini = teardown) {
  python_writes("local");
}
Test(checkpoint, python_writes_remote, .fini = teardown) {
  python_writes("remote");
}

/* ------------------------------------------------------------------ */
/* training: stop, save, load into a fresh server, resume               */

#define N_PARAMS 4
static const char *const k_pnames[N_PARAMS] = {"fc1.weight", "fc1.bias",
                                               "fc2.weight", "fc2.bias"};

typedef struct run_state {
  dispatch_device *dev;
  dispatch_tensor *p[N_PARAMS]; /* AUTODIFF leaves */
  dispatch_optim *opt;
  dispatch_tensor *x, *y;
} run_state;

/* Random data (the same seeds on every device), 16 samples of 8 features,
 * 4 classes. */
static void make_data(run_state *r) {
  dispatch_device *dev = r->dev;
  int64_t xs[2] = {16, 8};
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 2, xs, 0, 1, 101, &r->x));
  int64_t lab[16];
  for (int i = 0; i < 16; i++) lab[i] = (i * 7 + 3) % 4;
  int64_t ys[1] = {16};
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ys, lab, sizeof lab,
                                    &r->y));
}

/* which: 0 sgd, 1 adam, 2 adamw (decay on the weights only, clipped) */
static void make_optim(run_state *r, int which) {
  static const double wd[N_PARAMS] = {0.1, 0, 0.1, 0};
  if (which == 2) {
    OK(r->dev, dispatch_adamw_new(r->p, N_PARAMS, 0.01, 0.9, 0.95, 1e-8, wd,
                                  &r->opt));
    OK(r->dev, dispatch_optim_set_clip(r->opt, 0.5));
  } else if (which == 1)
    OK(r->dev,
       dispatch_adam_new(r->p, N_PARAMS, 0.01, 0.9, 0.999, 1e-8, &r->opt));
  else
    OK(r->dev, dispatch_sgd_new(r->p, N_PARAMS, 0.05, 0.9, 0.001, &r->opt));
}

static void fresh_params(run_state *r) {
  int64_t s[N_PARAMS][2] = {{8, 16}, {16, 0}, {16, 4}, {4, 0}};
  int nd[N_PARAMS] = {2, 1, 2, 1};
  for (int i = 0; i < N_PARAMS; i++) {
    dispatch_tensor *t;
    OK(r->dev,
       dispatch_normal(r->dev, DISPATCH_F32, nd[i], s[i], 0, 0.3, 200 + i, &t));
    OK(r->dev, dispatch_autodiff(t, &r->p[i]));
    dispatch_tensor_free(t);
  }
}

/* One step: relu(x W1 + b1) W2 + b2, cross entropy, backward, update. */
static void train_step(run_state *r) {
  dispatch_device *dev = r->dev;
  OK(dev, dispatch_scope_begin(dev));
  dispatch_tensor *h, *hb, *ha, *o, *ob, *loss;
  OK(dev, dispatch_matmul(r->x, r->p[0], &h));
  OK(dev, dispatch_add(h, r->p[1], &hb));
  OK(dev, dispatch_relu(hb, &ha));
  OK(dev, dispatch_matmul(ha, r->p[2], &o));
  OK(dev, dispatch_add(o, r->p[3], &ob));
  OK(dev, dispatch_cross_entropy(ob, r->y, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(r->opt, g));
  dispatch_grads_free(g);
  OK(dev, dispatch_scope_end(dev));
}

static void run_free(run_state *r) {
  dispatch_optim_free(r->opt);
  for (int i = 0; i < N_PARAMS; i++) dispatch_tensor_free(r->p[i]);
  dispatch_tensor_free(r->x);
  dispatch_tensor_free(r->y);
  dispatch_device_close(r->dev);
  memset(r, 0, sizeof *r);
}

/* Params after total steps uninterrupted vs. stopped at k, saved with the
 * optimizer, loaded on a new device (REMOTE: a restarted server) and
 * resumed: the bytes must be identical. */
static void resume_case(const char *kind, int which) {
  const int k = 3, total = 7;
  int adam = which != 0; /* m, v and a step count */
  const char *name = which == 2 ? "adamw" : "adam";
  setup_dir();
  int remote = strcmp(kind, "remote") == 0;
  if (remote) start_server(NULL);

  run_state a = {.dev = open_kind(kind)};
  make_data(&a);
  fresh_params(&a);
  make_optim(&a, which);
  for (int s = 0; s < total; s++) train_step(&a);
  void *want[N_PARAMS];
  size_t wn[N_PARAMS];
  for (int i = 0; i < N_PARAMS; i++) want[i] = read_all(a.p[i], &wn[i]);
  run_free(&a);

  run_state b = {.dev = open_kind(kind)};
  make_data(&b);
  fresh_params(&b);
  make_optim(&b, which);
  for (int s = 0; s < k; s++) train_step(&b);
  char path[300];
  path_in_dir(path, sizeof path, "train.safetensors");
  OK(b.dev, dispatch_save(b.dev, path, k_pnames, b.p, N_PARAMS, b.opt));
  run_free(&b);
  if (remote) {
    /* a fresh server: nothing of the first session survives but the file */
    cr_assert_eq(sp_stop(&g_srv), 0);
    start_server(NULL);
  }

  run_state c = {.dev = open_kind(kind)};
  make_data(&c);
  dispatch_checkpoint *ck;
  OK(c.dev, dispatch_load(c.dev, path, &ck));
  cr_assert_eq(dispatch_checkpoint_count(ck), N_PARAMS * (adam ? 3 : 2) + adam);
  for (int i = 0; i < N_PARAMS; i++) {
    dispatch_tensor *t = dispatch_checkpoint_get(ck, k_pnames[i]);
    cr_assert_not_null(t);
    OK(c.dev, dispatch_autodiff(t, &c.p[i]));
  }
  make_optim(&c, which);
  if (adam) {
    /* an SGD optimizer refuses Adam state and keeps its own */
    dispatch_optim *sgd;
    OK(c.dev, dispatch_sgd_new(c.p, N_PARAMS, 0.1, 0.9, 0, &sgd));
    cr_assert_eq(dispatch_optim_load(sgd, ck), DISPATCH_EINVAL);
    char want[128];
    snprintf(want, sizeof want,
             "holds \"%s\" state for 4 parameters; this optimizer is sgd "
             "over 4", name);
    cr_assert(strstr(dispatch_device_errmsg(c.dev), want), "%s",
              dispatch_device_errmsg(c.dev));
    dispatch_optim_free(sgd);
    /* parameters in another order: state shapes no longer match */
    dispatch_tensor *swapped[N_PARAMS] = {c.p[1], c.p[0], c.p[2], c.p[3]};
    dispatch_optim *adam2;
    if (which == 2)
      OK(c.dev, dispatch_adamw_new(swapped, N_PARAMS, 0.01, 0.9, 0.999, 1e-8,
                                   NULL, &adam2));
    else
      OK(c.dev,
         dispatch_adam_new(swapped, N_PARAMS, 0.01, 0.9, 0.999, 1e-8, &adam2));
    cr_assert_eq(dispatch_optim_load(adam2, ck), DISPATCH_ESHAPE);
    cr_assert(strstr(dispatch_device_errmsg(c.dev),
                     "\"optim.0.m\" is f32 [8, 16], parameter 0 is f32 [16]"),
              "%s", dispatch_device_errmsg(c.dev));
    dispatch_optim_free(adam2);
    cr_assert_not_null(dispatch_checkpoint_get(ck, "optim.step"));
    cr_assert_not_null(dispatch_checkpoint_get(ck, "optim.3.v"));
  } else {
    cr_assert_not_null(dispatch_checkpoint_get(ck, "optim.2.momentum"));
  }
  OK(c.dev, dispatch_optim_load(c.opt, ck));
  dispatch_checkpoint_free(ck); /* the params and the optimizer keep theirs */
  for (int s = k; s < total; s++) train_step(&c);
  for (int i = 0; i < N_PARAMS; i++) {
    size_t n;
    void *got = read_all(c.p[i], &n);
    cr_assert_eq(n, wn[i]);
    cr_assert_eq(memcmp(got, want[i], n), 0,
                 "%s after a resume differs from the uninterrupted run",
                 k_pnames[i]);
    free(got);
    free(want[i]);
  }
  run_free(&c);
}

Test(checkpoint, resume_adam_remote_fresh_server, .fini = teardown) {
  resume_case("remote", 1);
}
Test(checkpoint, resume_sgd_remote_fresh_server, .fini = teardown) {
  resume_case("remote", 0);
}
Test(checkpoint, resume_adam_local, .fini = teardown) {
  resume_case("local", 1);
}
Test(checkpoint, resume_adamw_clipped_local, .fini = teardown) {
  resume_case("local", 2);
}
Test(checkpoint, resume_adamw_clipped_remote_fresh_server, .fini = teardown) {
  resume_case("remote", 2);
}
/* Adam and AdamW state have the same names: the kind tells them apart */
Test(checkpoint, adam_refuses_adamw_state, .fini = teardown) {
  setup_dir();
  run_state a = {.dev = open_kind("local")};
  make_data(&a);
  fresh_params(&a);
  make_optim(&a, 2);
  train_step(&a);
  char path[300];
  path_in_dir(path, sizeof path, "adamw.safetensors");
  OK(a.dev, dispatch_save(a.dev, path, k_pnames, a.p, N_PARAMS, a.opt));
  dispatch_checkpoint *ck;
  OK(a.dev, dispatch_load(a.dev, path, &ck));
  cr_assert_str_eq(dispatch_checkpoint_meta(ck, "dispatch.optim"), "adamw");
  dispatch_optim *adam;
  OK(a.dev, dispatch_adam_new(a.p, N_PARAMS, 0.01, 0.9, 0.999, 1e-8, &adam));
  cr_assert_eq(dispatch_optim_load(adam, ck), DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(a.dev),
                   "holds \"adamw\" state for 4 parameters; this optimizer "
                   "is adam over 4"),
            "%s", dispatch_device_errmsg(a.dev));
  dispatch_optim_free(adam);
  dispatch_checkpoint_free(ck);
  run_free(&a);
}

/* ------------------------------------------------------------------ */
/* issue 21 item 10: a FIFO is refused, not opened for ever            */

/* Loading a FIFO nobody writes returns "not a regular file" at once; a
 * blocking open waited for a writer that never comes (the timeout ends
 * the test if it hangs). */
Test(checkpoint, load_of_a_fifo_refused, .fini = teardown, .timeout = 30) {
  setup_dir();
  char path[300];
  path_in_dir(path, sizeof path, "fifo.safetensors");
  cr_assert_eq(mkfifo(path, 0600), 0);
  dispatch_device *dev = open_kind("local");
  dispatch_checkpoint *ck = NULL;
  cr_assert_eq(dispatch_load(dev, path, &ck), DISPATCH_EINVAL);
  cr_assert_null(ck);
  cr_assert(strstr(dispatch_device_errmsg(dev), "not a regular file"), "%s",
            dispatch_device_errmsg(dev));
  OK(dev, dispatch_device_sync(dev));
  dispatch_device_close(dev);
}
