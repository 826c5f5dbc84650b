/* Command line of dispatch-server. */
#include <errno.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <uv.h>

#include "sv.h"

void sv_config_defaults(sv_config *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->host, sizeof c->host, "127.0.0.1");
  c->port = 7070;
  c->max_frame = 1ULL << 30;          /* 1 GiB */
  c->max_msg = 16ULL << 20;           /* 16 MiB of protobuf */
  c->max_session_bytes = 4ULL << 30;  /* 4 GiB */
  /* 3/4 of the memory this process may use (a cgroup limit counts), so
   * sessions together cannot drive the machine into swap or the OOM
   * killer; 4 GiB when the system does not say */
  uint64_t mem = uv_get_constrained_memory();
  uint64_t phys = uv_get_total_memory();
  if (mem == 0 || (phys && mem > phys)) mem = phys;
  c->max_memory = mem ? mem / 4 * 3 : 4ULL << 30;
  c->max_queued_bytes = 256ULL << 20; /* 256 MiB */
  c->max_elements = 1ULL << 31;
  c->max_output_queue = 64ULL << 20;  /* 64 MiB */
  c->storage_cache = 512ULL << 20;    /* 512 MiB */
  c->session_cache = 64ULL << 20;     /* 64 MiB */
  /* 2^34: admits a 2048^3 matmul (8.6e9) twice over and every op the
   * examples, tests and make bench run (the largest, bench's 2048 matmul,
   * is half of it), refuses a 512x512-window pool at stride 1 on a
   * 1024x1024 input (6.9e10), which would hold a worker for minutes */
  c->max_op_cost = 1ULL << 34;
  /* 2^38: sixteen ops at the per-op default; a replay is one job on one
   * worker, so this is how long one request may hold it */
  c->max_replay_cost = 1ULL << 38;
  c->inline_cost = SV_INLINE_COST_DEFAULT;
  c->loop_spin_us = SV_LOOP_SPIN_US_DEFAULT;
  c->max_queued = 4096;
  c->max_sessions = 64;
  c->idle_timeout_s = 600;
  c->frame_timeout_s = 300;
  unsigned n = uv_available_parallelism();
  c->threads = n < 1 ? 1 : n > 64 ? 64 : (int)n;
  c->log_level = SV_LOG_INFO;
  c->handshake_timeout_s = 10;
  c->drain_timeout_s = 30;
  c->session_grace_s = 60;
}

void sv_config_release(sv_config *c) {
  if (c->token) {
    memset(c->token, 0, c->token_len);
    dsp_free(c->token);
  }
  c->token = NULL;
  c->token_len = 0;
}

int sv_addr_is_loopback(const struct sockaddr *sa) {
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *a4 = (const struct sockaddr_in *)sa;
    return (ntohl(a4->sin_addr.s_addr) >> 24) == 127;
  }
  if (sa->sa_family == AF_INET6) {
    const struct in6_addr *a6 = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    if (IN6_IS_ADDR_LOOPBACK(a6)) return 1;
    return IN6_IS_ADDR_V4MAPPED(a6) && a6->s6_addr[12] == 127;
  }
  return 0;
}

/* Reads the token file: its contents less one trailing newline (and a
 * CR before it). An empty token would accept anyone, so it is refused. */
static int read_token(sv_config *c, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "dispatch-server: --token-file %s: %s\n", path,
            strerror(errno));
    return -1;
  }
  char buf[4097];
  size_t n = fread(buf, 1, sizeof buf, f);
  int err = ferror(f);
  fclose(f);
  if (err || n == sizeof buf) {
    fprintf(stderr, "dispatch-server: --token-file %s: %s\n", path,
            err ? "read error" : "longer than 4096 bytes");
    return -1;
  }
  if (n > 0 && buf[n - 1] == '\n') n--;
  if (n > 0 && buf[n - 1] == '\r') n--;
  if (n == 0) {
    fprintf(stderr, "dispatch-server: --token-file %s is empty\n", path);
    return -1;
  }
  sv_config_release(c);
  c->token = dsp_malloc(n + 1);
  if (!c->token) {
    fprintf(stderr, "dispatch-server: out of memory reading the token\n");
    return -1;
  }
  memcpy(c->token, buf, n);
  c->token[n] = '\0';
  c->token_len = n;
  memset(buf, 0, sizeof buf);
  return 0;
}

