/* u64 -> pointer hash map for client-chosen ids (never pointers). */
#include <string.h>

#include "sv.h"

static size_t slot_of(uint64_t k, size_t cap) {
  /* splitmix64 finalizer: client ids are often sequential */
  k ^= k >> 30;
  k *= 0xbf58476d1ce4e5b9ULL;
  k ^= k >> 27;
  k *= 0x94d049bb133111ebULL;
  k ^= k >> 31;
  return (size_t)k & (cap - 1);
}

void sv_idmap_init(sv_idmap *m) { memset(m, 0, sizeof *m); }

void sv_idmap_clear(sv_idmap *m) {
  dsp_free(m->keys);
  dsp_free(m->vals);
  memset(m, 0, sizeof *m);
}

void *sv_idmap_get(const sv_idmap *m, uint64_t key) {
  if (m->cap == 0) return NULL;
  for (size_t i = slot_of(key, m->cap);; i = (i + 1) & (m->cap - 1)) {
    if (!m->vals[i]) return NULL;
    if (m->keys[i] == key) return m->vals[i];
  }
}

/* Grows to twice the capacity; on failure the old table is kept. */
static int grow(sv_idmap *m) {
  size_t ncap = m->cap ? m->cap * 2 : 16;
  uint64_t *nk = dsp_calloc(ncap, sizeof *nk);
  void **nv = dsp_calloc(ncap, sizeof *nv);
  if (!nk || !nv) {
    dsp_free(nk);
    dsp_free(nv);
    return DISPATCH_ENOMEM;
  }
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->vals[i]) continue;
    size_t j = slot_of(m->keys[i], ncap);
    while (nv[j]) j = (j + 1) & (ncap - 1);
    nk[j] = m->keys[i];
    nv[j] = m->vals[i];
  }
  dsp_free(m->keys);
  dsp_free(m->vals);
  m->keys = nk;
  m->vals = nv;
  m->cap = ncap;
  return 0;
}

int sv_idmap_put(sv_idmap *m, uint64_t key, void *val) {
  if (!val) return DISPATCH_EINVAL;
  if ((m->count + 1) * 4 > m->cap * 3) {
    int rc = grow(m);
    if (rc < 0) return rc;
  }
  size_t i = slot_of(key, m->cap);
  while (m->vals[i]) {
    if (m->keys[i] == key) return DISPATCH_EIDINUSE;
    i = (i + 1) & (m->cap - 1);
  }
  m->keys[i] = key;
  m->vals[i] = val;
  m->count++;
  return 0;
}

void *sv_idmap_del(sv_idmap *m, uint64_t key) {
  if (m->cap == 0) return NULL;
  size_t mask = m->cap - 1;
  size_t i = slot_of(key, m->cap);
  while (m->vals[i] && m->keys[i] != key) i = (i + 1) & mask;
  if (!m->vals[i]) return NULL;
  void *v = m->vals[i];
  /* backward shift: keep every later entry of the probe run reachable */
  size_t hole = i;
  for (size_t j = (i + 1) & mask; m->vals[j]; j = (j + 1) & mask) {
    size_t home = slot_of(m->keys[j], m->cap);
    /* move j into hole unless home lies cyclically in (hole, j] */
    int in_range = hole <= j ? (home > hole && home <= j)
                             : (home > hole || home <= j);
    if (!in_range) {
      m->keys[hole] = m->keys[j];
      m->vals[hole] = m->vals[j];
      hole = j;
    }
  }
  m->vals[hole] = NULL;
  m->keys[hole] = 0;
  m->count--;
  return v;
}
