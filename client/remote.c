/* The requests of a REMOTE device: each public call's request built
 * (common/wire_req.c) and queued or waited for (call.c), the hello that
 * opens the session and the bye that ends it, and the REMOTE row of the
 * device-kind table. The connection is conn.c (TCP) and tls.c (TLS), the
 * replay log and resume replay.c. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "conn.h"
#include "op_record.h"
#include "safetensors.h"
#include "wire_req.h"

static int req_op(dispatch_device *dev, dsp_opcode op, const uint64_t *in,
                  int n_in, const dsp_attrs *a, uint64_t out, int no_grad) {
  /* a peer's creation op names its device: only an Op carries that */
  if (dev->conn->batch_ops && !(n_in == 0 && dev->device) &&
      dsp_oprec_fits(n_in, a->n_ints, a->n_floats))
    return dispatch__put_record(dev, op, in, n_in, a, out, no_grad);
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_op(&w, (int32_t)op, in, (size_t)n_in, out, a->ints,
                  (size_t)a->n_ints, a->floats, (size_t)a->n_floats, no_grad);
  /* a peer's creation ops land on its device; ops on inputs follow them */
  if (n_in == 0 && dev->device) w.body.op.device = dev->device;
  return dispatch__queue(dev, r, out, NULL, 0);
}

static int req_upload(dispatch_device *dev, uint64_t id, const dsp_meta *meta,
                      const void *data, size_t n) {
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_upload(&w, id, (int32_t)meta->dtype,
                                         (size_t)meta->ndim, meta->shape);
  if (dev->device) w.body.upload.device = dev->device;
  return dispatch__queue(dev, r, id, data, n);
}

static int req_to_device(dispatch_device *dev, uint64_t id, uint64_t out,
                         const char *device) {
  dsp_wreq w;
  return dispatch__queue(dev, dsp_wreq_to_device(&w, id, out, device), out,
                         NULL, 0);
}

