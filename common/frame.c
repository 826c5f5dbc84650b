/* Frame header codec: explicit little-endian, limits checked first. */
#include "frame.h"

#include <stdio.h>

#include "dispatch_errors.h"
#include "dsp.h"

/* Byte by byte so the layout is little-endian on any host; written so gcc
 * merges each into one load or store (an 8-byte loop stayed a loop of 56
 * instructions a header on the client's path of every request). */
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  put32(p, (uint32_t)v);
  put32(p + 4, (uint32_t)(v >> 32));
}
static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
         (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}

void dsp_frame_header_encode(uint8_t out[DSP_FRAME_HEADER_SIZE],
                             const dsp_frame_header *h) {
  put32(out, h->msg_len);
  put32(out + 4, h->flags);
  put64(out + 8, h->bulk_len);
}

int dsp_frame_header_decode(const uint8_t in[DSP_FRAME_HEADER_SIZE],
                            uint64_t max_msg, uint64_t max_bulk,
                            dsp_frame_header *h) {
  h->msg_len = get32(in);
  h->flags = get32(in + 4);
  h->bulk_len = get64(in + 8);
  if (h->flags != 0) return DISPATCH_EPROTO;
  if (h->msg_len > max_msg || h->bulk_len > max_bulk) return DISPATCH_ETOOLARGE;
  return 0;
}

unsigned dsp_dtype_wire_minor(int dt) {
  return dt == DSP_F16 || dt == DSP_BF16 ? DSP_PROTO_MINOR_HALF : 0;
}

int dsp_dtype_wire_refusal(int dt, unsigned minor, const char *who, char *buf,
                           size_t len) {
  unsigned need = dsp_dtype_wire_minor(dt);
  if (minor >= need) return 0;
  snprintf(buf, len, "%s needs protocol %d.%u; the %s speaks %d.%u",
           dsp_dtype_name((dsp_dtype)dt), DSP_PROTO_MAJOR, need, who,
           DSP_PROTO_MAJOR, minor);
  return 1;
}
