/* Checkpoints the server writes and reads itself (CkptSave, CkptLoad,
 * protocol 1.6), in the directory of --checkpoint-dir only, in the
 * safetensors layout of common/safetensors.c (the one dispatch_save and
 * dispatch_load use), so either side reads the other's files.
 *
 * Confinement: a name is checked as a string first (relative, no empty,
 * "." or ".." component, no control byte, UTF-8, at most
 * SV_CKPT_NAME_MAX bytes), then resolved one component at a time with
 * openat(O_NOFOLLOW) from the directory's descriptor (sv_config_parse
 * opened it), so no symbolic link is followed anywhere on the way, the
 * last component included, and nothing is reached outside the directory.
 * A save writes a temporary file beside its target (O_EXCL, O_NOFOLLOW),
 * fsyncs it, renames it over the target and fsyncs the directory; any
 * failure unlinks the temporary file. Both run on a worker (the kinds
 * table gives them no loop flag and no inline cost). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "handlers.h"
#include "safetensors.h"

#define SV_CKPT_NAME_MAX 1024

/* A checked name: the parent directory's descriptor (owned) and the last
 * component, a pointer into text; shown is the name as messages quote it. */
typedef struct ckpt_path {
  char text[SV_CKPT_NAME_MAX + 1];
  char shown[4 * SV_LOG_STR_MAX + 8];
  int dirfd;
  const char *leaf;
} ckpt_path;

static int no_dir(char *why, size_t len) {
  return sv_why(why, len, DISPATCH_EUNSUPPORTED,
                "checkpoints: this server has no --checkpoint-dir");
}

/* The string rules (see the head of the file). */
static int check_name(const ProtobufCBinaryData *f, ckpt_path *p, char *why,
                      size_t len) {
  if (f->len == 0)
    return sv_why(why, len, DISPATCH_EINVAL, "checkpoint: the name is empty");
  if (f->len > SV_CKPT_NAME_MAX)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint: the name has %zu bytes, at most %d", f->len,
                  SV_CKPT_NAME_MAX);
  for (size_t i = 0; i < f->len; i++)
    if (f->data[i] < 0x20 || f->data[i] == 0x7f)
      return sv_why(why, len, DISPATCH_EINVAL,
                    "checkpoint: the name has the control byte 0x%02x at "
                    "offset %zu",
                    f->data[i], i);
  memcpy(p->text, f->data, f->len);
  p->text[f->len] = '\0';
  sv_log_str(p->shown, sizeof p->shown, p->text, SV_LOG_STR_MAX);
  if (!dsp_st_utf8_ok(f->data, f->len))
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint \"%s\": the name is not valid UTF-8", p->shown);
  if (p->text[0] == '/')
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint \"%s\": an absolute name; names are relative "
                  "to the server's --checkpoint-dir",
                  p->shown);
  for (const char *c = p->text;;) {
    const char *slash = strchr(c, '/');
    size_t n = slash ? (size_t)(slash - c) : strlen(c);
    if (n == 0 || (n == 1 && c[0] == '.') ||
        (n == 2 && c[0] == '.' && c[1] == '.'))
      return sv_why(why, len, DISPATCH_EINVAL,
                    "checkpoint \"%s\": a component is empty, \".\" or "
                    "\"..\"; names stay inside --checkpoint-dir",
                    p->shown);
    if (n > NAME_MAX)
      return sv_why(why, len, DISPATCH_EINVAL,
                    "checkpoint \"%s\": a component of %zu bytes passes %d",
                    p->shown, n, NAME_MAX);
    if (!slash) break;
    c = slash + 1;
  }
  return 0;
}

/* Walks the directories of the name from the checkpoint directory, each
 * opened with O_NOFOLLOW: a symbolic link or a missing directory is
 * refused. 0 with p->dirfd (owned) and p->leaf. */
