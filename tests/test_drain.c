/* SIGTERM drains (issue 12 item 3): against a real dispatch-server on
 * 127.0.0.1 port 0. Requests the server has read before the signal run
 * and are answered, then every session gets an Error frame with
 * DISPATCH_ESHUTDOWN (req_id 0) and a close; new connections are refused;
 * --drain-timeout bounds the wait for long work; the exit status is 0.
 * The client library reports the goodbye as DISPATCH_ESHUTDOWN, not as a
 * lost connection (DISPATCH_ECONN).
 *
 * To know the server has read a pipeline before the signal is sent, the
 * pipeline goes out in one send() headed by a Sync: the server parses a
 * whole read buffer in one go and answers a Sync on an idle session at
 * once, so its reply arriving means the rest of that buffer was parsed
 * too (a few KiB over loopback arrive in one piece). */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"
#include "wire_req.h"

static sp_server g_srv;

static void start(const char *const *args) {
  check_server_start(&g_srv, args);
}

static void stop(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

/* A pipeline assembled in memory and sent with one send(). */
typedef struct pipe_buf {
  uint8_t buf[16384];
  size_t n;
  uint64_t next_id;
} pipe_buf;

static uint64_t put(pipe_buf *p, Dspwire__Request *r) {
  r->req_id = p->next_id++;
  cr_assert_lt(p->n + dsp_req_frame_size(r), sizeof p->buf);
  p->n += dsp_req_frame_encode(r, 0, p->buf + p->n);
  return r->req_id;
}

/* full([n, n], value) into id */
static void put_full(pipe_buf *p, uint64_t id, int64_t n, double value) {
  dsp_wreq w;
  int64_t ints[3] = {DSP_F32, n, n};
  put(p, dsp_wreq_op(&w, DSP_OP_FULL, NULL, 0, id, ints, 3, &value, 1, 1));
}

static void put_matmul(pipe_buf *p, uint64_t a, uint64_t b, uint64_t out) {
  dsp_wreq w;
  uint64_t in[2] = {a, b};
  put(p, dsp_wreq_op(&w, DSP_OP_MATMUL, in, 2, out, NULL, 0, NULL, 0, 1));
}

/* Sends the pipeline (a Sync first) and waits for the Sync's reply. */
static void send_after_sync(wire_conn *c, pipe_buf *p) {
  cr_assert_eq(wire_send_raw(c, p->buf, p->n), 0);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(c, &r, &bulk, &bl), 0, "no reply to the sync");
  cr_assert_eq(r->req_id, 1, "first reply is for req %llu",
               (unsigned long long)r->req_id);
  cr_assert_null(r->error, "sync failed: %s",
                 r->error ? r->error->message : "");
  wire_reply_free(r, bulk);
}

/* Expects the goodbye: an Error frame, req_id 0, DISPATCH_ESHUTDOWN; its
 * message is copied to msg. */
static void expect_goodbye(wire_conn *c, char *msg, size_t len) {
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(c, &r, &bulk, &bl), 0, "no goodbye frame");
  cr_assert_not_null(r->error, "a reply for req %llu instead of the goodbye",
                     (unsigned long long)r->req_id);
  cr_assert_eq(r->req_id, 0);
  cr_assert_eq(r->error->code, DISPATCH_ESHUTDOWN, "code %d: %s",
               r->error->code, r->error->message);
  snprintf(msg, len, "%s", r->error->message);
  wire_reply_free(r, bulk);
}

/* A queue of matmuls of n x n f32 (n a power of two; n = 2048 is about
 * 17 GFLOP each), then a Sum and a Read of it; the values stay exact:
 * full(1/n) @ full(1/n) is n * n^-2 = 1/n again, and the sum is n. */
static uint64_t put_long_work(pipe_buf *p, int64_t n, int matmuls) {
  put_full(p, 1000, n, 1.0 / (double)n);
  uint64_t cur = 1000;
  for (int i = 0; i < matmuls; i++) {
    put_matmul(p, cur, 1000, 1001 + (uint64_t)i);
    cur = 1001 + (uint64_t)i;
  }
  dsp_wreq w;
  put(p, dsp_wreq_op(&w, DSP_OP_SUM, &cur, 1, 5000, NULL, 0, NULL, 0, 1));
  return put(p, dsp_wreq_read(&w, 5000));
}

