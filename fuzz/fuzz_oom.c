/* libFuzzer target 4: the session target with one allocation failing (the
 * input's first two bytes pick which). Every error path of decode, upload,
 * validation, ops, autodiff and replies must return DISPATCH_ENOMEM
 * without a crash, a leak (LeakSanitizer) or counters out of step. */
#include "fz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_outcome o;
  if (fz_run_oom(data, size, &o) == 0) {
    if (o.leak) __builtin_trap();
    if (o.rc == DISPATCH_EINTERNAL) __builtin_trap();
  }
  return 0;
}
