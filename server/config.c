/* Command line of dispatch-server. */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <unistd.h>
#include <uv.h>

#include "sv.h"

void sv_secret_free(char **s, size_t *len) {
  if (*s) {
    memset(*s, 0, *len);
    dsp_free(*s);
  }
  *s = NULL;
  *len = 0;
}

void sv_config_release(sv_config *c) {
  sv_secret_free(&c->token, &c->token_len);
  sv_secret_free(&c->metrics_token, &c->metrics_token_len);
  sv_secret_free(&c->peer_token, &c->peer_token_len);
  if (c->checkpoint_fd >= 0) close(c->checkpoint_fd);
  c->checkpoint_fd = -1;
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

/* A token file: its contents less one trailing newline (and a CR before
 * it). An empty token would accept anyone, so it is refused. */
int sv_secret_read(const char *path, char **out, size_t *out_len, char *why,
                   size_t len) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(why, len, "%s: %s", path, strerror(errno));
    return -1;
  }
  char buf[4097];
  size_t n = fread(buf, 1, sizeof buf, f);
  int err = ferror(f);
  fclose(f);
  if (err || n == sizeof buf) {
    snprintf(why, len, "%s: %s", path,
             err ? "read error" : "longer than 4096 bytes");
    memset(buf, 0, sizeof buf);
    return -1;
  }
  if (n > 0 && buf[n - 1] == '\n') n--;
  if (n > 0 && buf[n - 1] == '\r') n--;
  if (n == 0) {
    snprintf(why, len, "%s is empty", path);
    return -1;
  }
  char *t = dsp_malloc(n + 1);
  if (!t) {
    snprintf(why, len, "%s: out of memory reading the token", path);
    memset(buf, 0, sizeof buf);
    return -1;
  }
  memcpy(t, buf, n);
  t[n] = '\0';
  memset(buf, 0, sizeof buf);
  *out = t;
  *out_len = n;
  return 0;
}

/* --token-file and --metrics-token-file: the file is read now (a bad one
 * stops the server before it binds) and its path kept for SIGHUP. */
static int set_secret(const char *opt, const char *path, const char **file,
                      char **tok, size_t *tok_len) {
  char why[600], *t;
  size_t n;
  if (sv_secret_read(path, &t, &n, why, sizeof why) < 0) {
    fprintf(stderr, "dispatch-server: %s %s\n", opt, why);
    return -1;
  }
  sv_secret_free(tok, tok_len);
  *tok = t;
  *tok_len = n;
  *file = path;
  return 0;
}

static int read_token(sv_config *c, const char *path) {
  return set_secret("--token-file", path, &c->token_file, &c->token,
                    &c->token_len);
}

static int read_metrics_token(sv_config *c, const char *path) {
  return set_secret("--metrics-token-file", path, &c->metrics_token_file,
                    &c->metrics_token, &c->metrics_token_len);
}

static int read_peer_token(sv_config *c, const char *path) {
  return set_secret("--peer-token-file", path, &c->peer_token_file,
                    &c->peer_token, &c->peer_token_len);
}

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

/* ------------------------------------------------------------ options */

/* How a row's value is read and where it goes. */
typedef enum opt_type {
  OPT_BYTES, /* parse_num base 1024 into the field (uint64_t) */
  OPT_COUNT, /* parse_num base 1000 into the field (uint64_t) */
  OPT_INT,   /* a whole number into the field (int or uint32_t) */
  OPT_PATH,  /* the value itself (it points into argv) */
  OPT_FLAG,  /* no value: the field (int) becomes 1 */
  OPT_FN,    /* the row's own setter */
} opt_type;

/* One option of the command line: the getopt table, the --help text, the
 * defaults and the step that applies a value all come from these rows. */
typedef struct opt_row {
  const char *name; /* without the leading "--" */
  const char *arg;  /* its value's name in --help; NULL: takes no value */
  opt_type type;
  uint64_t min, max; /* bounds of a number */
  size_t off, size;  /* the sv_config field (not OPT_FN) */
  uint64_t dflt;     /* a number's default (0 when the row has dflt_fn) */
  uint64_t (*dflt_fn)(void); /* a default computed at start */
  /* OPT_FN: applies v (NULL for a row without a value): 0, 1 to stop with
   * exit status 0 (--help, --version), -1 after printing why */
  int (*set)(sv_config *c, const char *v);
  const char *dflt_value; /* OPT_FN: the value applied as the default */
  const char *help; /* --help lines, '\n' between them */
} opt_row;

