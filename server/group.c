/* The MPI group of dispatch-server --mpi (protocol 1.7): the servers of
 * one mpirun job, rank r listening on --listen's port + r, all-reduce
 * tensors and gradients for their clients.
 *
 * Threads. Every MPI call is made by one thread of its own (the group
 * thread, which also called MPI_Init_thread); a worker running a
 * GroupAllreduce or a grouped Step packs the tensors into a host block,
 * queues it here and waits, at most a bounded time, for the group thread
 * to say it is reduced; the libuv loop never waits for MPI.
 *
 * Order. Clients may send the all-reduces of several groups, and the
 * servers receive them in any order, while MPI needs every rank to enter
 * the same collective. So rank 0 chooses: its group thread takes its
 * oldest queued all-reduce and broadcasts its key (the client's group
 * and sequence number); each rank then looks for that key among its own
 * (waiting --mpi-timeout for it to arrive), and all ranks exchange a
 * fixed header (present, dtype, count, number of tensors, a hash of the
 * shapes, the reduction). Only when every header agrees does the data
 * move, so a member that lacks the request or holds other shapes makes
 * every member refuse it with the same message, and the MPI calls stay
 * in step.
 *
 * Failure. MPI's error handler returns (the plugin sets
 * MPI_ERRORS_RETURN). A worker waits at most 3 x --mpi-timeout: past it,
 * an all-reduce not yet started is withdrawn, and one inside MPI marks
 * the group broken (the group thread is stuck in a collective a peer
 * will never finish), so this and every later all-reduce fail at once
 * with DISPATCH_EGROUP; the group must be restarted (README). Open MPI
 * 4.1 itself ends the whole job when a rank dies (mpirun kills the
 * survivors), so clients of the others see their connection close.
 *
 * CUDA tensors. When every member holds the tensors of an all-reduce on a
 * CUDA device and loaded the NCCL plugin (dispatch-nccl.so, loaded by
 * the group thread when the server has a CUDA device), the reduction
 * runs through NCCL on the GPUs, in place on the tensors' storage and on
 * their session's stream, with no host copy. The header says where each
 * rank holds them (sv_gplace), so all ranks choose the path alike
 * (sv_group_nccl_path); with any member on the CPU or without NCCL the
 * host path runs, CUDA tensors staged through host memory by their worker
 * when the group thread asks (GOP_STAGE). One NCCL communicator per
 * combination of the ranks' devices, made at the first all-reduce that
 * needs it, inside that round: rank 0's ncclGetUniqueId broadcast over
 * MPI, ncclCommInitRankConfig on every rank, the outcomes exchanged so a
 * failed init refuses that all-reduce on every rank with the same message;
 * those devices then take the host path. An NCCL all-reduce that fails or
 * passes --mpi-timeout aborts its communicator and breaks the group, as
 * a failed MPI call does. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cuda_plugin.h"
#include "group.h"
#include "group_mpi.h"
#include "group_nccl.h"
#include "handlers.h"

/* GOP_STAGE: the group thread chose the host path for an all-reduce whose
 * CUDA tensors are not staged yet; the worker stages them and sets it
 * back to GOP_RUNNING */
enum { GOP_QUEUED, GOP_RUNNING, GOP_STAGE, GOP_DONE };

typedef struct sv_gop {
  struct sv_gop *next;
  uint64_t group, seq;
  int64_t reduce, type, count, n, hash;
  void *buf;
  dsp_budget *budget; /* charged buf's bytes (holding a reference) */
  uint64_t charged;
  int state;
  int refs; /* the worker and, while it works on it, the group thread */
  int rc;
  char why[384];
  sv_gplace place;
  /* place.kind SV_GK_CUDA with NCCL loaded: buf stays NULL until the host
   * path asks for it; ts holds references to the tensors, whose device
   * bytes (ptrs, counts elements each, on stream) NCCL reduces in place */
  int lazy;
  size_t n_ts;
  dsp_tensor **ts;
  void **ptrs;
  size_t *counts;
  void *stream;
  int stage_rc; /* the worker's staging on GOP_STAGE */
  char stage_why[248];
} sv_gop;

/* What every rank sends before the data (allgather): equal on every rank,
 * or the all-reduce is refused. */
typedef struct ghdr {
  uint64_t group, seq;
  int64_t present, type, reduce, count, n, hash;
  sv_gplace place;
} ghdr;

/* One rank's outcome of a local step (a staging, an NCCL init), gathered
 * so every rank reaches the same verdict (agree). */
typedef struct gverdict {
  int64_t rc;
  char why[248];
} gverdict;

/* An NCCL communicator over the ranks' devices (key: a hash of their
 * ordinals, by rank), or the reason its init failed. A fixed table, so
 * that recording an outcome never fails on one rank alone: every rank
 * holds the same entries in the same order. */
#define G_MAX_COMMS 16
typedef struct gcomm {
  uint64_t key;
  void *comm;
  int failed;
  char why[384];
} gcomm;

/* What rank 0 broadcasts: the next all-reduce, or stop. */
typedef struct gkey {
  uint64_t group, seq;
  int64_t stop;
} gkey;

/* Exchanged once at start: where each rank runs. */
typedef struct ghost {
  char host[64];
  int64_t loopback;
  uint64_t job;
} ghost;

static struct {
  int on;
  int rank, size;
  uint64_t job;
  int timeout_s;
  void *dl;
  const sv_mpi_api *api;
  pthread_t th;
  pthread_mutex_t mu;
  pthread_cond_t cv; /* any change: broadcast */
  sv_gop *head;      /* queued and running, oldest first */
  atomic_int queued; /* how many of them are queued (has_queued) */
  int stop;
  int broken;
  char broken_why[384];
  int started, start_rc;
  char start_why[512];
  int finished;
  const sv_config *cfg;
  /* the server has a CUDA device: the CUDA plugin's table (tensor
   * places), and the NCCL plugin when it loaded; comms only the group
   * thread touches */
  int cuda;
  const dsp_cuda_plugin *cu;
  const sv_nccl_api *nccl;
  gcomm comms[G_MAX_COMMS];
  int n_comms;
  /* G.size of each, for choose and agree (made at start: a round never
   * allocates between collectives) */
  sv_gplace *pbuf;
  gverdict *vbuf;
} G = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* cond wait until the monotonic time `until` (the cond uses the realtime
 * clock: converted each time) */
