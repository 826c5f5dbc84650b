/* stderr logging with a level; one fprintf per line so lines from the loop
 * and the workers never interleave mid-line. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "sv.h"

int sv_log_level = SV_LOG_INFO;

static const char *const g_names[] = {"error", "warn", "info", "debug"};

int sv_log_parse_level(const char *s) {
  for (int i = 0; i < 4; i++)
    if (strcmp(s, g_names[i]) == 0) return i;
  return -1;
}

void sv_log(int level, const char *fmt, ...) {
  if (level > sv_log_level) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  fprintf(stderr, "%02d:%02d:%02d.%03ld dispatch-server %s: %s\n", tm.tm_hour,
          tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000L, g_names[level], msg);
}
