/* The socket-free half of reading a request: frame header limits, protobuf
 * decode, the structural rules of proto/README.md and the upload checks.
 * net.c calls these on the loop thread; the fuzzers and the regression
 * suite call them (through sv_stream_exec) on plain byte buffers, so the
 * code they exercise is the code the server runs. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "frame.h"
#include "op_record.h"
#include "sv.h"

int sv_why(char *why, size_t len, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, len, fmt, ap);
  va_end(ap);
  return code;
}

int sv_attrs_from(size_t n_ints, const int64_t *ints, size_t n_floats,
                  const double *floats, dsp_attrs *a) {
  if (n_ints > DSP_MAX_ATTR_INTS || n_floats > DSP_MAX_ATTR_FLOATS)
    return DISPATCH_EINVAL;
  *a = dsp_attrs_none();
  a->n_ints = (int)n_ints;
  for (size_t i = 0; i < n_ints; i++) a->ints[i] = ints[i];
  a->n_floats = (int)n_floats;
  for (size_t i = 0; i < n_floats; i++) a->floats[i] = floats[i];
  return 0;
}

/* Checks a header before anything is allocated for the frame: flags, the
 * message limit, message + bulk against the frame limit (no overflow: both
 * parts are already below max_frame) and a non-empty message. */
int sv_decode_header(const sv_config *cfg,
                     const uint8_t *in,
                     dsp_frame_header *h, char *why, size_t why_len) {
  int rc = dsp_frame_header_decode(in, cfg->max_msg, cfg->max_frame, h);
  if (rc == 0 && (uint64_t)h->msg_len > cfg->max_frame - h->bulk_len)
    rc = DISPATCH_ETOOLARGE;
  if (rc < 0)
    return sv_why(why, why_len, rc,
                  "bad frame header: message %u bytes (limit %llu), bulk "
                  "%llu bytes (frame limit %llu), flags %u",
                  h->msg_len, (unsigned long long)cfg->max_msg,
                  (unsigned long long)h->bulk_len,
                  (unsigned long long)cfg->max_frame, h->flags);
  if (h->msg_len == 0)
    return sv_why(why, why_len, DISPATCH_EPROTO, "frame has no message");
  return 0;
}

/* The layout of an Ops request's records (op_record.h): at least one, at
 * most DSP_OPREC_MAX, each whole and of a known op code. NULL when they
 * are fine, else the reason (in buf). */
const char *sv_check_ops(const Dspwire__Request *r, char *buf, size_t len) {
  const ProtobufCBinaryData *recs = &r->ops->records;
  /* absent records are data NULL, len 0: no pointer arithmetic on that
   * (NULL + 0 is undefined in C; clang's UBSan aborts on it) */
  if (recs->len == 0) return "ops request without records";
  const uint8_t *p = recs->data, *end = recs->data + recs->len;
  int n = 0;
  while (p < end) {
    dsp_oprec r;
    char why[128];
    if (++n > DSP_OPREC_MAX) {
      snprintf(buf, len, "ops request of more than %d records", DSP_OPREC_MAX);
      return buf;
    }
    if (dsp_oprec_next(&p, end, &r, why, sizeof why) < 0) {
      snprintf(buf, len, "ops record %d: %s", n, why);
      return buf;
    }
    if (!dsp_op_lookup(r.op)) {
      snprintf(buf, len, "ops record %d: unknown op code %d", n, r.op);
      return buf;
    }
  }
  return NULL;
}

/* An Op's op code is one the op table knows. */
const char *sv_check_op(const Dspwire__Request *r, char *buf, size_t len) {
  if (dsp_op_lookup(r->op->op)) return NULL;
  snprintf(buf, len, "unknown op code %d", r->op->op);
  return buf;
}

/* Decodes one message and applies the rules that do not need a session:
 * a body, hello first and only once, bulk only on an upload, a known op
 * code. On failure nothing is kept and *req_id is the request's id when
 * the message decoded (0 otherwise). */
