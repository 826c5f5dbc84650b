/* Groups (protocol 1.7): the dispatch-servers of one MPI job, opened
 * together, all-reduce tensors and gradients among themselves. The client
 * sends each member the same small request, keyed by the group's random
 * id and a sequence number, and never carries a tensor's bytes; the
 * servers match the requests and run MPI (server/group.c). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "client_internal.h"
#include "conn.h"

struct dispatch_group {
  int n;
  dispatch_device **devs; /* by rank, owned */
  uint64_t key;           /* the group's id on the wire */
  uint64_t seq;           /* the last all-reduce's number */
};

static uint64_t draw_key(void) {
  uint64_t k = 0;
  FILE *f = fopen("/dev/urandom", "rb");
  if (!f || fread(&k, sizeof k, 1, f) != 1) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    k = ((uint64_t)t.tv_nsec << 20) ^ (uint64_t)t.tv_sec ^
        ((uint64_t)getpid() << 40);
  }
  if (f) fclose(f);
  return k ? k : 1; /* 0 means "no group" in a Step */
}

static int open_err(char *err, size_t len, int rc, const char *fmt,
                    const char *a, const char *b) {
  if (err && len) snprintf(err, len, fmt, a, b);
  return rc;
}

/* The member's GroupJoin: its rank, the job's size and id. */
static int join(dispatch_device *dev, uint64_t key, int n, uint32_t *rank,
                uint32_t *size, uint64_t *job) {
  Dspwire__GroupJoin gj = DSPWIRE__GROUP_JOIN__INIT;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  gj.group = key;
  gj.size = (uint32_t)n;
  req.body_case = DSPWIRE__REQUEST__BODY_GROUP_JOIN;
  req.group_join = &gj;
  Dspwire__Reply *r = NULL;
  int rc = dispatch__remote_call(dev, &req, NULL, 0, NULL, 0, &r);
  if (rc == 0 && (r->body_case != DSPWIRE__REPLY__BODY_GROUP || !r->group))
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "group_open: \"%s\" answered without its rank", dev->spec);
  if (rc == 0) {
    *rank = r->group->rank;
    *size = r->group->size;
    *job = r->group->job;
  }
  dispatch__remote_reply_free(r);
  return rc;
}

void dispatch_group_close(dispatch_group *g) {
  if (!g) return;
  for (int i = 0; i < g->n; i++) dispatch_device_close(g->devs[i]);
  free(g->devs);
  free(g);
}

int dispatch_group_open(const char *const *specs, int n,
                        const dispatch_options *opts, dispatch_group **out,
                        char *err, size_t err_len) {
  if (out) *out = NULL;
  if (!specs || n < 1 || !out)
    return open_err(err, err_len, DISPATCH_EINVAL,
                    "group_open: no device strings%s%s", "", "");
  dispatch_group *g = calloc(1, sizeof *g);
  dispatch_device **opened = calloc((size_t)n, sizeof *opened);
  uint32_t *ranks = calloc((size_t)n, sizeof *ranks);
  if (g) g->devs = calloc((size_t)n, sizeof *g->devs);
  int rc = g && opened && ranks && g->devs ? 0 : DISPATCH_ENOMEM;
  if (rc < 0) open_err(err, err_len, rc, "group_open: out of memory%s%s", "", "");
  uint64_t job0 = 0;
  if (g) g->key = draw_key();
  for (int i = 0; rc == 0 && i < n; i++) {
    char why[256];
    if (!specs[i]) {
      rc = open_err(err, err_len, DISPATCH_EINVAL,
                    "group_open: device string %s is NULL%s", "", "");
      break;
    }
    rc = dispatch_device_open(specs[i], opts, &opened[i], why, sizeof why);
    if (rc < 0) {
      open_err(err, err_len, rc, "group_open: %s: %s", specs[i], why);
      break;
    }
    dispatch_device *d = opened[i];
    if (d->ops != &dispatch__remote_ops) {
      rc = open_err(err, err_len, DISPATCH_EUNSUPPORTED,
                    "group_open: \"%s\" is not a dispatch-server device (a "
                    "group's members are servers started with --mpi)%s",
                    specs[i], "");
      break;
    }
    if (d->conn->server_minor < 7) {
      char v[16];
      snprintf(v, sizeof v, "1.%u", d->conn->server_minor);
      rc = open_err(err, err_len, DISPATCH_EUNSUPPORTED,
                    "group_open: \"%s\" speaks protocol %s; groups need 1.7",
                    specs[i], v);
      break;
    }
    uint32_t size = 0;
    uint64_t job = 0;
    rc = join(d, g->key, n, &ranks[i], &size, &job);
    if (rc < 0) {
      open_err(err, err_len, rc, "group_open: %s: %s", specs[i],
               dsp_ctx_errmsg(d->ctx));
      break;
    }
    if (i == 0) job0 = job;
    if (job != job0 || ranks[i] >= (uint32_t)n) {
      rc = open_err(err, err_len, DISPATCH_EGROUP,
                    "group_open: \"%s\" is not a rank of the MPI job of "
                    "\"%s\" (every member must come from one mpirun)",
                    specs[i], specs[0]);
      break;
    }
    if (g->devs[ranks[i]]) {
      rc = open_err(err, err_len, DISPATCH_EGROUP,
                    "group_open: \"%s\" and \"%s\" are the same rank",
                    specs[i], g->devs[ranks[i]]->spec);
      break;
    }
    g->devs[ranks[i]] = d;
  }
  if (rc < 0) {
    for (int i = 0; opened && i < n; i++) dispatch_device_close(opened[i]);
    if (g) free(g->devs);
    free(g);
  } else {
    g->n = n;
    *out = g;
  }
  free(opened);
  free(ranks);
  return rc;
}

