/* Server-to-server transfers (protocol 1.7): two real dispatch-servers on
 * 127.0.0.1, A the source (--name a), B the destination (--peer a=ADDR).
 *
 * - dispatch_to_device from A to B moves the bytes server to server (A
 *   logs the peer fetch) and they arrive bit for bit;
 * - B refuses a peer it has not configured, A refuses B's wrong token;
 * - SIGHUP rereads B's --peer-token-file (a rotation on both sides works,
 *   on A alone is refused, an empty file is refused and the old token
 *   kept) and its --peer-ca/--peer-cert/--peer-key files;
 * - a capability works once, not after its --peer-cap-ttl, not after its
 *   tensor was freed;
 * - B charges the session before it connects: a pull over quota fails
 *   and A never serves a byte;
 * - the source's connection cut in the middle of the bytes fails the
 *   pull with DISPATCH_ECONN and leaves B with no tensor and no bytes. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/fault_proxy.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_a, g_b;
static fault_proxy *g_fp;
static char g_dir[64];
static int g_log_fd = -1;

static void teardown(void) {
  fp_stop(g_fp);
  g_fp = NULL;
  if (g_b.pid) sp_stop(&g_b);
  if (g_a.pid) sp_stop(&g_a);
  if (g_log_fd >= 0) close(g_log_fd);
  g_log_fd = -1;
  if (g_dir[0]) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_assert_eq(system(cmd), 0);
    g_dir[0] = '\0';
  }
}

/* Stops both servers and checks they exited cleanly: a sanitizer's
 * report at shutdown fails the test (asserts in .fini would not). */
static void stop_clean(void) {
  int sb = g_b.pid ? sp_stop(&g_b) : 0;
  int sa = g_a.pid ? sp_stop(&g_a) : 0;
  cr_assert_eq(sb, 0, "B exited with status %d", sb);
  cr_assert_eq(sa, 0, "A exited with status %d", sa);
}

/* A scratch folder with the token files "a.tok" (tok-a) and "bad.tok". */
static void make_dir(void) {
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp-peer-XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
  char p[128];
  const char *files[][2] = {{"a.tok", "tok-a\n"}, {"bad.tok", "tok-x\n"}};
  for (int i = 0; i < 2; i++) {
    snprintf(p, sizeof p, "%s/%s", g_dir, files[i][0]);
    FILE *f = fopen(p, "w");
    cr_assert_not_null(f);
    fputs(files[i][1], f);
    fclose(f);
  }
}

static const char *path(const char *name) {
  static char p[16][128];
  static int k;
  k = (k + 1) % 16;
  snprintf(p[k], sizeof p[k], "%s/%s", g_dir, name);
  return p[k];
}