#define FIELD(f) offsetof(sv_config, f), sizeof(((sv_config *)0)->f)

/* 3/4 of the memory this process may use (a cgroup limit counts), so
 * sessions together cannot drive the machine into swap or the OOM killer;
 * 4 GiB when the system does not say */
static uint64_t default_max_memory(void) {
  uint64_t mem = uv_get_constrained_memory();
  uint64_t phys = uv_get_total_memory();
  if (mem == 0 || (phys && mem > phys)) mem = phys;
  return mem ? mem / 4 * 3 : 4ULL << 30;
}

static uint64_t default_threads(void) {
  unsigned n = uv_available_parallelism();
  return n < 1 ? 1 : n > 64 ? 64 : n;
}

static int set_listen(sv_config *c, const char *v) {
  return split_hostport("--listen", v, c->host, sizeof c->host, &c->port);
}

static int set_metrics_listen(sv_config *c, const char *v) {
  return split_hostport("--metrics-listen", v, c->metrics_host,
                        sizeof c->metrics_host, &c->metrics_port);
}

static int set_device(sv_config *c, const char *v) {
  if (c->n_devices == SV_MAX_DEVICES) {
    put_err("at most %d --device options", SV_MAX_DEVICES);
    return -1;
  }
  c->devices[c->n_devices++] = v;
  return 0;
}

/* --peer NAME=ADDR: NAME as a peer's grants carry it (its --name), ADDR
 * HOST:PORT as --listen takes it, resolved at each pull */
static int set_peer(sv_config *c, const char *v) {
  const char *eq = strchr(v, '=');
  char host[256];
  int port;
  if (!eq || eq == v || eq - v > 64) {
    put_err("--peer: '%s' is not NAME=HOST:PORT (NAME: 1 to 64 bytes)", v);
    return -1;
  }
  if (split_hostport("--peer", eq + 1, host, sizeof host, &port) < 0)
    return -1;
  for (int i = 0; i < c->n_peers; i++)
    if (strncmp(c->peers[i], v, (size_t)(eq - v) + 1) == 0) {
      put_err("--peer: '%.*s' is named twice", (int)(eq - v), v);
      return -1;
    }
  if (c->n_peers == SV_MAX_PEERS) {
    put_err("at most %d --peer options", SV_MAX_PEERS);
    return -1;
  }
  c->peers[c->n_peers++] = v;
  return 0;
}

static int set_log_level(sv_config *c, const char *v) {
  int l = sv_log_parse_level(v);
  if (l < 0) {
    put_err("--log-level takes error, warn, info or debug, got '%s'", v);
    return -1;
  }
  c->log_level = l;
  return 0;
}

static int set_log_format(sv_config *c, const char *v) {
  int f = sv_log_parse_format(v);
  if (f < 0) {
    put_err("--log-format takes text or json, got '%s'", v);
    return -1;
  }
  c->log_format = f;
  return 0;
}

static int set_version(sv_config *c, const char *v) {
  printf("dispatch-server %s\n", DISPATCH_VERSION_STRING);
  return 1;
}

static int set_help(sv_config *c, const char *v);

/* 2^34 for --max-op-cost admits a 2048^3 matmul (8.6e9) twice over and
 * every op the examples, tests and make bench run (the largest, bench's
 * 2048 matmul, is half of it), and refuses a 512x512-window pool at
 * stride 1 on a 1024x1024 input (6.9e10), which would hold a worker for
 * minutes. 2^38 for --max-replay-cost: sixteen ops at the per-op
 * default; a replay is one job on one worker, so this is how long one
 * request may hold it. */