static void wait_until(double until) {
  double left = until - now_s();
  if (left <= 0) return;
  if (left > 0.2) left = 0.2; /* re-check the state at least this often */
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  double ns = (double)t.tv_nsec + left * 1e9;
  t.tv_sec += (time_t)(ns / 1e9);
  t.tv_nsec = (long)fmod(ns, 1e9);
  pthread_cond_timedwait(&G.cv, &G.mu, &t);
}

static void gop_unref_locked(sv_gop *op) {
  if (--op->refs > 0) return;
  for (size_t i = 0; i < op->n_ts; i++) dsp_tensor_unref(op->ts[i]);
  free(op->ts);
  free(op->ptrs);
  free(op->counts);
  free(op->buf);
  dsp_budget_uncharge(op->budget, op->charged);
  free(op);
}

static void unlink_locked(sv_gop *op) {
  for (sv_gop **p = &G.head; *p; p = &(*p)->next)
    if (*p == op) {
      *p = op->next;
      op->next = NULL;
      return;
    }
}

static sv_gop *find_locked(uint64_t group, uint64_t seq) {
  for (sv_gop *p = G.head; p; p = p->next)
    if (p->group == group && p->seq == seq && p->state == GOP_QUEUED) return p;
  return NULL;
}

static sv_gop *first_queued_locked(void) {
  for (sv_gop *p = G.head; p; p = p->next)
    if (p->state == GOP_QUEUED) return p;
  return NULL;
}

/* The group cannot run another collective: every queued all-reduce and
 * every later one fails with why. */
static void break_locked(const char *why) {
  if (!G.broken) {
    G.broken = 1;
    snprintf(G.broken_why, sizeof G.broken_why, "%s", why);
    sv_log(SV_LOG_ERROR, "group: %s", why);
  }
  for (sv_gop *p = G.head; p; p = p->next)
    if (p->state == GOP_QUEUED) {
      atomic_fetch_sub(&G.queued, 1);
      p->state = GOP_DONE;
      p->rc = DISPATCH_EGROUP;
      snprintf(p->why, sizeof p->why, "%s", G.broken_why);
    }
  pthread_cond_broadcast(&G.cv);
}

static const char *type_name(int64_t t) {
  return t == SV_MPI_F32   ? "f32"
         : t == SV_MPI_F64 ? "f64"
         : t == SV_MPI_I64 ? "i64"
         : t == SV_NCCL_F16 ? "f16"
                            : "bf16";
}

static int is_half(int64_t t) { return t == SV_NCCL_F16 || t == SV_NCCL_BF16; }

/* an op's reduction: 0 sum, 1 mean, 2 + r the broadcast of rank r's
 * tensors (the wire's GroupAllreduce.reduce) */
enum { RED_SUM = 0, RED_MEAN = 1, RED_BCAST = 2 };

const char *sv_group_reduce_name(int64_t reduce, char *buf, size_t len) {
  if (reduce >= RED_BCAST)
    snprintf(buf, len, "broadcast from rank %lld",
             (long long)(reduce - RED_BCAST));
  else
    snprintf(buf, len, "%s", reduce == RED_MEAN ? "mean" : "sum");
  return buf;
}

int sv_group_nccl_path(const sv_gplace *p, int n) {
  for (int r = 0; r < n; r++)
    if (p[r].kind != SV_GK_CUDA || !p[r].nccl) return 0;
  return n > 0;
}

/* The verdict on the headers of all ranks: 0, or DISPATCH_EGROUP with the
 * same message on every rank (it depends on the headers only). */
static int judge(const ghdr *all, char *why, size_t len) {
  const ghdr *a = &all[0];
  for (int r = 0; r < G.size; r++)
    if (!all[r].present)
      return sv_why(why, len, DISPATCH_EGROUP,
                    "all-reduce (group %llx, seq %llu): rank %d received no "
                    "matching request within --mpi-timeout %d s (every member "
                    "must be sent the same all-reduce)",
                    (unsigned long long)a->group, (unsigned long long)a->seq,
                    r, G.timeout_s);
  for (int r = 1; r < G.size; r++) {
    const ghdr *b = &all[r];
    if (b->type != a->type || b->count != a->count || b->n != a->n ||
        b->hash != a->hash || b->reduce != a->reduce) {
      char ra[40], rb[40];
      return sv_why(
          why, len, DISPATCH_EGROUP,
          "all-reduce (group %llx, seq %llu): the members disagree: rank 0 "
          "holds %lld %s tensors of %lld elements (shape hash %llx, %s), "
          "rank %d holds %lld %s tensors of %lld elements (shape hash %llx, "
          "%s); every member must hold the same dtypes and shapes",
          (unsigned long long)a->group, (unsigned long long)a->seq,
          (long long)a->n, type_name(a->type), (long long)a->count,
          (unsigned long long)a->hash, sv_group_reduce_name(a->reduce, ra, sizeof ra),
          r, (long long)b->n, type_name(b->type), (long long)b->count,
          (unsigned long long)b->hash, sv_group_reduce_name(b->reduce, rb, sizeof rb));
    }
  }
  return 0;
}

/* FNV-1a over the ranks' device ordinals */
static uint64_t devs_key(const ghdr *all) {
  uint64_t h = 1469598103934665603ULL;
  for (int r = 0; r < G.size; r++)
    for (int b = 0; b < 8; b++)
      h = (h ^ (uint8_t)((uint64_t)all[r].place.dev >> (8 * b))) *
          1099511628211ULL;
  return h;
}

/* The communicator made (or failed) for the ranks' devices of all[], or
 * NULL. */
static gcomm *comm_find(const ghdr *all) {
  uint64_t key = devs_key(all);
  for (int i = 0; i < G.n_comms; i++)
    if (G.comms[i].key == key) return &G.comms[i];
  return NULL;
}

/* The path the headers all[] lead to: 1 NCCL, 0 the host, or a refusal
 * (the same on every rank: it depends on the headers and on the outcome
 * of earlier NCCL inits, which every rank shares) of half types, which
 * only NCCL reduces. */
