/* libFuzzer target 1: one frame's bytes -> header limits -> protobuf
 * decode -> structural rules -> (for an upload) the upload checks against
 * a scratch session -> request description. Nothing may crash or leak,
 * and a refused frame must leave nothing allocated. */
#include <string.h>

#include "frame.h"
#include "fz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const sv_config *cfg = fz_config_once();
  if (size < DSP_FRAME_HEADER_SIZE) return 0;
  char why[512];
  dsp_frame_header h;
  if (sv_decode_header(cfg, data, &h, why, sizeof why) < 0) return 0;
  const uint8_t *msg = data + DSP_FRAME_HEADER_SIZE;
  size_t left = size - DSP_FRAME_HEADER_SIZE;
  if (left < h.msg_len) return 0;
  /* both session states: before and after the hello */
  for (int hello_done = 0; hello_done < 2; hello_done++) {
    Dspwire__Request *req;
    uint64_t rid;
    if (sv_decode_request(msg, h.msg_len, h.bulk_len, hello_done, &req, &rid,
                          why, sizeof why) < 0)
      continue;
    char desc[256];
    sv_describe(req, desc, sizeof desc);
    if (req->body_case == DSPWIRE__REQUEST__BODY_UPLOAD) {
      sv_global g;
      memset(&g, 0, sizeof g);
      dsp_ctx *io = dsp_ctx_new(dsp_cpu_backend());
      sv_session *s = io ? sv_session_new(cfg, &g, NULL) : NULL;
      if (s) {
        sv_job *j = dsp_calloc(1, sizeof *j);
        if (j) {
          j->req = req;
          req = NULL;
          j->sess = s;
          if (sv_upload_prepare(cfg, io, s, j, h.bulk_len, 0) != 0)
            __builtin_trap(); /* may_wait 0 must always judge */
          if (j->upload &&
              dsp_tensor_nbytes(j->upload) != h.bulk_len)
            __builtin_trap(); /* the bulk would overrun the tensor */
          if ((uint64_t)atomic_load(&s->queued_bytes) != j->upload_bytes)
            __builtin_trap();
          sv_job_free(j);
        }
        sv_session_teardown(s);
        dsp_free(s);
      }
      dsp_ctx_free(io);
    }
    if (req) dspwire__request__free_unpacked(req, &sv_pb_allocator);
  }
  return 0;
}
