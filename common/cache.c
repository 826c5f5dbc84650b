/* A budget's free lists (dsp_budget_set_cache): freed storages (struct
 * and data block together) in one list per size class, and freed tensor
 * headers in a stack, so a step that frees and makes tensors of the same
 * sizes again (a chain of ops, a training loop, repeated uploads) calls
 * neither malloc nor the kernel's page faults.
 *
 * Everything kept stays charged to the budget it was charged to, so a
 * session's lists count toward its quota; the budget gets them back when
 * a charge needs room (dsp__budget_relieve). The lists are bounded in
 * bytes of charge; storages also sit in one age order across classes,
 * and the oldest make room for a newer one. One lock: frees come from
 * any thread (a server's loop drops a read's reference after a worker
 * ran the op), and it is uncontended otherwise. It is a spinlock, one
 * atomic exchange to take and a store to drop, as the sections are a few
 * pointer moves (a mutex cost a LOCAL chain of small adds 4% against
 * plain malloc); a waiter yields its core after a short spin, so a
 * holder preempted on a busy machine is not starved.
 *
 * Under AddressSanitizer a kept data block and all of a kept header but
 * its link are poisoned, so a use after free still reports. */
#include <sched.h>
#include <stdatomic.h>
#include <string.h>

#include "dsp_internal.h"

/* Headers kept at most: one step's worth for a large graph. */
#define MAX_HEADERS 4096
#define HEADER_COST DSP_BUDGET_COST(sizeof(dsp_tensor))

struct dsp__cache {
  atomic_flag mu;
  uint64_t max_bytes;
  uint64_t bytes;             /* charge of everything kept */
  dsp_storage *cls[DSP__NCLASS]; /* newest first */
  dsp_storage *oldest, *newest;  /* age order over all classes */
  dsp_tensor *headers;           /* stack, linked through their first bytes */
  int n_headers;
  uint64_t hits, misses, evicted, released;
};

static void lock(dsp__cache *c) {
  for (int spins = 0;
       atomic_flag_test_and_set_explicit(&c->mu, memory_order_acquire);)
    if (++spins > 64) {
      sched_yield();
      spins = 0;
    }
}

static void unlock(dsp__cache *c) {
  atomic_flag_clear_explicit(&c->mu, memory_order_release);
}

dsp__cache *dsp__cache_new(void) {
  dsp__cache *c = dsp_calloc(1, sizeof *c);
  if (c) atomic_flag_clear(&c->mu);
  return c;
}

static dsp_tensor *hdr_next(dsp_tensor *t) {
  dsp_tensor *n;
  memcpy(&n, (void *)t, sizeof n);
  return n;
}

static void unlink_storage(dsp__cache *c, dsp_storage *s) {
  int k = dsp__size_class(s->cap);
  if (s->cprev) s->cprev->cnext = s->cnext;
  else c->cls[k] = s->cnext;
  if (s->cnext) s->cnext->cprev = s->cprev;
  if (s->lprev) s->lprev->lnext = s->lnext;
  else c->oldest = s->lnext;
  if (s->lnext) s->lnext->lprev = s->lprev;
  else c->newest = s->lprev;
  s->cprev = s->cnext = s->lprev = s->lnext = NULL;
  c->bytes -= s->charged;
  DSP_UNPOISON(s->data, s->cap);
}

/* Unlinks the oldest storages until `want` bytes of charge are out (or
 * none is left), onto *out (linked through lnext); returns the bytes. */
static uint64_t take_oldest(dsp__cache *c, uint64_t want, dsp_storage **out) {
  uint64_t got = 0;
  while (got < want && c->oldest) {
    dsp_storage *s = c->oldest;
    got += s->charged;
    unlink_storage(c, s);
    s->lnext = *out;
    *out = s;
  }
  return got;
}

static void destroy_list(dsp_storage *s) {
  while (s) {
    dsp_storage *n = s->lnext;
    s->lnext = NULL;
    dsp__storage_destroy(s);
    s = n;
  }
}

/* The four operations below with the lock held by the caller. */
static dsp_storage *take_storage(dsp__cache *c, const dsp_backend *be,
                                 size_t nbytes) {
  int k = dsp__size_class(nbytes);
  dsp_storage *s = c->cls[k];
  while (s && (s->backend != be || s->cap < nbytes)) s = s->cnext;
  if (s) {
    unlink_storage(c, s);
    c->hits++;
  } else {
    c->misses++;
  }
  return s;
}

