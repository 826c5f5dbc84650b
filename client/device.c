/* Devices (open from a spec string, close), error detail, scopes, stats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

/* The library's version, from dispatch_version.h as it was built (a
 * program compiled against another header sees the difference between
 * this and DISPATCH_VERSION). */
const char *dispatch_version(void) { return DISPATCH_VERSION; }

void dispatch_options_init(dispatch_options *opts) {
  if (!opts) return;
  memset(opts, 0, sizeof *opts);
  opts->size = sizeof *opts;
}

/* The first error of the device whose call failed last on this thread: a
 * call whose inputs are all NULL names no device, yet must answer with the
 * error that left it a NULL. A copy, not a pointer, so a device closed on
 * another thread leaves nothing dangling here. */
static _Thread_local struct {
  int code;
  uint64_t serial;
  char msg[512];
} t_last;
static _Atomic uint64_t g_serial;

static void note_thread(const dispatch_device *dev) {
  t_last.code = dev->first_code;
  t_last.serial = dev->serial;
  memcpy(t_last.msg, dev->first_msg, sizeof t_last.msg);
}

int dispatch__ret(dispatch_device *dev, int rc) {
  if (!dev || rc >= 0) return rc;
  dev->errcode = rc;
  /* a wait that timed out failed nothing: the request stays queued */
  if (!dev->first_code && rc != DISPATCH_ETIMEDOUT) {
    const char *m = dsp_ctx_errmsg(dev->ctx);
    dev->first_code = rc;
    snprintf(dev->first_msg, sizeof dev->first_msg, "%s",
             *m ? m : dispatch_strerror(rc));
  }
  note_thread(dev);
  return rc;
}

/* Answering with the first error makes it the last one too, so errcode and
 * errmsg always describe the code the latest failing call returned. */
int dispatch__null_input(dispatch_device *dev, const char *fn, int i) {
  if (!dev) return t_last.code ? t_last.code : DISPATCH_EINVAL;
  if (dev->first_code == 0) /* nothing failed: a caller's mistake */
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "%s: input %d is NULL", fn, i));
  dev->errcode = dev->first_code;
  dsp_seterr(dev->ctx, dev->first_code, "%s", dev->first_msg);
  note_thread(dev);
  return dev->first_code;
}

/* The in-use guard. A thread is named by the address of a thread-local
 * byte; the owner is taken with one compare-and-swap, so a second thread
 * sees it taken at once and leaves without touching the device: its
 * error is kept in thread-local state only (t_busy, and t_last for a
 * NULL-input call after it), which dispatch_device_errcode/errmsg give
 * that thread for that device until its next call there gets in. */
static _Thread_local char t_me;
static _Thread_local struct {
  uint64_t serial; /* the device it names, 0: none */
  char msg[384];
} t_busy;

int dispatch__enter(dispatch_device *dev, const char *fn, dispatch__hold *h) {
  h->c = NULL;
  if (!dev || !dev->conn) return 0;
  dispatch__conn *c = dev->conn;
  uintptr_t me = (uintptr_t)&t_me, none = 0;
  if (atomic_load(&c->owner) == me) {
    c->depth++;
  } else if (atomic_compare_exchange_strong(&c->owner, &none, me)) {
    c->depth = 1;
  } else {
    snprintf(t_busy.msg, sizeof t_busy.msg,
             "%s: device \"%.200s\" is in use by another thread (a call is "
             "in flight there); dispatch devices are not thread-safe: give "
             "each thread its own device",
             fn, dev->spec);
    t_busy.serial = dev->serial;
    t_last.code = DISPATCH_EBUSY;
    t_last.serial = dev->serial;
    snprintf(t_last.msg, sizeof t_last.msg, "%s", t_busy.msg);
    return DISPATCH_EBUSY;
  }
  h->c = c;
  if (t_busy.serial == dev->serial) t_busy.serial = 0;
  return 0;
}

void dispatch__leave(dispatch__hold *h) {
  if (h->c && --h->c->depth == 0) atomic_store(&h->c->owner, (uintptr_t)0);
  h->c = NULL;
}

int dispatch__sync_call(dispatch_device *dev) {
  if (!dev->sync) return 0;
  return dev->ops->sync(dev); /* LOCAL: 0 */
}