static int choose(const ghdr *all, char *why, size_t len) {
  if (all[0].reduce >= RED_BCAST) return 0; /* bytes: the host path */
  sv_gplace *p = G.pbuf;
  for (int r = 0; r < G.size; r++) p[r] = all[r].place;
  int nccl = sv_group_nccl_path(p, G.size);
  gcomm *c = nccl ? comm_find(all) : NULL;
  if (c && c->failed) nccl = 0;
  /* more device combinations than the table holds: the host path */
  if (nccl && !c && G.n_comms == G_MAX_COMMS) nccl = 0;
  if (nccl || !is_half(all[0].type)) return nccl;
  int r = 0;
  while (r < G.size && p[r].kind == SV_GK_CUDA && p[r].nccl) r++;
  char where[448];
  if (r == G.size)
    snprintf(where, sizeof where, "NCCL could not start for these devices (%s)",
             c ? c->why : "?");
  else
    snprintf(where, sizeof where, "rank %d %s", r,
             p[r].kind != SV_GK_CUDA ? "holds them on the CPU (or on more "
                                       "than one device)"
                                     : "has no NCCL plugin");
  return sv_why(why, len, DISPATCH_EDTYPE,
                "all-reduce (group %llx, seq %llu): %s tensors are reduced "
                "only through NCCL, with every member's tensors on one CUDA "
                "device; %s",
                (unsigned long long)all[0].group,
                (unsigned long long)all[0].seq, type_name(all[0].type),
                where);
}

/* Every rank's outcome rc (why: its message) of a local step, exchanged:
 * 0 when all succeeded, else the first failing rank's code and message,
 * the same on every rank; DISPATCH_EGROUP with *mpi_failed when MPI
 * itself failed. */
static int agree(const ghdr *h, const char *what, int rc, const char *mine,
                 char *why, size_t len, int *mpi_failed) {
  gverdict me;
  memset(&me, 0, sizeof me);
  me.rc = rc;
  if (rc < 0) snprintf(me.why, sizeof me.why, "%s", mine);
  if (G.api->allgather(&me, G.vbuf, sizeof me, why, len) < 0) {
    *mpi_failed = 1;
    return DISPATCH_EGROUP;
  }
  for (int r = 0; r < G.size; r++)
    if (G.vbuf[r].rc < 0)
      return sv_why(why, len, (int)G.vbuf[r].rc,
                    "all-reduce (group %llx, seq %llu): %s failed on rank "
                    "%d: %s",
                    (unsigned long long)h->group, (unsigned long long)h->seq,
                    what, r, G.vbuf[r].why);
  return 0;
}

/* The communicator for the ranks' devices of all[], made now when new:
 * every rank calls this in the same round. 0 with *out; else a negative
 * code and why, the same on every rank, the failure kept (those devices
 * take the host path from then on); *mpi_failed when MPI failed. */
static int comm_get(const ghdr *all, gcomm **out, char *why, size_t len,
                    int *mpi_failed) {
  if ((*out = comm_find(all))) return 0;
  struct {
    char id[SV_NCCL_ID_BYTES];
    gverdict v;
  } gid;
  memset(&gid, 0, sizeof gid);
  if (G.rank == 0 && G.nccl->unique_id(gid.id, gid.v.why, sizeof gid.v.why) < 0)
    gid.v.rc = DISPATCH_EGROUP;
  if (G.api->bcast(&gid, sizeof gid, NULL, why, len) < 0) {
    *mpi_failed = 1;
    return DISPATCH_EGROUP;
  }
  void *comm = NULL;
  char mine[248] = "";
  int64_t dev = all[G.rank].place.dev;
  int lrc = 0;
  if (gid.v.rc < 0)
    lrc = (int)gid.v.rc, snprintf(mine, sizeof mine, "%s", gid.v.why);
  else if (G.nccl->comm_init(&comm, (int)dev, G.size, G.rank, gid.id,
                             G.timeout_s, mine, sizeof mine) < 0)
    lrc = DISPATCH_EGROUP;
  int rc = agree(all, "NCCL init", lrc, mine, why, len, mpi_failed);
  if (rc < 0 && comm) G.nccl->comm_destroy(comm, 1), comm = NULL;
  if (*mpi_failed) return rc;
  gcomm *c = &G.comms[G.n_comms++];
  *c = (gcomm){.key = devs_key(all), .comm = comm, .failed = rc < 0};
  if (rc < 0) {
    snprintf(c->why, sizeof c->why, "%s", why);
    sv_log(SV_LOG_WARN, "group: %s; all-reduces over these devices take "
                        "the host path", why);
    return rc;
  }
  sv_log(SV_LOG_INFO, "group: %s communicator of %d ranks made (this rank "
                      "on cuda:%lld)",
         G.nccl->describe(), G.size, (long long)dev);
  *out = c;
  return 0;
}

/* The NCCL path: in place on the tensors' device bytes. A failure has
 * aborted the communicator: *nccl_failed (the group breaks). */
static int run_nccl(sv_gop *op, const ghdr *all, char *why, size_t len,
                    int *mpi_failed, int *nccl_failed) {
  gcomm *c;
  int rc = comm_get(all, &c, why, len, mpi_failed);
  if (rc < 0) return rc;
  char mine[320];
  if (G.nccl->allreduce(c->comm, (int)op->place.dev, op->stream, op->n_ts,
                        op->ptrs, op->counts, (int)op->type, (int)op->reduce,
                        G.timeout_s, mine, sizeof mine) == 0)
    return 0;
  c->comm = NULL; /* aborted */
  c->failed = 1;
  snprintf(c->why, sizeof c->why, "%s", mine);
  *nccl_failed = 1;
  return sv_why(why, len, DISPATCH_EGROUP,
                "all-reduce (group %llx, seq %llu): %s; restart the group",
                (unsigned long long)op->group, (unsigned long long)op->seq,
                mine);
}

/* The host path for an op whose CUDA tensors are not staged: the worker
 * stages them (it owns the session's ctx); at most --mpi-timeout. */
