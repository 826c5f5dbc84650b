/* Command line of dispatch-server. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "sv.h"

void sv_config_defaults(sv_config *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->host, sizeof c->host, "127.0.0.1");
  c->port = 7070;
  c->max_frame = 1ULL << 30;          /* 1 GiB */
  c->max_msg = 16ULL << 20;           /* 16 MiB of protobuf */
  c->max_session_bytes = 4ULL << 30;  /* 4 GiB */
  c->max_elements = 1ULL << 31;
  c->max_output_queue = 64ULL << 20;  /* 64 MiB */
  c->max_queued = 4096;
  c->max_sessions = 64;
  c->idle_timeout_s = 600;
  unsigned n = uv_available_parallelism();
  c->threads = n < 1 ? 1 : n > 64 ? 64 : (int)n;
  c->log_level = SV_LOG_INFO;
}

static const char *const g_usage =
    "usage: dispatch-server [options]\n"
    "  --listen HOST:PORT       address to listen on (default 127.0.0.1:7070;\n"
    "                           port 0 picks a free port, printed on stdout)\n"
    "  --max-frame BYTES        largest frame, message + bulk (default 1 GiB)\n"
    "  --max-session-bytes BYTES  tensor bytes one session may hold (4 GiB)\n"
    "  --max-sessions N         concurrent sessions (default 64)\n"
    "  --idle-timeout SECONDS   close idle sessions, 0 never (default 600)\n"
    "  --threads N              worker threads running kernels (default: cores)\n"
    "  --max-output-queue BYTES unsent replies before a client is dropped\n"
    "                           (default 64 MiB)\n"
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
    } else if (strcmp(a, "--max-sessions") == 0) {
      if (parse_u64(a, v, 1, 100000, &n) < 0) return -1;
      c->max_sessions = (int)n;
    } else if (strcmp(a, "--idle-timeout") == 0) {
      if (parse_u64(a, v, 0, 86400 * 365, &n) < 0) return -1;
      c->idle_timeout_s = (int)n;
    } else if (strcmp(a, "--threads") == 0) {
      if (parse_u64(a, v, 1, 256, &n) < 0) return -1;
      c->threads = (int)n;
    } else if (strcmp(a, "--max-output-queue") == 0) {
      if (parse_u64(a, v, 0, 1ULL << 40, &c->max_output_queue) < 0) return -1;
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
  return 0;
}
