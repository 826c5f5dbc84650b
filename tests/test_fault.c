/* Session resume and the fault suite: a real dispatch-server on 127.0.0.1,
 * clients talking to it through the fault-injection proxy
 * (tests/helpers/fault_proxy.h) that cuts and resets connections in the
 * middle of uploads, after a Backward was sent and inside Read replies.
 *
 * - a training loop cut 10 times ends bit-identical to an undisturbed run;
 * - a server SIGKILLed after a checkpoint: the checkpoint loaded into a
 *   new server and trained on ends bit-identical to the uninterrupted run;
 * - a client SIGKILLed mid-upload: the server's held bytes and RSS go back
 *   to their baseline after --session-grace;
 * - a resume token with other credentials (hello token, or over mutual
 *   TLS another client certificate of the same CA), or of an expired
 *   session, is refused with its code; an in-place optimizer step sent again after a
 *   cut mid-reply is applied once. */
#include <criterion/criterion.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "frame.h"
#include "helpers/client_check.h"
#include "helpers/fault_proxy.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static fault_proxy *g_fp;
static char g_dir[256];

static void teardown(void) {
  fp_stop(g_fp);
  g_fp = NULL;
  if (g_srv.pid) sp_stop(&g_srv);
  if (g_dir[0]) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_assert_eq(system(cmd), 0);
    g_dir[0] = '\0';
  }
}

/* Stops the server and checks it exited cleanly: a sanitizer's report at
 * shutdown (a use after free in the teardown) fails the test. Asserts in
 * .fini do not fail a Criterion test, so tests call this themselves. */
static void stop_server_clean(void) {
  int st = sp_stop(&g_srv);
  cr_assert_eq(st, 0, "dispatch-server exited with status %d", st);
}

/* Starts the server with --session-grace grace and, when queue is set,
 * --max-queued-bytes queue. */
static void start_server_q(const char *grace, const char *queue) {
  /* no storage cache: freed tensor pages go back, so RSS can be judged */
  const char *args[] = {"--log-level", "warn", "--session-grace", grace,
                        "--storage-cache", "0",
                        queue ? "--max-queued-bytes" : NULL, queue, NULL};
  check_server_start(&g_srv, args);
}

static void start_server(const char *grace) { start_server_q(grace, NULL); }

static dispatch_device *open_port(int port) {
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.timeout_ms = 20000;
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* Server-wide stats through a raw connection of its own (closed with a
 * bye, so it is not kept for a resume). */
static Dspwire__StatsReply server_stats(void) {
  Dspwire__StatsReply st;
  cr_assert_eq(wire_server_stats(g_srv.port, &st), 0, "no server stats");
  return st;
}

/* ------------------------------------------------------------ training */

#define N_P 4
#define BATCH 64
#define FEAT 32
#define HID 64
#define CLS 10

typedef struct trainer {
  dispatch_device *dev;
  dispatch_tensor *p[N_P];
  dispatch_optim *opt;
} trainer;

/* Deterministic synthetic data: batch s of a fixed pseudo-random stream. */
static void batch_data(int s, float *x, int64_t *y) {
  uint32_t st = 12345u + (uint32_t)s * 7919u;
  for (int i = 0; i < BATCH * FEAT; i++) {
    st = st * 1664525u + 1013904223u;
    x[i] = (float)((st >> 8) & 0xffff) / 65536.0f - 0.5f;
  }
  for (int i = 0; i < BATCH; i++) {
    st = st * 1664525u + 1013904223u;
    y[i] = (int64_t)((st >> 16) % CLS);
  }
}

static void trainer_init(trainer *t, dispatch_device *dev) {
  t->dev = dev;
  int64_t s[N_P][2] = {{FEAT, HID}, {HID, 0}, {HID, CLS}, {CLS, 0}};
  int nd[N_P] = {2, 1, 2, 1};
  for (int i = 0; i < N_P; i++) {
    dispatch_tensor *w;
    OK(dev, dispatch_normal(dev, DISPATCH_F32, nd[i], s[i], 0, 0.2, 300 + i,
                            &w));
    OK(dev, dispatch_autodiff(w, &t->p[i]));
    dispatch_tensor_free(w);
  }
  OK(dev, dispatch_adam_new(t->p, N_P, 0.01, 0.9, 0.999, 1e-8, &t->opt));
}

/* One step: upload the batch, MLP forward, cross entropy, backward, Adam
 * update, and a read of the first layer (the round trips a cut may hit). */
static void train_step(trainer *t, int s) {
  dispatch_device *dev = t->dev;
  float x[BATCH * FEAT];
  int64_t y[BATCH];
  batch_data(s, x, y);
  OK(dev, dispatch_scope_begin(dev));
  int64_t xs[2] = {BATCH, FEAT}, ys[1] = {BATCH};
  dispatch_tensor *xt, *yt, *h, *hb, *ha, *o, *ob, *loss;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, xs, x, sizeof x,
                                    &xt));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, ys, y, sizeof y,
                                    &yt));
  OK(dev, dispatch_matmul(xt, t->p[0], &h));
  OK(dev, dispatch_add(h, t->p[1], &hb));
  OK(dev, dispatch_relu(hb, &ha));
  OK(dev, dispatch_matmul(ha, t->p[2], &o));
  OK(dev, dispatch_add(o, t->p[3], &ob));
  OK(dev, dispatch_cross_entropy(ob, yt, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(t->opt, g));
  dispatch_grads_free(g);
  static float w1[FEAT * HID];
  OK(dev, dispatch_tensor_read(t->p[0], w1, sizeof w1));
  OK(dev, dispatch_scope_end(dev));
}

static void *read_param(trainer *t, int i, size_t *n) {
  *n = dispatch_tensor_nbytes(t->p[i]);
  void *b = malloc(*n);
  OK(t->dev, dispatch_tensor_read(t->p[i], b, *n));
  return b;
}

