/* The safetensors format (safetensors.h): the header a save writes and the
 * checks a load makes before it creates anything. The JSON is written and
 * parsed by cJSON (Debian's libcjson). */
#include "safetensors.h"

#include <cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
/* tensor bytes go to the file as they are in memory; safetensors wants
 * little-endian, so a big-endian port needs a byte swap first */
#error "safetensors.c assumes a little-endian host"
#endif

/* safetensors' name of each dtype, indexed by dsp_dtype (torch writes
 * torch.float16 as F16 and torch.bfloat16 as BF16, 2 bytes each) */
static const char *const k_st_dtype[] = {"F32", "F64", "I64",
                                         "BOOL", "F16", "BF16"};
_Static_assert(sizeof k_st_dtype / sizeof k_st_dtype[0] == DSP_NDTYPES,
               "every dtype needs its safetensors name");

/* dsp_seterr formats into the ctx's own buffer, so the old message is
 * copied out first. */
int dsp_st_prefix_err(dsp_ctx *ctx, int rc, const char *fmt, ...) {
  char pre[512], old[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pre, sizeof pre, fmt, ap);
  va_end(ap);
  snprintf(old, sizeof old, "%s", dsp_ctx_errmsg(ctx));
  return dsp_seterr(ctx, rc, "%s: %s", pre, old);
}

int dsp_st_utf8_ok(const unsigned char *s, size_t n) {
  size_t i = 0;
  while (i < n) {
    unsigned c = s[i];
    size_t len;
    unsigned cp;
    if (c < 0x80) {
      i++;
      continue;
    } else if ((c & 0xE0) == 0xC0) {
      len = 2, cp = c & 0x1F;
    } else if ((c & 0xF0) == 0xE0) {
      len = 3, cp = c & 0x0F;
    } else if ((c & 0xF8) == 0xF0) {
      len = 4, cp = c & 0x07;
    } else {
      return 0;
    }
    if (n - i < len) return 0;
    for (size_t k = 1; k < len; k++) {
      if ((s[i + k] & 0xC0) != 0x80) return 0;
      cp = (cp << 6) | (s[i + k] & 0x3F);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) ||
        (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF))
      return 0;
    i += len;
  }
  return 1;
}

int dsp_write_all(int fd, const void *p, size_t n) {
  const uint8_t *b = p;
  while (n) {
    ssize_t w = write(fd, b, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    b += w;
    n -= (size_t)w;
  }
  return 0;
}

int dsp_pread_all(int fd, void *p, size_t n, uint64_t off) {
  uint8_t *b = p;
  while (n) {
    ssize_t r = pread(fd, b, n, (off_t)off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return -1;
    if (r == 0) {
      errno = 0;
      return -1;
    }
    b += r;
    n -= (size_t)r;
    off += (uint64_t)r;
  }
  return 0;
}

/* ------------------------------------------------------------------ */
/* save                                                                */

int dsp_st_check_name(dsp_ctx *ctx, const char *path, int i,
                      const char *name) {
  if (!*name || strcmp(name, "__metadata__") == 0)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "save \"%s\": tensor %d: the name \"%s\" is reserved or "
                      "empty",
                      path, i, name);
  if (!dsp_st_utf8_ok((const unsigned char *)name, strlen(name)))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "save \"%s\": tensor %d: the name is not valid UTF-8",
                      path, i);
  return 0;
}

