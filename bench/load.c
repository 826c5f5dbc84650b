/* bench load (issue 12 item 5, full size): 64 sessions each making 10,000
 * library calls (uploads, mul, sum, backward, grad, reads, every value
 * checked) and 8 sessions uploading 64 MiB tensors, all at once, through
 * the driver the load suite uses at a reduced size (tests/helpers/load.c).
 *
 * It starts its own dispatch-server (72 sessions is over the default
 * --max-sessions 64, and the RSS baseline must be a fresh server's) with
 * --max-sessions 80 --storage-cache 0, from $DISPATCH_SERVER_BIN or else
 * the dispatch-server beside this program's build directory.
 *
 * Rows (section "load"): calls/s; p50 and p99 latency of the calls that
 * wait for a reply (reads, backward); the server's VmRSS peak and after
 * the run, each against its baseline. Exit 1 when any call failed or any
 * value differed. LOAD_CLIENTS, LOAD_OPS, LOAD_BIG and LOAD_BIG_MIB
 * override the sizes (a quick run). */
#include <stdarg.h>
#include <libgen.h>

#include "bench.h"
#include "helpers/load.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

#define MIB (1024.0 * 1024.0)

static long env_long(const char *name, long def) {
  const char *v = getenv(name);
  return v && *v ? strtol(v, NULL, 10) : def;
}

/* Sets DISPATCH_SERVER_BIN (for server_proc) when it is not set: the
 * server of the build this program belongs to. */
static void find_server(void) {
  if (getenv("DISPATCH_SERVER_BIN") && *getenv("DISPATCH_SERVER_BIN")) return;
  char self[4096];
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n <= 0) return;
  self[n] = '\0';
  char path[4200];
  snprintf(path, sizeof path, "%s/../dispatch-server", dirname(self));
  setenv("DISPATCH_SERVER_BIN", path, 1);
}

/* Waits (bounded) until the server holds no tensor of any session. */
static void wait_server_empty(int port) {
  for (int i = 0; i < 600; i++) {
    wire_conn c;
    unsigned long long left = 1;
    if (wire_connect(&c, port) == 0 && wire_hello(&c, "bench-load") == 0) {
      Dspwire__StatsReply st;
      if (wire_get_stats(&c, &st) == 0) left = st.server_tensors;
    }
    wire_close(&c);
    if (left == 0) return;
    usleep(50000);
  }
}

/* One row of the load section: a single measurement, no goal (the run
 * itself fails on an error, a mismatch or a server that did not start). */
static void load_row(const char *metric, double v, const char *unit,
                     int lower_better, const char *ref_name, double ref,
                     const char *fmt, ...) {
  char note[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(note, sizeof note, fmt, ap);
  va_end(ap);
  bench_def d = {"load", metric, unit, lower_better, ref_name, 0,
                 BENCH_GOAL_NONE, 0};
  bench_emit1(&d, v, ref, note);
}

int main(void) {
  load_cfg cfg = {.clients = (int)env_long("LOAD_CLIENTS", 64),
                  .ops = (int)env_long("LOAD_OPS", 10000),
                  .big_clients = (int)env_long("LOAD_BIG", 8),
                  .big_bytes = (size_t)env_long("LOAD_BIG_MIB", 64) << 20,
                  .big_rounds = 2};
  char sessions[16];
  snprintf(sessions, sizeof sessions, "%d",
           cfg.clients + cfg.big_clients + 8);
  const char *args[] = {"--max-sessions", sessions, "--storage-cache", "0",
                        "--log-level", "warn", NULL};
  find_server();
  sp_server srv;
  if (sp_start(&srv, args) != 0) {
    load_row("calls/s", NAN, "calls/s", 0, NULL, NAN,
             "n/a: dispatch-server (%s) did not start",
             getenv("DISPATCH_SERVER_BIN"));
    return 1;
  }
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", srv.port);
  cfg.spec = spec;
  cfg.server_pid = srv.pid;
  load_result r;
  int rc = load_run(&cfg, &r);
  wait_server_empty(srv.port);
  long long after = load_rss(srv.pid);
  int st = sp_stop(&srv);

  char what[512];
  snprintf(what, sizeof what,
           "%d sessions x %d calls + %d x %zu MiB uploads; %lld calls in "
           "%.1f s; %lld errors %lld mismatches%s%s",
           cfg.clients, cfg.ops, cfg.big_clients, cfg.big_bytes >> 20, r.ops,
           r.seconds, r.errors, r.mismatches, r.first_error[0] ? ": " : "",
           r.first_error);
  double base = (double)r.rss_before / MIB;
  double bound = base + cfg.big_clients * 2.0 * (double)cfg.big_bytes / MIB +
                 64.0;
  load_row("calls/s", r.ops_per_s, "calls/s", 0, NULL, NAN, "%s", what);
  load_row("p50 latency of waiting calls", r.p50_us, "us", 1, NULL, NAN,
           "reads and backward, %lld of them", r.waits);
  load_row("p99 latency of waiting calls", r.p99_us, "us", 1, NULL, NAN,
           "reads and backward");
  load_row("server RSS peak", (double)r.rss_peak / MIB, "MiB", 1,
           "baseline RSS", base,
           "bound baseline + 2 x uploads per big session + 64 = %.0f MiB: %s",
           bound, (double)r.rss_peak / MIB <= bound ? "within" : "OVER");
  load_row("server RSS after", (double)after / MIB, "MiB", 1, "baseline RSS",
           base, "every session closed and its tensors freed; server exit %d",
           st);
  return rc == 0 && st == 0 ? 0 : 1;
}