static void trainer_free(trainer *t) {
  dispatch_optim_free(t->opt);
  for (int i = 0; i < N_P; i++) dispatch_tensor_free(t->p[i]);
  dispatch_device_close(t->dev);
  memset(t, 0, sizeof *t);
}

static void train(int port, int steps, void *out[N_P], size_t n[N_P]) {
  trainer t;
  trainer_init(&t, open_port(port));
  for (int s = 0; s < steps; s++) train_step(&t, s);
  for (int i = 0; i < N_P; i++) out[i] = read_param(&t, i, &n[i]);
  trainer_free(&t);
}

#define REQ(b) DSPWIRE__REQUEST__BODY_##b
#define REP(b) DSPWIRE__REPLY__BODY_##b

Test(fault, training_survives_ten_disconnects, .fini = teardown,
     .timeout = 600) {
  start_server("30");
  const int steps = 40;
  void *want[N_P], *got[N_P];
  size_t wn[N_P], gn[N_P];
  train(g_srv.port, steps, want, wn);

  /* connection k (the first, then each resume) gets fault k */
  const fp_rule rules[] = {
      /* mid-upload: half of a batch's bytes reached the server */
      {.conn = 0, .dir = FP_C2S, .at_byte = -1, .body = REQ(UPLOAD), .nth = 3,
       .pct = 50, .action = FP_CUT},
      /* mid-backward: the Backward arrived (since 1.3 it has no reply),
       * then the connection is gone */
      {.conn = 1, .dir = FP_C2S, .at_byte = -1, .body = REQ(BACKWARD),
       .nth = 2, .pct = 100, .action = FP_CUT},
      /* mid-read: inside the tensor bytes of a Read reply */
      {.conn = 2, .dir = FP_S2C, .at_byte = -1, .body = REP(READ), .nth = 2,
       .pct = 50, .action = FP_CUT},
      {.conn = 3, .dir = FP_C2S, .at_byte = -1, .body = REQ(UPLOAD), .nth = 4,
       .pct = 30, .action = FP_RESET},
      {.conn = 4, .dir = FP_C2S, .at_byte = -1, .body = REQ(BACKWARD),
       .nth = 1, .pct = 100, .action = FP_RESET},
      {.conn = 5, .dir = FP_S2C, .at_byte = -1, .body = REP(READ), .nth = 1,
       .pct = 10, .action = FP_RESET},
      /* an upload whose header and message arrived, none of its bytes */
      {.conn = 6, .dir = FP_C2S, .at_byte = -1, .body = REQ(UPLOAD), .nth = 2,
       .pct = 0, .action = FP_CUT},
      /* the in-place optimizer step sent, then the connection gone */
      {.conn = 7, .dir = FP_C2S, .at_byte = -1, .body = REQ(STEP), .nth = 2,
       .pct = 100, .action = FP_CUT},
      /* a Read reply's header and message on their way, none of its
       * bytes (a Backward has no reply to cut since protocol 1.3) */
      {.conn = 8, .dir = FP_S2C, .at_byte = -1, .body = REP(READ), .nth = 2,
       .pct = 0, .action = FP_CUT},
      {.conn = 9, .dir = FP_S2C, .at_byte = -1, .body = REP(READ), .nth = 3,
       .pct = 90, .action = FP_RESET},
      /* the last connection is slowed, not cut */
      {.conn = 10, .dir = FP_S2C, .at_byte = -1, .body = REP(READ), .nth = 1,
       .pct = 50, .action = FP_DELAY, .arg = 30},
      {.conn = 10, .dir = FP_C2S, .at_byte = 0, .action = FP_THROTTLE,
       .arg = 4 << 20},
  };
  const int n_rules = (int)(sizeof rules / sizeof *rules);
  g_fp = fp_start(g_srv.port, rules, n_rules);
  cr_assert_not_null(g_fp);
  train(fp_port(g_fp), steps, got, gn);

  char where[200];
  for (int i = 0; i < fp_fired(g_fp); i++) {
    fp_where(g_fp, i, where, sizeof where);
    cr_log_info("fault %d: %s", i, where);
  }
  cr_assert_eq(fp_fired(g_fp), n_rules, "only %d of %d faults fired",
               fp_fired(g_fp), n_rules);
  cr_assert_eq(fp_conns(g_fp), 11, "%d connections", fp_conns(g_fp));
  Dspwire__StatsReply st = server_stats();
  cr_assert_eq(st.sessions_resumed, 10);
  cr_assert_eq(st.sessions_detached, 0);
  for (int i = 0; i < N_P; i++) {
    cr_assert_eq(gn[i], wn[i]);
    cr_assert_eq(memcmp(got[i], want[i], wn[i]), 0,
                 "parameter %d differs from the undisturbed run", i);
    free(got[i]);
    free(want[i]);
  }
}

/* ------------------------------------------------------------ checkpoint */

static const char *const k_names[N_P] = {"w1", "b1", "w2", "b2"};