static int cmp_name_ptr(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* {"__metadata__": {...}, name: {dtype, shape, data_offsets}, ...} in
 * data order, unformatted; NULL when out of memory. */
static char *header_json(const dsp_st_entry *es, int n,
                         const char *const *mkeys, const char *const *mvals,
                         int n_meta) {
  cJSON *root = cJSON_CreateObject();
  if (!root) return NULL;
  cJSON *meta = cJSON_AddObjectToObject(root, "__metadata__");
  int ok = meta && cJSON_AddStringToObject(meta, "format", "dispatch");
  for (int i = 0; ok && i < n_meta; i++)
    ok = cJSON_AddStringToObject(meta, mkeys[i], mvals[i]) != NULL;
  for (int i = 0; ok && i < n; i++) {
    cJSON *o = cJSON_AddObjectToObject(root, es[i].name);
    cJSON *shape = o ? cJSON_AddArrayToObject(o, "shape") : NULL;
    ok = o && shape &&
         cJSON_AddStringToObject(o, "dtype", k_st_dtype[es[i].meta.dtype]);
    for (int d = 0; ok && d < es[i].meta.ndim; d++) {
      cJSON *v = cJSON_CreateNumber((double)es[i].meta.shape[d]);
      ok = v && cJSON_AddItemToArray(shape, v);
    }
    cJSON *off = ok ? cJSON_AddArrayToObject(o, "data_offsets") : NULL;
    cJSON *b = cJSON_CreateNumber((double)es[i].begin);
    cJSON *e = cJSON_CreateNumber((double)es[i].end);
    ok = off && b && e;
    if (ok) {
      cJSON_AddItemToArray(off, b);
      cJSON_AddItemToArray(off, e);
    } else {
      cJSON_Delete(b);
      cJSON_Delete(e);
    }
  }
  char *js = ok ? cJSON_PrintUnformatted(root) : NULL;
  cJSON_Delete(root);
  return js;
}

int dsp_st_header(dsp_ctx *ctx, const char *path, dsp_st_entry *es, int n,
                  const char *const *mkeys, const char *const *mvals,
                  int n_meta, uint8_t **out, size_t *len) {
  *out = NULL;
  *len = 0;
  uint64_t off = 0;
  for (int i = 0; i < n; i++) {
    int64_t numel = 1;
    for (int d = 0; d < es[i].meta.ndim; d++) numel *= es[i].meta.shape[d];
    es[i].begin = off;
    off += (uint64_t)numel * dsp_dtype_size(es[i].meta.dtype);
    es[i].end = off;
    if ((double)off > DSP_ST_MAX_EXACT)
      return dsp_seterr(ctx, DISPATCH_EOVERFLOW,
                        "save \"%s\": data passes 2^53 bytes", path);
  }
  if (n > 1) {
    char **sorted = dsp_malloc((size_t)n * sizeof *sorted);
    if (!sorted)
      return dsp_seterr(ctx, DISPATCH_ENOMEM, "save: out of memory");
    for (int i = 0; i < n; i++) sorted[i] = es[i].name;
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_name_ptr);
    for (int i = 1; i < n; i++)
      if (strcmp(sorted[i - 1], sorted[i]) == 0) {
        int rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                            "save \"%s\": the name \"%s\" appears twice", path,
                            sorted[i]);
        dsp_free(sorted);
        return rc;
      }
    dsp_free(sorted);
  }
  char *js = header_json(es, n, mkeys, mvals, n_meta);
  if (!js)
    return dsp_seterr(ctx, DISPATCH_ENOMEM,
                      "save \"%s\": out of memory (header)", path);
  size_t jl = strlen(js), padded = (jl + 7) & ~(size_t)7;
  if (padded > DSP_ST_MAX_HEADER) {
    cJSON_free(js);
    return dsp_seterr(ctx, DISPATCH_ETOOLARGE,
                      "save \"%s\": header of %zu bytes passes the %llu-byte "
                      "limit of a load",
                      path, padded, (unsigned long long)DSP_ST_MAX_HEADER);
  }
  uint8_t *buf = dsp_malloc(8 + padded);
  if (!buf) {
    cJSON_free(js);
    return dsp_seterr(ctx, DISPATCH_ENOMEM,
                      "save \"%s\": out of memory (header)", path);
  }
  for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
  memcpy(buf + 8, js, jl);
  memset(buf + 8 + jl, ' ', padded - jl);
  cJSON_free(js);
  *out = buf;
  *len = 8 + padded;
  return 0;
}

/* ------------------------------------------------------------------ */
/* load                                                                */

