/* dispatch-server's command line, through the real binary: --opt value and
 * --opt=value, size suffixes (K/M/G/T, KiB..., powers of 1024) and count
 * suffixes (powers of 1000), --version, --listen with a host name resolved
 * by libuv (localhost, [::1]) and the loopback rule applied to what the
 * name resolves to, the refusals and their messages (each names the option
 * and the value), and a client reaching the server by name. Every server
 * listens on loopback with an ephemeral port. */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dispatch_client.h"

/* A server run: what it printed and how it ended. */
typedef struct run {
  pid_t pid;      /* > 0 while it still runs (it printed its line) */
  int status;     /* exit status when it ended, -1 while running */
  char out[16384]; /* stdout (--help is over 4 KiB) */
  char err[8192]; /* stderr */
  int port;       /* from "dispatch-server listening on IP:PORT" */
  char ip[64];
} run;

static run g_run;

static void stop_run(run *r) {
  if (r->pid <= 0) return;
  kill(r->pid, SIGTERM);
  int st;
  waitpid(r->pid, &st, 0);
  r->pid = 0;
  r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

static void cleanup(void) { stop_run(&g_run); }

static void append(char *buf, size_t cap, size_t *len, int fd, int *open_) {
  char tmp[1024];
  ssize_t n = read(fd, tmp, sizeof tmp);
  if (n <= 0) {
    *open_ = 0;
    return;
  }
  size_t k = (size_t)n < cap - 1 - *len ? (size_t)n : cap - 1 - *len;
  memcpy(buf + *len, tmp, k);
  *len += k;
  buf[*len] = '\0';
}

/* Runs dispatch-server with exactly args (no implied --listen) and returns
 * once it either printed its listening line (r->pid stays > 0: the test
 * stops it) or exited (r->status). The bounded wait (60 s) only catches a
 * server that neither starts nor exits. */
static void start(run *r, const char *const *args) {
  const char *bin = getenv("DISPATCH_SERVER_BIN");
  if (!bin || !*bin) cr_skip_test("DISPATCH_SERVER_BIN is not set");
  memset(r, 0, sizeof *r);
  r->status = -1;
  int po[2], pe[2];
  cr_assert_eq(pipe(po), 0);
  cr_assert_eq(pipe(pe), 0);
  const char *argv[40] = {bin};
  int n = 1;
  for (; args[n - 1]; n++) argv[n] = args[n - 1];
  argv[n] = NULL;
  fflush(NULL);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    dup2(po[1], 1);
    dup2(pe[1], 2);
    close(po[0]);
    close(pe[0]);
    execv(bin, (char *const *)argv);
    _exit(127);
  }
  close(po[1]);
  close(pe[1]);
  size_t lo = 0, le = 0;
  int oo = 1, eo = 1;
  while (oo || eo) {
    if (strchr(r->out, '\n') && strstr(r->out, "listening on ")) break;
    struct pollfd p[2] = {{oo ? po[0] : -1, POLLIN, 0},
                          {eo ? pe[0] : -1, POLLIN, 0}};
    int pr = poll(p, 2, 60000);
    if (pr <= 0) {
      kill(pid, SIGKILL);
      break;
    }
    if (p[0].revents) append(r->out, sizeof r->out, &lo, po[0], &oo);
    if (p[1].revents) append(r->err, sizeof r->err, &le, pe[0], &eo);
  }
  close(po[0]);
  close(pe[0]);
  const char *l = strstr(r->out, "dispatch-server listening on ");
  if (l && strchr(l, '\n')) {
    r->pid = pid;
    l += strlen("dispatch-server listening on ");
    const char *colon = strrchr(l, ':');
    size_t il = (size_t)(colon - l);
    if (il >= sizeof r->ip) il = sizeof r->ip - 1;
    memcpy(r->ip, l, il);
    r->ip[il] = '\0';
    r->port = atoi(colon + 1);
    return;
  }
  int st;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  r->status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
}

/* The server must refuse args: exit status 2, nothing bound, and every
 * string of want (NULL-terminated) in its stderr. */
static void refused(const char *const *args, const char *const *want) {
  start(&g_run, args);
  cr_assert_eq(g_run.pid, 0, "it started: %s", g_run.out);
  cr_assert_eq(g_run.status, 2, "exit status %d; stderr: %s", g_run.status,
               g_run.err);
  for (; *want; want++)
    cr_assert(strstr(g_run.err, *want), "'%s' not in stderr: %s", *want,
              g_run.err);
}

