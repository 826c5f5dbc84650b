/* The safetensors file format, shared by the client library's
 * dispatch_save/dispatch_load (client/checkpoint.c) and the server's
 * checkpoints in --checkpoint-dir (server/checkpoint.c), so a file either
 * side writes is one the other reads: an 8-byte little-endian header
 * length N, N bytes of JSON naming each tensor's dtype, shape and
 * [begin, end) offsets into the data section (padded with spaces so the
 * data starts 8-aligned), then the raw little-endian bytes.
 *
 * No tensors here: the caller moves the bytes. Every function that fails
 * returns a negative DISPATCH_E* code with the message in ctx; messages
 * start with "save \"PATH\"" or "load \"PATH\"", path being what the
 * caller names the file by. */
#ifndef DSP_SAFETENSORS_H
#define DSP_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dsp.h"

#define DSP_ST_MAX_HEADER ((uint64_t)100 << 20) /* as the reference reader */
#define DSP_ST_MAX_EXACT 9007199254740992.0     /* 2^53: exact in JSON */

/* One tensor of a file: its name, dtype and shape, and where its bytes
 * lie in the data section. */
typedef struct dsp_st_entry {
  char *name; /* dsp_st_file: owned; dsp_st_header: borrowed */
  dsp_meta meta;
  uint64_t begin, end;
} dsp_st_entry;

/* 1 when s[0..n-1] is well-formed UTF-8 (no overlongs, surrogates or code
 * points past U+10FFFF). */
int dsp_st_utf8_ok(const unsigned char *s, size_t n);

/* A tensor name a file may hold: non-empty, not "__metadata__", UTF-8.
 * 0, or DISPATCH_EINVAL "save \"PATH\": tensor I: ...". */
int dsp_st_check_name(dsp_ctx *ctx, const char *path, int i, const char *name);

/* Lays the n entries out one after the other in the given order (each
 * entry's begin and end from its meta), refuses a name given twice or
 * data past 2^53 bytes, and builds the file's first bytes: the 8-byte
 * length and the padded JSON header, with metadata "format": "dispatch"
 * and the n_meta key/value pairs given. *out (dsp_malloc, the caller's)
 * holds *len bytes; the data section follows them in the file. */
int dsp_st_header(dsp_ctx *ctx, const char *path, dsp_st_entry *es, int n,
                  const char *const *mkeys, const char *const *mvals,
                  int n_meta, uint8_t **out, size_t *len);

/* A parsed file: its entries in data order, its metadata, and where the
 * data section starts. Everything is owned (dsp_st_file_release). */
typedef struct dsp_st_file {
  int n;
  dsp_st_entry *es;
  int n_meta;
  char **keys, **vals;
  uint64_t data_at; /* file offset of the data section */
  uint64_t max_bytes; /* the largest tensor's byte size */
} dsp_st_file;

/* Reads and checks the whole header of the open regular file fd (size
 * bytes long) against the file: a header length over 100 MiB
 * (DISPATCH_ETOOLARGE), a header that is not UTF-8 or one JSON object,
 * entries missing dtype/shape/data_offsets, offsets that overlap, leave a
 * gap or run past the end, bytes after the last tensor, duplicate names
 * (DISPATCH_EINVAL), an unknown dtype (DISPATCH_EDTYPE), a rank over
 * DSP_MAX_DIMS (DISPATCH_EDIM), sizes that overflow (DISPATCH_EOVERFLOW),
 * a shape whose byte size differs from its offsets (DISPATCH_ESHAPE).
 * 0 with *f filled, or a code with *f empty. */
int dsp_st_read_header(dsp_ctx *ctx, int fd, uint64_t size, const char *path,
                       dsp_st_file *f);
void dsp_st_file_release(dsp_st_file *f);

/* The metadata value of key in f, or NULL. */
const char *dsp_st_meta(const dsp_st_file *f, const char *key);

/* Puts "PREFIX: " (printf-formatted) before the message ctx holds;
 * returns rc. */
int dsp_st_prefix_err(dsp_ctx *ctx, int rc, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* write(2) all n bytes, retrying EINTR: 0, or -1 with errno set. */
int dsp_write_all(int fd, const void *p, size_t n);
/* pread(2) all n bytes at off: 0, or -1 with errno set (0 for a file
 * shorter than off + n). */
int dsp_pread_all(int fd, void *p, size_t n, uint64_t off);

#endif
