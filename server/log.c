/* stderr logging with a level; one fprintf per line so lines from the loop
 * and the workers never interleave mid-line, and one line per call: every
 * control byte and invalid UTF-8 in a message is written as \xNN, so
 * nothing that reaches a message from the network (a client name, a
 * certificate subject, a library's reason) can start a line of its own.
 * In JSON the same escaped text is a string cJSON quotes (", \ and the
 * rest), so every line is one valid JSON object in valid UTF-8. */
#include <cJSON.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sv.h"

int sv_log_level = SV_LOG_INFO;
int sv_log_format = SV_LOG_TEXT;

static const char *const g_names[] = {"error", "warn", "info", "debug"};

int sv_log_parse_level(const char *s) {
  for (int i = 0; i < 4; i++)
    if (strcmp(s, g_names[i]) == 0) return i;
  return -1;
}

int sv_log_parse_format(const char *s) {
  if (strcmp(s, "text") == 0) return SV_LOG_TEXT;
  if (strcmp(s, "json") == 0) return SV_LOG_JSON;
  return -1;
}

/* Length of the valid UTF-8 sequence at p (1..4), or 0 when p does not
 * start one (a stray continuation byte, an overlong form, a surrogate, a
 * code point past U+10FFFF, or a sequence cut short). */
static size_t utf8_len(const unsigned char *p) {
  unsigned c = p[0];
  size_t n;
  unsigned min;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) n = 2, min = 0x80;
  else if (c >= 0xe0 && c <= 0xef) n = 3, min = 0x800;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, min = 0x10000;
  else return 0;
  unsigned cp = c & (0x7f >> n);
  for (size_t i = 1; i < n; i++) {
    if ((p[i] & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (p[i] & 0x3f);
  }
  if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return 0;
  return n;
}

/* Copies s into out (len bytes, always terminated) with control bytes,
 * DEL and invalid UTF-8 as \xNN (and backslash too when esc_bs), at most
 * max source characters; returns 1 when s was cut. */
static int escape(char *out, size_t len, const char *s, size_t max,
                  int esc_bs) {
  const unsigned char *p = (const unsigned char *)s;
  size_t o = 0, chars = 0;
  while (*p) {
    size_t n = utf8_len(p);
    int hex = n == 0 || *p < 0x20 || *p == 0x7f || (esc_bs && *p == '\\');
    size_t need = hex ? 4 : n;
    if (chars == max || o + need + 1 > len) break;
    if (hex) {
      snprintf(out + o, 5, "\\x%02x", *p);
      p++;
    } else {
      memcpy(out + o, p, n);
      p += n;
    }
    o += need;
    chars++;
  }
  out[o] = '\0';
  return *p != '\0';
}

const char *sv_log_str(char *buf, size_t len, const char *s, size_t max) {
  if (len < 4) return "";
  if (!s) s = "";
  if (escape(buf, len - 3, s, max, 1)) strcat(buf, "...");
  return buf;
}

/* "2026-12-01T08:10:00.123Z": UTC, so lines from hosts in other zones
 * sort and compare as they are. */
static void timestamp(char *buf, size_t len) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  char date[40];
  strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%S", &tm);
  snprintf(buf, len, "%s.%03dZ", date, (int)(ts.tv_nsec / 1000000L) % 1000);
}

/* The JSON line, or NULL when cJSON runs out of memory (the caller then
 * writes the text form: a line is never dropped). */
static char *json_line(const char *ts, int level, unsigned long long session,
                       const char *peer, const char *msg) {
  cJSON *o = cJSON_CreateObject();
  char *out = NULL;
  if (o && cJSON_AddStringToObject(o, "ts", ts) &&
      cJSON_AddStringToObject(o, "level", g_names[level]) &&
      cJSON_AddStringToObject(o, "msg", msg) &&
      (!session || cJSON_AddNumberToObject(o, "session", (double)session)) &&
      (!peer || cJSON_AddStringToObject(o, "peer", peer)))
    out = cJSON_PrintUnformatted(o);
  cJSON_Delete(o);
  return out;
}

/* One line: session 0 and peer NULL for lines about no connection. */
static void emit(int level, unsigned long long session, const char *peer,
                 const char *fmt, va_list ap) {
  char raw[1024], msg[4 * sizeof raw], ts[64];
  vsnprintf(raw, sizeof raw, fmt, ap);
  escape(msg, sizeof msg, raw, sizeof raw, 0);
  timestamp(ts, sizeof ts);
  char safe_peer[4 * 96];
  if (peer) escape(safe_peer, sizeof safe_peer, peer, 96, 0);
  if (sv_log_format == SV_LOG_JSON) {
    char *line = json_line(ts, level, session, peer ? safe_peer : NULL, msg);
    if (line) {
      fprintf(stderr, "%s\n", line);
      cJSON_free(line);
      return;
    }
  }
  if (session && peer)
    fprintf(stderr, "%s dispatch-server %s: conn %llu (%s): %s\n", ts,
            g_names[level], session, safe_peer, msg);
  else if (session)
    fprintf(stderr, "%s dispatch-server %s: conn %llu: %s\n", ts,
            g_names[level], session, msg);
  else
    fprintf(stderr, "%s dispatch-server %s: %s\n", ts, g_names[level], msg);
}

void sv_log(int level, const char *fmt, ...) {
  if (level > sv_log_level) return;
  va_list ap;
  va_start(ap, fmt);
  emit(level, 0, NULL, fmt, ap);
  va_end(ap);
}

void sv_log_conn(int level, unsigned long long session, const char *peer,
                 const char *fmt, ...) {
  if (level > sv_log_level) return;
  va_list ap;
  va_start(ap, fmt);
  emit(level, session, peer, fmt, ap);
  va_end(ap);
}