Test(fault, server_killed_after_checkpoint_loses_nothing, .fini = teardown,
     .timeout = 600) {
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp_fault_XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
  char path[300];
  snprintf(path, sizeof path, "%s/ckpt.safetensors", g_dir);
  start_server("5");
  const int k = 4, more = 5;
  trainer a;
  trainer_init(&a, open_port(g_srv.port));
  for (int s = 0; s < k; s++) train_step(&a, s);
  OK(a.dev, dispatch_save(a.dev, path, k_names, a.p, N_P, a.opt));
  for (int s = k; s < k + more; s++) train_step(&a, s);
  void *want[N_P];
  size_t wn[N_P];
  for (int i = 0; i < N_P; i++) want[i] = read_param(&a, i, &wn[i]);
  /* the server dies: the session is gone with it */
  cr_assert_eq(sp_signal(&g_srv, SIGKILL), 0);
  sp_wait(&g_srv);
  g_srv.pid = 0;
  dispatch_device_set_timeout(a.dev, 300);
  float v[CLS];
  cr_assert_eq(dispatch_tensor_read(a.p[3], v, sizeof v), DISPATCH_ECONN,
               "%s", dispatch_device_errmsg(a.dev));
  trainer_free(&a);

  start_server("5");
  trainer b = {.dev = open_port(g_srv.port)};
  dispatch_checkpoint *ck;
  OK(b.dev, dispatch_load(b.dev, path, &ck));
  for (int i = 0; i < N_P; i++)
    OK(b.dev, dispatch_autodiff(dispatch_checkpoint_get(ck, k_names[i]),
                                &b.p[i]));
  OK(b.dev, dispatch_adam_new(b.p, N_P, 0.01, 0.9, 0.999, 1e-8, &b.opt));
  OK(b.dev, dispatch_optim_load(b.opt, ck));
  dispatch_checkpoint_free(ck);
  for (int s = k; s < k + more; s++) train_step(&b, s);
  for (int i = 0; i < N_P; i++) {
    size_t n;
    void *got = read_param(&b, i, &n);
    cr_assert_eq(n, wn[i]);
    cr_assert_eq(memcmp(got, want[i], n), 0,
                 "%s after the restart differs from the uninterrupted run",
                 k_names[i]);
    free(got);
    free(want[i]);
  }
  trainer_free(&b);
}

/* ------------------------------------------------------------ killed client */

static long rss_kb(pid_t pid) {
  char p[64], line[256];
  snprintf(p, sizeof p, "/proc/%d/status", (int)pid);
  FILE *f = fopen(p, "r");
  if (!f) return -1;
  long kb = -1;
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "VmRSS: %ld kB", &kb) == 1) break;
  fclose(f);
  return kb;
}

Test(fault, client_killed_mid_upload_frees_after_grace, .fini = teardown) {
  /* under AddressSanitizer freed blocks wait in a quarantine instead of
   * going back: without it the tensor's pages are unmapped when freed,
   * as in a plain build (the option means nothing there) */
  const char *ao = getenv("ASAN_OPTIONS");
  char opts[512];
  snprintf(opts, sizeof opts, "%s%squarantine_size_mb=0", ao ? ao : "",
           ao && *ao ? ":" : "");
  setenv("ASAN_OPTIONS", opts, 1);
  start_server("1");
  Dspwire__StatsReply base = server_stats();
  long rss0 = rss_kb(g_srv.pid);
  const size_t big = 48u << 20;
  /* the doomed client is a separate program (python3, raw sockets): a
   * copy of this test process would share the test runner's state. It
   * sends the frames written here: a hello that asks for resume, then an
   * upload of 48 MiB of which it sends 24 MiB before saying so. */
  dsp_wreq hw;
  Dspwire__Request *h =
      dsp_wreq_hello(&hw, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, NULL, "doomed");
  hw.body.hello.resume = 1;
  h->req_id = 1;
  uint8_t hello[512], upl[256];
  size_t hl = dsp_req_frame_encode(h, 0, hello);
  dsp_wreq w;
  int64_t shape[1] = {(int64_t)(big / 4)};
  Dspwire__Request *r = dsp_wreq_upload(&w, 1, DSP_F32, 1, shape);
  r->req_id = 2;
  r->seq = 1;
  size_t ul = dsp_req_frame_encode(r, big, upl);
  char hex_h[1100], hex_u[600];
  for (size_t i = 0; i < hl; i++) sprintf(hex_h + 2 * i, "%02x", hello[i]);
  for (size_t i = 0; i < ul; i++) sprintf(hex_u + 2 * i, "%02x", upl[i]);
  char script[4096];
  snprintf(script, sizeof script,
           "import socket,struct,sys,time\n"
           "s=socket.create_connection(('127.0.0.1',%d))\n"
           "s.sendall(bytes.fromhex('%s'))\n"
           "def rd(n):\n"
           "  b=b''\n"
           "  while len(b)<n:\n"
           "    c=s.recv(n-len(b))\n"
           "    if not c: sys.exit(2)\n"
           "    b+=c\n"
           "  return b\n"
           "m,f,bl=struct.unpack('<IIQ',rd(16)); rd(m+bl)\n"
           "s.sendall(bytes.fromhex('%s'))\n"
           "s.sendall(bytes(%zu))\n"
           "sys.stdout.write('x'); sys.stdout.flush()\n"
           "time.sleep(600)\n",
           g_srv.port, hex_h, hex_u, big / 2);
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  pid_t child = fork();
  cr_assert_neq(child, -1);
  if (child == 0) {
    dup2(pfd[1], 1);
    close(pfd[0]);
    close(pfd[1]);
    execl("/usr/bin/python3", "python3", "-c", script, (char *)NULL);
    _exit(127);
  }
  close(pfd[1]);
  char ch;
  cr_assert_eq(read(pfd[0], &ch, 1), 1, "the child did not start its upload");
  close(pfd[0]);
  /* the server holds the upload's tensor while it arrives */
  Dspwire__StatsReply mid = server_stats();
  for (int i = 0; i < 200 && mid.server_held_bytes < base.server_held_bytes +
                                                       big;
       i++) {
    sleep_ms(20);
    mid = server_stats();
  }
  cr_assert_geq(mid.server_held_bytes, base.server_held_bytes + big,
                "held %llu, baseline %llu",
                (unsigned long long)mid.server_held_bytes,
                (unsigned long long)base.server_held_bytes);
  kill(child, SIGKILL);
  int status;
  waitpid(child, &status, 0);
  /* detached, then freed once the grace (1 s) has passed */
  Dspwire__StatsReply after = server_stats();
  for (int i = 0; i < 500 && after.sessions_expired < 1; i++) {
    sleep_ms(20);
    after = server_stats();
  }
  cr_assert_eq(after.sessions_expired, 1);
  cr_assert_eq(after.sessions_detached, 0);
  cr_assert_neq(wire_wait_held_bytes(g_srv.port, base.server_held_bytes,
                                     100, &after),
                -2, "no server stats");
  cr_assert_eq(after.server_held_bytes, base.server_held_bytes,
               "held %llu after the grace, baseline %llu",
               (unsigned long long)after.server_held_bytes,
               (unsigned long long)base.server_held_bytes);
  cr_assert_eq(after.server_tensors, base.server_tensors);
  long rss1 = rss_kb(g_srv.pid);
  cr_assert(rss0 > 0 && rss1 > 0);
  /* the 48 MiB tensor's pages are not kept: RSS within 16 MiB of where
   * it started (the allocator may keep a little) */
  cr_assert_lt(rss1, rss0 + 16 * 1024, "RSS %ld kB, baseline %ld kB", rss1,
               rss0);
}

