/* The Prometheus endpoint (--metrics-listen) and the server's labelled
 * counters.
 *
 * libmicrohttpd serves GET /metrics from a thread of its own, so a scrape
 * never waits for the loop to be idle and never runs on it. It reads two
 * kinds of figures without any lock the loop or a worker holds for long:
 *
 *   - counters any thread bumps (ops, errors, limits, tensors per device):
 *     relaxed atomics in sv_global, read directly;
 *   - what only the loop knows (connections and their states, queued
 *     requests, unsent replies, bytes in and out, request latencies): the
 *     scrape wakes the loop through a uv_async, the loop copies them into
 *     a snapshot under a mutex held only for the copy, and the scrape
 *     waits (at most SNAP_WAIT_MS) for that snapshot. A loop that does not
 *     answer in time, or has shut down, leaves the last snapshot served.
 */
#include <errno.h>
#include <microhttpd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

#include "conn.h"

#define SNAP_WAIT_MS 2000
/* Scrape connections at a time, and how long one request may take from
 * the moment its connection is ready for it (opened, or done with the
 * previous one) to its end, however its bytes trickle: MHD's own timeout
 * counts only silence, so clients sending a byte now and then held every
 * slot for ever and no scrape was served. */
#define MAX_SCRAPES 16
#define REQUEST_DEADLINE_S 5

/* ------------------------------------------------------------ counters */

void sv_count_limit(sv_global *g, sv_limit which) {
  atomic_fetch_add_explicit(&g->limit_violations, 1, memory_order_relaxed);
  if ((unsigned)which < SV_LIM_COUNT)
    atomic_fetch_add_explicit(&g->m.limits[which], 1, memory_order_relaxed);
}

void sv_count_error(sv_global *g, int code) {
  int i = code < 0 && -code < SV_METRIC_ERRS ? -code : 0;
  atomic_fetch_add_explicit(&g->m.errors[i], 1, memory_order_relaxed);
}

void sv_tally_tensor(sv_tally *t, const sv_global *g, const dsp_tensor *x,
                     long long nbytes, int sign) {
  t->dirty = 1;
  t->bytes += sign * nbytes;
  t->tensors += sign;
  const dsp_backend *be = x->storage ? x->storage->backend : NULL;
  for (int i = 0; i < g->n_devices && g->devices; i++)
    if (g->devices[i].be == be) {
      t->dev_tensors[i] += sign;
      t->dev_bytes[i] += sign * nbytes;
      t->devs |= 1u << i;
      return;
    }
}

void sv_tally_op(sv_tally *t, int op) {
  if (op < 0 || op >= SV_METRIC_OPS) return;
  t->dirty = 1;
  t->ops[op]++;
  t->op_mask[op / 64] |= 1ull << (op % 64);
}

void sv_tally_flush(sv_tally *t, sv_global *g, atomic_llong *session_bytes) {
  if (!t->dirty) return;
  if (t->bytes) {
    atomic_fetch_add_explicit(&g->bytes, t->bytes, memory_order_relaxed);
    atomic_fetch_add_explicit(session_bytes, t->bytes, memory_order_relaxed);
  }
  if (t->tensors)
    atomic_fetch_add_explicit(&g->tensors, t->tensors, memory_order_relaxed);
  for (int i = 0; t->devs; i++)
    if (t->devs & (1u << i)) {
      t->devs &= ~(1u << i);
      atomic_fetch_add_explicit(&g->m.dev_tensors[i], t->dev_tensors[i],
                                memory_order_relaxed);
      atomic_fetch_add_explicit(&g->m.dev_bytes[i], t->dev_bytes[i],
                                memory_order_relaxed);
      t->dev_tensors[i] = t->dev_bytes[i] = 0;
    }
  for (int w = 0; w < SV_METRIC_OPS / 64; w++)
    while (t->op_mask[w]) {
      int op = w * 64 + __builtin_ctzll(t->op_mask[w]);
      t->op_mask[w] &= t->op_mask[w] - 1;
      atomic_fetch_add_explicit(&g->m.ops[op], t->ops[op],
                                memory_order_relaxed);
      t->ops[op] = 0;
    }
  t->tensors = t->bytes = 0;
  t->dirty = 0;
}

