/* Every seed of the fuzz corpora and every crash the fuzzers found
 * (tests/fuzz_corpus/regress/) runs through the fuzzers' own handler entry
 * point, fz_run (frames -> decode -> validate -> execute on a scratch
 * session -> teardown), built here with gcc. Each must return without
 * crashing, leave the server-wide counters at zero, and end the way its
 * file name says (see fuzz/gen_seeds.c):
 *   .ok  runs, no error reply        .any  anything but a crash or leak
 *   .trunc  the stream ends inside a frame
 *   .EPROTO / .ETOOLARGE / .EVERSION  the stream is refused with that code
 *   .err-ENAME  runs, the first error reply carries DISPATCH_ENAME
 * A regress file is named <target>-<what>.<expect>, target being frame,
 * stream, session or oom (the input format); the oom inputs (a failing
 * allocation) are only held to "no crash, no leak, counters in step". */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../fuzz/fz_common.c"

static const char *corpus_dir(void) {
  static char dir[512];
  const char *env = getenv("DISPATCH_FUZZ_CORPUS");
  if (env) return env;
  /* the suites run from the repository root; __FILE__ is tests/... */
  snprintf(dir, sizeof dir, "%s", __FILE__);
  char *slash = strrchr(dir, '/');
  if (slash) snprintf(slash + 1, sizeof dir - (size_t)(slash + 1 - dir),
                      "fuzz_corpus");
  else snprintf(dir, sizeof dir, "tests/fuzz_corpus");
  return dir;
}

static int code_of(const char *name) {
  char full[64];
  snprintf(full, sizeof full, "DISPATCH_%s", name);
  for (int c = -1; c > -64; c--)
    if (strcmp(dispatch_err_name(c), full) == 0) return c;
  return 1; /* no such code: never matches */
}

static uint8_t *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  uint8_t *buf = NULL;
  size_t cap = 0;
  *n = 0;
  for (;;) {
    if (*n == cap) {
      cap = cap ? cap * 2 : 4096;
      uint8_t *q = realloc(buf, cap);
      if (!q) break;
      buf = q;
    }
    size_t got = fread(buf + *n, 1, cap - *n, f);
    *n += got;
    if (got == 0) break;
  }
  fclose(f);
  return buf ? buf : malloc(1);
}

typedef enum { FMT_FRAME, FMT_STREAM, FMT_SESSION, FMT_OOM } fmt;

/* Runs one file and checks its outcome against its name. */
static void check_file(const char *path, const char *name, fmt f) {
  size_t n;
  uint8_t *data = slurp(path, &n);
  cr_assert(data, "cannot read %s", path);
  fz_outcome o;
  int rc;
  if (f == FMT_OOM) {
    rc = n < 2 ? -1 : fz_run_oom(data, n, &o);
    free(data);
    /* a failed allocation may stop the seeding or the session itself */
    cr_expect(rc == 0 || rc == -1, "%s: fz_run_oom gave %d", name, rc);
    if (rc == 0) {
      cr_expect(!o.leak, "%s: counters out of step", name);
      cr_expect_neq(o.rc, DISPATCH_EINTERNAL, "%s: a reply did not decode",
                    name);
    }
    return;
  }
  if (f == FMT_SESSION) {
    fz_buf b = {0};
    fz_recipe_frames(data, n, &b);
    cr_assert(!b.failed, "%s: recipe out of memory", name);
    rc = fz_run(b.p, b.n, 1, 1, &o);
    fz_buf_free(&b);
  } else {
    rc = fz_run(data, n, 0, f == FMT_FRAME, &o);
  }
  free(data);
  cr_assert_eq(rc, 0, "%s: no scratch session", name);
  cr_expect_eq(o.seed_rc, 0, "%s: seeding failed with %s", name,
               dispatch_err_name(o.seed_rc));
  cr_expect(!o.leak, "%s: counters not back to zero after teardown", name);
  cr_expect_neq(o.rc, DISPATCH_EINTERNAL, "%s: a reply did not decode",
                name);
  const char *dot = strrchr(name, '.');
  cr_assert(dot, "%s: no expected outcome in the name", name);
  const char *exp = dot + 1;
  if (strcmp(exp, "any") == 0) return;
  if (strcmp(exp, "ok") == 0) {
    cr_expect_eq(o.rc, 0, "%s: refused with %s", name,
                 dispatch_err_name(o.rc));
    cr_expect_eq(o.st.error_replies, 0, "%s: error reply %s", name,
                 dispatch_err_name(o.st.first_error));
    cr_expect(!o.st.truncated, "%s: truncated", name);
  } else if (strcmp(exp, "trunc") == 0) {
    cr_expect_eq(o.rc, 0, "%s: refused with %s", name,
                 dispatch_err_name(o.rc));
    cr_expect(o.st.truncated, "%s: not seen as truncated", name);
  } else if (strncmp(exp, "err-", 4) == 0) {
    cr_expect_eq(o.rc, 0, "%s: refused with %s", name,
                 dispatch_err_name(o.rc));
    cr_expect_eq(o.st.first_error, code_of(exp + 4),
                 "%s: first error reply %s, expected DISPATCH_%s", name,
                 dispatch_err_name(o.st.first_error), exp + 4);
  } else {
    cr_expect_eq(o.rc, code_of(exp), "%s: ended with %s, expected "
                 "DISPATCH_%s", name, dispatch_err_name(o.rc), exp);
  }
}

