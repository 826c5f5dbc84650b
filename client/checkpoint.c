/* Checkpoints in the safetensors format (common/safetensors.c: the header
 * and its checks, shared with the server's own checkpoints), written and
 * read here (dispatch_save, dispatch_load) or by the server into its
 * --checkpoint-dir (dispatch_save_on_server, dispatch_load_on_server).
 *
 * Memory: a save reads each tensor in pieces of at most CKPT_CHUNK bytes
 * (one row of dim 0 when a row is larger), so saving a REMOTE model never
 * holds a second copy of it here; a load holds one tensor's bytes at a
 * time. A load validates the whole header against the file size before it
 * creates the first tensor, and frees every tensor it made on any failure,
 * so a refused file leaves nothing behind. */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "client_internal.h"
#include "safetensors.h"

#define CKPT_CHUNK ((size_t)1 << 20) /* bytes per read in a save */

struct dispatch_checkpoint {
  dispatch_device *dev;
  int n;
  char **names;              /* in data order */
  dispatch_tensor **tensors; /* one reference each, unscoped */
  int *by_name;              /* indices sorted by name (lookups) */
  int n_meta;
  char **meta_keys, **meta_vals;
};

/* ------------------------------------------------------------------ */
/* save                                                                */

/* Streams t's bytes to fd: whole when it fits CKPT_CHUNK, else as slices
 * of whole rows of dim 0 (at least one row), each read and freed before
 * the next. Row-major slices of dim 0 are contiguous, so the pieces
 * concatenate to the tensor's bytes. */
static int stream_tensor(dispatch_device *dev, int fd, const dsp_st_entry *e,
                         dispatch_tensor *t, uint8_t **buf, size_t *cap,
                         const char *path) {
  size_t nb = (size_t)(e->end - e->begin);
  if (!nb) return 0;
  int64_t rows = e->meta.ndim ? e->meta.shape[0] : 1;
  size_t row_bytes = nb / (size_t)rows;
  int64_t step = rows;
  if (nb > CKPT_CHUNK && e->meta.ndim > 0) {
    step = (int64_t)(CKPT_CHUNK / row_bytes);
    if (step < 1) step = 1;
  }
  size_t want = (size_t)step * row_bytes;
  if (want > *cap) {
    uint8_t *nbuf = dsp_realloc(*buf, want);
    if (!nbuf)
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "save \"%s\": out of memory (%zu bytes for tensor "
                        "\"%s\")",
                        path, want, e->name);
    *buf = nbuf;
    *cap = want;
  }
  for (int64_t r0 = 0; r0 < rows; r0 += step) {
    int64_t r1 = r0 + step < rows ? r0 + step : rows;
    size_t len = (size_t)(r1 - r0) * row_bytes;
    int rc;
    if (r0 == 0 && r1 == rows) {
      rc = dispatch_tensor_read(t, *buf, len);
    } else {
      dispatch_tensor *s = NULL;
      rc = dispatch_slice(t, 0, r0, r1, 1, &s);
      if (rc == 0) rc = dispatch_tensor_read(s, *buf, len);
      dispatch_tensor_free(s);
    }
    if (rc < 0)
      return dsp_st_prefix_err(dev->ctx, rc, "save \"%s\": reading tensor \"%s\"",
                        path, e->name);
    if (dsp_write_all(fd, *buf, len) < 0)
      return dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                        strerror(errno));
  }
  return 0;
}

/* The metadata "dispatch.optim" names the optimizer; Adam and AdamW keep
 * m, v and the step count t, SGD its velocity. */
static const char *optim_kind(const dispatch_optim *o) {
  return o->op == DSP_OP_SGD_STEP    ? "sgd"
         : o->op == DSP_OP_ADAM_STEP ? "adam"
                                     : "adamw";
}
static int optim_has_t(const dispatch_optim *o) {
  return o->op != DSP_OP_SGD_STEP;
}


