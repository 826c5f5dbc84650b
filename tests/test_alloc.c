/* Allocation by size class (issue 11 item 2): a budget's free lists
 * (common/cache.c) and the CPU backend's block cache.
 *
 * In process, through the core: hits and misses as the counters show
 * them (same class and device reuse the block, zeroed; another class or
 * device does not), the byte bound holds after every free, a charge the
 * budget (or its parent) would refuse first gets the cached bytes back,
 * and the CPU block cache keeps more than eight blocks, by bytes.
 * Through a real dispatch-server on 127.0.0.1: a session at its quota
 * with cached blocks still uploads, and a session gets the cached bytes
 * of another one back before --max-memory refuses it. Through the client:
 * sixteen 16 MiB tensors kept live, freed and made again fault in far
 * fewer fresh pages with the LOCAL cache than without it (getrusage's
 * minor faults, compared within the test, no time involved), and a few
 * training steps give the same bits with the cache on, off and REMOTE. */
#include <criterion/criterion.h>
#include <malloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "client_internal.h"
#include "backend.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#define MiB (1024ull * 1024ull)

static sp_server g_srv;

static void stop_server(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static void start_server(const char *const *extra) {
  if (!getenv("DISPATCH_SERVER_BIN") || !*getenv("DISPATCH_SERVER_BIN"))
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs "
                   "dispatch-server (make test sets it); failing rather "
                   "than skipping");
  const char *args[24] = {"--log-level", "error", "--storage-cache", "0"};
  int n = 4;
  for (int i = 0; extra && extra[i] && n < 23; i++) args[n++] = extra[i];
  args[n] = NULL;
  cr_assert_eq(sp_start(&g_srv, args), 0, "dispatch-server did not start");
}

/* A ctx charging a new budget of `limit` (under parent) with free lists
 * of `cache` bytes; *b is the caller's reference. */
static dsp_ctx *ctx_with(uint64_t limit, uint64_t cache, dsp_budget *parent,
                         dsp_budget **b) {
  dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
  cr_assert_not_null(ctx);
  *b = dsp_budget_new(limit, parent, "session", "--max-session-bytes");
  cr_assert_not_null(*b);
  cr_assert_eq(dsp_budget_set_cache(*b, cache), 0);
  dsp_ctx_set_budget(ctx, *b);
  return ctx;
}

static void ctx_done(dsp_ctx *ctx, dsp_budget *b) {
  dsp_budget_set_cache(b, 0);
  cr_assert_eq(dsp_budget_used(b), 0, "all freed, lists emptied: %llu",
               (unsigned long long)dsp_budget_used(b));
  dsp_ctx_free(ctx);
  dsp_budget_unref(b);
}

static dsp_tensor *f32_new(dsp_ctx *ctx, int64_t n) {
  dsp_meta m = {DSP_F32, 1, {n}};
  dsp_tensor *t = NULL;
  int rc = dsp_tensor_new(ctx, &m, &t);
  cr_assert_eq(rc, 0, "new [%lld]: %s", (long long)n, dsp_ctx_errmsg(ctx));
  return t;
}

static dsp_cache_stats stats_of(dsp_budget *b) {
  dsp_cache_stats st;
  dsp_budget_cache_stats(b, &st);
  return st;
}