static int ask_stage(sv_gop *op, char *why, size_t len) {
  pthread_mutex_lock(&G.mu);
  op->state = GOP_STAGE;
  pthread_cond_broadcast(&G.cv);
  double until = now_s() + G.timeout_s;
  while (op->state == GOP_STAGE && now_s() < until) wait_until(until);
  int rc;
  if (op->state == GOP_STAGE) {
    op->state = GOP_RUNNING;
    rc = sv_why(why, len, DISPATCH_EGROUP,
                "its worker did not stage the tensors within %d s",
                G.timeout_s);
  } else {
    rc = op->stage_rc;
    if (rc < 0) snprintf(why, len, "%s", op->stage_why);
  }
  pthread_mutex_unlock(&G.mu);
  return rc;
}

static void divide(sv_gop *op);

/* The host path: MPI_Allreduce of the host block (CUDA tensors staged
 * first where NCCL would have read them in place). */
static int run_host(sv_gop *op, const ghdr *all, char *why, size_t len,
                    int *mpi_failed) {
  int rc = 0, lazy = 0;
  char mine[248] = "";
  if (op->lazy) rc = ask_stage(op, mine, sizeof mine);
  for (int r = 0; r < G.size; r++)
    if (all[r].place.kind == SV_GK_CUDA && all[r].place.nccl) lazy = 1;
  if (lazy)
    rc = agree(all, "staging the CUDA tensors through host memory", rc, mine,
               why, len, mpi_failed);
  if (rc < 0) return rc;
  if (op->reduce >= RED_BCAST
          ? G.api->bcast_from(op->buf, op->charged,
                              (int)(op->reduce - RED_BCAST), why, len) < 0
          : G.api->allreduce_sum(op->buf, (size_t)op->count, (int)op->type,
                                 G.size > 2, why, len) < 0) {
    *mpi_failed = 1;
    return DISPATCH_EGROUP;
  }
  if (op->reduce == RED_MEAN) divide(op);
  return 0;
}

static void divide(sv_gop *op) {
  if (op->type == SV_MPI_F32) {
    float *v = op->buf, d = (float)G.size;
    for (int64_t i = 0; i < op->count; i++) v[i] /= d;
  } else {
    double *v = op->buf, d = (double)G.size;
    for (int64_t i = 0; i < op->count; i++) v[i] /= d;
  }
}

/* bcast's hurry: this rank holds an all-reduce waiting for rank 0's word
 * (G.queued counts them; read without the lock, a stale answer only
 * changes how long the next sleep is) */
static int has_queued(void) {
  return atomic_load_explicit(&G.queued, memory_order_relaxed) > 0;
}

/* One all-reduce, chosen by rank 0: 0 to go on, -1 to stop the loop. */
static int one_round(void) {
  char why[384];
  gkey k = {0, 0, 0};
  if (G.rank == 0) {
    pthread_mutex_lock(&G.mu);
    sv_gop *op;
    while (!G.stop && !(op = first_queued_locked())) wait_until(now_s() + 1.0);
    if (G.stop) k.stop = 1;
    else k.group = op->group, k.seq = op->seq;
    pthread_mutex_unlock(&G.mu);
  }
  if (G.api->bcast(&k, sizeof k, has_queued, why, sizeof why) < 0) {
    pthread_mutex_lock(&G.mu);
    break_locked(why);
    pthread_mutex_unlock(&G.mu);
    return -1;
  }
  if (k.stop) return -1;
  pthread_mutex_lock(&G.mu);
  double until = now_s() + G.timeout_s;
  sv_gop *op;
  while (!(op = find_locked(k.group, k.seq)) && !G.stop && now_s() < until)
    wait_until(until);
  ghdr mine = {.group = k.group, .seq = k.seq};
  if (op) {
    atomic_fetch_sub(&G.queued, 1);
    op->state = GOP_RUNNING;
    op->refs++;
    mine = (ghdr){k.group,  k.seq,     1,     op->type, op->reduce,
                  op->count, op->n, op->hash, op->place};
  }
  pthread_mutex_unlock(&G.mu);
  ghdr *all = calloc((size_t)G.size, sizeof *all);
  int rc = all ? 0 : DISPATCH_ENOMEM;
  if (!all) snprintf(why, sizeof why, "group: out of memory");
  int mpi_failed = 0, nccl_failed = 0;
  if (rc == 0 && G.api->allgather(&mine, all, sizeof mine, why, sizeof why) < 0)
    rc = DISPATCH_EGROUP, mpi_failed = 1;
  if (rc == 0) rc = judge(all, why, sizeof why);
  int nccl = 0;
  if (rc == 0 && (nccl = choose(all, why, sizeof why)) < 0) rc = nccl;
  if (rc == 0 && nccl)
    rc = run_nccl(op, all, why, sizeof why, &mpi_failed, &nccl_failed);
  else if (rc == 0)
    rc = run_host(op, all, why, sizeof why, &mpi_failed);
  free(all);
  pthread_mutex_lock(&G.mu);
  if (op) {
    op->state = GOP_DONE;
    op->rc = rc;
    if (rc < 0) snprintf(op->why, sizeof op->why, "%s", why);
    unlink_locked(op);
    gop_unref_locked(op);
  }
  if (mpi_failed || nccl_failed) break_locked(why);
  pthread_cond_broadcast(&G.cv);
  pthread_mutex_unlock(&G.mu);
  return mpi_failed || nccl_failed ? -1 : 0;
}

/* dlopen-s a plugin: $env when set and not empty, else `file` beside the
 * binary, else ../lib/dispatch/`file` from it (make install). 0 with *dl
 * and *entry (the symbol sym), the file in path; else
 * DISPATCH_EUNSUPPORTED and one line in why ("WHAT: cannot load the KIND
 * plugin FILE (dlopen's reason; ENV names another)"). */
