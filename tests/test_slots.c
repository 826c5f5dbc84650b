/* Session slots (--max-sessions) and detached sessions: a real
 * dispatch-server on 127.0.0.1 with its metrics endpoint, raw clients.
 *
 * - a detached session never keeps a new client out: at the limit one is
 *   expired to make room (those whose connection the server closed for a
 *   limit first, then the one detached longest ago), counted in
 *   dispatch_sessions_evicted_total, and its resume is told why;
 * - a detached session expiring while a request of it still runs leaves
 *   nothing behind: the late reply is freed with its job, not kept (the
 *   server's held bytes come back to their baseline; under the sanitizer
 *   build, LeakSanitizer at the server's exit says the same). */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "frame.h"
#include "helpers/client_check.h"
#include "helpers/http.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static int g_mport; /* the metrics endpoint's port */

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

TestSuite(slots, .fini = cleanup, .timeout = 180);

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000};
  nanosleep(&ts, NULL);
}

/* Starts the server with --metrics-listen 127.0.0.1:0 and args, and reads
 * the endpoint's port from the line it prints after "listening on". */
static void start(const char *const *args) {
  const char *all[32];
  int n = 0;
  all[n++] = "--metrics-listen";
  all[n++] = "127.0.0.1:0";
  all[n++] = "--log-level";
  all[n++] = "error";
  for (int i = 0; args[i] && n < 31; i++) all[n++] = args[i];
  all[n] = NULL;
  check_server_start(&g_srv, all);
  char line[256];
  size_t len = 0;
  while (len < sizeof line - 1) {
    struct pollfd p = {.fd = g_srv.out_fd, .events = POLLIN};
    cr_assert_gt(poll(&p, 1, 60000), 0, "no metrics line on stdout");
    cr_assert_eq(read(g_srv.out_fd, line + len, 1), 1);
    if (line[len] == '\n') break;
    len++;
  }
  line[len] = '\0';
  const char *prefix = "dispatch-server metrics on 127.0.0.1:";
  cr_assert_eq(strncmp(line, prefix, strlen(prefix)), 0, "%s", line);
  g_mport = atoi(line + strlen(prefix));
}

/* GET /metrics (helpers/http.c): the body, malloc'd. */
static char *scrape(void) {
  char *body, why[256];
  int st = http_request(g_mport, "GET", "/metrics", &body, why, sizeof why);
  cr_assert_eq(st, 200, "GET /metrics: %d %s", st, st < 0 ? why : body);
  return body;
}

/* The value of the sample named exactly series, from a fresh scrape. */
static double metric(const char *series) {
  char *text = scrape();
  size_t n = strlen(series);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : p)
    if (strncmp(p, series, n) == 0 && p[n] == ' ') {
      double v = strtod(p + n, NULL);
      free(text);
      return v;
    }
  cr_assert_fail("no sample %s in:\n%s", series, text);
  return 0;
}

#define DETACHED "dispatch_sessions_detached"
#define EVICTED_CLOSED "dispatch_sessions_evicted_total{reason=\"server_closed\"}"
#define EVICTED_OLDEST "dispatch_sessions_evicted_total{reason=\"oldest\"}"

/* Waits (bounded: a safety net, not a timing check) until series reads
 * want; fails with what (and the value) otherwise. */
static void wait_metric(const char *series, double want, const char *what) {
  double v = metric(series);
  for (int i = 0; i < 1500 && v != want; i++) {
    sleep_ms(20);
    v = metric(series);
  }
  cr_assert_eq(v, want, "%s (%s %g, %g expected)", what, series, v, want);
}

/* ... until the server has seen want sessions detached. */
static void wait_detached(int want) {
  wait_metric(DETACHED, want, "sessions detached");
}

/* Waits (bounded) until no connection is closing: one the server closed
 * counts towards --max-sessions until it is freed, and the next connect
 * must not find it there. */
static void settle(void) {
  const char *closing = "dispatch_sessions{state=\"closing\"}";
  double v = metric(closing);
  for (int i = 0; i < 1500 && v != 0; i++) {
    sleep_ms(20);
    v = metric(closing);
  }
  cr_assert_eq(v, 0, "%g connections still closing", v);
}