static int cmp_offset(const void *a, const void *b) {
  const dsp_st_entry *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  if (x->end != y->end) return x->end < y->end ? -1 : 1;
  return 0;
}

static int cmp_name(const void *a, const void *b) {
  return strcmp(((const dsp_st_entry *)a)->name,
                ((const dsp_st_entry *)b)->name);
}

/* A JSON number that is a whole number in [0, 2^53]. */
static int json_count(const cJSON *v, uint64_t *out) {
  if (!cJSON_IsNumber(v)) return -1;
  double d = v->valuedouble;
  if (!(d >= 0) || d > DSP_ST_MAX_EXACT || d != floor(d)) return -1;
  *out = (uint64_t)d;
  return 0;
}

/* One tensor's entry: {"dtype": ..., "shape": [...], "data_offsets":
 * [begin, end]} with end - begin the shape's byte size. e->name is left
 * pointing into the JSON. */
static int parse_entry(dsp_ctx *ctx, const char *path, const cJSON *o,
                       dsp_st_entry *e) {
  const char *nm = o->string;
  if (!cJSON_IsObject(o))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": entry is not a JSON object",
                      path, nm);
  const cJSON *dt = cJSON_GetObjectItemCaseSensitive(o, "dtype");
  const cJSON *sh = cJSON_GetObjectItemCaseSensitive(o, "shape");
  const cJSON *of = cJSON_GetObjectItemCaseSensitive(o, "data_offsets");
  if (!cJSON_IsString(dt) || !cJSON_IsArray(sh) || !cJSON_IsArray(of))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": needs a string \"dtype\", "
                      "an array \"shape\" and an array \"data_offsets\"",
                      path, nm);
  int dtype = -1;
  for (int i = 0; i < DSP_NDTYPES; i++)
    if (strcmp(dt->valuestring, k_st_dtype[i]) == 0) dtype = i;
  if (dtype < 0)
    return dsp_seterr(ctx, DISPATCH_EDTYPE,
                      "load \"%s\": tensor \"%s\": dtype \"%.32s\" is not "
                      "supported (F32, F64, I64, BOOL, F16, BF16)",
                      path, nm, dt->valuestring);
  memset(&e->meta, 0, sizeof e->meta);
  e->meta.dtype = (dsp_dtype)dtype;
  int nd = cJSON_GetArraySize(sh);
  if (nd > DSP_MAX_DIMS)
    return dsp_seterr(ctx, DISPATCH_EDIM,
                      "load \"%s\": tensor \"%s\": rank %d passes %d", path, nm,
                      nd, DSP_MAX_DIMS);
  e->meta.ndim = nd;
  int d = 0;
  const cJSON *v;
  cJSON_ArrayForEach(v, sh) {
    uint64_t s;
    if (json_count(v, &s) < 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": tensor \"%s\": shape[%d] is not a whole "
                        "number in [0, 2^53]",
                        path, nm, d);
    e->meta.shape[d++] = (int64_t)s;
  }
  if (cJSON_GetArraySize(of) != 2 ||
      json_count(cJSON_GetArrayItem(of, 0), &e->begin) < 0 ||
      json_count(cJSON_GetArrayItem(of, 1), &e->end) < 0 || e->end < e->begin)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": tensor \"%s\": data_offsets must be "
                      "[begin, end], whole numbers with begin <= end",
                      path, nm);
  int64_t numel;
  int rc = dsp_meta_numel(ctx, &e->meta, &numel);
  if (rc < 0)
    return dsp_st_prefix_err(ctx, rc, "load \"%s\": tensor \"%s\"", path, nm);
  uint64_t need = (uint64_t)numel * dsp_dtype_size(e->meta.dtype);
  if (need != e->end - e->begin) {
    char sb[160];
    return dsp_seterr(
        ctx, DISPATCH_ESHAPE,
        "load \"%s\": tensor \"%s\": %s %s needs %llu bytes, "
        "data_offsets [%llu, %llu] hold %llu",
        path, nm, k_st_dtype[dtype], dsp_shape_str(&e->meta, sb, sizeof sb),
        (unsigned long long)need, (unsigned long long)e->begin,
        (unsigned long long)e->end, (unsigned long long)(e->end - e->begin));
  }
  e->name = (char *)nm;
  return 0;
}