static const opt_row g_rows[] = {
    {"listen", "HOST:PORT", OPT_FN, .set = set_listen,
     .dflt_value = "127.0.0.1:7070",
     .help = "address to listen on (default 127.0.0.1:7070;\n"
             "port 0 picks a free port, printed on stdout);\n"
             "HOST: an IP, [IPv6] or a name, resolved at\n"
             "start (the first address is bound); a plain\n"
             "bind needs every address loopback"},
    {"max-frame", "BYTES", OPT_BYTES, 64, 1ULL << 40, FIELD(max_frame),
     1ULL << 30, .help = "largest frame, message + bulk (default 1 GiB)"},
    {"max-session-bytes", "BYTES", OPT_BYTES, 0, 1ULL << 50,
     FIELD(max_session_bytes), 4ULL << 30,
     .help = "bytes one session may make the server hold:\n"
             "tensors named or not (autodiff tape,\n"
             "gradients, uploads being read), kernel\n"
             "scratch, ids (default 4 GiB)"},
    {"max-memory", "BYTES", OPT_BYTES, 0, 1ULL << 50, FIELD(max_memory),
     .dflt_fn = default_max_memory,
     .help = "all sessions and their queued requests\n"
             "together (default 3/4 of physical or cgroup\n"
             "memory); the storage cache comes on top"},
    {"device", "NAME", OPT_FN, .set = set_device,
     .help = "a device to host, repeatable: cpu, cpu:N\n"
             "(several CPU devices, each counted apart,\n"
             "see --device-memory), cuda:N, or all\n"
             "(default: cpu); clients pick one by name"},
    {"device-memory", "BYTES", OPT_BYTES, 0, 1ULL << 50, FIELD(device_memory),
     0,
     .help = "each device's own budget for the tensors\n"
             "stored on it (default: none; all devices\n"
             "together within --max-memory)"},
    {"max-queued-bytes", "BYTES", OPT_BYTES, 0, 1ULL << 50,
     FIELD(max_queued_bytes), 256ULL << 20,
     .help = "decoded requests one session may have\n"
             "waiting; past it the server stops reading\n"
             "the session until they ran (256 MiB)"},
    {"max-sessions", "N", OPT_INT, 1, 100000, FIELD(max_sessions), 64,
     .help = "concurrent sessions, detached ones kept\n"
             "for a resume included, though at the limit\n"
             "these are expired for a new one (default 64)"},
    {"idle-timeout", "SECONDS", OPT_INT, 0, 86400 * 365,
     FIELD(idle_timeout_s), 600,
     .help = "close idle sessions, 0 never (default 600);\n"
             "idle time counts from the last complete\n"
             "request"},
    {"frame-timeout", "SECONDS", OPT_INT, 0, 86400, FIELD(frame_timeout_s),
     300,
     .help = "a frame must arrive whole within this time\n"
             "from its first byte, 0 never (default 300)"},
    {"threads", "N", OPT_INT, 1, 256, FIELD(threads),
     .dflt_fn = default_threads,
     .help = "worker threads running kernels (default: cores)"},
    {"max-output-queue", "BYTES", OPT_BYTES, 0, 1ULL << 40,
     FIELD(max_output_queue), 64ULL << 20,
     .help = "unsent replies, with the server's bookkeeping\n"
             "of each (~150 bytes), before a client is\n"
             "dropped (default 64 MiB)"},
    {"max-elements", "N", OPT_COUNT, 1, 1ULL << 50, FIELD(max_elements),
     1ULL << 31,
     .help = "elements of one tensor, counting a zero\n"
             "size as 1 ([N, 0] spans N) (default 2^31)"},
    {"max-op-cost", "N", OPT_COUNT, 0, UINT64_MAX, FIELD(max_op_cost),
     1ULL << 34,
     .help = "estimated elementary operations of one op\n"
             "(matmul m*n*k, conv out*C*kh*kw, pool\n"
             "out*kh*kw, ...), backward ops included; over\n"
             "it the op fails with DISPATCH_ELIMIT; 0 no\n"
             "limit (default 2^34, about 1.7e10)"},
    {"max-replay-cost", "N", OPT_COUNT, 0, UINT64_MAX, FIELD(max_replay_cost),
     1ULL << 38,
     .help = "the same for one graph replay, all its ops\n"
             "and nodes together (each node counts at\n"
             "least 512); over it the replay fails with\n"
             "DISPATCH_ELIMIT, a definition that must\n"
             "pass it is refused; 0 no limit (default\n"
             "2^38)"},
    {"inline-cost", "N", OPT_COUNT, 0, SV_INLINE_COST_MAX, FIELD(inline_cost),
     SV_INLINE_COST_DEFAULT,
     .help = "an op of an idle session whose estimated\n"
             "work (as --max-op-cost counts it) is at\n"
             "most N runs on the network thread, saving\n"
             "two thread wake-ups; 0 never, at most\n"
             "2^20 = 1048576 (default 2^14 = 16384)"},
    {"loop-spin-us", "N", OPT_INT, 0, SV_LOOP_SPIN_US_MAX, FIELD(loop_spin_us),
     SV_LOOP_SPIN_US_DEFAULT,
     .help = "after answering a request itself, the\n"
             "network thread polls the sockets without\n"
             "sleeping for N microseconds, so a client's\n"
             "next request costs it no wake-up; 0 never,\n"
             "at most 10000 (default 50)"},
    {"max-queued", "N", OPT_INT, 1, 1u << 24, FIELD(max_queued), 4096,
     .help = "requests buffered per session before the\n"
             "server stops reading it (default 4096)"},
    {"storage-cache", "BYTES", OPT_BYTES, 0, 1ULL << 50, FIELD(storage_cache),
     512ULL << 20,
     .help = "freed tensor storage (blocks of 1 MiB and\n"
             "more) the server keeps for reuse instead of\n"
             "returning it to the OS, 0 none (default\n"
             "512 MiB): fresh pages fault on first touch"},
    {"session-cache", "BYTES", OPT_BYTES, 0, 1ULL << 50, FIELD(session_cache),
     64ULL << 20,
     .help = "each session's free lists of freed tensor\n"
             "storage and headers (by size class), charged\n"
             "to the session and given back when a quota\n"
             "needs the room, 0 none (default 64 MiB)"},
    {"handshake-timeout", "SECONDS", OPT_INT, 0, 3600,
     FIELD(handshake_timeout_s), 10,
     .help = "TLS handshake + hello must finish in\n"
             "this time, 0 never (default 10)"},
    {"drain-timeout", "SECONDS", OPT_INT, 0, 86400, FIELD(drain_timeout_s), 30,
     .help = "on SIGTERM/SIGINT, run and answer the requests\n"
             "already received for at most this long, then\n"
             "cancel the rest; 0 no wait (default 30)"},
    {"session-grace", "SECONDS", OPT_INT, 0, 86400, FIELD(session_grace_s), 60,
     .help = "keep a dropped session for a resume (60)"},
    {"tls-cert", "FILE", OPT_PATH, .off = offsetof(sv_config, tls_cert),
     .help = "serve TLS with this certificate (PEM chain)"},
    {"tls-key", "FILE", OPT_PATH, .off = offsetof(sv_config, tls_key),
     .help = "private key of --tls-cert"},
    {"tls-client-ca", "FILE", OPT_PATH,
     .off = offsetof(sv_config, tls_client_ca),
     .help = "mutual TLS: require a client certificate\n"
             "signed by this CA"},
    {"token-file", "FILE", OPT_FN, .set = read_token,
     .help = "clients must send this token in hello\n"
             "(reread on SIGHUP, as are the --tls-* files)"},
    {"insecure", NULL, OPT_FLAG, .off = offsetof(sv_config, insecure),
     .help = "allow a non-loopback --listen without both\n"
             "TLS and a token (not --metrics-listen: see\n"
             "--metrics-public)"},
    {"log-level", "error|warn|info|debug", OPT_FN, .set = set_log_level,
     .dflt_value = "info", .help = "stderr log level (default info)"},
    {"log-format", "text|json", OPT_FN, .set = set_log_format,
     .dflt_value = "text",
     .help = "log lines as text (default) or one JSON\n"
             "object a line (ts, level, msg, and session\n"
             "and peer where the line has them); times\n"
             "are ISO-8601 UTC with milliseconds"},
    {"metrics-listen", "HOST:PORT", OPT_FN, .set = set_metrics_listen,
     .help = "serve Prometheus metrics over HTTP at\n"
             "/metrics (default: off; port 0 picks a free\n"
             "port, printed on stdout); HOST as for\n"
             "--listen, loopback only unless\n"
             "--metrics-public"},
    /* srvops: the metrics endpoint beyond loopback, and its token */
    {"metrics-public", NULL, OPT_FLAG,
     .off = offsetof(sv_config, metrics_public),
     .help = "allow a non-loopback --metrics-listen (plain\n"
             "HTTP: add --metrics-token-file, or a\n"
             "firewall that admits only the scraper)"},
    {"metrics-token-file", "FILE", OPT_FN, .set = read_metrics_token,
     .help = "/metrics answers 401 unless the request has\n"
             "\"Authorization: Bearer TOKEN\", TOKEN this\n"
             "file's contents (reread on SIGHUP)"},
    /* server-side checkpoints (server/checkpoint.c) */
    {"checkpoint-dir", "DIR", OPT_PATH,
     .off = offsetof(sv_config, checkpoint_dir),
     .help = "let clients save and load checkpoints\n"
             "here, by names confined to DIR (default:\n"
             "off, such requests are refused)"},
    /* server-to-server transfers (server/peer.c) */
    {"name", "NAME", OPT_PATH, .off = offsetof(sv_config, name),
     .help = "this server's name for its peers: the NAME\n"
             "they list it under with --peer; without it\n"
             "no tensor can be pulled from this server"},
    {"peer", "NAME=HOST:PORT", OPT_FN, .set = set_peer,
     .help = "a server this one may pull tensors from,\n"
             "repeatable; it connects to no other address"},
    {"peer-token-file", "FILE", OPT_FN, .set = read_peer_token,
     .help = "the token this server sends in its hello\n"
             "to a peer (the peer's --token-file; reread\n"
             "on SIGHUP)"},
    {"peer-ca", "FILE", OPT_PATH, .off = offsetof(sv_config, peer_ca),
     .help = "TLS to peers, their certificates verified\n"
             "against this CA and their host name (without\n"
             "it: plain TCP, to loopback peers only unless\n"
             "--insecure); with --peer-cert/--peer-key,\n"
             "reread on SIGHUP"},
    {"peer-cert", "FILE", OPT_PATH, .off = offsetof(sv_config, peer_cert),
     .help = "client certificate for peers that require\n"
             "mutual TLS (with --peer-key)"},
    {"peer-key", "FILE", OPT_PATH, .off = offsetof(sv_config, peer_key),
     .help = "private key of --peer-cert"},
    {"peer-cap-ttl", "SECONDS", OPT_INT, 1, 3600, FIELD(peer_cap_ttl_s), 30,
     .help = "a transfer capability this server grants\n"
             "is valid this long, once (default 30)"},
    {"peer-timeout", "SECONDS", OPT_INT, 1, 3600, FIELD(peer_timeout_s), 30,
     .help = "a pull fails when a peer does not connect,\n"
             "or is silent, this long (default 30)"},
    /* the MPI group (server/group.c) */
    {"mpi", NULL, OPT_FLAG, .off = offsetof(sv_config, mpi),
     .help = "run as one rank of an MPI group (under\n"
             "mpirun; rank r listens on --listen's port\n"
             "+ r) whose members all-reduce tensors"},
    {"mpi-timeout", "SECONDS", OPT_INT, 1, 3600, FIELD(mpi_timeout_s), 30,
     .help = "a member waits this long for the others'\n"
             "part of an all-reduce; an all-reduce fails\n"
             "with DISPATCH_EGROUP after at most three\n"
             "times it (default 30)"},
    {"mpi-insecure", NULL, OPT_FLAG, .off = offsetof(sv_config, mpi_insecure),
     .help = "allow a group whose ranks are not all on\n"
             "this host's loopback: MPI traffic is neither\n"
             "authenticated nor encrypted"},
    {"version", NULL, OPT_FN, .set = set_version,
     .help = "print the version and exit"},
    {"help", NULL, OPT_FN, .set = set_help, .help = "this text"},
};

