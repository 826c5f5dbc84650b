/* dispatch-server's observability, on 127.0.0.1 only: the Prometheus
 * endpoint of --metrics-listen (scraped over a plain socket: the test
 * writes a GET and splits the answer into its status line and body,
 * nothing more), counters that move by exactly the work done, the
 * exposition checked by `promtool check metrics`, the loopback rule of
 * --metrics-listen, and both log formats (text lines with ISO-8601 UTC
 * timestamps, and --log-format json, each line parsed with cJSON). */
#include <cJSON.h>
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <regex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dsp.h"
#include "helpers/http.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static int g_mport; /* the metrics endpoint's port */
static char g_log[64];

static void cleanup(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  if (*g_log) unlink(g_log);
}

static void need_bin(void) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin)
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs "
                   "dispatch-server (make test sets it)");
}

/* The line after "listening on": "dispatch-server metrics on 127.0.0.1:P".
 * A bounded wait: the server prints it before it serves anything. */
static int read_metrics_port(int fd) {
  char line[256];
  size_t len = 0;
  while (len < sizeof line - 1) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 60000);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t n = read(fd, line + len, 1);
    if (n <= 0) return -1;
    if (line[len] == '\n') break;
    len++;
  }
  line[len] = '\0';
  const char *prefix = "dispatch-server metrics on 127.0.0.1:";
  if (strncmp(line, prefix, strlen(prefix)) != 0) return -1;
  return atoi(line + strlen(prefix));
}

/* Starts the server with --metrics-listen 127.0.0.1:0 and args; stderr
 * (the log) goes to a temporary file when logged is set. */
static void start(const char *const *args, int logged) {
  need_bin();
  const char *all[32];
  int n = 0;
  all[n++] = "--metrics-listen";
  all[n++] = "127.0.0.1:0";
  all[n++] = "--threads";
  all[n++] = "2";
  all[n++] = "--log-level"; /* quiet unless the test asks for more */
  all[n++] = "error";
  for (int i = 0; args && args[i] && n < 31; i++) all[n++] = args[i];
  all[n] = NULL;
  int saved = -1;
  if (logged) {
    snprintf(g_log, sizeof g_log, "/tmp/dsp-metrics-log-XXXXXX");
    int fd = mkstemp(g_log);
    cr_assert_geq(fd, 0);
    fflush(stderr);
    saved = dup(2);
    dup2(fd, 2);
    close(fd);
  }
  int rc = sp_start(&g_srv, all);
  if (logged) {
    dup2(saved, 2);
    close(saved);
  }
  cr_assert_eq(rc, 0, "server did not start");
  g_mport = read_metrics_port(g_srv.out_fd);
  cr_assert_gt(g_mport, 0, "no 'dispatch-server metrics on' line on stdout");
}

/* One HTTP request (helpers/http.c): the status code and the body (a
 * malloc'd string); the test fails when no answer comes. */
static int http(const char *method, const char *path, char **body) {
  char why[256];
  int status = http_request(g_mport, method, path, body, why, sizeof why);
  cr_assert_geq(status, 0, "%s %s: %s", method, path, why);
  return status;
}

static char *scrape(void) {
  char *body;
  int st = http("GET", "/metrics", &body);
  cr_assert_eq(st, 200, "GET /metrics: %d %s", st, body);
  return body;
}

/* The value of the sample whose name and labels are exactly series
 * ("dispatch_ops_total{op=\"add\"}"); the test fails when it is absent. */
static double value(const char *text, const char *series) {
  size_t n = strlen(series);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : p)
    if (strncmp(p, series, n) == 0 && p[n] == ' ') return strtod(p + n, NULL);
  cr_assert_fail("no sample %s in:\n%s", series, text);
  return 0;
}

static const float k_d6[6] = {1, 2, 3, 4, 5, 6};

static void connect_hello(wire_conn *c) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  cr_assert_eq(wire_hello(c, "metrics-test"), 0);
}

/* Runs `promtool check metrics` on text; its output (problems found) is
 * copied into out. Returns its exit status. */