static int req_devices(dispatch_device *dev, dispatch_device_info *out, int max,
                       int *n) {
  dsp_wreq w;
  Dspwire__Reply *r;
  *n = 0;
  int rc = dispatch__call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "device_list: the server's reply carries no stats");
  if (rc == 0) {
    for (size_t i = 0; i < r->stats->n_devices; i++) {
      const Dspwire__DeviceInfo *d = r->stats->devices[i];
      if ((int)i < max) {
        dispatch_device_info *o = &out[i];
        snprintf(o->kind, sizeof o->kind, "%s", d->kind);
        snprintf(o->name, sizeof o->name, "%s", d->name);
        snprintf(o->description, sizeof o->description, "%s",
                 d->description);
        o->total_memory = d->total_memory;
        o->free_memory = d->free_memory;
      }
    }
    *n = (int)r->stats->n_devices;
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

/* 0 when the server has dev->device (by its stats' device list), else
 * DISPATCH_EDEVICE naming the devices it has. */
int dispatch__remote_check_device(dispatch_device *dev) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "open_peer: the server's reply carries no stats");
  if (rc == 0) {
    char names[256];
    size_t k = 0;
    names[0] = '\0';
    int found = 0;
    size_t dl = strlen(dev->device);
    for (size_t i = 0; i < r->stats->n_devices; i++) {
      const Dspwire__DeviceInfo *d = r->stats->devices[i];
      if (strcmp(d->name, dev->device) == 0 ||
          (!strchr(dev->device, ':') && strncmp(d->name, dev->device, dl) == 0 &&
           d->name[dl] == ':'))
        found = 1;
      if (k < sizeof names) {
        int wr = snprintf(names + k, sizeof names - k, "%s%s", i ? ", " : "",
                          d->name);
        if (wr > 0) k += (size_t)wr;
      }
    }
    if (!found)
      rc = dsp_seterr(dev->ctx, DISPATCH_EDEVICE,
                      "%s: the server has no device \"%s\" (it has %s)",
                      dev->spec, dev->device,
                      names[0] ? names : "no device list: protocol 1.0");
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

static int req_track(dispatch_device *dev, uint64_t id) {
  dsp_wreq w;
  return dispatch__queue(dev, dsp_wreq_track(&w, id), 0, NULL, 0);
}

static int req_grad(dispatch_device *dev, uint64_t grads, uint64_t tensor,
                    uint64_t out) {
  dsp_wreq w;
  return dispatch__queue(dev, dsp_wreq_grad(&w, grads, tensor, out), out, NULL,
                         0);
}

/* opt's step over params and states (ids): adamw's weight decays (1.5),
 * the clip and the tensor that gets the norm (1.5), the loss scale
 * (1.7) */
static int req_step(dispatch_optim *opt, uint64_t grads,
                    const uint64_t *params, const uint64_t *states,
                    const dsp_attrs *a) {
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_step(
      &w, (int32_t)opt->op, grads, params, (size_t)opt->n, states,
      (size_t)opt->n * (size_t)opt->k, a->ints, (size_t)a->n_ints, a->floats,
      (size_t)a->n_floats);
  Dspwire__Step *st = &w.body.step;
  st->max_norm = opt->max_norm;
  st->norm = opt->max_norm > 0.0 && opt->norm ? opt->norm->id : 0;
  if (opt->group) { /* 1.7, client/group.c: all-reduced through the group */
    st->group = opt->group;
    st->group_seq = opt->group_seq;
    st->group_reduce = opt->group_reduce;
  }
  if (opt->wd) {
    st->n_weight_decay = (size_t)opt->n;
    st->weight_decay = opt->wd;
  }
  if (opt->ls_scale) {
    st->loss_scale = opt->ls_scale->id;
    st->loss_scale_counts = opt->ls_counts->id;
    st->loss_scale_growth = opt->ls_growth;
    st->loss_scale_backoff = opt->ls_backoff;
    st->loss_scale_interval = opt->ls_interval;
  }
  return dispatch__queue(opt->dev, req, 0, NULL, 0);
}

static int req_read(dispatch_device *dev, uint64_t id, void *buf,
                    size_t nbytes) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(dev, dsp_wreq_read(&w, id), buf, nbytes, id, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_READ)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "read: the server's reply carries no tensor");
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