static const char *const g_usage =
    "usage: dispatch-server [options]\n"
    "Values: --opt VALUE or --opt=VALUE. BYTES take K, M, G or T (or KiB,\n"
    "...), powers of 1024 (8G = 8589934592); N of --max-elements,\n"
    "--max-op-cost and --max-replay-cost the same letters as powers of\n"
    "1000 (2G = 2e9).\n"
    "  --listen HOST:PORT       address to listen on (default 127.0.0.1:7070;\n"
    "                           port 0 picks a free port, printed on stdout);\n"
    "                           HOST: an IP, [IPv6] or a name, resolved at\n"
    "                           start (the first address is bound); a plain\n"
    "                           bind needs every address loopback\n"
    "  --max-frame BYTES        largest frame, message + bulk (default 1 GiB)\n"
    "  --max-session-bytes BYTES  bytes one session may make the server hold:\n"
    "                           tensors named or not (autodiff tape,\n"
    "                           gradients, uploads being read), kernel\n"
    "                           scratch, ids (default 4 GiB)\n"
    "  --max-memory BYTES       all sessions and their queued requests\n"
    "                           together (default 3/4 of physical or cgroup\n"
    "                           memory); the storage cache comes on top\n"
    "  --device NAME            a device to host, repeatable: cpu, cpu:N\n"
    "                           (several CPU devices, each counted apart,\n"
    "                           see --device-memory), cuda:N, or all\n"
    "                           (default: cpu); clients pick one by name\n"
    "  --device-memory BYTES    each device's own budget for the tensors\n"
    "                           stored on it (default: none; all devices\n"
    "                           together within --max-memory)\n"
    "  --max-queued-bytes BYTES decoded requests one session may have\n"
    "                           waiting; past it the server stops reading\n"
    "                           the session until they ran (256 MiB)\n"
    "  --max-sessions N         concurrent sessions, detached ones kept\n"
    "                           for a resume included, though at the limit\n"
    "                           these are expired for a new one (default 64)\n"
    "  --idle-timeout SECONDS   close idle sessions, 0 never (default 600);\n"
    "                           idle time counts from the last complete\n"
    "                           request\n"
    "  --frame-timeout SECONDS  a frame must arrive whole within this time\n"
    "                           from its first byte, 0 never (default 300)\n"
    "  --threads N              worker threads running kernels (default: cores)\n"
    "  --max-output-queue BYTES unsent replies, with the server's bookkeeping\n"
    "                           of each (~150 bytes), before a client is\n"
    "                           dropped (default 64 MiB)\n"
    "  --max-elements N         elements of one tensor, counting a zero\n"
    "                           size as 1 ([N, 0] spans N) (default 2^31)\n"
    "  --max-op-cost N          estimated elementary operations of one op\n"
    "                           (matmul m*n*k, conv out*C*kh*kw, pool\n"
    "                           out*kh*kw, ...), backward ops included; over\n"
    "                           it the op fails with DISPATCH_ELIMIT; 0 no\n"
    "                           limit (default 2^34, about 1.7e10)\n"
    "  --max-replay-cost N      the same for one graph replay, all its ops\n"
    "                           and nodes together (each node counts at\n"
    "                           least 512); over it the replay fails with\n"
    "                           DISPATCH_ELIMIT, a definition that must\n"
    "                           pass it is refused; 0 no limit (default\n"
    "                           2^38)\n"
    "  --inline-cost N          an op of an idle session whose estimated\n"
    "                           work (as --max-op-cost counts it) is at\n"
    "                           most N runs on the network thread, saving\n"
    "                           two thread wake-ups; 0 never, at most\n"
    "                           2^20 = 1048576 (default 2^14 = 16384)\n"
    "  --loop-spin-us N         after answering a request itself, the\n"
    "                           network thread polls the sockets without\n"
    "                           sleeping for N microseconds, so a client's\n"
    "                           next request costs it no wake-up; 0 never,\n"
    "                           at most 10000 (default 50)\n"
    "  --max-queued N           requests buffered per session before the\n"
    "                           server stops reading it (default 4096)\n"
    "  --storage-cache BYTES    freed tensor storage (blocks of 1 MiB and\n"
    "                           more) the server keeps for reuse instead of\n"
    "                           returning it to the OS, 0 none (default\n"
    "                           512 MiB): fresh pages fault on first touch\n"
    "  --session-cache BYTES    each session's free lists of freed tensor\n"
    "                           storage and headers (by size class), charged\n"
    "                           to the session and given back when a quota\n"
    "                           needs the room, 0 none (default 64 MiB)\n"
    "  --handshake-timeout SECONDS  TLS handshake + hello must finish in\n"
    "                           this time, 0 never (default 10)\n"
    "  --drain-timeout SECONDS  on SIGTERM/SIGINT, run and answer the requests\n"
    "                           already received for at most this long, then\n"
    "                           cancel the rest; 0 no wait (default 30)\n"
    "  --session-grace SECONDS  keep a dropped session for a resume (60)\n"
    "  --tls-cert FILE          serve TLS with this certificate (PEM chain)\n"
    "  --tls-key FILE           private key of --tls-cert\n"
    "  --tls-client-ca FILE     mutual TLS: require a client certificate\n"
    "                           signed by this CA\n"
    "  --token-file FILE        clients must send this token in hello\n"
    "  --insecure               allow a non-loopback --listen without both\n"
    "                           TLS and a token, and a non-loopback\n"
    "                           --metrics-listen\n"
    "  --log-level error|warn|info|debug  stderr log level (default info)\n"
    "  --log-format text|json   log lines as text (default) or one JSON\n"
    "                           object a line (ts, level, msg, and session\n"
    "                           and peer where the line has them); times\n"
    "                           are ISO-8601 UTC with milliseconds\n"
    "  --metrics-listen HOST:PORT  serve Prometheus metrics over HTTP at\n"
    "                           /metrics (default: off; port 0 picks a free\n"
    "                           port, printed on stdout); HOST as for\n"
    "                           --listen, loopback only unless --insecure\n"
    "  --version                print the version and exit\n"
    "  --help                   this text\n";