static int resolve(int base, ckpt_path *p, char *why, size_t len) {
  int fd = dup(base);
  if (fd < 0)
    return sv_why(why, len, DISPATCH_EIO, "checkpoint \"%s\": %s", p->shown,
                  strerror(errno));
  char *c = p->text;
  for (char *slash; (slash = strchr(c, '/')) != NULL; c = slash + 1) {
    *slash = '\0';
    int next = openat(fd, c, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int err = errno;
    *slash = '/';
    close(fd);
    if (next < 0) {
      if (err == ELOOP || err == ENOTDIR)
        return sv_why(why, len, DISPATCH_EINVAL,
                      "checkpoint \"%s\": \"%.*s\" is a symbolic link or not "
                      "a directory; links are not followed",
                      p->shown, (int)(slash - p->text), p->text);
      return sv_why(why, len, DISPATCH_EIO, "checkpoint \"%s\": \"%.*s\": %s",
                    p->shown, (int)(slash - p->text), p->text, strerror(err));
    }
    fd = next;
  }
  p->dirfd = fd;
  p->leaf = c;
  return 0;
}

static int open_path(sv_session *s, const ProtobufCBinaryData *f, ckpt_path *p,
                     char *why, size_t len) {
  p->dirfd = -1;
  if (s->cfg->checkpoint_fd < 0) return no_dir(why, len);
  int rc = check_name(f, p, why, len);
  return rc < 0 ? rc : resolve(s->cfg->checkpoint_fd, p, why, len);
}

/* ------------------------------------------------------------ save */

/* The metadata pairs a client sends: UTF-8, unique keys, "format" kept
 * for the server's own. */
static int check_meta(const Dspwire__CkptSave *m, const ckpt_path *p,
                      char *why, size_t len) {
  if (m->n_meta_keys != m->n_meta_values)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint save \"%s\": %zu metadata keys, %zu values",
                  p->shown, m->n_meta_keys, m->n_meta_values);
  for (size_t i = 0; i < m->n_meta_keys; i++) {
    const char *k = m->meta_keys[i], *v = m->meta_values[i];
    if (!dsp_st_utf8_ok((const unsigned char *)k, strlen(k)) ||
        !dsp_st_utf8_ok((const unsigned char *)v, strlen(v)) ||
        strcmp(k, "format") == 0)
      return sv_why(why, len, DISPATCH_EINVAL,
                    "checkpoint save \"%s\": metadata %zu is not UTF-8 or "
                    "names \"format\"",
                    p->shown, i);
    for (size_t q = 0; q < i; q++)
      if (strcmp(m->meta_keys[q], k) == 0)
        return sv_why(why, len, DISPATCH_EINVAL,
                      "checkpoint save \"%s\": the metadata key %zu appears "
                      "twice",
                      p->shown, i);
  }
  return 0;
}

/* Writes every tensor's bytes: a pin of each (on the CPU its storage, no
 * copy; a device copies to host memory, charged to the session while it
 * is written). */
static int write_tensors(sv_session *s, int fd, dsp_tensor **ts, int n,
                         const ckpt_path *p, char *why, size_t len) {
  for (int i = 0; i < n; i++) {
    size_t nb = dsp_tensor_nbytes(ts[i]);
    if (!nb) continue;
    int host = (dsp_backend_caps(ts[i]->storage->backend) &
                DSP_CAP_HOST_MEMORY) != 0;
    char refused[SV_WHY_LEN];
    if (!host && dsp_budget_charge_why(s->budget, nb, "checkpoint staging",
                                       refused, sizeof refused) < 0)
      return sv_why(why, len, DISPATCH_EQUOTA, "checkpoint save \"%s\": %s",
                    p->shown, refused);
    dsp_pin *pin = NULL;
    int rc = dsp_tensor_pin(s->ctx, ts[i], &pin);
    if (rc < 0)
      rc = sv_why(why, len, rc, "checkpoint save \"%s\": %s", p->shown,
                  dsp_ctx_errmsg(s->ctx));
    for (size_t off = 0; rc == 0 && off < nb;) {
      size_t k = dsp_pin_avail(pin, off, nb - off);
      if (dsp_write_all(fd, (const uint8_t *)dsp_pin_data(pin) + off, k) < 0)
        rc = sv_why(why, len, DISPATCH_EIO, "checkpoint save \"%s\": write: %s",
                    p->shown, strerror(errno));
      off += k;
    }
    dsp_pin_release(pin);
    if (!host) dsp_budget_uncharge(s->budget, nb);
    if (rc < 0) return rc;
  }
  return 0;
}

/* The temporary file, its data, fsync, rename, directory fsync: a reader
 * of the name sees the old file or the whole new one. */
