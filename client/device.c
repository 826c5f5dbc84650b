/* Devices (open from a spec string, close), error detail, scopes, stats. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client_internal.h"

const char *dispatch_version(void) {
#ifdef DISPATCH_VERSION_STRING
  return DISPATCH_VERSION_STRING;
#else
  return "0.1.0";
#endif
}

void dispatch_options_init(dispatch_options *opts) {
  if (opts) memset(opts, 0, sizeof *opts);
}

int dispatch__ret(dispatch_device *dev, int rc) {
  if (dev && rc < 0) dev->errcode = rc;
  return rc;
}

static void copy_msg(char *errmsg, size_t len, const char *msg) {
  if (errmsg && len) snprintf(errmsg, len, "%s", msg);
}

/* Splits "HOST:PORT" (HOST may be "[v6]") into host and port buffers. */
static int split_hostport(const char *s, char *host, size_t hlen, char *port,
                          size_t plen) {
  const char *colon = strrchr(s, ':');
  if (!colon || colon == s || !colon[1]) return DISPATCH_EINVAL;
  const char *h = s;
  size_t n = (size_t)(colon - s);
  if (h[0] == '[' && n >= 2 && h[n - 1] == ']') h++, n -= 2;
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
  dispatch_options o;
  dispatch_options_init(&o);
  if (opts) o = *opts;
  if (!o.token) o.token = getenv("DISPATCH_TOKEN");
  if (!o.token) o.token = "";
  if (!o.client_name) o.client_name = "libdispatch-client";
  if (o.timeout_ms <= 0) {
    const char *t = getenv("DISPATCH_TIMEOUT_MS");
    long v = t ? strtol(t, NULL, 10) : 0;
    o.timeout_ms = v > 0 && v < 86400000 ? (int)v : 30000;
  }

  dispatch_tensor_kind kind;
  char host[256], port[16];
  if (strcmp(spec, "local") == 0) {
    kind = DISPATCH_KIND_LOCAL;
  } else if (strncmp(spec, "tcp://", 6) == 0) {
    kind = DISPATCH_KIND_REMOTE;
    if (split_hostport(spec + 6, host, sizeof host, port, sizeof port) < 0) {
      char m[512];
      snprintf(m, sizeof m,
               "device \"%.400s\": expected tcp://HOST:PORT with a port in "
               "1..65535",
               spec);
      copy_msg(errmsg, errmsg_len, m);
      return DISPATCH_EINVAL;
    }
  } else if (strncmp(spec, "tls://", 6) == 0) {
    kind = DISPATCH_KIND_REMOTE;
    if (split_hostport(spec + 6, host, sizeof host, port, sizeof port) < 0) {
      char m[512];
      snprintf(m, sizeof m,
               "device \"%.400s\": expected tls://HOST:PORT with a port in "
               "1..65535",
               spec);
      copy_msg(errmsg, errmsg_len, m);
      return DISPATCH_EINVAL;
    }
  } else {
    char m[512];
    snprintf(m, sizeof m,
             "device \"%.400s\": unknown spec (use \"local\", "
             "\"tcp://HOST:PORT\" or \"tls://HOST:PORT\")",
             spec);
    copy_msg(errmsg, errmsg_len, m);
    return DISPATCH_EINVAL;
  }

  dispatch_device *dev = dsp_calloc(1, sizeof *dev);
  if (!dev) {
    copy_msg(errmsg, errmsg_len, "dispatch_device_open: out of memory");
    return DISPATCH_ENOMEM;
  }
  dev->kind = kind;
  dev->conn.fd = -1;
  dev->conn.timeout_ms = o.timeout_ms;
  dev->spec = dsp_strdup(spec);
  dev->ctx = dsp_ctx_new();
  if (!dev->spec || !dev->ctx) {
    dsp_free(dev->spec);
    dsp_ctx_free(dev->ctx);
    dsp_free(dev);
    copy_msg(errmsg, errmsg_len, "dispatch_device_open: out of memory");
    return DISPATCH_ENOMEM;
  }
  if (kind == DISPATCH_KIND_REMOTE) {
    int rc = dispatch__remote_open(dev, host, port, o.token, o.client_name,
                                   strncmp(spec, "tls://", 6) == 0 ? &o
                                                                   : NULL);
    if (rc < 0) {
      copy_msg(errmsg, errmsg_len, dsp_ctx_errmsg(dev->ctx));
      dispatch__remote_close(dev);
      dsp_free(dev->spec);
      dsp_ctx_free(dev->ctx);
      dsp_free(dev);
      return rc;
    }
  }
  *out = dev;
  return 0;
}

/* Frees everything still alive on dev without following references
 * (tensors hold references to each other, so each handle is destroyed
 * exactly once from the device's list). */
void dispatch_device_close(dispatch_device *dev) {
  if (!dev) return;
  dev->closing = 1;
  if (dev->kind == DISPATCH_KIND_REMOTE) dispatch__remote_close(dev);
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
  dsp_free(dev->spec);
  dsp_ctx_free(dev->ctx);
  dsp_free(dev);
}

dispatch_tensor_kind dispatch_device_kind(const dispatch_device *dev) {
  return dev->kind;
}

const char *dispatch_device_spec(const dispatch_device *dev) {
  return dev ? dev->spec : "";
}

const char *dispatch_device_errmsg(const dispatch_device *dev) {
  return dev ? dsp_ctx_errmsg(dev->ctx) : "";
}

int dispatch_device_errcode(const dispatch_device *dev) {
  return dev ? dev->errcode : DISPATCH_EINVAL;
}

int dispatch_device_sync(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
  if (dev->kind == DISPATCH_KIND_LOCAL) return 0;
  return dispatch__ret(dev, dispatch__remote_sync(dev));
}

int dispatch_device_stats(dispatch_device *dev, dispatch_stats *out) {
  if (!dev || !out) return DISPATCH_EINVAL;
  if (dev->kind == DISPATCH_KIND_LOCAL) {
    *out = dev->local_stats;
    return 0;
  }
  memset(out, 0, sizeof *out);
  return dispatch__ret(dev, dispatch__remote_stats(dev, out));
}

int dispatch_device_set_timeout(dispatch_device *dev, int timeout_ms) {
  if (!dev) return DISPATCH_EINVAL;
  if (timeout_ms <= 0)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "set_timeout: %d ms is not positive",
                                         timeout_ms));
  dev->conn.timeout_ms = timeout_ms;
  return 0;
}

/* ------------------------------------------------------------------ */
/* scopes                                                              */

int dispatch_scope_begin(dispatch_device *dev) {
  if (!dev) return DISPATCH_EINVAL;
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
  struct dispatch__scope *s = dev->scope;
  if (!s)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "scope_end: no scope is open"));
  while (s->head) {
    dispatch_tensor *t = s->head;
    scope_unlink(t);
    dispatch_tensor_free(t);
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

/* Used by dispatch_tensor_free when the last reference goes. */
void dispatch__scope_forget(dispatch_tensor *t) { scope_unlink(t); }
