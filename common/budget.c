/* Memory budgets: a byte count with a limit, optionally inside a parent
 * budget (a server session inside the whole server), charged by every
 * allocation a ctx makes on behalf of its owner.
 *
 * Every successful charge also takes a reference on the budget and every
 * uncharge drops one, so an object charged to a budget (a storage freed on
 * another thread, a decoded request freed after its session ended) can
 * always uncharge it: the budget lives until its creator and every charged
 * object are gone. Counts are atomic; a charge that would pass a limit
 * changes nothing. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "dsp_internal.h"

struct dsp_budget {
  atomic_ullong used;
  atomic_long refs;
  uint64_t limit;
  dsp_budget *parent; /* one reference, dropped with this budget */
  char who[32];       /* "session" */
  char flag[40];      /* "--max-session-bytes" */
  /* free lists (dsp_budget_set_cache), set once, before the budget is
   * shared; NULL: none */
  dsp__cache *_Atomic cache;
  /* the children that have free lists, so a charge this budget refuses
   * can get their cached bytes back; reg_mu guards the list and the
   * children's reg_prev/reg_next */
  pthread_mutex_t reg_mu;
  dsp_budget *reg_head;
  dsp_budget *reg_prev, *reg_next;
  int registered;
};

dsp_budget *dsp_budget_new(uint64_t limit, dsp_budget *parent,
                           const char *who, const char *flag) {
  dsp_budget *b = dsp_calloc(1, sizeof *b);
  if (!b) return NULL;
  atomic_init(&b->used, 0);
  atomic_init(&b->refs, 1);
  b->limit = limit;
  pthread_mutex_init(&b->reg_mu, NULL);
  b->parent = dsp_budget_ref(parent);
  snprintf(b->who, sizeof b->who, "%s", who ? who : "budget");
  snprintf(b->flag, sizeof b->flag, "%s", flag ? flag : "limit");
  return b;
}

dsp_budget *dsp_budget_ref(dsp_budget *b) {
  if (b) atomic_fetch_add_explicit(&b->refs, 1, memory_order_relaxed);
  return b;
}

void dsp_budget_unref(dsp_budget *b) {
  while (b && atomic_fetch_sub_explicit(&b->refs, 1, memory_order_acq_rel) ==
                  1) {
    dsp_budget *p = b->parent;
    if (b->registered) {
      pthread_mutex_lock(&p->reg_mu);
      if (b->reg_prev) b->reg_prev->reg_next = b->reg_next;
      else p->reg_head = b->reg_next;
      if (b->reg_next) b->reg_next->reg_prev = b->reg_prev;
      pthread_mutex_unlock(&p->reg_mu);
    }
    /* empty: every kept object held a reference */
    dsp__cache_free(atomic_load(&b->cache));
    pthread_mutex_destroy(&b->reg_mu);
    dsp_free(b);
    b = p;
  }
}

uint64_t dsp_budget_used(const dsp_budget *b) {
  return b ? atomic_load(&((dsp_budget *)b)->used) : 0;
}

uint64_t dsp_budget_limit(const dsp_budget *b) {
  return b ? b->limit : UINT64_MAX;
}

/* b's own free lists count as room (a charge would get them back); other
 * budgets' lists are not summed here, so a hint may say no where the
 * charge itself, which gets those back too, would succeed. */
int dsp_budget_fits(const dsp_budget *b, uint64_t n) {
  dsp_cache_stats cs;
  dsp_budget_cache_stats(b, &cs);
  for (; b; b = b->parent) {
    uint64_t u = atomic_load(&((dsp_budget *)b)->used);
    u = u > cs.bytes ? u - cs.bytes : 0;
    if (n > b->limit || u > b->limit - n) return 0;
  }
  return 1;
}

dsp__cache *dsp__budget_cache(const dsp_budget *b) {
  return b ? atomic_load_explicit(&((dsp_budget *)b)->cache,
                                  memory_order_relaxed)
           : NULL;
}

/* The lists are made once and registered with the parent, which may then
 * reach them when it refuses a charge; later calls only move the bound. */
int dsp_budget_set_cache(dsp_budget *b, uint64_t max_bytes) {
  if (!b) return 0;
  dsp__cache *c = atomic_load(&b->cache);
  if (!c) {
    if (max_bytes == 0) return 0;
    c = dsp__cache_new();
    if (!c) return DISPATCH_ENOMEM;
    atomic_store(&b->cache, c);
    if (b->parent) {
      dsp_budget *p = b->parent;
      pthread_mutex_lock(&p->reg_mu);
      b->reg_next = p->reg_head;
      if (p->reg_head) p->reg_head->reg_prev = b;
      p->reg_head = b;
      b->registered = 1;
      pthread_mutex_unlock(&p->reg_mu);
    }
  }
  dsp__cache_set_max(c, max_bytes);
  return 0;
}

void dsp_budget_cache_stats(const dsp_budget *b, dsp_cache_stats *out) {
  dsp__cache *c = dsp__budget_cache(b);
  if (c) dsp__cache_stats(c, out);
  else memset(out, 0, sizeof *out);
}