/* What a save writes, in data order: entry i is es[i] (its name owned)
 * with the bytes of ts[i] (borrowed, plain LOCAL or REMOTE), or, ts[i]
 * NULL, the eight bytes of step (Adam's and AdamW's step count); and the
 * optimizer's metadata. */
typedef struct ck_plan {
  int n;
  dsp_st_entry *es;
  dispatch_tensor **ts;
  int64_t step;
  int n_meta;
  const char *keys[2], *vals[2];
  char nparams[32];
} ck_plan;

static void plan_free(ck_plan *p) {
  for (int i = 0; p->es && i < p->n; i++) dsp_free(p->es[i].name);
  dsp_free(p->es);
  dsp_free(p->ts);
  memset(p, 0, sizeof *p);
}

/* One entry of the plan: a copy of name, tensor t (NULL: the step). */
static int plan_put(dispatch_device *dev, ck_plan *p, const char *name,
                    dispatch_tensor *t) {
  dsp_st_entry *e = &p->es[p->n];
  if (!(e->name = dsp_strdup(name)))
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
  if (t) {
    e->meta = t->meta;
  } else {
    memset(&e->meta, 0, sizeof e->meta);
    e->meta.dtype = DSP_I64;
  }
  p->ts[p->n++] = t;
  return 0;
}

/* the dynamic loss scale's state (dispatch_optim_set_loss_scale): the
 * scale, f32 [], and its counts, i64 [2] (good steps since the last
 * change, steps skipped) */
#define LS_SCALE "optim.loss_scale"
#define LS_COUNTS "optim.loss_scale.counts"

/* The checks and the entries of a save (dispatch_save, and the one the
 * server makes): every name and tensor given, then opt's state under the
 * documented names optim.<i>.momentum (SGD), optim.<i>.m and optim.<i>.v
 * (Adam, AdamW) for parameter i, and optim.step (their t). */
static int plan_save(dispatch_device *dev, const char *path,
                     const char *const *names, dispatch_tensor *const *tensors,
                     int n, const dispatch_optim *opt, ck_plan *p) {
  memset(p, 0, sizeof *p);
  if (!path || !*path || n < 0 || (n > 0 && (!names || !tensors)))
    return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save: needs a path and n >= 0 names and tensors");
  if (opt && opt->dev != dev)
    return dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                      "save \"%s\": the optimizer lives on \"%s\", not \"%s\"",
                      path, opt->dev->spec, dev->spec);
  int per = opt ? opt->k : 0;
  int64_t total64 =
      (int64_t)n + (opt ? (int64_t)opt->n * per + optim_has_t(opt) +
                              (opt->ls_scale ? 2 : 0)
                        : 0);
  if (total64 > INT32_MAX)
    return dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save \"%s\": too many tensors", path);
  size_t total = total64 ? (size_t)total64 : 1;
  p->es = dsp_calloc(total, sizeof *p->es);
  p->ts = dsp_calloc(total, sizeof *p->ts);
  if (!p->es || !p->ts)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "save \"%s\": out of memory", path);
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++) {
    if (!names[i] || !tensors[i])
      rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                      "save \"%s\": name or tensor %d is NULL", path, i);
    else if ((rc = dsp_st_check_name(dev->ctx, path, i, names[i])) < 0)
      break;
    else if (tensors[i]->dev != dev)
      rc = dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                      "save \"%s\": tensor \"%s\" lives on \"%s\", not \"%s\"",
                      path, names[i], tensors[i]->dev->spec, dev->spec);
    else
      rc = plan_put(dev, p, names[i], dispatch_inner(tensors[i]));
  }
  static const char *const sgd_names[] = {"momentum"};
  static const char *const adam_names[] = {"m", "v"};
  for (int i = 0; opt && rc == 0 && i < opt->n * per; i++) {
    char nb[64];
    snprintf(nb, sizeof nb, "optim.%d.%s", i / per,
             opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % per]);
    rc = plan_put(dev, p, nb, opt->states[i]);
  }
  if (opt && rc == 0 && optim_has_t(opt)) {
    p->step = opt->t;
    rc = plan_put(dev, p, "optim.step", NULL);
  }
  if (opt && rc == 0 && opt->ls_scale) {
    rc = plan_put(dev, p, LS_SCALE, opt->ls_scale);
    if (rc == 0) rc = plan_put(dev, p, LS_COUNTS, opt->ls_counts);
  }
  if (opt) {
    snprintf(p->nparams, sizeof p->nparams, "%d", opt->n);
    p->keys[0] = "dispatch.optim";
    p->vals[0] = optim_kind(opt);
    p->keys[1] = "dispatch.optim.params";
    p->vals[1] = p->nparams;
    p->n_meta = 2;
  }
  return rc;
}