Test(alloc, free_lists_count_hits_and_misses) {
  dsp_budget *b;
  dsp_ctx *ctx = ctx_with(1ull << 30, 1 * MiB, NULL, &b);
  dsp_tensor *t = f32_new(ctx, 16);
  void *p16 = dsp_tensor_data(t);
  for (int i = 0; i < 16; i++) ((float *)p16)[i] = 7.0f;
  dsp_tensor_unref(t);
  dsp_cache_stats st = stats_of(b);
  cr_assert_eq(st.misses, 1);
  cr_assert_eq(st.hits, 0);
  cr_assert_gt(st.bytes, 0, "the freed storage and header are kept");
  /* same size: the same block, zeroed as dsp_tensor_new promises */
  t = f32_new(ctx, 16);
  cr_assert_eq(dsp_tensor_data(t), p16);
  for (int i = 0; i < 16; i++) cr_assert_eq(((float *)p16)[i], 0.0f);
  st = stats_of(b);
  cr_assert_eq(st.hits, 1);
  dsp_tensor_unref(t);
  /* another size class: a miss, and the 16-float block stays */
  dsp_tensor *big = f32_new(ctx, 1000);
  void *p1000 = dsp_tensor_data(big);
  cr_assert_eq(stats_of(b).misses, 2);
  dsp_tensor_unref(big);
  /* 990 floats share 1000's class and fit its block: a hit */
  t = f32_new(ctx, 990);
  cr_assert_eq(dsp_tensor_data(t), p1000);
  cr_assert_eq(stats_of(b).hits, 2);
  dsp_tensor_unref(t);
  /* 1010 floats share the class but do not fit: a miss */
  t = f32_new(ctx, 1010);
  cr_assert_neq(dsp_tensor_data(t), p1000);
  cr_assert_eq(stats_of(b).misses, 3);
  dsp_tensor_unref(t);
  /* the same size on another device instance is that device's storage */
  dsp_backend *cpu1 = dsp_cpu_backend_new("cpu:1");
  cr_assert_not_null(cpu1);
  dsp_ctx_set_backend(ctx, cpu1);
  t = f32_new(ctx, 16);
  cr_assert_neq(dsp_tensor_data(t), p16);
  cr_assert_eq(t->storage->backend, cpu1);
  cr_assert_eq(stats_of(b).misses, 4);
  dsp_tensor_unref(t);
  dsp_ctx_set_backend(ctx, NULL);
  t = f32_new(ctx, 16);
  cr_assert_eq(dsp_tensor_data(t), p16);
  dsp_tensor_unref(t);
  ctx_done(ctx, b);
  dsp_cpu_backend_free(cpu1);
}

Test(alloc, lists_never_exceed_their_bound) {
  enum { N = 64 };
  const uint64_t bound = 256 * 1024;
  dsp_budget *b;
  dsp_ctx *ctx = ctx_with(1ull << 30, bound, NULL, &b);
  dsp_tensor *t[N];
  for (int i = 0; i < N; i++) t[i] = f32_new(ctx, 16 + 997 * (int64_t)i);
  for (int i = 0; i < N; i++) {
    dsp_tensor_unref(t[(i * 7) % N]); /* 7 is prime to 64: each once */
    dsp_cache_stats st = stats_of(b);
    cr_assert_leq(st.bytes, bound, "after %d frees: %llu kept", i + 1,
                  (unsigned long long)st.bytes);
    cr_assert_eq(st.max_bytes, bound);
  }
  dsp_cache_stats st = stats_of(b);
  cr_assert_gt(st.evicted, 0, "older blocks made room for newer ones");
  cr_assert_gt(st.bytes, bound / 2, "the lists are used up to their bound");
  /* nothing is live: what the budget holds is exactly what is kept */
  cr_assert_eq(dsp_budget_used(b), st.bytes);
  /* a lower bound lets go of the difference at once */
  cr_assert_eq(dsp_budget_set_cache(b, bound / 4), 0);
  cr_assert_leq(stats_of(b).bytes, bound / 4);
  cr_assert_eq(dsp_budget_used(b), stats_of(b).bytes);
  ctx_done(ctx, b);
}

/* 3 x 2 MiB freed into the lists of an 8 MiB budget: a 5 MiB tensor
 * does not fit beside them, and without giving them back the budget
 * would refuse it. */
