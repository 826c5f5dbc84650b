/* Worker pool: runs sessions' jobs off the loop thread.
 *
 * Guarantees: jobs of one session run in submission order and never on two
 * workers at once. A worker takes a session's queued jobs as one batch
 * (one lock round and no wake-up per job, which is what small pipelined
 * ops were paying for) and runs them in order for one turn: the turn ends
 * after SV_TURN_JOBS jobs or once the work of the jobs it ran reaches
 * SV_TURN_COST (s->turn_cost, dsp_op_cost units; a Backward or Step ends a
 * turn by itself), and the session, if it has jobs left, goes to the back
 * of the run queue. So a session with a long FIFO delays another session
 * by at most one turn per worker. The ctx's cancel flag is read before
 * each job: once a session is cancelled its jobs not yet run go back to
 * the loop unrun (they were dropped with their connection), all but its
 * teardown, which runs. Finished jobs go back to the loop (woken through
 * an eventfd) in completion order, published together at the end of a
 * turn, or at once after a job that has a reply so no reply waits behind
 * later work (the turn's last job excepted: it goes with the end of the
 * turn, which marks the session not running in the same lock hold). A
 * worker that takes the same session again at once (it is alone in the
 * run queue) carries a turn's finished jobs without a reply into the
 * next turn instead, so the loop is not woken for a turn that merely
 * ended. The loop submits what one socket read decoded as one list, and
 * signals a worker after unlocking. */
#include <stdlib.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <uv.h>

#include "sv.h"

struct sv_pool {
  /* the loop's wake-up: an eventfd it polls (uv_poll), written when
   * finished jobs land in an empty done list. Not a uv_async: its sender
   * marks the handle busy around the write, and the loop, woken by that
   * write and run at once on the sender's core, spins and yields until
   * the sender is back to clear the mark (24 us a reply here, measured
   * from the worker's send to the loop's callback) */
  uv_poll_t poll;
  int efd;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  sv_session *runq_head, *runq_tail;
  int stop;
  int running; /* sessions a worker is running now */
  sv_job *done_head, *done_tail;
  pthread_t *threads;
  int n_threads;
  sv_done_fn done;
  void *ud;
  pthread_t loop_thread; /* sv_pool_new's: the only one that submits */
};

/* 1 on the pool's loop thread (SV_DEBUG_CHECK) */
static int on_loop(const sv_pool *p) {
  return pthread_equal(pthread_self(), p->loop_thread) != 0;
}

/* 1 when every job of head.. belongs to s (SV_DEBUG_CHECK) */
static int one_session(const sv_job *head, const sv_session *s) {
  for (const sv_job *j = head; j; j = j->next)
    if (j->sess != s) return 0;
  return 1;
}

static void runq_push(sv_pool *p, sv_session *s) {
  s->runq_next = NULL;
  if (p->runq_tail) p->runq_tail->runq_next = s;
  else p->runq_head = s;
  p->runq_tail = s;
}

/* Appends the finished jobs head..tail to the done list (caller holds the
 * lock). */
static void done_append(sv_pool *p, sv_job *head, sv_job *tail) {
  if (!head) return;
  if (p->done_tail) p->done_tail->next = head;
  else p->done_head = head;
  p->done_tail = tail;
}

/* Wakes the loop for the done list (no lock held). */
static void done_notify(sv_pool *p) {
  uint64_t one = 1;
  /* fails only with EAGAIN, when the counter is full: already readable */
  ssize_t n = write(p->efd, &one, sizeof one);
  (void)n;
}

/* Appends head..tail (may be empty), finished jobs of s, to the done
 * list (lock held) and counts the return; 1 when the loop must be woken
 * for them (done_notify, after the unlock), 0 when there is nothing or the
 * list was not empty (the loop is woken for it already, and takes it
 * whole). The loop may free s once its teardown is on the list. */
static int done_hand(sv_pool *p, sv_session *s, sv_job *head, sv_job *tail) {
  if (!head) return 0;
  s->n_returns++;
  int wake = !p->done_head;
  done_append(p, head, tail);
  return wake;
}

/* done_hand from a worker holding the lock: the wake-up, when one is due,
 * goes out with the lock released for it. */
static void done_hand_wake(sv_pool *p, sv_session *s, sv_job *head,
                           sv_job *tail) {
  if (done_hand(p, s, head, tail)) {
    pthread_mutex_unlock(&p->mu);
    done_notify(p);
    pthread_mutex_lock(&p->mu);
  }
}

/* Hands head..tail, finished jobs of s, to the loop: one lock round and
 * at most one eventfd write. */
static void done_publish(sv_pool *p, sv_session *s, sv_job *head,
                         sv_job *tail) {
  if (!head) return;
  pthread_mutex_lock(&p->mu);
  int wake = done_hand(p, s, head, tail);
  pthread_mutex_unlock(&p->mu);
  if (wake) done_notify(p);
}

