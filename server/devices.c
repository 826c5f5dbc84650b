/* The server's devices: parsing --device, opening each through a small
 * table of kinds, and their per-device memory budgets. */
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_plugin.h"
#include "sv.h"

/* Opens device `index` of a kind: 0 with *out, or a negative code with a
 * one-line reason in why. */
typedef int (*dev_open_fn)(int index, dsp_backend **out, char *why,
                           size_t len);
/* How many devices of the kind this host has (for --device all). */
typedef int (*dev_count_fn)(void);

static int cpu_open(int index, dsp_backend **out, char *why, size_t len) {
  char id[32];
  snprintf(id, sizeof id, "cpu:%d", index);
  *out = dsp_cpu_backend_new(id);
  if (!*out) {
    snprintf(why, len, "out of memory opening %s", id);
    return DISPATCH_ENOMEM;
  }
  return 0;
}

static int cpu_count(void) { return 1; }

/* The CUDA backend is the plugin dispatch-cuda.so (common/cuda_plugin.h),
 * loaded at the first CUDA device asked for: this binary links no CUDA
 * library, and serves cpu devices on a host without the plugin or a GPU. */
static const dsp_cuda_plugin *g_cuda;

static int cuda_open(int index, dsp_backend **out, char *why, size_t len) {
  char reason[1536] = "";
  int rc = dsp_cuda_plugin_open(index, &g_cuda, out, reason, sizeof reason);
  if (rc < 0) snprintf(why, len, "--device cuda:%d: %s", index, reason);
  return rc;
}

/* A GPU holds no more than its memory: without --device-memory that is
 * its budget, and what the hello reports as its total (not --max-memory,
 * which bounds all devices together). Only a device cuda_open opened
 * reaches these, so g_cuda is set. */
static uint64_t cuda_total(const dsp_backend *be) {
  return g_cuda->total_memory(be);
}

static void cuda_close(dsp_backend *be) { g_cuda->backend_close(be); }

/* --device all: every GPU the plugin sees, none without the plugin or a
 * usable GPU (then all is cpu:0); what was found is kept for the log
 * (sv_devices_note). */
static char g_note[2048];
static int cuda_count(void) {
  return dsp_cuda_plugin_describe(g_note, sizeof g_note);
}

const char *sv_devices_note(void) { return g_note; }

static int cuda_session_open(dsp_backend *be, dsp_backend **out, char *why,
                             size_t len) {
  return g_cuda->session_open(be, out, why, len);
}
static void cuda_session_close(dsp_backend *view) {
  g_cuda->session_close(view);
}

static const struct dev_kind {
  const char *kind;
  dev_open_fn open;
  void (*close)(dsp_backend *be);
  dev_count_fn count;
  int (*session_open)(dsp_backend *be, dsp_backend **out, char *why,
                      size_t len);
  void (*session_close)(dsp_backend *view);
  /* the device's own memory, 0: none of its own (host memory) */
  uint64_t (*total)(const dsp_backend *be);
} g_kinds[] = {
    {"cpu", cpu_open, dsp_cpu_backend_free, cpu_count, NULL, NULL, NULL},
    {"cuda", cuda_open, cuda_close, cuda_count, cuda_session_open,
     cuda_session_close, cuda_total},
};
#define N_KINDS (sizeof g_kinds / sizeof g_kinds[0])

/* Splits "kind" or "kind:N" (N in 0..999). 0, or -1 when malformed. */
static int parse_name(const char *s, char *kind, size_t klen, int *index) {
  const char *colon = strchr(s, ':');
  size_t n = colon ? (size_t)(colon - s) : strlen(s);
  if (n == 0 || n >= klen) return -1;
  memcpy(kind, s, n);
  kind[n] = '\0';
  *index = 0;
  if (!colon) return 0;
  const char *d = colon + 1;
  if (!*d || strlen(d) > 3) return -1;
  for (const char *p = d; *p; p++)
    if (*p < '0' || *p > '9') return -1;
  *index = atoi(d);
  return 0;
}