int dispatch_group_size(const dispatch_group *g) { return g ? g->n : 0; }

dispatch_device *dispatch_group_device(dispatch_group *g, int rank) {
  if (!g || rank < 0 || rank >= g->n) return NULL;
  return g->devs[rank];
}

/* The server's id of t, a tensor of member r: 0 with *id, or the error
 * recorded on that member's device. */
static int member_id(dispatch_group *g, int r, dispatch_tensor *t, size_t i,
                     const char *fn, uint64_t *id) {
  dispatch_device *dev = g->devs[r];
  if (!t) return dispatch__null_input(dev, fn, (int)i);
  if (t->dev != dev)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                                         "%s: tensor %zu of rank %d lives on "
                                         "\"%s\", not on \"%s\"",
                                         fn, i, r, t->dev->spec, dev->spec));
  dispatch_tensor *in = t->kind == DISPATCH_KIND_AUTODIFF ? t->inner : t;
  if (in->status) return dispatch__poisoned_input(dev, in);
  *id = in->id;
  return 0;
}

static int check_reduce(dispatch_group *g, int reduce, const char *fn) {
  if (reduce == DISPATCH_REDUCE_SUM || reduce == DISPATCH_REDUCE_MEAN) return 0;
  return dispatch__ret(g->devs[0],
                       dsp_seterr(g->devs[0]->ctx, DISPATCH_EINVAL,
                                  "%s: reduce %d is not DISPATCH_REDUCE_SUM "
                                  "or DISPATCH_REDUCE_MEAN",
                                  fn, reduce));
}

/* Queues one GroupAllreduce on every member (no reply): tensors (k per
 * member, rank-major) or the gradients of params in grads; wire is the
 * wire's reduction (0 sum, 1 mean, 2 + r broadcast from rank r), already
 * checked. */
static int allreduce(dispatch_group *g, dispatch_tensor *const *ts,
                     dispatch_grads *const *grads, size_t k, int wire,
                     const char *fn) {
  if (!ts || k == 0)
    return dispatch__ret(g->devs[0], dsp_seterr(g->devs[0]->ctx,
                                                DISPATCH_EINVAL,
                                                "%s: no tensors", fn));
  int rc = 0;
  /* every member's part is checked before any is sent: a member that
   * refused after another had sent would leave that one waiting in its
   * group for --mpi-timeout */
  uint64_t *ids = calloc((size_t)g->n * k, sizeof *ids);
  if (!ids) return DISPATCH_ENOMEM;
  for (int r = 0; r < g->n && rc == 0; r++) {
    dispatch_device *dev = g->devs[r];
    dispatch__hold hold = {NULL};
    if ((rc = dispatch__enter(dev, fn, &hold)) < 0) break;
    if (grads && (!grads[r] || grads[r]->dev != dev))
      rc = dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                                         "%s: rank %d's gradients are %s",
                                         fn, r,
                                         grads[r] ? "on another device"
                                                  : "NULL"));
    for (size_t i = 0; i < k && rc == 0; i++)
      rc = member_id(g, r, ts[(size_t)r * k + i], i, fn, &ids[(size_t)r * k + i]);
    dispatch__leave(&hold);
  }
  uint64_t seq = ++g->seq;
  for (int r = 0; r < g->n && rc == 0; r++) {
    dispatch_device *dev = g->devs[r];
    dispatch__hold hold = {NULL};
    if ((rc = dispatch__enter(dev, fn, &hold)) < 0) break;
    Dspwire__GroupAllreduce ga = DSPWIRE__GROUP_ALLREDUCE__INIT;
    Dspwire__Request req = DSPWIRE__REQUEST__INIT;
    ga.group = g->key;
    ga.seq = seq;
    ga.reduce = wire;
    if (grads) {
      ga.grads = grads[r]->id;
      ga.n_params = k;
      ga.params = ids + (size_t)r * k;
    } else {
      ga.n_tensors = k;
      ga.tensors = ids + (size_t)r * k;
    }
    req.body_case = DSPWIRE__REQUEST__BODY_GROUP_ALLREDUCE;
    req.group_allreduce = &ga;
    rc = dispatch__remote_queue(dev, &req);
    /* sent now: the other members wait for this one's part, and the
     * caller's next wait may be on another member */
    if (rc == 0) rc = dispatch__flush(dev);
    if (rc == 0) rc = dispatch__sync_call(dev);
    if (rc < 0) rc = dispatch__ret(dev, rc);
    dispatch__leave(&hold);
  }
  free(ids);
  return rc;
}

