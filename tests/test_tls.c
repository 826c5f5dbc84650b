/* TLS between libdispatch-client and dispatch-server, on 127.0.0.1 only,
 * with certificates made per test by deploy/make-certs.sh in a temp dir:
 * a round trip equal to plain TCP, a plain client on a TLS port, a wrong
 * CA, a wrong host name, mutual TLS with and without a client
 * certificate, expired certificates. Needs DISPATCH_SERVER_BIN (its
 * directory's parent is the repository root holding deploy/). */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv, g_plain;
static char g_dir[64], g_dir2[64];

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  if (g_plain.pid) sp_stop(&g_plain);
  char cmd[256];
  if (*g_dir) {
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    cr_expect_eq(system(cmd), 0);
  }
  if (*g_dir2) {
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir2);
    cr_expect_eq(system(cmd), 0);
  }
}

/* Makes a CA, server and client certificates into a new temp dir. */
static void make_certs(char *dir, size_t len, const char *name, int days) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin) cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
  char b[1024];
  snprintf(b, sizeof b, "%s", bin);
  char *root = dirname(dirname(b));
  snprintf(dir, len, "/tmp/dsp-tls-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  char cmd[2048];
  snprintf(cmd, sizeof cmd, "'%s/deploy/make-certs.sh' '%s' '%s' %d >/dev/null",
           root, dir, name, days);
  cr_assert_eq(system(cmd), 0, "make-certs.sh failed: %s", cmd);
}

static const char *path(const char *dir, const char *file) {
  static char bufs[8][256];
  static int i;
  char *p = bufs[i++ % 8];
  snprintf(p, 256, "%s/%s", dir, file);
  return p;
}

/* Starts a TLS server from g_dir's server certificate; extra arguments
 * (may be NULL) follow. */
static void start_tls(sp_server *s, const char *dir, const char *const *more) {
  const char *args[24] = {"--log-level", "warn", "--tls-cert",
                          path(dir, "server.pem"), "--tls-key",
                          path(dir, "server.key")};
  int n = 6;
  for (int i = 0; more && more[i]; i++) args[n++] = more[i];
  args[n] = NULL;
  cr_assert_eq(sp_start(s, args), 0, "TLS server did not start");
}

static int open_tls(int port, const dispatch_options *o, dispatch_device **d,
                    char *msg, size_t len) {
  char spec[64];
  snprintf(spec, sizeof spec, "tls://127.0.0.1:%d", port);
  *msg = '\0';
  return dispatch_device_open(spec, o, d, msg, len);
}

static dispatch_options ca_opts(const char *dir) {
  dispatch_options o;
  dispatch_options_init(&o);
  o.ca_file = path(dir, "ca.pem");
  o.timeout_ms = 60000;
  return o;
}


#define N 192 /* a 192x192 f32 matrix: 144 KiB, over the client's inline
                 bulk size and many TLS records */

/* upload, matmul, tanh, sum -> backward -> grad; reads y and dL/dA. */
static void program(dispatch_device *dev, float *y, float *ga) {
  static float a[N * N], b[N * N];
  for (int i = 0; i < N * N; i++) {
    a[i] = (float)((i * 37) % 101) / 101.0f - 0.5f;
    b[i] = (float)((i * 53) % 97) / 97.0f - 0.5f;
  }
  int64_t shape[2] = {N, N};
  dispatch_tensor *ta, *tb, *wa, *m, *t, *loss;
  dispatch_grads *g;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, a, sizeof a,
                                    &ta));
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 2, shape, b, sizeof b,
                                    &tb));
  OK(dev, dispatch_autodiff(ta, &wa));
  OK(dev, dispatch_matmul(wa, tb, &m));
  OK(dev, dispatch_tanh(m, &t));
  OK(dev, dispatch_sum(t, 0, NULL, 0, &loss));
  OK(dev, dispatch_backward(loss, &g));
  dispatch_tensor *gr;
  OK(dev, dispatch_grad(g, wa, &gr));
  OK(dev, dispatch_tensor_read(t, y, sizeof(float) * N * N));
  OK(dev, dispatch_tensor_read(gr, ga, sizeof(float) * N * N));
  dispatch_tensor_free(gr);
  dispatch_grads_free(g);
  dispatch_tensor_free(loss);
  dispatch_tensor_free(t);
  dispatch_tensor_free(m);
  dispatch_tensor_free(wa);
  dispatch_tensor_free(ta);
  dispatch_tensor_free(tb);
}