static void fsync_dir_of(const char *path) {
  const char *slash = strrchr(path, '/');
  char dir[4096];
  if (!slash) {
    snprintf(dir, sizeof dir, ".");
  } else if (slash == path) {
    snprintf(dir, sizeof dir, "/");
  } else {
    size_t l = (size_t)(slash - path);
    if (l >= sizeof dir) return;
    memcpy(dir, path, l);
    dir[l] = 0;
  }
  int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}


/* Writes header and data to PATH.tmp.PID.N, fsyncs it and renames it over
 * path: a reader sees the old file or the whole new one, never a part. */
static int save_file(dispatch_device *dev, const char *path, ck_plan *p) {
  uint8_t *hdr = NULL;
  size_t hlen = 0;
  int rc = dsp_st_header(dev->ctx, path, p->es, p->n, p->keys, p->vals,
                         p->n_meta, &hdr, &hlen);
  char *tmp = NULL;
  int fd = -1;
  if (rc == 0) {
    static unsigned long counter; /* devices may save from distinct threads */
    size_t tl = strlen(path) + 64;
    tmp = dsp_malloc(tl);
    for (int tries = 0; tmp && fd < 0 && tries < 16; tries++) {
      snprintf(tmp, tl, "%s.tmp.%ld.%lu", path, (long)getpid(),
               __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED));
      fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno != EEXIST) break;
    }
    if (!tmp)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save: out of memory");
    else if (fd < 0)
      rc = dsp_seterr(dev->ctx, DISPATCH_EIO,
                      "save \"%s\": cannot create %s: %s", path, tmp,
                      strerror(errno));
  }
  if (rc == 0 && dsp_write_all(fd, hdr, hlen) < 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                    strerror(errno));
  uint8_t *buf = NULL;
  size_t cap = 0;
  for (int i = 0; i < p->n && rc == 0; i++) {
    if (p->ts[i]) {
      rc = stream_tensor(dev, fd, &p->es[i], p->ts[i], &buf, &cap, path);
    } else if (dsp_write_all(fd, &p->step, 8) < 0) {
      rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": write: %s", path,
                      strerror(errno));
    }
  }
  dsp_free(buf);
  if (rc == 0 && fsync(fd) < 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": fsync: %s", path,
                    strerror(errno));
  if (fd >= 0 && close(fd) < 0 && rc == 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": close: %s", path,
                    strerror(errno));
  if (rc == 0 && rename(tmp, path) < 0)
    rc = dsp_seterr(dev->ctx, DISPATCH_EIO, "save \"%s\": rename from %s: %s",
                    path, tmp, strerror(errno));
  if (rc == 0)
    fsync_dir_of(path);
  else if (fd >= 0)
    unlink(tmp);
  dsp_free(tmp);
  dsp_free(hdr);
  return rc;
}

int dispatch_save(dispatch_device *dev, const char *path,
                  const char *const *names, dispatch_tensor *const *tensors,
                  int n, const dispatch_optim *opt) {
  if (!dev) return DISPATCH_EINVAL;
  ck_plan p;
  int rc = plan_save(dev, path, names, tensors, n, opt, &p);
  if (rc == 0) rc = save_file(dev, path, &p);
  plan_free(&p);
  return dispatch__ret(dev, rc);
}

/* The server checks what only it can (the name against its directory, the
 * ids); what a REMOTE device knows is refused here first: a LOCAL device,
 * a server of protocol 1.5 or older, one without --checkpoint-dir. */
