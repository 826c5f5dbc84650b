/* Protocol 1.3 Ops requests (issue 11): many small ops as packed records
 * in one message. Raw-protocol checks that a record runs exactly as the Op
 * it stands for (same results, same deferred errors, its output id as the
 * failed request), that a malformed record is a protocol error that closes
 * only its connection, and that records past --inline-cost go on to a
 * worker; and a client-level check that the library batches a pipeline
 * and still reports a server-side failure inside a batch on the right
 * tensor. */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dispatch.pb-c.h"
#include "dsp.h"
#include "frame.h"
#include "helpers/fake_peer.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"
#include "op_record.h"

static sp_server g_srv;

static void start_with(const char *const *args) {
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void start(void) {
  const char *args[] = {"--log-level", "error", "--threads", "2", NULL};
  start_with(args);
}
/* an add of 16 floats costs 32: it runs inline, one of 1000 does not */
static void start_cost_100(void) {
  const char *args[] = {"--log-level", "error", "--inline-cost", "100",
                        NULL};
  start_with(args);
}
/* room for about four tensors of 64 KiB and the session's other needs */
static void start_small_quota(void) {
  const char *args[] = {"--log-level", "error", "--max-session-bytes",
                        "400000", NULL};
  start_with(args);
}
static void stop_checked(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

TestSuite(op_records, .init = start, .fini = stop_checked);

static const float k_one[16] = {1, 1, 1, 1, 1, 1, 1, 1,
                                1, 1, 1, 1, 1, 1, 1, 1};

/* Appends a two-input record to buf at *len. */
static void rec2(uint8_t *buf, size_t *len, int op, uint64_t a, uint64_t b,
                 uint64_t out) {
  uint64_t in[2] = {a, b};
  *len += dsp_oprec_put(buf + *len, op, 0, in, 2, out, NULL, 0, NULL, 0);
}

static void open_session(wire_conn *c, const char *name) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, name), 0);
  int64_t s16[1] = {16};
  cr_assert_neq(wire_upload(c, 1, DSP_F32, 1, s16, k_one, sizeof k_one), 0);
}

/* The same chain of adds and muls as Op messages on one session and as
 * one Ops message on another: every intermediate is bit-identical, and
 * Stats counts every record as an op. */
Test(op_records, records_run_as_the_ops_they_stand_for) {
  enum { N = 600 };
  wire_conn a, b;
  open_session(&a, "ops");
  open_session(&b, "records");
  static uint8_t buf[N * 40];
  size_t len = 0;
  for (uint64_t i = 0; i < N; i++) {
    int op = i % 3 == 2 ? DSP_OP_MUL : DSP_OP_ADD; /* x_{i+1} = x_i op 1 */
    uint64_t in[2] = {i + 1, 1};
    cr_assert_neq(wire_op(&a, op, in, 2, i + 2, NULL, 0, NULL, 0), 0);
    rec2(buf, &len, op, i + 1, 1, i + 2);
  }
  cr_assert_neq(wire_ops(&b, buf, len), 0);
  for (uint64_t id = 2; id <= N + 1; id += 97) {
    void *x, *y;
    size_t nx, ny;
    cr_assert_eq(wire_read_tensor(&a, id, &x, &nx, NULL, NULL), 0);
    cr_assert_eq(wire_read_tensor(&b, id, &y, &ny, NULL, NULL), 0);
    cr_assert_eq(nx, ny);
    cr_assert_eq(memcmp(x, y, nx), 0, "tensor %llu differs",
                 (unsigned long long)id);
    free(x);
    free(y);
  }
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&b, &st), 0);
  cr_assert_eq(st.ops, N, "%llu ops counted for %d records",
               (unsigned long long)st.ops, N);
  wire_close(&a);
  wire_close(&b);
}

/* A failing record fails alone, as an Op would: its output is poisoned,
 * what depends on it is poisoned, the rest run, and the next wait reports
 * the first failure with that record's output id as the failed request
 * and its op in the message. */
