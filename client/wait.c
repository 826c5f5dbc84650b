/* How long a REMOTE wait polls the socket before it sleeps (issue 11
 * item 4).
 *
 * Sleeping in poll() costs a wake-up when the reply comes: tens of
 * microseconds on a virtual machine, as much as a whole loopback round
 * trip. Polling instead saves it, but only while the reply comes soon,
 * and only while the polling thread does not hold a core the server needs
 * to produce that reply. So:
 *
 * - Same host, few cores: the server is on this host (its address is
 *   loopback) and this process may run on fewer than
 *   DISPATCH__SPIN_MIN_CPUS cores: the spin is capped at
 *   DISPATCH__SPIN_SHARED_MAX_NS. A reply that needs a worker needs the
 *   server's loop thread and a worker while the client waits, and a
 *   spinning client may take the worker's core; but a client that never
 *   spins pays a sleeping thread's wake-up on every reply, also on the
 *   ones the loop thread makes alone (Sync, Read, inline ops): 68 us for
 *   a Sync here, against 20 us with the spin. The back-off below keeps a
 *   run of slow replies from spinning. The client cannot see the
 *   server's CPU affinity, so it assumes the server may use the same
 *   cores as itself, as it does when neither is pinned.
 * - Everywhere the spin follows the recent replies: a running estimate of
 *   a reply's latency (the newest counts a quarter), spinning twice that
 *   plus DISPATCH__SPIN_SLACK_NS, within DISPATCH__SPIN_MIN_NS and the
 *   maximum (DISPATCH__SPIN_MAX_NS, or the cap above); with no history
 *   yet, the maximum. A spin that
 *   ends without the reply doubles the number of following waits that
 *   sleep at once (1, 3, 7, ... up to DISPATCH__SPIN_SKIP_MAX), so replies
 *   slower than any spin cost one short probe now and then and not a
 *   spin each; a spin that catches its reply ends the back-off.
 * - DISPATCH_SPIN_US, when set, overrides both: a fixed spin of that many
 *   microseconds (0: never spin).
 *
 * The policy is pure functions of dispatch__spin, so it is unit-tested
 * without sockets or clocks (tests/test_client_wait.c). */
#include <netinet/in.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client_internal.h"

int64_t dispatch__spin_budget(const dispatch__spin *s) {
  if (s->override_ns >= 0) return s->override_ns;
  int64_t max = s->loopback && s->ncpu < DISPATCH__SPIN_MIN_CPUS
                    ? DISPATCH__SPIN_SHARED_MAX_NS
                    : DISPATCH__SPIN_MAX_NS;
  if (s->skip > 0) return 0;
  if (s->est_ns <= 0) return max;
  int64_t b = s->est_ns > max ? max : 2 * s->est_ns + DISPATCH__SPIN_SLACK_NS;
  if (b < DISPATCH__SPIN_MIN_NS) b = DISPATCH__SPIN_MIN_NS;
  if (b > max) b = max;
  return b;
}

void dispatch__spin_record(dispatch__spin *s, int64_t budget_ns,
                           int64_t waited_ns) {
  if (s->override_ns >= 0) return;
  if (waited_ns < 0) waited_ns = 0;
  /* a wait that slept measured the reply plus a wake-up: an estimate on
   * the high side, which a later probe corrects */
  s->est_ns = s->est_ns <= 0 ? waited_ns
                             : s->est_ns + (waited_ns - s->est_ns) / 4;
  if (budget_ns <= 0) {
    if (s->skip > 0) s->skip--;
    return;
  }
  if (waited_ns <= budget_ns) {
    s->fails = 0;
    return;
  }
  if (s->fails < 31) s->fails++;
  uint32_t skip = (1u << s->fails) - 1;
  s->skip = skip > DISPATCH__SPIN_SKIP_MAX ? DISPATCH__SPIN_SKIP_MAX : skip;
}

/* The cores this process may run on (sched_getaffinity), at least 1. */
static int affinity_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static int is_loopback(const struct sockaddr_storage *ss) {
  if (ss->ss_family == AF_INET) {
    const struct sockaddr_in *a = (const struct sockaddr_in *)ss;
    return (ntohl(a->sin_addr.s_addr) >> 24) == 127;
  }
  if (ss->ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)ss;
    static const uint8_t v4mapped[12] = {0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0xff, 0xff};
    if (IN6_IS_ADDR_LOOPBACK(&a->sin6_addr)) return 1;
    return memcmp(a->sin6_addr.s6_addr, v4mapped, 12) == 0 &&
           a->sin6_addr.s6_addr[12] == 127;
  }
  return 0;
}

void dispatch__spin_init(dispatch__spin *s, int fd) {
  memset(s, 0, sizeof *s);
  /* read at each connect, so one process may open devices that wait
   * differently (make bench compares both) */
  const char *e = getenv("DISPATCH_SPIN_US");
  s->override_ns = -1;
  if (e && *e) {
    long us = strtol(e, NULL, 10);
    if (us < 0) us = 0;
    if (us > 10000) us = 10000;
    s->override_ns = (int64_t)us * 1000;
  }
  s->ncpu = affinity_cpus();
  struct sockaddr_storage ss;
  socklen_t len = sizeof ss;
  s->loopback = fd >= 0 &&
                getpeername(fd, (struct sockaddr *)&ss, &len) == 0 &&
                is_loopback(&ss);
}

/* Keepalive (protocol 1.4): the server says it is alive at this interval
 * while it works on the session's requests and writes nothing else. A
 * quarter of the bound: the server ticks at the interval and sends when
 * a tick finds nothing written since the previous one, so the gap between
 * two signs of life is at most two intervals, half the bound. */
uint32_t dispatch__keepalive_for(int timeout_ms) {
  if (timeout_ms <= 0) return 0;
  return timeout_ms >= 4 ? (uint32_t)timeout_ms / 4 : 1;
}

/* Silence is judged before the deadline: a wait that heard nothing for
 * its whole bound lost its server, whatever the deadline says; one that
 * heard something within the bound only ran out of time. */
int dispatch__wait_verdict(int64_t now, int64_t heard, int64_t deadline,
                           int timeout_ms, int at_boundary, int64_t *left) {
  *left = -1;
  if (timeout_ms <= 0) return DISPATCH__WAIT_ON;
  int64_t end = heard + timeout_ms;
  if (now >= end) return DISPATCH__WAIT_SILENT;
  if (at_boundary) {
    if (now >= deadline) return DISPATCH__WAIT_TIMEDOUT;
    if (deadline < end) end = deadline;
  }
  *left = end - now;
  return DISPATCH__WAIT_ON;
}