static int server_ckpt_ok(dispatch_device *dev, const char *fn,
                          const char *file) {
  if (dev->ops->kind != DISPATCH_KIND_REMOTE)
    return dsp_seterr(dev->ctx, DISPATCH_ENOTREMOTE,
                      "%s \"%s\": \"%s\" is a local device; use dispatch_%s",
                      fn, file ? file : "(null)", dev->spec,
                      strcmp(fn, "save_on_server") == 0 ? "save" : "load");
  if (dev->conn->server_minor < 6)
    return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                      "%s: needs a server of protocol 1.6, \"%s\" speaks 1.%u",
                      fn, dev->spec, dev->conn->server_minor);
  if (!dev->conn->server_checkpoints)
    return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                      "%s: the server of \"%s\" has no --checkpoint-dir", fn,
                      dev->spec);
  if (!file || !*file)
    return dsp_seterr(dev->ctx, DISPATCH_EINVAL, "%s: needs a file name", fn);
  return 0;
}

int dispatch_save_on_server(dispatch_device *dev, const char *file,
                            const char *const *names,
                            dispatch_tensor *const *tensors, int n,
                            const dispatch_optim *opt) {
  if (!dev) return DISPATCH_EINVAL;
  int rc = server_ckpt_ok(dev, "save_on_server", file);
  ck_plan p;
  memset(&p, 0, sizeof p);
  if (rc == 0) rc = plan_save(dev, file, names, tensors, n, opt, &p);
  uint64_t *ids = NULL;
  const char **tnames = NULL;
  dispatch_tensor *step = NULL;
  if (rc == 0) {
    ids = dsp_calloc(p.n ? (size_t)p.n : 1, sizeof *ids);
    tnames = dsp_calloc(p.n ? (size_t)p.n : 1, sizeof *tnames);
    if (!ids || !tnames)
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "save_on_server: out of "
                                                 "memory");
  }
  for (int i = 0; rc == 0 && i < p.n; i++) {
    tnames[i] = p.es[i].name;
    if (!p.ts[i]) /* the step count goes up as a tensor of its own */
      rc = dev->ops->upload(dev, &p.es[i].meta, &p.step, sizeof p.step,
                            &step);
    ids[i] = p.ts[i] ? p.ts[i]->id : rc == 0 ? step->id : 0;
  }
  if (rc == 0)
    rc = dispatch__remote_ckpt_save(dev, file, tnames, ids, p.n, p.keys,
                                    p.vals, p.n_meta);
  if (step) dispatch__tensor_unref(step);
  dsp_free(ids);
  dsp_free(tnames);
  plan_free(&p);
  return dispatch__ret(dev, rc);
}

/* ------------------------------------------------------------------ */
/* load                                                                */

void dispatch_checkpoint_free(dispatch_checkpoint *ck) {
  if (!ck) return;
  for (int i = 0; i < ck->n; i++) {
    dispatch_tensor_free(ck->tensors ? ck->tensors[i] : NULL);
    dsp_free(ck->names ? ck->names[i] : NULL);
  }
  for (int i = 0; i < ck->n_meta; i++) {
    dsp_free(ck->meta_keys[i]);
    dsp_free(ck->meta_vals[i]);
  }
  dsp_free(ck->meta_keys);
  dsp_free(ck->meta_vals);
  dsp_free(ck->names);
  dsp_free(ck->tensors);
  dsp_free(ck->by_name);
  dsp_free(ck);
}


/* ck takes f's names and metadata (f keeps its entries' metas), with
 * room for one tensor per entry and the name index. */