/* A session to the server at spec can run one op: open, a tensor, sync. */
static void client_works(const char *spec) {
  dispatch_device *d = NULL;
  char msg[256] = "";
  int rc = dispatch_device_open(spec, NULL, &d, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s: %s: %s", spec, dispatch_err_name(rc), msg);
  dispatch_stats st = DISPATCH_STATS_INIT;
  rc = dispatch_device_stats(d, &st);
  cr_assert_eq(rc, 0, "%s", dispatch_device_errmsg(d));
  dispatch_device_close(d);
}

Test(cli, both_option_forms_and_size_suffixes, .fini = cleanup) {
  /* 8G of --max-memory; each suffix form, = and space, in one start */
  const char *a[] = {"--listen=127.0.0.1:0", "--max-memory=8G",
                     "--max-session-bytes", "512MiB", "--max-frame=64k",
                     "--storage-cache", "0", "--max-elements=2G",
                     "--max-op-cost", "1T", "--device-memory=1T",
                     "--log-level=warn", NULL};
  start(&g_run, a);
  cr_assert_gt(g_run.pid, 0, "exit %d; stderr: %s", g_run.status, g_run.err);
  cr_assert_str_eq(g_run.ip, "127.0.0.1");
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_run.port);
  client_works(spec);
  stop_run(&g_run);
  cr_assert_eq(g_run.status, 0, "%s", g_run.err);
}

Test(cli, size_suffix_is_a_power_of_1024, .fini = cleanup) {
  /* 63 bytes is under --max-frame's floor of 64; 1K is 1024, above it */
  const char *lo[] = {"--listen", "127.0.0.1:0", "--max-frame", "63", NULL};
  const char *w1[] = {"--max-frame", "'63'", "[64, 1099511627776]", NULL};
  refused(lo, w1);
  /* --max-frame's ceiling is 2^40 = 1T exactly: 1T passes, 1025G not */
  const char *hi[] = {"--listen=127.0.0.1:0", "--max-frame=1025G", NULL};
  const char *w2[] = {"--max-frame", "'1025G'", "out of range", NULL};
  refused(hi, w2);
  /* counts are powers of 1000: --max-elements' ceiling is 2^50 =
   * 1125899906842624, so 1125T (1.125e15) fits, 1126T does not; as
   * powers of 1024 both would be far over it */
  const char *c1[] = {"--max-elements", "1126T", NULL};
  const char *w3[] = {"--max-elements", "'1126T'", "out of range", NULL};
  refused(c1, w3);
  const char *ok[] = {"--listen=127.0.0.1:0", "--max-frame=1TiB",
                      "--max-memory", "8G", "--max-elements=1125T",
                      "--log-level=warn", NULL};
  start(&g_run, ok);
  cr_assert_gt(g_run.pid, 0, "exit %d; stderr: %s", g_run.status, g_run.err);
}

Test(cli, bad_values_name_the_option_and_the_value, .fini = cleanup) {
  const char *a1[] = {"--max-memory=8X", NULL};
  const char *w1[] = {"--max-memory", "'8X'", "K, M, G or T", NULL};
  refused(a1, w1);
  /* overflows 64 bits after the suffix, and before it */
  const char *a2[] = {"--max-memory", "99999999999G", NULL};
  const char *w2[] = {"--max-memory", "'99999999999G'", "out of range", NULL};
  refused(a2, w2);
  const char *a3[] = {"--max-memory", "99999999999999999999999", NULL};
  const char *w3[] = {"--max-memory", "'99999999999999999999999'",
                      "out of range", NULL};
  refused(a3, w3);
  const char *a4[] = {"--max-memory=-1", NULL};
  const char *w4[] = {"--max-memory", "'-1'", NULL};
  refused(a4, w4);
  const char *a5[] = {"--max-memory=", NULL};
  const char *w5[] = {"--max-memory", "''", NULL};
  refused(a5, w5);
  /* counts take no size suffix where a fraction of a thread is meant */
  const char *a6[] = {"--threads=2K", NULL};
  const char *w6[] = {"--threads", "'2K'", "whole number", NULL};
  refused(a6, w6);
  const char *a7[] = {"--max-memory", "8 G", NULL};
  const char *w7[] = {"--max-memory", "'8 G'", NULL};
  refused(a7, w7);
}