Test(op_records, failing_record_poisons_its_output_and_is_deferred) {
  wire_conn c;
  open_session(&c, "fail");
  uint8_t buf[256];
  size_t len = 0;
  rec2(buf, &len, DSP_OP_ADD, 1, 1, 2);   /* ok: 2 */
  rec2(buf, &len, DSP_OP_ADD, 1, 99, 3);  /* no input 99 */
  rec2(buf, &len, DSP_OP_ADD, 3, 1, 4);   /* poisoned by 3 */
  rec2(buf, &len, DSP_OP_ADD, 2, 1, 5);   /* ok: 3 */
  cr_assert_neq(wire_ops(&c, buf, len), 0);
  char msg[700];
  uint64_t failed = 0;
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, &failed), DISPATCH_ENOID,
               "%s", msg);
  cr_assert_eq(failed, 3, "failed request %llu, expected 3 (its output id)",
               (unsigned long long)failed);
  cr_assert(strstr(msg, "op add [1, 99] -> 3"), "%s", msg);
  cr_assert(strstr(msg, "input 1 id 99 does not exist"), "%s", msg);
  void *x;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 5, &x, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)x)[7], 3.0f);
  free(x);
  cr_assert_eq(wire_read_tensor(&c, 4, &x, &n, NULL, NULL),
               DISPATCH_EPOISONED);
  wire_close(&c);
}

/* One malformed Ops message: the server answers a protocol error and
 * closes that connection, and serves the next one. */
static void expect_refused(const uint8_t *buf, size_t len, const char *what) {
  wire_conn c;
  open_session(&c, "bad");
  /* the refusal comes at once; a server that takes the message answers
   * nothing, and this is how long that takes to show (not minutes) */
  c.wait_ms = 20000;
  cr_assert_neq(wire_ops(&c, buf, len), 0);
  Dspwire__Reply *r = NULL;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0, "%s: no reply", what);
  cr_assert_not_null(r->error, "%s: not refused", what);
  cr_assert_eq(r->error->code, DISPATCH_EPROTO, "%s: code %d (%s)", what,
               r->error->code, r->error->message);
  cr_assert(strstr(r->error->message, "ops"), "%s: %s", what,
            r->error->message);
  wire_reply_free(r, NULL);
  cr_assert(wire_wait_closed(&c), "%s: connection left open", what);
  wire_close(&c);
}

Test(op_records, malformed_records_are_protocol_errors) {
  uint8_t buf[64];
  size_t len = 0;
  rec2(buf, &len, DSP_OP_ADD, 1, 1, 2);
  expect_refused(buf, len - 3, "cut record");
  expect_refused(buf, 0, "no records");
  uint8_t b2[64];
  memcpy(b2, buf, len);
  b2[1] = 2; /* unknown flag */
  expect_refused(b2, len, "unknown flag");
  memcpy(b2, buf, len);
  b2[6] = 1; /* padding */
  expect_refused(b2, len, "padding");
  memcpy(b2, buf, len);
  b2[0] = 0; /* no op 0 */
  expect_refused(b2, len, "unknown op code");
  memcpy(b2, buf, len);
  b2[2] = DSP_MAX_INPUTS + 1; /* more inputs than any op takes */
  expect_refused(b2, len, "input count");
  size_t big_len = (DSP_OPREC_MAX + 1) * len;
  uint8_t *big = malloc(big_len);
  cr_assert_not_null(big);
  for (int i = 0; i <= DSP_OPREC_MAX; i++) memcpy(big + i * len, buf, len);
  expect_refused(big, big_len, "too many records");
  free(big);
  /* the server still serves */
  wire_conn c;
  open_session(&c, "after");
  cr_assert_eq(wire_ops(&c, buf, len) != 0, 1);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
}

/* The record limit is inclusive: DSP_OPREC_MAX records are one job, one
 * more is a protocol error (malformed_records_are_protocol_errors). */
Test(op_records, exactly_the_record_limit_is_accepted) {
  wire_conn c;
  open_session(&c, "limit");
  enum { REC = DSP_OPREC_FIXED + 8 };
  static uint8_t buf[DSP_OPREC_MAX * REC];
  size_t len = 0;
  for (uint64_t i = 0; i < DSP_OPREC_MAX; i++) {
    uint64_t in[1] = {1};
    len += dsp_oprec_put(buf + len, DSP_OP_RELU, 0, in, 1, 2 + i, NULL, 0,
                         NULL, 0);
  }
  cr_assert_eq(len, sizeof buf);
  cr_assert_neq(wire_ops(&c, buf, len), 0);
  char msg[512];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0,
               "%d records refused: %s", DSP_OPREC_MAX, msg);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, DSP_OPREC_MAX, "%llu ops ran",
               (unsigned long long)st.ops);
  wire_close(&c);
}