static const char *const g_limit_names[SV_LIM_COUNT] = {
    [SV_LIM_QUOTA] = "quota",
    [SV_LIM_MAX_ELEMENTS] = "max_elements",
    [SV_LIM_MAX_OP_COST] = "max_op_cost",
    [SV_LIM_FRAME_SIZE] = "frame_size",
    [SV_LIM_MAX_SESSIONS] = "max_sessions",
    [SV_LIM_OUTPUT_QUEUE] = "output_queue",
    [SV_LIM_IDLE_TIMEOUT] = "idle_timeout",
    [SV_LIM_HANDSHAKE_TIMEOUT] = "handshake_timeout",
    [SV_LIM_FRAME_TIMEOUT] = "frame_timeout",
};

/* Upper bounds of the latency buckets, as the le labels print them. */
static const double g_lat_le[SV_LAT_BUCKETS] = {
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025,
    0.05,   0.1,     0.25,   0.5,   1,      2.5,   5,     10};

void sv_metrics_observe(sv_server *srv, int bc, uint64_t ns) {
  if (bc < 0 || bc >= SV_BODY_MAX) return;
  double s = (double)ns / 1e9;
  int b = 0;
  while (b < SV_LAT_BUCKETS && s > g_lat_le[b]) b++;
  srv->ls.lat[bc][b]++;
  srv->ls.lat_ns[bc] += ns;
}

/* ------------------------------------------------------------ snapshot */

/* What the loop publishes for a scrape. */
typedef struct snapshot {
  uint64_t handshake, active, closing; /* connections by state */
  uint64_t queued_requests;            /* submitted, not yet back */
  uint64_t queued_bytes;               /* decoded requests and uploads */
  uint64_t output_bytes;               /* unsent replies (outq_bytes) */
  uint64_t bytes_in, bytes_out;
  sv_loop_stats ls;
} snapshot;

typedef struct sv_metrics {
  sv_server *srv;
  struct MHD_Daemon *d;
  int port;
  double start_time; /* seconds since the epoch */
  uv_async_t async;
  int async_open;
  pthread_mutex_t mu; /* guards everything below */
  pthread_cond_t cv;  /* CLOCK_MONOTONIC */
  int loop_alive;     /* the async may be sent */
  uint64_t gen;       /* snapshots published */
  snapshot snap;
  /* the open connections (MHD's thread adds and drops them) and the
   * guard thread that ends each request past REQUEST_DEADLINE_S */
  pthread_mutex_t cmu; /* guards conns and guard_stop */
  pthread_cond_t ccv;  /* CLOCK_MONOTONIC: wakes the guard to stop */
  struct scrape_conn {
    int used, cut;
    int fd;       /* MHD's, open while used (MHD closes it after it
                     tells on_connection, which clears used) */
    double since; /* monotonic seconds: this request's start */
  } conns[MAX_SCRAPES];
  int guard_stop, guard_on;
  pthread_t guard;
  /* --metrics-token-file's token (NULL: none asked for); SIGHUP replaces
   * it from the loop while MHD's thread reads it */
  pthread_mutex_t tmu;
  char *token;
  size_t token_len;
} sv_metrics;

/* Loop thread: the connections' state, summed, published. */
static void on_snapshot(uv_async_t *a) {
  sv_metrics *m = a->data;
  sv_server *srv = m->srv;
  snapshot s;
  memset(&s, 0, sizeof s);
  s.bytes_in = srv->ls.in_closed;
  s.bytes_out = srv->ls.out_closed;
  for (sv_conn *c = srv->conns; c; c = c->next) {
    if (c->closing) s.closing++;
    else if (c->hello_done) s.active++;
    else s.handshake++;
    s.queued_requests += c->inflight;
    s.output_bytes += c->outq_bytes;
    s.bytes_in += c->received;
    s.bytes_out += c->sent;
    /* a closing session's budget goes away on a worker (teardown) */
    if (!c->closing) s.queued_bytes += dsp_budget_used(c->sess->queue);
  }
  s.ls = srv->ls;
  pthread_mutex_lock(&m->mu);
  m->snap = s;
  m->gen++;
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
}

/* Metrics thread: a fresh snapshot when the loop answers in time, else
 * the last one. */
static void take_snapshot(sv_metrics *m, snapshot *out) {
  pthread_mutex_lock(&m->mu);
  if (m->loop_alive) {
    uint64_t want = m->gen + 1;
    uv_async_send(&m->async);
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += SNAP_WAIT_MS / 1000;
    until.tv_nsec += (SNAP_WAIT_MS % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
      until.tv_sec++;
      until.tv_nsec -= 1000000000L;
    }
    while (m->loop_alive && m->gen < want)
      if (pthread_cond_timedwait(&m->cv, &m->mu, &until) == ETIMEDOUT) break;
  }
  *out = m->snap;
  pthread_mutex_unlock(&m->mu);
}