Test(tls, round_trip_equals_plain_tcp, .fini = cleanup, .timeout = 120) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  start_tls(&g_srv, g_dir, NULL);
  const char *args[] = {"--log-level", "warn", NULL};
  cr_assert_eq(sp_start(&g_plain, args), 0);
  static float y1[N * N], g1[N * N], y2[N * N], g2[N * N];
  dispatch_options o = ca_opts(g_dir);
  char msg[512];
  dispatch_device *dt, *dp;
  int rc = open_tls(g_srv.port, &o, &dt, msg, sizeof msg);
  cr_assert_eq(rc, 0, "tls open: %s: %s", dispatch_err_name(rc), msg);
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_plain.port);
  rc = dispatch_device_open(spec, NULL, &dp, msg, sizeof msg);
  cr_assert_eq(rc, 0, "tcp open: %s", msg);
  /* a TLS client on the plain port: refused cleanly on both sides */
  dispatch_device *dx = NULL;
  rc = open_tls(g_plain.port, &o, &dx, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_null(dx);
  program(dt, y1, g1);
  program(dp, y2, g2);
  cr_assert_eq(memcmp(y1, y2, sizeof y1), 0, "tanh(A B) differs over TLS");
  cr_assert_eq(memcmp(g1, g2, sizeof g1), 0, "dL/dA differs over TLS");
  int nonzero = 0;
  for (int i = 0; i < N * N; i++) nonzero += g1[i] != 0.0f;
  cr_assert_gt(nonzero, N * N / 2);
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dt, dispatch_device_stats(dt, &st));
  cr_assert_eq(st.tensors, 0, "every tensor freed over TLS");
  dispatch_device_close(dt);
  dispatch_device_close(dp);
  cr_assert_eq(sp_stop(&g_srv), 0);
  cr_assert_eq(sp_stop(&g_plain), 0);
}

Test(tls, env_ca_and_name_given_to_make_certs, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "dispatch.test", 30);
  start_tls(&g_srv, g_dir, NULL);
  setenv("DISPATCH_TLS_CA", path(g_dir, "ca.pem"), 1);
  setenv("DISPATCH_TLS_SERVER_NAME", "dispatch.test", 1);
  char msg[512];
  dispatch_device *d;
  int rc = open_tls(g_srv.port, NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  OK(d, dispatch_device_sync(d));
  dispatch_device_close(d);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, plain_client_on_tls_port_fails_cleanly, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  start_tls(&g_srv, g_dir, NULL);
  char spec[64], msg[512] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.timeout_ms = 60000;
  dispatch_device *d = NULL;
  int rc = dispatch_device_open(spec, &o, &d, msg, sizeof msg);
  cr_assert_lt(rc, 0, "a plain client must not get a session on a TLS port");
  cr_assert_null(d);
  cr_assert(*msg, "an error message is given");
  /* the server keeps serving TLS clients */
  dispatch_options t = ca_opts(g_dir);
  rc = open_tls(g_srv.port, &t, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  OK(d, dispatch_device_sync(d));
  dispatch_device_close(d);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, wrong_ca_is_refused_with_the_verify_reason, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  make_certs(g_dir2, sizeof g_dir2, "localhost", 30);
  start_tls(&g_srv, g_dir, NULL);
  dispatch_options o = ca_opts(g_dir2); /* another CA */
  char msg[512];
  dispatch_device *d = NULL;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_null(d);
  cr_assert(strstr(msg, "certificate verify failed"), "%s", msg);
  cr_assert(strstr(msg, "local issuer certificate"), "%s", msg);
  /* no CA file and no env: the system store does not know the test CA */
  unsetenv("DISPATCH_TLS_CA");
  dispatch_options none;
  dispatch_options_init(&none);
  rc = open_tls(g_srv.port, &none, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "certificate verify failed"), "%s", msg);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, wrong_host_name_is_refused, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "dispatch.test", 30);
  start_tls(&g_srv, g_dir, NULL);
  dispatch_options o = ca_opts(g_dir);
  o.server_name = "other.example";
  char msg[512];
  dispatch_device *d = NULL;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "hostname mismatch"), "%s", msg);
  cr_assert(strstr(msg, "other.example"), "%s", msg);
  /* an IP literal is checked against the IP SANs: 127.0.0.2 is not one */
  o.server_name = "127.0.0.2";
  rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "IP address mismatch"), "%s", msg);
  o.server_name = "localhost"; /* in the SAN */
  rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  dispatch_device_close(d);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, mutual_tls_needs_a_client_certificate, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  const char *more[] = {"--tls-client-ca", path(g_dir, "ca.pem"), NULL};
  start_tls(&g_srv, g_dir, more);
  dispatch_options o = ca_opts(g_dir);
  char msg[512];
  dispatch_device *d = NULL;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_null(d);
  cr_assert(strstr(msg, "certificate"), "%s", msg);
  /* a certificate from another CA is refused as well */
  make_certs(g_dir2, sizeof g_dir2, "localhost", 30);
  o.cert_file = path(g_dir2, "client.pem");
  o.key_file = path(g_dir2, "client.key");
  rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  /* the right one is accepted */
  o.cert_file = path(g_dir, "client.pem");
  o.key_file = path(g_dir, "client.key");
  rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  OK(d, dispatch_device_sync(d));
  dispatch_device_close(d);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, expired_server_certificate_is_refused, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", -1);
  start_tls(&g_srv, g_dir, NULL);
  dispatch_options o = ca_opts(g_dir);
  char msg[512];
  dispatch_device *d = NULL;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "certificate has expired"), "%s", msg);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, expired_client_certificate_is_refused, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  make_certs(g_dir2, sizeof g_dir2, "localhost", -1);
  /* the server trusts both CAs: the expired client's chain is known */
  char both[300];
  snprintf(both, sizeof both, "%s/both.pem", g_dir);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "cat '%s' '%s' > '%s'", path(g_dir, "ca.pem"),
           path(g_dir2, "ca.pem"), both);
  cr_assert_eq(system(cmd), 0);
  const char *more[] = {"--tls-client-ca", both, NULL};
  start_tls(&g_srv, g_dir, more);
  dispatch_options o = ca_opts(g_dir);
  o.cert_file = path(g_dir2, "client.pem");
  o.key_file = path(g_dir2, "client.key");
  char msg[512];
  dispatch_device *d = NULL;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_ETLS, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert(strstr(msg, "expired"), "%s", msg);
  cr_assert_eq(sp_stop(&g_srv), 0);
}

