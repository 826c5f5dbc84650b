/* Read snapshots by copy-on-write (see dsp.h). A pinned data block is
 * "attached" while it is still its storage's data; the first in-place
 * write after that copies the bytes to a fresh block, swaps the storage
 * to it and "detaches" the old block, which the pins then own. One mutex
 * guards the blocks: pins are rare (one per large Read in flight), and a
 * pin is released on another thread than the one that writes. Attached
 * blocks are found by their storage's address in a hash table, so many
 * reads in flight (a server's sessions each pipelining Reads) do not make
 * each pin or in-place write scan them all.
 *
 * That holds for a backend whose storage is host memory
 * (DSP_CAP_HOST_MEMORY, the CPU). For any other backend a pin is the
 * backend's own snapshot (stage_out: a GPU copies to pinned host memory
 * while the Read runs, in the session's order), detached from the start: no writer shares it. */
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "backend.h"
#include "dsp_internal.h"

typedef struct pin_block {
  struct pin_block *next; /* in its g_attached bucket while owner is set */
  dsp_storage *owner;     /* NULL once detached */
  void *data;
  size_t nbytes;
  const dsp_backend *backend;
  long pins;
  dsp_budget *budget; /* once detached: charged `charged` for the copy */
  uint64_t charged;
  int staged;   /* data is the backend's stage_out memory, not storage */
  void *token;  /* its stage_release token */
} pin_block;

struct dsp_pin {
  pin_block *b;
  dsp_tensor *keep; /* an alias: keeps the owner storage alive */
  atomic_long refs; /* holders of this pin (dsp_pin_retain) */
};

#define N_BUCKETS 4096u

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pin_block *g_attached[N_BUCKETS];
static atomic_long g_n_attached; /* lets unpinned writes skip the mutex */

static pin_block **bucket(const dsp_storage *s) {
  uintptr_t h = (uintptr_t)s;
  h ^= h >> 17;
  h *= (uintptr_t)0x9e3779b97f4a7c15ull;
  return &g_attached[(h >> 20) % N_BUCKETS];
}

static pin_block *find_locked(const dsp_storage *s) {
  for (pin_block *b = *bucket(s); b; b = b->next)
    if (b->owner == s) return b;
  return NULL;
}

static void unlink_locked(pin_block *b) {
  for (pin_block **pp = bucket(b->owner); *pp; pp = &(*pp)->next)
    if (*pp == b) {
      *pp = b->next;
      atomic_fetch_sub(&g_n_attached, 1);
      return;
    }
}

/* Drops one pin of b; at zero an attached block is forgotten and a
 * detached one's bytes are freed (outside the lock). */
static void unpin(pin_block *b) {
  void *free_data = NULL;
  const dsp_backend *be = b->backend;
  pthread_mutex_lock(&g_mu);
  int last = --b->pins == 0;
  if (last) {
    if (b->owner) unlink_locked(b);
    else free_data = b->data;
  }
  pthread_mutex_unlock(&g_mu);
  if (!last) return;
  if (b->staged) {
    be->stage_release(be->bctx, b->token);
  } else if (free_data) {
    be->free(be->bctx, free_data);
    dsp_budget_uncharge(b->budget, b->charged);
  }
  dsp_free(b);
}