/* Runs every file of a corpus folder; returns how many. */
static int run_dir(const char *sub, int by_prefix, fmt f) {
  char dir[600];
  snprintf(dir, sizeof dir, "%s/%s", corpus_dir(), sub);
  DIR *d = opendir(dir);
  cr_assert(d, "cannot open %s", dir);
  int count = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
    fmt ff = f;
    if (by_prefix) {
      if (strncmp(e->d_name, "frame-", 6) == 0) ff = FMT_FRAME;
      else if (strncmp(e->d_name, "stream-", 7) == 0) ff = FMT_STREAM;
      else if (strncmp(e->d_name, "session-", 8) == 0) ff = FMT_SESSION;
      else if (strncmp(e->d_name, "oom-", 4) == 0) ff = FMT_OOM;
      else cr_assert_fail("%s: name does not start with a target", path);
    }
    check_file(path, e->d_name, ff);
    count++;
  }
  closedir(d);
  return count;
}

Test(fuzz_regress, stream_seeds) {
  cr_assert_geq(run_dir("stream", 0, FMT_STREAM), 20);
}

Test(fuzz_regress, frame_seeds) {
  cr_assert_geq(run_dir("frame", 0, FMT_FRAME), 5);
}

Test(fuzz_regress, session_seeds) {
  cr_assert_geq(run_dir("session", 0, FMT_SESSION), 5);
}

/* Under a failing allocation only "no crash, no leak, counters in step"
 * is expected (the .any of every name); leaks show under make sanitize
 * and valgrind. */
Test(fuzz_regress, oom_seeds) {
  cr_assert_geq(run_dir("oom", 0, FMT_OOM), 5);
}

Test(fuzz_regress, crashes_found) {
  run_dir("regress", 1, FMT_STREAM);
}

/* The seeded scratch session itself: every seeding request must succeed
 * and a read of its matmul answers without error, so the recipes really
 * run against live tensors and a gradient container. */
Test(fuzz_regress, seeded_session_is_live) {
  fz_buf b = {0};
  uint8_t rec[] = {7, 8}; /* read 8 = matmul(1, 2) */
  fz_recipe_frames(rec, sizeof rec, &b);
  fz_outcome o;
  cr_assert_eq(fz_run(b.p, b.n, 1, 1, &o), 0);
  fz_buf_free(&b);
  cr_assert_eq(o.seed_rc, 0);
  cr_assert_eq(o.rc, 0);
  cr_assert_eq(o.st.replies, 1);
  cr_assert_eq(o.st.error_replies, 0);
  cr_assert(!o.leak);
}

/* ------------------------------------------------ issue 9's shapes
 * The recipe kinds 0xf0..0xf3 must build what they are there for; a
 * generator that quietly built something else would leave the fuzzers
 * blind to them. Each test decodes the frames a recipe makes. */

typedef struct decoded {
  Dspwire__Request *req[64];
  uint64_t bulk[64];
  int n;
} decoded;

static void decode_recipe(const uint8_t *rec, size_t n, decoded *d) {
  fz_buf b = {0};
  fz_recipe_frames(rec, n, &b);
  cr_assert(!b.failed);
  memset(d, 0, sizeof *d);
  size_t at = 0;
  while (at < b.n) {
    cr_assert_lt(d->n, 64);
    dsp_frame_header h;
    cr_assert_eq(dsp_frame_header_decode(b.p + at, UINT32_MAX, UINT64_MAX,
                                         &h), 0);
    at += DSP_FRAME_HEADER_SIZE;
    cr_assert_leq(at + h.msg_len + h.bulk_len, b.n);
    d->req[d->n] = dspwire__request__unpack(NULL, h.msg_len, b.p + at);
    cr_assert(d->req[d->n], "frame %d does not decode", d->n);
    d->bulk[d->n++] = h.bulk_len;
    at += h.msg_len + h.bulk_len;
  }
  fz_buf_free(&b);
}