Test(tls, bad_server_files_refuse_to_start, .fini = cleanup) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  const char *args[] = {"--tls-cert", path(g_dir, "server.pem"), "--tls-key",
                        path(g_dir, "client.key"), NULL}; /* wrong key */
  cr_assert_neq(sp_start(&g_srv, args), 0);
  const char *args2[] = {"--tls-cert", path(g_dir, "server.pem"), NULL};
  cr_assert_neq(sp_start(&g_srv, args2), 0, "--tls-cert needs --tls-key");
}

/* --max-queued 4: the server stops reading after 4 waiting requests while
 * the rest of the pipelined ops sit decrypted-to-be inside the TLS
 * session; each time the workers catch up it must decrypt those before
 * waiting on the socket, or the session would stall. */
Test(tls, throttled_pipeline_resumes_from_tls_buffers, .fini = cleanup,
     .timeout = 120) {
  make_certs(g_dir, sizeof g_dir, "localhost", 30);
  const char *more[] = {"--max-queued", "4", NULL};
  start_tls(&g_srv, g_dir, more);
  dispatch_options o = ca_opts(g_dir);
  char msg[512];
  dispatch_device *d;
  int rc = open_tls(g_srv.port, &o, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s", dispatch_err_name(rc), msg);
  float v[64];
  for (int i = 0; i < 64; i++) v[i] = (float)i;
  int64_t shape[1] = {64};
  dispatch_tensor *x;
  OK(d, dispatch_tensor_from_data(d, DISPATCH_F32, 1, shape, v, sizeof v, &x));
  for (int i = 0; i < 2000; i++) {
    dispatch_tensor *y;
    OK(d, dispatch_add_scalar(x, 1.0, &y));
    dispatch_tensor_free(x);
    x = y;
  }
  float out[64];
  OK(d, dispatch_tensor_read(x, out, sizeof out));
  for (int i = 0; i < 64; i++) cr_assert_eq(out[i], (float)i + 2000.0f);
  dispatch_tensor_free(x);
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(d, dispatch_device_stats(d, &st));
  cr_assert_eq(st.tensors, 0);
  cr_assert_eq(st.ops, 2000);
  dispatch_device_close(d);
  cr_assert_eq(sp_stop(&g_srv), 0);
}