static void put_err(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void put_err(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fputs("dispatch-server: ", stderr);
  vfprintf(stderr, fmt, ap);
  fputs("\n", stderr);
  va_end(ap);
}

/* Reads the leading decimal digits of s into *v and *end past them; 0,
 * -1 when s does not start with a digit, -2 when the number does not fit
 * 64 bits. strtoull is not
 * used: it takes a sign, leading spaces and wraps "-1" to 2^64-1. */
static int read_digits(const char *s, const char **end, uint64_t *v) {
  if (*s < '0' || *s > '9') return -1;
  uint64_t n = 0;
  for (; *s >= '0' && *s <= '9'; s++) {
    unsigned d = (unsigned)(*s - '0');
    if (n > (UINT64_MAX - d) / 10) return -2;
    n = n * 10 + d;
  }
  *end = s;
  *v = n;
  return 0;
}

/* Parses NUMBER[SUFFIX] into *out within [min, max]. SUFFIX is one of
 * K, M, G, T (either case); for sizes an optional "iB" (KiB) or "B" (KB)
 * may follow;
 * base is 1024 for sizes, 1000 for counts, 0 when no suffix is allowed.
 * On failure prints one line naming opt and the value, and returns -1. */
static int parse_num(const char *opt, const char *s, unsigned base,
                     uint64_t min, uint64_t max, uint64_t *out) {
  const char *what = base == 1024 ? "a size in bytes (a number with an "
                                    "optional K, M, G or T suffix, powers "
                                    "of 1024: 512M, 8G, 64KiB)"
                     : base == 1000 ? "a count (a number with an optional "
                                      "K, M, G or T suffix, powers of 1000: "
                                      "2G = 2000000000)"
                                    : "a whole number";
  const char *end;
  uint64_t v;
  int r = read_digits(s, &end, &v);
  if (r == -2) goto range;
  if (r < 0) goto bad;
  unsigned shift = 0;
  if (base && *end) {
    const char *units = "KMGT";
    const char *u = strchr(units, *end >= 'a' ? *end - 'a' + 'A' : *end);
    if (!u || !*u) goto bad;
    shift = (unsigned)(u - units) + 1;
    end++;
    /* bytes may say so (KiB, KB: both 1024 here); counts may not */
    if (base == 1024 && strcmp(end, "iB") == 0) end += 2;
    else if (base == 1024 && strcmp(end, "B") == 0) end++;
  }
  if (*end) goto bad;
  for (unsigned i = 0; i < shift; i++) {
    if (v > UINT64_MAX / base) goto range;
    v *= base;
  }
  if (v < min || v > max) goto range;
  *out = v;
  return 0;
bad:
  put_err("%s: '%s' is not %s", opt, s, what);
  return -1;
range:
  put_err("%s: '%s' is out of range: %s must be in [%llu, %llu]", opt, s,
          opt, (unsigned long long)min, (unsigned long long)max);
  return -1;
}

static int parse_size(const char *opt, const char *s, uint64_t min,
                      uint64_t max, uint64_t *out) {
  return parse_num(opt, s, 1024, min, max, out);
}

static int parse_int(const char *opt, const char *s, uint64_t min,
                     uint64_t max, int *out) {
  uint64_t v;
  if (parse_num(opt, s, 0, min, max, &v) < 0) return -1;
  *out = (int)v;
  return 0;
}

/* Formats sa as "IP" for messages. */
static void addr_name(const struct sockaddr *sa, char *buf, size_t len) {
  snprintf(buf, len, "?");
  if (sa->sa_family == AF_INET)
    uv_ip4_name((const struct sockaddr_in *)sa, buf, len);
  else if (sa->sa_family == AF_INET6)
    uv_ip6_name((const struct sockaddr_in6 *)sa, buf, len);
}

/* Splits HOST:PORT (HOST may be [IPv6]) into host (hlen bytes) and *port;
 * opt names the option in messages. A bare IPv6 literal with its port
 * ("::1:7070") is refused: which colon starts the port would be a guess. */
static int split_hostport(const char *opt, const char *s, char *host,
                          size_t hlen_max, int *port) {
  const char *h = s, *colon;
  size_t hl;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':') goto bad;
    h = s + 1;
    hl = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon) goto bad;
    hl = (size_t)(colon - s);
    if (memchr(s, ':', hl)) {
      put_err("%s: '%s': write an IPv6 address in brackets, "
              "[ADDR]:PORT", opt, s);
      return -1;
    }
  }
  if (hl == 0 || hl >= hlen_max) goto bad;
  memcpy(host, h, hl);
  host[hl] = '\0';
  char what[64];
  snprintf(what, sizeof what, "%s port", opt);
  return parse_int(what, colon + 1, 0, 65535, port);