static int promtool(const char *text, char *out, size_t len) {
  char path[64];
  snprintf(path, sizeof path, "/tmp/dsp-scrape-XXXXXX");
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  size_t n = strlen(text);
  cr_assert_eq(write(fd, text, n), (ssize_t)n);
  close(fd);
  char cmd[160];
  snprintf(cmd, sizeof cmd, "promtool check metrics < %s 2>&1", path);
  FILE *p = popen(cmd, "r");
  cr_assert_not_null(p);
  size_t got = fread(out, 1, len - 1, p);
  out[got] = '\0';
  int st = pclose(p);
  unlink(path);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

TestSuite(metrics, .fini = cleanup, .timeout = 120);

/* Known work moves the counters by exactly that much: 5 adds, one failed
 * matmul (DISPATCH_ESHAPE), two uploads; tensors and bytes per device come
 * back to 0 once freed; the latency histograms count each request. */
Test(metrics, counters_follow_known_work) {
  start(NULL, 0);
  char *before = scrape();
  double add0 = value(before, "dispatch_ops_total{op=\"add\"}");
  double in0 = value(before, "dispatch_received_bytes_total");
  cr_assert_eq(value(before, "dispatch_sessions_opened_total"), 0);
  cr_assert_eq(value(before, "dispatch_errors_total{code=\"DISPATCH_ESHAPE\"}"),
               0);
  cr_assert_eq(value(before, "dispatch_tensors{device=\"cpu:0\"}"), 0);
  free(before);

  wire_conn c;
  connect_hello(&c);
  int64_t s23[2] = {2, 3}, s45[2] = {4, 5};
  float d20[20] = {0};
  wire_upload(&c, 1, DSP_F32, 2, s23, k_d6, sizeof k_d6);
  wire_upload(&c, 2, DSP_F32, 2, s45, d20, sizeof d20);
  uint64_t ab[2] = {1, 1}, mm[2] = {1, 2};
  for (uint64_t i = 0; i < 5; i++)
    wire_op(&c, DSP_OP_ADD, ab, 2, 10 + i, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_MATMUL, mm, 2, 20, NULL, 0, NULL, 0); /* [2,3]@[4,5] */
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_ESHAPE);

  char *t = scrape();
  cr_assert_eq(value(t, "dispatch_ops_total{op=\"add\"}") - add0, 5);
  cr_assert_eq(value(t, "dispatch_ops_total{op=\"matmul\"}"), 0);
  cr_assert_eq(value(t, "dispatch_errors_total{code=\"DISPATCH_ESHAPE\"}"), 1);
  cr_assert_eq(value(t, "dispatch_sessions{state=\"active\"}"), 1);
  cr_assert_eq(value(t, "dispatch_sessions_opened_total"), 1);
  /* 2 uploads + 5 results; the failed matmul's id is poisoned, no tensor */
  cr_assert_eq(value(t, "dispatch_tensors{device=\"cpu:0\"}"), 7);
  cr_assert_eq(value(t, "dispatch_tensor_bytes{device=\"cpu:0\"}"),
               24 + 80 + 5 * 24);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_count"
                        "{kind=\"op\"}"),
               6);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_count"
                        "{kind=\"upload\"}"),
               2);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_bucket"
                        "{kind=\"upload\",le=\"+Inf\"}"),
               2);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_count"
                        "{kind=\"hello\"}"),
               1);
  cr_assert_eq(value(t, "dispatch_queued_requests"), 0);
  /* at least the two uploads' payloads came in */
  cr_assert_geq(value(t, "dispatch_received_bytes_total") - in0, 24 + 80);
  cr_assert_gt(value(t, "dispatch_sent_bytes_total"), 0);
  free(t);

  uint64_t ids[7] = {1, 2, 10, 11, 12, 13, 14};
  wire_free(&c, ids, 7, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  t = scrape();
  cr_assert_eq(value(t, "dispatch_tensors{device=\"cpu:0\"}"), 0);
  cr_assert_eq(value(t, "dispatch_tensor_bytes{device=\"cpu:0\"}"), 0);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_count"
                        "{kind=\"sync\"}"),
               2);
  free(t);
  wire_close(&c);
  /* the server sees the close in its own time: a bounded wait for it */
  int open = 1;
  for (int i = 0; i < 600 && open; i++) {
    t = scrape();
    open = value(t, "dispatch_sessions{state=\"active\"}") +
               value(t, "dispatch_sessions{state=\"closing\"}") >
           0;
    free(t);
    if (open) usleep(10000);
  }
  cr_assert_eq(open, 0, "the closed session is still counted");
}