/* A raw session that asks to be resumable. */
typedef struct raw_sess {
  wire_conn c;
  uint8_t token[64];
  size_t token_len;
  int resumed;
  char msg[512]; /* the refusal's message */
} raw_sess;

static uint64_t send_seq(wire_conn *c, Dspwire__Request *r, uint64_t seq,
                         const void *bulk, size_t n) {
  r->req_id = ++c->next_req_id;
  r->seq = seq;
  cr_assert_eq(wire_send(c, r, bulk, n), 0);
  return r->req_id;
}

/* Hello (a resume of token when set): the reply's error code, 0 when
 * accepted; the connection must answer. */
static int hello(raw_sess *s, const raw_sess *resume) {
  memset(s, 0, sizeof *s);
  cr_assert_eq(wire_connect(&s->c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, NULL, "slots");
  w.body.hello.resume = 1;
  if (resume) {
    w.body.hello.resume_token.data = (uint8_t *)resume->token;
    w.body.hello.resume_token.len = resume->token_len;
  }
  send_seq(&s->c, r, 0, NULL, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(&s->c, &rep, NULL, NULL), 0, "no hello reply");
  int code = rep->error ? rep->error->code : 0;
  if (rep->error) snprintf(s->msg, sizeof s->msg, "%s", rep->error->message);
  if (!code && rep->hello) {
    s->token_len = rep->hello->resume_token.len;
    cr_assert_leq(s->token_len, sizeof s->token);
    memcpy(s->token, rep->hello->resume_token.data, s->token_len);
    s->resumed = rep->hello->resumed;
  }
  wire_reply_free(rep, NULL);
  return code;
}

static void bye(raw_sess *s) {
  wire_bye(&s->c);
  wire_close(&s->c);
}

/* The resume of old's session must be refused with DISPATCH_ESESSION,
 * saying it was expired to make room, and want; the refused connection
 * is gone before this returns. */
static void expect_evicted(const raw_sess *old, const char *want) {
  raw_sess r;
  int rc = hello(&r, old);
  cr_assert_eq(rc, DISPATCH_ESESSION, "resume of the evicted session: %s",
               dispatch_err_name(rc));
  cr_assert(strstr(r.msg, "to make room for a new client"), "%s", r.msg);
  cr_assert(strstr(r.msg, want), "%s", r.msg);
  cr_assert_eq(wire_wait_closed(&r.c), 1);
  wire_close(&r.c);
  settle();
}

/* old's session must resume (it was not the one evicted); then bye. */
static void expect_resumes(const raw_sess *old) {
  raw_sess r;
  int rc = hello(&r, old);
  cr_assert_eq(rc, 0, "the wrong detached session was evicted: %s: %s",
               dispatch_err_name(rc), r.msg);
  cr_assert(r.resumed);
  bye(&r);
}

/* An upload of 64 KiB and 400 Reads of it that s never takes: more than
 * the sockets buffer, less than --max-output-queue. */
static void unread_reads(raw_sess *s) {
  enum { N = 16384 };
  static float x[N];
  int64_t sh[1] = {N};
  dsp_wreq w;
  send_seq(&s->c, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), 1, x, sizeof x);
  for (uint64_t i = 0; i < 400; i++)
    send_seq(&s->c, dsp_wreq_read(&w, 1), 2 + i, NULL, 0);
}

/* With --max-sessions 2, two clients that drop (as a kill -9 does: the
 * socket closes, no bye) used to keep a third out with DISPATCH_ELIMIT
 * for the whole --session-grace. The third gets in at once: the session
 * detached longest ago is expired for it, and its resume says so; the
 * other still resumes. */
