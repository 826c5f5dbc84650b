/* Shared by the libFuzzer targets (fuzz/fuzz_*.c, clang) and the
 * regression suite (tests/test_fuzz_regress.c, gcc, which includes
 * fz_common.c): the capped server config, the seeded scratch session, the
 * "recipe" encoding of the session target and the one handler entry point
 * fz_run (frames -> decode -> validate -> execute -> teardown). */
#ifndef FZ_COMMON_H
#define FZ_COMMON_H

#include <stddef.h>
#include <stdint.h>

#include "sv.h"

/* Small limits so a fuzzer explores logic instead of allocating gigabytes:
 * 64 KiB frames, 4096 elements per tensor, 256 KiB per session. */
void fz_config(sv_config *c);
/* That config, made once per process (and the log level set from it). */
const sv_config *fz_config_once(void);

/* A growable byte buffer (dsp_malloc); on allocation failure it marks
 * itself failed and ignores further appends. */
typedef struct fz_buf {
  uint8_t *p;
  size_t n, cap;
  int failed;
} fz_buf;
void fz_buf_put(fz_buf *b, const void *p, size_t n);
void fz_buf_free(fz_buf *b);
/* Appends one frame: header + packed req + bulk (bulk_len may differ from
 * the bytes given: missing bytes are zeros). */
void fz_frame(fz_buf *b, const Dspwire__Request *req, const void *bulk,
              size_t have, uint64_t bulk_len);

/* The frames that seed the scratch session (after a hello): f32 tensors
 * 1 [2,3] and 2 [3,2] (tracked), 3 scalar f32, 4 i64 [3] = {0,2,1},
 * 5 bool [2,3], 6 f32 [1,1,4,4], 7 f32 [2,1,3,3], 8 = matmul(1,2),
 * 9 = sum(8), gradients container 1 from backward(9, retain), and
 * 10/11/12 f32 [2,3] (sgd velocity, adam m and v). */
void fz_seed_frames(fz_buf *b);

/* Turns a recipe (the session target's input: a compact byte program of
 * uploads, ops, track, backward, grad, step, free, read, sync, stats and
 * raw messages over small ids) into frames. */
void fz_recipe_frames(const uint8_t *in, size_t n, fz_buf *out);

typedef struct fz_outcome {
  int rc;             /* sv_stream_exec's return for the input's frames */
  sv_stream_stats st; /* its stats */
  int seed_rc;        /* the seeding stream's return (0 expected) */
  int leak;           /* the session's table, its counters and the
                         server-wide ones disagreed after the stream, or were not zero after teardown */
} fz_outcome;

/* The handler entry point: a fresh session (seeded with fz_seed_frames
 * when seeded), the input's frames run after a hello when hello_done,
 * then teardown and the check that the server-wide tensor and byte
 * counters and the session's queued bytes are back to zero. Returns 0, or
 * -1 when the session could not be made (out of memory). */
int fz_run(const uint8_t *p, size_t n, int seeded, int hello_done,
           fz_outcome *o);

/* Installs a dsp allocator that fails only the at-th allocation from now
 * (0: none), and puts the default one back. */
void fz_fail_alloc(long at);
void fz_fail_alloc_off(void);
/* The out-of-memory form of the session target: in[0..1] (little-endian)
 * + 1 is the allocation to fail, the rest a recipe run like the session
 * target's (seeded, the seeding may fail too). Returns fz_run's value, 0
 * for an input too short to say. */
int fz_run_oom(const uint8_t *in, size_t n, fz_outcome *o);

#endif