/* ------------------------------------------------------------ raw resume */

typedef struct raw_sess {
  wire_conn c;
  uint8_t token[64];
  size_t token_len;
  uint64_t last_seq;
  int resumed;
} raw_sess;

/* Sends req with seq and returns its req_id. */
static uint64_t send_seq(wire_conn *c, Dspwire__Request *r, uint64_t seq,
                         const void *bulk, size_t n) {
  r->req_id = ++c->next_req_id;
  r->seq = seq;
  cr_assert_eq(wire_send(c, r, bulk, n), 0);
  return r->req_id;
}

/* Hello (a resume when token is set); the reply's error code, 0 when
 * accepted (s filled), 1 when the connection failed. */
static int raw_hello(raw_sess *s, int port, const char *auth,
                     const uint8_t *token, size_t token_len, uint64_t ack) {
  if (wire_connect(&s->c, port)) return 1;
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, auth, "raw");
  w.body.hello.resume = 1;
  if (token) {
    w.body.hello.resume_token.data = (uint8_t *)token;
    w.body.hello.resume_token.len = token_len;
    w.body.hello.resume_ack = ack;
  }
  send_seq(&s->c, r, 0, NULL, 0);
  Dspwire__Reply *rep;
  if (wire_recv(&s->c, &rep, NULL, NULL)) return 1;
  int code = rep->error ? rep->error->code : 0;
  if (!code && rep->hello) {
    s->token_len = rep->hello->resume_token.len;
    cr_assert_leq(s->token_len, sizeof s->token);
    memcpy(s->token, rep->hello->resume_token.data, s->token_len);
    s->last_seq = rep->hello->last_seq;
    s->resumed = rep->hello->resumed;
  }
  wire_reply_free(rep, NULL);
  return code;
}

/* Drops s's connection and resumes its session on t (resume_ack ack):
 * the resume must succeed and the server must have received every
 * request up to seq last. */
static void drop_and_resume(raw_sess *s, raw_sess *t, uint64_t ack,
                            uint64_t last) {
  wire_close(&s->c);
  cr_assert_eq(raw_hello(t, g_srv.port, NULL, s->token, s->token_len, ack),
               0);
  cr_assert(t->resumed);
  cr_assert_eq(t->last_seq, last, "the server received up to seq %llu",
               (unsigned long long)t->last_seq);
}

/* Receives one reply that must answer rid without an error; the caller
 * frees it (wire_reply_free with *bulk; bulk may be NULL when none). */
static Dspwire__Reply *recv_ok(wire_conn *c, uint64_t rid, void **bulk,
                               size_t *n) {
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(c, &rep, bulk, n), 0, "no reply to request %llu",
               (unsigned long long)rid);
  cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
  cr_assert_eq(rep->req_id, rid);
  return rep;
}

/* Receives one Read reply and checks its four floats. */
static void expect_read(wire_conn *c, uint64_t rid, const float want[4]) {
  Dspwire__Reply *rep;
  void *bulk;
  size_t n;
  cr_assert_eq(wire_recv(c, &rep, &bulk, &n), 0);
  cr_assert_eq(rep->req_id, rid);
  cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
  cr_assert_eq(n, 4 * sizeof(float));
  cr_assert_eq(memcmp(bulk, want, n), 0, "got %g %g %g %g",
               (double)((float *)bulk)[0], (double)((float *)bulk)[1],
               (double)((float *)bulk)[2], (double)((float *)bulk)[3]);
  wire_reply_free(rep, bulk);
}

Test(fault, step_sent_again_after_a_cut_mid_reply_runs_once,
     .fini = teardown, .timeout = 120) {
  start_server("30");
  raw_sess s;
  cr_assert_eq(raw_hello(&s, g_srv.port, NULL, NULL, 0, 0), 0);
  cr_assert_eq(s.token_len, 32, "a 256-bit resume token");
  float p0[4] = {1, 2, 3, 4};
  int64_t sh[1] = {4};
  dsp_wreq w;
  send_seq(&s.c, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), 1, p0, sizeof p0);
  send_seq(&s.c, dsp_wreq_track(&w, 1), 2, NULL, 0);
  uint64_t in1[1] = {1};
  send_seq(&s.c, dsp_wreq_op(&w, DSP_OP_SUM, in1, 1, 2, NULL, 0, NULL, 0, 0),
           3, NULL, 0);
  uint64_t rb = send_seq(&s.c, dsp_wreq_backward(&w, 2, 10, 0), 4, NULL, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(&s.c, &rep, NULL, NULL), 0);
  cr_assert_eq(rep->req_id, rb);
  cr_assert_null(rep->error);
  wire_reply_free(rep, NULL);
  /* p -= 1.0 * grad (all ones), in place */
  uint64_t params[1] = {1}, states[1] = {3};
  float z[4] = {0};
  send_seq(&s.c, dsp_wreq_upload(&w, 3, DSP_F32, 1, sh), 5, z, sizeof z);
  double fl[3] = {1.0, 0.0, 0.0};
  Dspwire__Request *step = dsp_wreq_step(&w, DSP_OP_SGD_STEP, 10, params, 1,
                                         states, 1, NULL, 0, fl, 3);
  send_seq(&s.c, step, 6, NULL, 0);
  uint64_t rr = send_seq(&s.c, dsp_wreq_read(&w, 1), 7, NULL, 0);
  /* the connection drops before the Read's reply is taken */
  raw_sess t;
  drop_and_resume(&s, &t, 4, 7);
  const float once[4] = {0, 1, 2, 3};
  expect_read(&t.c, rr, once); /* the kept reply, sent on resume */
  /* a client that sends the step and the read again: neither runs again,
   * the read gets its original reply */
  t.c.next_req_id = 100;
  step = dsp_wreq_step(&w, DSP_OP_SGD_STEP, 10, params, 1, states, 1, NULL, 0,
                       fl, 3);
  send_seq(&t.c, step, 6, NULL, 0);
  Dspwire__Request *rd = dsp_wreq_read(&w, 1);
  rd->req_id = rr;
  rd->seq = 7;
  cr_assert_eq(wire_send(&t.c, rd, NULL, 0), 0);
  expect_read(&t.c, rr, once);
  uint64_t r8 = send_seq(&t.c, dsp_wreq_read(&w, 1), 8, NULL, 0);
  expect_read(&t.c, r8, once);
  /* the counter: one op (sum) and one step ran */
  Dspwire__Request *sr = dsp_wreq_stats(&w);
  uint64_t rs = send_seq(&t.c, sr, 9, NULL, 0);
  cr_assert_eq(wire_recv(&t.c, &rep, NULL, NULL), 0);
  cr_assert_eq(rep->req_id, rs);
  cr_assert_not_null(rep->stats);
  cr_assert_eq(rep->stats->ops, 2, "ops %llu",
               (unsigned long long)rep->stats->ops);
  cr_assert_eq(rep->stats->sessions_resumed, 1);
  wire_reply_free(rep, NULL);
  wire_bye(&t.c);
  wire_close(&t.c);
}

