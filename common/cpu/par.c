/* The CPU backend's thread pool (par.h). One job at a time: a caller
 * that finds the pool busy runs its chunks alone, so two server workers
 * never wait on each other here, and a chunk that starts a job of its own
 * runs that one alone too. Helpers join a job under the mutex (which is
 * what lets the caller retire the job: after it has taken the job back,
 * nobody new can join, and it waits only for those that did); chunks are
 * claimed with one atomic add each. */
#include "par.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#define PAR_MAX_THREADS 256
/* how long an idle helper polls for the next job before it sleeps: a
 * training step's kernels follow each other within microseconds, and a
 * wake-up through the condition variable costs tens of them */
#define PAR_SPIN_NS 50000

typedef struct par_job {
  dsp_par_fn fn;
  void *arg;
  dsp_ctx *ctx;
  int64_t n, grain, nchunks;
  int max_lanes;   /* dsp__par_lanes(nchunks) */
  int lanes_given; /* under g_par.mu: lanes handed to helpers so far */
  atomic_llong next;
  atomic_int stop;
  atomic_int active; /* helpers that joined and have not finished */
} par_job;

static struct {
  pthread_once_t once;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int nhelp;        /* helpers started; 0: every job runs on its caller */
  atomic_uint gen;  /* bumped (under mu) for each job published */
  par_job *job;     /* under mu: the job helpers may join, or NULL */
  atomic_flag busy; /* set while a caller owns the pool */
  atomic_int cap;   /* dsp__par_set_threads: 0 none, else at most cap lanes */
  pthread_t th[PAR_MAX_THREADS];
} g_par = {PTHREAD_ONCE_INIT, PTHREAD_MUTEX_INITIALIZER,
           PTHREAD_COND_INITIALIZER, 0, 0, NULL, ATOMIC_FLAG_INIT, 0, {0}};

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  __asm__ __volatile__("" ::: "memory");
#endif
}

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claims and runs chunks of j until none is left or the job stops. */
static void par_work(par_job *j, int lane) {
  for (;;) {
    if (atomic_load_explicit(&j->stop, memory_order_relaxed)) return;
    int64_t k = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    if (k >= j->nchunks) return;
    if (dsp_ctx_cancelled(j->ctx)) {
      atomic_store_explicit(&j->stop, 1, memory_order_relaxed);
      return;
    }
    int64_t lo = k * j->grain;
    int64_t hi = j->n - lo < j->grain ? j->n : lo + j->grain;
    if (j->fn(j->arg, lo, hi, lane)) {
      atomic_store_explicit(&j->stop, 1, memory_order_relaxed);
      return;
    }
  }
}

static void *par_main(void *unused) {
  (void)unused;
  unsigned seen = atomic_load(&g_par.gen);
  for (;;) {
    int64_t t0 = now_ns();
    for (unsigned spins = 1;
         atomic_load_explicit(&g_par.gen, memory_order_acquire) == seen;
         spins++) {
      cpu_relax();
      if ((spins & 63) == 0 && now_ns() - t0 > PAR_SPIN_NS) break;
    }
    pthread_mutex_lock(&g_par.mu);
    while (atomic_load_explicit(&g_par.gen, memory_order_relaxed) == seen)
      pthread_cond_wait(&g_par.cv, &g_par.mu);
    seen = atomic_load_explicit(&g_par.gen, memory_order_relaxed);
    par_job *j = g_par.job;
    int lane = 0;
    if (j && j->lanes_given + 1 < j->max_lanes) {
      lane = ++j->lanes_given;
      atomic_fetch_add_explicit(&j->active, 1, memory_order_relaxed);
    } else {
      j = NULL;
    }
    pthread_mutex_unlock(&g_par.mu);
    if (j) {
      par_work(j, lane);
      atomic_fetch_sub_explicit(&j->active, 1, memory_order_release);
    }
  }
  return NULL;
}

