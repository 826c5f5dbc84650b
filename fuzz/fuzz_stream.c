/* libFuzzer target 3: the whole request handler. The input is the byte
 * stream a client sends (hello first), split into frames, decoded,
 * validated and executed in sequence against a scratch session: uploads
 * with bulk, ops, track, backward, grad, step, free, read, stats. After
 * teardown every counter must be back to zero. */
#include "fz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_outcome o;
  if (fz_run(data, size, 0, 0, &o) == 0) {
    if (o.leak) __builtin_trap();
    if (o.rc == DISPATCH_EINTERNAL) __builtin_trap();
  }
  return 0;
}