/* A Read larger than the session's whole queue budget (--max-queued-bytes
 * 1 MiB, a 16 MiB tensor) is still kept for a resume: by reference to its
 * snapshot, not as a copy charged to the queue. The in-place step queued
 * behind it must not change what the kept reply sends, and the next Read
 * sees the step. */
Test(fault, large_read_over_the_queue_budget_is_kept_by_reference,
     .fini = teardown, .timeout = 120) {
  start_server_q("30", "1048576");
  raw_sess s;
  cr_assert_eq(raw_hello(&s, g_srv.port, NULL, NULL, 0, 0), 0);
  enum { N = 4 << 20 };
  int64_t sh[1] = {N};
  float *x = malloc((size_t)N * sizeof *x);
  cr_assert_not_null(x);
  for (int i = 0; i < N; i++) x[i] = (float)(i % 1000);
  dsp_wreq w;
  /* the upload and grads container are whole-tensor uploads of their own */
  send_seq(&s.c, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), 1, x,
           (size_t)N * sizeof *x);
  uint64_t rr = send_seq(&s.c, dsp_wreq_read(&w, 1), 2, NULL, 0);
  /* p += 1 in place after the Read: p - lr * g with lr -1, g = ones */
  send_seq(&s.c, dsp_wreq_track(&w, 1), 3, NULL, 0);
  uint64_t in1[1] = {1};
  send_seq(&s.c, dsp_wreq_op(&w, DSP_OP_SUM, in1, 1, 2, NULL, 0, NULL, 0, 0),
           4, NULL, 0);
  uint64_t rb = send_seq(&s.c, dsp_wreq_backward(&w, 2, 10, 0), 5, NULL, 0);
  float *z = calloc((size_t)N, sizeof *z);
  cr_assert_not_null(z);
  send_seq(&s.c, dsp_wreq_upload(&w, 3, DSP_F32, 1, sh), 6, z,
           (size_t)N * sizeof *z);
  free(z);
  uint64_t params[1] = {1}, states[1] = {3};
  double fl[3] = {-1.0, 0.0, 0.0};
  send_seq(&s.c, dsp_wreq_step(&w, DSP_OP_SGD_STEP, 10, params, 1, states, 1,
                               NULL, 0, fl, 3), 7, NULL, 0);
  uint64_t rs = send_seq(&s.c, dsp_wreq_sync(&w), 8, NULL, 0);
  /* let everything run, then drop the connection with the Read's reply
   * (and the Sync's) unread */
  sleep_ms(300);
  raw_sess t;
  drop_and_resume(&s, &t, 1, 8);
  void *bulk;
  size_t n;
  Dspwire__Reply *rep = recv_ok(&t.c, rr, &bulk, &n); /* the kept Read */
  cr_assert_eq(n, (size_t)N * sizeof *x);
  cr_assert_eq(memcmp(bulk, x, n), 0, "the kept Read is not the snapshot "
               "taken before the step (first %g)", (double)((float *)bulk)[0]);
  wire_reply_free(rep, bulk);
  /* then the Backward's and the Sync's replies, kept too */
  uint64_t want[2] = {rb, rs};
  for (int k = 0; k < 2; k++)
    wire_reply_free(recv_ok(&t.c, want[k], NULL, NULL), NULL);
  uint64_t r9 = send_seq(&t.c, dsp_wreq_read(&w, 1), 9, NULL, 0);
  rep = recv_ok(&t.c, r9, &bulk, &n);
  cr_assert_eq(n, (size_t)N * sizeof *x);
  for (int i = 0; i < N; i += 4099)
    cr_assert_eq(((float *)bulk)[i], x[i] + 1.0f, "element %d after the step",
                 i);
  wire_reply_free(rep, bulk);
  free(x);
  wire_bye(&t.c);
  wire_close(&t.c);
  stop_server_clean();
}

/* A waiting reply the session could not keep (a 60 KB Read, copied whole,
 * over a 32 KiB queue budget) is not silently lost: after the resume the
 * client gets an error reply for that request, naming why. */