static int ck_take(dsp_ctx *ctx, dispatch_checkpoint *ck, dsp_st_file *f) {
  int n = f->n;
  ck->names = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->names);
  ck->tensors = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->tensors);
  ck->by_name = dsp_calloc(n ? (size_t)n : 1, sizeof *ck->by_name);
  if (!ck->names || !ck->tensors || !ck->by_name)
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  ck->n = n;
  for (int i = 0; i < n; i++) {
    ck->names[i] = f->es[i].name;
    f->es[i].name = NULL;
    ck->by_name[i] = i;
  }
  ck->meta_keys = f->keys;
  ck->meta_vals = f->vals;
  ck->n_meta = f->n_meta;
  f->keys = f->vals = NULL;
  f->n_meta = 0;
  /* by_name: data-order indices in name order (insertion sort: the
   * names of a file are few, and this keeps no comparator state) */
  for (int i = 1; i < n; i++) {
    int v = ck->by_name[i], q = i - 1;
    while (q >= 0 && strcmp(ck->names[ck->by_name[q]], ck->names[v]) > 0) {
      ck->by_name[q + 1] = ck->by_name[q];
      q--;
    }
    ck->by_name[q + 1] = v;
  }
  return 0;
}

/* Reads and validates the header, then makes one tensor per entry in data
 * order, holding one tensor's bytes at a time; REMOTE ends with a sync so
 * that a refused upload fails the load. Any failure frees everything. */
int dispatch_load(dispatch_device *dev, const char *path,
                  dispatch_checkpoint **out) {
  if (out) *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  if (!path || !out)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "load: needs a path and an out"));
  dsp_ctx *ctx = dev->ctx;
  int rc = 0;
  uint8_t *buf = NULL;
  dsp_st_file f;
  memset(&f, 0, sizeof f);
  dispatch_checkpoint *ck = dsp_calloc(1, sizeof *ck);
  /* non-blocking until it is known to be a regular file: a blocking open
   * of a FIFO waits for a writer, forever if none comes */
  int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  struct stat st;
  if (!ck) {
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  } else if (fd < 0 || fstat(fd, &st) < 0) {
    rc =
        dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": %s", path, strerror(errno));
  } else if (!S_ISREG(st.st_mode)) {
    rc = dsp_seterr(ctx, DISPATCH_EINVAL, "load \"%s\": not a regular file",
                    path);
  }
  if (rc == 0 && fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) < 0)
    rc = dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": %s", path,
                    strerror(errno));
  if (rc == 0) {
    ck->dev = dev;
    rc = dsp_st_read_header(ctx, fd, (uint64_t)st.st_size, path, &f);
  }
  dsp_st_entry *es = f.es; /* ck_take leaves the metas and offsets */
  if (rc == 0) rc = ck_take(ctx, ck, &f);
  if (rc == 0 && f.max_bytes && !(buf = dsp_malloc((size_t)f.max_bytes)))
    rc = dsp_seterr(ctx, DISPATCH_ENOMEM,
                    "load \"%s\": out of memory (%zu bytes for one tensor)",
                    path, (size_t)f.max_bytes);
  for (int i = 0; rc == 0 && i < ck->n; i++) {
    size_t nb = (size_t)(es[i].end - es[i].begin);
    if (nb && dsp_pread_all(fd, buf, nb, f.data_at + es[i].begin) < 0)
      rc =
          dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": reading \"%s\": %s", path,
                     ck->names[i], errno ? strerror(errno) : "file shrank");
    if (rc == 0 && es[i].meta.dtype == DSP_BOOL &&
        (rc = dsp_check_bool_bytes(ctx, buf, nb)) < 0)
      rc = dsp_st_prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path,
                             ck->names[i]);
    if (rc == 0 && (rc = dev->ops->upload(dev, &es[i].meta, buf, nb,
                                          &ck->tensors[i])) < 0)
      rc = dsp_st_prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path,
                             ck->names[i]);
  }
  /* REMOTE: the uploads' errors come back here */
  if (rc == 0 && ck->n && (rc = dev->ops->sync(dev)) < 0)
    rc = dsp_st_prefix_err(ctx, rc, "load \"%s\"", path);
  if (fd >= 0) close(fd);
  dsp_free(buf);
  dsp_st_file_release(&f);
  if (rc < 0) {
    dispatch_checkpoint_free(ck);
    return dispatch__ret(dev, rc);
  }
  *out = ck;
  return 0;
}

