/* Command line of dispatch-server. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
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
  /* 2^34: admits a 2048^3 matmul (8.6e9) twice over and every op the
   * examples, tests and make bench run (the largest, bench's 2048 matmul,
   * is half of it), refuses a 512x512-window pool at stride 1 on a
   * 1024x1024 input (6.9e10), which would hold a worker for minutes */
  c->max_op_cost = 1ULL << 34;
  c->max_queued = 4096;
  c->max_sessions = 64;
  c->idle_timeout_s = 600;
  c->frame_timeout_s = 300;
  unsigned n = uv_available_parallelism();
  c->threads = n < 1 ? 1 : n > 64 ? 64 : (int)n;
  c->log_level = SV_LOG_INFO;
  c->handshake_timeout_s = 10;
}

void sv_config_release(sv_config *c) {
  if (c->token) {
    memset(c->token, 0, c->token_len);
    dsp_free(c->token);
  }
  c->token = NULL;
  c->token_len = 0;
}

int sv_host_is_loopback(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (strcmp(host, "localhost") == 0) return 1;
  if (inet_pton(AF_INET, host, &a4) == 1)
    return (ntohl(a4.s_addr) >> 24) == 127;
  if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_LOOPBACK(&a6);
  return 0; /* a host name may resolve anywhere */
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
    "  --listen HOST:PORT       address to listen on (default 127.0.0.1:7070;\n"
    "                           port 0 picks a free port, printed on stdout)\n"
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
    "  --max-sessions N         concurrent sessions (default 64)\n"
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
    "  --max-queued N           requests buffered per session before the\n"
    "                           server stops reading it (default 4096)\n"
    "  --storage-cache BYTES    freed tensor storage (blocks of 1 MiB and\n"
    "                           more) the server keeps for reuse instead of\n"
    "                           returning it to the OS, 0 none (default\n"
    "                           512 MiB): fresh pages fault on first touch\n"
    "  --handshake-timeout SECONDS  TLS handshake + hello must finish in\n"
    "                           this time, 0 never (default 10)\n"
    "  --tls-cert FILE          serve TLS with this certificate (PEM chain)\n"
    "  --tls-key FILE           private key of --tls-cert\n"
    "  --tls-client-ca FILE     mutual TLS: require a client certificate\n"
    "                           signed by this CA\n"
    "  --token-file FILE        clients must send this token in hello\n"
    "  --insecure               allow a non-loopback --listen without both\n"
    "                           TLS and a token\n"
    "  --log-level error|warn|info|debug  stderr log level (default info)\n"
    "  --help                   this text\n";

static int parse_u64(const char *opt, const char *s, uint64_t min,
                     uint64_t max, uint64_t *out) {
  char *end;
  errno = 0;
  if (!s || !*s || *s == '-') goto bad;
  unsigned long long v = strtoull(s, &end, 10);
  if (errno || *end || v < min || v > max) goto bad;
  *out = v;
  return 0;
bad:
  fprintf(stderr, "dispatch-server: %s needs a number in [%llu, %llu], got "
                  "'%s'\n",
          opt, (unsigned long long)min, (unsigned long long)max,
          s ? s : "");
  return -1;
}

static int parse_listen(sv_config *c, const char *s) {
  const char *colon = s ? strrchr(s, ':') : NULL;
  if (!colon || colon == s || (size_t)(colon - s) >= sizeof c->host) {
    fprintf(stderr, "dispatch-server: --listen needs HOST:PORT, got '%s'\n",
            s ? s : "");
    return -1;
  }
  const char *h = s;
  size_t hl = (size_t)(colon - s);
  if (hl >= 2 && h[0] == '[' && h[hl - 1] == ']') { /* [::1]:7070 */
    h++;
    hl -= 2;
  }
  memcpy(c->host, h, hl);
  c->host[hl] = '\0';
  uint64_t port;
  if (parse_u64("--listen port", colon + 1, 0, 65535, &port) < 0) return -1;
  c->port = (int)port;
  return 0;
}

int sv_config_parse(sv_config *c, int argc, char **argv) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *v = i + 1 < argc ? argv[i + 1] : NULL;
    uint64_t n;
    if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
      fputs(g_usage, stdout);
      return 1;
    }
    if (strcmp(a, "--insecure") == 0) {
      c->insecure = 1;
      continue;
    }
    if (!v) {
      fprintf(stderr, "dispatch-server: unknown option or missing value: "
                      "%s\n%s", a, g_usage);
      return -1;
    }
    if (strcmp(a, "--listen") == 0) {
      if (parse_listen(c, v) < 0) return -1;
    } else if (strcmp(a, "--max-frame") == 0) {
      if (parse_u64(a, v, 64, 1ULL << 40, &c->max_frame) < 0) return -1;
    } else if (strcmp(a, "--max-session-bytes") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 50, &c->max_session_bytes) < 0) return -1;
    } else if (strcmp(a, "--max-memory") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 50, &c->max_memory) < 0) return -1;
    } else if (strcmp(a, "--device") == 0) {
      if (c->n_devices == SV_MAX_DEVICES) {
        fprintf(stderr, "dispatch-server: at most %d --device options\n",
                SV_MAX_DEVICES);
        return -1;
      }
      c->devices[c->n_devices++] = v;
    } else if (strcmp(a, "--device-memory") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 50, &c->device_memory) < 0) return -1;
    } else if (strcmp(a, "--max-queued-bytes") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 50, &c->max_queued_bytes) < 0) return -1;
    } else if (strcmp(a, "--max-sessions") == 0) {
      if (parse_u64(a, v, 1, 100000, &n) < 0) return -1;
      c->max_sessions = (int)n;
    } else if (strcmp(a, "--idle-timeout") == 0) {
      if (parse_u64(a, v, 0, 86400 * 365, &n) < 0) return -1;
      c->idle_timeout_s = (int)n;
    } else if (strcmp(a, "--frame-timeout") == 0) {
      if (parse_u64(a, v, 0, 86400, &n) < 0) return -1;
      c->frame_timeout_s = (int)n;
    } else if (strcmp(a, "--threads") == 0) {
      if (parse_u64(a, v, 1, 256, &n) < 0) return -1;
      c->threads = (int)n;
    } else if (strcmp(a, "--max-output-queue") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 40, &c->max_output_queue) < 0) return -1;
    } else if (strcmp(a, "--max-elements") == 0) {
      if (parse_u64(a, v, 1, 1ULL << 50, &c->max_elements) < 0) return -1;
    } else if (strcmp(a, "--max-op-cost") == 0) {
      if (parse_u64(a, v, 0, UINT64_MAX, &c->max_op_cost) < 0) return -1;
    } else if (strcmp(a, "--storage-cache") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 50, &c->storage_cache) < 0) return -1;
    } else if (strcmp(a, "--max-queued") == 0) {
      if (parse_u64(a, v, 1, 1u << 24, &n) < 0) return -1;
      c->max_queued = (uint32_t)n;
    } else if (strcmp(a, "--handshake-timeout") == 0) {
      if (parse_u64(a, v, 0, 3600, &n) < 0) return -1;
      c->handshake_timeout_s = (int)n;
    } else if (strcmp(a, "--tls-cert") == 0) {
      c->tls_cert = v;
    } else if (strcmp(a, "--tls-key") == 0) {
      c->tls_key = v;
    } else if (strcmp(a, "--tls-client-ca") == 0) {
      c->tls_client_ca = v;
    } else if (strcmp(a, "--token-file") == 0) {
      if (read_token(c, v) < 0) return -1;
    } else if (strcmp(a, "--log-level") == 0) {
      int l = sv_log_parse_level(v);
      if (l < 0) {
        fprintf(stderr, "dispatch-server: --log-level takes error, warn, "
                        "info or debug, got '%s'\n", v);
        return -1;
      }
      c->log_level = l;
    } else {
      fprintf(stderr, "dispatch-server: unknown option %s\n%s", a, g_usage);
      return -1;
    }
    i++;
  }
  if (c->max_msg > c->max_frame) c->max_msg = c->max_frame;
  if (!c->tls_cert != !c->tls_key) {
    fprintf(stderr, "dispatch-server: --tls-cert and --tls-key go together\n");
    return -1;
  }
  if (c->tls_client_ca && !c->tls_cert) {
    fprintf(stderr, "dispatch-server: --tls-client-ca needs --tls-cert and "
                    "--tls-key\n");
    return -1;
  }
  /* refused here, before anything binds */
  if (!sv_host_is_loopback(c->host) && !(c->tls_cert && c->token) &&
      !c->insecure) {
    fprintf(stderr,
            "dispatch-server: refusing to listen on %s without both TLS "
            "(--tls-cert/--tls-key) and a token (--token-file): anyone who "
            "can reach this address could run code and read tensors. Add "
            "them, listen on 127.0.0.1, or pass --insecure to accept the "
            "risk.\n",
            c->host);
    return -1;
  }
  if (!sv_host_is_loopback(c->host) && !(c->tls_cert && c->token))
    fprintf(stderr, "dispatch-server: warning: --insecure: listening on %s "
                    "without %s\n",
            c->host, c->tls_cert ? "a token" : c->token ? "TLS" :
            "TLS or a token");
  return 0;
}