Test(alloc, refused_charge_gets_cached_bytes_back_first) {
  dsp_budget *b;
  dsp_ctx *ctx = ctx_with(8 * MiB, 8 * MiB, NULL, &b);
  dsp_tensor *t[3];
  for (int i = 0; i < 3; i++) t[i] = f32_new(ctx, (int64_t)(2 * MiB / 4));
  for (int i = 0; i < 3; i++) dsp_tensor_unref(t[i]);
  cr_assert_gt(stats_of(b).bytes, 6 * MiB);
  cr_assert_gt(dsp_budget_used(b), 6 * MiB, "kept blocks stay charged");
  dsp_tensor *big = f32_new(ctx, (int64_t)(5 * MiB / 4));
  dsp_cache_stats st = stats_of(b);
  cr_assert_geq(st.released, 3 * MiB, "released %llu",
                (unsigned long long)st.released);
  cr_assert_leq(dsp_budget_used(b), 8 * MiB);
  dsp_tensor_unref(big);
  /* what cannot fit even with empty lists is still refused, by name */
  dsp_meta m = {DSP_F32, 1, {(int64_t)(9 * MiB / 4)}};
  dsp_tensor *no = NULL;
  cr_assert_eq(dsp_tensor_new(ctx, &m, &no), DISPATCH_EQUOTA);
  cr_assert_null(no);
  cr_assert(strstr(dsp_ctx_errmsg(ctx), "session holds") &&
                strstr(dsp_ctx_errmsg(ctx), "--max-session-bytes"),
            "%s", dsp_ctx_errmsg(ctx));
  ctx_done(ctx, b);
}

/* Two sessions under an 8 MiB server budget: the second one's 5 MiB
 * tensor gets the first one's cached 6 MiB back. */
Test(alloc, server_budget_gets_other_sessions_cached_bytes_back) {
  dsp_budget *server = dsp_budget_new(8 * MiB, NULL, "server",
                                      "--max-memory");
  dsp_budget *ba, *bb;
  dsp_ctx *a = ctx_with(8 * MiB, 8 * MiB, server, &ba);
  dsp_ctx *c = ctx_with(8 * MiB, 8 * MiB, server, &bb);
  dsp_tensor *t[3];
  for (int i = 0; i < 3; i++) t[i] = f32_new(a, (int64_t)(2 * MiB / 4));
  for (int i = 0; i < 3; i++) dsp_tensor_unref(t[i]);
  uint64_t kept = stats_of(ba).bytes;
  cr_assert_gt(kept, 6 * MiB);
  dsp_tensor *big = f32_new(c, (int64_t)(5 * MiB / 4));
  cr_assert_lt(stats_of(ba).bytes, kept, "the other session's lists gave");
  cr_assert_gt(stats_of(ba).released, 0);
  cr_assert_leq(dsp_budget_used(server), 8 * MiB);
  dsp_tensor_unref(big);
  ctx_done(a, ba);
  ctx_done(c, bb);
  cr_assert_eq(dsp_budget_used(server), 0);
  dsp_budget_unref(server);
}

/* Sessions that come and go while others, squeezed by the server
 * budget, take their cached bytes: four threads, each making sessions
 * (budgets with lists) that allocate and free under a budget too small
 * for all, and end. No deadlock (a budget whose last reference goes
 * while another thread releases its lists), and nothing is left charged
 * at the end. */
typedef struct churn_arg {
  dsp_budget *server;
  int seed;
  int ok, quota;
} churn_arg;

#include <pthread.h>
static void *churn(void *p) {
  churn_arg *a = p;
  unsigned r = (unsigned)a->seed;
  for (int s = 0; s < 40; s++) {
    dsp_budget *b = dsp_budget_new(6 * MiB, a->server, "session",
                                   "--max-session-bytes");
    dsp_ctx *ctx = dsp_ctx_new(dsp_cpu_backend());
    if (!b || !ctx || dsp_budget_set_cache(b, 4 * MiB) < 0) return NULL;
    dsp_ctx_set_budget(ctx, b);
    dsp_tensor *live[4] = {NULL};
    for (int i = 0; i < 60; i++) {
      r = r * 1103515245u + 12345u;
      int k = (int)((r >> 8) % 4);
      dsp_tensor_unref(live[k]);
      live[k] = NULL;
      dsp_meta m = {DSP_F32, 1, {(int64_t)(1 + (r >> 12) % (512 * 1024))}};
      if (dsp_tensor_new(ctx, &m, &live[k]) == 0) a->ok++;
      else a->quota++;
    }
    for (int k = 0; k < 4; k++) dsp_tensor_unref(live[k]);
    dsp_budget_set_cache(b, 0);
    dsp_ctx_free(ctx);
    dsp_budget_unref(b);
  }
  return NULL;
}