static int decode_with(ProtobufCAllocator *alloc, const uint8_t *msg,
                       size_t len, uint64_t bulk_len, int hello_done,
                       Dspwire__Request **out, uint64_t *req_id, char *why,
                       size_t why_len) {
  *out = NULL;
  *req_id = 0;
  Dspwire__Request *req = dspwire__request__unpack(alloc, len, msg);
  if (!req)
    return sv_why(why, why_len, DISPATCH_EPROTO,
                  "undecodable request message (%zu bytes)", len);
  *req_id = req->req_id;
  const char *bad = NULL;
  char opwhy[192];
  Dspwire__Request__BodyCase bc = req->body_case;
  const sv_req_kind *kind = sv_req_kind_of(bc);
  if (bc == DSPWIRE__REQUEST__BODY__NOT_SET) {
    bad = "request has no body";
  } else if (!hello_done && bc != DSPWIRE__REQUEST__BODY_HELLO) {
    bad = "the first request must be a hello";
  } else if (hello_done && bc == DSPWIRE__REQUEST__BODY_HELLO) {
    bad = "a second hello";
  } else if (!kind->bulk && bulk_len != 0) {
    bad = "only an upload or a graph replay may carry a bulk part";
  } else if (kind->check) {
    bad = kind->check(req, opwhy, sizeof opwhy);
  }
  if (bad) {
    dspwire__request__free_unpacked(req, alloc);
    return sv_why(why, why_len, DISPATCH_EPROTO, "request %llu: %s",
                  (unsigned long long)*req_id, bad);
  }
  *out = req;
  return 0;
}

int sv_decode_request(const uint8_t *msg, size_t len, uint64_t bulk_len,
                      int hello_done, Dspwire__Request **out,
                      uint64_t *req_id, char *why, size_t why_len) {
  return decode_with(&sv_pb_allocator, msg, len, bulk_len, hello_done, out,
                     req_id, why, why_len);
}

/* Reads a varint at *p (below end); 0 when it is cut or too long. */
static int scan_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
  uint64_t r = 0;
  for (int sh = 0; sh < 64 && *p < end; sh += 7) {
    uint8_t b = *(*p)++;
    r |= (uint64_t)(b & 0x7f) << sh;
    if (!(b & 0x80)) {
      *v = r;
      return 1;
    }
  }
  return 0;
}

/* The req_id (field 1) and the body's field number of a Request, read
 * from the wire form without allocating; fields it cannot walk stop the
 * scan (what was found stays). */
static void scan_request(const uint8_t *p, size_t len, uint64_t *req_id,
                         int *body) {
  const uint8_t *end = p + len;
  *req_id = 0;
  *body = 0;
  while (p < end) {
    uint64_t key, v;
    if (!scan_varint(&p, end, &key)) return;
    uint64_t field = key >> 3;
    switch (key & 7) {
      case 0:
        if (!scan_varint(&p, end, &v)) return;
        if (field == 1) *req_id = v;
        break;
      case 1:
        if (end - p < 8) return;
        p += 8;
        break;
      case 2:
        if (!scan_varint(&p, end, &v) || v > (uint64_t)(end - p)) return;
        p += v;
        if (field >= 2 && field <= 64) *body = (int)field;
        break;
      case 5:
        if (end - p < 4) return;
        p += 4;
        break;
      default: return;
    }
  }
}

int sv_decode_request_charged(sv_session *s, const uint8_t *msg, size_t len,
                              uint64_t bulk_len, int hello_done,
                              Dspwire__Request **out, uint64_t *req_id,
                              int *body, char *why, size_t why_len) {
  *body = 0;
  if (!s || !s->queue)
    return decode_with(&sv_pb_allocator, msg, len, bulk_len, hello_done, out,
                       req_id, why, why_len);
  s->pb.refused = 0;
  s->pb.hint = len;
  int rc = decode_with(&s->pb.pb, msg, len, bulk_len, hello_done, out,
                       req_id, why, why_len);
  sv_pb_charge_done(&s->pb);
  if (rc < 0 && s->pb.refused) {
    scan_request(msg, len, req_id, body);
    return sv_why(why, why_len, DISPATCH_EQUOTA, "%s (a %zu-byte message)",
                  s->pb.why, len);
  }
  if (rc == 0) *body = (int)(*out)->body_case;
  return rc;
}

