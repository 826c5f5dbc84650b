/* The server's debug checks (SV_DEBUG_CHECK, server/sv.h). Built with
 * DSP_DEBUG=1 (make sanitize), a broken thread rule aborts the process and
 * names the rule; in a release build the check is compiled out, its
 * condition not even evaluated, and the call does its work. */
#include <criterion/criterion.h>
#include <pthread.h>
#include <signal.h>
#include <uv.h>

#include "sv.h"

#if defined(DSP_DEBUG) && DSP_DEBUG
#define CHECKED 1
#define BROKEN_RULE .signal = SIGABRT
#else
#define CHECKED 0
#define BROKEN_RULE .signal = 0
#endif

static void no_done(sv_job *j, void *ud) {
  (void)j;
  (void)ud;
}

/* a pool whose loop thread is this one, as sv_run makes it */
static uv_loop_t g_loop;
static sv_pool *pool_on_this_thread(void) {
  cr_assert_eq(uv_loop_init(&g_loop), 0);
  sv_pool *p = sv_pool_new(&g_loop, 1, no_done, NULL);
  cr_assert_not_null(p);
  return p;
}

static void pool_done(sv_pool *p) {
  sv_pool_close(p);
  uv_run(&g_loop, UV_RUN_DEFAULT);
  cr_assert_eq(uv_loop_close(&g_loop), 0);
}

typedef struct asker {
  sv_pool *p;
  sv_session *s;
  int idle;
} asker;

static void *ask_idle(void *arg) {
  asker *a = arg;
  a->idle = sv_pool_session_idle(a->p, a->s);
  return NULL;
}

Test(debug_checks, condition_evaluated_only_when_checked) {
  int n = 0;
  SV_DEBUG_CHECK(++n > 0, "a check that holds");
  cr_assert_eq(n, CHECKED);
}

Test(debug_checks, idle_asked_on_the_loop_thread) {
  sv_pool *p = pool_on_this_thread();
  sv_session s = {0};
  cr_assert_eq(sv_pool_session_idle(p, &s), 1);
  pool_done(p);
}

/* a worker (or any thread but the loop) asking whether a session is idle
 * would take its worker-side state while the loop may too */
Test(debug_checks, idle_asked_off_the_loop_thread, BROKEN_RULE) {
  sv_pool *p = pool_on_this_thread();
  sv_session s = {0};
  asker a = {p, &s, -1};
  pthread_t th;
  cr_assert_eq(pthread_create(&th, NULL, ask_idle, &a), 0);
  pthread_join(th, NULL);
  /* reached only in a release build: unchecked, the answer is still right */
  cr_assert_eq(CHECKED, 0);
  cr_assert_eq(a.idle, 1);
  pool_done(p);
}