Test(drain, queued_work_answered_then_shutdown, .init = NULL,
     .fini = stop, .timeout = 240) {
  const char *args[] = {"--drain-timeout", "120", NULL};
  start(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "drain"), 0);
  pipe_buf *p = calloc(1, sizeof *p);
  p->next_id = 1;
  dsp_wreq w;
  put(p, dsp_wreq_sync(&w));
  uint64_t rd = put_long_work(p, 1024, 8);
  send_after_sync(&c, p);
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);

  /* the Read queued before the signal is answered, with the right value */
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0, "the Read got no reply");
  cr_assert_null(r->error, "the Read failed: %d %s",
                 r->error ? r->error->code : 0,
                 r->error ? r->error->message : "");
  cr_assert_eq(r->req_id, rd);
  cr_assert_eq(bl, sizeof(float));
  float v;
  memcpy(&v, bulk, sizeof v);
  cr_assert_eq(v, 1024.0f, "sum %g", (double)v);
  wire_reply_free(r, bulk);

  char msg[256];
  expect_goodbye(&c, msg, sizeof msg);
  cr_assert(strstr(msg, "shutting down"), "%s", msg);
  cr_assert_eq(wire_wait_closed(&c), 1, "not closed after the goodbye");
  wire_close(&c);
  cr_assert_eq(sp_wait(&g_srv), 0, "exit status after the drain");
  g_srv.pid = 0;
  free(p);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Work far longer than --drain-timeout 1: cut off, the goodbye says so,
 * a connection tried during the drain is refused, and the exit is 0. */
Test(drain, timeout_cuts_long_work, .fini = stop, .timeout = 240) {
  const char *args[] = {"--drain-timeout", "1", NULL};
  start(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "drain"), 0);
  pipe_buf *p = calloc(1, sizeof *p);
  p->next_id = 1;
  dsp_wreq w;
  put(p, dsp_wreq_sync(&w));
  put_long_work(p, 2048, 200); /* minutes of work on any CPU */
  send_after_sync(&c, p);
  double t0 = now_s();
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);

  /* new connections: refused once the signal is handled (bounded wait) */
  int refused = 0;
  for (int i = 0; i < 1000 && !refused; i++) {
    wire_conn x;
    if (wire_connect(&x, g_srv.port) < 0) {
      refused = 1;
    } else {
      wire_close(&x);
      usleep(1000);
    }
  }
  cr_assert(refused, "connections still accepted during the drain");
  cr_assert_eq(waitpid(g_srv.pid, NULL, WNOHANG), 0,
               "the server exited before its drain timeout");

  char msg[256];
  expect_goodbye(&c, msg, sizeof msg);
  cr_assert(strstr(msg, "cut off"), "%s", msg);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
  cr_assert_eq(sp_wait(&g_srv), 0, "exit status after a cut-off drain");
  g_srv.pid = 0;
  /* generous: the timeout is 1 s, a cancelled matmul stops within a block */
  cr_assert_lt(now_s() - t0, 60.0, "drain took %.1f s", now_s() - t0);
  free(p);
}

static dispatch_device *open_remote(void) {
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s", spec, msg);
  return dev;
}

/* A library session idle during SIGTERM: the server exits 0 at once, and
 * the session's next calls report DISPATCH_ESHUTDOWN, not ECONN. */
Test(drain, idle_client_sees_eshutdown, .fini = stop, .timeout = 120) {
  start(NULL);
  dispatch_device *dev = open_remote();
  float v[4] = {1, 2, 3, 4}, back[4];
  int64_t shape[1] = {4};
  dispatch_tensor *t = NULL, *u = NULL;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, v,
                                         sizeof v, &t), 0);
  cr_assert_eq(dispatch_tensor_read(t, back, sizeof back), 0);
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);
  cr_assert_eq(sp_wait(&g_srv), 0, "exit status with an idle session");
  g_srv.pid = 0;

  int rc = dispatch_add(t, t, &u); /* queued, no wait */
  if (rc == 0) rc = dispatch_tensor_read(u, back, sizeof back);
  cr_assert_eq(rc, DISPATCH_ESHUTDOWN, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "shutting down"), "%s",
            dispatch_device_errmsg(dev));
  rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_ESHUTDOWN, "later call: %s",
               dispatch_err_name(rc));
  cr_assert_str_eq(dispatch_err_name(DISPATCH_ESHUTDOWN),
                   "DISPATCH_ESHUTDOWN");
  dispatch_tensor_free(u);
  dispatch_tensor_free(t);
  dispatch_device_close(dev);
}

/* A library session whose server is killed without a drain still sees a
 * lost connection: the two stay apart. */