/* ------------------------------------------------------------ render */

static long long ld(atomic_llong *a) {
  return atomic_load_explicit(a, memory_order_relaxed);
}

static void family(FILE *f, const char *name, const char *type,
                   const char *help) {
  fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* The exposition text (Prometheus text format 0.0.4). Label values are
 * names from the server's own tables (device, op, error, kind, limit),
 * none of which needs escaping. */
static void render(sv_metrics *m, FILE *f) {
  sv_server *srv = m->srv;
  sv_global *g = &srv->g;
  snapshot s;
  take_snapshot(m, &s);

  family(f, "dispatch_build_info", "gauge",
         "Version of this dispatch-server build (the value is always 1).");
  fprintf(f, "dispatch_build_info{version=\"%s\"} 1\n",
          DISPATCH_VERSION_STRING);
  family(f, "process_start_time_seconds", "gauge",
         "Start time of the process since the Unix epoch, in seconds.");
  fprintf(f, "process_start_time_seconds %.3f\n", m->start_time);

  family(f, "dispatch_sessions", "gauge",
         "Connections open now, by state: handshake (TLS handshake or hello "
         "not done), active, closing (its work being cancelled).");
  fprintf(f, "dispatch_sessions{state=\"handshake\"} %llu\n",
          (unsigned long long)s.handshake);
  fprintf(f, "dispatch_sessions{state=\"active\"} %llu\n",
          (unsigned long long)s.active);
  fprintf(f, "dispatch_sessions{state=\"closing\"} %llu\n",
          (unsigned long long)s.closing);
  family(f, "dispatch_sessions_opened_total", "counter",
         "Connections accepted since the server started.");
  fprintf(f, "dispatch_sessions_opened_total %llu\n",
          (unsigned long long)s.ls.opened);
  family(f, "dispatch_sessions_detached", "gauge",
         "Sessions whose connection dropped, kept for a resume "
         "(--session-grace).");
  fprintf(f, "dispatch_sessions_detached %lld\n", ld(&g->sessions_detached));
  family(f, "dispatch_sessions_evicted_total", "counter",
         "Detached sessions expired before their grace to make room for a "
         "new session (--max-sessions), by reason: server_closed (the "
         "server had closed the connection for a limit), oldest (detached "
         "longest ago).");
  fprintf(f, "dispatch_sessions_evicted_total{reason=\"server_closed\"} "
          "%lld\n", ld(&g->m.evicted[0]));
  fprintf(f, "dispatch_sessions_evicted_total{reason=\"oldest\"} %lld\n",
          ld(&g->m.evicted[1]));

  family(f, "dispatch_tensors", "gauge",
         "Tensors the sessions hold by id, by device.");
  for (int i = 0; i < g->n_devices; i++)
    fprintf(f, "dispatch_tensors{device=\"%s\"} %lld\n", g->devices[i].name,
            ld(&g->m.dev_tensors[i]));
  family(f, "dispatch_tensor_bytes", "gauge",
         "Bytes of the tensors the sessions hold by id, by device.");
  for (int i = 0; i < g->n_devices; i++)
    fprintf(f, "dispatch_tensor_bytes{device=\"%s\"} %lld\n",
            g->devices[i].name, ld(&g->m.dev_bytes[i]));
  family(f, "dispatch_device_memory_bytes", "gauge",
         "Storage charged to each device: tensors held by id, autodiff "
         "tapes, gradients, uploads being read.");
  for (int i = 0; i < g->n_devices; i++)
    fprintf(f, "dispatch_device_memory_bytes{device=\"%s\"} %llu\n",
            g->devices[i].name,
            (unsigned long long)dsp_budget_used(g->devices[i].mem));
  family(f, "dispatch_memory_bytes", "gauge",
         "Bytes all sessions hold, queued requests included "
         "(what --max-memory bounds).");
  fprintf(f, "dispatch_memory_bytes %llu\n",
          (unsigned long long)dsp_budget_used(g->mem));
  family(f, "dispatch_memory_limit_bytes", "gauge",
         "The server-wide memory limit (--max-memory).");
  fprintf(f, "dispatch_memory_limit_bytes %llu\n",
          (unsigned long long)(g->mem ? dsp_budget_limit(g->mem) : 0));

  family(f, "dispatch_ops_total", "counter",
         "Ops run, by op: forward ops, and each parameter of an optimizer "
         "step (ops inside a backward pass are not counted).");
  for (int op = 0; op < SV_METRIC_OPS; op++) {
    const dsp_op_info *info = dsp_op_lookup(op);
    if (info)
      fprintf(f, "dispatch_ops_total{op=\"%s\"} %lld\n", info->name,
              ld(&g->m.ops[op]));
  }
  family(f, "dispatch_errors_total", "counter",
         "Errors reported to clients (error replies, deferred errors, "
         "refusals that close a connection), by code.");
  for (int i = 1; i < SV_METRIC_ERRS; i++) {
    const char *name = dispatch_err_name(-i);
    if (strcmp(name, "DISPATCH_EUNKNOWN") != 0)
      fprintf(f, "dispatch_errors_total{code=\"%s\"} %lld\n", name,
              ld(&g->m.errors[i]));
  }
  fprintf(f, "dispatch_errors_total{code=\"DISPATCH_EUNKNOWN\"} %lld\n",
          ld(&g->m.errors[0]));
  family(f, "dispatch_protocol_errors_total", "counter",
         "Connections closed for a protocol error, a failed TLS handshake "
         "or a wrong token.");
  fprintf(f, "dispatch_protocol_errors_total %lld\n",
          ld(&g->protocol_errors));
  family(f, "dispatch_reloads_total", "counter",
         "SIGHUP reloads of the token and TLS files: ok when every file "
         "was taken, refused when one was kept as it was.");
  fprintf(f, "dispatch_reloads_total{result=\"ok\"} %lld\n",
          ld(&g->m.reloads[0]));
  fprintf(f, "dispatch_reloads_total{result=\"refused\"} %lld\n",
          ld(&g->m.reloads[1]));
  family(f, "dispatch_limit_violations_total", "counter",
         "Requests or connections refused by a server limit, by limit.");
  for (int i = 0; i < SV_LIM_COUNT; i++)
    fprintf(f, "dispatch_limit_violations_total{limit=\"%s\"} %lld\n",
            g_limit_names[i], ld(&g->m.limits[i]));

  family(f, "dispatch_request_duration_seconds", "histogram",
         "Time from a request's message decoded to its result back on the "
         "server's loop (its reply queued), by request kind.");
  for (int bc = 0; bc < SV_BODY_MAX; bc++) {
    const char *kind = sv_req_kind_of((Dspwire__Request__BodyCase)bc)->name;
    if (!strcmp(kind, "unknown") || !strcmp(kind, "empty")) continue;
    uint64_t cum = 0;
    for (int b = 0; b <= SV_LAT_BUCKETS; b++) {
      cum += s.ls.lat[bc][b];
      if (b < SV_LAT_BUCKETS)
        fprintf(f,
                "dispatch_request_duration_seconds_bucket{kind=\"%s\","
                "le=\"%g\"} %llu\n",
                kind, g_lat_le[b], (unsigned long long)cum);
      else
        fprintf(f,
                "dispatch_request_duration_seconds_bucket{kind=\"%s\","
                "le=\"+Inf\"} %llu\n",
                kind, (unsigned long long)cum);
    }
    fprintf(f, "dispatch_request_duration_seconds_sum{kind=\"%s\"} %.9f\n",
            kind, (double)s.ls.lat_ns[bc] / 1e9);
    fprintf(f, "dispatch_request_duration_seconds_count{kind=\"%s\"} %llu\n",
            kind, (unsigned long long)cum);
  }

  family(f, "dispatch_received_bytes_total", "counter",
         "Bytes read from client connections (TLS records included).");
  fprintf(f, "dispatch_received_bytes_total %llu\n",
          (unsigned long long)s.bytes_in);
  family(f, "dispatch_sent_bytes_total", "counter",
         "Bytes written to client connections (TLS records included).");
  fprintf(f, "dispatch_sent_bytes_total %llu\n",
          (unsigned long long)s.bytes_out);
  family(f, "dispatch_queued_requests", "gauge",
         "Requests decoded and handed to the workers, not yet finished.");
  fprintf(f, "dispatch_queued_requests %llu\n",
          (unsigned long long)s.queued_requests);
  family(f, "dispatch_queued_bytes", "gauge",
         "Bytes of decoded requests waiting to run (what "
         "--max-queued-bytes bounds per session).");
  fprintf(f, "dispatch_queued_bytes %llu\n",
          (unsigned long long)s.queued_bytes);
  family(f, "dispatch_output_queue_bytes", "gauge",
         "Reply bytes not yet taken by the clients' sockets (what "
         "--max-output-queue bounds per connection).");
  fprintf(f, "dispatch_output_queue_bytes %llu\n",
          (unsigned long long)s.output_bytes);
}

/* ------------------------------------------------------------ HTTP */

static enum MHD_Result reply(struct MHD_Connection *conn, unsigned status,
                             const char *body) {
  struct MHD_Response *r = MHD_create_response_from_buffer(
      strlen(body), (void *)body, MHD_RESPMEM_PERSISTENT);
  if (!r) return MHD_NO;
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/plain; charset=utf-8");
  if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
  if (status == MHD_HTTP_UNAUTHORIZED)
    MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                            "Bearer realm=\"dispatch-server metrics\"");
  enum MHD_Result rc = MHD_queue_response(conn, status, r);
  MHD_destroy_response(r);
  return rc;
}