/* Takes up to SV_TURN_JOBS jobs off the front of s's FIFO (lock held);
 * NULL when every job was cancelled. */
static sv_job *take_batch(sv_session *s) {
  sv_job *head = s->fifo_head, *last = head;
  if (!head) return NULL;
  for (int n = 1; n < SV_TURN_JOBS && last->next; n++) last = last->next;
  s->fifo_head = last->next;
  if (!s->fifo_head) s->fifo_tail = NULL;
  last->next = NULL;
  return head;
}

/* Runs one turn of s over batch (no lock held). Returns the jobs it did
 * not run (the turn's budget ran out), in order. Jobs finished before a
 * reply are published to the loop as the turn goes; the rest are left in
 * *dh..*dt for the caller to publish under the same lock hold that ends
 * the turn: once the loop has the teardown job it may free s, so nothing
 * may touch s after that. *torn is set when the teardown ran. */
static sv_job *run_turn(sv_pool *p, sv_session *s, sv_job *batch, int *torn,
                        sv_job **dh_out, sv_job **dt_out) {
  sv_job *dh = NULL, *dt = NULL; /* finished, not yet published */
  int dropping = 0;
  s->turn_cost = 0;
  s->n_batches++;
  while (batch) {
    sv_job *j = batch;
    batch = j->next;
    j->next = NULL;
    if (j->kind == SV_JOB_TEARDOWN) {
      SV_DEBUG_CHECK(!batch, "a teardown is its session's last job");
      sv_session_teardown(s); /* always the session's last job */
      *torn = 1;
    } else if (dropping || dsp_ctx_cancelled(s->ctx)) {
      /* the connection is gone, and its queued jobs with it: the loop
       * frees these unrun, as it does sv_pool_cancel's; only a teardown
       * behind them still runs */
      dropping = 1;
    } else {
      sv_session_exec(s, j);
    }
    if (dt) dt->next = j;
    else dh = j;
    dt = j;
    if (*torn) break;
    if (dropping) continue;
    /* a reply is not held behind the rest of the turn; the last job's
     * goes out with the turn's end, under the lock that marks the session
     * not running, so a client that sends its next request on that reply
     * finds the session idle (and its tiny ops may run inline) */
    if (j->out && batch) {
      done_publish(p, s, dh, dt);
      dh = dt = NULL;
    }
    if (s->turn_cost >= SV_TURN_COST) break;
  }
  *dh_out = dh;
  *dt_out = dt;
  return batch;
}

static void *worker_main(void *arg) {
  sv_pool *p = arg;
  sv_job *carry_h = NULL, *carry_t = NULL; /* finished, held for a turn */
  pthread_mutex_lock(&p->mu);
  for (;;) {
    while (!p->stop && !p->runq_head) pthread_cond_wait(&p->cv, &p->mu);
    if (p->stop) {
      done_append(p, carry_h, carry_t); /* as any job finished at the end */
      break;
    }
    sv_session *s = p->runq_head;
    SV_DEBUG_CHECK(!on_loop(p) && s->scheduled && !s->running,
                   "a scheduled session runs on one worker at a time");
    p->runq_head = s->runq_next;
    if (!p->runq_head) p->runq_tail = NULL;
    sv_job *batch = take_batch(s);
    if (!batch) { /* every job was cancelled */
      s->scheduled = 0;
      /* what s's last turn finished goes to the loop now */
      done_hand_wake(p, s, carry_h, carry_t);
      carry_h = carry_t = NULL;
      continue;
    }
    s->running = 1;
    p->running++;
    pthread_mutex_unlock(&p->mu);

    int torn = 0;
    sv_job *dh, *dt;
    sv_job *rest = run_turn(p, s, batch, &torn, &dh, &dt);
    if (carry_h && dh) { /* the jobs carried from s's last turn go first */
      carry_t->next = dh;
      dh = carry_h;
    } else if (carry_h) {
      dh = carry_h;
      dt = carry_t;
    }
    carry_h = carry_t = NULL;

    pthread_mutex_lock(&p->mu);
    s->running = 0;
    p->running--;
    if (rest) { /* back in front of whatever arrived meanwhile */
      sv_job *last = rest;
      while (last->next) last = last->next;
      last->next = s->fifo_head;
      s->fifo_head = rest;
      if (!s->fifo_tail) s->fifo_tail = last;
    }
    if (!torn && s->fifo_head) {
      /* this worker takes the front of the run queue next: a session
       * alone there is its own again, and waking another worker for it
       * only cost a wake-up and a core's worth of contention */
      int alone = !p->runq_head;
      runq_push(p, s);
      if (!alone) pthread_cond_signal(&p->cv);
      /* ... and then the finished jobs need not go to the loop yet when
       * none has a reply (only the last may): this worker holds the lock
       * until it takes s again, so they go with s's next turn, in order,
       * and the loop is not woken for a turn that only ended (a Backward
       * and a Step each end one) */
      if (alone && dh && !dt->out) {
        int n = 0;
        for (sv_job *j = dh; j && n <= SV_CARRY_JOBS; j = j->next) n++;
        if (n <= SV_CARRY_JOBS) {
          carry_h = dh;
          carry_t = dt;
          continue;
        }
      }
    } else {
      SV_DEBUG_CHECK(!s->fifo_head, "no job is queued behind a teardown");
      s->scheduled = 0;
    }
    /* last: from here the loop may free s (after its teardown) */
    done_hand_wake(p, s, dh, dt);
  }
  pthread_mutex_unlock(&p->mu);
  return NULL;
}