/* Each limit that refuses something is counted under its own label, and
 * its error under its code. */
Test(metrics, limit_violations_by_limit) {
  const char *args[] = {"--max-elements", "100", "--max-op-cost", "1000",
                        NULL};
  start(args, 0);
  wire_conn c;
  connect_hello(&c);
  int64_t s200[1] = {200}, s10[2] = {10, 10};
  float big[200] = {0}, d100[100] = {0};
  wire_upload(&c, 1, DSP_F32, 1, s200, big, sizeof big); /* > 100 elements */
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_ELIMIT);
  wire_upload(&c, 2, DSP_F32, 2, s10, d100, sizeof d100);
  uint64_t mm[2] = {2, 2};
  /* 10x10 @ 10x10: 1000 multiply-adds + 100 outputs, over 1000 */
  wire_op(&c, DSP_OP_MATMUL, mm, 2, 3, NULL, 0, NULL, 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_ELIMIT);
  char *t = scrape();
  cr_assert_eq(value(t, "dispatch_limit_violations_total"
                        "{limit=\"max_elements\"}"),
               1);
  cr_assert_eq(value(t, "dispatch_limit_violations_total"
                        "{limit=\"max_op_cost\"}"),
               1);
  cr_assert_eq(value(t, "dispatch_limit_violations_total{limit=\"quota\"}"),
               0);
  cr_assert_eq(value(t, "dispatch_errors_total{code=\"DISPATCH_ELIMIT\"}"), 2);
  free(t);
  wire_close(&c);
}

/* Replies a client does not take show in dispatch_output_queue_bytes: 48
 * reads of a 1 MiB tensor, none of them read back, are more than the
 * loopback socket buffers hold (the Read replies share the tensor's
 * storage, so the server holds no copies). A bounded wait for the replies
 * to reach the queue; then they are read and the gauge drains to 0. */
Test(metrics, unsent_replies_show_in_the_output_queue) {
  start(NULL, 0);
  wire_conn c;
  connect_hello(&c);
  int64_t s1m[1] = {1 << 18};
  float *d = calloc(1 << 18, sizeof *d);
  cr_assert_not_null(d);
  wire_upload(&c, 1, DSP_F32, 1, s1m, d, (1 << 18) * sizeof *d);
  free(d);
  enum { READS = 48 };
  for (int i = 0; i < READS; i++) wire_read(&c, 1);
  double q = 0;
  for (int i = 0; i < 600 && q == 0; i++) {
    char *t = scrape();
    q = value(t, "dispatch_output_queue_bytes");
    free(t);
    if (q == 0) usleep(10000);
  }
  cr_assert_gt(q, 0, "48 MiB of replies nobody reads, none queued");
  for (int i = 0; i < READS; i++) {
    Dspwire__Reply *r;
    void *bulk;
    size_t bl;
    cr_assert_eq(wire_recv(&c, &r, &bulk, &bl), 0);
    cr_assert_eq(bl, (size_t)(1 << 20));
    wire_reply_free(r, bulk);
  }
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  char *t = scrape();
  cr_assert_eq(value(t, "dispatch_output_queue_bytes"), 0);
  cr_assert_eq(value(t, "dispatch_request_duration_seconds_count"
                        "{kind=\"read\"}"),
               READS);
  cr_assert_geq(value(t, "dispatch_sent_bytes_total"), READS * (1 << 20));
  free(t);
  wire_close(&c);
}