void dsp_st_file_release(dsp_st_file *f) {
  for (int i = 0; f->es && i < f->n; i++) dsp_free(f->es[i].name);
  for (int i = 0; i < f->n_meta; i++) {
    dsp_free(f->keys[i]);
    dsp_free(f->vals[i]);
  }
  dsp_free(f->es);
  dsp_free(f->keys);
  dsp_free(f->vals);
  memset(f, 0, sizeof *f);
}

const char *dsp_st_meta(const dsp_st_file *f, const char *key) {
  for (int i = 0; key && i < f->n_meta; i++)
    if (strcmp(f->keys[i], key) == 0) return f->vals[i];
  return NULL;
}

/* Checks the parsed header against the data section (every tensor's
 * entry, the metadata, unique names, contiguous offsets covering the data
 * exactly) and fills f, names copied out of the JSON. */
static int check_header(dsp_ctx *ctx, const char *path, const cJSON *root,
                        uint64_t data_len, dsp_st_file *f) {
  if (!cJSON_IsObject(root))
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the header is not a JSON object", path);
  int n = 0, n_meta_objs = 0;
  const cJSON *c, *meta = NULL;
  cJSON_ArrayForEach(c, root) {
    if (strcmp(c->string, "__metadata__") == 0) {
      meta = c;
      n_meta_objs++;
    } else {
      n++;
    }
  }
  if (n_meta_objs > 1)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the name \"__metadata__\" appears twice",
                      path);
  if (meta) {
    if (!cJSON_IsObject(meta))
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": __metadata__ is not a JSON object", path);
    int nm = cJSON_GetArraySize(meta);
    f->keys = dsp_calloc(nm ? (size_t)nm : 1, sizeof(char *));
    f->vals = dsp_calloc(nm ? (size_t)nm : 1, sizeof(char *));
    if (!f->keys || !f->vals)
      return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
    cJSON_ArrayForEach(c, meta) {
      if (!cJSON_IsString(c))
        return dsp_seterr(ctx, DISPATCH_EINVAL,
                          "load \"%s\": __metadata__ \"%s\" is not a string",
                          path, c->string);
      f->keys[f->n_meta] = dsp_strdup(c->string);
      f->vals[f->n_meta] = dsp_strdup(c->valuestring);
      f->n_meta++;
      if (!f->keys[f->n_meta - 1] || !f->vals[f->n_meta - 1])
        return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
    }
  }
  dsp_st_entry *es = dsp_calloc(n ? (size_t)n : 1, sizeof *es);
  if (!es) return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  f->es = es;
  int i = 0, rc;
  cJSON_ArrayForEach(c, root) {
    if (c == meta) continue;
    rc = parse_entry(ctx, path, c, &es[i]);
    /* from here on f owns a copy of the name */
    es[i].name = rc == 0 ? dsp_strdup(es[i].name) : NULL;
    i++;
    f->n = i;
    if (rc < 0) return rc;
    if (!es[i - 1].name)
      return dsp_seterr(ctx, DISPATCH_ENOMEM, "load: out of memory");
  }
  qsort(es, (size_t)n, sizeof *es, cmp_name);
  for (i = 1; i < n; i++)
    if (strcmp(es[i - 1].name, es[i].name) == 0)
      return dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": the name \"%s\" appears twice", path,
                        es[i].name);
  qsort(es, (size_t)n, sizeof *es, cmp_offset);
  uint64_t at = 0;
  for (i = 0; i < n; i++) {
    if (es[i].begin != at)
      return dsp_seterr(
          ctx, DISPATCH_EINVAL,
          "load \"%s\": tensor \"%s\" starts at %llu, %s %llu (offsets must "
          "be contiguous)",
          path, es[i].name, (unsigned long long)es[i].begin,
          es[i].begin < at ? "overlapping data that runs to"
                           : "leaving a gap after data that ends at",
          (unsigned long long)at);
    at = es[i].end;
    if (es[i].end - es[i].begin > f->max_bytes)
      f->max_bytes = es[i].end - es[i].begin;
  }
  if (at > data_len)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": truncated: the offsets need %llu data "
                      "bytes, the file has %llu",
                      path, (unsigned long long)at,
                      (unsigned long long)data_len);
  if (at < data_len)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": %llu bytes after the last tensor's data "
                      "(the offsets cover %llu of %llu)",
                      path, (unsigned long long)(data_len - at),
                      (unsigned long long)at, (unsigned long long)data_len);
  return 0;
}