Test(drain, killed_server_is_econn, .fini = stop, .timeout = 120) {
  start(NULL);
  dispatch_device *dev = open_remote();
  cr_assert_eq(dispatch_device_sync(dev), 0);
  cr_assert_eq(sp_signal(&g_srv, SIGKILL), 0);
  sp_wait(&g_srv);
  g_srv.pid = 0;
  int rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_ECONN, "got %s", dispatch_err_name(rc));
  dispatch_device_close(dev);
}

/* --drain-timeout 0: no waiting; the pipeline is cut off at once and the
 * exit is still 0. */
Test(drain, zero_timeout_no_wait, .fini = stop, .timeout = 240) {
  const char *args[] = {"--drain-timeout", "0", NULL};
  start(args);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "drain"), 0);
  pipe_buf *p = calloc(1, sizeof *p);
  p->next_id = 1;
  dsp_wreq w;
  put(p, dsp_wreq_sync(&w));
  put_long_work(p, 2048, 200);
  send_after_sync(&c, p);
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);
  char msg[256];
  expect_goodbye(&c, msg, sizeof msg);
  cr_assert(strstr(msg, "cut off"), "%s", msg);
  wire_close(&c);
  cr_assert_eq(sp_wait(&g_srv), 0);
  g_srv.pid = 0;
  free(p);
}

/* ---------------------------------------------------------------- */

static char g_log[64];

/* Starts the server with its stderr in a temporary file (g_log), so a
 * test can wait for what it logs. */
static void start_logged(const char *const *args) {
  snprintf(g_log, sizeof g_log, "/tmp/dsp-drain-XXXXXX");
  int fd = mkstemp(g_log);
  cr_assert_geq(fd, 0);
  int saved = dup(2);
  dup2(fd, 2);
  start(args);
  dup2(saved, 2);
  close(saved);
  close(fd);
}

static void stop_logged(void) {
  stop();
  if (*g_log) unlink(g_log);
}

/* Waits (bounded) until the server's log contains needle. */
static int wait_log(const char *needle) {
  for (int i = 0; i < 1200; i++) {
    FILE *f = fopen(g_log, "rb");
    if (f) {
      static char buf[1 << 20];
      size_t n = fread(buf, 1, sizeof buf - 1, f);
      fclose(f);
      buf[n] = '\0';
      if (strstr(buf, needle)) return 1;
    }
    usleep(50000);
  }
  return 0;
}

typedef struct reader {
  dispatch_tensor *t;
  float v;
  int rc;
} reader;

static void *reader_main(void *p) {
  reader *r = p;
  r->rc = dispatch_tensor_read(r->t, &r->v, sizeof r->v);
  return NULL;
}

/* Through the library: ops queued behind a Read that the server has read
 * (its debug log names the read) when SIGTERM comes are run, the Read is
 * answered with the right value, and the next call gives ESHUTDOWN. */
Test(drain, library_queued_work_answered_then_eshutdown, .fini = stop_logged,
     .timeout = 240) {
  const char *args[] = {"--log-level", "debug", "--drain-timeout", "120",
                        NULL};
  start_logged(args);
  dispatch_device *dev = open_remote();
  int64_t shape[2] = {1024, 1024};
  dispatch_tensor *a = NULL, *cur = NULL, *s = NULL;
  cr_assert_eq(dispatch_scope_begin(dev), 0);
  cr_assert_eq(dispatch_full(dev, DISPATCH_F32, 2, shape, 1.0 / 1024, &a), 0);
  cur = a;
  for (int i = 0; i < 8; i++) {
    dispatch_tensor *next;
    cr_assert_eq(dispatch_matmul(cur, a, &next), 0);
    cur = next;
  }
  cr_assert_eq(dispatch_sum(cur, 0, NULL, 0, &s), 0);
  reader r = {.t = s};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, reader_main, &r), 0);
  cr_assert(wait_log(": read "), "the server never read the Read");
  cr_assert_eq(sp_signal(&g_srv, SIGTERM), 0);
  pthread_join(th, NULL);
  cr_assert_eq(r.rc, 0, "the queued Read: %s: %s", dispatch_err_name(r.rc),
               dispatch_device_errmsg(dev));
  cr_assert_eq(r.v, 1024.0f, "sum %g", (double)r.v);
  int rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_ESHUTDOWN, "after the drain: %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(dev));
  cr_assert_eq(sp_wait(&g_srv), 0, "exit status");
  g_srv.pid = 0;
  dispatch_scope_end(dev);
  dispatch_device_close(dev);
}