/* promtool finds nothing to complain about in a scrape taken after work
 * of every kind the counters follow (ops, an error, a refusal). */
Test(metrics, promtool_accepts_the_exposition) {
  start(NULL, 0);
  wire_conn c;
  connect_hello(&c);
  int64_t s23[2] = {2, 3};
  wire_upload(&c, 1, DSP_F32, 2, s23, k_d6, sizeof k_d6);
  uint64_t ab[2] = {1, 1}, bad[2] = {1, 99};
  wire_op(&c, DSP_OP_MUL, ab, 2, 2, NULL, 0, NULL, 0);
  wire_op(&c, DSP_OP_MUL, bad, 2, 3, NULL, 0, NULL, 0); /* unknown id */
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), DISPATCH_ENOID);
  char *t = scrape();
  cr_assert_eq(value(t, "dispatch_errors_total{code=\"DISPATCH_ENOID\"}"), 1);
  char out[8192];
  int st = promtool(t, out, sizeof out);
  cr_assert_eq(st, 0, "promtool check metrics: exit %d:\n%s", st, out);
  cr_assert_eq(out[0], '\0', "promtool reported problems:\n%s", out);
  free(t);
  wire_close(&c);
}

/* Only /metrics is served, and only to GET (or HEAD). */
Test(metrics, other_paths_and_methods_are_refused) {
  start(NULL, 0);
  char *body;
  cr_assert_eq(http("GET", "/", &body), 404, "%s", body);
  free(body);
  cr_assert_eq(http("GET", "/metrics/x", &body), 404, "%s", body);
  free(body);
  cr_assert_eq(http("POST", "/metrics", &body), 405, "%s", body);
  free(body);
  cr_assert_eq(http("HEAD", "/metrics", &body), 200);
  cr_assert_eq(body[0], '\0', "a HEAD answer has no body: %s", body);
  free(body);
}

/* --metrics-listen beyond loopback needs --metrics-public (--insecure
 * covers --listen only, and says so): refused before anything binds; a
 * malformed address or an unknown --log-format stops the server with a
 * line naming it. */
Test(metrics, non_loopback_metrics_address_is_refused) {
  need_bin();
  char out[4096];
  const char *a1[] = {"--listen", "127.0.0.1:0", "--metrics-listen",
                      "0.0.0.0:0", NULL};
  int st = sp_run_capture(a1, out, sizeof out);
  cr_assert_eq(st, 2, "exit status %d, output: %s", st, out);
  cr_assert_null(strstr(out, "listening"), "it must not bind: %s", out);
  cr_assert(strstr(out, "refusing to serve metrics on 0.0.0.0"), "%s", out);
  cr_assert(strstr(out, "--metrics-public"), "%s", out);
  const char *a4[] = {"--listen", "127.0.0.1:0", "--insecure",
                      "--metrics-listen", "0.0.0.0:0", NULL};
  st = sp_run_capture(a4, out, sizeof out);
  cr_assert_eq(st, 2, "--insecure alone: exit status %d, output: %s", st,
               out);
  cr_assert(strstr(out, "refusing to serve metrics on 0.0.0.0"), "%s", out);
  cr_assert(strstr(out, "(--insecure covers --listen only)"), "%s", out);
  const char *a2[] = {"--listen", "127.0.0.1:0", "--metrics-listen",
                      "127.0.0.1", NULL};
  st = sp_run_capture(a2, out, sizeof out);
  cr_assert_eq(st, 2, "%s", out);
  cr_assert(strstr(out, "--metrics-listen: '127.0.0.1' is not HOST:PORT"),
            "%s", out);
  const char *a3[] = {"--listen", "127.0.0.1:0", "--log-format", "xml", NULL};
  st = sp_run_capture(a3, out, sizeof out);
  cr_assert_eq(st, 2, "%s", out);
  cr_assert(strstr(out, "--log-format takes text or json, got 'xml'"), "%s",
            out);
  const char *a5[] = {"--listen", "127.0.0.1:0", "--metrics-public", NULL};
  st = sp_run_capture(a5, out, sizeof out);
  cr_assert_eq(st, 2, "%s", out);
  cr_assert(strstr(out, "--metrics-public needs --metrics-listen"), "%s", out);
}