static double mono_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* MHD's thread: a connection opens (its first request's clock starts) or
 * closes. */
static void on_connection(void *cls, struct MHD_Connection *conn,
                          void **sctx, enum MHD_ConnectionNotificationCode toe) {
  sv_metrics *m = cls;
  pthread_mutex_lock(&m->cmu);
  if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(conn, MHD_CONNECTION_INFO_CONNECTION_FD);
    for (int i = 0; ci && i < MAX_SCRAPES; i++)
      if (!m->conns[i].used) {
        m->conns[i] = (struct scrape_conn){1, 0, ci->connect_fd, mono_now()};
        *sctx = &m->conns[i];
        break;
      }
  } else if (*sctx) {
    ((struct scrape_conn *)*sctx)->used = 0;
    *sctx = NULL;
  }
  pthread_mutex_unlock(&m->cmu);
}

/* MHD's thread: a request ended; a kept-alive connection's next one
 * starts its own clock. */
static void on_completed(void *cls, struct MHD_Connection *conn,
                         void **con_cls, enum MHD_RequestTerminationCode toe) {
  sv_metrics *m = cls;
  (void)con_cls;
  (void)toe;
  const union MHD_ConnectionInfo *ci =
      MHD_get_connection_info(conn, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
  pthread_mutex_lock(&m->cmu);
  struct scrape_conn *sc = ci ? ci->socket_context : NULL;
  if (sc && sc->used) sc->since = mono_now();
  pthread_mutex_unlock(&m->cmu);
}

/* The guard's thread: once a second, every request open for
 * REQUEST_DEADLINE_S or more has its socket shut down; MHD then reads the
 * end of it and closes the connection on its own thread, and a waiting
 * scrape gets the slot. */
static void *guard_main(void *arg) {
  sv_metrics *m = arg;
  pthread_mutex_lock(&m->cmu);
  while (!m->guard_stop) {
    double now = mono_now();
    int cut = 0;
    for (int i = 0; i < MAX_SCRAPES; i++) {
      struct scrape_conn *sc = &m->conns[i];
      if (sc->used && !sc->cut && now - sc->since >= REQUEST_DEADLINE_S) {
        shutdown(sc->fd, SHUT_RDWR);
        sc->cut = 1;
        cut++;
      }
    }
    if (cut) {
      pthread_mutex_unlock(&m->cmu);
      sv_log(SV_LOG_WARN,
             "metrics endpoint: %d request(s) still open after %d s ended, "
             "so that scrapes are served",
             cut, REQUEST_DEADLINE_S);
      pthread_mutex_lock(&m->cmu);
      continue;
    }
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    ts.tv_sec += 1;
    pthread_cond_timedwait(&m->ccv, &m->cmu, &ts);
  }
  pthread_mutex_unlock(&m->cmu);
  return NULL;
}

/* MHD's thread: 1 when no token is configured, or the request says
 * "Authorization: Bearer TOKEN" with the token (the scheme's case does not
 * matter, RFC 7235; compared as the hello's token is, sv_token_matches). */
static int authorized(sv_metrics *m, struct MHD_Connection *conn) {
  const char *h = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                              MHD_HTTP_HEADER_AUTHORIZATION);
  const char *tok = NULL;
  if (h && strncasecmp(h, "Bearer ", 7) == 0)
    for (tok = h + 7; *tok == ' ';) tok++;
  pthread_mutex_lock(&m->tmu);
  int ok = !m->token || sv_token_matches(m->token, m->token_len, tok);
  pthread_mutex_unlock(&m->tmu);
  return ok;
}