static void decoded_free(decoded *d) {
  for (int i = 0; i < d->n; i++)
    dspwire__request__free_unpacked(d->req[i], NULL);
}

/* Runs a recipe on the seeded session: no error reply, `replies` replies
 * in all, counters in step. */
static void run_recipe_clean(const uint8_t *rec, size_t n, uint64_t replies) {
  fz_buf b = {0};
  fz_recipe_frames(rec, n, &b);
  fz_outcome o;
  cr_assert_eq(fz_run(b.p, b.n, 1, 1, &o), 0);
  fz_buf_free(&b);
  cr_assert_eq(o.seed_rc, 0);
  cr_assert_eq(o.rc, 0);
  cr_assert_eq(o.st.error_replies, 0, "%s",
               dispatch_err_name(o.st.first_error));
  cr_assert_eq(o.st.replies, replies);
  cr_assert(!o.leak);
}

/* a zero among the dims and one of at least 2^32 */
static int zero_beside_huge(const int64_t *v, size_t n) {
  int zero = 0, huge = 0;
  for (size_t i = 0; i < n; i++) {
    zero |= v[i] == 0;
    huge |= v[i] >= ((int64_t)1 << 32);
  }
  return zero && huge;
}

Test(fuzz_regress, recipe_zero_size_upload) {
  /* every shape of the table: an upload with no bulk, then a softmax */
  for (uint8_t k = 0; k < 16; k++) {
    uint8_t rec[] = {0xf0, 0, k, 0, 1, 0, 1, 1, 0, 1};
    decoded d;
    decode_recipe(rec, sizeof rec, &d);
    cr_assert_eq(d.n, 3, "shape %u: %d frames", k, d.n);
    Dspwire__Request *u = d.req[0];
    cr_assert_eq(u->body_case, DSPWIRE__REQUEST__BODY_UPLOAD);
    cr_assert_eq(d.bulk[0], 0);
    int64_t numel = 1;
    for (size_t i = 0; i < u->upload->meta->n_shape; i++)
      numel = u->upload->meta->shape[i] == 0 ? 0 : numel;
    cr_assert_eq(numel, 0, "shape %u has no zero dim", k);
    cr_assert_eq(d.req[1]->body_case, DSPWIRE__REQUEST__BODY_OP);
    cr_assert_eq(d.req[1]->op->op, DSP_OP_SOFTMAX);
    cr_assert_eq(d.req[1]->op->inputs[0], u->upload->id);
    cr_assert_eq(d.req[2]->body_case, DSPWIRE__REQUEST__BODY_READ);
    decoded_free(&d);
  }
  uint8_t rec[] = {0xf0, 0, 0, 0, 0, 0};
  decoded d;
  decode_recipe(rec, sizeof rec, &d);
  cr_assert(zero_beside_huge(d.req[0]->upload->meta->shape,
                             d.req[0]->upload->meta->n_shape));
  decoded_free(&d);
}

Test(fuzz_regress, recipe_zero_size_attribute_shapes) {
  int seen_create = 0, seen_reshape = 0, seen_backward = 0;
  for (uint8_t k = 0; k < 11; k++) {
    uint8_t rec[] = {0xf1, k, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 0};
    decoded d;
    decode_recipe(rec, sizeof rec, &d);
    cr_assert_geq(d.n, 1);
    Dspwire__Op *o = d.req[0]->op;
    cr_assert_eq(d.req[0]->body_case, DSPWIRE__REQUEST__BODY_OP);
    cr_assert(zero_beside_huge(o->ints, o->n_ints),
              "op %d: no zero-size shape among its ints", o->op);
    seen_create |= o->op == DSP_OP_ZEROS;
    seen_reshape |= o->op == DSP_OP_RESHAPE;
    seen_backward |= o->op == DSP_OP_SLICE_BACKWARD;
    decoded_free(&d);
  }
  cr_assert(seen_create && seen_reshape && seen_backward);
}