static const struct dev_kind *kind_of(const char *k) {
  for (size_t i = 0; i < N_KINDS; i++)
    if (strcmp(g_kinds[i].kind, k) == 0) return &g_kinds[i];
  return NULL;
}

static int add_device(const sv_config *cfg, sv_global *g,
                      const struct dev_kind *k, int index, char *why,
                      size_t len) {
  char name[32];
  snprintf(name, sizeof name, "%s:%d", k->kind, index);
  if (sv_device_find(g, name)) {
    snprintf(why, len, "--device %s: given twice", name);
    return DISPATCH_EINVAL;
  }
  if (g->n_devices == SV_MAX_DEVICES) {
    snprintf(why, len, "--device %s: at most %d devices", name,
             SV_MAX_DEVICES);
    return DISPATCH_ELIMIT;
  }
  sv_device *d = &g->devices[g->n_devices];
  memset(d, 0, sizeof *d);
  int rc = k->open(index, &d->be, why, len);
  if (rc < 0) return rc;
  char who[40];
  snprintf(who, sizeof who, "device %s", name);
  /* without --device-memory a host-memory device is counted but only
   * --max-memory (every session's budget's parent) limits it, so the
   * server-wide refusal keeps its own message; a GPU is also bounded by
   * its own memory */
  uint64_t own = k->total ? k->total(d->be) : 0;
  uint64_t limit = cfg->device_memory ? cfg->device_memory
                   : own              ? own
                                      : UINT64_MAX;
  d->total = cfg->device_memory ? cfg->device_memory
             : own              ? own
                                : cfg->max_memory;
  d->mem = dsp_budget_new(limit, NULL, who, "--device-memory");
  if (!d->mem) {
    k->close(d->be);
    snprintf(why, len, "out of memory opening %s", name);
    return DISPATCH_ENOMEM;
  }
  dsp_backend_set_device(d->be, d->name, d->mem);
  snprintf(d->name, sizeof d->name, "%s", name);
  d->kind = k->kind;
  d->close = k->close;
  d->session_open = k->session_open;
  d->session_close = k->session_close;
  g->n_devices++;
  return 0;
}

int sv_devices_open(const sv_config *cfg, sv_global *g, char *why,
                    size_t len) {
  g->devices = dsp_calloc(SV_MAX_DEVICES, sizeof *g->devices);
  g->n_devices = 0;
  if (!g->devices) {
    snprintf(why, len, "out of memory opening devices");
    return DISPATCH_ENOMEM;
  }
  static const char *const dflt[] = {"cpu"};
  const char *const *list = cfg->n_devices ? cfg->devices : dflt;
  int n = cfg->n_devices ? cfg->n_devices : 1;
  int rc = 0;
  for (int i = 0; i < n && rc == 0; i++) {
    if (strcmp(list[i], "all") == 0) {
      for (size_t k = 0; k < N_KINDS && rc == 0; k++)
        for (int j = 0, nk = g_kinds[k].count(); j < nk && rc == 0; j++) {
          char name[32];
          snprintf(name, sizeof name, "%s:%d", g_kinds[k].kind, j);
          if (!sv_device_find(g, name))
            rc = add_device(cfg, g, &g_kinds[k], j, why, len);
        }
      continue;
    }
    char kind[16];
    int index;
    const struct dev_kind *k = NULL;
    if (parse_name(list[i], kind, sizeof kind, &index) < 0 ||
        !(k = kind_of(kind))) {
      snprintf(why, len, "--device %.64s: expected cpu, cpu:N, cuda:N or "
               "all", list[i]);
      rc = DISPATCH_EINVAL;
      break;
    }
    rc = add_device(cfg, g, k, index, why, len);
  }
  if (rc < 0) sv_devices_close(g);
  return rc;
}