/* A, its log in g_dir/a.log; extra: more of its arguments */
static void start_a(const char *const *extra) {
  const char *args[16] = {"--log-level", "info", "--name", "a"};
  int n = 4;
  for (; extra && *extra; extra++) args[n++] = *extra;
  args[n] = NULL;
  g_log_fd = open(path("a.log"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  cr_assert_geq(g_log_fd, 0);
  cr_assert_eq(sp_start_logged(&g_a, args, g_log_fd), 0, "A did not start");
}

/* B with peer a at port (0: none) and extra arguments */
static void start_b(int port, const char *const *extra) {
  static char peer[64];
  const char *args[16] = {"--log-level", "warn"};
  int n = 2;
  if (port) {
    snprintf(peer, sizeof peer, "a=127.0.0.1:%d", port);
    args[n++] = "--peer";
    args[n++] = peer;
  }
  for (; extra && *extra; extra++) args[n++] = *extra;
  args[n] = NULL;
  check_server_start(&g_b, args);
}

static int a_log_has(const char *what) {
  FILE *f = fopen(path("a.log"), "r");
  cr_assert_not_null(f);
  char line[1024];
  int hit = 0;
  while (!hit && fgets(line, sizeof line, f)) hit = strstr(line, what) != NULL;
  fclose(f);
  return hit;
}

static dispatch_device *open_dev(int port, const char *token) {
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.token = token;
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

/* n floats of a fixed pattern on dev */
static dispatch_tensor *pattern(dispatch_device *dev, int64_t rows,
                                int64_t cols, float **host) {
  size_t n = (size_t)(rows * cols);
  float *x = malloc(n * sizeof *x);
  cr_assert_not_null(x);
  for (size_t i = 0; i < n; i++) x[i] = (float)(i % 9973) * 0.25f - 7.0f;
  int64_t shape[2] = {rows, cols};
  dispatch_tensor *t = NULL;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, x,
                                    n * sizeof *x, &t));
  *host = x;
  return t;
}

static uint64_t server_tensors(int port, uint64_t *held) {
  Dspwire__StatsReply st;
  cr_assert_eq(wire_server_stats(port, &st), 0);
  if (held) *held = st.server_held_bytes;
  return st.server_tensors;
}

Test(peer, moves_bytes_server_to_server, .fini = teardown) {
  make_dir();
  const char *a_args[] = {"--token-file", path("a.tok"), NULL};
  start_a(a_args);
  const char *b_args[] = {"--peer-token-file", path("a.tok"), NULL};
  start_b(g_a.port, b_args);
  dispatch_device *a = open_dev(g_a.port, "tok-a");
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 300, 517, &x), *tb = NULL;
  OK(b, dispatch_to_device(ta, b, &tb));
  cr_assert_eq(dispatch_tensor_device(tb), b);
  size_t nb = dispatch_tensor_nbytes(tb);
  cr_assert_eq(nb, 300 * 517 * sizeof(float));
  float *y = malloc(nb);
  OK(b, dispatch_tensor_read(tb, y, nb));
  cr_assert_eq(memcmp(x, y, nb), 0, "the pulled bytes differ");
  /* the bytes went A -> B: A served them to B's connection */
  cr_assert(a_log_has("peer fetch of tensor"), "A logged no peer fetch");
  /* a second move works too (a new capability each time) */
  dispatch_tensor *tb2 = NULL;
  OK(b, dispatch_to_device(ta, b, &tb2));
  dispatch_tensor_free(tb2);
  free(x);
  free(y);
  dispatch_tensor_free(tb);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

Test(peer, refuses_unknown_peer_and_wrong_token, .fini = teardown) {
  make_dir();
  const char *a_args[] = {"--token-file", path("a.tok"), NULL};
  start_a(a_args);
  /* B has peers, but none named a */
  const char *other[] = {"--peer", "other=127.0.0.1:1", NULL};
  start_b(0, other);
  dispatch_device *a = open_dev(g_a.port, "tok-a");
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 4, 5, &x), *tb = NULL;
  int rc = dispatch_to_device(ta, b, &tb);
  cr_assert_eq(rc, DISPATCH_EPEER, "unknown peer gave %s",
               dispatch_err_name(rc));
  cr_assert_null(tb);
  cr_assert(strstr(dispatch_device_errmsg(b), "no peer 'a'") &&
                strstr(dispatch_device_errmsg(b), "it has other"),
            "%s", dispatch_device_errmsg(b));
  cr_assert_eq(server_tensors(g_b.port, NULL), 0);
  dispatch_device_close(b);
  cr_assert_eq(sp_stop(&g_b), 0, "B did not exit cleanly");
  /* B knows a but sends the wrong token */
  const char *bad[] = {"--peer-token-file", path("bad.tok"), NULL};
  start_b(g_a.port, bad);
  b = open_dev(g_b.port, NULL);
  rc = dispatch_to_device(ta, b, &tb);
  cr_assert_eq(rc, DISPATCH_EAUTH, "wrong token gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  cr_assert_null(tb);
  cr_assert_eq(server_tensors(g_b.port, NULL), 0);
  free(x);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

/* Writes text to g_dir/name (a rotation: a new file where a server reads) */
static void put_file(const char *name, const char *text) {
  FILE *f = fopen(path(name), "w");
  cr_assert_not_null(f, "%s", path(name));
  fputs(text, f);
  cr_assert_eq(fclose(f), 0);
}

static int log_count(const char *log, const char *what) {
  FILE *f = fopen(path(log), "r");
  cr_assert_not_null(f);
  char line[1024];
  int n = 0;
  while (fgets(line, sizeof line, f)) n += strstr(line, what) != NULL;
  fclose(f);
  return n;
}

/* SIGHUP to s, then a bounded wait for its n-th "done" line in log */
static void hup(sp_server *s, const char *log, int n) {
  cr_assert_eq(sp_signal(s, SIGHUP), 0);
  for (int i = 0; i < 1500 && log_count(log, "reload (SIGHUP): done:") < n;
       i++)
    usleep(20 * 1000);
  cr_assert_eq(log_count(log, "reload (SIGHUP): done:"), n,
               "%s: no reload %d", log, n);
}

/* a move of ta to b: 0 and the bytes equal to x's, or the code */
static int move_check(dispatch_tensor *ta, dispatch_device *b,
                      const float *x) {
  dispatch_tensor *tb = NULL;
  int rc = dispatch_to_device(ta, b, &tb);
  if (rc < 0) {
    cr_assert_null(tb);
    return rc;
  }
  size_t nb = dispatch_tensor_nbytes(tb);
  float *y = malloc(nb);
  cr_assert_not_null(y);
  OK(b, dispatch_tensor_read(tb, y, nb));
  cr_assert_eq(memcmp(x, y, nb), 0, "the pulled bytes differ");
  free(y);
  dispatch_tensor_free(tb);
  return 0;
}

/* --peer-token-file is reread on SIGHUP: the token rotated on A (its
 * --token-file) and on B (its --peer-token-file), each with a SIGHUP.
 * With only A rotated B's pull is refused by A; with both, it works; an
 * empty file on B is refused and B keeps presenting the token it had. */
Test(peer, peer_token_rotates_on_sighup, .fini = teardown) {
  make_dir();
  put_file("a-live.tok", "tok-a\n");
  put_file("b-peer.tok", "tok-a\n");
  const char *a_args[] = {"--token-file", path("a-live.tok"), NULL};
  start_a(a_args);
  static char peer[64];
  snprintf(peer, sizeof peer, "a=127.0.0.1:%d", g_a.port);
  const char *b_args[] = {"--log-level", "info", "--peer", peer,
                          "--peer-token-file", path("b-peer.tok"), NULL};
  int fd = open(path("b.log"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  cr_assert_geq(fd, 0);
  int st = sp_start_logged(&g_b, b_args, fd);
  close(fd);
  cr_assert_eq(st, 0, "B did not start");
  dispatch_device *a = open_dev(g_a.port, "tok-a");
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 37, 41, &x);
  cr_assert_eq(move_check(ta, b, x), 0, "%s", dispatch_device_errmsg(b));
  /* A alone rotated: B still presents tok-a, which A now refuses (the
   * client's own session on A, opened before, goes on) */
  put_file("a-live.tok", "tok-new\n");
  hup(&g_a, "a.log", 1);
  int rc = move_check(ta, b, x);
  cr_assert_eq(rc, DISPATCH_EAUTH, "one side rotated gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  cr_assert(strstr(dispatch_device_errmsg(b), "peer 'a' refused"), "%s",
            dispatch_device_errmsg(b));
  cr_assert_eq(server_tensors(g_b.port, NULL), 0);
  /* B rotated too: the next pull presents tok-new */
  put_file("b-peer.tok", "tok-new\n");
  hup(&g_b, "b.log", 1);
  cr_assert_eq(log_count("b.log", "peer token reloaded from "
                                  "--peer-token-file"), 1);
  cr_assert_eq(move_check(ta, b, x), 0, "both rotated: %s",
               dispatch_device_errmsg(b));
  /* a broken file is refused (counted as a refused reload) and B keeps
   * presenting tok-new */
  put_file("b-peer.tok", "");
  hup(&g_b, "b.log", 2);
  cr_assert_eq(log_count("b.log", "refused --peer-token-file"), 1);
  cr_assert_eq(log_count("b.log", "done: 0 reloaded, 1 refused"), 1);
  cr_assert_eq(move_check(ta, b, x), 0, "after a refused file: %s",
               dispatch_device_errmsg(b));
  free(x);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

/* A raw grant of tensor id on c: the capability (32 bytes) */
static void grant(wire_conn *c, uint64_t id, uint8_t cap[32]) {
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_peer_grant(&w, id);
  r->req_id = ++c->next_req_id;
  cr_assert_eq(wire_send(c, r, NULL, 0), 0);
  Dspwire__Reply *rep;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(c, &rep, &bulk, &bl), 0);
  cr_assert(!rep->error || !rep->error->code, "grant refused: %s",
            rep->error ? rep->error->message : "");
  cr_assert_eq(rep->body_case, DSPWIRE__REPLY__BODY_PEER_GRANT);
  cr_assert_eq(rep->peer_grant->capability.len, 32);
  cr_assert_str_eq(rep->peer_grant->name, "a");
  memcpy(cap, rep->peer_grant->capability.data, 32);
  wire_reply_free(rep, bulk);
}

/* A raw pull on c into output of an f32 [n]: the reply's error code (0:
 * none), its message in msg */
static int pull(wire_conn *c, const uint8_t cap[32], uint64_t output,
                int64_t n, char *msg, size_t len) {
  dsp_wreq w;
  int64_t shape[1] = {n};
  Dspwire__Request *r =
      dsp_wreq_peer_pull(&w, "a", cap, 32, output, 0, 1, shape, NULL);
  r->req_id = ++c->next_req_id;
  cr_assert_eq(wire_send(c, r, NULL, 0), 0);
  Dspwire__Reply *rep;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(c, &rep, &bulk, &bl), 0);
  int code = rep->error ? rep->error->code : 0;
  snprintf(msg, len, "%s", rep->error ? rep->error->message : "");
  wire_reply_free(rep, bulk);
  return code;
}

Test(peer, capability_once_in_time_while_tensor_lives, .fini = teardown) {
  make_dir();
  const char *a_args[] = {"--peer-cap-ttl", "1", NULL};
  start_a(a_args);
  start_b(g_a.port, NULL);
  wire_conn ca, cb;
  cr_assert_eq(wire_connect(&ca, g_a.port), 0);
  cr_assert_eq(wire_hello(&ca, "peer-test"), 0);
  cr_assert_eq(wire_connect(&cb, g_b.port), 0);
  cr_assert_eq(wire_hello(&cb, "peer-test"), 0);
  float x[6] = {1, 2, 3, 4, 5, 6};
  int64_t shape[1] = {6};
  wire_upload(&ca, 10, 0, 1, shape, x, sizeof x);
  wire_upload(&ca, 11, 0, 1, shape, x, sizeof x);
  cr_assert_eq(wire_sync_check(&ca, NULL, 0, NULL), 0);
  uint8_t cap[32], cap2[32];
  char msg[512];
  /* once */
  grant(&ca, 10, cap);
  cr_assert_eq(pull(&cb, cap, 100, 6, msg, sizeof msg), 0, "%s", msg);
  int rc = pull(&cb, cap, 101, 6, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ECAPABILITY, "a used capability gave %d: %s", rc,
               msg);
  cr_assert(strstr(msg, "unknown capability"), "%s", msg);
  /* not after its tensor was freed */
  grant(&ca, 11, cap2);
  uint64_t gone = 11;
  wire_free(&ca, &gone, 1, NULL, 0);
  cr_assert_eq(wire_sync_check(&ca, NULL, 0, NULL), 0);
  rc = pull(&cb, cap2, 102, 6, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ECAPABILITY, "a freed tensor's gave %d: %s", rc,
               msg);
  /* not after --peer-cap-ttl (1 s) */
  grant(&ca, 10, cap);
  usleep(1300 * 1000);
  rc = pull(&cb, cap, 103, 6, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ECAPABILITY, "an expired one gave %d: %s", rc, msg);
  cr_assert(strstr(msg, "expired"), "%s", msg);
  /* what B holds: the one tensor that arrived */
  void *data;
  size_t nb;
  int nd;
  int64_t sh[8];
  cr_assert_eq(wire_read_tensor(&cb, 100, &data, &nb, &nd, sh), 0);
  cr_assert_eq(nb, sizeof x);
  cr_assert_eq(memcmp(data, x, nb), 0);
  free(data);
  cr_assert_eq(wire_read_tensor(&cb, 101, &data, &nb, &nd, sh),
               DISPATCH_ENOID);
  cr_assert_eq(server_tensors(g_b.port, NULL), 1);
  wire_close(&cb);
  wire_close(&ca);
  stop_clean();
}

Test(peer, quota_is_charged_before_a_byte, .fini = teardown) {
  make_dir();
  start_a(NULL);
  const char *b_args[] = {"--max-session-bytes", "1M", NULL};
  start_b(g_a.port, b_args);
  dispatch_device *a = open_dev(g_a.port, NULL);
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 1024, 1024, &x), *tb = NULL; /* 4 MiB */
  int rc = dispatch_to_device(ta, b, &tb);
  cr_assert_eq(rc, DISPATCH_EQUOTA, "over quota gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  cr_assert_null(tb);
  /* refused before B connected: A served nothing */
  cr_assert_not(a_log_has("peer fetch"), "A served a refused pull");
  cr_assert_eq(server_tensors(g_b.port, NULL), 0);
  free(x);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

Test(peer, source_cut_mid_transfer_leaves_nothing, .fini = teardown) {
  make_dir();
  start_a(NULL);
  /* B reaches A through the proxy, which cuts A's reply to the fetch
   * halfway through its bytes */
  fp_rule cut = {.conn = -1, .dir = FP_S2C, .at_byte = -1,
                 .body = DSPWIRE__REPLY__BODY_READ, .nth = 1, .pct = 50,
                 .action = FP_CUT};
  g_fp = fp_start(g_a.port, &cut, 1);
  cr_assert_not_null(g_fp);
  /* no free lists: the bytes of the dropped tensor go back at once */
  const char *b_args[] = {"--session-cache", "0", "--storage-cache", "0",
                          NULL};
  start_b(fp_port(g_fp), b_args);
  dispatch_device *a = open_dev(g_a.port, NULL);
  dispatch_device *b = open_dev(g_b.port, NULL);
  uint64_t held0;
  server_tensors(g_b.port, &held0);
  float *x;
  dispatch_tensor *ta = pattern(a, 1024, 1024, &x), *tb = NULL;
  int rc = dispatch_to_device(ta, b, &tb);
  cr_assert_eq(rc, DISPATCH_ECONN, "a cut transfer gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  cr_assert(strstr(dispatch_device_errmsg(b), "dropped"), "%s",
            dispatch_device_errmsg(b));
  cr_assert_eq(fp_fired(g_fp), 1, "the proxy did not cut");
  cr_assert_null(tb);
  /* no half-written tensor, and its 4 MiB given back (what stays is the
   * session's bookkeeping of the failed request: its kept error reply) */
  uint64_t held;
  cr_assert_eq(server_tensors(g_b.port, &held), 0);
  cr_assert_lt(held, held0 + (64u << 10), "B holds %llu bytes, %llu before",
               (unsigned long long)held, (unsigned long long)held0);
  /* B's session goes on */
  dispatch_tensor *z = NULL;
  int64_t shape[1] = {3};
  OK(b, dispatch_ones(b, DISPATCH_F32, 1, shape, &z));
  float out[3];
  OK(b, dispatch_tensor_read(z, out, sizeof out));
  cr_assert_eq(out[2], 1.0f);
  free(x);
  dispatch_tensor_free(z);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

/* deploy/make-certs.sh into g_dir/sub: CA, server and client certificates
 * and a token */
static void make_certs(const char *sub) {
  char b[1024], cmd[2048];
  snprintf(b, sizeof b, "%s", check_server_bin());
  char *root = dirname(dirname(b));
  snprintf(cmd, sizeof cmd, "'%s/deploy/make-certs.sh' '%s/%s' >/dev/null",
           root, g_dir, sub);
  cr_assert_eq(system(cmd), 0, "make-certs.sh failed: %s", cmd);
}

/* B over TLS to A with the given peer options; a move of a tensor of A
 * whose result is returned (0, or the code) */
static int tls_move(dispatch_device *a, dispatch_tensor *ta,
                    const char *const *b_args, dispatch_tensor **tb,
                    dispatch_device **b) {
  start_b(g_a.port, b_args);
  *b = open_dev(g_b.port, NULL);
  (void)a;
  return dispatch_to_device(ta, *b, tb);
}

Test(peer, mutual_tls_both_ways_verified, .fini = teardown) {
  make_dir();
  make_certs("c");
  make_certs("other"); /* a CA A's certificate is not signed by */
  const char *a_args[] = {"--tls-cert", path("c/server.pem"), "--tls-key",
                          path("c/server.key"), "--tls-client-ca",
                          path("c/ca.pem"), "--token-file", path("c/token"),
                          NULL};
  start_a(a_args);
  char spec[64], msg[256] = "", token[256] = "";
  FILE *f = fopen(path("c/token"), "r");
  cr_assert_not_null(f);
  cr_assert_not_null(fgets(token, sizeof token, f));
  fclose(f);
  token[strcspn(token, "\n")] = '\0';
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", g_a.port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = path("c/ca.pem");
  o.cert_file = path("c/client.pem");
  o.key_file = path("c/client.key");
  o.token = token;
  dispatch_device *a = NULL, *b = NULL;
  int rc = dispatch_device_open(spec, &o, &a, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s", spec, msg);
  float *x;
  dispatch_tensor *ta = pattern(a, 64, 129, &x), *tb = NULL;
  /* verified both ways: the bytes arrive */
  const char *good[] = {"--peer-ca", path("c/ca.pem"), "--peer-cert",
                        path("c/client.pem"), "--peer-key",
                        path("c/client.key"), "--peer-token-file",
                        path("c/token"), NULL};
  OK(b, tls_move(a, ta, good, &tb, &b));
  size_t nb = dispatch_tensor_nbytes(tb);
  float *y = malloc(nb);
  OK(b, dispatch_tensor_read(tb, y, nb));
  cr_assert_eq(memcmp(x, y, nb), 0);
  free(y);
  dispatch_tensor_free(tb);
  dispatch_device_close(b);
  cr_assert_eq(sp_stop(&g_b), 0, "B did not exit cleanly");
  /* no client certificate: A's mutual TLS refuses B */
  const char *no_cert[] = {"--peer-ca", path("c/ca.pem"), "--peer-token-file",
                           path("c/token"), NULL};
  tb = NULL;
  rc = tls_move(a, ta, no_cert, &tb, &b);
  cr_assert(rc == DISPATCH_ETLS || rc == DISPATCH_ECONN,
            "no client certificate gave %s: %s", dispatch_err_name(rc),
            dispatch_device_errmsg(b));
  cr_assert_null(tb);
  cr_assert_eq(server_tensors(g_b.port, NULL), 0);
  dispatch_device_close(b);
  cr_assert_eq(sp_stop(&g_b), 0, "B did not exit cleanly");
  /* B trusts another CA: it refuses A's certificate */
  const char *wrong_ca[] = {"--peer-ca", path("other/ca.pem"), "--peer-cert",
                            path("c/client.pem"), "--peer-key",
                            path("c/client.key"), "--peer-token-file",
                            path("c/token"), NULL};
  rc = tls_move(a, ta, wrong_ca, &tb, &b);
  cr_assert_eq(rc, DISPATCH_ETLS, "a wrong CA gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  cr_assert(strstr(dispatch_device_errmsg(b), "handshake"), "%s",
            dispatch_device_errmsg(b));
  cr_assert_null(tb);
  free(x);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

/* --peer-ca/--peer-cert/--peer-key are reread on SIGHUP as one set: a
 * CA file that does not parse is refused and the pulls go on with the
 * context in use; a CA that did not sign A's certificate is taken, and
 * the next pull refuses A. */
Test(peer, peer_tls_files_reread_on_sighup, .fini = teardown) {
  make_dir();
  make_certs("c");
  make_certs("other");
  char cp[512];
  snprintf(cp, sizeof cp, "cp '%s' '%s'", path("c/ca.pem"), path("peer-ca.pem"));
  cr_assert_eq(system(cp), 0);
  const char *a_args[] = {"--tls-cert", path("c/server.pem"), "--tls-key",
                          path("c/server.key"), "--tls-client-ca",
                          path("c/ca.pem"), NULL};
  start_a(a_args);
  static char peer[64];
  snprintf(peer, sizeof peer, "a=127.0.0.1:%d", g_a.port);
  const char *b_args[] = {"--log-level", "info", "--peer", peer,
                          "--peer-ca", path("peer-ca.pem"), "--peer-cert",
                          path("c/client.pem"), "--peer-key",
                          path("c/client.key"), NULL};
  int fd = open(path("b.log"), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  cr_assert_geq(fd, 0);
  int st = sp_start_logged(&g_b, b_args, fd);
  close(fd);
  cr_assert_eq(st, 0, "B did not start");
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", g_a.port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = path("c/ca.pem");
  o.cert_file = path("c/client.pem");
  o.key_file = path("c/client.key");
  dispatch_device *a = NULL;
  cr_assert_eq(dispatch_device_open(spec, &o, &a, msg, sizeof msg), 0, "%s",
               msg);
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 19, 23, &x);
  cr_assert_eq(move_check(ta, b, x), 0, "%s", dispatch_device_errmsg(b));
  put_file("peer-ca.pem", "not a certificate\n");
  hup(&g_b, "b.log", 1);
  cr_assert_eq(log_count("b.log", "refused the --peer-ca"), 1);
  cr_assert_eq(move_check(ta, b, x), 0, "after a refused CA file: %s",
               dispatch_device_errmsg(b));
  snprintf(cp, sizeof cp, "cp '%s' '%s'", path("other/ca.pem"),
           path("peer-ca.pem"));
  cr_assert_eq(system(cp), 0);
  hup(&g_b, "b.log", 2);
  cr_assert_eq(log_count("b.log", "peer TLS files reloaded"), 1);
  int rc = move_check(ta, b, x);
  cr_assert_eq(rc, DISPATCH_ETLS, "another CA gave %s: %s",
               dispatch_err_name(rc), dispatch_device_errmsg(b));
  free(x);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

/* A destination without --peer, or a source without --name, takes part
 * in no server-to-server transfer: the client copies the bytes itself, as
 * before protocol 1.7, and the move still works. */
Test(peer, without_peers_the_client_copies, .fini = teardown) {
  make_dir();
  start_a(NULL);
  start_b(0, NULL);
  dispatch_device *a = open_dev(g_a.port, NULL);
  dispatch_device *b = open_dev(g_b.port, NULL);
  float *x;
  dispatch_tensor *ta = pattern(a, 33, 65, &x), *tb = NULL;
  OK(b, dispatch_to_device(ta, b, &tb));
  size_t nb = dispatch_tensor_nbytes(tb);
  float *y = malloc(nb);
  OK(b, dispatch_tensor_read(tb, y, nb));
  cr_assert_eq(memcmp(x, y, nb), 0);
  cr_assert_not(a_log_has("peer fetch"), "B has no peers, yet A served one");
  /* and back: B has no --name, so it grants nothing (the first refusal) */
  dispatch_tensor *back = NULL;
  OK(a, dispatch_to_device(tb, a, &back));
  memset(y, 0, nb);
  OK(a, dispatch_tensor_read(back, y, nb));
  cr_assert_eq(memcmp(x, y, nb), 0);
  dispatch_tensor_free(back);
  free(x);
  free(y);
  dispatch_tensor_free(tb);
  dispatch_tensor_free(ta);
  dispatch_device_close(b);
  dispatch_device_close(a);
  stop_clean();
}

typedef struct slow_pull {
  dispatch_device *b;
  dispatch_tensor *src, *out;
  int rc;
  atomic_int done;
} slow_pull;

static void *run_pull(void *arg) {
  slow_pull *p = arg;
  p->rc = dispatch_to_device(p->src, p->b, &p->out);
  atomic_store(&p->done, 1);
  return NULL;
}

Test(peer, a_pull_leaves_the_loop_serving, .fini = teardown) {
  make_dir();
  start_a(NULL);
  /* A's bytes stop halfway for 3 s (well within --peer-timeout) */
  fp_rule slow = {.conn = -1, .dir = FP_S2C, .at_byte = -1,
                  .body = DSPWIRE__REPLY__BODY_READ, .nth = 1, .pct = 50,
                  .action = FP_DELAY, .arg = 3000};
  g_fp = fp_start(g_a.port, &slow, 1);
  cr_assert_not_null(g_fp);
  const char *b_args[] = {"--threads", "1", NULL};
  start_b(fp_port(g_fp), b_args);
  dispatch_device *a = open_dev(g_a.port, NULL);
  slow_pull p = {.b = open_dev(g_b.port, NULL)};
  float *x;
  p.src = pattern(a, 1024, 1024, &x);
  OK(a, dispatch_device_sync(a));
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, run_pull, &p), 0);
  /* the pull is held halfway once the proxy's delay has fired */
  while (fp_fired(g_fp) == 0 && !atomic_load(&p.done)) usleep(1000);
  /* another session of B: its hello, upload and read need only the loop */
  dispatch_device *c = open_dev(g_b.port, NULL);
  float v[4] = {1, 2, 3, 4}, w[4];
  int64_t shape[1] = {4};
  dispatch_tensor *t = NULL;
  OK(c, dispatch_tensor_from_data(c, DISPATCH_F32, 1, shape, v, sizeof v, &t));
  OK(c, dispatch_tensor_read(t, w, sizeof w));
  int served_during_pull = !atomic_load(&p.done);
  cr_assert_eq(memcmp(v, w, sizeof v), 0);
  pthread_join(th, NULL);
  cr_assert_eq(p.rc, 0, "the throttled pull: %s: %s", dispatch_err_name(p.rc),
               dispatch_device_errmsg(p.b));
  cr_assert(served_during_pull,
            "the other session was answered only after the pull ended");
  float *y = malloc(4u << 20);
  OK(p.b, dispatch_tensor_read(p.out, y, 4u << 20));
  cr_assert_eq(memcmp(x, y, 4u << 20), 0);
  free(y);
  free(x);
  dispatch_tensor_free(t);
  dispatch_tensor_free(p.out);
  dispatch_tensor_free(p.src);
  dispatch_device_close(c);
  dispatch_device_close(p.b);
  dispatch_device_close(a);
  stop_clean();
}

/* The peer options are checked at start: each bad one stops the server
 * with a line naming it (exit status 2 for a bad command line, 1 for a
 * file it cannot use). */
Test(peer, bad_peer_options_stop_the_server) {
  check_server_bin();
  static const struct {
    const char *args[6];
    const char *says;
  } cases[] = {
      {{"--peer", "noequals:7070"}, "is not NAME=HOST:PORT"},
      {{"--peer", "=127.0.0.1:7070"}, "is not NAME=HOST:PORT"},
      {{"--peer", "a=127.0.0.1"}, "is not HOST:PORT"},
      {{"--peer", "a=127.0.0.1:1", "--peer", "a=127.0.0.1:2"},
       "'a' is named twice"},
      {{"--peer-cert", "c.pem"}, "--peer-cert and --peer-key go together"},
      {{"--peer-cert", "c.pem", "--peer-key", "c.key"},
       "--peer-cert needs --peer-ca"},
      {{"--name", "a:b"}, "--name: 'a:b' must be"},
      {{"--peer-cap-ttl", "0"}, "--peer-cap-ttl: '0' is out of range"},
      {{"--peer-token-file", "/nonexistent/tok"}, "--peer-token-file"},
      /* read at start (not only at the first pull): it stops the server */
      {{"--peer-ca", "/nonexistent/ca.pem"},
       "loading --peer-ca /nonexistent/ca.pem failed"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *argv[8];
    int n = 0;
    for (int k = 0; k < 6 && cases[i].args[k]; k++) argv[n++] = cases[i].args[k];
    argv[n] = NULL;
    char out[2048];
    int st = sp_run_capture(argv, out, sizeof out);
    cr_assert_neq(st, 0, "case %zu started: %s", i, out);
    cr_assert(strstr(out, cases[i].says), "case %zu: want '%s' in: %s", i,
              cases[i].says, out);
  }
}