/* 1 when kept; what had to go to make room is added to *drop */
static int put_storage(dsp__cache *c, dsp_storage *s, dsp_storage **drop) {
  if (s->charged > c->max_bytes) return 0;
  if (c->bytes + s->charged > c->max_bytes)
    c->evicted += take_oldest(c, c->bytes + s->charged - c->max_bytes, drop);
  if (c->bytes + s->charged > c->max_bytes) return 0;
  int k = dsp__size_class(s->cap);
  s->cprev = NULL;
  s->cnext = c->cls[k];
  if (s->cnext) s->cnext->cprev = s;
  c->cls[k] = s;
  s->lnext = NULL;
  s->lprev = c->newest;
  if (c->newest) c->newest->lnext = s;
  else c->oldest = s;
  c->newest = s;
  c->bytes += s->charged;
  DSP_POISON(s->data, s->cap);
  return 1;
}

static dsp_tensor *take_header(dsp__cache *c) {
  dsp_tensor *t = c->headers;
  if (t) {
    DSP_UNPOISON(t, sizeof *t);
    c->headers = hdr_next(t);
    c->n_headers--;
    c->bytes -= HEADER_COST;
  }
  return t;
}

static int put_header(dsp__cache *c, dsp_tensor *t) {
  if (c->n_headers >= MAX_HEADERS || c->bytes + HEADER_COST > c->max_bytes)
    return 0;
  memcpy((void *)t, &c->headers, sizeof c->headers);
  DSP_POISON((char *)t + sizeof(dsp_tensor *),
             sizeof *t - sizeof(dsp_tensor *));
  c->headers = t;
  c->n_headers++;
  c->bytes += HEADER_COST;
  return 1;
}

int dsp__cache_put_storage(dsp__cache *c, dsp_storage *s) {
  dsp_storage *drop = NULL;
  lock(c);
  int kept = put_storage(c, s, &drop);
  unlock(c);
  destroy_list(drop);
  return kept;
}

dsp_tensor *dsp__cache_take_header(dsp__cache *c) {
  lock(c);
  dsp_tensor *t = take_header(c);
  unlock(c);
  return t;
}

int dsp__cache_put_header(dsp__cache *c, dsp_tensor *t) {
  lock(c);
  int kept = put_header(c, t);
  unlock(c);
  return kept;
}

void dsp__cache_take_both(dsp__cache *c, const dsp_backend *be,
                          size_t nbytes, dsp_tensor **t, dsp_storage **s) {
  lock(c);
  *t = take_header(c);
  *s = be ? take_storage(c, be, nbytes) : NULL;
  unlock(c);
}

void dsp__cache_put_both(dsp__cache *c, dsp_tensor *t, dsp_storage *s,
                         int *t_kept, int *s_kept) {
  dsp_storage *drop = NULL;
  lock(c);
  *s_kept = put_storage(c, s, &drop);
  *t_kept = put_header(c, t);
  unlock(c);
  destroy_list(drop);
}

uint64_t dsp__cache_detach(dsp__cache *c, uint64_t want, dsp__cache_out *out) {
  lock(c);
  uint64_t got = take_oldest(c, want, &out->storages);
  while (got < want && c->headers) {
    dsp_tensor *t = c->headers;
    DSP_UNPOISON(t, sizeof *t);
    c->headers = hdr_next(t);
    c->n_headers--;
    c->bytes -= HEADER_COST;
    got += HEADER_COST;
    memcpy((void *)t, &out->headers, sizeof out->headers);
    out->headers = t;
  }
  c->released += got;
  unlock(c);
  return got;
}

void dsp__cache_out_free(dsp__cache_out *out) {
  destroy_list(out->storages);
  while (out->headers) {
    dsp_tensor *n = hdr_next(out->headers);
    dsp__header_destroy(out->headers);
    out->headers = n;
  }
  out->storages = NULL;
}

uint64_t dsp__cache_release(dsp__cache *c, uint64_t want) {
  dsp__cache_out out = {NULL, NULL};
  uint64_t got = dsp__cache_detach(c, want, &out);
  dsp__cache_out_free(&out);
  return got;
}

void dsp__cache_set_max(dsp__cache *c, uint64_t max_bytes) {
  lock(c);
  c->max_bytes = max_bytes;
  uint64_t over = c->bytes > max_bytes ? c->bytes - max_bytes : 0;
  unlock(c);
  /* what no longer fits goes now; a release is not pressure, so undo
   * its count */
  if (over) {
    uint64_t got = dsp__cache_release(c, max_bytes ? over : UINT64_MAX);
    lock(c);
    c->released -= got;
    c->evicted += got;
    unlock(c);
  }
}

void dsp__cache_stats(dsp__cache *c, dsp_cache_stats *out) {
  lock(c);
  *out = (dsp_cache_stats){c->hits,      c->misses,  c->bytes,
                           c->max_bytes, c->evicted, c->released};
  unlock(c);
}

void dsp__cache_free(dsp__cache *c) {
  if (!c) return;
  dsp__cache_release(c, UINT64_MAX);
  dsp_free(c);
}