int dsp_st_read_header(dsp_ctx *ctx, int fd, uint64_t size, const char *path,
                       dsp_st_file *f) {
  memset(f, 0, sizeof *f);
  uint8_t lenb[8];
  uint64_t hlen = 0;
  if (size < 8 || dsp_pread_all(fd, lenb, 8, 0) < 0)
    return dsp_seterr(ctx, size < 8 ? DISPATCH_EINVAL : DISPATCH_EIO,
                      "load \"%s\": truncated: %llu bytes, shorter than the "
                      "8-byte header length",
                      path, (unsigned long long)size);
  for (int i = 0; i < 8; i++) hlen |= (uint64_t)lenb[i] << (8 * i);
  if (hlen > DSP_ST_MAX_HEADER)
    return dsp_seterr(ctx, DISPATCH_ETOOLARGE,
                      "load \"%s\": header length %llu passes the limit of "
                      "%llu bytes",
                      path, (unsigned long long)hlen,
                      (unsigned long long)DSP_ST_MAX_HEADER);
  if (hlen > size - 8)
    return dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": truncated: header length %llu, %llu bytes "
                      "follow it",
                      path, (unsigned long long)hlen,
                      (unsigned long long)(size - 8));
  char *hdr = dsp_malloc((size_t)hlen + 1);
  if (!hdr)
    return dsp_seterr(ctx, DISPATCH_ENOMEM,
                      "load \"%s\": out of memory (header of %llu bytes)", path,
                      (unsigned long long)hlen);
  int rc = 0;
  cJSON *root = NULL;
  if (dsp_pread_all(fd, hdr, (size_t)hlen, 8) < 0)
    rc = dsp_seterr(ctx, DISPATCH_EIO, "load \"%s\": reading the header: %s",
                    path, errno ? strerror(errno) : "file shrank");
  if (rc == 0 && !dsp_st_utf8_ok((const unsigned char *)hdr, (size_t)hlen))
    rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                    "load \"%s\": the header is not valid UTF-8", path);
  if (rc == 0) {
    hdr[hlen] = 0;
    const char *end = NULL;
    root = cJSON_ParseWithLengthOpts(hdr, (size_t)hlen, &end, 0);
    if (!root) {
      rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                      "load \"%s\": the header is not valid JSON (at byte "
                      "%lld of %llu)",
                      path, end ? (long long)(end - hdr) : -1LL,
                      (unsigned long long)hlen);
    } else {
      while (end && end < hdr + hlen &&
             (*end == ' ' || *end == '\t' || *end == '\n' || *end == '\r'))
        end++;
      if (end != hdr + hlen)
        rc = dsp_seterr(ctx, DISPATCH_EINVAL,
                        "load \"%s\": the header has bytes after its JSON "
                        "value (at byte %lld)",
                        path, end ? (long long)(end - hdr) : -1LL);
    }
  }
  if (rc == 0) rc = check_header(ctx, path, root, size - 8 - hlen, f);
  f->data_at = 8 + hlen;
  cJSON_Delete(root);
  dsp_free(hdr);
  if (rc < 0) dsp_st_file_release(f);
  return rc;
}