Test(alloc, sessions_churn_under_server_pressure, .timeout = 120) {
  dsp_budget *server = dsp_budget_new(12 * MiB, NULL, "server",
                                      "--max-memory");
  pthread_t th[4];
  churn_arg args[4];
  for (int i = 0; i < 4; i++) {
    args[i] = (churn_arg){server, i + 1, 0, 0};
    cr_assert_eq(pthread_create(&th[i], NULL, churn, &args[i]), 0);
  }
  int ok = 0, quota = 0;
  for (int i = 0; i < 4; i++) {
    pthread_join(th[i], NULL);
    ok += args[i].ok;
    quota += args[i].quota;
  }
  fprintf(stderr, "alloc churn: %d allocations, %d refused\n", ok, quota);
  cr_assert_gt(ok, 4 * 40 * 60 / 2);
  cr_assert_eq(dsp_budget_used(server), 0, "left charged: %llu",
               (unsigned long long)dsp_budget_used(server));
  dsp_budget_unref(server);
}

/* The CPU backend's own cache: more than the eight blocks it used to keep,
 * bounded by bytes, oldest out first. */
Test(alloc, cpu_block_cache_by_class_and_bytes) {
  enum { N = 12 };
  const dsp_backend *be = dsp_cpu_backend();
  const size_t sz = 3 * MiB / 2;
  dsp_cpu_cache_set_limit(64 * MiB);
  void *blk[N];
  for (int i = 0; i < N; i++)
    cr_assert_eq(be->alloc(be->bctx, sz, 0, &blk[i]), 0);
  for (int i = 0; i < N; i++) be->free(be->bctx, blk[i]);
  dsp_cache_stats st;
  dsp_cpu_cache_stats(&st);
  cr_assert_eq(st.bytes, N * sz, "all %d blocks kept: %llu bytes", N,
               (unsigned long long)st.bytes);
  uint64_t hits0 = st.hits;
  void *again[N];
  for (int i = 0; i < N; i++) {
    cr_assert_eq(be->alloc(be->bctx, sz, 1, &again[i]), 0);
    cr_assert_eq(((unsigned char *)again[i])[sz - 1], 0, "zeroed on reuse");
  }
  dsp_cpu_cache_stats(&st);
  cr_assert_eq(st.hits - hits0, N);
  cr_assert_eq(st.bytes, 0);
  /* a 10 MiB bound: the oldest go, the bound holds */
  dsp_cpu_cache_set_limit(10 * MiB);
  for (int i = 0; i < N; i++) {
    be->free(be->bctx, again[i]);
    dsp_cpu_cache_stats(&st);
    cr_assert_leq(st.bytes, 10 * MiB);
  }
  cr_assert_gt(st.evicted, 0);
  dsp_cpu_cache_set_limit(0);
  dsp_cpu_cache_stats(&st);
  cr_assert_eq(st.bytes, 0);
}

/* ---------------------------------------------------------- server */

static void *filled(size_t n, float v) {
  float *p = malloc(n);
  cr_assert_not_null(p);
  for (size_t i = 0; i < n / 4; i++) p[i] = v;
  return p;
}

static int upload_mib(wire_conn *c, uint64_t id, int mib, char *msg,
                      size_t len) {
  size_t n = (size_t)mib * MiB;
  void *v = filled(n, 1.5f);
  int64_t s[1] = {(int64_t)(n / 4)};
  wire_upload(c, id, DSP_F32, 1, s, v, n);
  free(v);
  return wire_sync_check(c, msg, len, NULL);
}

/* A session at --max-session-bytes 40 MiB holding 32 MiB of freed
 * uploads in its lists uploads 24 MiB: the lists give way. */