int dispatch__poisoned_input(dispatch_device *dev, const dispatch_tensor *t) {
  int code = t->kind == DISPATCH_KIND_AUTODIFF ? t->inner->status : t->status;
  const char *m = t->kind == DISPATCH_KIND_AUTODIFF ? t->inner->poison_msg
                                                     : t->poison_msg;
  return dispatch__ret(dev, dsp_seterr(dev->ctx, code, "%s",
                                       m ? m : dispatch_strerror(code)));
}

int dispatch_device_error(const dispatch_device *dev, const char **msg) {
  if (msg) *msg = dev ? dev->first_msg : "";
  return dev ? dev->first_code : DISPATCH_EINVAL;
}

void dispatch_device_clear_error(dispatch_device *dev) {
  if (!dev) return;
  dev->first_code = 0;
  dev->first_msg[0] = '\0';
  if (t_last.serial == dev->serial) t_last.code = 0;
}

static void copy_msg(char *errmsg, size_t len, const char *msg) {
  if (errmsg && len) snprintf(errmsg, len, "%s", msg);
}

/* Splits "HOST:PORT" into host and port buffers. HOST is a name, an IPv4
 * address or "[IPv6]"; an IPv6 address without brackets is refused, as the
 * server's --listen refuses it: in "::1:7070" which colon starts the port
 * would be a guess. Names are resolved later, at connect (getaddrinfo,
 * every address tried in turn). */
static int split_hostport(const char *s, char *host, size_t hlen, char *port,
                          size_t plen) {
  const char *h = s, *colon;
  size_t n;
  if (s[0] == '[') {
    const char *close = strchr(s, ']');
    if (!close || close[1] != ':') return DISPATCH_EINVAL;
    h = s + 1;
    n = (size_t)(close - h);
    colon = close + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon) return DISPATCH_EINVAL;
    n = (size_t)(colon - s);
    if (memchr(s, ':', n)) return DISPATCH_EINVAL;
  }
  if (n == 0 || !colon[1]) return DISPATCH_EINVAL;
  if (n >= hlen || strlen(colon + 1) >= plen) return DISPATCH_EINVAL;
  memcpy(host, h, n);
  host[n] = '\0';
  strcpy(port, colon + 1);
  for (const char *p = port; *p; p++)
    if (*p < '0' || *p > '9') return DISPATCH_EINVAL;
  long pn = strtol(port, NULL, 10);
  if (pn <= 0 || pn > 65535) return DISPATCH_EINVAL;
  return 0;
}

/* "local", "local:cpu", "local:cpu:0": the in-process CPU (*cuda -1);
 * "local:cuda" or "local:cuda:N" (N in 0..999): CUDA device N in process
 * through the plugin (*cuda N, opened by the caller); anything else
 * DISPATCH_EINVAL with the reason in errmsg. */
static int local_device(const char *spec, int *cuda, char *errmsg,
                        size_t len) {
  *cuda = -1;
  if (strcmp(spec, "local") == 0 || strcmp(spec, "local:cpu") == 0 ||
      strcmp(spec, "local:cpu:0") == 0)
    return 0;
  if (strcmp(spec, "local:cuda") == 0) {
    *cuda = 0;
    return 0;
  }
  if (strncmp(spec, "local:cuda:", 11) == 0) {
    const char *d = spec + 11;
    size_t n = strlen(d);
    int ok = n > 0 && n <= 3;
    for (size_t i = 0; ok && i < n; i++) ok = d[i] >= '0' && d[i] <= '9';
    if (ok) {
      *cuda = atoi(d);
      return 0;
    }
  }
  char m[600];
  snprintf(m, sizeof m,
           "device \"%.400s\": unknown local device (use local, local:cpu "
           "or local:cuda:N)",
           spec);
  copy_msg(errmsg, len, m);
  return DISPATCH_EINVAL;
}

/* Runs dev's LOCAL ops on CUDA device `index` through the plugin; on
 * failure the reason names the spec and what is missing (the plugin, or
 * a GPU or driver). */