Test(cli, unknown_option_missing_value_stray_argument, .fini = cleanup) {
  const char *a1[] = {"--max-memry=8G", NULL};
  const char *w1[] = {"unknown", "'--max-memry=8G'", "--help", NULL};
  refused(a1, w1);
  const char *a2[] = {"--listen=127.0.0.1:0", "--max-memory", NULL};
  const char *w2[] = {"--max-memory needs a value", NULL};
  refused(a2, w2);
  const char *a3[] = {"--insecure=yes", NULL};
  const char *w3[] = {"--insecure takes no value", NULL};
  refused(a3, w3);
  const char *a5[] = {"--help=1", NULL};
  const char *w5[] = {"--help takes no value", NULL};
  refused(a5, w5);
  const char *a6[] = {"-x", NULL};
  const char *w6[] = {"unknown option '-x'", NULL};
  refused(a6, w6);
  const char *a4[] = {"--listen=127.0.0.1:0", "8G", NULL};
  const char *w4[] = {"unexpected argument '8G'", NULL};
  refused(a4, w4);
}

Test(cli, version_prints_the_build_version, .fini = cleanup) {
  const char *a[] = {"--version", NULL};
  start(&g_run, a);
  cr_assert_eq(g_run.status, 0, "%s", g_run.err);
  char want[64];
  snprintf(want, sizeof want, "dispatch-server %s\n", dispatch_version());
  cr_assert_str_eq(g_run.out, want);
  const char *h[] = {"--help", NULL};
  start(&g_run, h);
  cr_assert_eq(g_run.status, 0, "%s", g_run.err);
  cr_assert(strstr(g_run.out, "--version") && strstr(g_run.out, "8G"), "%s",
            g_run.out);
}

Test(cli, listen_localhost_and_a_client_by_name, .fini = cleanup) {
  const char *a[] = {"--listen", "localhost:0", "--log-level=warn", NULL};
  start(&g_run, a);
  cr_assert_gt(g_run.pid, 0, "exit %d; stderr: %s", g_run.status, g_run.err);
  cr_assert_str_eq(g_run.ip, "127.0.0.1"); /* /etc/hosts order */
  cr_assert_gt(g_run.port, 0);
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://localhost:%d", g_run.port);
  client_works(spec);
}

/* 1 when this machine can bind ::1 (an IPv6-less container cannot). */
static int have_ipv6_loopback(void) {
  int fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd < 0) return 0;
  struct sockaddr_in6 a;
  memset(&a, 0, sizeof a);
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  int ok = bind(fd, (struct sockaddr *)&a, sizeof a) == 0;
  close(fd);
  return ok;
}

Test(cli, listen_ipv6_loopback_and_a_client, .fini = cleanup) {
  if (!have_ipv6_loopback()) cr_skip_test("::1 cannot be bound here");
  const char *a[] = {"--listen=[::1]:0", "--log-level=warn", NULL};
  start(&g_run, a);
  cr_assert_gt(g_run.pid, 0, "exit %d; stderr: %s", g_run.status, g_run.err);
  cr_assert_str_eq(g_run.ip, "::1");
  char spec[64];
  snprintf(spec, sizeof spec, "tcp://[::1]:%d", g_run.port);
  client_works(spec);
  /* without brackets the port is a guess: refused before connecting, the
   * same rule as --listen's (the old parser took the last colon) */
  const char *bad[] = {"tcp://::1:%d", "tcp://[::1:%d", "tcp://[::1]%d",
                       "tcp://[]:%d"};
  for (int i = 0; i < 4; i++) {
    snprintf(spec, sizeof spec, bad[i], g_run.port);
    dispatch_device *d = NULL;
    char msg[512] = "";
    int rc = dispatch_device_open(spec, NULL, &d, msg, sizeof msg);
    cr_assert_eq(rc, DISPATCH_EINVAL, "%s: %s: %s", spec,
                 dispatch_err_name(rc), msg);
    cr_assert_null(d);
    cr_assert(strstr(msg, spec) && strstr(msg, "in brackets"), "%s", msg);
  }
}

Test(cli, listen_forms_refused, .fini = cleanup) {
  /* an IPv6 address needs brackets: "::1:0" could be ::1 port 0 or ::1:0 */
  const char *a1[] = {"--listen", "::1:0", NULL};
  const char *w1[] = {"--listen", "'::1:0'", "brackets", NULL};
  refused(a1, w1);
  const char *a2[] = {"--listen", "no-such-host.invalid:0", NULL};
  const char *w2[] = {"--listen", "cannot resolve 'no-such-host.invalid'",
                      NULL};
  refused(a2, w2);
  const char *a3[] = {"--listen", "localhost:70000", NULL};
  const char *w3[] = {"--listen port", "'70000'", NULL};
  refused(a3, w3);
}