Test(alloc, session_at_its_quota_uses_its_cached_bytes,
     .fini = stop_server, .timeout = 120) {
  const char *args[] = {"--max-session-bytes", "41943040",
                        "--session-cache", "64M", NULL};
  start_server(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "alloc"), 0);
  char msg[700] = "";
  cr_assert_eq(upload_mib(&c, 1, 16, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(upload_mib(&c, 2, 16, msg, sizeof msg), 0, "%s", msg);
  uint64_t ids[2] = {1, 2};
  wire_free(&c, ids, 2, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_lt(st.held_bytes, 1 * MiB, "held_bytes leaves the lists out");
  cr_assert_gt(st.server_held_bytes, 32 * MiB, "the lists stay charged");
  cr_assert_eq(upload_mib(&c, 3, 24, msg, sizeof msg), 0,
               "24 MiB beside 32 MiB of cached blocks: %s", msg);
  /* past the quota with nothing cached to give: refused as before */
  cr_assert_eq(upload_mib(&c, 4, 24, msg, sizeof msg), DISPATCH_EQUOTA);
  cr_assert(strstr(msg, "--max-session-bytes"), "%s", msg);
  wire_close(&c);
  /* a clean exit: under valgrind (make valgrind's wrapper) a leak or a
   * memory error would change it */
  cr_assert_eq(sp_stop(&g_srv), 0, "server did not shut down cleanly");
}

/* Session A keeps 32 MiB of freed uploads cached and stays connected;
 * session B's 32 MiB under --max-memory 48 MiB get them back. */
Test(alloc, server_memory_pressure_takes_other_sessions_cached_bytes,
     .fini = stop_server, .timeout = 120) {
  const char *args[] = {"--max-memory", "50331648", "--session-cache", "64M",
                        NULL};
  start_server(args);
  wire_conn a, b;
  cr_assert_eq(wire_connect(&a, g_srv.port), 0);
  cr_assert_eq(wire_hello(&a, "a"), 0);
  cr_assert_eq(wire_connect(&b, g_srv.port), 0);
  cr_assert_eq(wire_hello(&b, "b"), 0);
  char msg[700] = "";
  cr_assert_eq(upload_mib(&a, 1, 16, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(upload_mib(&a, 2, 16, msg, sizeof msg), 0, "%s", msg);
  uint64_t ids[2] = {1, 2};
  wire_free(&a, ids, 2, NULL, 0);
  cr_assert_eq(wire_sync_check(&a, msg, sizeof msg, NULL), 0, "%s", msg);
  cr_assert_eq(upload_mib(&b, 1, 16, msg, sizeof msg), 0, "%s", msg);
  cr_assert_eq(upload_mib(&b, 2, 16, msg, sizeof msg), 0,
               "B's second 16 MiB needs A's cached blocks: %s", msg);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&b, &st), 0);
  cr_assert_leq(st.server_held_bytes, 48 * MiB);
  cr_assert_gt(st.held_bytes, 32 * MiB);
  wire_close(&a);
  wire_close(&b);
  cr_assert_eq(sp_stop(&g_srv), 0, "server did not shut down cleanly");
}

/* Decoded requests take one arena each (server/encode.c): charged to the
 * session's queue while they wait, given back whole when they are freed,
 * whichever way they end (run, refused by the rules, undecodable). */
Test(alloc, request_arenas_are_charged_and_given_back,
     .fini = stop_server, .timeout = 120) {
  const char *args[] = {"--session-cache", "0", NULL};
  start_server(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "arena"), 0);
  float one[16];
  for (int i = 0; i < 16; i++) one[i] = 1.0f;
  int64_t s16[1] = {16};
  wire_upload(&c, 1, DSP_F32, 1, s16, one, sizeof one);
  Dspwire__StatsReply base;
  cr_assert_eq(wire_get_stats(&c, &base), 0);
  for (uint64_t i = 0; i < 2000; i++) {
    uint64_t in[2] = {i == 0 ? 1 : i + 1, 1};
    wire_op(&c, DSP_OP_ADD, in, 2, i + 2, NULL, 0, NULL, 0);
    if (i > 0) {
      uint64_t f[1] = {i + 1};
      wire_free(&c, f, 1, NULL, 0);
    }
  }
  /* an op on a missing id: decoded, then failed by the worker */
  uint64_t missing[2] = {999999, 1};
  wire_op(&c, DSP_OP_ADD, missing, 2, 5000, NULL, 0, NULL, 0);
  char msg[512];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), DISPATCH_ENOID,
               "%s", msg);
  float *back = NULL;
  size_t n = 0;
  int nd = 0;
  int64_t shp[8];
  cr_assert_eq(wire_read_tensor(&c, 2001, (void **)&back, &n, &nd, shp), 0);
  cr_assert_eq(n, sizeof one);
  cr_assert_eq(back[0], 2001.0f, "the chain ran: %f", back[0]);
  free(back);
  /* The requests' arenas go back as the loop frees finished requests
   * (a bounded wait); only the Stats request itself, decoded while it
   * runs, stays charged then. 2000 leaked arenas would hold ~350 KB. */
  Dspwire__StatsReply st;
  int settled = 0;
  for (int i = 0; i < 400 && !settled; i++) {
    cr_assert_eq(wire_get_stats(&c, &st), 0);
    settled = st.queued_bytes < 1024 &&
              st.server_held_bytes == st.held_bytes + st.queued_bytes;
    if (!settled) usleep(5000);
  }
  cr_assert(settled, "queue still charged %llu, server %llu, session %llu",
            (unsigned long long)st.queued_bytes,
            (unsigned long long)st.server_held_bytes,
            (unsigned long long)st.held_bytes);
  cr_assert_eq(st.tensors, base.tensors + 1);
  wire_close(&c);
  cr_assert_eq(sp_stop(&g_srv), 0, "server did not shut down cleanly");
}