bad:
  put_err("%s: '%s' is not HOST:PORT (127.0.0.1:7070, "
          "localhost:7070, [::1]:7070)", opt, s);
  return -1;
}

/* Resolves host with libuv's resolver (a private loop: nothing else runs
 * yet) into *out with port, the first address, which is the one bound.
 * *all_loopback says whether every address the name has is a loopback
 * one: a name that resolves partly elsewhere is not loopback. names gets
 * the addresses, for the refusal message; opt names the option. */
static int resolve_host(const char *opt, const char *host, int port,
                        struct sockaddr_storage *out, int *all_loopback,
                        char *names, size_t nlen) {
  uv_loop_t loop;
  uv_getaddrinfo_t req;
  struct addrinfo hints;
  memset(&hints, 0, sizeof hints);
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  if (uv_loop_init(&loop) != 0) {
    put_err("%s: cannot start a resolver loop", opt);
    return -1;
  }
  /* no callback: libuv resolves synchronously */
  int rc = uv_getaddrinfo(&loop, &req, NULL, host, NULL, &hints);
  uv_loop_close(&loop);
  if (rc != 0) {
    put_err("%s: cannot resolve '%s': %s", opt, host, uv_strerror(rc));
    return -1;
  }
  *all_loopback = 1;
  names[0] = '\0';
  size_t used = 0;
  int first = 1;
  for (struct addrinfo *ai = req.addrinfo; ai; ai = ai->ai_next) {
    if (ai->ai_family != AF_INET && ai->ai_family != AF_INET6) continue;
    if (ai->ai_addrlen > sizeof *out) continue;
    if (first) {
      memcpy(out, ai->ai_addr, ai->ai_addrlen);
      first = 0;
    }
    if (!sv_addr_is_loopback(ai->ai_addr)) *all_loopback = 0;
    char ip[64];
    addr_name(ai->ai_addr, ip, sizeof ip);
    if (used < nlen && !strstr(names, ip))
      used += (size_t)snprintf(names + used, nlen - used, "%s%s",
                               used ? ", " : "", ip);
  }
  uv_freeaddrinfo(req.addrinfo);
  if (first) {
    put_err("%s: '%s' has no IPv4 or IPv6 address", opt, host);
    return -1;
  }
  if (out->ss_family == AF_INET)
    ((struct sockaddr_in *)out)->sin_port = htons((uint16_t)port);
  else
    ((struct sockaddr_in6 *)out)->sin6_port = htons((uint16_t)port);
  return 0;
}