static void pre_err(sv_job *j, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void pre_err(sv_job *j, int code, const char *fmt, ...) {
  char msg[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  j->pre_err = code;
  j->pre_msg = dsp_strdup(msg); /* NULL is fine: the code still travels */
}

/* Checks an Upload's meta against every limit before allocating, then
 * allocates the tensor its bulk will land in. Any failure is deferred in
 * the job (the caller discards the bulk to stay in step). Returns 1, with
 * nothing changed, when the upload would pass the quota but may_wait says
 * earlier requests (a free, say) are still queued: judge it again later
 * with may_wait 0. */
int sv_upload_bulk(const sv_config *cfg, dsp_ctx *io_ctx, sv_session *s,
                   sv_job *j, uint64_t bulk_len, int may_wait) {
  Dspwire__Upload *u = j->req->upload;
  dsp_meta m;
  memset(&m, 0, sizeof m);
  int64_t numel = 0;
  if (!u->meta) {
    pre_err(j, DISPATCH_EINVAL, "upload: no tensor meta");
    return 0;
  }
  if (u->meta->n_shape > DSP_MAX_DIMS) {
    pre_err(j, DISPATCH_EINVAL, "upload: rank %zu, at most %d",
            u->meta->n_shape, DSP_MAX_DIMS);
    return 0;
  }
  if (!dsp_dtype_valid(u->meta->dtype)) {
    pre_err(j, DISPATCH_EDTYPE, "upload: dtype %d is not a dtype",
            u->meta->dtype);
    return 0;
  }
  char shape[160], msg[512];
  int rc = sv_dtype_for_client(s, u->meta->dtype, "upload", msg, sizeof msg);
  if (rc < 0) { /* an older client cannot name a half dtype */
    pre_err(j, rc, "%s", msg);
    return 0;
  }
  m.dtype = (dsp_dtype)u->meta->dtype;
  m.ndim = (int)u->meta->n_shape;
  for (int i = 0; i < m.ndim; i++) m.shape[i] = u->meta->shape[i];
  rc = sv_check_meta(cfg, s->global, io_ctx, &m, "upload", &numel, msg,
                         sizeof msg);
  if (rc < 0) {
    pre_err(j, rc, "%s", msg);
    return 0;
  }
  uint64_t nbytes = (uint64_t)numel * dsp_dtype_size(m.dtype);
  if (nbytes != bulk_len) {
    dsp_shape_str(&m, shape, sizeof shape); /* formatted only to refuse */
    pre_err(j, DISPATCH_EINVAL,
            "upload: %llu bulk bytes, but %s %s needs %llu",
            (unsigned long long)bulk_len, dsp_dtype_name(m.dtype), shape,
            (unsigned long long)nbytes);
    return 0;
  }
  /* the tensor is charged to the session from now on: queued uploads
   * count as held. The headers' few hundred bytes are in the hint. */
  if (may_wait && !dsp_budget_fits(s->budget, nbytes + 512)) return 1;
  dsp_tensor *t;
  /* on the session's device (or the one the upload names), charged to the
   * session and that device */
  const dsp_backend *be = s->device;
  const char *want = j->req->upload->device;
  if (want && *want) {
    const sv_device *d = sv_device_find(s->global, want);
    if (!d) {
      char names[256], w[4 * SV_LOG_STR_MAX + 8];
      sv_device_names(s->global, names, sizeof names);
      pre_err(j, DISPATCH_EDEVICE, "upload: this server has no device \"%s\" "
              "(it has %s)", sv_log_str(w, sizeof w, want, SV_LOG_STR_MAX),
              names[0] ? names : "only its default CPU");
      return 0;
    }
    char why[320];
    if ((rc = sv_session_backend(s, d, &be, why, sizeof why)) < 0) {
      pre_err(j, rc, "upload: %s", why);
      return 0;
    }
  }
  dsp_ctx_set_budget(io_ctx, s->budget);
  dsp_ctx_set_backend(io_ctx, be);
  rc = dsp_tensor_new_uninit(io_ctx, &m, &t); /* the bulk fills it */
  dsp_ctx_set_backend(io_ctx, NULL);
  dsp_ctx_set_budget(io_ctx, NULL);
  if (rc < 0) {
    if (rc == DISPATCH_EQUOTA) sv_count_limit(s->global, SV_LIM_QUOTA);
    pre_err(j, rc, "upload: %s", dsp_ctx_errmsg(io_ctx));
    return 0;
  }
  /* the bulk lands in the backend's staging memory (on the CPU the storage
   * itself), committed in order when the upload runs */
  rc = dsp_tensor_stage_in(io_ctx, t, &j->upload_stage);
  if (rc < 0) {
    pre_err(j, rc, "upload: %s", dsp_ctx_errmsg(io_ctx));
    dsp_tensor_unref(t);
    return 0;
  }
  j->upload = t;
  j->upload_bytes = nbytes;
  atomic_fetch_add(&s->queued_bytes, (long long)nbytes);
  return 0;
}

int sv_upload_prepare(const sv_config *cfg, dsp_ctx *io_ctx, sv_session *s,
                      sv_job *j, uint64_t bulk_len, int may_wait) {
  const sv_req_kind *kind = sv_req_kind_of(j->req->body_case);
  return kind->bulk ? kind->bulk(cfg, io_ctx, s, j, bulk_len, may_wait) : 0;
}

/* Checks that a reply frame the session produced is one frame that decodes
 * as a Reply: a malformed reply is as much a bug as a crash. */
static int check_reply(const sv_job *j, sv_stream_stats *st) {
  if (j->out_len < DSP_FRAME_HEADER_SIZE) return DISPATCH_EINTERNAL;
  dsp_frame_header h;
  if (dsp_frame_header_decode(j->out, UINT32_MAX, UINT64_MAX, &h) < 0 ||
      (uint64_t)h.msg_len + h.bulk_len + DSP_FRAME_HEADER_SIZE != j->out_len)
    return DISPATCH_EINTERNAL;
  Dspwire__Reply *r = dspwire__reply__unpack(
      &sv_pb_allocator, h.msg_len, j->out + DSP_FRAME_HEADER_SIZE);
  if (!r) return DISPATCH_ENOMEM; /* the frame was packed by us */
  st->replies++;
  if (r->error) {
    st->error_replies++;
    if (!st->first_error) st->first_error = r->error->code;
  }
  dspwire__reply__free_unpacked(r, &sv_pb_allocator);
  return 0;
}

/* Runs a byte stream the way one connection's requests run, but
 * synchronously: header, decode, structural rules, hello, upload checks
 * with the bulk copied in, then sv_session_exec, one request after the
 * other. Stops at the first protocol error (returned: the server would
 * send it and close), after a bye, or where the stream ends inside a frame
 * (st->truncated). Nothing of a request outlives the call; the session
 * keeps what its requests made. */
int sv_stream_exec(sv_session *s, dsp_ctx *io_ctx, int *hello_done,
                   const uint8_t *p, size_t n, sv_stream_stats *st) {
  const sv_config *cfg = s->cfg;
  char why[512];
  memset(st, 0, sizeof *st);
  while (n > 0) {
    dsp_frame_header h;
    if (n < DSP_FRAME_HEADER_SIZE) {
      st->truncated = 1;
      return 0;
    }
    int rc = sv_decode_header(cfg, p, &h, why, sizeof why);
    if (rc < 0) return rc;
    p += DSP_FRAME_HEADER_SIZE;
    n -= DSP_FRAME_HEADER_SIZE;
    if (n < h.msg_len) {
      st->truncated = 1;
      return 0;
    }
    Dspwire__Request *req;
    uint64_t rid;
    int body;
    rc = sv_decode_request_charged(s, p, h.msg_len, h.bulk_len, *hello_done,
                                   &req, &rid, &body, why, sizeof why);
    if (rc == DISPATCH_EQUOTA && *hello_done) {
      /* nothing is queued here: the request alone does not fit, and its
       * bulk (an upload's) is skipped as the connection would */
      p += h.msg_len;
      n -= h.msg_len;
      st->frames++;
      if (n < h.bulk_len) {
        st->truncated = 1;
        return 0;
      }
      p += h.bulk_len;
      n -= (size_t)h.bulk_len;
      sv_job dj;
      memset(&dj, 0, sizeof dj);
      sv_session_defer(s, rid, body, rc, why, &dj.out, &dj.out_len);
      st->executed++;
      rc = dj.out ? check_reply(&dj, st) : 0;
      dsp_free(dj.out);
      if (rc < 0) return rc;
      continue;
    }
    if (rc < 0) return rc;
    p += h.msg_len;
    n -= h.msg_len;
    st->frames++;
    if (req->body_case == DSPWIRE__REQUEST__BODY_HELLO) {
      int major = (int)req->hello->major;
      unsigned minor = req->hello->minor;
      dspwire__request__free_unpacked(req, &sv_pb_allocator);
      if (major != DSP_PROTO_MAJOR) return DISPATCH_EVERSION;
      if (!*hello_done) s->peer_minor = minor; /* as sv_hello does */
      *hello_done = 1;
      continue;
    }
    sv_job *j = dsp_calloc(1, sizeof *j);
    if (!j) {
      dspwire__request__free_unpacked(req, &sv_pb_allocator);
      return DISPATCH_ENOMEM;
    }
    j->req = req;
    j->sess = s;
    if (sv_req_kind_of(req->body_case)->bulk)
      sv_upload_prepare(cfg, io_ctx, s, j, h.bulk_len, 0);
    if (n < h.bulk_len) {
      atomic_fetch_sub(&s->queued_bytes, (long long)j->upload_bytes);
      sv_job_free(j);
      st->truncated = 1;
      return 0;
    }
    if (j->upload && h.bulk_len)
      memcpy(j->upload_stage.host, p, (size_t)h.bulk_len);
    p += h.bulk_len;
    n -= (size_t)h.bulk_len;
    sv_session_exec(s, j);
    st->executed++;
    rc = j->out ? check_reply(j, st) : 0;
    int bye = j->is_bye;
    sv_job_free(j);
    if (rc < 0) return rc;
    if (bye) {
      st->bye = 1;
      return 0;
    }
  }
  return 0;
}
