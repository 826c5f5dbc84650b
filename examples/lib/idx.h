/* Reader for gzip-compressed IDX files (the MNIST / Fashion-MNIST format).
 *
 * An IDX file is a big-endian header: two zero bytes, a type byte (0x08 for
 * unsigned bytes), a rank byte, then one u32 size per dim, then the data.
 */
#ifndef EXAMPLES_IDX_H
#define EXAMPLES_IDX_H

#include <stddef.h>
#include <stdint.h>

typedef struct idx_array {
  int ndim;
  uint32_t dims[4];
  size_t count;   /* product of dims */
  uint8_t *data;  /* count bytes, owned by the array */
} idx_array;

/* Reads path (gzip or plain). Returns 0, or -1 with a message in err.
 * On success the caller owns arr->data and frees it with idx_free. */
int idx_read(const char *path, idx_array *arr, char *err, size_t errlen);
void idx_free(idx_array *arr);

/* The Fashion-MNIST split under dir: images as f32 in [0,1] of shape
 * [n, 784] and labels as i64 of shape [n]. Buffers are malloc'd and owned
 * by the caller (free). Returns 0 or -1 with a message in err. */
typedef struct fmnist_split {
  size_t n;
  float *images;
  int64_t *labels;
} fmnist_split;

int fmnist_load(const char *dir, int train, fmnist_split *out, char *err,
                size_t errlen);
void fmnist_free(fmnist_split *s);

/* Default dataset folder (Debian's dataset-fashion-mnist package); the
 * environment variable FASHION_MNIST_DIR overrides it. */
const char *fmnist_default_dir(void);

#endif