/* The server reads the file into tensors first_id, first_id + 1, ... of
 * the session (nothing is made on a failure); here they get their handles,
 * in the file's data order as dispatch_load makes them. */
int dispatch_load_on_server(dispatch_device *dev, const char *file,
                            dispatch_checkpoint **out) {
  if (out) *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  int rc = server_ckpt_ok(dev, "load_on_server", file);
  if (rc == 0 && !out)
    rc = dsp_seterr(dev->ctx, DISPATCH_EINVAL, "load_on_server: needs an out");
  if (rc < 0) return dispatch__ret(dev, rc);
  dsp_st_file f;
  memset(&f, 0, sizeof f);
  uint64_t first = 0;
  dispatch_checkpoint *ck = dsp_calloc(1, sizeof *ck);
  if (!ck)
    rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "load_on_server: out of memory");
  else
    rc = dispatch__remote_ckpt_load(dev, file, &first, &f);
  int made = 0;
  if (rc == 0) {
    ck->dev = dev;
    dsp_st_entry *es = f.es;
    rc = ck_take(dev->ctx, ck, &f);
    for (; rc == 0 && made < ck->n; made++) {
      rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &es[made].meta, 0,
                                &ck->tensors[made]);
      if (rc == 0) ck->tensors[made]->id = first + (uint64_t)made;
    }
    /* the server made every one: those without a handle are freed there */
    if (rc < 0 && made > 0) made--;
    for (int i = made; i < f.n; i++)
      dispatch__remote_free(dev, first + (uint64_t)i, 0);
  }
  dsp_st_file_release(&f);
  if (rc < 0) {
    dispatch_checkpoint_free(ck);
    return dispatch__ret(dev, rc);
  }
  *out = ck;
  return 0;
}

int dispatch_checkpoint_count(const dispatch_checkpoint *ck) {
  return ck ? ck->n : 0;
}

const char *dispatch_checkpoint_name(const dispatch_checkpoint *ck, int i) {
  return ck && i >= 0 && i < ck->n ? ck->names[i] : NULL;
}

dispatch_tensor *dispatch_checkpoint_tensor(const dispatch_checkpoint *ck,
                                            int i) {
  return ck && i >= 0 && i < ck->n ? ck->tensors[i] : NULL;
}

dispatch_tensor *dispatch_checkpoint_get(const dispatch_checkpoint *ck,
                                         const char *name) {
  if (!ck || !name) return NULL;
  int lo = 0, hi = ck->n - 1;
  while (lo <= hi) {
    int mid = lo + (hi - lo) / 2, j = ck->by_name[mid];
    int c = strcmp(name, ck->names[j]);
    if (c == 0) return ck->tensors[j];
    if (c < 0)
      hi = mid - 1;
    else
      lo = mid + 1;
  }
  return NULL;
}

const char *dispatch_checkpoint_meta(const dispatch_checkpoint *ck,
                                     const char *key) {
  for (int i = 0; ck && key && i < ck->n_meta; i++)
    if (strcmp(ck->meta_keys[i], key) == 0) return ck->meta_vals[i];
  return NULL;
}

/* ------------------------------------------------------------------ */
/* optimizer state                                                     */

/* Checks every state tensor (and Adam's or AdamW's step count) before it changes
 * anything, then swaps the optimizer's state tensors for the checkpoint's. */