int dsp_tensor_pin(dsp_ctx *ctx, dsp_tensor *t, dsp_pin **out) {
  *out = NULL;
  dsp_pin *p = dsp_calloc(1, sizeof *p);
  if (p) atomic_init(&p->refs, 1);
  pin_block *fresh = dsp_calloc(1, sizeof *fresh);
  if (!p || !fresh || dsp_tensor_alias(ctx, t, &t->meta, &p->keep) < 0) {
    dsp_free(p);
    dsp_free(fresh);
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "out of memory pinning a read");
  }
  dsp_storage *s = t->storage;
  if (!(s->backend->caps & DSP_CAP_HOST_MEMORY)) {
    const dsp_backend *be = s->backend;
    const void *host = NULL;
    void *token = NULL;
    int rc = be->stage_out(be->bctx, s->data, s->nbytes, &host, &token);
    if (rc < 0) {
      dsp_tensor_unref(p->keep);
      dsp_free(p);
      dsp_free(fresh);
      return dsp_seterr(ctx, rc, "staging %zu bytes of a read from backend "
                        "%s failed", s->nbytes, be->name);
    }
    *fresh = (pin_block){NULL, NULL, (void *)host, s->nbytes, be, 1, NULL, 0,
                         1, token};
    p->b = fresh;
    *out = p;
    return 0;
  }
  pthread_mutex_lock(&g_mu);
  pin_block *b = find_locked(s);
  if (!b) {
    pin_block **head = bucket(s);
    b = fresh;
    fresh = NULL;
    *b = (pin_block){*head, s, s->data, s->nbytes, s->backend, 0, NULL, 0,
                     0, NULL};
    *head = b;
    atomic_fetch_add(&g_n_attached, 1);
  }
  b->pins++;
  pthread_mutex_unlock(&g_mu);
  dsp_free(fresh);
  p->b = b;
  *out = p;
  return 0;
}

const void *dsp_pin_data(const dsp_pin *p) { return p->b->data; }

/* Only a staged block can still be landing; a failed part is sent as it
 * is (the copy's error is the device's, and surfaces in the session's
 * next wait). */
size_t dsp_pin_avail(const dsp_pin *p, size_t off, size_t want) {
  const pin_block *b = p->b;
  if (!want || !b->staged || !b->backend->stage_out_wait) return want;
  size_t end = b->backend->stage_out_wait(b->backend->bctx, b->token, off);
  if (end <= off) return want;
  return end - off < want ? end - off : want;
}
size_t dsp_pin_nbytes(const dsp_pin *p) { return p->b->nbytes; }

dsp_pin *dsp_pin_retain(dsp_pin *p) {
  if (p) atomic_fetch_add(&p->refs, 1);
  return p;
}

void dsp_pin_release(dsp_pin *p) {
  if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
  unpin(p->b);
  dsp_tensor_unref(p->keep);
  dsp_free(p);
}

/* The copy runs outside the lock with a pin of its own held, so a reader
 * releasing meanwhile never frees the bytes being copied. */
int dsp__storage_prepare_write(dsp_ctx *ctx, dsp_tensor *t) {
  if (atomic_load(&g_n_attached) == 0) return 0;
  dsp_storage *s = t->storage;
  pthread_mutex_lock(&g_mu);
  pin_block *b = find_locked(s);
  if (b) b->pins++;
  pthread_mutex_unlock(&g_mu);
  if (!b) return 0;
  /* the writer's session pays for the second block until the last read of
   * the old one is sent: a pipelined Read + Step holds both at once */
  uint64_t cost = DSP_BUDGET_COST(s->nbytes);
  int rc = dsp_budget_charge(ctx->budget, ctx, cost,
                             "copy of a tensor a read still sends");
  if (rc < 0) {
    unpin(b);
    return rc;
  }
  void *nd = NULL;
  rc = s->backend->alloc(s->backend->bctx, s->nbytes, 0, &nd);
  if (rc < 0) {
    dsp_budget_uncharge(ctx->budget, cost);
    unpin(b);
    return dsp_seterr(ctx, DISPATCH_ENOMEM,
                      "out of memory copying %zu bytes that a read still "
                      "sends",
                      s->nbytes);
  }
  /* b is attached, so the backend has DSP_CAP_HOST_MEMORY: its storage
   * is host memory and a memcpy is its own copy */
  if (s->nbytes) memcpy(nd, b->data, s->nbytes);
  pthread_mutex_lock(&g_mu);
  if (b->owner == s) {
    s->data = nd;
    s->cap = s->nbytes; /* the block may have been a larger reused one */
    unlink_locked(b);
    b->owner = NULL;
    b->budget = ctx->budget; /* the charge holds a reference on it */
    b->charged = cost;
    nd = NULL;
  }
  pthread_mutex_unlock(&g_mu);
  if (nd) { /* the last read finished meanwhile: no copy was needed */
    s->backend->free(s->backend->bctx, nd);
    dsp_budget_uncharge(ctx->budget, cost);
  }
  unpin(b);
  return 0;
}
