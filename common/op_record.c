/* Packed op records (see op_record.h). Little-endian on any host: each
 * value is one unaligned load or store (memcpy) and a byte-order
 * conversion that is nothing on a little-endian host. */
#include "op_record.h"

#include <endian.h>
#include <stdio.h>
#include <string.h>

static void put64(uint8_t *p, uint64_t v) {
  v = htole64(v);
  memcpy(p, &v, sizeof v);
}
static uint64_t get64(const uint8_t *p) {
  uint64_t v;
  memcpy(&v, p, sizeof v);
  return le64toh(v);
}

int dsp_oprec_fits(int n_in, int n_ints, int n_floats) {
  return n_in >= 0 && n_in <= DSP_MAX_INPUTS && n_ints >= 0 &&
         n_ints <= DSP_MAX_ATTR_INTS && n_floats >= 0 &&
         n_floats <= DSP_MAX_ATTR_FLOATS;
}

size_t dsp_oprec_put(uint8_t *p, int op, int no_grad, const uint64_t *in,
                     int n_in, uint64_t out, const int64_t *ints, int n_ints,
                     const double *floats, int n_floats) {
  p[0] = (uint8_t)op;
  p[1] = no_grad ? DSP_OPREC_NO_GRAD : 0;
  p[2] = (uint8_t)n_in;
  p[3] = (uint8_t)n_ints;
  p[4] = (uint8_t)n_floats;
  p[5] = p[6] = p[7] = 0;
  put64(p + 8, out);
  uint8_t *q = p + DSP_OPREC_FIXED;
  for (int i = 0; i < n_in; i++, q += 8) put64(q, in[i]);
  for (int i = 0; i < n_ints; i++, q += 8) put64(q, (uint64_t)ints[i]);
  for (int i = 0; i < n_floats; i++, q += 8) {
    uint64_t bits;
    memcpy(&bits, &floats[i], sizeof bits);
    put64(q, bits);
  }
  return (size_t)(q - p);
}

int dsp_oprec_next(const uint8_t **p, const uint8_t *end, dsp_oprec *r,
                   char *why, size_t len) {
  const uint8_t *q = *p;
  size_t left = (size_t)(end - q);
  if (left < DSP_OPREC_FIXED) {
    snprintf(why, len, "op record cut short (%zu bytes, at least %d)", left,
             DSP_OPREC_FIXED);
    return -1;
  }
  r->op = q[0];
  r->no_grad = q[1] & DSP_OPREC_NO_GRAD;
  r->n_in = q[2];
  r->n_ints = q[3];
  r->n_floats = q[4];
  if ((q[1] & ~DSP_OPREC_NO_GRAD) || q[5] || q[6] || q[7]) {
    snprintf(why, len, "op record with unknown flags or padding");
    return -1;
  }
  if (!dsp_oprec_fits(r->n_in, r->n_ints, r->n_floats)) {
    snprintf(why, len,
             "op record with %d inputs, %d ints, %d floats (at most %d, %d, "
             "%d)",
             r->n_in, r->n_ints, r->n_floats, DSP_MAX_INPUTS,
             DSP_MAX_ATTR_INTS, DSP_MAX_ATTR_FLOATS);
    return -1;
  }
  size_t size = dsp_oprec_size(r->n_in, r->n_ints, r->n_floats);
  if (left < size) {
    snprintf(why, len, "op record cut short (%zu bytes of %zu)", left, size);
    return -1;
  }
  r->out = get64(q + 8);
  r->in = q + DSP_OPREC_FIXED;
  r->ints = r->in + 8 * (size_t)r->n_in;
  r->floats = r->ints + 8 * (size_t)r->n_ints;
  *p = q + size;
  return 0;
}

uint64_t dsp_oprec_in(const dsp_oprec *r, int i) {
  return get64(r->in + 8 * (size_t)i);
}

const dsp_attrs *dsp_oprec_attrs(const dsp_oprec *r, dsp_attrs *a) {
  static const dsp_attrs none; /* all zero: no attributes */
  if (r->n_ints == 0 && r->n_floats == 0) return &none;
  *a = none;
  a->n_ints = r->n_ints;
  for (int i = 0; i < r->n_ints; i++)
    a->ints[i] = (int64_t)get64(r->ints + 8 * (size_t)i);
  a->n_floats = r->n_floats;
  for (int i = 0; i < r->n_floats; i++) {
    uint64_t bits = get64(r->floats + 8 * (size_t)i);
    memcpy(&a->floats[i], &bits, sizeof bits);
  }
  return a;
}