static int local_cuda_open(dispatch_device *dev, int index, char *errmsg,
                           size_t len) {
  char why[1600];
  int rc = dsp_cuda_plugin_open(index, &dev->cuda, &dev->cuda_be, why,
                                sizeof why);
  if (rc < 0) {
    char m[2100];
    snprintf(m, sizeof m, "device \"%.200s\": %s", dev->spec, why);
    copy_msg(errmsg, len, m);
    return rc;
  }
  dev->cuda->ctx_use(dev->ctx, dev->cuda_be);
  return 0;
}

/* The CUDA device of a local:cuda:N device, after its ctx is gone. */
static void local_cuda_close(dispatch_device *dev) {
  if (dev->cuda_be) dev->cuda->backend_close(dev->cuda_be);
  dev->cuda_be = NULL;
}

/* A server device name as sent in the hello: KIND or KIND:N, letters,
 * digits and one colon, at most 31 characters; the server judges whether
 * it has it. */
static int valid_server_device(const char *d) {
  size_t n = strlen(d);
  if (n == 0 || n > 31) return 0;
  int colons = 0;
  for (const char *p = d; *p; p++) {
    if (*p == ':') {
      if (++colons > 1 || p == d || !p[1]) return 0;
    } else if (!((*p >= 'a' && *p <= 'z') || (*p >= '0' && *p <= '9') ||
                 *p == '_')) {
      return 0;
    }
  }
  return 1;
}

/* Opens a device; on failure nothing is left allocated and the detail is
 * copied to errmsg, since no device survives to hold it. */