Test(fault, reply_not_kept_is_answered_with_an_error_after_resume,
     .fini = teardown, .timeout = 120) {
  start_server_q("30", "32768");
  raw_sess s;
  cr_assert_eq(raw_hello(&s, g_srv.port, NULL, NULL, 0, 0), 0);
  enum { N = 15000 };
  int64_t sh[1] = {N};
  static float x[N];
  dsp_wreq w;
  send_seq(&s.c, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), 1, x, sizeof x);
  uint64_t rr = send_seq(&s.c, dsp_wreq_read(&w, 1), 2, NULL, 0);
  sleep_ms(300);
  raw_sess t;
  drop_and_resume(&s, &t, 1, 2);
  /* a lost reply shows as a receive that times out, not a hung suite */
  t.c.wait_ms = 20000;
  Dspwire__Reply *rep;
  void *bulk;
  size_t n;
  cr_assert_eq(wire_recv(&t.c, &rep, &bulk, &n), 0,
               "no answer to the Read after the resume");
  cr_assert_eq(rep->req_id, rr);
  cr_assert_not_null(rep->error, "a reply over the budget was kept");
  cr_assert_eq(rep->error->code, DISPATCH_EQUOTA, "%s",
               dispatch_err_name(rep->error->code));
  cr_assert_eq(rep->error->failed_req_id, 0,
               "the tensor itself is fine: nothing to mark");
  cr_assert(strstr(rep->error->message, "not kept"), "%s",
            rep->error->message);
  wire_reply_free(rep, bulk);
  /* the session itself is intact: the tensor reads back */
  uint64_t r3 = send_seq(&t.c, dsp_wreq_read(&w, 1), 3, NULL, 0);
  rep = recv_ok(&t.c, r3, &bulk, &n);
  cr_assert_eq(n, sizeof x);
  wire_reply_free(rep, bulk);
  wire_bye(&t.c);
  wire_close(&t.c);
  stop_server_clean();
}

/* Detached sessions count towards --max-sessions, but never keep a new
 * session out: with a limit of 2 and one session detached, one new
 * session is admitted beside it (the detached one still resumes); with
 * it dropped again, the next new session is admitted too, the detached
 * one expired for it, and its resume is refused with ESESSION. */
Test(fault, detached_sessions_count_towards_max_sessions, .fini = teardown,
     .timeout = 60) {
  const char *args[] = {"--log-level", "error", "--session-grace", "30",
                        "--max-sessions", "2", NULL};
  check_server_start(&g_srv, args);
  raw_sess a, bs, c, d, e;
  cr_assert_eq(raw_hello(&a, g_srv.port, NULL, NULL, 0, 0), 0);
  wire_close(&a.c);
  sleep_ms(300); /* the server sees the drop: a is detached */
  cr_assert_eq(raw_hello(&bs, g_srv.port, NULL, NULL, 0, 0), 0,
               "1 connected + 1 detached is within a limit of 2");
  cr_assert_eq(raw_hello(&d, g_srv.port, NULL, a.token, a.token_len, 0), 0,
               "the detached session's own resume was refused");
  cr_assert(d.resumed);
  wire_close(&d.c);
  sleep_ms(300); /* a is detached again */
  int rc = raw_hello(&c, g_srv.port, NULL, NULL, 0, 0);
  cr_assert_eq(rc, 0, "a new session was refused for a detached one "
               "(code %d)", rc);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c.c, &st), 0);
  cr_assert_eq(st.sessions_detached, 0);
  cr_assert_eq(st.sessions_expired, 1);
  wire_bye(&c.c);
  wire_close(&c.c);
  sleep_ms(100);
  rc = raw_hello(&e, g_srv.port, NULL, a.token, a.token_len, 0);
  cr_assert_eq(rc, DISPATCH_ESESSION, "resume of the expired session: %d",
               rc);
  wire_close(&e.c);
  wire_bye(&bs.c);
  wire_close(&bs.c);
  stop_server_clean();
}

Test(fault, expired_session_token_refused, .fini = teardown) {
  start_server("1");
  raw_sess s;
  cr_assert_eq(raw_hello(&s, g_srv.port, NULL, NULL, 0, 0), 0);
  wire_close(&s.c);
  Dspwire__StatsReply st = server_stats();
  for (int i = 0; i < 500 && st.sessions_expired < 1; i++) {
    sleep_ms(20);
    st = server_stats();
  }
  cr_assert_eq(st.sessions_expired, 1);
  raw_sess t;
  int code = raw_hello(&t, g_srv.port, NULL, s.token, s.token_len, 0);
  cr_assert_eq(code, DISPATCH_ESESSION, "got %d", code);
  cr_assert_eq(wire_wait_closed(&t.c), 1);
  wire_close(&t.c);
  /* a token that never existed reads the same */
  uint8_t bogus[32] = {1, 2, 3};
  code = raw_hello(&t, g_srv.port, NULL, bogus, sizeof bogus, 0);
  cr_assert_eq(code, DISPATCH_ESESSION, "got %d", code);
  wire_close(&t.c);
}

Test(fault, library_gives_esession_once_the_session_expired,
     .fini = teardown, .timeout = 120) {
  start_server("1");
  /* the first connection is cut after its second Sync; the reconnect's
   * hello is then held 2.5 s, past the server's 1 s grace */
  const fp_rule rules[] = {
      {.conn = 0, .dir = FP_C2S, .at_byte = -1, .body = REQ(SYNC), .nth = 2,
       .pct = 100, .action = FP_CUT},
      {.conn = 1, .dir = FP_C2S, .at_byte = 0, .action = FP_DELAY,
       .arg = 2500},
  };
  g_fp = fp_start(g_srv.port, rules, 2);
  cr_assert_not_null(g_fp);
  dispatch_device *dev = open_port(fp_port(g_fp));
  int64_t sh[1] = {4};
  dispatch_tensor *x;
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 1, sh, &x));
  OK(dev, dispatch_device_sync(dev));
  int rc = dispatch_device_sync(dev);
  cr_assert_eq(rc, DISPATCH_ESESSION, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "no session waits"), "%s",
            dispatch_device_errmsg(dev));
  /* and keeps saying so */
  float v[4];
  cr_assert_eq(dispatch_tensor_read(x, v, sizeof v), DISPATCH_ESESSION);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  Dspwire__StatsReply st = server_stats();
  cr_assert_eq(st.sessions_expired, 1);
}