static int open_plugin(const char *env_name, const char *kind,
                       const char *file, const char *sym, const char *what,
                       int flags,
                       void **dl, void **entry, char *path, size_t plen,
                       char *why, size_t len) {
  char exe[PATH_MAX], p1[PATH_MAX + 64], p2[PATH_MAX + 64];
  const char *env = getenv(env_name);
  const char *tries[2] = {NULL, NULL};
  if (env && *env) {
    tries[0] = env;
  } else {
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n <= 0) return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                              "%s: cannot find the server's own path", what);
    exe[n] = '\0';
    char *slash = strrchr(exe, '/');
    if (slash) *slash = '\0';
    snprintf(p1, sizeof p1, "%s/%s", exe, file);
    snprintf(p2, sizeof p2, "%s/../lib/dispatch/%s", exe, file);
    tries[0] = p1;
    tries[1] = p2;
  }
  const char *err = "not found";
  for (int i = 0; i < 2 && tries[i]; i++) {
    *dl = dlopen(tries[i], flags);
    if (!*dl) {
      err = dlerror();
      continue;
    }
    snprintf(path, plen, "%s", tries[i]);
    *entry = dlsym(*dl, sym);
    return 0;
  }
  return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                "%s: cannot load the %s plugin %s (%s; %s names another)",
                what, kind, file, err ? err : "?", env_name);
}

/* The MPI plugin, its table checked. */
static int load_plugin(char *why, size_t len) {
  char path[PATH_MAX + 64];
  void *entry = NULL;
  /* global: Open MPI loads its components with dlopen and they need
   * libmpi's symbols */
  int rc = open_plugin("DISPATCH_MPI_PLUGIN", "MPI", "dispatch-mpi.so",
                       SV_MPI_ENTRY, "--mpi", RTLD_NOW | RTLD_GLOBAL, &G.dl,
                       &entry, path, sizeof path, why, len);
  if (rc < 0) return rc;
  sv_mpi_entry_fn fn = (sv_mpi_entry_fn)entry;
  G.api = fn ? fn() : NULL;
  if (G.api && G.api->abi == SV_MPI_ABI) return 0;
  return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                "--mpi: %s is not a dispatch MPI plugin of ABI %d", path,
                SV_MPI_ABI);
}

int sv_nccl_load(const sv_nccl_api **out, const char **path, char *why,
                 size_t len) {
  static char where[PATH_MAX + 64];
  void *dl = NULL, *entry = NULL;
  *out = NULL;
  *path = "";
  int rc = open_plugin("DISPATCH_NCCL_PLUGIN", "NCCL", SV_NCCL_FILE, SV_NCCL_ENTRY,
                       "group", RTLD_NOW | RTLD_LOCAL, &dl, &entry, where,
                       sizeof where, why, len);
  if (rc < 0) return rc;
  sv_nccl_entry_fn fn = (sv_nccl_entry_fn)entry;
  const sv_nccl_api *api = fn ? fn() : NULL;
  if (!api || api->abi != SV_NCCL_ABI) {
    dlclose(dl);
    return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                  "group: %s is not a dispatch NCCL plugin of ABI %d (stale? "
                  "rebuild it from this tree: make build/%s)",
                  where, SV_NCCL_ABI, SV_NCCL_FILE);
  }
  *out = api; /* the handle stays open for the process's life */
  *path = where;
  return 0;
}

/* The server has a CUDA device: its plugin's table (where tensors live)
 * and the NCCL plugin; without NCCL, CUDA tensors take the host path. */
static void nccl_start(void) {
  char why[1536];
  if (dsp_cuda_plugin_load(&G.cu, why, sizeof why) < 0) {
    G.cu = NULL;
    sv_log(SV_LOG_INFO, "group: no NCCL path: %s", why);
    return;
  }
  const char *path;
  if (sv_nccl_load(&G.nccl, &path, why, sizeof why) < 0) {
    sv_log(SV_LOG_WARN, "%s: all-reduces of CUDA tensors stage through "
                        "host memory",
           why);
    return;
  }
  sv_log(SV_LOG_INFO, "group: NCCL plugin %s loaded (%s): an all-reduce "
                      "whose members all hold CUDA tensors runs on the GPUs",
         path, G.nccl->describe());
}

/* Init, the ranks' places, the trust rule; then rounds until stopped. */
static void *group_main(void *arg) {
  (void)arg;
  char why[512];
  int rc = G.api->init(&G.rank, &G.size, why, sizeof why) < 0
               ? DISPATCH_EGROUP
               : 0;
  ghost me, *all = NULL;
  int inited = rc == 0;
  if (rc == 0) {
    memset(&me, 0, sizeof me);
    gethostname(me.host, sizeof me.host - 1);
    me.loopback = sv_addr_is_loopback((const struct sockaddr *)&G.cfg->listen_addr);
    FILE *f = fopen("/dev/urandom", "rb");
    if (!f || fread(&me.job, sizeof me.job, 1, f) != 1)
      me.job = (uint64_t)time(NULL) ^ ((uint64_t)getpid() << 32);
    if (f) fclose(f);
    all = calloc((size_t)G.size, sizeof *all);
    if (!all) rc = sv_why(why, sizeof why, DISPATCH_ENOMEM, "--mpi: out of memory");
    else if (G.api->allgather(&me, all, sizeof me, why, sizeof why) < 0)
      rc = DISPATCH_EGROUP;
  }
  if (rc == 0) {
    G.job = all[0].job;
    int local = 1;
    for (int r = 0; r < G.size; r++)
      if (!all[r].loopback || strcmp(all[r].host, all[0].host) != 0) local = 0;
    if (!local && !G.cfg->mpi_insecure)
      rc = sv_why(why, sizeof why, DISPATCH_EINVAL,
                  "--mpi: the group's ranks are not all on this host's "
                  "loopback (rank 0 on %s, %d ranks): MPI traffic is neither "
                  "authenticated nor encrypted; keep it on a private network "
                  "and pass --mpi-insecure to acknowledge it",
                  all[0].host, G.size);
    else if (!local)
      sv_log(SV_LOG_WARN, "--mpi-insecure: the group's MPI traffic is neither "
                          "authenticated nor encrypted");
  }
  free(all);
  if (rc == 0) {
    G.pbuf = calloc((size_t)G.size, sizeof *G.pbuf);
    G.vbuf = calloc((size_t)G.size, sizeof *G.vbuf);
    if (!G.pbuf || !G.vbuf)
      rc = sv_why(why, sizeof why, DISPATCH_ENOMEM, "--mpi: out of memory");
  }
  if (rc == 0 && G.cuda) nccl_start();
  pthread_mutex_lock(&G.mu);
  G.started = 1;
  G.start_rc = rc;
  if (rc < 0) snprintf(G.start_why, sizeof G.start_why, "%s", why);
  pthread_cond_broadcast(&G.cv);
  pthread_mutex_unlock(&G.mu);
  if (rc == 0)
    while (one_round() == 0) {
    }
  /* every rank reaches here together on a clean stop (rank 0's broadcast)
   * or on a start refused alike everywhere; after an MPI failure the
   * process ends without it (mpirun ends the job) */
  pthread_mutex_lock(&G.mu);
  int clean = inited && !G.broken;
  pthread_mutex_unlock(&G.mu);
  /* every rank stops in the same round, so their communicators are idle */
  for (int i = 0; i < G.n_comms; i++)
    if (G.comms[i].comm) G.nccl->comm_destroy(G.comms[i].comm, !clean);
  G.n_comms = 0;
  free(G.pbuf);
  free(G.vbuf);
  G.pbuf = NULL, G.vbuf = NULL;
  if (clean) G.api->finalize();
  pthread_mutex_lock(&G.mu);
  G.finished = 1;
  pthread_cond_broadcast(&G.cv);
  pthread_mutex_unlock(&G.mu);
  return NULL;
}

