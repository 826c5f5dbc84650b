/* The packed op records of a 1.3 Ops request (proto/README.md, "Op
 * records"): many small ops in one message, without a protobuf message per
 * op. The client writes them (client/call.c), the server reads them
 * (server/decode.c checks a whole message on the loop thread, then
 * server/handlers.c runs each record as it would an Op).
 *
 * One record, every field little-endian, sizes in bytes:
 *   0   1  op code (dsp_opcode)
 *   1   1  flags: bit 0 no_grad; the other bits must be 0
 *   2   1  n_in      inputs, at most DSP_MAX_INPUTS
 *   3   1  n_ints    int attributes, at most DSP_MAX_ATTR_INTS
 *   4   1  n_floats  float attributes, at most DSP_MAX_ATTR_FLOATS
 *   5   3  zero
 *   8   8  output id
 *   16  8 * n_in      input ids (u64)
 *   ..  8 * n_ints    int attributes (i64)
 *   ..  8 * n_floats  float attributes (IEEE-754 binary64)
 * No allocation and no I/O here. */
#ifndef DSP_OP_RECORD_H
#define DSP_OP_RECORD_H

#include <stddef.h>
#include <stdint.h>

#include "dsp.h"

#define DSP_OPREC_FIXED 16 /* header and output id */
/* Records one Ops message may carry: a message is one job on the server,
 * so this bounds what one job runs (4096 tiny ops: about a millisecond) */
#define DSP_OPREC_MAX 4096
#define DSP_OPREC_NO_GRAD 1u

/* One record as read back: the arrays stay in the message (unaligned,
 * little-endian); dsp_oprec_in and dsp_oprec_attrs copy them out. */
typedef struct dsp_oprec {
  int op;
  int no_grad;
  int n_in, n_ints, n_floats;
  uint64_t out;
  const uint8_t *in;   /* n_in ids */
  const uint8_t *ints; /* then n_ints, then n_floats values */
  const uint8_t *floats;
} dsp_oprec;

/* Bytes of a record with these counts. */
static inline size_t dsp_oprec_size(int n_in, int n_ints, int n_floats) {
  return DSP_OPREC_FIXED + 8 * (size_t)(n_in + n_ints + n_floats);
}

/* 1 when an op with these counts fits a record (each count in its byte and
 * within the limits above). */
int dsp_oprec_fits(int n_in, int n_ints, int n_floats);

/* Writes one record at p (room for dsp_oprec_size bytes; counts that
 * dsp_oprec_fits accepts) and returns its size. in, ints and floats are
 * borrowed for the call. */
size_t dsp_oprec_put(uint8_t *p, int op, int no_grad, const uint64_t *in,
                     int n_in, uint64_t out, const int64_t *ints, int n_ints,
                     const double *floats, int n_floats);

/* Reads the record at *p (end: the end of the records) into r and moves *p
 * past it. 0, or -1 with the reason in why[0..len-1] (a cut record, a
 * count over its limit, unknown flags or non-zero padding); the op code is
 * not judged here. */
int dsp_oprec_next(const uint8_t **p, const uint8_t *end, dsp_oprec *r,
                   char *why, size_t len);

/* Input i of r (i < r->n_in). */
uint64_t dsp_oprec_in(const dsp_oprec *r, int i);
/* r's attributes: a shared empty set when it has none, else a (filled
 * in, as dsp_attrs_none() with them set). */
const dsp_attrs *dsp_oprec_attrs(const dsp_oprec *r, dsp_attrs *a);

#endif