/* Sends a Backward and returns its reply's error code (0: it ran). */
static int backward_code(wire_conn *c, uint64_t loss, uint64_t grads) {
  uint64_t id = wire_backward(c, loss, grads, 0);
  cr_assert_neq(id, 0);
  Dspwire__Reply *r = NULL;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0, "no backward reply");
  cr_assert_eq(r->req_id, id);
  int code = r->error ? r->error->code : 0;
  wire_reply_free(r, NULL);
  return code;
}

/* A record's no_grad flag is the Op's: the op on a tracked input records
 * no graph with it set, and does without it. */
Test(op_records, no_grad_flag_keeps_the_graph_out) {
  wire_conn c;
  open_session(&c, "nograd");
  cr_assert_neq(wire_track(&c, 1), 0);
  uint8_t buf[64];
  size_t len = 0;
  uint64_t in[1] = {1};
  len += dsp_oprec_put(buf + len, DSP_OP_SUM, 1, in, 1, 2, NULL, 0, NULL, 0);
  len += dsp_oprec_put(buf + len, DSP_OP_SUM, 0, in, 1, 3, NULL, 0, NULL, 0);
  cr_assert_neq(wire_ops(&c, buf, len), 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  cr_assert_eq(backward_code(&c, 3, 10), 0, "sum without no_grad untracked");
  cr_assert_eq(backward_code(&c, 2, 11), DISPATCH_ENOTTRACKED,
               "sum with no_grad recorded a graph");
  wire_close(&c);
}

/* Records the loop may not run (over --inline-cost) go, with the rest of
 * their message, to a worker, where later records still see what the
 * inline ones made. */
Test(op_records, records_past_the_inline_cost_go_to_a_worker,
     .init = start_cost_100) {
  wire_conn c;
  open_session(&c, "mixed");
  int64_t s1000[1] = {1000};
  static float big[1000];
  for (int i = 0; i < 1000; i++) big[i] = (float)i;
  cr_assert_neq(wire_upload(&c, 10, DSP_F32, 1, s1000, big, sizeof big), 0);
  /* that upload is over the cost too: let it finish, so the session is
   * idle when the records arrive */
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  uint8_t buf[512];
  size_t len = 0;
  rec2(buf, &len, DSP_OP_ADD, 1, 1, 2);    /* inline: 2 */
  rec2(buf, &len, DSP_OP_ADD, 2, 1, 3);    /* inline: 3 */
  rec2(buf, &len, DSP_OP_ADD, 10, 10, 11); /* cost 2000: a worker's */
  rec2(buf, &len, DSP_OP_ADD, 3, 1, 4);    /* on the worker too: 4 */
  cr_assert_neq(wire_ops(&c, buf, len), 0);
  void *x;
  size_t n;
  cr_assert_eq(wire_read_tensor(&c, 4, &x, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)x)[0], 4.0f);
  free(x);
  cr_assert_eq(wire_read_tensor(&c, 11, &x, &n, NULL, NULL), 0);
  cr_assert_eq(((float *)x)[999], 1998.0f);
  free(x);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.ops, 4);
  cr_assert_eq(st.inline_ops, 2, "%llu of 4 records ran inline, expected 2",
               (unsigned long long)st.inline_ops);
  cr_assert_gt(st.batches, 0, "no worker turn");
  wire_close(&c);
}

/* ------------------------------------------------------------ client */

static dispatch_device *open_remote(void) {
  char spec[64], err[256];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, err, sizeof err);
  cr_assert_eq(rc, 0, "open %s: %s", spec, err);
  return dev;
}

/* The library sends a pipeline of small ops as Ops messages: a chain of
 * 1000 adds then a read runs wholly inline (as Op messages, a pipeline
 * that long goes to the workers), and gives the right sum. */
Test(op_records, client_sends_a_pipeline_as_records) {
  dispatch_device *dev = open_remote();
  int64_t shape[1] = {16};
  dispatch_tensor *one, *cur;
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 1, shape, &one), 0);
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 1, shape, &cur), 0);
  for (int i = 0; i < 1000; i++) {
    dispatch_tensor *nx;
    cr_assert_eq(dispatch_add(cur, one, &nx), 0);
    dispatch_tensor_free(cur);
    cur = nx;
  }
  float out[16];
  cr_assert_eq(dispatch_tensor_read(cur, out, sizeof out), 0);
  cr_assert_eq(out[3], 1001.0f);
  dispatch_stats st = DISPATCH_STATS_INIT;
  cr_assert_eq(dispatch_device_stats(dev, &st), 0);
  cr_assert_eq(st.ops, 1002);
  cr_assert_eq(st.inline_ops, st.ops,
               "%llu of %llu ops inline: the pipeline was not sent as records",
               (unsigned long long)st.inline_ops, (unsigned long long)st.ops);
  dispatch_tensor_free(cur);
  dispatch_tensor_free(one);
  dispatch_device_close(dev);
}