int dispatch_optim_load(dispatch_optim *opt, const dispatch_checkpoint *ck) {
  if (!opt) return DISPATCH_EINVAL;
  dispatch_device *dev = opt->dev;
  dsp_ctx *ctx = dev->ctx;
  if (!ck)
    return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                                         "optim_load: checkpoint is NULL"));
  if (ck->dev != dev)
    return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EDEVICE,
                                         "optim_load: checkpoint lives on "
                                         "\"%s\", optimizer on \"%s\"",
                                         ck->dev->spec, dev->spec));
  const char *kind = optim_kind(opt);
  const char *mk = dispatch_checkpoint_meta(ck, "dispatch.optim");
  const char *mn = dispatch_checkpoint_meta(ck, "dispatch.optim.params");
  char nb[32];
  snprintf(nb, sizeof nb, "%d", opt->n);
  if (!mk || !mn || strcmp(mk, kind) != 0 || strcmp(mn, nb) != 0)
    return dispatch__ret(
        dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                        "optim_load: the checkpoint holds %s%s%s state for %s "
                        "parameters; this optimizer is %s over %d",
                        mk ? "\"" : "", mk ? mk : "no optimizer",
                        mk ? "\"" : "", mn ? mn : "no", kind, opt->n));
  static const char *const sgd_names[] = {"momentum"};
  static const char *const adam_names[] = {"m", "v"};
  int total = opt->n * opt->k;
  for (int i = 0; i < total; i++) {
    char name[64];
    snprintf(
        name, sizeof name, "optim.%d.%s", i / opt->k,
        opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % opt->k]);
    dispatch_tensor *t = dispatch_checkpoint_get(ck, name);
    const dsp_meta *want = &opt->params[i / opt->k]->inner->meta;
    if (!t)
      return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_EINVAL,
                                           "optim_load: no tensor \"%s\" in "
                                           "the checkpoint",
                                           name));
    if (!dsp_meta_equal(&t->meta, want)) {
      char a[128], b[128];
      return dispatch__ret(
          dev, dsp_seterr(ctx, DISPATCH_ESHAPE,
                          "optim_load: \"%s\" is %s %s, parameter %d is %s %s",
                          name, dsp_dtype_name(t->meta.dtype),
                          dsp_shape_str(&t->meta, a, sizeof a), i / opt->k,
                          dsp_dtype_name(want->dtype),
                          dsp_shape_str(want, b, sizeof b)));
    }
  }
  /* the loss scale comes back when both sides have one; a checkpoint
   * without it leaves the optimizer's (freshly set) scale alone */
  dispatch_tensor *ls = opt->ls_scale ? dispatch_checkpoint_get(ck, LS_SCALE)
                                      : NULL;
  dispatch_tensor *lc = ls ? dispatch_checkpoint_get(ck, LS_COUNTS) : NULL;
  if (ls && (!lc || !dsp_meta_equal(&ls->meta, &opt->ls_scale->meta) ||
             !dsp_meta_equal(&lc->meta, &opt->ls_counts->meta)))
    return dispatch__ret(dev, dsp_seterr(ctx, DISPATCH_ESHAPE,
                                         "optim_load: \"" LS_SCALE "\" must "
                                         "be an f32 scalar and \"" LS_COUNTS
                                         "\" an i64 [2] beside it"));
  int64_t step = opt->t;
  if (optim_has_t(opt)) {
    dispatch_tensor *t = dispatch_checkpoint_get(ck, "optim.step");
    int rc = 0;
    if (!t || t->meta.dtype != DSP_I64 || t->meta.ndim != 0)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "optim_load: \"optim.step\" is missing or not an i64 "
                      "scalar");
    else if ((rc = dispatch_tensor_read(t, &step, sizeof step)) == 0 &&
             step < 0)
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "optim_load: \"optim.step\" is negative (%lld)",
                      (long long)step);
    if (rc < 0) return dispatch__ret(dev, rc);
  }
  for (int i = 0; i < total; i++) {
    char name[64];
    snprintf(
        name, sizeof name, "optim.%d.%s", i / opt->k,
        opt->op == DSP_OP_SGD_STEP ? sgd_names[0] : adam_names[i % opt->k]);
    dispatch_tensor *t = dispatch_tensor_ref(dispatch_checkpoint_get(ck, name));
    dispatch_tensor_free(opt->states[i]);
    opt->states[i] = t;
  }
  opt->t = step;
  if (ls) {
    dispatch__tensor_unref(opt->ls_scale);
    dispatch__tensor_unref(opt->ls_counts);
    opt->ls_scale = dispatch_tensor_ref(ls);
    opt->ls_counts = dispatch_tensor_ref(lc);
  }
  return 0;
}