Test(fuzz_regress, recipe_steps_between_reads) {
  /* 4 rounds: read 1, step (sgd, adam, sgd, adam), read 1 */
  uint8_t rec[] = {0xf2, 3, 0x05, 0x07, 0x05, 0x07};
  decoded d;
  decode_recipe(rec, sizeof rec, &d);
  cr_assert_eq(d.n, 12);
  for (int k = 0; k < 4; k++) {
    Dspwire__Request **r = d.req + 3 * k;
    cr_assert_eq(r[0]->body_case, DSPWIRE__REQUEST__BODY_READ);
    cr_assert_eq(r[1]->body_case, DSPWIRE__REQUEST__BODY_STEP);
    cr_assert_eq(r[2]->body_case, DSPWIRE__REQUEST__BODY_READ);
    cr_assert_eq(r[1]->step->op, k & 1 ? DSP_OP_ADAM_STEP : DSP_OP_SGD_STEP);
    cr_assert_eq(r[1]->step->params[0], r[0]->read->id);
    cr_assert_eq(r[2]->read->id, r[0]->read->id);
  }
  decoded_free(&d);
  /* and the whole recipe runs on the seeded session without an error */
  run_recipe_clean(rec, sizeof rec, 8); /* the reads reply */
}

Test(fuzz_regress, recipe_retained_backward_passes) {
  /* 4 passes into containers 2..5, all retained; 3 grads, each read */
  uint8_t rec[] = {0xf3, 3, 4, 3, 1, 0, 2, 1, 4, 0};
  decoded d;
  decode_recipe(rec, sizeof rec, &d);
  cr_assert_eq(d.n, 10);
  for (int k = 0; k < 4; k++) {
    cr_assert_eq(d.req[k]->body_case, DSPWIRE__REQUEST__BODY_BACKWARD);
    cr_assert(d.req[k]->backward->retain);
    cr_assert_eq(d.req[k]->backward->grads, 2 + (uint64_t)k);
  }
  for (int k = 4; k < 10; k += 2) {
    cr_assert_eq(d.req[k]->body_case, DSPWIRE__REQUEST__BODY_GRAD);
    cr_assert_eq(d.req[k + 1]->body_case, DSPWIRE__REQUEST__BODY_READ);
    cr_assert_eq(d.req[k + 1]->read->id, d.req[k]->grad->output);
  }
  decoded_free(&d);
  run_recipe_clean(rec, sizeof rec, 7); /* the passes and the reads */
}

/* ------------------------------------------------ 1.3 Ops records
 * Kind 0xf4..0xf7 builds one Ops request: well-formed records run on the
 * seeded session, and each mode byte from 0xf0 and a cut byte from 0xf8
 * make the malformation the loop refuses. */
Test(fuzz_regress, recipe_ops_records) {
  /* add(1,1)->13, matmul(1,2)->14 with no_grad, add(13,13)->15; read 15 */
  static const uint8_t ok[] = {0xf4, 2, 0,  2, 1, 1, 13, 0, 0, 0,  47, 2,
                               1,    2, 14, 0, 0, 1, 0,  2, 13, 13, 15, 0,
                               0,    0, 0,  7, 15};
  decoded d;
  decode_recipe(ok, sizeof ok, &d);
  cr_assert_eq(d.n, 2);
  cr_assert_eq(d.req[0]->body_case, DSPWIRE__REQUEST__BODY_OPS);
  const ProtobufCBinaryData *rb = &d.req[0]->ops->records;
  const uint8_t *p = rb->data, *end = rb->data + rb->len;
  dsp_oprec r;
  char why[128];
  int n = 0, no_grad = 0;
  while (p < end) {
    cr_assert_eq(dsp_oprec_next(&p, end, &r, why, sizeof why), 0, "%s", why);
    no_grad += r.no_grad;
    n++;
  }
  cr_assert_eq(n, 3);
  cr_assert_eq(no_grad, 1);
  decoded_free(&d);
  run_recipe_clean(ok, sizeof ok, 1);
  /* each malformation: the stream ends with a protocol error */
  for (int m = 0; m < 5; m++) {
    uint8_t bad[] = {0xf5, 0, 0, 2, 1, 1, 13, 0, 0, 0, 0};
    if (m < 4) bad[9] = (uint8_t)(0xf0 | m); /* flag, pad, count, code */
    else bad[10] = 0xfb;                      /* 4 bytes cut */
    fz_buf b = {0};
    fz_recipe_frames(bad, sizeof bad, &b);
    fz_outcome o;
    cr_assert_eq(fz_run(b.p, b.n, 1, 1, &o), 0);
    fz_buf_free(&b);
    cr_assert_eq(o.rc, DISPATCH_EPROTO, "malformation %d: %s", m,
                 dispatch_err_name(o.rc));
    cr_assert(!o.leak);
  }
}