/* A record that fails on the server (over the session's quota) inside a
 * batch: the wait after it reports DISPATCH_EQUOTA, the tensor it was
 * making is the one marked failed, and the tensors made before it hold
 * their values. */
Test(op_records, client_marks_the_tensor_whose_record_failed,
     .init = start_small_quota) {
  dispatch_device *dev = open_remote();
  int64_t shape[1] = {16384}; /* 64 KiB */
  dispatch_tensor *x, *t[8] = {0};
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 1, shape, &x), 0);
  int queued = 0;
  for (int i = 0; i < 8; i++, queued++)
    if (dispatch_add_scalar(x, (double)i, &t[i]) < 0) break;
  static float w[16384];
  int rc = dispatch_tensor_read(t[0], w, sizeof w);
  cr_assert_eq(rc, DISPATCH_EQUOTA, "read gave %d (%s)", rc,
               dispatch_device_errmsg(dev));
  int first_bad = -1;
  for (int i = 0; i < queued && first_bad < 0; i++) {
    if (dispatch_tensor_read(t[i], w, sizeof w) < 0) {
      first_bad = i;
    } else {
      cr_assert_eq(w[100], 1.0f + (float)i, "tensor %d", i);
    }
  }
  cr_assert_gt(first_bad, 0, "no tensor fit, or none failed (%d)", first_bad);
  cr_assert_eq(dispatch_tensor_read(t[first_bad], w, sizeof w),
               DISPATCH_EQUOTA, "%s", dispatch_device_errmsg(dev));
  for (int i = 0; i < 8; i++) dispatch_tensor_free(t[i]);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

/* ------------------------------------------------- client, on the wire */

/* A scripted 1.3 server (a thread here): it answers the hello as 1.3 with
 * room for a full batch, logs each request's kind and (for an Ops) its
 * record count, and answers a Sync; nothing else is answered. */
#define FK_LOG 64
typedef struct fk {
  int lfd, cfd, port;
  pthread_t th;
  pthread_mutex_t mu;
  int n;
  int kind[FK_LOG];
  int recs[FK_LOG];
} fk;

static int count_records(const ProtobufCBinaryData *b) {
  const uint8_t *p = b->data, *end = b->data + b->len;
  int n = 0;
  char why[128];
  while (p < end) {
    dsp_oprec r;
    if (dsp_oprec_next(&p, end, &r, why, sizeof why) < 0) return -1;
    n++;
  }
  return n;
}

static void *fk_main(void *arg) {
  fk *f = arg;
  f->cfd = accept(f->lfd, NULL, NULL);
  if (f->cfd < 0) return NULL;
  for (;;) {
    Dspwire__Request *q;
    void *bulk;
    size_t bulk_len;
    if (fake_recv_request(f->cfd, &q, &bulk, &bulk_len) < 0) break;
    free(bulk);
    pthread_mutex_lock(&f->mu);
    if (f->n < FK_LOG) {
      f->kind[f->n] = q->body_case;
      f->recs[f->n] = q->body_case == DSPWIRE__REQUEST__BODY_OPS
                          ? count_records(&q->ops->records)
                          : 0;
      f->n++;
    }
    pthread_mutex_unlock(&f->mu);
    Dspwire__Reply r = DSPWIRE__REPLY__INIT;
    r.req_id = q->req_id;
    Dspwire__HelloReply hr = DSPWIRE__HELLO_REPLY__INIT;
    if (q->body_case == DSPWIRE__REQUEST__BODY_HELLO) {
      hr.major = DSP_PROTO_MAJOR;
      hr.minor = 3;
      hr.max_frame = 1 << 24;
      r.body_case = DSPWIRE__REPLY__BODY_HELLO;
      r.hello = &hr;
      fake_send_reply(f->cfd, &r, NULL, 0);
    } else if (q->body_case == DSPWIRE__REQUEST__BODY_SYNC) {
      fake_send_reply(f->cfd, &r, NULL, 0);
    }
    dspwire__request__free_unpacked(q, NULL);
  }
  return NULL;
}