void sv_metrics_set_token(sv_server *srv, char *token, size_t len) {
  sv_metrics *m = srv->metrics;
  if (!m) {
    sv_secret_free(&token, &len);
    return;
  }
  pthread_mutex_lock(&m->tmu);
  char *old = m->token;
  size_t old_len = m->token_len;
  m->token = token;
  m->token_len = len;
  pthread_mutex_unlock(&m->tmu);
  sv_secret_free(&old, &old_len);
}

/* GET /metrics: the exposition; anything else a short error, and
 * everything 401 without the token when one is configured. A request
 * body is read and ignored (MHD calls once more per piece of it). */
static enum MHD_Result on_request(void *cls, struct MHD_Connection *conn,
                                  const char *url, const char *method,
                                  const char *version,
                                  const char *upload_data,
                                  size_t *upload_data_size, void **con_cls) {
  static int seen;
  (void)version;
  (void)upload_data;
  if (!*con_cls) { /* headers only so far */
    *con_cls = &seen;
    return MHD_YES;
  }
  if (*upload_data_size) {
    *upload_data_size = 0;
    return MHD_YES;
  }
  if (!authorized(cls, conn))
    return reply(conn, MHD_HTTP_UNAUTHORIZED,
                 "unauthorized: send \"Authorization: Bearer TOKEN\" with "
                 "the token of --metrics-token-file\n");
  if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 &&
      strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
    return reply(conn, MHD_HTTP_METHOD_NOT_ALLOWED,
                 "method not allowed: GET /metrics\n");
  if (strcmp(url, "/metrics") != 0)
    return reply(conn, MHD_HTTP_NOT_FOUND,
                 "not found: the metrics are at /metrics\n");
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  if (!f) return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  render(cls, f);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad) {
    free(buf);
    return reply(conn, MHD_HTTP_INTERNAL_SERVER_ERROR, "out of memory\n");
  }
  /* MHD frees buf with free(), as open_memstream allocated it */
  struct MHD_Response *r =
      MHD_create_response_from_buffer(len, buf, MHD_RESPMEM_MUST_FREE);
  if (!r) {
    free(buf);
    return MHD_NO;
  }
  MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE,
                          "text/plain; version=0.0.4; charset=utf-8");
  enum MHD_Result rc = MHD_queue_response(conn, MHD_HTTP_OK, r);
  MHD_destroy_response(r);
  return rc;
}

