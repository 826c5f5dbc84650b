/* SIGHUP on a running dispatch-server, on 127.0.0.1 only: a rotated TLS
 * certificate (made by deploy/make-certs.sh in temp dirs) serves new
 * handshakes while a client connected before goes on, and so does a
 * rotated client CA (mutual TLS); a rotated token is
 * required of new connections while a connected session goes on and a
 * detached one resumes with the new token only; a bad new file (key not
 * matching, not PEM, missing, empty token) is refused with a log line
 * and the old one kept. Each reload is waited for by its "done" log line
 * (a bounded wait: the signal is handled on the server's loop). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static char g_dir[64], g_ca1[64], g_ca2[64]; /* work dir, two CAs' dirs */

static void rm_dir(char *dir) {
  if (!*dir) return;
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  cr_expect_eq(system(cmd), 0);
  *dir = '\0';
}

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  rm_dir(g_dir);
  rm_dir(g_ca1);
  rm_dir(g_ca2);
}

static const char *path(const char *dir, const char *file) {
  static char bufs[8][256];
  static int i;
  char *p = bufs[i++ % 8];
  snprintf(p, 256, "%s/%s", dir, file);
  return p;
}

static void new_dir(char *dir, size_t len) {
  snprintf(dir, len, "/tmp/dsp-reload-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

/* A CA with its server certificate (localhost) in a new temp dir. */
static void make_certs(char *dir, size_t len) {
  char b[1024];
  snprintf(b, sizeof b, "%s", check_server_bin());
  char *root = dirname(dirname(b));
  new_dir(dir, len);
  char cmd[2048];
  snprintf(cmd, sizeof cmd,
           "'%s/deploy/make-certs.sh' '%s' localhost 30 >/dev/null", root,
           dir);
  cr_assert_eq(system(cmd), 0, "make-certs.sh failed: %s", cmd);
}

static void write_file(const char *p, const char *text) {
  FILE *f = fopen(p, "w");
  cr_assert_not_null(f, "%s", p);
  fputs(text, f);
  cr_assert_eq(fclose(f), 0);
}

/* Copies src over dst (a rotation: a new file where the server reads). */
static void copy_file(const char *src, const char *dst) {
  char cmd[600];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", src, dst);
  cr_assert_eq(system(cmd), 0, "%s", cmd);
}

/* Starts the server with its stderr (the log, at info) in g_dir/log. */
static void start_logged(const char *const *more) {
  const char *args[24] = {"--log-level", "info", "--threads", "2"};
  int n = 4;
  for (int i = 0; more && more[i]; i++) args[n++] = more[i];
  args[n] = NULL;
  int fd = open(path(g_dir, "log"), O_CREAT | O_WRONLY | O_TRUNC, 0600);
  cr_assert(fd >= 0);
  int rc = sp_start_logged(&g_srv, args, fd);
  close(fd);
  cr_assert_eq(rc, 0, "server did not start");
}

/* The whole log so far (malloc'd). */
static char *read_log(void) {
  FILE *f = fopen(path(g_dir, "log"), "r");
  cr_assert_not_null(f);
  size_t cap = 1 << 16, len = 0;
  char *buf = malloc(cap);
  cr_assert_not_null(buf);
  size_t n;
  while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += n;
    if (len + 1 == cap) {
      buf = realloc(buf, cap *= 2);
      cr_assert_not_null(buf);
    }
  }
  buf[len] = '\0';
  fclose(f);
  return buf;
}

static int count(const char *text, const char *needle) {
  int n = 0;
  for (const char *p = strstr(text, needle); p; p = strstr(p + 1, needle))
    n++;
  return n;
}

/* Waits (bounded) until the log holds needle n times; returns the log
 * (malloc'd). */
static char *wait_log(const char *needle, int n) {
  char *log = read_log();
  for (int i = 0; i < 3000 && count(log, needle) < n; i++) {
    free(log);
    struct timespec ts = {0, 20 * 1000 * 1000};
    nanosleep(&ts, NULL);
    log = read_log();
  }
  cr_assert_eq(count(log, needle), n, "'%s' %d times? the log:\n%s", needle,
               n, log);
  return log;
}

/* Sends SIGHUP and waits for the reload's last line, the n-th of the
 * server's life; returns the log (malloc'd). */
static char *hup(int n) {
  cr_assert_eq(sp_signal(&g_srv, SIGHUP), 0);
  return wait_log("reload (SIGHUP): done:", n);
}

/* Asserts a clean exit, quoting the log when not. */
static void stop_checked(void) {
  int st = sp_stop(&g_srv);
  if (st == 0) return;
  char *log = read_log();
  cr_assert_eq(st, 0, "server exit status %d; its log:\n%s", st, log);
  free(log);
}

/* Opens scheme://127.0.0.1:PORT with o (its timeout and no_resume set
 * here: a refusal must not be retried). */
static int open_with(const char *scheme, dispatch_options *o,
                     dispatch_device **d, char *msg, size_t len) {
  char spec[64];
  snprintf(spec, sizeof spec, "%s://127.0.0.1:%d", scheme, g_srv.port);
  o->timeout_ms = 60000;
  o->no_resume = 1;
  *d = NULL;
  *msg = '\0';
  return dispatch_device_open(spec, o, d, msg, len);
}

static int open_dev(const char *scheme, const char *ca, const char *token,
                    dispatch_device **d, char *msg, size_t len) {
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = ca;
  o.token = token;
  return open_with(scheme, &o, d, msg, len);
}

/* TLS verifying the server against ca, with the client certificate
 * make-certs.sh made in dir (mutual TLS). */
static int open_mtls(const char *ca, const char *dir, dispatch_device **d,
                     char *msg, size_t len) {
  char cert[256], key[256];
  snprintf(cert, sizeof cert, "%s", path(dir, "client.pem"));
  snprintf(key, sizeof key, "%s", path(dir, "client.key"));
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = ca;
  o.cert_file = cert;
  o.key_file = key;
  return open_with("tls", &o, d, msg, len);
}

static const float k_x[4] = {1, 2, 3, 4};

/* Uploads k_x on d. */
static dispatch_tensor *upload(dispatch_device *d) {
  int64_t shape[1] = {4};
  dispatch_tensor *t;
  OK(d, dispatch_tensor_from_data(d, DISPATCH_F32, 1, shape, k_x, sizeof k_x,
                                  &t));
  return t;
}

/* x + x read back: the session (made before a reload) still runs ops. */
static void still_works(dispatch_device *d, dispatch_tensor *x) {
  dispatch_tensor *y;
  float got[4];
  OK(d, dispatch_add(x, x, &y));
  OK(d, dispatch_tensor_read(y, got, sizeof got));
  for (int i = 0; i < 4; i++) cr_assert_eq(got[i], 2 * k_x[i], "[%d]", i);
  dispatch_tensor_free(y);
}

/* The server starts on ca1's certificate, copied into g_dir; ca2's is
 * then copied over it and SIGHUP sent: a client verifying against ca2
 * connects, one verifying against ca1 is refused, and the client that
 * connected before goes on over its TLS session. */
Test(reload, tls_certificate_rotates_for_new_handshakes, .fini = cleanup,
     .timeout = 120) {
  make_certs(g_ca1, sizeof g_ca1);
  make_certs(g_ca2, sizeof g_ca2);
  new_dir(g_dir, sizeof g_dir);
  copy_file(path(g_ca1, "server.pem"), path(g_dir, "server.pem"));
  copy_file(path(g_ca1, "server.key"), path(g_dir, "server.key"));
  const char *args[] = {"--tls-cert", path(g_dir, "server.pem"), "--tls-key",
                        path(g_dir, "server.key"), NULL};
  start_logged(args);
  char msg[512];
  dispatch_device *before, *after, *stale;
  int rc = open_dev("tls", path(g_ca1, "ca.pem"), NULL, &before, msg,
                    sizeof msg);
  cr_assert_eq(rc, 0, "first client: %s: %s", dispatch_err_name(rc), msg);
  dispatch_tensor *x = upload(before);
  /* before the rotation a client of ca2 is refused: the check below is
   * not one that passes anyway */
  rc = open_dev("tls", path(g_ca2, "ca.pem"), NULL, &stale, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "ca2 before the rotation: %s: %s",
               dispatch_err_name(rc), msg);

  copy_file(path(g_ca2, "server.pem"), path(g_dir, "server.pem"));
  copy_file(path(g_ca2, "server.key"), path(g_dir, "server.key"));
  char *log = hup(1);
  cr_assert(strstr(log, "reload (SIGHUP): TLS certificate and key reloaded"),
            "%s", log);
  cr_assert(strstr(log, "done: 1 reloaded, 0 refused"), "%s", log);
  free(log);

  rc = open_dev("tls", path(g_ca2, "ca.pem"), NULL, &after, msg, sizeof msg);
  cr_assert_eq(rc, 0, "ca2 after the rotation: %s: %s", dispatch_err_name(rc),
               msg);
  dispatch_tensor *x2 = upload(after);
  still_works(after, x2);
  rc = open_dev("tls", path(g_ca1, "ca.pem"), NULL, &stale, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "ca1 after the rotation: %s: %s",
               dispatch_err_name(rc), msg);
  still_works(before, x); /* the old TLS session goes on */
  dispatch_tensor_free(x2);
  dispatch_tensor_free(x);
  dispatch_device_close(after);
  dispatch_device_close(before);
  stop_checked();
}

/* Mutual TLS: the --tls-client-ca file is replaced by another CA and
 * SIGHUP sent: a client certificate of the new CA passes, one of the old
 * CA is refused, and the client connected with the old one goes on. */
Test(reload, client_ca_rotates_for_new_handshakes, .fini = cleanup,
     .timeout = 120) {
  make_certs(g_ca1, sizeof g_ca1);
  make_certs(g_ca2, sizeof g_ca2);
  new_dir(g_dir, sizeof g_dir);
  char client_ca[256], server_ca[256];
  snprintf(client_ca, sizeof client_ca, "%s", path(g_dir, "client-ca.pem"));
  snprintf(server_ca, sizeof server_ca, "%s", path(g_ca1, "ca.pem"));
  copy_file(path(g_ca1, "ca.pem"), client_ca);
  const char *args[] = {"--tls-cert",      path(g_ca1, "server.pem"),
                        "--tls-key",       path(g_ca1, "server.key"),
                        "--tls-client-ca", client_ca,
                        NULL};
  start_logged(args);
  char msg[512];
  dispatch_device *before, *d;
  int rc = open_mtls(server_ca, g_ca1, &before, msg, sizeof msg);
  cr_assert_eq(rc, 0, "ca1's client: %s: %s", dispatch_err_name(rc), msg);
  dispatch_tensor *x = upload(before);
  rc = open_mtls(server_ca, g_ca2, &d, msg, sizeof msg);
  cr_assert_neq(rc, 0, "ca2's client before the rotation passed");

  copy_file(path(g_ca2, "ca.pem"), client_ca);
  char *log = hup(1);
  cr_assert(strstr(log, "--tls-client-ca"), "%s", log);
  cr_assert(strstr(log, "done: 1 reloaded, 0 refused"), "%s", log);
  free(log);
  rc = open_mtls(server_ca, g_ca2, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "ca2's client after the rotation: %s: %s",
               dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  rc = open_mtls(server_ca, g_ca1, &d, msg, sizeof msg);
  cr_assert_neq(rc, 0, "ca1's client after the rotation passed");
  still_works(before, x);
  dispatch_tensor_free(x);
  dispatch_device_close(before);
  stop_checked();
}

/* A key that does not match the certificate, a certificate that is not
 * PEM, a missing key: each SIGHUP is refused, says why, and the server
 * goes on serving the certificate it had. */
Test(reload, bad_tls_files_are_refused_and_the_old_kept, .fini = cleanup,
     .timeout = 120) {
  make_certs(g_ca1, sizeof g_ca1);
  make_certs(g_ca2, sizeof g_ca2);
  new_dir(g_dir, sizeof g_dir);
  char pem[256], key[256], ca1[256]; /* path() reuses its buffers */
  snprintf(pem, sizeof pem, "%s", path(g_dir, "server.pem"));
  snprintf(key, sizeof key, "%s", path(g_dir, "server.key"));
  snprintf(ca1, sizeof ca1, "%s", path(g_ca1, "ca.pem"));
  copy_file(path(g_ca1, "server.pem"), pem);
  copy_file(path(g_ca1, "server.key"), key);
  const char *args[] = {"--tls-cert", pem, "--tls-key", key, NULL};
  start_logged(args);
  char msg[512];
  dispatch_device *d;

  copy_file(path(g_ca2, "server.key"), key); /* ca1's cert, ca2's key */
  char *log = hup(1);
  /* OpenSSL 3 finds the mismatch as it loads the key */
  cr_assert(strstr(log, "reload (SIGHUP): refused the TLS files: cannot "
                        "load the private key"),
            "%s", log);
  cr_assert(strstr(log, "mismatch"), "%s", log);
  cr_assert(strstr(log, "done: 0 reloaded, 1 refused"), "%s", log);
  free(log);
  int rc = open_dev("tls", ca1, NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "old certificate after a refused key: %s: %s",
               dispatch_err_name(rc), msg);
  dispatch_device_close(d);

  copy_file(path(g_ca1, "server.key"), key);
  write_file(pem, "not a certificate\n");
  log = hup(2);
  cr_assert(strstr(log, "refused the TLS files: cannot load the "
                        "certificate chain"),
            "%s", log);
  free(log);

  copy_file(path(g_ca1, "server.pem"), pem);
  cr_assert_eq(unlink(key), 0);
  log = hup(3);
  cr_assert(strstr(log, "refused the TLS files: cannot load the private key"),
            "%s", log);
  cr_assert_eq(count(log, "done: 0 reloaded, 1 refused"), 3, "%s", log);
  free(log);
  rc = open_dev("tls", ca1, NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "old certificate after three refusals: %s: %s",
               dispatch_err_name(rc), msg);
  dispatch_tensor *x = upload(d);
  still_works(d, x);
  dispatch_tensor_free(x);
  dispatch_device_close(d);
  stop_checked();
}

/* A raw hello asking for a resumable session, or resuming *rt (len
 * bytes); the reply's code (0: accepted), with a new session's resume
 * token into rt and whether it resumed. */
static int raw_hello(wire_conn *c, const char *token, uint8_t *rt,
                     size_t *rt_len, int *resumed) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, token, "reload");
  w.body.hello.resume = 1;
  if (*rt_len) {
    w.body.hello.resume_token.data = rt;
    w.body.hello.resume_token.len = *rt_len;
  }
  r->req_id = ++c->next_req_id;
  cr_assert_eq(wire_send(c, r, NULL, 0), 0);
  Dspwire__Reply *rep;
  cr_assert_eq(wire_recv(c, &rep, NULL, NULL), 0, "no hello reply");
  int code = rep->error ? rep->error->code : 0;
  if (!code) {
    cr_assert_not_null(rep->hello);
    if (!*rt_len) {
      cr_assert_leq(rep->hello->resume_token.len, 64);
      memcpy(rt, rep->hello->resume_token.data, rep->hello->resume_token.len);
      *rt_len = rep->hello->resume_token.len;
    }
    *resumed = rep->hello->resumed;
  }
  wire_reply_free(rep, NULL);
  return code;
}