uint64_t dsp_budget_release_cached(dsp_budget *b, uint64_t want) {
  dsp__cache *c = dsp__budget_cache(b);
  return c ? dsp__cache_release(c, want) : 0;
}

/* The children's entries are taken out while reg_mu is held (so none of
 * them can unregister and be freed meanwhile) and freed after it is
 * dropped: freeing one uncharges its budget, which may drop that budget's
 * last reference (its owner left meanwhile), and freeing a budget takes
 * its parent's reg_mu. */
static uint64_t relieve_children(dsp_budget *p, uint64_t want) {
  uint64_t got = 0;
  dsp__cache_out out = {NULL, NULL};
  pthread_mutex_lock(&p->reg_mu);
  for (dsp_budget *k = p->reg_head; k && got < want; k = k->reg_next)
    got += dsp__cache_detach(atomic_load(&k->cache), want - got, &out);
  pthread_mutex_unlock(&p->reg_mu);
  dsp__cache_out_free(&out);
  return got;
}

uint64_t dsp__budget_relieve(dsp_budget *b, const dsp_budget *stop,
                             uint64_t want) {
  uint64_t got = 0;
  for (dsp_budget *q = b; q && got < want; q = q->parent) {
    dsp__cache *c = atomic_load(&q->cache);
    if (c) got += dsp__cache_release(c, want - got);
    if (q->reg_head && got < want) got += relieve_children(q, want - got);
    if (q == stop) break;
  }
  return got;
}

/* Adds n to b and each parent in turn; the first that would pass its
 * limit undoes what was added and, if free lists under it hold enough of
 * what it is missing, gets that back and tries once more; else it names
 * itself in the error. */
int dsp_budget_charge_why(dsp_budget *b, uint64_t n, const char *what,
                          char *why, size_t why_len) {
  int rc = dsp_budget_charge_held(b, n, what, why, why_len);
  if (rc == 0) dsp_budget_ref(b);
  return rc;
}

int dsp_budget_charge_held(dsp_budget *b, uint64_t n, const char *what,
                           char *why, size_t why_len) {
  if (!b) return 0;
  int retried = 0;
retry:
  for (dsp_budget *p = b; p; p = p->parent) {
    uint64_t old = atomic_fetch_add(&p->used, n);
    if (n > p->limit || old > p->limit - n) {
      atomic_fetch_sub(&p->used, n);
      for (dsp_budget *q = b; q != p; q = q->parent)
        atomic_fetch_sub(&q->used, n);
      if (!retried && n <= p->limit) {
        retried = 1;
        uint64_t over = old + n - p->limit;
        if (dsp__budget_relieve(b, p, over) > 0) goto retry;
      }
      if (why && why_len)
        snprintf(why, why_len,
                 "%s: %s holds %llu bytes; %llu more would pass its limit "
                 "of %llu bytes (%s)",
                 what ? what : "allocation", p->who, (unsigned long long)old,
                 (unsigned long long)n, (unsigned long long)p->limit,
                 p->flag);
      return DISPATCH_EQUOTA;
    }
  }
  return 0;
}

int dsp_budget_charge(dsp_budget *b, dsp_ctx *ctx, uint64_t n,
                      const char *what) {
  return dsp_budget_charge_why(b, n, what, ctx ? ctx->err : NULL,
                               ctx ? sizeof ctx->err : 0);
}

void dsp_budget_uncharge_part(dsp_budget *b, uint64_t n) {
  for (dsp_budget *p = b; p; p = p->parent) atomic_fetch_sub(&p->used, n);
}

void dsp_budget_uncharge(dsp_budget *b, uint64_t n) {
  if (!b) return;
  for (dsp_budget *p = b; p; p = p->parent) atomic_fetch_sub(&p->used, n);
  dsp_budget_unref(b);
}

void dsp_ctx_set_budget(dsp_ctx *ctx, dsp_budget *b) {
  dsp_budget *old = ctx->budget;
  ctx->budget = dsp_budget_ref(b);
  dsp_budget_unref(old);
}

dsp_budget *dsp_ctx_budget(const dsp_ctx *ctx) { return ctx->budget; }

int dsp__scratch_alloc(dsp_ctx *ctx, size_t n, const char *what,
                       void **out) {
  *out = NULL;
  uint64_t cost = DSP_BUDGET_COST(n);
  int rc = dsp_budget_charge(ctx->budget, ctx, cost, what);
  if (rc < 0) return rc;
  *out = dsp_malloc(n);
  if (!*out) {
    dsp_budget_uncharge(ctx->budget, cost);
    return dsp_seterr(ctx, DISPATCH_ENOMEM, "%s: out of memory for %zu bytes",
                      what, n);
  }
  return 0;
}

void dsp__scratch_free(dsp_ctx *ctx, void *p, size_t n) {
  if (!p) return;
  dsp_free(p);
  dsp_budget_uncharge(ctx->budget, DSP_BUDGET_COST(n));
}