static int req_backward(dispatch_device *dev, uint64_t loss, uint64_t grads,
                        int retain) {
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_backward(&w, loss, grads, retain);
  if (dev->conn->server_minor >= 3) {
    /* 1.3: pipelined like an op; a failure is the next wait's error and
     * leaves grads a failed container (proto/README.md). The frees queued
     * so far go first: the gradients a loop let go of last step must be
     * gone before this pass makes new ones (one set within the quota) */
    w.body.backward.no_reply = 1;
    int rc = dispatch__check_alive(dev);
    if (rc == DISPATCH__EBROKEN) rc = dispatch__reconnect(dev);
    if (rc == 0) rc = dispatch__put_frees_now(dev);
    return rc < 0 ? rc : dispatch__queue(dev, req, grads, NULL, 0);
  }
  Dspwire__Reply *r;
  int rc = dispatch__call(dev, req, NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

int dispatch__remote_sync(dispatch_device *dev) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(dev, dsp_wreq_sync(&w), NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

int dispatch__remote_ckpt_save(dispatch_device *dev, const char *file,
                               const char *const *names, const uint64_t *ids,
                               int n, const char *const *keys,
                               const char *const *vals, int n_meta) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(dev,
                          dsp_wreq_ckpt_save(&w, file, strlen(file), names,
                                             ids, (size_t)n, keys, vals,
                                             (size_t)n_meta),
                          NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

/* The reply's names, metas and metadata into f, each meta checked as an
 * upload's would be (a server is not trusted to send a sane one). */
static int ckpt_reply_take(dispatch_device *dev, const Dspwire__CkptReply *c,
                           dsp_st_file *f) {
  if (c->n_names != c->n_metas || c->n_meta_keys != c->n_meta_values ||
      c->n_names > INT32_MAX || c->n_meta_keys > INT32_MAX)
    return dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                      "load_on_server: the server's reply has %zu names, %zu "
                      "metas, %zu keys, %zu values",
                      c->n_names, c->n_metas, c->n_meta_keys,
                      c->n_meta_values);
  size_t n = c->n_names, nm = c->n_meta_keys;
  f->es = dsp_calloc(n ? n : 1, sizeof *f->es);
  f->keys = dsp_calloc(nm ? nm : 1, sizeof *f->keys);
  f->vals = dsp_calloc(nm ? nm : 1, sizeof *f->vals);
  if (!f->es || !f->keys || !f->vals)
    return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                      "load_on_server: out of memory");
  for (size_t i = 0; i < n; i++) {
    const Dspwire__TensorMeta *m = c->metas[i];
    dsp_meta *dm = &f->es[i].meta;
    int64_t numel;
    if (!m || !dsp_dtype_valid(m->dtype) || m->n_shape > DSP_MAX_DIMS)
      return dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                        "load_on_server: the server's meta %zu is malformed",
                        i);
    memset(dm, 0, sizeof *dm);
    dm->dtype = (dsp_dtype)m->dtype;
    dm->ndim = (int)m->n_shape;
    for (int d = 0; d < dm->ndim; d++) dm->shape[d] = m->shape[d];
    if (dsp_meta_numel(dev->ctx, dm, &numel) < 0)
      return dsp_st_prefix_err(dev->ctx, DISPATCH_EPROTO,
                               "load_on_server: the server's meta %zu", i);
    f->n = (int)i + 1;
    if (!(f->es[i].name = dsp_strdup(c->names[i])))
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "load_on_server: out of memory");
  }
  f->n = (int)n;
  for (size_t i = 0; i < nm; i++) {
    f->keys[i] = dsp_strdup(c->meta_keys[i]);
    f->vals[i] = dsp_strdup(c->meta_values[i]);
    f->n_meta = (int)i + 1;
    if (!f->keys[i] || !f->vals[i])
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                        "load_on_server: out of memory");
  }
  return 0;
}

/* ids a load sets aside: the most tensors one file may hold here */
#define DISPATCH__CKPT_IDS ((uint64_t)1 << 24)