/* --metrics-public passes a non-loopback address on to the bind, with a
 * warning naming it. The address is TEST-NET-1 (192.0.2.1, RFC 5737),
 * which no interface here has: the bind fails after the check, so the
 * test serves nothing beyond loopback. */
Test(metrics, metrics_public_allows_a_non_loopback_address) {
  need_bin();
  char out[4096];
  const char *a[] = {"--listen", "127.0.0.1:0", "--metrics-listen",
                     "192.0.2.1:0", "--metrics-public", NULL};
  int st = sp_run_capture(a, out, sizeof out);
  cr_assert_null(strstr(out, "refusing"), "%s", out);
  cr_assert(strstr(out, "warning: --metrics-public: serving metrics on "
                        "192.0.2.1 over plain HTTP without authentication"),
            "%s", out);
  cr_assert(strstr(out, "cannot serve metrics on 192.0.2.1"), "%s", out);
  cr_assert_eq(st, 1, "exit status %d, output: %s", st, out);
}

/* One request with "Authorization: Bearer token" (NULL: no header). */
static int http_bearer(const char *path, const char *token, char **body) {
  char why[256], hdr[256];
  snprintf(hdr, sizeof hdr, "Authorization: Bearer %s\r\n",
           token ? token : "");
  int st = http_request_hdr(g_mport, "GET", path, token ? hdr : NULL, body,
                            why, sizeof why);
  cr_assert_geq(st, 0, "GET %s: %s", path, why);
  return st;
}