int dispatch_device_open(const char *spec, const dispatch_options *opts,
                         dispatch_device **out, char *errmsg,
                         size_t errmsg_len) {
  if (!out) {
    copy_msg(errmsg, errmsg_len, "dispatch_device_open: out is NULL");
    return DISPATCH_EINVAL;
  }
  *out = NULL;
  if (!spec || !*spec) spec = getenv("DISPATCH_DEVICE");
  if (!spec || !*spec) spec = "local";
  /* Only the fields within the caller's opts->size are read: a program
   * built against an older, shorter struct gets the defaults for the
   * fields it does not have, and never has bytes past its struct read. */
  dispatch_options o;
  dispatch_options_init(&o);
  if (opts) {
    if (opts->size < sizeof opts->size) {
      copy_msg(errmsg, errmsg_len,
               "dispatch_device_open: opts->size is 0; start the options "
               "from dispatch_options_init or DISPATCH_OPTIONS_INIT");
      return DISPATCH_EINVAL;
    }
    size_t n = opts->size < sizeof o ? opts->size : sizeof o;
    memcpy(&o, opts, n);
    o.size = sizeof o;
  }
  if (!o.token) o.token = getenv("DISPATCH_TOKEN");
  if (!o.token) o.token = "";
  if (!o.client_name) o.client_name = "libdispatch-client";
  if (!o.sync) {
    const char *e = getenv("DISPATCH_SYNC");
    o.sync = e && strcmp(e, "1") == 0;
  }
  if (o.timeout_ms <= 0) {
    const char *t = getenv("DISPATCH_TIMEOUT_MS");
    long v = t ? strtol(t, NULL, 10) : 0;
    o.timeout_ms = v > 0 && v < 86400000 ? (int)v : 30000;
    if (t && *t == '0' && v == 0) o.timeout_ms = 0; /* "0": no limit */
  }

  const dispatch__kind_ops *ops;
  char host[256], port[16], base[300];
  const char *sdev = NULL; /* the server device after "HOST:PORT/" */
  int cuda = -1;          /* local:cuda:N: N */
  if (strncmp(spec, "local", 5) == 0 &&
      (spec[5] == '\0' || spec[5] == ':')) {
    int rc = local_device(spec, &cuda, errmsg, errmsg_len);
    if (rc < 0) return rc;
    ops = &dispatch__local_ops;
  } else if (strncmp(spec, "tcp://", 6) == 0 ||
             strncmp(spec, "tls://", 6) == 0) {
    ops = &dispatch__remote_ops;
    const char *slash = strchr(spec + 6, '/');
    size_t n = slash ? (size_t)(slash - spec - 6) : strlen(spec + 6);
    if (slash) sdev = slash + 1;
    if (n >= sizeof base || (slash && !valid_server_device(sdev)) ||
        (memcpy(base, spec + 6, n), base[n] = '\0',
         split_hostport(base, host, sizeof host, port, sizeof port) < 0)) {
      char m[600];
      snprintf(m, sizeof m,
               "device \"%.400s\": expected %.6sHOST:PORT or "
               "%.6sHOST:PORT/DEVICE (DEVICE like cpu, cpu:1, cuda:0) with a "
               "port in 1..65535; HOST a name, an IPv4 address or an IPv6 "
               "address in brackets ([::1])",
               spec, spec, spec);
      copy_msg(errmsg, errmsg_len, m);
      return DISPATCH_EINVAL;
    }
  } else {
    char m[600];
    snprintf(m, sizeof m,
             "device \"%.400s\": unknown spec (use \"local\", \"local:cpu\", "
             "\"tcp://HOST:PORT[/DEVICE]\" or \"tls://HOST:PORT[/DEVICE]\")",
             spec);
    copy_msg(errmsg, errmsg_len, m);
    return DISPATCH_EINVAL;
  }

  dispatch_device *dev = dsp_calloc(1, sizeof *dev);
  if (!dev) {
    copy_msg(errmsg, errmsg_len, "dispatch_device_open: out of memory");
    return DISPATCH_ENOMEM;
  }
  dev->ops = ops;
  dev->conn = dsp_calloc(1, sizeof *dev->conn);
  dev->spec = dsp_strdup(spec);
  dev->ctx = dsp_ctx_new(dsp_cpu_backend());
  if (!dev->conn || !dev->spec || !dev->ctx) {
    dsp_free(dev->conn);
    dsp_free(dev->spec);
    dsp_ctx_free(dev->ctx);
    dsp_free(dev);
    copy_msg(errmsg, errmsg_len, "dispatch_device_open: out of memory");
    return DISPATCH_ENOMEM;
  }
  dev->serial = ++g_serial;
  dev->sync = o.sync != 0;
  dev->conn->refs = 1;
  dev->conn->fd = -1;
  dev->conn->timeout_ms = o.timeout_ms;
  dev->conn->resume_off = o.no_resume;
  dev->conn->resume_ms = o.resume_timeout_ms;
  dispatch__open_args oa = {host, port, o.token, o.client_name, sdev,
                            strncmp(spec, "tls://", 6) == 0 ? &o : NULL};
  int rc = cuda >= 0 ? local_cuda_open(dev, cuda, errmsg, errmsg_len) : 0;
  if (rc < 0) {
    dsp_free(dev->conn);
    dsp_free(dev->spec);
    dsp_ctx_free(dev->ctx);
    dsp_free(dev);
    return rc;
  }
  rc = ops->open(dev, &oa);
  if (rc < 0) {
    copy_msg(errmsg, errmsg_len, dsp_ctx_errmsg(dev->ctx));
    ops->close(dev);
    dsp_free(dev->spec);
    dsp_ctx_free(dev->ctx);
    local_cuda_close(dev);
    dsp_free(dev);
    return rc;
  }
  *out = dev;
  return 0;
}

/* Frees everything still alive on dev without following references
 * (tensors hold references to each other, so each handle is destroyed
 * exactly once from the device's list). */
void dispatch_device_close(dispatch_device *dev) {
  if (!dev) return;
  dev->ops->detach(dev);
  dev->closing = 1;
  if (t_last.serial == dev->serial) t_last.code = 0;
  dispatch__graph_close_all(dev); /* they hold tensor references */
  dev->ops->close(dev); /* LOCAL: its conn (only the timeout was used) */
  while (dev->optims) {
    dispatch_optim *o = dev->optims;
    dev->optims = o->next;
    dsp_free(o->params);
    dsp_free(o->states);
    dsp_free(o);
  }
  while (dev->grads) {
    dispatch_grads *g = dev->grads;
    dev->grads = g->next;
    dsp_grads_free(g->local);
    dsp_free(g);
  }
  while (dev->all) {
    dispatch_tensor *t = dev->all;
    dev->all = t->anext;
    dispatch__tensor_destroy(t);
  }
  while (dev->scope) {
    struct dispatch__scope *s = dev->scope;
    dev->scope = s->parent;
    dsp_free(s);
  }
  dsp_free(dev->device);
  dsp_free(dev->spec);
  /* every tensor is gone: the free lists give their blocks back (each
   * holds a reference on the budget the ctx drops) */
  dsp_budget_set_cache(dsp_ctx_budget(dev->ctx), 0);
  dsp_ctx_free(dev->ctx);
  local_cuda_close(dev);
  dsp_free(dev);
}