int sv_group_start(sv_config *cfg) {
  char why[640];
  int rc = load_plugin(why, sizeof why);
  if (rc < 0) {
    fprintf(stderr, "dispatch-server: %s\n", why);
    return rc;
  }
  G.cfg = cfg;
  G.timeout_s = cfg->mpi_timeout_s;
  for (int i = 0; i < cfg->n_devices; i++)
    if (strncmp(cfg->devices[i], "cuda", 4) == 0 ||
        strcmp(cfg->devices[i], "all") == 0)
      G.cuda = 1;
  if (pthread_create(&G.th, NULL, group_main, NULL) != 0) {
    fprintf(stderr, "dispatch-server: --mpi: cannot start the group thread\n");
    return DISPATCH_ENOMEM;
  }
  pthread_mutex_lock(&G.mu);
  while (!G.started) pthread_cond_wait(&G.cv, &G.mu);
  rc = G.start_rc;
  pthread_mutex_unlock(&G.mu);
  if (rc < 0) {
    pthread_join(G.th, NULL);
    fprintf(stderr, "dispatch-server: %s\n", G.start_why);
    return rc;
  }
  if (cfg->port && cfg->port + G.rank > 65535) {
    fprintf(stderr,
            "dispatch-server: --mpi: rank %d would listen on port %d + %d, "
            "past 65535\n",
            G.rank, cfg->port, G.rank);
    sv_group_stop();
    return DISPATCH_EINVAL;
  }
  if (cfg->port) {
    cfg->port += G.rank;
    if (cfg->listen_addr.ss_family == AF_INET)
      ((struct sockaddr_in *)&cfg->listen_addr)->sin_port =
          htons((uint16_t)cfg->port);
    else
      ((struct sockaddr_in6 *)&cfg->listen_addr)->sin6_port =
          htons((uint16_t)cfg->port);
  }
  G.on = 1;
  printf("dispatch-server: MPI rank %d of %d (pid %d)\n", G.rank, G.size,
         (int)getpid());
  fflush(stdout);
  return 0;
}

void sv_group_stop(void) {
  if (!G.api) return;
  pthread_mutex_lock(&G.mu);
  G.stop = 1;
  pthread_cond_broadcast(&G.cv);
  /* rank 0 tells the others; a rank other than 0 waits for that word in
   * its broadcast, so it waits here a little for rank 0 to stop too */
  double until = now_s() + 5.0;
  while (!G.finished && now_s() < until) wait_until(until);
  int done = G.finished;
  pthread_mutex_unlock(&G.mu);
  if (done) pthread_join(G.th, NULL);
  else pthread_detach(G.th); /* stuck in MPI: the process ends anyway */
  G.on = 0;
}

/* ------------------------------------------------------------ requests */

/* FNV-1a over each tensor's dtype, rank and dims */
static uint64_t shape_hash(dsp_tensor *const *ts, size_t n) {
  uint64_t h = 1469598103934665603ULL;
  for (size_t i = 0; i < n; i++) {
    int64_t v[DSP_MAX_DIMS + 2];
    v[0] = ts[i]->meta.dtype;
    v[1] = ts[i]->meta.ndim;
    for (int d = 0; d < ts[i]->meta.ndim; d++) v[d + 2] = ts[i]->meta.shape[d];
    const unsigned char *p = (const unsigned char *)v;
    for (size_t b = 0; b < sizeof(int64_t) * (size_t)(v[1] + 2); b++)
      h = (h ^ p[b]) * 1099511628211ULL;
  }
  return h;
}

/* The host block: every tensor's bytes one after the other, charged to
 * budget (the session's) until the op lets go of it. */
static int pack(dsp_ctx *ctx, dsp_budget *budget, dsp_tensor *const *ts,
                size_t n, size_t total, sv_gop *op, char *why, size_t len) {
  int rc = dsp_budget_charge_why(budget, total, "all-reduce", why, len);
  if (rc < 0) return rc;
  void *buf = malloc(total ? total : 1);
  if (!buf) {
    dsp_budget_uncharge(budget, total);
    return sv_why(why, len, DISPATCH_ENOMEM, "all-reduce: out of memory");
  }
  size_t at = 0;
  for (size_t i = 0; i < n; i++) {
    size_t nb = dsp_tensor_nbytes(ts[i]);
    rc = dsp_tensor_read(ctx, ts[i], (char *)buf + at, nb);
    if (rc < 0) {
      free(buf);
      dsp_budget_uncharge(budget, total);
      return sv_why(why, len, rc, "all-reduce: tensor %zu: %s", i,
                    dsp_ctx_errmsg(ctx));
    }
    at += nb;
  }
  op->buf = buf;
  op->budget = budget;
  op->charged = total;
  return 0;
}

/* Where this rank holds ts: SV_GK_CUDA when every tensor lives on one CUDA
 * backend (a session's view: one stream), else SV_GK_HOST. */
