/* gzip IDX reader: checks every header field against the bytes present. */
#include "idx.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zlib.h>

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 |
         (uint32_t)p[3];
}

static int read_exact(gzFile f, void *buf, size_t n) {
  uint8_t *p = buf;
  while (n > 0) {
    unsigned chunk = n > (1u << 30) ? (1u << 30) : (unsigned)n;
    int got = gzread(f, p, chunk);
    if (got <= 0) return -1;
    p += got;
    n -= (size_t)got;
  }
  return 0;
}

int idx_read(const char *path, idx_array *arr, char *err, size_t errlen) {
  memset(arr, 0, sizeof *arr);
  gzFile f = gzopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "%s: cannot open", path);
    return -1;
  }
  uint8_t hdr[4];
  if (read_exact(f, hdr, 4) < 0 || hdr[0] || hdr[1] || hdr[2] != 0x08 ||
      hdr[3] == 0 || hdr[3] > 4) {
    snprintf(err, errlen, "%s: not an unsigned-byte IDX file", path);
    gzclose(f);
    return -1;
  }
  arr->ndim = hdr[3];
  size_t count = 1;
  for (int i = 0; i < arr->ndim; i++) {
    uint8_t d[4];
    if (read_exact(f, d, 4) < 0) {
      snprintf(err, errlen, "%s: truncated header", path);
      gzclose(f);
      return -1;
    }
    arr->dims[i] = be32(d);
    if (arr->dims[i] && count > ((size_t)1 << 40) / arr->dims[i]) {
      snprintf(err, errlen, "%s: implausible size", path);
      gzclose(f);
      return -1;
    }
    count *= arr->dims[i];
  }
  arr->count = count;
  arr->data = malloc(count ? count : 1);
  if (!arr->data) {
    snprintf(err, errlen, "%s: out of memory for %zu bytes", path, count);
    gzclose(f);
    return -1;
  }
  if (read_exact(f, arr->data, count) < 0) {
    snprintf(err, errlen, "%s: truncated data (expected %zu bytes)", path,
             count);
    idx_free(arr);
    gzclose(f);
    return -1;
  }
  gzclose(f);
  return 0;
}

void idx_free(idx_array *arr) {
  free(arr->data);
  arr->data = NULL;
}

const char *fmnist_default_dir(void) {
  const char *d = getenv("FASHION_MNIST_DIR");
  return d && *d ? d : "/usr/share/datasets/fashion-mnist";
}

int fmnist_load(const char *dir, int train, fmnist_split *out, char *err,
                size_t errlen) {
  memset(out, 0, sizeof *out);
  char ip[1024], lp[1024];
  const char *pre = train ? "train" : "t10k";
  snprintf(ip, sizeof ip, "%s/%s-images-idx3-ubyte.gz", dir, pre);
  snprintf(lp, sizeof lp, "%s/%s-labels-idx1-ubyte.gz", dir, pre);
  idx_array im, lb;
  if (idx_read(ip, &im, err, errlen) < 0) return -1;
  if (idx_read(lp, &lb, err, errlen) < 0) {
    idx_free(&im);
    return -1;
  }
  if (im.ndim != 3 || lb.ndim != 1 || im.dims[0] != lb.dims[0] ||
      im.dims[1] * im.dims[2] != 784) {
    snprintf(err, errlen, "%s: unexpected shapes", dir);
    idx_free(&im);
    idx_free(&lb);
    return -1;
  }
  size_t n = im.dims[0];
  out->images = malloc(n * 784 * sizeof(float));
  out->labels = malloc(n * sizeof(int64_t));
  if (!out->images || !out->labels) {
    snprintf(err, errlen, "out of memory");
    fmnist_free(out);
    idx_free(&im);
    idx_free(&lb);
    return -1;
  }
  for (size_t i = 0; i < n * 784; i++) out->images[i] = im.data[i] / 255.0f;
  for (size_t i = 0; i < n; i++) {
    if (lb.data[i] > 9) {
      snprintf(err, errlen, "%s: label %u out of range", lp, lb.data[i]);
      fmnist_free(out);
      idx_free(&im);
      idx_free(&lb);
      return -1;
    }
    out->labels[i] = lb.data[i];
  }
  out->n = n;
  idx_free(&im);
  idx_free(&lb);
  return 0;
}

void fmnist_free(fmnist_split *s) {
  free(s->images);
  free(s->labels);
  s->images = NULL;
  s->labels = NULL;
  s->n = 0;
}