static int write_file(sv_session *s, const ckpt_path *p, const uint8_t *hdr,
                      size_t hlen, dsp_tensor **ts, int n, char *why,
                      size_t len) {
  static atomic_ulong counter;
  char tmp[64];
  int fd = -1;
  for (int tries = 0; fd < 0 && tries < 16; tries++) {
    snprintf(tmp, sizeof tmp, ".dispatch-tmp.%ld.%lu", (long)getpid(),
             (unsigned long)atomic_fetch_add(&counter, 1));
    fd = openat(p->dirfd, tmp,
                O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) break;
  }
  if (fd < 0)
    return sv_why(why, len, DISPATCH_EIO,
                  "checkpoint save \"%s\": cannot create a temporary file: %s",
                  p->shown, strerror(errno));
  int rc = 0;
  if (dsp_write_all(fd, hdr, hlen) < 0)
    rc = sv_why(why, len, DISPATCH_EIO, "checkpoint save \"%s\": write: %s",
                p->shown, strerror(errno));
  if (rc == 0) rc = write_tensors(s, fd, ts, n, p, why, len);
  if (rc == 0 && fsync(fd) < 0)
    rc = sv_why(why, len, DISPATCH_EIO, "checkpoint save \"%s\": fsync: %s",
                p->shown, strerror(errno));
  if (close(fd) < 0 && rc == 0)
    rc = sv_why(why, len, DISPATCH_EIO, "checkpoint save \"%s\": close: %s",
                p->shown, strerror(errno));
  if (rc == 0 && renameat(p->dirfd, tmp, p->dirfd, p->leaf) < 0)
    rc = sv_why(why, len, DISPATCH_EIO, "checkpoint save \"%s\": rename: %s",
                p->shown, strerror(errno));
  if (rc < 0) {
    unlinkat(p->dirfd, tmp, 0);
    return rc;
  }
  if (fsync(p->dirfd) < 0)
    return sv_why(why, len, DISPATCH_EIO,
                  "checkpoint save \"%s\": fsync of the directory: %s",
                  p->shown, strerror(errno));
  return 0;
}

static int save(sv_session *s, const Dspwire__CkptSave *m, ckpt_path *p,
                char *why, size_t len) {
  /* the target itself: a regular file or nothing yet, never a link (the
   * rename would replace the link, but a name that is one is refused) */
  struct stat st;
  if (fstatat(p->dirfd, p->leaf, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
      !S_ISREG(st.st_mode))
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint save \"%s\": the name is a %s, not a regular "
                  "file",
                  p->shown,
                  S_ISLNK(st.st_mode) ? "symbolic link" : "directory or "
                                                          "special file");
  if (m->n_names != m->n_ids || m->n_names > INT32_MAX)
    return sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint save \"%s\": %zu names, %zu ids", p->shown,
                  m->n_names, m->n_ids);
  int rc = check_meta(m, p, why, len);
  if (rc < 0) return rc;
  int n = (int)m->n_names;
  dsp_st_entry *es = dsp_calloc(n ? (size_t)n : 1, sizeof *es);
  dsp_tensor **ts = dsp_calloc(n ? (size_t)n : 1, sizeof *ts);
  if (!es || !ts) rc = sv_why(why, len, DISPATCH_ENOMEM, "out of memory");
  for (int i = 0; rc == 0 && i < n; i++) {
    if ((rc = dsp_st_check_name(s->ctx, p->shown, i, m->names[i])) < 0) {
      rc = sv_why(why, len, rc, "checkpoint %s", dsp_ctx_errmsg(s->ctx));
      break;
    }
    rc = sv_get_tensor(s, m->ids[i], SV_LABEL("checkpoint save"), why, len,
                       &ts[i]);
    if (rc == 0) {
      es[i].name = m->names[i];
      es[i].meta = ts[i]->meta;
    }
  }
  uint8_t *hdr = NULL;
  size_t hlen = 0;
  if (rc == 0 &&
      (rc = dsp_st_header(s->ctx, p->shown, es, n,
                          (const char *const *)m->meta_keys,
                          (const char *const *)m->meta_values,
                          (int)m->n_meta_keys, &hdr, &hlen)) < 0)
    rc = sv_why(why, len, rc, "checkpoint %s", dsp_ctx_errmsg(s->ctx));
  if (rc == 0) rc = write_file(s, p, hdr, hlen, ts, n, why, len);
  dsp_free(hdr);
  dsp_free(es);
  dsp_free(ts);
  return rc;
}