/* The peer shares dev's connection, so its tensors are in dev's session
 * and a move between the two is a ToDevice request; only the device its
 * new tensors land on differs. */
int dispatch_device_open_peer(dispatch_device *dev, const char *device,
                              dispatch_device **out) {
  if (!out)
    return dev ? dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                               "open_peer: out is NULL"))
               : DISPATCH_EINVAL;
  *out = NULL;
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_open_peer");
  int rc = dev->ops->peer(dev);
  if (rc < 0) return dispatch__ret(dev, rc);
  if (!device || !valid_server_device(device))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "open_peer: \"%.64s\" is not a "
                                         "device name (cpu, cpu:1, cuda:0)",
                                         device ? device : "(null)"));
  if (dev->conn->dead)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, dev->conn->dead_code,
                                         "open_peer: %s", dev->conn->dead_why));
  const char *slash = strchr(dev->spec + 6, '/');
  size_t n = slash ? (size_t)(slash - dev->spec) : strlen(dev->spec);
  dispatch_device *p = dsp_calloc(1, sizeof *p);
  char *spec = dsp_malloc(n + strlen(device) + 2);
  if (p) p->ctx = dsp_ctx_new(dsp_cpu_backend());
  if (p) p->device = dsp_strdup(device);
  if (!p || !spec || !p->ctx || !p->device) {
    if (p) dsp_ctx_free(p->ctx), dsp_free(p->device);
    dsp_free(p);
    dsp_free(spec);
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "open_peer: out of memory"));
  }
  memcpy(spec, dev->spec, n);
  spec[n] = '/';
  strcpy(spec + n + 1, device);
  p->spec = spec;
  p->serial = ++g_serial;
  p->sync = dev->sync;
  p->ops = dev->ops;
  p->conn = dev->conn;
  p->conn->refs++;
  /* the server says whether it has the device */
  rc = dispatch__remote_check_device(p);
  if (rc < 0) {
    dsp_seterr(dev->ctx, rc, "%s", dsp_ctx_errmsg(p->ctx));
    dispatch_device_close(p);
    return dispatch__ret(dev, rc);
  }
  *out = p;
  return 0;
}

/* The caller's array may be of an older, shorter dispatch_device_info:
 * out[0].size gives its element size, the array is walked with that
 * stride, and each element gets only the fields within it. The devices
 * are gathered into full-size structs first. */
int dispatch_device_list(dispatch_device *dev, dispatch_device_info *out,
                         int max, int *n) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_list");
  if (!n || max < 0 || (max > 0 && !out))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "device_list: bad arguments"));
  size_t size = max > 0 ? out->size : 0;
  if (max > 0 && size < offsetof(dispatch_device_info, kind) + sizeof out->kind)
    return dispatch__ret(
        dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "device_list: out[0].size is %zu; declare the array "
                        "with DISPATCH_DEVICE_INFO_INIT as its first element",
                        size));
  dispatch_device_info *all = NULL;
  if (max > 0 && !(all = dsp_calloc((size_t)max, sizeof *all)))
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM,
                                         "device_list: out of memory"));
  int rc = dispatch__ret(dev, dev->ops->devices(dev, all, max, n));
  if (rc == 0) {
    int k = *n < max ? *n : max;
    for (int i = 0; i < k; i++) {
      all[i].size = size;
      memcpy((char *)out + (size_t)i * size, &all[i],
             size < sizeof *all ? size : sizeof *all);
    }
  }
  dsp_free(all);
  return rc;
}

dispatch_tensor_kind dispatch_device_kind(const dispatch_device *dev) {
  return dev->ops->kind;
}