Test(fault, resume_with_other_credentials_refused, .fini = teardown,
     .timeout = 120) {
  start_server("30");
  raw_sess s;
  /* a server without --token-file takes any hello token, but a session
   * resumes only with the one it was opened with */
  cr_assert_eq(raw_hello(&s, g_srv.port, "alpha", NULL, 0, 0), 0);
  wire_close(&s.c);
  raw_sess t;
  int code = raw_hello(&t, g_srv.port, "beta", s.token, s.token_len, 0);
  cr_assert_eq(code, DISPATCH_EAUTH, "got %d", code);
  wire_close(&t.c);
  code = raw_hello(&t, g_srv.port, NULL, s.token, s.token_len, 0);
  cr_assert_eq(code, DISPATCH_EAUTH, "got %d", code);
  wire_close(&t.c);
  /* the right one still resumes: the refusals did not end the session */
  code = raw_hello(&t, g_srv.port, "alpha", s.token, s.token_len, 0);
  cr_assert_eq(code, 0, "got %d", code);
  cr_assert(t.resumed);
  wire_bye(&t.c);
  wire_close(&t.c);
}

/* ------------------------------------------------------------ mutual TLS */

/* A CA, a server and a client certificate for localhost in a fresh g_dir
 * (deploy/make-certs.sh), then the shell command extra run in g_dir
 * (NULL: none). */
static void make_certs(const char *extra) {
  const char *bin = check_server_bin();
  char b[1024];
  snprintf(b, sizeof b, "%s", bin);
  char *root = dirname(dirname(b));
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp_fault_XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
  char cmd[4096];
  snprintf(cmd, sizeof cmd,
           "'%s/deploy/make-certs.sh' '%s' localhost 30 >/dev/null && "
           "cd '%s' && %s",
           root, g_dir, g_dir, extra ? extra : "true");
  cr_assert_eq(system(cmd), 0, "making certificates failed: %s", cmd);
}

Test(fault, tls_resume_needs_the_same_client_certificate, .fini = teardown,
     .timeout = 180) {
  /* a second client of the same CA */
  make_certs(
      "openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 "
      "-nodes -keyout other.key -out other.csr -subj '/CN=other client' "
      "2>/dev/null && printf 'extendedKeyUsage=clientAuth\\n' > ext && "
      "openssl x509 -req -in other.csr -CA ca.pem -CAkey ca.key "
      "-CAcreateserial -out other.pem -days 30 -extfile ext 2>/dev/null "
      "&& cp client.pem cur.pem && cp client.key cur.key");
  char cert[300], key[300], ca[300], srv_pem[300], srv_key[300];
  snprintf(cert, sizeof cert, "%s/cur.pem", g_dir);
  snprintf(key, sizeof key, "%s/cur.key", g_dir);
  snprintf(ca, sizeof ca, "%s/ca.pem", g_dir);
  snprintf(srv_pem, sizeof srv_pem, "%s/server.pem", g_dir);
  snprintf(srv_key, sizeof srv_key, "%s/server.key", g_dir);
  const char *args[] = {"--log-level", "warn", "--session-grace", "30",
                        "--tls-cert", srv_pem, "--tls-key", srv_key,
                        "--tls-client-ca", ca, NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "TLS server did not start");
  /* TLS bytes are opaque to the proxy: each connection is cut 400 ms in */
  const fp_rule rules[] = {
      {.conn = 0, .dir = FP_C2S, .at_byte = -1, .at_ms = 400,
       .action = FP_CUT},
      {.conn = 1, .dir = FP_C2S, .at_byte = -1, .at_ms = 400,
       .action = FP_CUT},
  };
  g_fp = fp_start(g_srv.port, rules, 2);
  cr_assert_not_null(g_fp);
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = ca;
  o.cert_file = cert;
  o.key_file = key;
  o.server_name = "localhost";
  o.timeout_ms = 20000;
  char spec[64], msg[512] = "";
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", fp_port(g_fp));
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  int64_t sh[1] = {4};
  dispatch_tensor *x;
  OK(dev, dispatch_ones(dev, DISPATCH_F32, 1, sh, &x));
  OK(dev, dispatch_device_sync(dev));
  sleep_ms(700); /* connection 0 is cut meanwhile */
  float v[4];
  OK(dev, dispatch_tensor_read(x, v, sizeof v)); /* resumed, same cert */
  cr_assert_eq(v[3], 1.0f);
  /* the files the client reconnects with now hold another certificate of
   * the same CA: the TLS handshake passes, the resume must not */
  char cmd[600];
  snprintf(cmd, sizeof cmd, "cd '%s' && cp other.pem cur.pem && "
           "cp other.key cur.key", g_dir);
  cr_assert_eq(system(cmd), 0);
  sleep_ms(700); /* connection 1 is cut */
  rc = dispatch_tensor_read(x, v, sizeof v);
  cr_assert_eq(rc, DISPATCH_EAUTH, "got %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "other credentials"), "%s",
            dispatch_device_errmsg(dev));
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  cr_assert_eq(fp_fired(g_fp), 2);
}

/* ------------------------------------------- waits on a busy TLS server */

/* Issue 21 item 5 over TLS: keepalives arrive as TLS records, so a sync
 * behind more work than its timeout gives DISPATCH_ETIMEDOUT, the session
 * is never lost (no resume), and waiting again gets the work's end. The
 * work doubles until a sync gives up on it. */