static sv_gplace place_of(dsp_tensor *const *ts, size_t n) {
  sv_gplace pl = {SV_GK_HOST, -1, G.nccl != NULL};
  if (!G.cu) return pl;
  int dev = -1;
  void *data, *stream;
  for (size_t i = 0; i < n; i++)
    if (!G.cu->tensor_place(ts[i], &dev, &data, &stream) ||
        ts[i]->storage->backend != ts[0]->storage->backend)
      return pl;
  pl.kind = SV_GK_CUDA;
  pl.dev = dev;
  return pl;
}

/* The NCCL path's side of an op: references to ts, each made writable
 * (copy-on-write) before its device pointer is taken, and the stream
 * synchronized so that the group's wait bound covers the reduction only
 * (and an earlier kernel's error comes back here, not as an NCCL one). */
static int borrow(dsp_ctx *ctx, dsp_tensor *const *ts, size_t n, sv_gop *op,
                  char *why, size_t len) {
  op->ts = calloc(n, sizeof *op->ts);
  op->ptrs = calloc(n, sizeof *op->ptrs);
  op->counts = calloc(n, sizeof *op->counts);
  if (!op->ts || !op->ptrs || !op->counts)
    return sv_why(why, len, DISPATCH_ENOMEM, "all-reduce: out of memory");
  for (size_t i = 0; i < n; i++) {
    int rc = dsp__storage_prepare_write(ctx, ts[i]);
    if (rc < 0)
      return sv_why(why, len, rc, "all-reduce: tensor %zu: %s", i,
                    dsp_ctx_errmsg(ctx));
    int dev;
    if (!G.cu->tensor_place(ts[i], &dev, &op->ptrs[i], &op->stream))
      return sv_why(why, len, DISPATCH_EINTERNAL,
                    "all-reduce: tensor %zu left its CUDA device", i);
    op->ts[op->n_ts++] = dsp_tensor_ref(ts[i]);
    op->counts[i] = (size_t)ts[i]->numel;
  }
  int rc = G.cu->sync(ts[0]->storage->backend, ctx);
  if (rc < 0)
    return sv_why(why, len, rc, "all-reduce: %s", dsp_ctx_errmsg(ctx));
  return 0;
}

int sv_group_reduce(dsp_ctx *ctx, dsp_budget *budget, dsp_tensor *const *ts,
                    size_t n, uint64_t group, uint64_t seq, int reduce,
                    char *why, size_t len) {
  if (!G.on)
    return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                  "all-reduce: this server is in no group (start the group's "
                  "servers with mpirun ... dispatch-server --mpi)");
  if (reduce < RED_SUM || reduce >= RED_BCAST + G.size)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "all-reduce: reduction %d is not sum (0), mean (1) or the "
                  "broadcast from a rank r of %d (2 + r)",
                  reduce, G.size);
  if (n == 0)
    return sv_why(why, len, DISPATCH_EINVAL, "all-reduce: no tensors");
  dsp_dtype dt = ts[0]->meta.dtype;
  int type = dt == DSP_F32    ? SV_MPI_F32
             : dt == DSP_F64  ? SV_MPI_F64
             : dt == DSP_I64  ? SV_MPI_I64
             : dt == DSP_F16  ? SV_NCCL_F16
             : dt == DSP_BF16 ? SV_NCCL_BF16
                              : -1;
  if (type < 0 || (type == SV_MPI_I64 && reduce == RED_MEAN)) {
    char rn[40];
    return sv_why(why, len, DISPATCH_EDTYPE,
                  "all-reduce: %s tensors cannot take a %s (f32 and f64: "
                  "sum or mean; i64: sum; f16 and bf16: sum or mean through "
                  "NCCL, every member's tensors on CUDA; a broadcast: any "
                  "of these)",
                  dsp_dtype_name(dt), sv_group_reduce_name(reduce, rn, sizeof rn));
  }
  size_t total = 0;
  /* a broadcast moves bytes: its tensors may mix these dtypes (the
   * shape hash holds each one's) */
  int bcast = reduce >= RED_BCAST;
  for (size_t i = 0; i < n; i++) {
    dsp_dtype di = ts[i]->meta.dtype;
    int ok = bcast ? di == DSP_F32 || di == DSP_F64 || di == DSP_I64 ||
                         di == DSP_F16 || di == DSP_BF16
                   : di == dt;
    if (!ok)
      return sv_why(why, len, DISPATCH_EDTYPE,
                    "all-reduce: tensor %zu is %s, tensor 0 %s (one request "
                    "reduces one dtype; a broadcast takes f32, f64, i64, f16 "
                    "and bf16)",
                    i, dsp_dtype_name(di), dsp_dtype_name(dt));
    total += dsp_tensor_nbytes(ts[i]);
  }
  sv_gop *op = calloc(1, sizeof *op);
  if (!op) return sv_why(why, len, DISPATCH_ENOMEM, "all-reduce: out of memory");
  *op = (sv_gop){.group = group, .seq = seq, .reduce = reduce, .type = type,
                 .count = (int64_t)(bcast ? total : total / dsp_dtype_size(dt)),
                 .n = (int64_t)n, .hash = (int64_t)shape_hash(ts, n),
                 .state = GOP_QUEUED, .refs = 1, .place = place_of(ts, n)};
  /* CUDA tensors with NCCL loaded stay where they are until the path is
   * known; half types are never staged (only NCCL reduces them); the rest
   * is copied into the host block now. The block is the session's until
   * the group thread lets go of it too (it may outlive this request when
   * a worker gives up). */
  op->lazy = op->place.kind == SV_GK_CUDA && op->place.nccl;
  int rc = op->lazy ? borrow(ctx, ts, n, op, why, len)
           : is_half(type) && reduce < RED_BCAST ? 0
                           : pack(ctx, budget, ts, n, total, op, why, len);
  pthread_mutex_lock(&G.mu);
  if (rc == 0 && G.broken)
    rc = sv_why(why, len, DISPATCH_EGROUP, "all-reduce: %s", G.broken_why);
  if (rc < 0) {
    gop_unref_locked(op);
    pthread_mutex_unlock(&G.mu);
    return rc;
  }
  sv_gop **tail = &G.head;
  while (*tail) tail = &(*tail)->next;
  *tail = op;
  atomic_fetch_add(&G.queued, 1);
  pthread_cond_broadcast(&G.cv);
  double until = now_s() + 3.0 * G.timeout_s;
  while (op->state != GOP_DONE && now_s() < until) {
    if (op->state == GOP_STAGE) {
      /* the host path for our CUDA tensors: staged here, where the
       * session's ctx is ours */
      pthread_mutex_unlock(&G.mu);
      char w[sizeof op->stage_why];
      int src = pack(ctx, budget, ts, n, total, op, w, sizeof w);
      pthread_mutex_lock(&G.mu);
      op->stage_rc = src;
      if (src < 0) snprintf(op->stage_why, sizeof op->stage_why, "%s", w);
      if (op->state == GOP_STAGE) op->state = GOP_RUNNING;
      pthread_cond_broadcast(&G.cv);
      continue;
    }
    wait_until(until);
  }
  if (op->state == GOP_DONE) {
    rc = op->rc;
    if (rc < 0) sv_why(why, len, rc, "%s", op->why);
  } else if (op->state == GOP_QUEUED) {
    atomic_fetch_sub(&G.queued, 1);
    unlink_locked(op);
    rc = sv_why(why, len, DISPATCH_EGROUP,
                "all-reduce (group %llx, seq %llu): the group did not take it "
                "up within %d s (rank 0 never received it, or the group is "
                "busy with an all-reduce a member stalls)",
                (unsigned long long)group, (unsigned long long)seq,
                3 * G.timeout_s);
  } else {
    char b[256];
    snprintf(b, sizeof b,
             "an all-reduce did not finish within %d s: a member stalled or "
             "died inside MPI or NCCL; restart the group",
             3 * G.timeout_s);
    break_locked(b);
    rc = sv_why(why, len, DISPATCH_EGROUP, "all-reduce (group %llx, seq %llu): %s",
                (unsigned long long)group, (unsigned long long)seq, b);
  }
  /* only this thread holds op once it is DONE or withdrawn: buf is ours;
   * none on the NCCL path (the tensors were reduced in place) */
  int copy = rc == 0 && op->buf;
  pthread_mutex_unlock(&G.mu);
  size_t at = 0;
  for (size_t i = 0; copy && i < n; i++) {
    size_t nb = dsp_tensor_nbytes(ts[i]);
    rc = dsp_tensor_write(ctx, ts[i], (char *)op->buf + at, nb);
    if (rc < 0) {
      rc = sv_why(why, len, rc, "all-reduce: tensor %zu: %s", i,
                  dsp_ctx_errmsg(ctx));
      break;
    }
    at += nb;
  }
  pthread_mutex_lock(&G.mu);
  gop_unref_locked(op);
  pthread_mutex_unlock(&G.mu);
  return rc;
}