static fk *fk_start(void) {
  fk *f = calloc(1, sizeof *f);
  f->cfd = -1;
  pthread_mutex_init(&f->mu, NULL);
  f->lfd = fake_listen(&f->port);
  cr_assert_geq(f->lfd, 0, "cannot listen on 127.0.0.1");
  cr_assert_eq(pthread_create(&f->th, NULL, fk_main, f), 0);
  return f;
}

static void fk_stop(fk *f) { /* after the client closed: the thread sees EOF */
  pthread_join(f->th, NULL);
  if (f->cfd >= 0) close(f->cfd);
  close(f->lfd);
  free(f);
}

/* Waits up to 5 s for at least n requests; returns how many came. */
static int fk_wait(fk *f, int n) {
  for (int i = 0; i < 500; i++) {
    pthread_mutex_lock(&f->mu);
    int have = f->n;
    pthread_mutex_unlock(&f->mu);
    if (have >= n) return have;
    poll(NULL, 0, 10);
  }
  pthread_mutex_lock(&f->mu);
  int have = f->n;
  pthread_mutex_unlock(&f->mu);
  return have;
}

static void no_server(void) {}

/* Records of Ops requests the fake has seen, and whether all of them came
 * before request index `before`. */
static int fk_records(fk *f, int before, int *ops_frames, int *max_recs) {
  int total = 0;
  *ops_frames = *max_recs = 0;
  pthread_mutex_lock(&f->mu);
  for (int i = 0; i < f->n; i++) {
    if (f->kind[i] != DSPWIRE__REQUEST__BODY_OPS) continue;
    cr_assert_lt(i, before, "an Ops (request %d) after request %d", i,
                 before);
    cr_assert_geq(f->recs[i], 1, "Ops %d: malformed or empty", i);
    total += f->recs[i];
    (*ops_frames)++;
    if (f->recs[i] > *max_recs) *max_recs = f->recs[i];
  }
  pthread_mutex_unlock(&f->mu);
  return total;
}

/* A long run of small ops reaches the server in full batches while it is
 * still being queued, before any wait (whatever the batch sizes, at most
 * DISPATCH__OPS_MAX = 256 records each); what is left of the open batch
 * goes out, in order, ahead of the next other request. */
Test(op_records, client_sends_full_batches_before_any_wait, .init = no_server,
     .fini = no_server) {
  fk *f = fk_start();
  char spec[64], err[256];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", f->port);
  dispatch_device *dev = NULL;
  cr_assert_eq(dispatch_device_open(spec, NULL, &dev, err, sizeof err), 0,
               "%s", err);
  int64_t shape[1] = {16};
  static dispatch_tensor *t[300];
  int nt = 0;
  cr_assert_eq(dispatch_ones(dev, DISPATCH_F32, 1, shape, &t[nt++]), 0);
  for (; nt < 256; nt++) /* 1 + 255 ops */
    cr_assert_eq(dispatch_add(t[0], t[nt - 1], &t[nt]), 0);
  int n = fk_wait(f, 2);
  int frames, max_recs;
  int sent = fk_records(f, 1000, &frames, &max_recs);
  cr_assert_geq(n, 2, "nothing but the hello before any wait: 256 queued "
                "ops not sent in batches");
  cr_assert_gt(sent, 0);
  cr_assert_leq(max_recs, 256, "an Ops of %d records", max_recs);
  for (int i = 0; i < 3; i++, nt++)
    cr_assert_eq(dispatch_add(t[0], t[nt - 1], &t[nt]), 0);
  float v[16] = {0};
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, shape, v,
                                         sizeof v, &t[nt++]),
               0);
  cr_assert_eq(dispatch_device_sync(dev), 0, "%s",
               dispatch_device_errmsg(dev));
  pthread_mutex_lock(&f->mu);
  n = f->n;
  cr_assert_geq(n, 4, "%d requests", n);
  cr_assert_eq(f->kind[n - 2], DSPWIRE__REQUEST__BODY_UPLOAD);
  cr_assert_eq(f->kind[n - 1], DSPWIRE__REQUEST__BODY_SYNC);
  pthread_mutex_unlock(&f->mu);
  /* every record sent, all of them ahead of the upload */
  cr_assert_eq(fk_records(f, n - 2, &frames, &max_recs), 259,
               "records sent in %d Ops", frames);
  for (int i = 0; i < nt; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
  fk_stop(f);
}
