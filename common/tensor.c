/* Reference-counted tensors over reference-counted contiguous storage.
 * Headers and storage are charged to the creating ctx's budget (if any)
 * before anything is allocated and uncharged when freed. */
#include <string.h>

#include "backend.h"
#include "dsp_internal.h"

/* The header, the data block and the backend's block header (16 bytes on
 * the CPU backend). */
static uint64_t storage_cost(size_t nbytes) {
  return DSP_BUDGET_COST(sizeof(dsp_storage)) + DSP_BUDGET_COST(nbytes) + 16;
}

/* Storage on backend be, charged first to be's device budget and then to
 * the ctx's (session) budget, both or neither. The device's charge takes
 * no budget reference (dsp_budget_charge_held): a storage cannot outlive
 * its backend, whose free function it calls, and the device budget lives
 * as long as the backend (dsp_backend.mem). A storage of be from the
 * ctx budget's free lists is still charged to that budget (for the block
 * it holds, which may be up to a size class larger than nbytes) but not
 * to the device, which counts live tensors only: it is charged there
 * again, and freed if the device refuses, so the refusal below names the
 * device as without the lists. Only host memory is kept in the lists, as
 * only host memory can be zeroed here. */
static int storage_new(dsp_ctx *ctx, const dsp_backend *be, size_t nbytes,
                       int zero, dsp_storage *s, dsp_storage **out) {
  /* s: the caller's candidate from the lists (dsp__cache_take_both) */
  if (s) {
    if (dsp_budget_charge_held(be->mem, s->charged, NULL, NULL, 0) == 0) {
      s->dev_budget = be->mem;
      s->refcount = 1;
      s->nbytes = nbytes;
      if (zero && nbytes) memset(s->data, 0, nbytes);
      *out = s;
      return 0;
    }
    dsp__storage_destroy(s);
  }
  uint64_t cost = storage_cost(nbytes);
  int rc = dsp_budget_charge_held(be->mem, cost, "tensor storage", ctx->err,
                                  sizeof ctx->err);
  if (rc < 0) return rc;
  rc = dsp_budget_charge(ctx->budget, ctx, cost, "tensor storage");
  if (rc < 0) {
    dsp_budget_uncharge_part(be->mem, cost);
    return rc;
  }
  s = dsp_malloc(sizeof *s);
  if (!s) {
    dsp_budget_uncharge(ctx->budget, cost);
    dsp_budget_uncharge_part(be->mem, cost);
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "out of memory (storage)");
  }
  s->refcount = 1;
  s->nbytes = nbytes;
  s->backend = be;
  s->data = NULL;
  s->budget = ctx->budget;
  s->charged = cost;
  s->dev_budget = be->mem;
  s->cap = nbytes;
  s->cprev = s->cnext = s->lprev = s->lnext = NULL;
  rc = be->alloc(be->bctx, nbytes, zero, &s->data);
  if (rc < 0) {
    dsp_free(s);
    dsp_budget_uncharge(ctx->budget, cost);
    dsp_budget_uncharge_part(be->mem, cost);
    return dsp_seterr(ctx, rc, "out of memory allocating %zu bytes", nbytes);
  }
  *out = s;
  return 0;
}

void dsp__storage_destroy(dsp_storage *s) {
  s->backend->free(s->backend->bctx, s->data);
  dsp_budget *b = s->budget, *db = s->dev_budget;
  uint64_t cost = s->charged;
  dsp_free(s);
  dsp_budget_uncharge(b, cost);
  dsp_budget_uncharge_part(db, cost);
}

/* The last reference hands the storage to its budget's free lists when
 * they keep it (still charged), else frees it. */
/* The lists a storage whose last reference went may go to (NULL: none). */
static dsp__cache *storage_cache(const dsp_storage *s) {
  return (s->backend->caps & DSP_CAP_HOST_MEMORY) ? dsp__budget_cache(s->budget) : NULL;
}

/* Drops one reference; 1 when it was the last. atomic: a server's loop
 * thread drops its reference to a storage it writes to the socket while a
 * worker may alias the same storage */
static int storage_release(dsp_storage *s) {
  return s && __atomic_sub_fetch(&s->refcount, 1, __ATOMIC_ACQ_REL) == 0;
}

static void storage_unref(dsp_storage *s) {
  if (!storage_release(s)) return;
  dsp__cache *c = storage_cache(s);
  if (c) { /* the device counts live tensors only (storage_new) */
    dsp_budget_uncharge_part(s->dev_budget, s->charged);
    s->dev_budget = NULL;
    if (dsp__cache_put_storage(c, s)) return;
  }
  dsp__storage_destroy(s);
}

