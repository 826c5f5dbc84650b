/* Staging: the tensor-level face of the backend table's stage_in /
 * commit_in / stage_release and copy_out, the only way the network layer
 * (and anything else outside a backend) moves a tensor's bytes. */
#include <string.h>

#include "backend.h"
#include "dsp_internal.h"

int dsp_tensor_stage_in(dsp_ctx *ctx, dsp_tensor *t, dsp_stage *st) {
  memset(st, 0, sizeof *st);
  const dsp_backend *be = t->storage->backend;
  size_t nbytes = dsp_tensor_nbytes(t);
  void *host = NULL, *token = NULL;
  int rc = be->stage_in(be->bctx, t->storage->data, nbytes, &host, &token);
  if (rc < 0)
    return dsp_seterr(ctx, rc, "staging %zu bytes for backend %s failed",
                      nbytes, be->name);
  st->host = host;
  st->nbytes = nbytes;
  st->t = dsp_tensor_ref(t);
  st->token = token;
  st->chunk = DSP_STAGE_CHUNK;
  return 0;
}

/* Parts start at multiples of st->chunk: committed only ever grows by a
 * whole part, except for the last one. */
void dsp_stage_progress(dsp_stage *st, size_t filled) {
  if (!st || !st->t || st->err) return;
  const dsp_backend *be = st->t->storage->backend;
  if (!be->commit_part) return;
  size_t chunk = st->chunk ? st->chunk : DSP_STAGE_CHUNK;
  if (filled > st->nbytes) filled = st->nbytes;
  while (st->committed < filled) {
    size_t n = filled - st->committed;
    if (n > chunk) n = chunk;
    else if (n < chunk && filled < st->nbytes) break; /* part not full yet */
    int rc = be->commit_part(be->bctx, st->t->storage->data, st->host,
                             st->committed, n, 0, st->token);
    if (rc < 0) {
      st->err = rc;
      return;
    }
    st->committed += n;
  }
}

int dsp_stage_commit(dsp_ctx *ctx, dsp_stage *st) {
  if (!st->t)
    return dsp_seterr(ctx, DISPATCH_EINVAL, "commit of a released staging");
  const dsp_backend *be = st->t->storage->backend;
  int rc;
  if (be->commit_part) {
    dsp_stage_progress(st, st->nbytes);
    rc = st->err ? st->err
                 : be->commit_part(be->bctx, st->t->storage->data, st->host,
                                   st->committed, 0, 1, st->token);
  } else {
    rc = be->commit_in(be->bctx, st->t->storage->data, st->host, st->nbytes,
                       st->token);
  }
  if (rc < 0)
    return dsp_seterr(ctx, rc, "moving %zu staged bytes into backend %s "
                      "failed", st->nbytes, be->name);
  return 0;
}

void dsp_stage_release(dsp_stage *st) {
  if (!st || !st->t) return;
  const dsp_backend *be = st->t->storage->backend;
  if (st->token) be->stage_release(be->bctx, st->token);
  dsp_tensor_unref(st->t);
  memset(st, 0, sizeof *st);
}

int dsp_tensor_write(dsp_ctx *ctx, dsp_tensor *t, const void *src,
                     size_t nbytes) {
  if (nbytes != dsp_tensor_nbytes(t))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "write: %zu bytes given for a tensor of %zu", nbytes,
                      dsp_tensor_nbytes(t));
  int rc = dsp__storage_prepare_write(ctx, t);
  dsp_stage st;
  if (rc == 0) rc = dsp_tensor_stage_in(ctx, t, &st);
  if (rc < 0) return rc;
  memcpy(st.host, src, nbytes);
  rc = dsp_stage_commit(ctx, &st);
  dsp_stage_release(&st);
  return rc;
}

int dsp_tensor_read(dsp_ctx *ctx, const dsp_tensor *t, void *dst,
                    size_t nbytes) {
  if (nbytes != dsp_tensor_nbytes(t))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "read: %zu bytes asked of a tensor of %zu", nbytes,
                      dsp_tensor_nbytes(t));
  if (!nbytes) return 0;
  const dsp_backend *be = t->storage->backend;
  int rc = be->copy_out(be->bctx, dst, t->storage->data, nbytes);
  if (rc < 0)
    return dsp_seterr(ctx, rc, "reading %zu bytes from backend %s failed",
                      nbytes, be->name);
  return 0;
}