static void write_token(const char *p, const char *text) {
  FILE *f = fopen(p, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  cr_assert_eq(fclose(f), 0);
}

/* --metrics-token-file: 401 without the token, with another one, or with
 * it under another scheme; 200 with it. SIGHUP reads the file again: the
 * new token is then the one that passes, and the reload is counted. */
Test(metrics, bearer_token_guards_the_endpoint_and_reloads) {
  char tf[] = "/tmp/dsp-mtoken-XXXXXX";
  int fd = mkstemp(tf);
  cr_assert_geq(fd, 0);
  close(fd);
  write_token(tf, "scrape-1\n");
  const char *args[] = {"--metrics-token-file", tf, NULL};
  start(args, 0);
  char *body;
  cr_assert_eq(http_bearer("/metrics", NULL, &body), 401, "%s", body);
  cr_assert(strstr(body, "Authorization: Bearer"), "%s", body);
  free(body);
  cr_assert_eq(http_bearer("/metrics", "scrape-2", &body), 401, "%s", body);
  free(body);
  cr_assert_eq(http_bearer("/metrics", "scrape-", &body), 401, "%s", body);
  free(body);
  cr_assert_eq(http_bearer("/other", "scrape-2", &body), 401, "%s", body);
  free(body);
  char why[256];
  int st = http_request_hdr(g_mport, "GET", "/metrics",
                            "Authorization: Basic scrape-1\r\n", &body, why,
                            sizeof why);
  cr_assert_eq(st, 401, "another scheme: %d %s", st, body ? body : why);
  free(body);
  cr_assert_eq(http_bearer("/metrics", "scrape-1", &body), 200, "%s", body);
  cr_assert_eq(value(body, "dispatch_reloads_total{result=\"ok\"}"), 0);
  free(body);

  write_token(tf, "scrape-2\n");
  cr_assert_eq(sp_signal(&g_srv, SIGHUP), 0);
  /* bounded: the loop handles the signal soon after */
  for (int i = 0; i < 3000; i++) {
    st = http_bearer("/metrics", "scrape-2", &body);
    if (st == 200) break;
    free(body);
    body = NULL;
    usleep(20000);
  }
  cr_assert_eq(st, 200, "the new token never passed");
  cr_assert_eq(value(body, "dispatch_reloads_total{result=\"ok\"}"), 1);
  cr_assert_eq(value(body, "dispatch_reloads_total{result=\"refused\"}"), 0);
  free(body);
  cr_assert_eq(http_bearer("/metrics", "scrape-1", &body), 401, "%s", body);
  free(body);
  unlink(tf);
}

/* ------------------------------------------------------------ logs */

static const char *k_ts_re =
    "^[0-9]{4}-[0-1][0-9]-[0-3][0-9]T[0-2][0-9]:[0-5][0-9]:[0-6][0-9]"
    "\\.[0-9]{3}Z";

/* A session with a hostile client name, then the server stopped; returns
 * the log's lines (a malloc'd buffer). */
static char *session_then_log(const char *fmt) {
  const char *args[] = {"--log-level", "debug", "--log-format", fmt, NULL};
  start(args, 1);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "q\"b\\s\nnl\xff"), 0);
  cr_assert_eq(wire_sync_check(&c, NULL, 0, NULL), 0);
  wire_close(&c);
  cr_assert_eq(sp_stop(&g_srv), 0);
  FILE *f = fopen(g_log, "r");
  cr_assert_not_null(f);
  char *buf = calloc(1, 1 << 20);
  cr_assert_not_null(buf);
  size_t n = fread(buf, 1, (1 << 20) - 1, f);
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* Text lines start with an ISO-8601 UTC timestamp with milliseconds. */
Test(metrics, text_log_lines_carry_iso8601_utc_timestamps) {
  char *log = session_then_log("text");
  regex_t re;
  char pat[256];
  snprintf(pat, sizeof pat, "%s dispatch-server (error|warn|info|debug): ",
           k_ts_re);
  cr_assert_eq(regcomp(&re, pat, REG_EXTENDED | REG_NOSUB), 0);
  int lines = 0, hello = 0;
  for (char *line = strtok(log, "\n"); line; line = strtok(NULL, "\n")) {
    cr_assert_eq(regexec(&re, line, 0, NULL, 0), 0, "line: %s", line);
    if (strstr(line, "conn 1 (127.0.0.1:") && strstr(line, "hello from"))
      hello++;
    lines++;
  }
  regfree(&re);
  cr_assert_gt(lines, 3, "%d lines", lines);
  cr_assert_eq(hello, 1, "the hello line names the connection and peer");
  free(log);
}

/* --log-format json: every line is one JSON object with ts, level and
 * msg; lines about a connection carry session and peer; a client string
 * with quotes, a backslash, a newline and invalid UTF-8 stays inside msg. */
Test(metrics, json_log_lines_parse_and_carry_fields) {
  char *log = session_then_log("json");
  regex_t re;
  cr_assert_eq(regcomp(&re, k_ts_re, REG_EXTENDED | REG_NOSUB), 0);
  int lines = 0, with_session = 0, hello = 0;
  for (char *line = strtok(log, "\n"); line; line = strtok(NULL, "\n")) {
    const char *end = NULL;
    cJSON *o = cJSON_ParseWithOpts(line, &end, 1);
    cr_assert_not_null(o, "not one JSON object: %s", line);
    cr_assert(cJSON_IsObject(o), "%s", line);
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(o, "ts");
    const cJSON *lv = cJSON_GetObjectItemCaseSensitive(o, "level");
    const cJSON *msg = cJSON_GetObjectItemCaseSensitive(o, "msg");
    cr_assert(cJSON_IsString(ts) && cJSON_IsString(lv) && cJSON_IsString(msg),
              "%s", line);
    cr_assert_eq(regexec(&re, ts->valuestring, 0, NULL, 0), 0, "ts: %s",
                 ts->valuestring);
    cr_assert_eq(strlen(ts->valuestring), 24, "%s", ts->valuestring);
    cr_assert(!strcmp(lv->valuestring, "error") ||
                  !strcmp(lv->valuestring, "warn") ||
                  !strcmp(lv->valuestring, "info") ||
                  !strcmp(lv->valuestring, "debug"),
              "level %s", lv->valuestring);
    const cJSON *sess = cJSON_GetObjectItemCaseSensitive(o, "session");
    const cJSON *peer = cJSON_GetObjectItemCaseSensitive(o, "peer");
    if (sess) {
      cr_assert(cJSON_IsNumber(sess) && sess->valuedouble == 1, "%s", line);
      with_session++;
    }
    if (peer)
      cr_assert(cJSON_IsString(peer) &&
                    !strncmp(peer->valuestring, "127.0.0.1:", 10),
                "%s", line);
    if (strstr(msg->valuestring, "hello from")) {
      hello++;
      cr_assert(peer != NULL, "%s", line);
      /* the quote as it was; the backslash, the newline and the invalid
       * byte as \xNN text (sv_log_str): nothing can start a line */
      cr_assert(strstr(msg->valuestring, "'q\"b\\x5cs\\x0anl\\xff'"),
                "msg: %s", msg->valuestring);
    }
    for (const char *p = msg->valuestring; *p; p++)
      cr_assert((unsigned char)*p >= 0x20, "control byte in msg: %s", line);
    cJSON_Delete(o);
    lines++;
  }
  regfree(&re);
  cr_assert_gt(lines, 3, "%d lines", lines);
  cr_assert_eq(hello, 1);
  cr_assert_geq(with_session, 3, "opened, hello, requests, closed");
  free(log);
}