#define N_ROWS (sizeof g_rows / sizeof g_rows[0])
/* getopt_long's value of row i; -h is --help's short form */
#define ROW_VAL(i) (256 + (int)(i))

static const char *const g_usage_head =
    "usage: dispatch-server [options]\n"
    "Values: --opt VALUE or --opt=VALUE. BYTES take K, M, G or T (or KiB,\n"
    "...), powers of 1024 (8G = 8589934592); N of --max-elements,\n"
    "--max-op-cost and --max-replay-cost the same letters as powers of\n"
    "1000 (2G = 2e9).\n";

/* The help column: "  --name ARG" is padded to it, or followed by two
 * spaces when it reaches it; the help's further lines start there. */
#define HELP_COL 27

/* --help: the head, then each row as "  --name ARG  help..." */
static int set_help(sv_config *c, const char *v) {
  fputs(g_usage_head, stdout);
  for (size_t i = 0; i < N_ROWS; i++) {
    const opt_row *o = &g_rows[i];
    int w = printf("  --%s%s%s", o->name, o->arg ? " " : "",
                   o->arg ? o->arg : "");
    printf("%*s", w < HELP_COL ? HELP_COL - w : 2, "");
    for (const char *h = o->help; *h;) {
      const char *nl = strchr(h, '\n');
      size_t n = nl ? (size_t)(nl - h) : strlen(h);
      printf("%.*s\n", (int)n, h);
      if (!nl) break;
      h = nl + 1;
      printf("%*s", HELP_COL, "");
    }
  }
  return 1;
}