/* "HOST" or "HOST (ADDR, ADDR)" when the name is not its one address. */
static void shown_name(const char *host, const char *names, char *buf,
                       size_t len) {
  if (strcmp(host, names) == 0) snprintf(buf, len, "%s", host);
  else snprintf(buf, len, "%s (%s)", host, names);
}

/* Values of the long options that have no short form. */
enum {
  O_LISTEN = 256, O_MAX_FRAME, O_MAX_SESSION_BYTES, O_MAX_MEMORY, O_DEVICE,
  O_DEVICE_MEMORY, O_MAX_QUEUED_BYTES, O_MAX_SESSIONS, O_IDLE_TIMEOUT,
  O_FRAME_TIMEOUT, O_THREADS, O_MAX_OUTPUT_QUEUE, O_MAX_ELEMENTS,
  O_MAX_OP_COST, O_STORAGE_CACHE, O_SESSION_CACHE, O_MAX_QUEUED, O_HANDSHAKE_TIMEOUT,
  O_TLS_CERT, O_TLS_KEY, O_TLS_CLIENT_CA, O_TOKEN_FILE, O_INSECURE,
  O_LOG_LEVEL, O_VERSION, O_METRICS_LISTEN, O_LOG_FORMAT, O_DRAIN_TIMEOUT,
  O_SESSION_GRACE, O_INLINE_COST, O_LOOP_SPIN_US, O_MAX_REPLAY_COST
};

static const struct option g_opts[] = {
    {"listen", required_argument, NULL, O_LISTEN},
    {"max-frame", required_argument, NULL, O_MAX_FRAME},
    {"max-session-bytes", required_argument, NULL, O_MAX_SESSION_BYTES},
    {"max-memory", required_argument, NULL, O_MAX_MEMORY},
    {"device", required_argument, NULL, O_DEVICE},
    {"device-memory", required_argument, NULL, O_DEVICE_MEMORY},
    {"max-queued-bytes", required_argument, NULL, O_MAX_QUEUED_BYTES},
    {"max-sessions", required_argument, NULL, O_MAX_SESSIONS},
    {"idle-timeout", required_argument, NULL, O_IDLE_TIMEOUT},
    {"frame-timeout", required_argument, NULL, O_FRAME_TIMEOUT},
    {"threads", required_argument, NULL, O_THREADS},
    {"max-output-queue", required_argument, NULL, O_MAX_OUTPUT_QUEUE},
    {"max-elements", required_argument, NULL, O_MAX_ELEMENTS},
    {"max-op-cost", required_argument, NULL, O_MAX_OP_COST},
    {"max-replay-cost", required_argument, NULL, O_MAX_REPLAY_COST},
    {"inline-cost", required_argument, NULL, O_INLINE_COST},
    {"loop-spin-us", required_argument, NULL, O_LOOP_SPIN_US},
    {"storage-cache", required_argument, NULL, O_STORAGE_CACHE},
    {"session-cache", required_argument, NULL, O_SESSION_CACHE},
    {"max-queued", required_argument, NULL, O_MAX_QUEUED},
    {"handshake-timeout", required_argument, NULL, O_HANDSHAKE_TIMEOUT},
    {"drain-timeout", required_argument, NULL, O_DRAIN_TIMEOUT},
    {"session-grace", required_argument, NULL, O_SESSION_GRACE},
    {"tls-cert", required_argument, NULL, O_TLS_CERT},
    {"tls-key", required_argument, NULL, O_TLS_KEY},
    {"tls-client-ca", required_argument, NULL, O_TLS_CLIENT_CA},
    {"token-file", required_argument, NULL, O_TOKEN_FILE},
    {"insecure", no_argument, NULL, O_INSECURE},
    {"log-level", required_argument, NULL, O_LOG_LEVEL},
    {"log-format", required_argument, NULL, O_LOG_FORMAT},
    {"metrics-listen", required_argument, NULL, O_METRICS_LISTEN},
    {"version", no_argument, NULL, O_VERSION},
    {"help", no_argument, NULL, 'h'},
    {NULL, 0, NULL, 0},
};