int dispatch__remote_ckpt_load(dispatch_device *dev, const char *file,
                               uint64_t *first, dsp_st_file *f) {
  dsp_wreq w;
  Dspwire__Reply *r;
  memset(f, 0, sizeof *f);
  /* the tensors get ids from here on: a block set aside before the call,
   * so a load whose reply is late (a timeout) still has its ids, which no
   * later call hands out */
  uint64_t id0 = dev->conn->next_id;
  dev->conn->next_id += DISPATCH__CKPT_IDS;
  *first = id0;
  int rc = dispatch__call(
      dev,
      dsp_wreq_ckpt_load(&w, file, strlen(file), id0,
                         (uint32_t)DISPATCH__CKPT_IDS),
      NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_CKPT)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "load_on_server: the server's reply carries no "
                    "checkpoint");
  if (rc == 0) {
    uint64_t end = id0 + r->ckpt->n_names;
    rc = ckpt_reply_take(dev, r->ckpt, f);
    if (rc < 0) { /* the server made them: nothing here will name them */
      for (uint64_t id = id0; id < end; id++)
        dispatch__remote_free(dev, id, 0);
      dsp_st_file_release(f);
    }
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

static int req_stats(dispatch_device *dev, dispatch_stats *out) {
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(dev, dsp_wreq_stats(&w), NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_STATS)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "stats: the server's reply carries no stats");
  if (r && r->body_case == DSPWIRE__REPLY__BODY_STATS) {
    out->tensors = r->stats->tensors;
    out->bytes = r->stats->bytes;
    out->ops = r->stats->ops;
    out->errors = r->stats->errors;
    out->grads = r->stats->grads;
    out->held_bytes = r->stats->held_bytes;
    out->session_limit = r->stats->session_limit;
    out->queued_bytes = r->stats->queued_bytes;
    out->batches = r->stats->batches;
    out->sessions = r->stats->sessions;
    out->server_tensors = r->stats->server_tensors;
    out->server_bytes = r->stats->server_bytes;
    out->server_held_bytes = r->stats->server_held_bytes;
    out->server_limit = r->stats->server_limit;
    out->protocol_errors = r->stats->protocol_errors;
    out->limit_violations = r->stats->limit_violations;
    out->devices = r->stats->n_devices;
    out->sessions_detached = r->stats->sessions_detached;
    out->sessions_resumed = r->stats->sessions_resumed;
    out->sessions_expired = r->stats->sessions_expired;
    out->inline_ops = r->stats->inline_ops;
    out->handoffs = r->stats->handoffs;
    out->returns = r->stats->returns;
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

static int remote_open(dispatch_device *dev, const char *host, const char *port,
                       const char *token, const char *client_name,
                       const char *device, const dispatch_options *tls) {
  dev->conn->next_id = 1;
  dev->conn->tr = tls ? &dispatch__transport_tls : &dispatch__transport_tcp;
  int rc = dispatch__conn_open(dev, host, port, tls);
  if (rc < 0) return rc;
  dsp_wreq w;
  Dspwire__Reply *r;
  Dspwire__Request *hello = dsp_wreq_hello(&w, DSP_PROTO_MAJOR,
                                            DSP_PROTO_MINOR, token,
                                            client_name);
  if (device) w.body.hello.device = (char *)device;
  const char *e = getenv("DISPATCH_RESUME");
  if (e && strcmp(e, "0") == 0) dev->conn->resume_off = 1;
  w.body.hello.resume = !dev->conn->resume_off;
  w.body.hello.keepalive_ms = dev->conn->ka_asked =
      dispatch__keepalive_for(dev->conn->timeout_ms);
  rc = dispatch__call(dev, hello, NULL, 0, 0, &r);
  if (rc == 0 && r->body_case != DSPWIRE__REPLY__BODY_HELLO)
    rc = dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                    "%s: the server did not answer hello", dev->spec);
  if (rc == 0 && r->hello->major != DSP_PROTO_MAJOR)
    rc = dsp_seterr(dev->ctx, DISPATCH_EVERSION,
                    "%s: server speaks protocol %u.%u, this client %d.%d",
                    dev->spec, r->hello->major, r->hello->minor,
                    DSP_PROTO_MAJOR, DSP_PROTO_MINOR);
  if (rc == 0) {
    dev->conn->max_frame = r->hello->max_frame;
    dev->conn->ready = 1;
    /* 1.3 servers take Ops; a frame limit below a full batch (and room
     * for its message) turns batching off rather than refuse the batch */
    const char *b = getenv("DISPATCH_OPS_BATCH");
    dev->conn->server_minor = r->hello->minor;
    dev->conn->server_checkpoints = r->hello->checkpoints; /* 1.6 */
    dev->conn->ka_ms = r->hello->keepalive_ms; /* 0: an older server */
    dev->conn->ops_limit = DISPATCH__OPS_FIRST;
    dev->conn->batch_ops = r->hello->minor >= 3 &&
                           r->hello->max_frame >= 4 * DISPATCH__OPS_BYTES &&
                           !(b && strcmp(b, "0") == 0);
    rc = dispatch__setup_resume(dev, r->hello, host, port, token, client_name,
                                tls);
    if (r->hello->session_device && *r->hello->session_device &&
        !(dev->conn->server_device = dsp_strdup(r->hello->session_device)))
      rc = dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "%s: out of memory",
                      dev->spec);
  } else if (rc == DISPATCH_ECONN && dev->conn->tls_failed) {
    /* TLS 1.3 reports a refused client certificate only after the
     * handshake, with the server's alert: still a TLS failure */
    rc = dsp_seterr(dev->ctx, DISPATCH_ETLS, "%s: TLS session refused: %s",
                    dev->spec, dev->conn->dead_why);
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

/* Says bye without waiting (the server frees the session's tensors when
 * the connection closes), then releases the socket and buffer. */
static void remote_close(dispatch_device *dev) {
  dispatch__conn *c = dev->conn;
  if (!c || --c->refs > 0) return; /* a peer still uses the session */
  c->closing = 1; /* a failure now only ends it: no reconnect */
  if (c->fd >= 0 && !c->dead && c->ready) {
    dsp_wreq w;
    c->n_free_ids = c->n_free_grads = 0;
    c->ops_n = 0; /* nothing can read their results any more */
    c->ops_len = 0;
    if (dispatch__queue(dev, dsp_wreq_bye(&w), 0, NULL, 0) == 0)
      dispatch__flush(dev);
  }
  c->tr->close(c); /* TLS: close_notify while the socket is open */
  if (c->fd >= 0) close(c->fd);
  c->fd = -1;
  dsp_free(c->buf);
  c->buf = NULL;
  c->len = c->cap = 0;
  dsp_free(c->ops);
  c->ops = NULL;
  dsp_free(c->rbuf);
  c->rbuf = NULL;
  c->rpos = c->rlen = 0;
  dsp_free(c->server_device);
  dsp_free(c->log);
  dsp_free(c->log_seq);
  dsp_free(c->log_off);
  dsp_free(c->host);
  dsp_free(c->port);
  dsp_free(c->auth);
  dsp_free(c->name);
  if (c->tls_o) {
    dsp_free((char *)c->tls_o->ca_file);
    dsp_free((char *)c->tls_o->cert_file);
    dsp_free((char *)c->tls_o->key_file);
    dsp_free((char *)c->tls_o->server_name);
    dsp_free(c->tls_o);
  }
  OPENSSL_cleanse(c->token, sizeof c->token);
  dsp_free(c);
  dev->conn = NULL;
}

/* ------------------------------------------------------------------ */
/* the REMOTE row of the device-kind table                             */

/* 1.7: a server of an older protocol holds no f16 or bf16 tensor: a call
 * that would make one is refused here, naming the dtype and the version
 * needed, rather than by the server as a dtype it does not know. */
static int server_carries(dispatch_device *dev, const char *fn, dsp_dtype dt) {
  char why[128];
  if (!dsp_dtype_wire_refusal((int)dt, dev->conn->server_minor, "server",
                              why, sizeof why))
    return 0;
  return dsp_seterr(dev->ctx, DISPATCH_EDTYPE, "%s: %s (\"%s\")", fn, why,
                    dev->spec);
}

/* The output's meta is inferred here (shape errors come back now) and the
 * op is queued without waiting; the output is tracked when an input is
 * AUTODIFF and the result is a float of a non-creation op, the rule the
 * engine applies on the server. */
static int remote_op(dispatch_device *dev, dsp_opcode op,
                     dispatch_tensor *const *cin, int n_in, const dsp_attrs *a,
                     int any_ad, dispatch_tensor **out, int *wrap) {
  const dsp_op_info *info = dsp_op_lookup((int)op);
  dsp_meta metas[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) metas[i] = cin[i]->meta;
  dsp_attrs none = dsp_attrs_none();
  dsp_meta om;
  int rc = dsp_op_infer(dev->ctx, op, metas, n_in, a ? a : &none, &om);
  if (rc < 0) return rc;
  if ((rc = server_carries(dev, info->name, om.dtype)) < 0) return rc;
  dispatch_tensor *t;
  rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &om, 0, &t);
  if (rc < 0) return rc;
  uint64_t ids[DSP_MAX_INPUTS];
  for (int i = 0; i < n_in; i++) ids[i] = cin[i]->id;
  t->id = dispatch__remote_new_id(dev);
  rc = req_op(dev, op, ids, n_in, a ? a : &none, t->id, !any_ad);
  if (rc < 0) {
    t->id = 0;
    dispatch__tensor_unref(t);
    return rc;
  }
  *wrap = any_ad && dsp_dtype_is_float(om.dtype) &&
          info->family != DSP_FAM_CREATE && info->family != DSP_FAM_OPTIM;
  *out = t;
  return 0;
}

/* one queued Upload whose bulk part is the bytes */
static int remote_upload(dispatch_device *dev, const dsp_meta *m,
                         const void *data, size_t nbytes,
                         dispatch_tensor **out) {
  int rc = server_carries(dev, "tensor_from_data", m->dtype);
  if (rc < 0) return rc;
  dispatch_tensor *t;
  rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, m, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  rc = req_upload(dev, t->id, m, data, nbytes);
  if (rc < 0) {
    t->id = 0; /* never reached the server: nothing to Free */
    dispatch__tensor_unref(t);
    return rc;
  }
  *out = t;
  return 0;
}

static int remote_read(dispatch_tensor *t, void *buf, size_t nbytes) {
  return req_read(t->dev, t->id, buf, nbytes);
}

/* The grant half of a server-to-server move, on the source's device:
 * 0 with the capability (cap_len bytes into cap) and the name the source
 * gives itself, or the source's error (its message in src's context). */
static int peer_grant(dispatch_device *src, uint64_t id, uint8_t *cap,
                      size_t *cap_len, char *name, size_t name_len) {
  DISPATCH__GUARD(src, "to_device");
  dsp_wreq w;
  Dspwire__Reply *r;
  int rc = dispatch__call(src, dsp_wreq_peer_grant(&w, id), NULL, 0, 0, &r);
  if (rc == 0 && (r->body_case != DSPWIRE__REPLY__BODY_PEER_GRANT ||
                  r->peer_grant->capability.len > *cap_len ||
                  !r->peer_grant->name || !r->peer_grant->name[0] ||
                  strlen(r->peer_grant->name) >= name_len))
    rc = dsp_seterr(src->ctx, DISPATCH_EPROTO,
                    "to_device: the source server's grant carries no usable "
                    "capability");
  if (rc == 0) {
    memcpy(cap, r->peer_grant->capability.data, r->peer_grant->capability.len);
    *cap_len = r->peer_grant->capability.len;
    snprintf(name, name_len, "%s", r->peer_grant->name);
  }
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  return rc;
}

/* Between two servers that speak 1.7: the source grants a capability for
 * c, the destination pulls the bytes from it, server to server; this
 * process sends two small requests. 1: the source cannot grant (it has
 * no --name) or the destination pulls from no peer (it has no --peer),
 * so the caller copies the bytes through here. */
static int peer_move(dispatch_tensor *c, dispatch_device *dev,
                     dispatch_tensor **out) {
  uint8_t cap[64];
  size_t cap_len = sizeof cap;
  char name[80];
  int rc = peer_grant(c->dev, c->id, cap, &cap_len, name, sizeof name);
  if (rc == DISPATCH_EUNSUPPORTED) return 1;
  if (rc < 0)
    return dsp_seterr(dev->ctx, rc, "to_device: the source server refused "
                      "the transfer: %s", dsp_ctx_errmsg(c->dev->ctx));
  dispatch_tensor *t;
  rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &c->meta, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  dsp_wreq w;
  Dspwire__Reply *r = NULL;
  rc = dispatch__call(dev,
                      dsp_wreq_peer_pull(&w, name, cap, cap_len, t->id,
                                         (int32_t)c->meta.dtype,
                                         (size_t)c->meta.ndim, c->meta.shape,
                                         dev->device),
                      NULL, 0, 0, &r);
  if (r) dspwire__reply__free_unpacked(r, &dispatch__pb_alloc);
  memset(cap, 0, sizeof cap);
  if (rc < 0) {
    t->id = 0; /* a failed pull leaves no tensor on the server */
    dispatch__tensor_unref(t);
    /* a destination without peers pulls from no one: copy through here
     * (the unused capability expires on the source) */
    return rc == DISPATCH_EUNSUPPORTED ? 1 : rc;
  }
  dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

/* Between two devices of one session (a device and its peers) the server
 * copies: one ToDevice request, no bytes through the client. Between two
 * servers of protocol 1.7 they move the bytes themselves (peer_move). */
static int remote_move(dispatch_tensor *c, dispatch_device *dev,
                       dispatch_tensor **out) {
  if (c->dev->conn != dev->conn) {
    if (c->kind == DISPATCH_KIND_REMOTE && c->dev->ops == dev->ops &&
        c->dev->conn->server_minor >= 7 && dev->conn->server_minor >= 7)
      return peer_move(c, dev, out);
    return 1;
  }
  const char *target = dev->device ? dev->device : dev->conn->server_device;
  if (!target)
    return dsp_seterr(dev->ctx, DISPATCH_EPROTO,
                      "to_device: the server named no session device");
  dispatch_tensor *t;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &c->meta, 0, &t);
  if (rc < 0) return rc;
  t->id = dispatch__remote_new_id(dev);
  rc = req_to_device(dev, c->id, t->id, target);
  if (rc < 0) {
    t->id = 0;
    dispatch__tensor_unref(t);
    return rc;
  }
  if ((rc = dispatch__sync_call(dev)) < 0) {
    dispatch__tensor_unref(t);
    return rc;
  }
  dispatch__scope_adopt(t);
  *out = t;
  return 0;
}

/* an AUTODIFF wrapper has no id */
static void remote_release(dispatch_tensor *t) {
  if (t->id) dispatch__remote_free(t->dev, t->id, 0);
}

static void remote_destroy(dispatch_tensor *t) { (void)t; }

static int remote_track(dispatch_tensor *t) {
  return req_track(t->dev, t->id);
}

static int remote_backward(dispatch_tensor *loss, int retain,
                           dispatch_grads *g) {
  dispatch_device *dev = g->dev;
  g->id = dispatch__remote_new_id(dev);
  int rc = req_backward(dev, loss->id, g->id, retain);
  if (rc == 0 && (rc = dispatch__sync_call(dev)) < 0)
    dispatch__remote_free(dev, g->id, 1); /* the failed container */
  return rc;
}

static int remote_grad(dispatch_grads *g, dispatch_tensor *leaf,
                       dispatch_tensor **out) {
  dispatch_device *dev = g->dev;
  /* the client knows an op's output from a leaf, so a non-leaf fails here
   * as on LOCAL (same code and message), not at a later wait */
  if (leaf->made_by)
    return dsp_seterr(dev->ctx, DISPATCH_ENOGRAD,
                      "grads_get: gradients are kept for tracked leaves "
                      "only; this tensor is the output of %s",
                      dsp_op_lookup(leaf->made_by - 1)->name);
  dispatch_tensor *r;
  int rc = dispatch__tensor_new(dev, DISPATCH_KIND_REMOTE, &leaf->meta, 0, &r);
  if (rc < 0) return rc;
  r->id = dispatch__remote_new_id(dev);
  rc = req_grad(dev, g->id, leaf->id, r->id);
  if (rc < 0) {
    r->id = 0;
    dispatch__tensor_unref(r);
    return rc;
  }
  *out = r;
  return 0;
}

static void remote_grads_free(dispatch_grads *g) {
  dispatch__remote_free(g->dev, g->id, 1);
}

/* one Step message carrying every parameter */
static int remote_step(dispatch_optim *opt, dispatch_grads *grads,
                       const dsp_attrs *a) {
  dispatch_device *dev = opt->dev;
  /* a 1.4 server would drop the clip unread and not know adamw: refused
   * here rather than stepping differently from LOCAL */
  if (dev->conn->server_minor < 5 &&
      (opt->max_norm > 0.0 || opt->op == DSP_OP_ADAMW_STEP))
    return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                      "optim_step: %s needs a server of protocol 1.5, "
                      "\"%s\" speaks 1.%u",
                      opt->op == DSP_OP_ADAMW_STEP ? "adamw" : "clipping",
                      dev->spec, dev->conn->server_minor);
  /* a 1.6 server would drop the scale unread and step on scaled
   * gradients */
  if (dev->conn->server_minor < 7 && opt->ls_scale)
    return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                      "optim_step: loss scaling needs a server of protocol "
                      "1.7, \"%s\" speaks 1.%u",
                      dev->spec, dev->conn->server_minor);
  uint64_t pstack[64], sstack[128];
  uint64_t *pids = pstack, *sids = sstack;
  if (opt->n > 64) {
    pids = dsp_calloc((size_t)opt->n, sizeof *pids);
    sids = dsp_calloc((size_t)opt->n * (size_t)opt->k, sizeof *sids);
    if (!pids || !sids) {
      dsp_free(pids);
      dsp_free(sids);
      return dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "optim_step: out of memory");
    }
  }
  for (int i = 0; i < opt->n; i++) pids[i] = opt->params[i]->inner->id;
  for (int i = 0; i < opt->n * opt->k; i++) sids[i] = opt->states[i]->id;
  int rc = req_step(opt, grads->id, pids, sids, a);
  if (pids != pstack) {
    dsp_free(pids);
    dsp_free(sids);
  }
  return rc;
}