/* ------------------------------------------------------------------ */
/* issue 21 item 9: slow clients do not hold the endpoint               */

#define N_SLOW 20

typedef struct slow_clients {
  int fd[N_SLOW];
  atomic_int stop;
  int reconnects;
} slow_clients;

/* A connection that sends a request line and one header, and then never
 * ends its headers. */
static int slow_open(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons((uint16_t)g_mport)};
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  const char *start = "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
  if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
      send(fd, start, strlen(start), MSG_NOSIGNAL) < 0) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Every 200 ms each connection sends one more byte of its header, well
 * inside MHD's 10 s of silence; one the server ends opens again. */
static void *slow_main(void *arg) {
  slow_clients *s = arg;
  while (!atomic_load(&s->stop)) {
    for (int i = 0; i < N_SLOW; i++) {
      if (s->fd[i] >= 0 && send(s->fd[i], "a", 1, MSG_NOSIGNAL) == 1) continue;
      if (s->fd[i] >= 0) close(s->fd[i]);
      s->fd[i] = slow_open();
      s->reconnects++;
    }
    usleep(200 * 1000);
  }
  return NULL;
}

/* Twenty clients trickling their headers (more than the endpoint's 16
 * connections), opening again whenever one is ended: a scrape still gets
 * its answer, as each request has a few seconds in all. Before, the
 * trickling kept every connection for ever and the scrape had none. */
Test(metrics, slow_clients_do_not_hold_the_endpoint) {
  start(NULL, 0);
  slow_clients s = {.reconnects = 0};
  atomic_init(&s.stop, 0);
  for (int i = 0; i < N_SLOW; i++) {
    s.fd[i] = slow_open();
    cr_assert_geq(s.fd[i], 0, "%s", strerror(errno));
  }
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, slow_main, &s), 0);
  sleep(1); /* the first 16 hold the endpoint's connections */
  char *text = scrape();
  cr_assert(strstr(text, "dispatch_memory_bytes"), "%s", text);
  free(text);
  atomic_store(&s.stop, 1);
  pthread_join(th, NULL);
  /* the scrape had a connection because slow ones were ended: reopened,
   * or with their end (FIN or reset) waiting to be read */
  int ended = s.reconnects;
  for (int i = 0; i < N_SLOW; i++) {
    if (s.fd[i] < 0) continue;
    char b;
    ssize_t r = recv(s.fd[i], &b, 1, MSG_DONTWAIT | MSG_PEEK);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) ended++;
    close(s.fd[i]);
  }
  cr_assert_gt(ended, 0, "no slow client was ever ended");
}