void dsp__header_destroy(dsp_tensor *t) {
  dsp_budget *b = t->budget;
  dsp_free(t);
  dsp_budget_uncharge(b, DSP_BUDGET_COST(sizeof *t));
}

static void tensor_free_shell(dsp_tensor *t) {
  dsp__cache *c = dsp__budget_cache(t->budget);
  if (c && dsp__cache_put_header(c, t)) return;
  dsp__header_destroy(t);
}

/* A header of numel elements of meta m: t, one the caller took from the
 * ctx budget's free lists (charged already), or NULL for a new one. */
static int tensor_shell(dsp_ctx *ctx, const dsp_meta *m, int64_t numel,
                        dsp_tensor *t, dsp_tensor **out) {
  int rc;
  if (t) {
    memset(t, 0, sizeof *t);
  } else {
    rc = dsp_budget_charge(ctx->budget, ctx,
                           DSP_BUDGET_COST(sizeof(dsp_tensor)), "tensor");
    if (rc < 0) return rc;
    t = dsp_calloc(1, sizeof *t);
  }
  if (!t) {
    dsp_budget_uncharge(ctx->budget, DSP_BUDGET_COST(sizeof(dsp_tensor)));
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "out of memory (tensor)");
  }
  t->refcount = 1;
  t->budget = ctx->budget;
  t->meta = *m;
  for (int i = m->ndim; i < DSP_MAX_DIMS; i++) t->meta.shape[i] = 0;
  t->numel = numel;
  *out = t;
  return 0;
}

int dsp__tensor_new_on(dsp_ctx *ctx, const dsp_backend *be, const dsp_meta *m,
                       int zero, dsp_tensor **out) {
  *out = NULL;
  int64_t numel;
  int rc = dsp_meta_numel(ctx, m, &numel);
  if (rc < 0) return rc;
  size_t nbytes = (size_t)numel * dsp_dtype_size(m->dtype);
  /* header and storage from the lists under one lock (a small op's
   * tensor took it twice, and gave it back twice) */
  dsp__cache *c = dsp__budget_cache(ctx->budget);
  dsp_tensor *ct = NULL, *t;
  dsp_storage *cs = NULL;
  if (c) dsp__cache_take_both(c, (be->caps & DSP_CAP_HOST_MEMORY) ? be : NULL, nbytes, &ct, &cs);
  rc = tensor_shell(ctx, m, numel, ct, &t);
  if (rc < 0) {
    if (cs && !dsp__cache_put_storage(c, cs)) dsp__storage_destroy(cs);
    return rc;
  }
  rc = storage_new(ctx, be, nbytes, zero, cs, &t->storage);
  if (rc < 0) {
    tensor_free_shell(t);
    return rc;
  }
  *out = t;
  return 0;
}

int dsp_tensor_new(dsp_ctx *ctx, const dsp_meta *m, dsp_tensor **out) {
  return dsp__tensor_new_on(ctx, ctx->backend, m, 1, out);
}

int dsp_tensor_new_uninit(dsp_ctx *ctx, const dsp_meta *m, dsp_tensor **out) {
  return dsp__tensor_new_on(ctx, ctx->backend, m, 0, out);
}

/* The bytes go source storage -> (source's stage_out) host memory ->
 * (destination's stage_in/commit_in) destination storage; between two CPU
 * devices both stagings are the storages themselves and the move is one
 * memcpy. */
int dsp_tensor_to_backend(dsp_ctx *ctx, const dsp_tensor *t,
                          const dsp_backend *be, dsp_tensor **out) {
  *out = NULL;
  dsp_tensor *nt;
  int rc = dsp__tensor_new_on(ctx, be, &t->meta, 0, &nt);
  if (rc < 0) return rc;
  size_t n = dsp_tensor_nbytes(t);
  if (n == 0) {
    *out = nt;
    return 0;
  }
  const dsp_backend *src = t->storage->backend;
  const void *host = NULL;
  void *token = NULL;
  rc = src->stage_out(src->bctx, t->storage->data, n, &host, &token);
  if (rc < 0) {
    dsp_tensor_unref(nt);
    return dsp_seterr(ctx, rc, "move to %s: staging %zu bytes out of %s "
                      "failed", dsp_backend_id(be), n, dsp_backend_id(src));
  }
  dsp_stage st;
  rc = dsp_tensor_stage_in(ctx, nt, &st);
  /* a source that lands its copy in parts (stage_out_wait) is taken part
   * by part, each handed on to the destination while the next lands */
  for (size_t off = 0; rc == 0 && off < n;) {
    size_t end = src->stage_out_wait
                     ? src->stage_out_wait(src->bctx, token, off) : n;
    if (end <= off || end > n) {
      rc = dsp_seterr(ctx, DISPATCH_EINTERNAL, "move to %s: copying %zu "
                      "bytes out of %s failed", dsp_backend_id(be), n,
                      dsp_backend_id(src));
      break;
    }
    memcpy((char *)st.host + off, (const char *)host + off, end - off);
    off = end;
    dsp_stage_progress(&st, off);
  }
  if (rc == 0) rc = dsp_stage_commit(ctx, &st);
  dsp_stage_release(&st);
  if (token) src->stage_release(src->bctx, token);
  if (rc < 0) {
    dsp_tensor_unref(nt);
    return rc;
  }
  *out = nt;
  return 0;
}