const char *dispatch_device_spec(const dispatch_device *dev) {
  return dev ? dev->spec : "";
}

/* A thread whose last call on dev was refused by the guard reads its own
 * refusal, not the other thread's state. */
const char *dispatch_device_errmsg(const dispatch_device *dev) {
  if (dev && t_busy.serial == dev->serial) return t_busy.msg;
  return dev ? dsp_ctx_errmsg(dev->ctx) : "";
}

int dispatch_device_errcode(const dispatch_device *dev) {
  if (dev && t_busy.serial == dev->serial) return DISPATCH_EBUSY;
  return dev ? dev->errcode : DISPATCH_EINVAL;
}

int dispatch_device_sync(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_sync");
  return dispatch__ret(dev, dev->ops->sync(dev));
}

/* Gathers every counter this library knows into a full struct, then
 * copies out only the part that lies within the caller's out->size: the
 * caller's struct may be older and shorter than ours, and nothing past it
 * is written. */
int dispatch_device_stats(dispatch_device *dev, dispatch_stats *out) {
  if (!dev || !out) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_stats");
  size_t size = out->size;
  if (size < offsetof(dispatch_stats, tensors) + sizeof out->tensors)
    return dispatch__ret(
        dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                        "device_stats: out->size is %zu; declare the struct "
                        "with DISPATCH_STATS_INIT",
                        size));
  dispatch_stats all;
  int rc = dispatch__ret(dev, dev->ops->stats(dev, &all));
  all.size = size;
  memcpy(out, &all, size < sizeof all ? size : sizeof all);
  return rc;
}

int dispatch_device_set_timeout(dispatch_device *dev, int timeout_ms) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_set_timeout");
  if (timeout_ms < 0)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "set_timeout: %d ms is negative",
                                         timeout_ms));
  dev->conn->timeout_ms = timeout_ms;
  return 0;
}

int dispatch_device_set_cache(dispatch_device *dev, uint64_t bytes) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "device_set_cache");
  return dispatch__ret(dev, dev->ops->set_cache(dev, bytes));
}

/* ------------------------------------------------------------------ */
/* scopes                                                              */

int dispatch_scope_begin(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "scope_begin");
  struct dispatch__scope *s = dsp_calloc(1, sizeof *s);
  if (!s)
    return dispatch__ret(
        dev, dsp_seterr(dev->ctx, DISPATCH_ENOMEM, "scope_begin: out of memory"));
  s->parent = dev->scope;
  dev->scope = s;
  return 0;
}

static void scope_unlink(dispatch_tensor *t) {
  struct dispatch__scope *s = t->scope;
  if (!s) return;
  if (t->sprev)
    t->sprev->snext = t->snext;
  else
    s->head = t->snext;
  if (t->snext) t->snext->sprev = t->sprev;
  t->sprev = t->snext = NULL;
  t->scope = NULL;
}

static void scope_link(struct dispatch__scope *s, dispatch_tensor *t) {
  t->scope = s;
  t->sprev = NULL;
  t->snext = s->head;
  if (s->head) s->head->sprev = t;
  s->head = t;
}

void dispatch__scope_adopt(dispatch_tensor *t) {
  if (t->dev->scope) scope_link(t->dev->scope, t);
}

/* Drops the scope's reference of each registered tensor; a tensor that
 * is freed by that unlinks itself, so the walk restarts at the head. */
int dispatch_scope_end(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "scope_end");
  struct dispatch__scope *s = dev->scope;
  if (!s)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "scope_end: no scope is open"));
  while (s->head) {
    dispatch_tensor *t = s->head;
    scope_unlink(t);
    dispatch__tensor_unref(t);
  }
  dev->scope = s->parent;
  dsp_free(s);
  return 0;
}

dispatch_tensor *dispatch_keep(dispatch_tensor *t) {
  if (!t || !t->scope) return t;
  struct dispatch__scope *parent = t->scope->parent;
  scope_unlink(t);
  if (parent) scope_link(parent, t);
  return t;
}

/* Used by dispatch_tensor_free (the caller drops the reference its scope
 * held) and when the last reference goes. */
void dispatch__scope_forget(dispatch_tensor *t) { scope_unlink(t); }