/* ---------------------------------------------------------- LOCAL */

static long minflt(void) {
  struct rusage ru;
  getrusage(RUSAGE_SELF, &ru);
  return ru.ru_minflt;
}

/* Sixteen 16 MiB tensors made (and written) while all live, freed, made
 * again: the minor faults of the second round. */
static long second_round_faults(uint64_t cache, uint64_t *hits) {
  enum { N = 16 };
  dispatch_device *dev = NULL;
  char err[256];
  cr_assert_eq(dispatch_device_open("local", NULL, &dev, err, sizeof err), 0,
               "%s", err);
  OK(dev, dispatch_device_set_cache(dev, cache));
  int64_t shape[1] = {(int64_t)(16 * MiB / 4)};
  dispatch_tensor *t[N];
  for (int i = 0; i < N; i++)
    OK(dev, dispatch_full(dev, DISPATCH_F32, 1, shape, 1.0 + i, &t[i]));
  for (int i = 0; i < N; i++) dispatch_tensor_free(t[i]);
  long f0 = minflt();
  for (int i = 0; i < N; i++)
    OK(dev, dispatch_full(dev, DISPATCH_F32, 1, shape, 2.0 + i, &t[i]));
  long f = minflt() - f0;
  for (int i = 0; i < N; i++) dispatch_tensor_free(t[i]);
  dsp_cache_stats st;
  dsp_budget_cache_stats(dsp_ctx_budget(dev->ctx), &st);
  *hits = st.hits;
  dispatch_device_close(dev);
  return f;
}

Test(alloc, sixteen_16mib_tensors_reuse_their_blocks) {
  /* glibc then maps every block of 128 KiB and more afresh and unmaps it
   * on free, whatever came before, so the run without the cache faults
   * its pages in each time */
#if !defined(__SANITIZE_ADDRESS__)
  cr_assert_eq(mallopt(M_MMAP_THRESHOLD, 128 * 1024), 1);
#endif
  /* (AddressSanitizer's allocator maps large blocks itself and keeps
   * freed ones in quarantine: fresh pages each time as well) */
  uint64_t hits_off, hits_on;
  long off = second_round_faults(0, &hits_off);
  long on = second_round_faults(512 * MiB, &hits_on);
  fprintf(stderr, "alloc: 16 x 16 MiB made again: %ld minor faults without "
          "the LOCAL cache, %ld with it\n", off, on);
  cr_assert_gt(off, 16 * 1000, "without the cache the pages fault in anew");
  cr_assert_lt(on * 8, off, "with the cache: %ld faults, without: %ld", on,
               off);
  cr_assert_eq(hits_off, 0);
  cr_assert_geq(hits_on, 16, "every block of the second round reused");
}