int sv_exec_ckpt_save(sv_session *s, sv_job *j, char *why, size_t len) {
  const Dspwire__CkptSave *m = j->req->ckpt_save;
  ckpt_path p;
  int rc = open_path(s, &m->file, &p, why, len);
  if (rc == 0) rc = save(s, m, &p, why, len);
  if (p.dirfd >= 0) close(p.dirfd);
  if (rc < 0) return rc;
  Dspwire__Reply r = DSPWIRE__REPLY__INIT;
  r.req_id = j->req->req_id;
  if (sv_encode_reply(&r, NULL, 0, &j->out, &j->out_len) < 0)
    return sv_why(why, len, DISPATCH_ENOMEM, "out of memory for the reply");
  return 0;
}

/* ------------------------------------------------------------ load */

/* Reads the checked file into new tensors of the session's device, each
 * charged to the session as it is made; ts[i] holds entry i's. */
static int read_tensors(sv_session *s, int fd, const dsp_st_file *f,
                        dsp_tensor **ts, const ckpt_path *p, char *why,
                        size_t len) {
  for (int i = 0; i < f->n; i++) {
    const dsp_st_entry *e = &f->es[i];
    int64_t numel;
    int rc = sv_check_meta(s->cfg, s->global, s->ctx, &e->meta,
                           "checkpoint load", &numel, why, len);
    if (rc < 0) return rc;
    rc = dsp_tensor_new_uninit(s->ctx, &e->meta, &ts[i]);
    dsp_stage st = {0};
    if (rc == 0) rc = dsp_tensor_stage_in(s->ctx, ts[i], &st);
    if (rc < 0)
      return sv_why(why, len, rc, "checkpoint load \"%s\": tensor \"%s\": %s",
                    p->shown, e->name, dsp_ctx_errmsg(s->ctx));
    if (st.nbytes &&
        dsp_pread_all(fd, st.host, st.nbytes, f->data_at + e->begin) < 0)
      rc = sv_why(why, len, DISPATCH_EIO,
                  "checkpoint load \"%s\": reading \"%s\": %s", p->shown,
                  e->name, errno ? strerror(errno) : "file shrank");
    if (rc == 0 && e->meta.dtype == DSP_BOOL &&
        dsp_check_bool_bytes(s->ctx, st.host, st.nbytes) < 0)
      rc = sv_why(why, len, DISPATCH_EINVAL,
                  "checkpoint load \"%s\": tensor \"%s\": %s", p->shown,
                  e->name, dsp_ctx_errmsg(s->ctx));
    if (rc == 0 && (rc = dsp_stage_commit(s->ctx, &st)) < 0)
      rc = sv_why(why, len, rc, "checkpoint load \"%s\": tensor \"%s\": %s",
                  p->shown, e->name, dsp_ctx_errmsg(s->ctx));
    dsp_stage_release(&st);
    if (rc < 0) return rc;
  }
  return 0;
}

/* Puts ts[i] under first_id + i; on a failure takes back the ones put. */
static int insert_all(sv_session *s, uint64_t first, dsp_tensor **ts, int n,
                      char *why, size_t len) {
  for (int i = 0; i < n; i++) {
    dsp_tensor *t = ts[i];
    ts[i] = NULL;
    int rc = sv_insert(s, first + (uint64_t)i, t, why, len);
    if (rc < 0) {
      while (i-- > 0) sv_tensor_drop(s, first + (uint64_t)i);
      return rc;
    }
  }
  return 0;
}

static int load_reply(sv_job *j, const dsp_st_file *f, char *why, size_t len) {
  int n = f->n;
  Dspwire__TensorMeta *metas = dsp_calloc(n ? (size_t)n : 1, sizeof *metas);
  Dspwire__TensorMeta **mp = dsp_calloc(n ? (size_t)n : 1, sizeof *mp);
  char **names = dsp_calloc(n ? (size_t)n : 1, sizeof *names);
  int rc = 0;
  if (!metas || !mp || !names) {
    rc = sv_why(why, len, DISPATCH_ENOMEM, "out of memory for the reply");
  } else {
    for (int i = 0; i < n; i++) {
      sv_wire_meta(&metas[i], &f->es[i].meta);
      mp[i] = &metas[i];
      names[i] = f->es[i].name;
    }
    Dspwire__CkptReply cr = DSPWIRE__CKPT_REPLY__INIT;
    cr.n_names = cr.n_metas = (size_t)n;
    cr.names = names;
    cr.metas = mp;
    cr.n_meta_keys = cr.n_meta_values = (size_t)f->n_meta;
    cr.meta_keys = f->keys;
    cr.meta_values = f->vals;
    Dspwire__Reply r = DSPWIRE__REPLY__INIT;
    r.req_id = j->req->req_id;
    r.body_case = DSPWIRE__REPLY__BODY_CKPT;
    r.ckpt = &cr;
    if (sv_encode_reply(&r, NULL, 0, &j->out, &j->out_len) < 0)
      rc = sv_why(why, len, DISPATCH_ENOMEM, "out of memory for the reply");
  }
  dsp_free(metas);
  dsp_free(mp);
  dsp_free(names);
  return rc;
}