static const char *opt_name(int val) {
  for (const struct option *o = g_opts; o->name; o++)
    if (o->val == val) return o->name;
  return "?";
}

/* Applies one option; 0, 1 to stop with exit status 0 (--help,
 * --version), -1 after printing why. */
static int apply(sv_config *c, int val, const char *v) {
  uint64_t n;
  char name[40];
  snprintf(name, sizeof name, "--%s", opt_name(val));
  switch (val) {
  case 'h':
    fputs(g_usage, stdout);
    return 1;
  case O_VERSION:
    printf("dispatch-server %s\n", DISPATCH_VERSION_STRING);
    return 1;
  case O_INSECURE:
    c->insecure = 1;
    return 0;
  case O_LISTEN:
    return split_hostport("--listen", v, c->host, sizeof c->host, &c->port);
  case O_METRICS_LISTEN:
    return split_hostport("--metrics-listen", v, c->metrics_host,
                          sizeof c->metrics_host, &c->metrics_port);
  case O_MAX_FRAME:
    return parse_size(name, v, 64, 1ULL << 40, &c->max_frame);
  case O_MAX_SESSION_BYTES:
    return parse_size(name, v, 0, 1ULL << 50, &c->max_session_bytes);
  case O_MAX_MEMORY:
    return parse_size(name, v, 0, 1ULL << 50, &c->max_memory);
  case O_DEVICE:
    if (c->n_devices == SV_MAX_DEVICES) {
      put_err("at most %d --device options", SV_MAX_DEVICES);
      return -1;
    }
    c->devices[c->n_devices++] = v;
    return 0;
  case O_DEVICE_MEMORY:
    return parse_size(name, v, 0, 1ULL << 50, &c->device_memory);
  case O_MAX_QUEUED_BYTES:
    return parse_size(name, v, 0, 1ULL << 50, &c->max_queued_bytes);
  case O_MAX_SESSIONS:
    return parse_int(name, v, 1, 100000, &c->max_sessions);
  case O_IDLE_TIMEOUT:
    return parse_int(name, v, 0, 86400 * 365, &c->idle_timeout_s);
  case O_FRAME_TIMEOUT:
    return parse_int(name, v, 0, 86400, &c->frame_timeout_s);
  case O_THREADS:
    return parse_int(name, v, 1, 256, &c->threads);
  case O_MAX_OUTPUT_QUEUE:
    return parse_size(name, v, 0, 1ULL << 40, &c->max_output_queue);
  case O_MAX_ELEMENTS:
    return parse_num(name, v, 1000, 1, 1ULL << 50, &c->max_elements);
  case O_MAX_OP_COST:
    return parse_num(name, v, 1000, 0, UINT64_MAX, &c->max_op_cost);
  case O_MAX_REPLAY_COST:
    return parse_num(name, v, 1000, 0, UINT64_MAX, &c->max_replay_cost);
  case O_INLINE_COST:
    return parse_num(name, v, 1000, 0, SV_INLINE_COST_MAX, &c->inline_cost);
  case O_LOOP_SPIN_US: {
    int us;
    int rc = parse_int(name, v, 0, SV_LOOP_SPIN_US_MAX, &us);
    if (rc == 0) c->loop_spin_us = (uint32_t)us;
    return rc;
  }
  case O_STORAGE_CACHE:
    return parse_size(name, v, 0, 1ULL << 50, &c->storage_cache);
  case O_SESSION_CACHE:
    return parse_size(name, v, 0, 1ULL << 50, &c->session_cache);
  case O_MAX_QUEUED:
    if (parse_num(name, v, 0, 1, 1u << 24, &n) < 0) return -1;
    c->max_queued = (uint32_t)n;
    return 0;
  case O_DRAIN_TIMEOUT:
    return parse_int(name, v, 0, 86400, &c->drain_timeout_s);
  case O_HANDSHAKE_TIMEOUT:
    return parse_int(name, v, 0, 3600, &c->handshake_timeout_s);
  case O_SESSION_GRACE:
    return parse_int(name, v, 0, 86400, &c->session_grace_s);
  case O_TLS_CERT:
    c->tls_cert = v;
    return 0;
  case O_TLS_KEY:
    c->tls_key = v;
    return 0;
  case O_TLS_CLIENT_CA:
    c->tls_client_ca = v;
    return 0;
  case O_TOKEN_FILE:
    return read_token(c, v);
  case O_LOG_LEVEL: {
    int l = sv_log_parse_level(v);
    if (l < 0) {
      put_err("--log-level takes error, warn, info or debug, got '%s'", v);
      return -1;
    }
    c->log_level = l;
    return 0;
  }
  case O_LOG_FORMAT: {
    int f = sv_log_parse_format(v);
    if (f < 0) {
      put_err("--log-format takes text or json, got '%s'", v);
      return -1;
    }
    c->log_format = f;
    return 0;
  }
  }
  return -1;
}