/* the wire's 0 sum, 1 mean */
static int wire_reduce(int reduce) { return reduce == DISPATCH_REDUCE_MEAN; }

int dispatch_group_allreduce(dispatch_group *g, dispatch_tensor *const *tensors,
                             size_t k, int reduce) {
  if (!g) return DISPATCH_EINVAL;
  int rc = check_reduce(g, reduce, "group_allreduce");
  if (rc < 0) return rc;
  return allreduce(g, tensors, NULL, k, wire_reduce(reduce),
                   "group_allreduce");
}

int dispatch_group_broadcast(dispatch_group *g, dispatch_tensor *const *tensors,
                             size_t k, int root) {
  if (!g) return DISPATCH_EINVAL;
  if (root < 0 || root >= g->n)
    return dispatch__ret(g->devs[0],
                         dsp_seterr(g->devs[0]->ctx, DISPATCH_EINVAL,
                                    "group_broadcast: root %d is not a rank "
                                    "of this group of %d",
                                    root, g->n));
  return allreduce(g, tensors, NULL, k, 2 + root, "group_broadcast");
}

int dispatch_group_allreduce_grads(dispatch_group *g,
                                   dispatch_grads *const *grads,
                                   dispatch_tensor *const *params, size_t k,
                                   int reduce) {
  if (!g || !grads) return DISPATCH_EINVAL;
  int rc = check_reduce(g, reduce, "group_allreduce_grads");
  if (rc < 0) return rc;
  return allreduce(g, params, grads, k, wire_reduce(reduce),
                   "group_allreduce_grads");
}

int dispatch_group_step(dispatch_group *g, dispatch_optim *const *opts,
                        dispatch_grads *const *grads, int reduce) {
  if (!g) return DISPATCH_EINVAL;
  int rc = check_reduce(g, reduce, "group_step");
  if (rc < 0) return rc;
  for (int r = 0; r < g->n; r++) {
    dispatch_device *dev = g->devs[r];
    if (!opts || !opts[r] || opts[r]->dev != dev || !grads || !grads[r] ||
        opts[r]->n != opts[0]->n)
      return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                           "group_step: rank %d needs an "
                                           "optimizer and gradients on \"%s\" "
                                           "with as many parameters as rank "
                                           "0's",
                                           r, dev->spec));
    if (dev->capture)
      return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                                           "group_step: not inside a graph "
                                           "capture"));
  }
  uint64_t seq = ++g->seq;
  for (int r = 0; r < g->n && rc == 0; r++) {
    dispatch_optim *o = opts[r];
    o->group = g->key;
    o->group_seq = seq;
    o->group_reduce = wire_reduce(reduce);
    rc = dispatch_optim_step(o, grads[r]);
    o->group = 0;
    if (rc == 0) {
      dispatch__hold hold = {NULL};
      if ((rc = dispatch__enter(o->dev, "group_step", &hold)) == 0) {
        rc = dispatch__flush(o->dev); /* as in allreduce */
        if (rc < 0) rc = dispatch__ret(o->dev, rc);
        dispatch__leave(&hold);
      }
    }
  }
  return rc;
}
