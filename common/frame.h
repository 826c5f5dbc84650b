/* Frame header codec shared by server and client (no I/O here).
 *
 * A frame is a 16-byte header, then msg_len bytes of one protobuf message,
 * then bulk_len raw bytes (tensor data) that land straight in storage:
 *   offset 0  u32 little-endian  msg_len
 *   offset 4  u32 little-endian  flags (must be 0 in version 1)
 *   offset 8  u64 little-endian  bulk_len
 */
#ifndef DSP_FRAME_H
#define DSP_FRAME_H

#include <stdint.h>

#define DSP_FRAME_HEADER_SIZE 16
#define DSP_PROTO_MAJOR 1
#define DSP_PROTO_MINOR 7

typedef struct dsp_frame_header {
  uint32_t msg_len;
  uint32_t flags;
  uint64_t bulk_len;
} dsp_frame_header;

void dsp_frame_header_encode(uint8_t out[DSP_FRAME_HEADER_SIZE],
                             const dsp_frame_header *h);
/* Decodes and checks a header before anything is allocated: msg_len must
 * be at most max_msg, bulk_len at most max_bulk, flags 0. Returns 0 or
 * DISPATCH_ETOOLARGE / DISPATCH_EPROTO. */
int dsp_frame_header_decode(const uint8_t in[DSP_FRAME_HEADER_SIZE],
                            uint64_t max_msg, uint64_t max_bulk,
                            dsp_frame_header *h);

#endif