int sv_exec_group_join(sv_session *s, sv_job *j, char *why, size_t len) {
  (void)s;
  Dspwire__GroupJoin *gj = j->req->group_join;
  if (!G.on)
    return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                  "group: this server is in no group (start the group's "
                  "servers with mpirun ... dispatch-server --mpi)");
  if (gj->size != (uint32_t)G.size)
    return sv_why(why, len, DISPATCH_EGROUP,
                  "group: the client opened a group of %u servers, but this "
                  "server's MPI job has %d ranks",
                  gj->size, G.size);
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  Dspwire__GroupReply gr = DSPWIRE__GROUP_REPLY__INIT;
  gr.rank = (uint32_t)G.rank;
  gr.size = (uint32_t)G.size;
  gr.job = G.job;
  r.body_case = DSPWIRE__REPLY__BODY_GROUP;
  r.group = &gr;
  return sv_job_reply(j, &r, "group", why, len);
}

int sv_exec_group_allreduce(sv_session *s, sv_job *j, char *why, size_t len) {
  Dspwire__GroupAllreduce *ga = j->req->group_allreduce;
  size_t n = ga->grads ? ga->n_params : ga->n_tensors;
  if (n > s->tensors.count)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "all-reduce: %zu tensors, but the session holds only %zu", n,
                  s->tensors.count);
  if (ga->grads && ga->n_tensors)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "all-reduce: tensors and grads both given");
  dsp_grads *g = NULL;
  int rc = 0;
  if (ga->grads && (rc = sv_get_grads(s, ga->grads, why, len, &g)) < 0)
    return rc;
  dsp_tensor **ts = dsp_calloc(n ? n : 1, sizeof *ts);
  if (!ts) return sv_why(why, len, DISPATCH_ENOMEM, "all-reduce: out of memory");
  size_t got = 0;
  for (size_t i = 0; i < n && rc == 0; i++) {
    dsp_tensor *t;
    rc = sv_get_tensor(s, ga->grads ? ga->params[i] : ga->tensors[i],
                       (sv_label){SV_LBL_INPUT, "all-reduce", i, 0}, why, len,
                       &t);
    if (rc < 0) break;
    if (g) {
      rc = dsp_grads_get(s->ctx, g, t, &t);
      if (rc < 0) {
        rc = sv_why(why, len, rc, "all-reduce: param %zu: %s", i,
                    dsp_ctx_errmsg(s->ctx));
        break;
      }
    } else {
      dsp_tensor_ref(t);
    }
    ts[got++] = t;
  }
  if (rc == 0)
    rc = sv_group_reduce(s->ctx, s->budget, ts, n, ga->group, ga->seq,
                         ga->reduce, why, len);
  for (size_t i = 0; i < got; i++) dsp_tensor_unref(ts[i]);
  dsp_free(ts);
  return rc;
}

int sv_group_step_grads(sv_session *s, dsp_tensor *const *args, size_t n,
                        size_t stride, const Dspwire__Step *st, char *why,
                        size_t len) {
  dsp_tensor **gs = dsp_calloc(n ? n : 1, sizeof *gs);
  if (!gs) return sv_why(why, len, DISPATCH_ENOMEM, "step: out of memory");
  for (size_t i = 0; i < n; i++) gs[i] = args[i * stride + 1];
  int rc = sv_group_reduce(s->ctx, s->budget, gs, n, st->group,
                           st->group_seq, st->group_reduce, why, len);
  dsp_free(gs);
  return rc;
}
