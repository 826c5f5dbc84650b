/* The client's spin decision (client/wait.c, issue 11 item 4) as a pure
 * function of its inputs: DISPATCH_SPIN_US, the cores this process may
 * use, whether the server is on loopback, and the latencies of recent
 * replies. No sockets or clocks, except one test that checks what
 * dispatch__spin_init reads from a real loopback connection. */
#include <arpa/inet.h>
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include "client_internal.h"

#define US 1000 /* ns */

static dispatch__spin make(int64_t override_ns, int ncpu, int loopback) {
  dispatch__spin s = {0};
  s.override_ns = override_ns;
  s.ncpu = ncpu;
  s.loopback = loopback;
  return s;
}

/* n waits whose replies come after lat_ns, each given the budget the
 * policy chose; returns how many of them spun (budget > 0). */
static int feed(dispatch__spin *s, int n, int64_t lat_ns) {
  int spun = 0;
  for (int i = 0; i < n; i++) {
    int64_t b = dispatch__spin_budget(s);
    if (b > 0) spun++;
    dispatch__spin_record(s, b, lat_ns);
  }
  return spun;
}

/* Same host with two cores: a spinning client may hold the core the
 * server needs, so the spin never exceeds DISPATCH__SPIN_SHARED_MAX_NS
 * there (never spinning at all made every reply pay a sleeping thread's
 * wake-up: a Sync took 68 us instead of 20 on this machine); quick
 * replies keep the spin, slow ones make it back off like anywhere. */
Test(client_wait, loopback_with_few_cores_spins_within_the_shared_cap) {
  for (int ncpu = 1; ncpu < DISPATCH__SPIN_MIN_CPUS; ncpu++) {
    dispatch__spin s = make(-1, ncpu, 1);
    cr_assert_eq(dispatch__spin_budget(&s), DISPATCH__SPIN_SHARED_MAX_NS,
                 "no history, %d cores", ncpu);
    cr_assert_eq(feed(&s, 100, 6 * US), 100, "%d cores: quick replies", ncpu);
    dispatch__spin slow = make(-1, ncpu, 1);
    slow.est_ns = 40 * DISPATCH__SPIN_MAX_NS;
    cr_assert_eq(dispatch__spin_budget(&slow), DISPATCH__SPIN_SHARED_MAX_NS,
                 "%d cores: a long estimate", ncpu);
    int spun = feed(&slow, 1000, 5000 * US);
    cr_assert_lt(spun, 1000 / DISPATCH__SPIN_SKIP_MAX + 10,
                 "%d cores: %d of 1000 waits spun for 5 ms replies", ncpu,
                 spun);
  }
  cr_assert_lt(DISPATCH__SPIN_SHARED_MAX_NS, DISPATCH__SPIN_MAX_NS);
}

/* Enough cores, or a server on another host: the first wait spins the
 * maximum (nothing known yet), and quick replies keep it spinning, about
 * twice their latency. */
Test(client_wait, quick_replies_keep_spinning_near_their_latency) {
  dispatch__spin cases[2] = {make(-1, DISPATCH__SPIN_MIN_CPUS, 1),
                             make(-1, 1, 0)};
  for (int k = 0; k < 2; k++) {
    dispatch__spin s = cases[k];
    cr_assert_eq(dispatch__spin_budget(&s), DISPATCH__SPIN_MAX_NS);
    cr_assert_eq(feed(&s, 100, 10 * US), 100, "case %d", k);
    int64_t b = dispatch__spin_budget(&s);
    cr_assert_geq(b, 20 * US, "case %d: budget %lld below 2x latency", k,
                  (long long)b);
    cr_assert_leq(b, 20 * US + DISPATCH__SPIN_SLACK_NS + 1 * US,
                  "case %d: budget %lld", k, (long long)b);
  }
}

/* The budget stays within its bounds whatever the estimate. */
Test(client_wait, budget_is_bounded) {
  dispatch__spin s = make(-1, 8, 0);
  feed(&s, 50, 100); /* 0.1 us replies */
  cr_assert_eq(dispatch__spin_budget(&s), DISPATCH__SPIN_MIN_NS > 2 * 100 +
                                                  DISPATCH__SPIN_SLACK_NS
                                              ? DISPATCH__SPIN_MIN_NS
                                              : 2 * 100 +
                                                    DISPATCH__SPIN_SLACK_NS);
  dispatch__spin t = make(-1, 8, 0);
  t.est_ns = 40 * DISPATCH__SPIN_MAX_NS;
  cr_assert_eq(dispatch__spin_budget(&t), DISPATCH__SPIN_MAX_NS);
}

/* Replies slower than any spin: each failed spin doubles the waits that
 * sleep at once, so over 1000 waits only a handful spin (probes), not
 * every one. */
Test(client_wait, failing_spins_back_off) {
  dispatch__spin s = make(-1, 16, 0);
  int spun = feed(&s, 1000, 5000 * US); /* 5 ms replies */
  cr_assert_gt(spun, 0, "never probed again");
  cr_assert_lt(spun, 1000 / DISPATCH__SPIN_SKIP_MAX + 10,
               "%d of 1000 waits spun for 5 ms replies", spun);
  cr_assert_eq(s.skip > 0 || dispatch__spin_budget(&s) > 0, 1);
}