/* Parses argv with getopt_long (--opt value, --opt=value, unambiguous
 * prefixes), then checks the options together and resolves --listen, so
 * every refusal happens before anything binds. */
int sv_config_parse(sv_config *c, int argc, char **argv) {
  opterr = 0; /* our messages name the option and point at --help */
  optind = 0; /* glibc: a full reset, so parsing twice works */
  for (;;) {
    int prev = optind ? optind : 1;
    int val = getopt_long(argc, argv, ":h", g_opts, NULL);
    if (val == -1) break;
    const char *arg = prev < argc ? argv[prev] : "";
    if (val == ':') {
      put_err("%s needs a value (see --help)", arg);
      return -1;
    }
    if (val == '?') {
      int is_long = strncmp(arg, "--", 2) == 0;
      if (is_long && optopt) /* a known flag given a value: --version=1 */
        put_err("--%s takes no value, got '%s' (see --help)",
                opt_name(optopt), arg);
      else if (optopt)
        put_err("unknown option '-%c' (see --help)", optopt);
      else
        put_err("unknown or ambiguous option '%s' (see --help)", arg);
      return -1;
    }
    int r = apply(c, val, optarg);
    if (r != 0) return r;
  }
  if (optind < argc) {
    put_err("unexpected argument '%s' (options start with --; see --help)",
            argv[optind]);
    return -1;
  }
  if (c->max_msg > c->max_frame) c->max_msg = c->max_frame;
  if (!c->tls_cert != !c->tls_key) {
    put_err("--tls-cert and --tls-key go together");
    return -1;
  }
  if (c->tls_client_ca && !c->tls_cert) {
    put_err("--tls-client-ca needs --tls-cert and --tls-key");
    return -1;
  }
  int loopback;
  char names[256];
  if (resolve_host("--listen", c->host, c->port, &c->listen_addr, &loopback,
                   names, sizeof names) < 0)
    return -1;
  char shown[600];
  shown_name(c->host, names, shown, sizeof shown);
  /* refused here, before anything binds */
  if (!loopback && !(c->tls_cert && c->token) && !c->insecure) {
    put_err("refusing to listen on %s without both TLS "
            "(--tls-cert/--tls-key) and a token (--token-file): anyone who "
            "can reach this address could run code and read tensors. Add "
            "them, listen on 127.0.0.1, or pass --insecure to accept the "
            "risk.",
            shown);
    return -1;
  }
  if (!loopback && !(c->tls_cert && c->token))
    put_err("warning: --insecure: listening on %s without %s", shown,
            c->tls_cert ? "a token" : c->token ? "TLS" : "TLS or a token");
  if (!c->metrics_host[0]) return 0;
  /* the metrics endpoint is plain HTTP with no authentication: the same
   * rule as a plain --listen, with the same override */
  if (resolve_host("--metrics-listen", c->metrics_host, c->metrics_port,
                   &c->metrics_addr, &loopback, names, sizeof names) < 0)
    return -1;
  shown_name(c->metrics_host, names, shown, sizeof shown);
  if (!loopback && !c->insecure) {
    put_err("refusing to serve metrics on %s: the endpoint is plain HTTP "
            "without authentication and tells anyone who reaches it how the "
            "server is used. Use a loopback address (127.0.0.1:9090) and a "
            "local scraper or proxy, or pass --insecure to accept the risk.",
            shown);
    return -1;
  }
  if (!loopback)
    put_err("warning: --insecure: serving metrics on %s without TLS or "
            "authentication", shown);
  return 0;
}