static int is_number(const opt_row *o) {
  return o->type == OPT_BYTES || o->type == OPT_COUNT || o->type == OPT_INT;
}

/* A number into the row's field: uint64_t, or int / uint32_t */
static void store(sv_config *c, const opt_row *o, uint64_t v) {
  char *f = (char *)c + o->off;
  if (o->size == sizeof(uint64_t)) {
    memcpy(f, &v, sizeof v);
  } else { /* an int or a uint32_t field: the bounds keep v below 2^31 */
    uint32_t u = (uint32_t)v;
    memcpy(f, &u, sizeof u);
  }
}

/* Applies row o's value v (NULL for a row without one): 0, 1 to stop with
 * exit status 0 (--help, --version), -1 after printing why. */
static int apply(sv_config *c, const opt_row *o, const char *v) {
  char name[40];
  uint64_t n;
  snprintf(name, sizeof name, "--%s", o->name);
  switch (o->type) {
    case OPT_BYTES:
    case OPT_COUNT:
    case OPT_INT:
      if (parse_num(name, v,
                    o->type == OPT_BYTES   ? 1024
                    : o->type == OPT_COUNT ? 1000
                                           : 0,
                    o->min, o->max, &n) < 0)
        return -1;
      store(c, o, n);
      return 0;
    case OPT_PATH:
      memcpy((char *)c + o->off, &v, sizeof v);
      return 0;
    case OPT_FLAG:
      *(int *)(void *)((char *)c + o->off) = 1;
      return 0;
    case OPT_FN: return o->set(c, v);
  }
  return -1;
}