/* After slow replies, quick ones bring the spin back within one back-off
 * period, and then every wait spins again. */
Test(client_wait, recovers_when_replies_get_quick) {
  dispatch__spin s = make(-1, 16, 0);
  feed(&s, 300, 5000 * US);
  int spun = feed(&s, DISPATCH__SPIN_SKIP_MAX + 30, 8 * US);
  cr_assert_gt(spun, 0, "no spin after replies got quick");
  cr_assert_eq(feed(&s, 100, 8 * US), 100, "quick replies, yet not spinning");
  cr_assert_leq(dispatch__spin_budget(&s), 40 * US);
}

/* DISPATCH_SPIN_US overrides both the history and the same-host rule. */
Test(client_wait, env_override_wins) {
  dispatch__spin s = make(0, 64, 0);
  cr_assert_eq(feed(&s, 50, 1 * US), 0, "DISPATCH_SPIN_US=0 spun");
  dispatch__spin t = make(30 * US, 2, 1);
  for (int i = 0; i < 50; i++) {
    cr_assert_eq(dispatch__spin_budget(&t), 30 * US);
    dispatch__spin_record(&t, 30 * US, 5000 * US);
  }
}

/* dispatch__spin_init on a real connection to 127.0.0.1: loopback seen,
 * at least one core, and the environment variable read at that moment. */
Test(client_wait, init_reads_peer_cores_and_env) {
  int l = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(l, 0);
  struct sockaddr_in a = {0};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert_eq(bind(l, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(listen(l, 1), 0);
  socklen_t al = sizeof a;
  cr_assert_eq(getsockname(l, (struct sockaddr *)&a, &al), 0);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  unsetenv("DISPATCH_SPIN_US");
  dispatch__spin s;
  dispatch__spin_init(&s, fd);
  cr_assert_eq(s.loopback, 1);
  cr_assert_geq(s.ncpu, 1);
  cr_assert_eq(s.override_ns, -1);
  cr_assert_eq(s.est_ns, 0);
  setenv("DISPATCH_SPIN_US", "25", 1);
  dispatch__spin_init(&s, fd);
  cr_assert_eq(s.override_ns, 25 * US);
  unsetenv("DISPATCH_SPIN_US");
  int u[2];
  cr_assert_eq(socketpair(AF_UNIX, SOCK_STREAM, 0, u), 0);
  dispatch__spin_init(&s, u[0]);
  cr_assert_eq(s.loopback, 0, "a unix socket is not a loopback address");
  close(u[0]);
  close(u[1]);
  close(fd);
  close(l);
}

/* ------------------------------------------------------------------ */
/* keepalive verdicts (protocol 1.4, issue 21 item 5)                  */

/* Heard from within the bound: the deadline only ends the wait where a
 * reply may begin, and then as a timeout, not a lost connection. */
Test(client_wait, a_server_heard_from_times_out_at_a_frame_boundary) {
  int64_t left;
  /* wait began at 0, bound 500, keepalive heard at 400; now 500 */
  cr_assert_eq(dispatch__wait_verdict(500, 400, 500, 500, 1, &left),
               DISPATCH__WAIT_TIMEDOUT);
  /* mid-frame the deadline does not count: poll until silence at 900 */
  cr_assert_eq(dispatch__wait_verdict(500, 400, 500, 500, 0, &left),
               DISPATCH__WAIT_ON);
  cr_assert_eq(left, 400);
  /* before the deadline: poll until it */
  cr_assert_eq(dispatch__wait_verdict(100, 50, 500, 500, 1, &left),
               DISPATCH__WAIT_ON);
  cr_assert_eq(left, 400);
}

/* Nothing heard for the whole bound is a lost connection, deadline or
 * not: silence is judged first. */
Test(client_wait, silence_for_the_whole_bound_is_a_lost_connection) {
  int64_t left;
  cr_assert_eq(dispatch__wait_verdict(500, 0, 500, 500, 1, &left),
               DISPATCH__WAIT_SILENT);
  cr_assert_eq(dispatch__wait_verdict(900, 400, 500, 500, 0, &left),
               DISPATCH__WAIT_SILENT);
  /* silence comes before the deadline: poll until the silence */
  cr_assert_eq(dispatch__wait_verdict(100, 0, 800, 500, 1, &left),
               DISPATCH__WAIT_ON);
  cr_assert_eq(left, 400);
}

/* 0: no bound at all, and no keepalive asked for. */
Test(client_wait, no_bound_waits_forever) {
  int64_t left = 7;
  cr_assert_eq(dispatch__wait_verdict(1000000, 0, 0, 0, 1, &left),
               DISPATCH__WAIT_ON);
  cr_assert_eq(left, -1);
  cr_assert_eq(dispatch__keepalive_for(0), 0);
  cr_assert_eq(dispatch__keepalive_for(30000), 7500);
  cr_assert_eq(dispatch__keepalive_for(2), 1);
}