/* A few SGD steps of a small MLP; its parameters after them. */
static void train(dispatch_device *dev, float out[2][48 * 64]) {
  int64_t sx[2] = {64, 48}, sw1[2] = {48, 64}, sw2[2] = {64, 32};
  dispatch_tensor *x, *w1, *w2, *p[2], *target;
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, sx, -1, 1, 1, &x));
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, sw1, -0.2, 0.2, 2, &w1));
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, sw2, -0.2, 0.2, 3, &w2));
  int64_t st[2] = {64, 32};
  OK(dev, dispatch_uniform(dev, DISPATCH_F32, 2, st, 0, 1, 4, &target));
  OK(dev, dispatch_autodiff(w1, &p[0]));
  OK(dev, dispatch_autodiff(w2, &p[1]));
  dispatch_optim *opt;
  OK(dev, dispatch_sgd_new(p, 2, 0.05, 0.9, 0.0, &opt));
  for (int step = 0; step < 6; step++) {
    OK(dev, dispatch_scope_begin(dev));
    dispatch_tensor *h, *r, *y, *loss;
    OK(dev, dispatch_matmul(x, p[0], &h));
    OK(dev, dispatch_relu(h, &r));
    OK(dev, dispatch_matmul(r, p[1], &y));
    OK(dev, dispatch_mse(y, target, &loss));
    dispatch_grads *g;
    OK(dev, dispatch_backward(loss, &g));
    OK(dev, dispatch_optim_step(opt, g));
    dispatch_grads_free(g);
    OK(dev, dispatch_scope_end(dev));
  }
  OK(dev, dispatch_tensor_read(p[0], out[0], 48 * 64 * 4));
  OK(dev, dispatch_tensor_read(p[1], out[1], 64 * 32 * 4));
  dispatch_optim_free(opt);
}

Test(alloc, cache_on_off_and_remote_train_bit_identical,
     .fini = stop_server, .timeout = 120) {
  start_server(NULL);
  static float res[3][2][48 * 64];
  memset(res, 0, sizeof res);
  for (int k = 0; k < 3; k++) {
    char spec[64], err[256];
    snprintf(spec, sizeof spec, k == 2 ? "tcp://127.0.0.1:%d" : "local",
             g_srv.port);
    dispatch_device *dev = NULL;
    cr_assert_eq(dispatch_device_open(spec, NULL, &dev, err, sizeof err), 0,
                 "%s", err);
    if (k == 1) OK(dev, dispatch_device_set_cache(dev, 0));
    train(dev, res[k]);
    if (k == 0) {
      dsp_cache_stats st;
      dsp_budget_cache_stats(dsp_ctx_budget(dev->ctx), &st);
      cr_assert_gt(st.hits, 20, "the steps reused blocks: %llu hits",
                   (unsigned long long)st.hits);
    }
    dispatch_device_close(dev);
  }
  cr_assert_eq(memcmp(res[0], res[1], sizeof res[0]), 0,
               "LOCAL with and without the cache differ");
  cr_assert_eq(memcmp(res[0], res[2], sizeof res[0]), 0,
               "LOCAL and REMOTE differ");
}

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
/* Under AddressSanitizer (make sanitize) a kept block is poisoned, so a
 * use after free of a tensor whose storage waits in the lists still
 * reports; reuse unpoisons it. */
Test(alloc, asan_sees_kept_blocks_as_freed) {
  dsp_budget *b;
  dsp_ctx *ctx = ctx_with(1ull << 30, 1 * MiB, NULL, &b);
  dsp_tensor *t = f32_new(ctx, 1000);
  float *p = dsp_tensor_data(t);
  cr_assert_eq(__asan_address_is_poisoned(p), 0);
  dsp_tensor_unref(t);
  cr_assert_eq(__asan_address_is_poisoned(p), 1);
  cr_assert_eq(__asan_address_is_poisoned(p + 999), 1);
  t = f32_new(ctx, 1000);
  cr_assert_eq(dsp_tensor_data(t), p, "the kept block came back");
  cr_assert_eq(__asan_address_is_poisoned(p + 999), 0);
  dsp_tensor_unref(t);
  /* the CPU backend's own cache too */
  const dsp_backend *be = dsp_cpu_backend();
  dsp_cpu_cache_set_limit(8 * MiB);
  void *blk;
  cr_assert_eq(be->alloc(be->bctx, 2 * MiB, 0, &blk), 0);
  be->free(be->bctx, blk);
  cr_assert_eq(__asan_address_is_poisoned((char *)blk + MiB), 1);
  dsp_cpu_cache_set_limit(0);
  ctx_done(ctx, b);
}
#endif