Test(slots, dropped_clients_do_not_lock_out_a_new_one) {
  const char *args[] = {"--max-sessions", "2", "--session-grace", "60",
                        NULL};
  start(args);
  raw_sess a, b, c;
  cr_assert_eq(hello(&a, NULL), 0);
  wire_close(&a.c);
  wait_detached(1);
  cr_assert_eq(hello(&b, NULL), 0);
  wire_close(&b.c);
  wait_detached(2);
  int rc = hello(&c, NULL);
  cr_assert_eq(rc, 0, "a new client was refused for detached sessions: "
               "%s: %s", dispatch_err_name(rc), c.msg);
  cr_assert_eq(metric(EVICTED_OLDEST), 1);
  cr_assert_eq(metric(EVICTED_CLOSED), 0);
  cr_assert_eq(metric(DETACHED), 1);
  expect_evicted(&a, "--max-sessions 2");
  expect_resumes(&b);
  bye(&c);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

/* The session of a client the server closed for a limit (it took none of
 * its replies for --idle-timeout) goes before an older one a client
 * dropped. */
Test(slots, a_session_the_server_closed_goes_first) {
  const char *args[] = {"--max-sessions", "2", "--session-grace", "60",
                        "--idle-timeout", "1", NULL};
  start(args);
  raw_sess a, b, c;
  cr_assert_eq(hello(&a, NULL), 0);
  wire_close(&a.c);
  wait_detached(1);
  cr_assert_eq(hello(&b, NULL), 0);
  unread_reads(&b);
  wait_detached(2); /* closed by the server: "does not read its replies" */
  wire_close(&b.c);
  int rc = hello(&c, NULL);
  cr_assert_eq(rc, 0, "a new client was refused for detached sessions: "
               "%s: %s", dispatch_err_name(rc), c.msg);
  cr_assert_eq(metric(EVICTED_CLOSED), 1);
  cr_assert_eq(metric(EVICTED_OLDEST), 0);
  expect_evicted(&b, "closed by the server");
  expect_resumes(&a);
  bye(&c);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

/* Server-wide stats through a session of its own (closed with a bye). */
static Dspwire__StatsReply server_stats(void) {
  Dspwire__StatsReply st;
  cr_assert_eq(wire_server_stats(g_srv.port, &st), 0, "no server stats");
  return st;
}

/* A detached session expires (--session-grace 1) while its Backward, a
 * request with a reply, runs: the cancelled Backward still comes back
 * with an error reply, which was kept for a resume that cannot come,
 * after the session's kept replies were dropped, and never freed (~130
 * bytes an expiry, charged to --max-memory, or not at all when the
 * teardown had released the queue budget first). */
Test(slots, a_reply_finished_after_expiry_is_not_kept) {
  const char *args[] = {"--session-grace", "1", "--storage-cache", "0",
                        NULL};
  start(args);
  Dspwire__StatsReply base = server_stats();
  double cancelled0 = metric("dispatch_errors_total{code=\"DISPATCH_ECANCELED\"}");
  for (int round = 1; round <= 2; round++) {
    raw_sess s;
    cr_assert_eq(hello(&s, NULL), 0);
    /* x (2048x2048, tracked), CHAIN matmuls and a sum: run in full (a
     * Sync answers), then a Backward through them (2 * CHAIN matmuls,
     * seconds of work: the expiry, 1-1.25 s after the drop, cancels it;
     * six, 0.1 s a product on an idle machine, finished first one run in
     * three), and the socket drops */
    enum { N = 2048 };
    static float x[N * N];
    int64_t sh[2] = {N, N};
    dsp_wreq w;
    uint64_t seq = 0;
    send_seq(&s.c, dsp_wreq_upload(&w, 1, DSP_F32, 2, sh), ++seq, x,
             sizeof x);
    send_seq(&s.c, dsp_wreq_track(&w, 1), ++seq, NULL, 0);
    uint64_t in[2];
    enum { CHAIN = 16 };
    for (uint64_t k = 1; k <= CHAIN; k++) {
      in[0] = in[1] = k;
      send_seq(&s.c, dsp_wreq_op(&w, DSP_OP_MATMUL, in, 2, k + 1, NULL, 0,
                                 NULL, 0, 0),
               ++seq, NULL, 0);
    }
    in[0] = CHAIN + 1;
    send_seq(&s.c, dsp_wreq_op(&w, DSP_OP_SUM, in, 1, CHAIN + 2, NULL, 0,
                               NULL, 0, 0),
             ++seq, NULL, 0);
    uint64_t sync = send_seq(&s.c, dsp_wreq_sync(&w), ++seq, NULL, 0);
    Dspwire__Reply *rep;
    cr_assert_eq(wire_recv(&s.c, &rep, NULL, NULL), 0);
    cr_assert_eq(rep->req_id, sync);
    cr_assert_null(rep->error, "%s", rep->error ? rep->error->message : "");
    wire_reply_free(rep, NULL);
    send_seq(&s.c, dsp_wreq_backward(&w, CHAIN + 2, CHAIN + 3, 0), ++seq,
             NULL, 0);
    wire_close(&s.c);
    /* expired, and torn down (its tensors are gone) */
    Dspwire__StatsReply st = server_stats();
    for (int i = 0; i < 1500 && (st.sessions_expired < (uint64_t)round ||
                                 st.server_tensors != base.server_tensors);
         i++) {
      sleep_ms(20);
      st = server_stats();
    }
    cr_assert_eq(st.sessions_expired, (uint64_t)round);
    cr_assert_eq(st.server_tensors, base.server_tensors);
  }
  /* the Backwards were still running at the expiry: cancelled there */
  cr_assert_geq(metric("dispatch_errors_total{code=\"DISPATCH_ECANCELED\"}"),
                cancelled0 + 2, "a Backward finished before its expiry");
  /* the loop has handled every job that came back before the teardowns */
  Dspwire__StatsReply st;
  cr_assert_neq(wire_wait_held_bytes(g_srv.port, base.server_held_bytes,
                                     50, &st),
                -2, "no server stats");
  cr_assert_eq(st.server_held_bytes, base.server_held_bytes,
               "held %llu bytes after two expiries, %llu before",
               (unsigned long long)st.server_held_bytes,
               (unsigned long long)base.server_held_bytes);
  int status = sp_stop(&g_srv);
  cr_assert_eq(status, 0, "dispatch-server exited with status %d", status);
}

/* A client that stalls a frame (--frame-timeout) while it takes none of
 * its replies: the refusal's Error frame waits behind the unread replies
 * (close_after_flush), and the idle check skipped such a connection, so
 * it was never closed and held its slot for as long as the client liked.
 * It is closed as any client that does not read is (--idle-timeout, the
 * idle_timeout limit counted once the frame timeout was). */
Test(slots, a_stalled_frame_behind_unread_replies_is_closed) {
  const char *args[] = {"--frame-timeout", "1", "--idle-timeout", "2",
                        NULL};
  start(args);
  raw_sess b;
  cr_assert_eq(hello(&b, NULL), 0);
  unread_reads(&b);
  uint8_t first = 20; /* one byte of a frame header, then nothing */
  cr_assert_eq(wire_send_raw(&b.c, &first, 1), 0);
  const char *frame = "dispatch_limit_violations_total{limit=\"frame_timeout\"}";
  const char *idle = "dispatch_limit_violations_total{limit=\"idle_timeout\"}";
  wait_metric(frame, 1, "the stalled frame was never refused");
  wait_metric(idle, 1, "a refused client that reads nothing was never closed");
  settle();
  wire_close(&b.c);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

/* A hello refused for an unknown device costs no detached session its
 * place: the device is looked up before room is made. */
Test(slots, a_hello_refused_for_its_device_evicts_nothing) {
  const char *args[] = {"--max-sessions", "1", "--session-grace", "60",
                        NULL};
  start(args);
  raw_sess a;
  cr_assert_eq(hello(&a, NULL), 0);
  wire_close(&a.c);
  wait_detached(1);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR,
                                       NULL, "slots");
  w.body.hello.device = "cuda:7";
  send_seq(&c, r, 0, NULL, 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(&c, &rep, NULL, NULL), 0, "no hello reply");
  cr_assert(rep->error, "a hello for an unknown device was accepted");
  cr_assert_eq(rep->error->code, DISPATCH_EDEVICE, "%s",
               rep->error->message);
  wire_reply_free(rep, NULL);
  wire_close(&c);
  settle();
  cr_assert_eq(metric(EVICTED_OLDEST), 0);
  expect_resumes(&a);
  cr_assert_eq(sp_stop(&g_srv), 0);
}