Test(fault, tls_wait_that_times_out_keeps_the_session, .fini = teardown,
     .timeout = 300) {
  make_certs(NULL);
  char ca[300], srv_pem[300], srv_key[300];
  snprintf(ca, sizeof ca, "%s/ca.pem", g_dir);
  snprintf(srv_pem, sizeof srv_pem, "%s/server.pem", g_dir);
  snprintf(srv_key, sizeof srv_key, "%s/server.key", g_dir);
  const char *args[] = {"--log-level", "warn", "--tls-cert", srv_pem,
                        "--tls-key", srv_key, NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "TLS server did not start");
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = ca;
  o.server_name = "localhost";
  o.timeout_ms = 600;
  char spec[64], msg[512] = "";
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", g_srv.port);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  int64_t sh[2] = {1024, 1024};
  dispatch_tensor *x, *y;
  OK(dev, dispatch_full(dev, DISPATCH_F32, 2, sh, 1.0 / 1024, &x));
  OK(dev, dispatch_device_sync(dev));
  int k;
  for (k = 8; k <= 8192; k *= 2) {
    for (int i = 0; i < k; i++) {
      OK(dev, dispatch_matmul(x, x, &y));
      dispatch_tensor_free(y);
    }
    rc = dispatch_device_sync(dev);
    if (rc == DISPATCH_ETIMEDOUT) break;
    cr_assert_eq(rc, 0, "sync after %d matmuls: %s: %s", k,
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    dispatch_stats st = DISPATCH_STATS_INIT; /* no reconnect on the way */
    OK(dev, dispatch_device_stats(dev, &st));
    cr_assert_eq(st.sessions_resumed, 0, "sync after %d matmuls resumed",
                 k);
  }
  cr_assert_eq(rc, DISPATCH_ETIMEDOUT, "no sync timed out (%d matmuls)", k);
  int again = 0;
  while ((rc = dispatch_device_sync(dev)) == DISPATCH_ETIMEDOUT)
    cr_assert_lt(++again, 1000);
  OK(dev, rc);
  float v[4];
  dispatch_tensor *row;
  int64_t one[1] = {4};
  OK(dev, dispatch_full(dev, DISPATCH_F32, 1, one, 0.5, &row));
  OK(dev, dispatch_tensor_read(row, v, sizeof v));
  cr_assert_eq(v[3], 0.5f);
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  cr_assert_eq(st.sessions_resumed, 0);
  cr_assert_eq(st.errors, 0);
  dispatch_tensor_free(row);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
}

/* ------------------------------------------------ keepalive frames (1.4) */

/* Connects and says hello asking for keepalives every ka_ms (0: none, as
 * a 1.3 client); uploads tensor 1 (1024 x 1024). Returns the interval
 * the hello's reply says the server uses. */
static uint32_t ka_open(wire_conn *c, uint32_t ka_ms) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *req =
      dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, NULL, "ka");
  w.body.hello.keepalive_ms = ka_ms;
  req->req_id = c->next_req_id++;
  cr_assert_eq(wire_send(c, req, NULL, 0), 0);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0);
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_HELLO);
  uint32_t got = r->hello->keepalive_ms;
  wire_reply_free(r, NULL);
  size_t n = (size_t)1 << 20;
  float *x = malloc(n * sizeof *x);
  cr_assert(x);
  for (size_t i = 0; i < n; i++) x[i] = 1.0f / 1024;
  int64_t sh[2] = {1024, 1024};
  cr_assert(wire_upload(c, 1, DSP_F32, 2, sh, x, n * sizeof *x));
  free(x);
  return got;
}

/* Queues k products of tensor 1 by itself (each freed) and a sync that
 * carries keepalive_ms ka (0: none); returns the keepalive frames that
 * came before the sync's reply. Any other frame fails the test. */
static int ka_busy_sync(wire_conn *c, int k, uint32_t ka) {
  uint64_t in[2] = {1, 1};
  for (int i = 0; i < k; i++) {
    uint64_t out = 100 + (uint64_t)i;
    cr_assert(wire_op(c, DSP_OP_MATMUL, in, 2, out, NULL, 0, NULL, 0));
    cr_assert(wire_free(c, &out, 1, NULL, 0));
  }
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_sync(&w);
  req->keepalive_ms = ka;
  uint64_t sid = req->req_id = c->next_req_id++;
  cr_assert_eq(wire_send(c, req, NULL, 0), 0);
  for (int n = 0;; n++) {
    Dspwire__Reply *r;
    cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0);
    if (r->req_id == sid) {
      cr_assert_null(r->error, "sync failed: %s",
                     r->error ? r->error->message : "");
      wire_reply_free(r, NULL);
      return n;
    }
    cr_assert(r->keepalive && r->req_id == 0 && !r->error &&
                  r->body_case == DSPWIRE__REPLY__BODY__NOT_SET,
              "an unexpected frame before the sync's reply (req_id %llu)",
              (unsigned long long)r->req_id);
    wire_reply_free(r, NULL);
  }
}

/* The server sends keepalives to a client that asked for them (raised
 * to its 20 ms floor), while the session has work in flight and nothing
 * else to say, and nothing to a client that did not ask (a 1.3 client)
 * until a request asks for them. The work doubles until keepalives come,
 * so no duration is assumed. */
Test(fault, keepalives_go_only_to_a_client_that_asked, .fini = teardown) {
  start_server("60");
  wire_conn a, b;
  cr_assert_eq(ka_open(&a, 5), 20);
  cr_assert_eq(ka_open(&b, 0), 0);
  int k, n = 0;
  for (k = 4; k <= 8192 && n == 0; k *= 2) n = ka_busy_sync(&a, k, 0);
  cr_assert_gt(n, 0, "no keepalive during %d matmuls", k / 2);
  cr_assert_eq(ka_busy_sync(&b, k / 2, 0), 0,
               "keepalives to a client that did not ask");
  /* any request may ask (Request.keepalive_ms): this sync does, and the
   * work after it hears keepalives */
  (void)ka_busy_sync(&b, 0, 20);
  for (k = 4, n = 0; k <= 8192 && n == 0; k *= 2) n = ka_busy_sync(&b, k, 0);
  cr_assert_gt(n, 0, "no keepalive after Request.keepalive_ms");
  wire_bye(&a);
  wire_bye(&b);
  wire_close(&a);
  wire_close(&b);
}