int dsp_tensor_from_data(dsp_ctx *ctx, const dsp_meta *m, const void *data,
                         size_t nbytes, dsp_tensor **out) {
  *out = NULL;
  dsp_tensor *t;
  int rc = dsp_tensor_new_uninit(ctx, m, &t);
  if (rc < 0) return rc;
  if (nbytes != t->storage->nbytes) {
    size_t need = t->storage->nbytes;
    dsp_tensor_unref(t);
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "tensor data: got %zu bytes, shape needs %zu", nbytes,
                      need);
  }
  if (m->dtype == DSP_BOOL && (rc = dsp_check_bool_bytes(ctx, data, nbytes)) < 0) {
    dsp_tensor_unref(t);
    return rc;
  }
  if (nbytes) {
    rc = ctx->backend->copy_in(ctx->backend->bctx, t->storage->data, data,
                               nbytes);
    if (rc < 0) {
      dsp_tensor_unref(t);
      return dsp_seterr(ctx, rc, "tensor data: copy failed");
    }
  }
  *out = t;
  return 0;
}

int dsp_tensor_alias(dsp_ctx *ctx, const dsp_tensor *src, const dsp_meta *m,
                     dsp_tensor **out) {
  *out = NULL;
  dsp_tensor *t;
  int64_t numel;
  int rc = dsp_meta_numel(ctx, m, &numel);
  if (rc < 0) return rc;
  dsp__cache *c = dsp__budget_cache(ctx->budget);
  rc = tensor_shell(ctx, m, numel, c ? dsp__cache_take_header(c) : NULL, &t);
  if (rc < 0) return rc;
  if (t->numel != src->numel || m->dtype != src->meta.dtype) {
    tensor_free_shell(t);
    return dsp_seterr(ctx, DISPATCH_ESHAPE,
                      "alias: %lld elements of %s cannot view %lld of %s",
                      (long long)src->numel, dsp_dtype_name(src->meta.dtype),
                      (long long)t->numel, dsp_dtype_name(m->dtype));
  }
  t->storage = src->storage;
  __atomic_fetch_add(&t->storage->refcount, 1, __ATOMIC_RELAXED);
  *out = t;
  return 0;
}

/* Set by the autodiff engine before its first node; read by every thread
 * that frees a tracked tensor, which was handed that tensor after the node
 * was made (so after the store). */
static dsp__node_release_fn g_node_release;

void dsp__tensor_set_node_release(dsp__node_release_fn fn) {
  /* stored once: every node made after it only reads the shared line */
  if (__atomic_load_n(&g_node_release, __ATOMIC_ACQUIRE) != fn)
    __atomic_store_n(&g_node_release, fn, __ATOMIC_RELEASE);
}

dsp_tensor *dsp_tensor_ref(dsp_tensor *t) {
  if (t) t->refcount++;
  return t;
}

void dsp_tensor_unref(dsp_tensor *t) {
  if (!t || --t->refcount > 0) return;
  if (t->node) __atomic_load_n(&g_node_release, __ATOMIC_ACQUIRE)(t->node);
  dsp_storage *s = t->storage;
  dsp__cache *c = dsp__budget_cache(t->budget);
  /* the common end of a small op's result: its storage's last reference,
   * both to the same lists, under one lock */
  if (c && s && storage_cache(s) == c) {
    if (!storage_release(s)) { /* another tensor still views it */
      tensor_free_shell(t);
      return;
    }
    dsp_budget_uncharge_part(s->dev_budget, s->charged); /* storage_unref */
    s->dev_budget = NULL;
    int t_kept, s_kept;
    dsp__cache_put_both(c, t, s, &t_kept, &s_kept);
    if (!s_kept) dsp__storage_destroy(s);
    if (!t_kept) dsp__header_destroy(t);
    return;
  }
  storage_unref(s);
  tensor_free_shell(t);
}

size_t dsp_tensor_nbytes(const dsp_tensor *t) {
  return (size_t)t->numel * dsp_dtype_size(t->meta.dtype);
}