/* Queues a Free of graph id (a lost connection frees it anyway). */
static void remote_graph_free(dispatch_device *dev, uint64_t id) {
  /* closing too: a peer going leaves its session serving the others */
  if (dev->conn->dead || dev->conn->fd < 0) return;
  Dspwire__Free f = DSPWIRE__FREE__INIT;
  Dspwire__Request req = DSPWIRE__REQUEST__INIT;
  f.n_graphs = 1;
  f.graphs = &id;
  req.body_case = DSPWIRE__REQUEST__BODY_FREE;
  req.free = &f;
  dispatch__remote_queue(dev, &req);
}

static int remote_stats(dispatch_device *dev, dispatch_stats *all) {
  memset(all, 0, sizeof *all);
  return req_stats(dev, all);
}

static int remote_set_cache(dispatch_device *dev, uint64_t bytes) {
  (void)bytes;
  return dsp_seterr(dev->ctx, DISPATCH_EUNSUPPORTED,
                    "set_cache: \"%s\" is a remote device (its "
                    "server's cache is dispatch-server --session-cache)",
                    dev->spec);
}

static int remote_open_row(dispatch_device *dev, const dispatch__open_args *a) {
  return remote_open(dev, a->host, a->port, a->token, a->client_name, a->device,
                     a->tls);
}