void sv_config_defaults(sv_config *c) {
  memset(c, 0, sizeof *c);
  for (size_t i = 0; i < N_ROWS; i++) {
    const opt_row *o = &g_rows[i];
    if (o->type == OPT_FN && o->dflt_value) o->set(c, o->dflt_value);
    else if (is_number(o))
      store(c, o, o->dflt_fn ? o->dflt_fn() : o->dflt);
  }
  c->max_msg = 16ULL << 20; /* 16 MiB of protobuf: not an option */
  c->checkpoint_fd = -1;
}

/* The getopt_long table of the rows (built once: the rows are const). */
static const struct option *long_options(void) {
  static struct option opts[N_ROWS + 1];
  for (size_t i = 0; i < N_ROWS; i++) {
    opts[i].name = g_rows[i].name;
    opts[i].has_arg = g_rows[i].arg ? required_argument : no_argument;
    opts[i].flag = NULL;
    opts[i].val = ROW_VAL(i);
  }
  return opts;
}

/* The row of a getopt_long value (-h: --help's), NULL when none */
static const opt_row *row_of(int val) {
  for (size_t i = 0; i < N_ROWS; i++)
    if (val == ROW_VAL(i) || (val == 'h' && strcmp(g_rows[i].name, "help") == 0))
      return &g_rows[i];
  return NULL;
}
/* Parses argv with getopt_long (--opt value, --opt=value, unambiguous
 * prefixes), then checks the options together and resolves --listen, so
 * every refusal happens before anything binds. */