/* libmicrohttpd's own complaints go to the server's log, in its format. */
static void mhd_log(void *cls, const char *fmt, va_list ap) {
  (void)cls;
  char msg[512];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t n = strlen(msg);
  while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r')) msg[--n] = '\0';
  sv_log(SV_LOG_WARN, "metrics endpoint: %s", msg);
}

/* ------------------------------------------------------------ lifecycle */

static void free_metrics(sv_metrics *m) {
  sv_secret_free(&m->token, &m->token_len);
  pthread_mutex_destroy(&m->tmu);
  pthread_cond_destroy(&m->ccv);
  pthread_mutex_destroy(&m->cmu);
  pthread_cond_destroy(&m->cv);
  pthread_mutex_destroy(&m->mu);
  dsp_free(m);
}

int sv_metrics_start(sv_server *srv) {
  const sv_config *cfg = srv->cfg;
  if (!cfg->metrics_host[0]) return 0;
  sv_metrics *m = dsp_calloc(1, sizeof *m);
  if (!m) return DISPATCH_ENOMEM;
  m->srv = srv;
  if (cfg->metrics_token) {
    m->token = dsp_malloc(cfg->metrics_token_len + 1);
    if (!m->token) {
      dsp_free(m);
      return DISPATCH_ENOMEM;
    }
    memcpy(m->token, cfg->metrics_token, cfg->metrics_token_len + 1);
    m->token_len = cfg->metrics_token_len;
  }
  struct timespec now;
  clock_gettime(CLOCK_REALTIME, &now);
  m->start_time = (double)now.tv_sec + (double)now.tv_nsec / 1e9;
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
  pthread_mutex_init(&m->mu, NULL);
  pthread_cond_init(&m->cv, &ca);
  pthread_mutex_init(&m->cmu, NULL);
  pthread_cond_init(&m->ccv, &ca);
  pthread_mutex_init(&m->tmu, NULL);
  pthread_condattr_destroy(&ca);
  if (uv_async_init(&srv->loop, &m->async, on_snapshot) != 0) {
    free_metrics(m);
    return DISPATCH_ENOMEM;
  }
  m->async.data = m;
  m->async_open = 1;
  m->loop_alive = 1;
  srv->metrics = m;
  const struct sockaddr *sa = (const struct sockaddr *)&cfg->metrics_addr;
  unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_AUTO |
                   MHD_USE_ERROR_LOG;
  if (sa->sa_family == AF_INET6) flags |= MHD_USE_IPv6;
  /* a few scrapers at a time, none holding a connection for long: 10 s
   * of silence, or REQUEST_DEADLINE_S for one request (the guard) */
  m->d = MHD_start_daemon(flags, 0, NULL, NULL, on_request, m,
                          MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
                          MHD_OPTION_SOCK_ADDR, sa,
                          MHD_OPTION_CONNECTION_LIMIT, (unsigned)MAX_SCRAPES,
                          MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)10,
                          MHD_OPTION_NOTIFY_CONNECTION, on_connection, m,
                          MHD_OPTION_NOTIFY_COMPLETED, on_completed, m,
                          MHD_OPTION_END);
  if (!m->d) {
    sv_log(SV_LOG_ERROR, "cannot serve metrics on %s:%d (--metrics-listen)",
           cfg->metrics_host, cfg->metrics_port);
    sv_metrics_loop_close(srv);
    return DISPATCH_EIO;
  }
  const union MHD_DaemonInfo *info =
      MHD_get_daemon_info(m->d, MHD_DAEMON_INFO_BIND_PORT);
  m->port = info ? info->port : cfg->metrics_port;
  if (pthread_create(&m->guard, NULL, guard_main, m) == 0) m->guard_on = 1;
  else
    sv_log(SV_LOG_WARN, "metrics endpoint: no thread to end slow requests; "
           "only %d s of silence ends one", 10);
  return 0;
}