/* Delivers finished jobs on the loop thread. */
static void on_done_ready(uv_poll_t *h, int status, int events) {
  (void)status;
  (void)events;
  sv_pool *p = h->data;
  SV_DEBUG_CHECK(on_loop(p), "finished jobs go back on the loop thread");
  uint64_t v;
  /* reset before taking the list: a job published after the take writes
   * again, so none waits for a wake-up that was read already */
  ssize_t n = read(p->efd, &v, sizeof v);
  (void)n;
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
  p->loop_thread = pthread_self(); /* the loop's: made before it runs */
  pthread_mutex_init(&p->mu, NULL);
  pthread_cond_init(&p->cv, NULL);
  p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (p->efd < 0 || uv_poll_init(loop, &p->poll, p->efd) != 0) {
    if (p->efd >= 0) close(p->efd);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->cv);
    dsp_free(p->threads);
    dsp_free(p);
    return NULL;
  }
  p->poll.data = p;
  uv_poll_start(&p->poll, UV_READABLE, on_done_ready);
  for (int i = 0; i < n; i++) {
    if (pthread_create(&p->threads[i], NULL, worker_main, p) != 0) break;
    p->n_threads++;
  }
  if (p->n_threads == 0) {
    sv_pool_close(p); /* caller runs the loop once to close the poll */
    return NULL;
  }
  return p;
}

void sv_pool_submit_list(sv_pool *p, sv_job *head, sv_job *tail) {
  sv_session *s = head->sess;
  tail->next = NULL;
  SV_DEBUG_CHECK(on_loop(p) && one_session(head, s),
                 "the loop alone submits, one session's jobs at a time");
  pthread_mutex_lock(&p->mu);
  s->n_handoffs++;
  if (s->fifo_tail) s->fifo_tail->next = head;
  else s->fifo_head = head;
  s->fifo_tail = tail;
  int wake = !s->scheduled;
  if (wake) {
    s->scheduled = 1;
    runq_push(p, s);
  }
  pthread_mutex_unlock(&p->mu);
  /* after the unlock: a worker woken under the lock would only block on
   * it, a second wake-up */
  if (wake) pthread_cond_signal(&p->cv);
}

void sv_pool_submit(sv_pool *p, sv_job *j) { sv_pool_submit_list(p, j, j); }

int sv_pool_session_idle(sv_pool *p, sv_session *s) {
  /* idle hands the worker-side state of s to the caller: only the loop */
  SV_DEBUG_CHECK(on_loop(p), "a session's idle state is asked on the loop");
  pthread_mutex_lock(&p->mu);
  int idle = !s->scheduled && !s->running && !s->fifo_head;
  pthread_mutex_unlock(&p->mu);
  return idle;
}

int sv_pool_idle(sv_pool *p) {
  pthread_mutex_lock(&p->mu);
  int idle = !p->runq_head && p->running == 0;
  pthread_mutex_unlock(&p->mu);
  return idle;
}

sv_job *sv_pool_cancel(sv_pool *p, sv_session *s) {
  SV_DEBUG_CHECK(on_loop(p), "queued jobs are cancelled on the loop thread");
  pthread_mutex_lock(&p->mu);
  sv_job *list = s->fifo_head;
  s->fifo_head = s->fifo_tail = NULL;
  pthread_mutex_unlock(&p->mu);
  return list;
}

static void free_poll_owner(uv_handle_t *h) {
  sv_pool *p = h->data;
  close(p->efd);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  dsp_free(p->threads);
  dsp_free(p);
}

void sv_pool_close(sv_pool *p) {
  SV_DEBUG_CHECK(on_loop(p), "the pool closes on the loop thread");
  pthread_mutex_lock(&p->mu);
  p->stop = 1;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
  p->n_threads = 0;
  /* jobs finished after the last delivery are dropped with their
   * sessions by the caller, which only closes the pool when none remain */
  uv_close((uv_handle_t *)&p->poll, free_poll_owner);
}