/* The loopback rule judges what a name resolves to. glibc's resolver reads
 * a dotted "name" like 10.1 as 10.0.0.1 (inet_aton), which inet_pton never
 * accepted: the address, not the spelling, decides. */
Test(cli, non_loopback_name_refused_by_its_address, .fini = cleanup) {
  const char *a1[] = {"--listen", "10.1:0", NULL};
  const char *w1[] = {"refusing to listen on 10.1 (10.0.0.1)", "--insecure",
                      NULL};
  refused(a1, w1);
  /* 127.1 is 127.0.0.1: loopback, served without TLS */
  const char *a2[] = {"--listen", "127.1:0", "--log-level=warn", NULL};
  start(&g_run, a2);
  cr_assert_gt(g_run.pid, 0, "exit %d; stderr: %s", g_run.status, g_run.err);
  cr_assert_str_eq(g_run.ip, "127.0.0.1");
}

/* The option names of a list ("--a --b ") that are not in other, as
 * " --x --y" into miss (len bytes). */
static void missing(const char *list, const char *other, char *miss,
                    size_t len) {
  miss[0] = '\0';
  for (const char *p = list; (p = strstr(p, "--")); p += 2) {
    const char *end = strchr(p, ' ');
    size_t n = end ? (size_t)(end - p) : strlen(p);
    char key[80];
    snprintf(key, sizeof key, "%.*s ", (int)n, p);
    if (!strstr(other, key)) {
      size_t used = strlen(miss);
      snprintf(miss + used, len - used, " %.*s", (int)n, p);
    }
  }
}

/* The man page documents exactly the options --help prints: every
 * "  --name" that starts a line of --help is an entry of the man page's
 * OPTIONS (a .TP followed by .B or .BI \-\-name), and every entry there is
 * an option of --help. */
Test(cli, man_page_lists_exactly_the_help_options, .fini = cleanup) {
  const char *h[] = {"--help", NULL};
  start(&g_run, h);
  cr_assert_eq(g_run.status, 0, "%s", g_run.err);
  static char help[4096], man[4096];
  size_t hn = 0, mn = 0;
  for (const char *l = g_run.out; l && *l;
       l = strchr(l, '\n'), l = l ? l + 1 : l)
    if (strncmp(l, "  --", 4) == 0) {
      size_t n = strcspn(l + 2, " \n");
      hn +=
          (size_t)snprintf(help + hn, sizeof help - hn, "%.*s ", (int)n, l + 2);
    }
  /* the suites run from the repository root; __FILE__ is tests/... */
  char path[512];
  snprintf(path, sizeof path, "%s", __FILE__);
  char *slash = strrchr(path, '/');
  cr_assert(slash);
  snprintf(slash, sizeof path - (size_t)(slash - path),
           "/../docs/man/dispatch-server.1");
  FILE *f = fopen(path, "r");
  cr_assert(f, "cannot open %s", path);
  char line[512];
  int in_options = 0, after_tp = 0;
  while (fgets(line, sizeof line, f)) {
    if (strncmp(line, ".SH", 3) == 0)
      in_options = strstr(line, "OPTIONS") != NULL;
    const char *name = NULL;
    if (after_tp && strncmp(line, ".BI \\-\\-", 8) == 0)
      name = line + 4;
    else if (after_tp && strncmp(line, ".B \\-\\-", 7) == 0)
      name = line + 3;
    after_tp = in_options && strncmp(line, ".TP", 3) == 0;
    if (!name) continue;
    char opt[80];
    size_t k = 0;
    for (const char *p = name;
         *p && *p != ' ' && *p != '\n' && k + 1 < sizeof opt; p++)
      if (*p != '\\') opt[k++] = *p; /* \- is a hyphen */
    opt[k] = '\0';
    mn += (size_t)snprintf(man + mn, sizeof man - mn, "%s ", opt);
  }
  fclose(f);
  cr_assert_gt(hn, 0, "no options in --help: %s", g_run.out);
  char miss[1024];
  missing(help, man, miss, sizeof miss);
  cr_expect_str_empty(miss, "in --help but not in %s:%s", path, miss);
  missing(man, help, miss, sizeof miss);
  cr_expect_str_empty(miss, "in %s but not in --help:%s", path, miss);
}
