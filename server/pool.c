/* Worker pool: runs sessions' jobs off the loop thread.
 *
 * Guarantees: jobs of one session run in submission order and never on two
 * workers at once; a worker runs one job of a session and then puts the
 * session at the back of the run queue, so a session with a long FIFO (or
 * one slow op) delays another session by at most the jobs already running.
 * Finished jobs go back to the loop through a uv_async in completion
 * order. */
#include <stdlib.h>
#include <uv.h>

#include "sv.h"

struct sv_pool {
  uv_async_t async; /* first: the loop sees &async as the handle */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sv_session *runq_head, *runq_tail;
  int stop;
  sv_job *done_head, *done_tail;
  pthread_t *threads;
  int n_threads;
  sv_done_fn done;
  void *ud;
};

static void runq_push(sv_pool *p, sv_session *s) {
  s->runq_next = NULL;
  if (p->runq_tail) p->runq_tail->runq_next = s;
  else p->runq_head = s;
  p->runq_tail = s;
}

static void *worker_main(void *arg) {
  sv_pool *p = arg;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && !p->runq_head) pthread_cond_wait(&p->cv, &p->mu);
    if (p->stop) break;
    sv_session *s = p->runq_head;
    p->runq_head = s->runq_next;
    if (!p->runq_head) p->runq_tail = NULL;
    sv_job *j = s->fifo_head;
    if (!j) { /* every job was cancelled */
      s->scheduled = 0;
      continue;
    }
    s->fifo_head = j->next;
    if (!s->fifo_head) s->fifo_tail = NULL;
    j->next = NULL;
    s->running = 1;
    pthread_mutex_unlock(&p->mu);

    if (j->kind == SV_JOB_TEARDOWN) sv_session_teardown(s);
    else sv_session_exec(s, j);

    pthread_mutex_lock(&p->mu);
    s->running = 0;
    if (j->kind != SV_JOB_TEARDOWN && s->fifo_head) {
      runq_push(p, s);
      pthread_cond_signal(&p->cv);
    } else {
      s->scheduled = 0;
    }
    if (p->done_tail) p->done_tail->next = j;
    else p->done_head = j;
    p->done_tail = j;
    pthread_mutex_unlock(&p->mu);
    uv_async_send(&p->async);
    pthread_mutex_lock(&p->mu);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* Delivers finished jobs on the loop thread. */
static void on_async(uv_async_t *a) {
  sv_pool *p = (sv_pool *)a;
  pthread_mutex_lock(&p->mu);
  sv_job *list = p->done_head;
  p->done_head = p->done_tail = NULL;
  pthread_mutex_unlock(&p->mu);
  while (list) {
    sv_job *next = list->next;
    list->next = NULL;
    p->done(list, p->ud);
    list = next;
  }
}

sv_pool *sv_pool_new(void *loop, int n, sv_done_fn done, void *ud) {
  if (n < 1) n = 1;
  sv_pool *p = dsp_calloc(1, sizeof *p);
  if (!p) return NULL;
  p->threads = dsp_calloc((size_t)n, sizeof *p->threads);
  if (!p->threads) {
    dsp_free(p);
    return NULL;
  }
  p->done = done;
  p->ud = ud;
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  if (uv_async_init(loop, &p->async, on_async) != 0) {
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    dsp_free(p->threads);
    dsp_free(p);
    return NULL;
  }
  for (int i = 0; i < n; i++) {
    if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) break;
    p->n_threads++;
  }
  if (p->n_threads == 0) {
    sv_pool_close(p); /* caller runs the loop once to close the async */
    return NULL;
  }
  return p;
}

void sv_pool_submit(sv_pool *p, sv_job *j) {
  sv_session *s = j->sess;
  j->next = NULL;
  pthread_mutex_lock(&p->mu);
  if (s->fifo_tail) s->fifo_tail->next = j;
  else s->fifo_head = j;
  s->fifo_tail = j;
  if (!s->scheduled) {
    s->scheduled = 1;
    runq_push(p, s);
    pthread_cond_signal(&p->cv);
  }
  pthread_mutex_unlock(&p->mu);
}

int sv_pool_session_idle(sv_pool *p, sv_session *s) {
  pthread_mutex_lock(&p->mu);
  int idle = !s->scheduled && !s->running && !s->fifo_head;
  pthread_mutex_unlock(&p->mu);
  return idle;
}

sv_job *sv_pool_cancel(sv_pool *p, sv_session *s) {
  pthread_mutex_lock(&p->mu);
  sv_job *list = s->fifo_head;
  s->fifo_head = s->fifo_tail = NULL;
  pthread_mutex_unlock(&p->mu);
  return list;
}

static void free_async_owner(uv_handle_t *h) {
  sv_pool *p = (sv_pool *)h;
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  dsp_free(p->threads);
  dsp_free(p);
}

void sv_pool_close(sv_pool *p) {
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
  p->n_threads = 0;
  /* jobs finished after the last async callback are dropped with their
   * sessions by the caller, which only closes the pool when none remain */
  uv_close((uv_handle_t *)&p->async, free_async_owner);
}