void sv_metrics_announce(sv_server *srv) {
  sv_metrics *m = srv->metrics;
  if (!m || !m->d) return;
  char ip[64] = "?";
  const struct sockaddr *sa = (const struct sockaddr *)&srv->cfg->metrics_addr;
  if (sa->sa_family == AF_INET)
    uv_ip4_name((const struct sockaddr_in *)sa, ip, sizeof ip);
  else
    uv_ip6_name((const struct sockaddr_in6 *)sa, ip, sizeof ip);
  int v6 = sa->sa_family == AF_INET6;
  printf("dispatch-server metrics on %s%s%s:%d\n", v6 ? "[" : "", ip,
         v6 ? "]" : "", m->port);
  sv_log(SV_LOG_INFO, "metrics at http://%s%s%s:%d/metrics", v6 ? "[" : "",
         ip, v6 ? "]" : "", m->port);
}

static void on_async_closed(uv_handle_t *h) {
  sv_metrics *m = h->data;
  m->async_open = 0;
  if (!m->d) free_metrics(m); /* never served: nothing else holds it */
}

void sv_metrics_loop_close(sv_server *srv) {
  sv_metrics *m = srv->metrics;
  if (!m || !m->loop_alive) return;
  pthread_mutex_lock(&m->mu);
  m->loop_alive = 0;
  pthread_cond_broadcast(&m->cv);
  pthread_mutex_unlock(&m->mu);
  if (!m->d) srv->metrics = NULL; /* freed once the handle closes */
  uv_close((uv_handle_t *)&m->async, on_async_closed);
}

void sv_metrics_stop(sv_server *srv) {
  sv_metrics *m = srv->metrics;
  if (!m) return;
  if (m->guard_on) {
    pthread_mutex_lock(&m->cmu);
    m->guard_stop = 1;
    pthread_cond_signal(&m->ccv);
    pthread_mutex_unlock(&m->cmu);
    pthread_join(m->guard, NULL);
    m->guard_on = 0;
  }
  MHD_stop_daemon(m->d); /* joins its thread: no scrape runs after this */
  m->d = NULL;
  srv->metrics = NULL;
  if (!m->async_open) free_metrics(m);
  /* else the loop never closed the handle (it always does before it
   * ends): leaving m is safer than freeing a handle libuv still lists */
}