/* A forked child has only the thread that forked: its jobs run alone. */
static void par_child(void) {
  g_par.nhelp = 0;
  pthread_mutex_init(&g_par.mu, NULL);
  pthread_cond_init(&g_par.cv, NULL);
  g_par.job = NULL;
  atomic_flag_clear(&g_par.busy);
}

static int par_threads_wanted(void) {
  const char *e = getenv("DISPATCH_CPU_THREADS");
  if (e && *e) {
    char *end;
    long v = strtol(e, &end, 10);
    if (*end == '\0' && v >= 1 && v <= PAR_MAX_THREADS) return (int)v;
  }
  cpu_set_t set;
  int n = 1;
  if (sched_getaffinity(0, sizeof set, &set) == 0) n = CPU_COUNT(&set);
  return n < 1 ? 1 : n > PAR_MAX_THREADS ? PAR_MAX_THREADS : n;
}

/* OpenBLAS (its pthreads build) */
extern void openblas_set_num_threads(int n);
extern int openblas_get_num_threads(void);

void dsp__par_blas_single(void) {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

static void par_start_once(void) {
  dsp__par_blas_single();
  int want = par_threads_wanted() - 1;
  if (want <= 0) return;
  /* helpers take no signals: the process's handlers stay on its own
   * threads (the server's loop) */
  sigset_t all, old;
  sigfillset(&all);
  pthread_sigmask(SIG_SETMASK, &all, &old);
  int n = 0;
  while (n < want && pthread_create(&g_par.th[n], NULL, par_main, NULL) == 0)
    n++;
  pthread_sigmask(SIG_SETMASK, &old, NULL);
  pthread_mutex_lock(&g_par.mu);
  g_par.nhelp = n;
  pthread_mutex_unlock(&g_par.mu);
  pthread_atfork(NULL, NULL, par_child);
}

int dsp__par_lanes(int64_t chunks) {
  pthread_once(&g_par.once, par_start_once);
  if (g_par.nhelp == 0) return 1;
  int64_t lanes = (int64_t)g_par.nhelp + 1;
  const int cap = atomic_load_explicit(&g_par.cap, memory_order_relaxed);
  if (cap > 0 && cap < lanes) lanes = cap;
  if (chunks >= 1 && chunks < lanes) lanes = chunks;
  return (int)lanes;
}

void dsp__par_set_threads(int n) {
  atomic_store(&g_par.cap, n > 0 ? n : 0);
}

int dsp__par_for(dsp_ctx *ctx, int64_t n, int64_t grain, dsp_par_fn fn,
                 void *arg) {
  if (grain < 1) grain = 1;
  const int64_t nch = dsp__par_nchunks(n, grain);
  int lanes = dsp__par_lanes(nch);
  if (lanes > 1 && atomic_flag_test_and_set(&g_par.busy)) lanes = 1;
  if (lanes <= 1) {
    for (int64_t k = 0; k < nch; k++) {
      int64_t lo = k * grain, hi = n - lo < grain ? n : lo + grain;
      if (dsp_ctx_cancelled(ctx) || fn(arg, lo, hi, 0)) return 1;
    }
    return 0;
  }
  par_job j = {.fn = fn, .arg = arg, .ctx = ctx, .n = n, .grain = grain,
               .nchunks = nch, .max_lanes = lanes};
  atomic_init(&j.next, 0);
  atomic_init(&j.stop, 0);
  atomic_init(&j.active, 0);
  pthread_mutex_lock(&g_par.mu);
  g_par.job = &j;
  atomic_fetch_add_explicit(&g_par.gen, 1, memory_order_release);
  pthread_cond_broadcast(&g_par.cv);
  pthread_mutex_unlock(&g_par.mu);
  par_work(&j, 0);
  pthread_mutex_lock(&g_par.mu);
  g_par.job = NULL;
  pthread_mutex_unlock(&g_par.mu);
  while (atomic_load_explicit(&j.active, memory_order_acquire) > 0)
    cpu_relax();
  atomic_flag_clear(&g_par.busy);
  return atomic_load_explicit(&j.stop, memory_order_relaxed) != 0;
}