int sv_config_parse(sv_config *c, int argc, char **argv) {
  opterr = 0; /* our messages name the option and point at --help */
  optind = 0; /* glibc: a full reset, so parsing twice works */
  for (;;) {
    int prev = optind ? optind : 1;
    int val = getopt_long(argc, argv, ":h", long_options(), NULL);
    if (val == -1) break;
    const char *arg = prev < argc ? argv[prev] : "";
    if (val == ':') {
      put_err("%s needs a value (see --help)", arg);
      return -1;
    }
    if (val == '?') {
      int is_long = strncmp(arg, "--", 2) == 0;
      const opt_row *o = row_of(optopt);
      if (is_long && optopt) /* a known flag given a value: --version=1 */
        put_err("--%s takes no value, got '%s' (see --help)",
                o ? o->name : "?", arg);
      else if (optopt)
        put_err("unknown option '-%c' (see --help)", optopt);
      else
        put_err("unknown or ambiguous option '%s' (see --help)", arg);
      return -1;
    }
    const opt_row *o = row_of(val);
    int r = o ? apply(c, o, optarg) : -1;
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
  if (!c->peer_cert != !c->peer_key) {
    put_err("--peer-cert and --peer-key go together");
    return -1;
  }
  if (c->peer_cert && !c->peer_ca) {
    put_err("--peer-cert needs --peer-ca (mutual TLS is TLS)");
    return -1;
  }
  if (c->name && (!c->name[0] || strlen(c->name) > 64 ||
                  strpbrk(c->name, "=:\n\r"))) {
    put_err("--name: '%s' must be 1 to 64 bytes without '=', ':' or a "
            "newline", c->name);
    return -1;
  }
  if (c->checkpoint_dir) {
    /* opened once: every name is resolved beneath this descriptor, so a
     * rename of the path later changes nothing the server writes */
    if (c->checkpoint_fd >= 0) close(c->checkpoint_fd);
    c->checkpoint_fd =
        open(c->checkpoint_dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (c->checkpoint_fd < 0) {
      put_err("--checkpoint-dir %s: %s", c->checkpoint_dir, strerror(errno));
      return -1;
    }
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
  if (!c->metrics_host[0]) {
    if (c->metrics_public || c->metrics_token_file) {
      put_err("%s needs --metrics-listen",
              c->metrics_public ? "--metrics-public" : "--metrics-token-file");
      return -1;
    }
    return 0;
  }
  /* the metrics endpoint is plain HTTP: beyond loopback only when asked
   * for by its own flag (--insecure is about --listen alone) */
  if (resolve_host("--metrics-listen", c->metrics_host, c->metrics_port,
                   &c->metrics_addr, &loopback, names, sizeof names) < 0)
    return -1;
  shown_name(c->metrics_host, names, shown, sizeof shown);
  if (!loopback && !c->metrics_public) {
    put_err("refusing to serve metrics on %s: the endpoint is plain HTTP "
            "and tells anyone who reaches it how the server is used. Use a "
            "loopback address (127.0.0.1:9090) and a local scraper or "
            "proxy, or pass --metrics-public (with --metrics-token-file or a "
            "firewall that admits only the scraper) to serve it there%s.",
            shown,
            c->insecure ? " (--insecure covers --listen only)" : "");
    return -1;
  }
  if (!loopback)
    put_err("warning: --metrics-public: serving metrics on %s over plain "
            "HTTP%s", shown,
            c->metrics_token ? ", a bearer token required"
                             : " without authentication");
  return 0;
}
