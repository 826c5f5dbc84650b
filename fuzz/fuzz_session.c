/* libFuzzer target 2: the request validator. The input is a recipe
 * (fz_common.c) of requests over small ids, turned into frames and run by
 * sv_session_exec on a scratch session seeded with tensors, tracked
 * leaves and a gradient container, so ids, shapes, dtypes, attributes and
 * byte counts are checked against live state. */
#include "fz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fz_buf b = {0};
  fz_recipe_frames(data, size, &b);
  fz_outcome o;
  if (!b.failed && fz_run(b.p, b.n, 1, 1, &o) == 0) {
    if (o.seed_rc != 0) __builtin_trap(); /* the seeding must always work */
    if (o.leak) __builtin_trap();         /* counters off after teardown */
    if (o.rc == DISPATCH_EINTERNAL) __builtin_trap(); /* a bad reply */
  }
  fz_buf_free(&b);
  return 0;
}