/* The token file gets a new token and SIGHUP: new connections need it
 * (the old one is refused), a connected session goes on, and a session
 * detached before the rotation resumes with the new token only. An empty
 * token file is then refused and the new token stays. */
Test(reload, token_rotates_for_new_connections, .fini = cleanup,
     .timeout = 120) {
  new_dir(g_dir, sizeof g_dir);
  char tf[256]; /* path() reuses its buffers */
  snprintf(tf, sizeof tf, "%s", path(g_dir, "token"));
  write_file(tf, "old-token\n");
  const char *args[] = {"--token-file", tf, "--session-grace", "600", NULL};
  start_logged(args);
  char msg[512];
  dispatch_device *kept, *d;
  int rc = open_dev("tcp", NULL, "old-token", &kept, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  dispatch_tensor *x = upload(kept);
  /* a resumable raw session, dropped before the rotation */
  wire_conn raw;
  uint8_t rt[64];
  size_t rt_len = 0;
  int resumed = 0;
  cr_assert_eq(raw_hello(&raw, "old-token", rt, &rt_len, &resumed), 0);
  cr_assert_gt(rt_len, 0, "no resume token");
  wire_close(&raw);

  write_file(tf, "new-token\n");
  char *log = hup(1);
  cr_assert(strstr(log, "reload (SIGHUP): token reloaded from --token-file"),
            "%s", log);
  free(log);
  rc = open_dev("tcp", NULL, "old-token", &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EAUTH, "old token after the rotation: %s: %s",
               dispatch_err_name(rc), msg);
  rc = open_dev("tcp", NULL, "new-token", &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "new token: %s: %s", dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  still_works(kept, x); /* authenticated once, at its hello */

  /* the detached session: the old token is refused at the hello, the
   * new one resumes it */
  cr_assert_eq(raw_hello(&raw, "old-token", rt, &rt_len, &resumed),
               DISPATCH_EAUTH);
  wire_close(&raw);
  cr_assert_eq(raw_hello(&raw, "new-token", rt, &rt_len, &resumed), 0,
               "resume with the new token refused");
  cr_assert_eq(resumed, 1, "a new session instead of the resumed one");
  wire_bye(&raw);
  wire_close(&raw);

  write_file(tf, "\n");
  log = hup(2);
  cr_assert(strstr(log, "reload (SIGHUP): refused --token-file: "), "%s", log);
  cr_assert(strstr(log, "is empty; the token in use stays"), "%s", log);
  free(log);
  rc = open_dev("tcp", NULL, "new-token", &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "new token after a refused reload: %s: %s",
               dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  rc = open_dev("tcp", NULL, "", &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EAUTH, "no token: %s", dispatch_err_name(rc));
  dispatch_tensor_free(x);
  dispatch_device_close(kept);
  stop_checked();
}

/* Without anything to reload, SIGHUP is logged and the server goes on
 * (its default action would end the process). */
Test(reload, sighup_without_files_keeps_serving, .fini = cleanup,
     .timeout = 60) {
  new_dir(g_dir, sizeof g_dir);
  start_logged(NULL);
  cr_assert_eq(sp_signal(&g_srv, SIGHUP), 0);
  free(wait_log("reload (SIGHUP): nothing to reload", 1));
  char msg[512];
  dispatch_device *d;
  int rc = open_dev("tcp", NULL, NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  stop_checked();
}