/* a peer goes while the session stays: free what it made there */
static void remote_detach(dispatch_device *dev) {
  if (!dev->conn || dev->conn->refs <= 1) return;
  for (dispatch_tensor *t = dev->all; t; t = t->anext)
    if (t->id) dispatch__remote_free(dev, t->id, 0);
  for (dispatch_grads *g = dev->grads; g; g = g->next)
    dispatch__remote_free(dev, g->id, 1);
}

static int remote_peer(dispatch_device *dev) {
  (void)dev;
  return 0;
}

const dispatch__kind_ops dispatch__remote_ops = {
    .kind = DISPATCH_KIND_REMOTE,
    .open = remote_open_row,
    .detach = remote_detach,
    .close = remote_close,
    .peer = remote_peer,
    .op = remote_op,
    .upload = remote_upload,
    .read = remote_read,
    .move = remote_move,
    .release = remote_release,
    .destroy = remote_destroy,
    .track = remote_track,
    .backward = remote_backward,
    .grad = remote_grad,
    .grads_free = remote_grads_free,
    .step = remote_step,
    .graph_define = dispatch__graph_define_remote,
    .graph_replay = dispatch__graph_replay_remote,
    .graph_free = remote_graph_free,
    .sync = dispatch__remote_sync,
    .stats = remote_stats,
    .devices = req_devices,
    .set_cache = remote_set_cache,
};