void sv_devices_close(sv_global *g) {
  if (!g->devices) return;
  for (int i = 0; i < g->n_devices; i++) {
    g->devices[i].close(g->devices[i].be);
    dsp_budget_unref(g->devices[i].mem);
  }
  dsp_free(g->devices);
  g->devices = NULL;
  g->n_devices = 0;
}

const sv_device *sv_device_find(const sv_global *g, const char *name) {
  if (!g->devices || !name) return NULL;
  char kind[16];
  int index;
  if (parse_name(name, kind, sizeof kind, &index) < 0) return NULL;
  int bare = strchr(name, ':') == NULL;
  for (int i = 0; i < g->n_devices; i++) {
    const sv_device *d = &g->devices[i];
    if (bare ? strcmp(d->kind, kind) == 0 : strcmp(d->name, name) == 0)
      return d;
  }
  return NULL;
}

void sv_device_names(const sv_global *g, char *buf, size_t len) {
  size_t k = 0;
  buf[0] = '\0';
  for (int i = 0; g->devices && i < g->n_devices && k + 1 < len; i++) {
    int w = snprintf(buf + k, len - k, "%s%s", i ? ", " : "",
                     g->devices[i].name);
    if (w < 0) break;
    k += (size_t)w;
  }
}

size_t sv_device_infos(const sv_global *g, Dspwire__DeviceInfo *infos,
                       Dspwire__DeviceInfo **ptrs) {
  size_t n = 0;
  for (int i = 0; g->devices && i < g->n_devices; i++, n++) {
    const sv_device *d = &g->devices[i];
    Dspwire__DeviceInfo init = DSPWIRE__DEVICE_INFO__INIT;
    infos[n] = init;
    infos[n].kind = (char *)d->kind;
    infos[n].name = (char *)d->name;
    infos[n].description = (char *)dsp_backend_description(d->be);
    uint64_t lim = d->total, used = dsp_budget_used(d->mem);
    infos[n].total_memory = lim;
    infos[n].free_memory = used < lim ? lim - used : 0;
    ptrs[n] = &infos[n];
  }
  return n;
}

/* Lock-free install: the loop (an upload, the hello) and the worker (an
 * op naming the device, a move) may both be first; the loser gives its
 * view straight back. */
int sv_session_backend(sv_session *s, const sv_device *d,
                       const dsp_backend **out, char *why, size_t len) {
  if (!d->session_open) {
    *out = d->be;
    return 0;
  }
  const sv_global *g = s->global;
  ptrdiff_t i = d - g->devices;
  if (!g->devices || i < 0 || i >= g->n_devices) {
    snprintf(why, len, "device %s is not one of this server's", d->name);
    return DISPATCH_EINTERNAL;
  }
  dsp_backend *v = atomic_load(&s->views[i]);
  if (v) {
    *out = v;
    return 0;
  }
  char reason[256] = "";
  int rc = d->session_open(d->be, &v, reason, sizeof reason);
  if (rc < 0 || !v) {
    snprintf(why, len, "opening a session on %s: %s", d->name, reason);
    return rc < 0 ? rc : DISPATCH_EINTERNAL;
  }
  dsp_backend *none = NULL;
  if (!atomic_compare_exchange_strong(&s->views[i], &none, v)) {
    d->session_close(v);
    v = none;
  }
  *out = v;
  return 0;
}

int sv_session_use_device(sv_session *s, const sv_device *d, char *why,
                          size_t len) {
  const dsp_backend *be;
  int rc = sv_session_backend(s, d, &be, why, len);
  if (rc < 0) return rc;
  s->device = be;
  dsp_ctx_set_backend(s->ctx, be);
  return 0;
}

void sv_session_backends_close(sv_session *s) {
  const sv_global *g = s->global;
  for (int i = 0; g && g->devices && i < g->n_devices; i++) {
    dsp_backend *v = atomic_exchange(&s->views[i], NULL);
    if (v) g->devices[i].session_close(v);
  }
}
