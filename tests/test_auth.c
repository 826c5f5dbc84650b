/* Authentication and safe defaults of dispatch-server, on 127.0.0.1 only:
 * --token-file (right, wrong, missing, other lengths, env DISPATCH_TOKEN,
 * together with TLS), the refusal being logged with the peer address and
 * counted in protocol_errors, and the refusal to listen on a non-loopback
 * address without TLS and a token (checked before anything binds: the
 * server exits without printing its listening line). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <libgen.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static char g_dir[64];

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  if (*g_dir) {
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_expect_eq(system(cmd), 0);
  }
}

static const char *path(const char *file) {
  static char bufs[8][256];
  static int i;
  char *p = bufs[i++ % 8];
  snprintf(p, 256, "%s/%s", g_dir, file);
  return p;
}

static void need_bin(void) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin) cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
  snprintf(g_dir, sizeof g_dir, "/tmp/dsp-auth-XXXXXX");
  cr_assert_not_null(mkdtemp(g_dir));
}

static void write_file(const char *p, const char *text) {
  FILE *f = fopen(p, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  cr_assert_eq(fclose(f), 0);
}

/* Starts the server with its stderr (the log) going to g_dir/server.log. */
static void start_logged(const char *const *args) {
  int fd = open(path("server.log"), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  cr_assert(fd >= 0);
  int rc = sp_start_logged(&g_srv, args, fd);
  close(fd);
  cr_assert_eq(rc, 0, "server did not start");
}

/* The log so far; the server writes it line by line, so one sync round
 * trip after the event guarantees the line is there. */
static void read_log(char *buf, size_t len) {
  FILE *f = fopen(path("server.log"), "r");
  cr_assert_not_null(f);
  size_t n = fread(buf, 1, len - 1, f);
  buf[n] = '\0';
  fclose(f);
}

/* Stops the server and asserts a clean exit, quoting its log when not:
 * a sanitizer report or a crash at shutdown shows up there. */
static void stop_checked(void) {
  int st = sp_stop(&g_srv);
  if (st == 0) return;
  char log[16384];
  read_log(log, sizeof log);
  cr_assert_eq(st, 0, "server exit status %d; its log:\n%s", st, log);
}

static int open_tcp(const char *token, dispatch_device **d, char *msg,
                    size_t len) {
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.token = token;
  o.timeout_ms = 60000;
  *d = NULL;
  *msg = '\0';
  return dispatch_device_open(spec, &o, d, msg, len);
}

static uint64_t protocol_errors(const char *token) {
  dispatch_device *d;
  char msg[256];
  cr_assert_eq(open_tcp(token, &d, msg, sizeof msg), 0, "%s", msg);
  dispatch_device_close(d);
  /* a raw session reads the server-wide counter */
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_hello(&w, 1, 0, token, NULL);
  req->req_id = 1;
  cr_assert_eq(wire_send(&c, req, NULL, 0), 0);
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
  cr_assert_null(r->error);
  wire_reply_free(r, bulk);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  wire_close(&c);
  return st.protocol_errors;
}

static void start_with_token(void) {
  need_bin();
  write_file(path("token"), "s3cret-token\n");
  const char *args[] = {"--log-level", "info", "--token-file", path("token"),
                        NULL};
  start_logged(args);
}

Test(auth, right_token_is_accepted, .fini = cleanup) {
  start_with_token();
  dispatch_device *d;
  char msg[256];
  int rc = open_tcp("s3cret-token", &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_eq(dispatch_device_sync(d), 0);
  dispatch_device_close(d);
  setenv("DISPATCH_TOKEN", "s3cret-token", 1); /* the env fallback */
  rc = open_tcp(NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  cr_assert_eq(protocol_errors("s3cret-token"), 0);
  stop_checked();
}

Test(auth, wrong_token_is_refused_logged_and_counted, .fini = cleanup) {
  start_with_token();
  const char *bad[] = {"s3cret-tokeN", "s3cret-toke", "s3cret-token2",
                       "s3cret-token\n"};
  for (int i = 0; i < 4; i++) {
    dispatch_device *d;
    char msg[256];
    int rc = open_tcp(bad[i], &d, msg, sizeof msg);
    cr_assert_eq(rc, DISPATCH_EAUTH, "token %d: %s: %s", i,
                 dispatch_err_name(rc), msg);
    cr_assert_null(d);
    cr_assert(strstr(msg, "wrong token"), "%s", msg);
  }
  cr_assert_eq(protocol_errors("s3cret-token"), 4);
  char log[16384];
  read_log(log, sizeof log);
  const char *p = strstr(log, "refused: wrong token");
  cr_assert_not_null(p, "log: %s", log);
  /* the line names the peer: "conn N (127.0.0.1:PORT): refused: ..." */
  const char *line = p;
  while (line > log && line[-1] != '\n') line--;
  cr_assert(strstr(line, "(127.0.0.1:") && strstr(line, "(127.0.0.1:") < p,
            "line: %.200s", line);
  stop_checked();
}

Test(auth, missing_token_is_refused_and_logged, .fini = cleanup) {
  start_with_token();
  unsetenv("DISPATCH_TOKEN");
  dispatch_device *d;
  char msg[256];
  int rc = open_tcp(NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EAUTH, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "requires a token"), "%s", msg);
  /* the raw protocol: one Error frame, then the close */
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  uint64_t rid = wire_hello_send(&c, 1, 0, "raw");
  Dspwire__Reply *r;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
  cr_assert_eq(r->req_id, rid);
  cr_assert_not_null(r->error);
  cr_assert_eq(r->error->code, DISPATCH_EAUTH);
  wire_reply_free(r, bulk);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
  cr_assert_eq(protocol_errors("s3cret-token"), 2);
  char log[16384];
  read_log(log, sizeof log);
  cr_assert(strstr(log, "(127.0.0.1:"), "%s", log);
  cr_assert(strstr(log, "refused: no token"), "%s", log);
  stop_checked();
}

Test(auth, empty_or_missing_token_file_refuses_to_start, .fini = cleanup) {
  need_bin();
  write_file(path("empty"), "\n");
  const char *a1[] = {"--token-file", path("empty"), NULL};
  cr_assert_neq(sp_start(&g_srv, a1), 0);
  const char *a2[] = {"--token-file", path("nonexistent"), NULL};
  cr_assert_neq(sp_start(&g_srv, a2), 0);
}

Test(auth, token_and_tls_together, .fini = cleanup) {
  need_bin();
  char b[1024], cmd[2048];
  snprintf(b, sizeof b, "%s", getenv("DISPATCH_SERVER_BIN"));
  snprintf(cmd, sizeof cmd, "'%s/deploy/make-certs.sh' '%s' >/dev/null",
           dirname(dirname(b)), g_dir);
  cr_assert_eq(system(cmd), 0);
  write_file(path("token"), "tok\n");
  const char *args[] = {"--log-level", "warn", "--token-file", path("token"),
                        "--tls-cert", path("server.pem"), "--tls-key",
                        path("server.key"), NULL};
  start_logged(args);
  char spec[64], msg[512];
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", g_srv.port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = path("ca.pem");
  o.token = "wrong";
  o.timeout_ms = 60000;
  dispatch_device *d = NULL;
  int rc = dispatch_device_open(spec, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EAUTH, "%s: %s", dispatch_err_name(rc), msg);
  o.token = "tok";
  rc = dispatch_device_open(spec, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_eq(dispatch_device_sync(d), 0);
  dispatch_device_close(d);
  stop_checked();
}

Test(auth, non_loopback_bind_is_refused_before_binding, .fini = cleanup) {
  need_bin();
  char out[4096];
  const char *a1[] = {"--listen", "0.0.0.0:0", NULL};
  int st = sp_run_capture(a1, out, sizeof out);
  cr_assert_eq(st, 2, "exit status %d, output: %s", st, out);
  cr_assert_null(strstr(out, "listening"), "it must not bind: %s", out);
  cr_assert(strstr(out, "--insecure"), "%s", out);
  cr_assert(strstr(out, "TLS") && strstr(out, "token"), "%s", out);
  /* a token alone is not enough, nor TLS alone */
  write_file(path("token"), "t\n");
  const char *a2[] = {"--listen", "0.0.0.0:0", "--token-file", path("token"),
                      NULL};
  st = sp_run_capture(a2, out, sizeof out);
  cr_assert_eq(st, 2, "%s", out);
  cr_assert_null(strstr(out, "listening"), "%s", out);
  const char *a3[] = {"--listen", "[::]:0", "--tls-cert", "/nonexistent",
                      "--tls-key", "/nonexistent", NULL};
  st = sp_run_capture(a3, out, sizeof out);
  cr_assert_eq(st, 2, "%s", out);
  cr_assert(strstr(out, "refusing to listen on ::"), "%s", out);
  /* the default is loopback */
  const char *a4[] = {"--help", NULL};
  st = sp_run_capture(a4, out, sizeof out);
  cr_assert_eq(st, 0);
  cr_assert(strstr(out, "default 127.0.0.1:7070"), "%s", out);
}