static int load(sv_session *s, sv_job *j, ckpt_path *p, char *why,
                size_t len) {
  const Dspwire__CkptLoad *m = j->req->ckpt_load;
  /* non-blocking until it is known to be a regular file: a FIFO would
   * hold the worker until a writer came */
  int fd = openat(p->dirfd, p->leaf,
                  O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0)
    return sv_why(why, len, errno == ELOOP ? DISPATCH_EINVAL : DISPATCH_EIO,
                  "checkpoint load \"%s\": %s", p->shown,
                  errno == ELOOP ? "a symbolic link; links are not followed"
                                 : strerror(errno));
  struct stat st;
  int rc = 0;
  if (fstat(fd, &st) < 0)
    rc = sv_why(why, len, DISPATCH_EIO, "checkpoint load \"%s\": %s",
                p->shown, strerror(errno));
  else if (!S_ISREG(st.st_mode))
    rc = sv_why(why, len, DISPATCH_EINVAL,
                "checkpoint load \"%s\": not a regular file", p->shown);
  dsp_st_file f = {0};
  if (rc == 0 && (rc = dsp_st_read_header(s->ctx, fd, (uint64_t)st.st_size,
                                          p->shown, &f)) < 0)
    rc = sv_why(why, len, rc, "checkpoint %s", dsp_ctx_errmsg(s->ctx));
  if (rc == 0 && m->max_tensors && (uint64_t)f.n > m->max_tensors)
    rc = sv_why(why, len, DISPATCH_EINVAL,
                "checkpoint load \"%s\": %d tensors, the request set aside "
                "ids for %u",
                p->shown, f.n, m->max_tensors);
  if (rc == 0 && f.n > 0 && m->first_id > UINT64_MAX - (uint64_t)(f.n - 1))
    rc = sv_why(why, len, DISPATCH_EINVAL,
                "checkpoint load \"%s\": %d ids from %llu pass 2^64",
                p->shown, f.n, (unsigned long long)m->first_id);
  for (int i = 0; rc == 0 && i < f.n; i++) {
    /* the reply names every dtype: an older client is sent none it
     * cannot read, and gets nothing made */
    char nm[4 * SV_LOG_STR_MAX + 8], what[8 * SV_LOG_STR_MAX + 64];
    snprintf(what, sizeof what, "checkpoint load \"%s\": tensor \"%s\"",
             p->shown, sv_log_str(nm, sizeof nm, f.es[i].name, SV_LOG_STR_MAX));
    rc = sv_dtype_for_client(s, f.es[i].meta.dtype, what, why, len);
  }
  for (int i = 0; rc == 0 && i < f.n; i++)
    rc = sv_check_free_id(s, m->first_id + (uint64_t)i, why, len);
  dsp_tensor **ts = NULL;
  if (rc == 0 && !(ts = dsp_calloc(f.n ? (size_t)f.n : 1, sizeof *ts)))
    rc = sv_why(why, len, DISPATCH_ENOMEM, "out of memory");
  if (rc == 0) rc = read_tensors(s, fd, &f, ts, p, why, len);
  if (rc == 0) rc = insert_all(s, m->first_id, ts, f.n, why, len);
  if (rc == 0 && (rc = load_reply(j, &f, why, len)) < 0)
    for (int i = 0; i < f.n; i++) sv_tensor_drop(s, m->first_id + (uint64_t)i);
  for (int i = 0; ts && i < f.n; i++) dsp_tensor_unref(ts[i]);
  dsp_free(ts);
  dsp_st_file_release(&f);
  close(fd);
  return rc;
}

int sv_exec_ckpt_load(sv_session *s, sv_job *j, char *why, size_t len) {
  ckpt_path p;
  int rc = open_path(s, &j->req->ckpt_load->file, &p, why, len);
  if (rc == 0) rc = load(s, j, &p, why, len);
  if (p.dirfd >= 0) close(p.dirfd);
  return rc;
}
