/* Writes the seed corpora under DIR (tests/fuzz_corpus by default):
 * DIR/stream/ whole client streams (hello first), DIR/frame/ single
 * frames, DIR/session/ recipes for the session target, DIR/oom/ the same
 * recipes behind two bytes naming the allocation that fails. A file's
 * name ends in the outcome the regression suite expects (tests/test_fuzz_regress.c):
 * .ok, .any, .trunc, .EPROTO/.ETOOLARGE/.EVERSION (the stream is refused),
 * or .err-ENAME (runs, the first error reply carries DISPATCH_ENAME).
 * Run by fuzz/run.sh gen; the output is committed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fz_common.c"

static const char *g_dir;

static void save(const char *sub, const char *name, const fz_buf *b) {
  char path[512];
  snprintf(path, sizeof path, "%s/%s/%s", g_dir, sub, name);
  FILE *f = fopen(path, "wb");
  if (!f || (b->n && fwrite(b->p, 1, b->n, f) != b->n)) {
    fprintf(stderr, "gen_seeds: cannot write %s\n", path);
    exit(1);
  }
  fclose(f);
}

static void hello(fz_buf *b, unsigned major) {
  dsp_wreq w;
  put(b, dsp_wreq_hello(&w, major, 0, NULL, "seed"));
}

static void bye_(fz_buf *b) {
  dsp_wreq w;
  put(b, dsp_wreq_bye(&w));
}

/* the shorter names the seed lists below were written with */
#define sync_ put_sync
#define stats_ put_stats
#define read_ put_read
#define grad_ put_grad
#define free_ put_free
#define step_ put_step

static void raw_header(fz_buf *b, uint32_t msg_len, uint32_t flags,
                       uint64_t bulk_len) {
  uint8_t hdr[DSP_FRAME_HEADER_SIZE];
  dsp_frame_header h = {msg_len, flags, bulk_len};
  dsp_frame_header_encode(hdr, &h);
  fz_buf_put(b, hdr, sizeof hdr);
}

static const float F6[6] = {1, -2, 3, 0.5f, -0.25f, 4};
static const int64_t S23[2] = {2, 3}, S32[2] = {3, 2}, S6[1] = {6};

static void u23(fz_buf *b, uint64_t id) {
  put_upload(b, id, DSP_F32, 2, S23, F6, sizeof F6, sizeof F6);
}

static void streams(void) {
  fz_buf b = {0};
#define NEW() (fz_buf_free(&b), g_rid = 1, hello(&b, DSP_PROTO_MAJOR))
  uint64_t in2[2], in1[1], in3[3];

  NEW();
  stats_(&b);
  save("stream", "hello_stats.ok", &b);

  NEW();
  u23(&b, 1);
  read_(&b, 1);
  in1[0] = 1;
  free_(&b, in1, 1, NULL, 0);
  stats_(&b);
  save("stream", "upload_read_free.ok", &b);

  NEW(); /* an op chain */
  u23(&b, 1);
  put_upload(&b, 2, DSP_F32, 2, S32, F6, sizeof F6, sizeof F6);
  in2[0] = 1, in2[1] = 1;
  put_op(&b, DSP_OP_ADD, in2, 2, 3, NULL, 0, NULL, 0);
  double two = 2;
  in1[0] = 3;
  put_op(&b, DSP_OP_MUL_SCALAR, in1, 1, 4, NULL, 0, &two, 1);
  in2[0] = 4, in2[1] = 2;
  put_op(&b, DSP_OP_MATMUL, in2, 2, 5, NULL, 0, NULL, 0);
  in1[0] = 5;
  put_op(&b, DSP_OP_RELU, in1, 1, 6, NULL, 0, NULL, 0);
  in1[0] = 6;
  put_op(&b, DSP_OP_SUM, in1, 1, 7, NULL, 0, NULL, 0);
  read_(&b, 7);
  sync_(&b);
  save("stream", "op_chain.ok", &b);

  NEW(); /* autodiff and both optimizer steps */
  u23(&b, 1);
  put_upload(&b, 2, DSP_F32, 2, S32, F6, sizeof F6, sizeof F6);
  put_track(&b, 1);
  put_track(&b, 2);
  in2[0] = 1, in2[1] = 2;
  put_op(&b, DSP_OP_MATMUL, in2, 2, 3, NULL, 0, NULL, 0);
  in1[0] = 3;
  put_op(&b, DSP_OP_MEAN, in1, 1, 4, NULL, 0, NULL, 0);
  put_backward(&b, 4, 1, 0);
  grad_(&b, 1, 1, 5);
  read_(&b, 5);
  u23(&b, 6); /* sgd velocity */
  put_upload(&b, 7, DSP_F32, 2, S32, F6, sizeof F6, sizeof F6); /* adam m */
  put_upload(&b, 8, DSP_F32, 2, S32, F6, sizeof F6, sizeof F6); /* adam v */
  uint64_t p1 = 1, p2 = 2, st2[2] = {7, 8}, v1 = 6;
  double sgd[3] = {0.1, 0.9, 0};
  step_(&b, DSP_OP_SGD_STEP, 1, &p1, 1, &v1, 1, NULL, 0, sgd, 3);
  double adam[4] = {0.01, 0.9, 0.999, 1e-8};
  int64_t t1 = 1;
  step_(&b, DSP_OP_ADAM_STEP, 1, &p2, 1, st2, 2, &t1, 1, adam, 4);
  free_(&b, NULL, 0, &p1, 1);
  read_(&b, 1);
  stats_(&b);
  save("stream", "autodiff_steps.ok", &b);

  NEW(); /* shape ops */
  u23(&b, 1);
  int64_t idx[2] = {2, 0};
  int64_t s2i[1] = {2};
  put_upload(&b, 2, DSP_I64, 1, s2i, idx, sizeof idx, sizeof idx);
  in1[0] = 1;
  int64_t rs[2] = {3, -1};
  put_op(&b, DSP_OP_RESHAPE, in1, 1, 3, rs, 2, NULL, 0);
  int64_t pm[2] = {1, 0};
  put_op(&b, DSP_OP_PERMUTE, in1, 1, 4, pm, 2, NULL, 0);
  put_op(&b, DSP_OP_TRANSPOSE, in1, 1, 5, pm, 2, NULL, 0);
  int64_t sl[4] = {1, 0, 3, 2};
  put_op(&b, DSP_OP_SLICE, in1, 1, 6, sl, 4, NULL, 0);
  in2[0] = 1, in2[1] = 1;
  int64_t d0 = 0;
  put_op(&b, DSP_OP_CAT, in2, 2, 7, &d0, 1, NULL, 0);
  put_op(&b, DSP_OP_STACK, in2, 2, 8, &d0, 1, NULL, 0);
  in2[0] = 1, in2[1] = 2;
  int64_t d1 = 1;
  put_op(&b, DSP_OP_INDEX_SELECT, in2, 2, 9, &d1, 1, NULL, 0);
  int64_t dt = DSP_F64;
  put_op(&b, DSP_OP_CAST, in1, 1, 10, &dt, 1, NULL, 0);
  int64_t bt[3] = {2, 2, 3};
  put_op(&b, DSP_OP_BROADCAST_TO, in1, 1, 11, bt, 3, NULL, 0);
  put_op(&b, DSP_OP_ARGMAX, in1, 1, 12, &d1, 1, NULL, 0);
  read_(&b, 9);
  sync_(&b);
  save("stream", "shape_ops.ok", &b);

  NEW(); /* nn ops */
  u23(&b, 1);
  int64_t lab[2] = {2, 0};
  put_upload(&b, 2, DSP_I64, 1, s2i, lab, sizeof lab, sizeof lab);
  float img[16];
  for (int i = 0; i < 16; i++) img[i] = (float)i - 7;
  int64_t s1144[4] = {1, 1, 4, 4}, s1122[4] = {1, 1, 2, 2};
  put_upload(&b, 3, DSP_F32, 4, s1144, img, sizeof img, sizeof img);
  put_upload(&b, 4, DSP_F32, 4, s1122, img, 16, 16);
  in1[0] = 1;
  put_op(&b, DSP_OP_SOFTMAX, in1, 1, 5, &d1, 1, NULL, 0);
  put_op(&b, DSP_OP_LOG_SOFTMAX, in1, 1, 6, &d1, 1, NULL, 0);
  in2[0] = 1, in2[1] = 2;
  put_op(&b, DSP_OP_CROSS_ENTROPY, in2, 2, 7, NULL, 0, NULL, 0);
  in2[0] = 1, in2[1] = 1;
  put_op(&b, DSP_OP_MSE, in2, 2, 8, NULL, 0, NULL, 0);
  in2[0] = 3, in2[1] = 4;
  put_op(&b, DSP_OP_CONV2D, in2, 2, 9, NULL, 0, NULL, 0);
  in1[0] = 3;
  int64_t pk[2] = {2, 2};
  put_op(&b, DSP_OP_MAX_POOL2D, in1, 1, 10, pk, 2, NULL, 0);
  put_op(&b, DSP_OP_AVG_POOL2D, in1, 1, 11, pk, 2, NULL, 0);
  double p = 0.5;
  int64_t seed = 7;
  put_op(&b, DSP_OP_DROPOUT, in1, 1, 12, &seed, 1, &p, 1);
  read_(&b, 9);
  sync_(&b);
  save("stream", "nn_ops.ok", &b);

  NEW(); /* creation ops */
  int64_t zs[3] = {DSP_F32, 2, 3};
  put_op(&b, DSP_OP_ZEROS, NULL, 0, 1, zs, 3, NULL, 0);
  put_op(&b, DSP_OP_ONES, NULL, 0, 2, zs, 3, NULL, 0);
  double v = 3.5;
  put_op(&b, DSP_OP_FULL, NULL, 0, 3, zs, 3, &v, 1);
  int64_t ad = DSP_F64;
  double ar[3] = {0, 5, 0.5};
  put_op(&b, DSP_OP_ARANGE, NULL, 0, 4, &ad, 1, ar, 3);
  int64_t us[4] = {DSP_F32, 42, 4, 4};
  double ur[2] = {-1, 1};
  put_op(&b, DSP_OP_UNIFORM, NULL, 0, 5, us, 4, ur, 2);
  put_op(&b, DSP_OP_NORMAL, NULL, 0, 6, us, 4, ur, 2);
  in3[0] = 1, in3[1] = 2, in3[2] = 3;
  put_op(&b, DSP_OP_STACK, in3, 3, 7, &d0, 1, NULL, 0);
  read_(&b, 7);
  stats_(&b);
  save("stream", "create_ops.ok", &b);

  NEW(); /* bye: the rest is never read */
  sync_(&b);
  bye_(&b);
  fz_buf_put(&b, "garbage after bye", 17);
  save("stream", "bye_then_junk.ok", &b);

  NEW(); /* deferred errors: the waiting request reports the first one */
  in2[0] = 40, in2[1] = 41;
  put_op(&b, DSP_OP_ADD, in2, 2, 3, NULL, 0, NULL, 0);
  sync_(&b);
  save("stream", "unknown_input.err-ENOID", &b);

  NEW();
  u23(&b, 1);
  u23(&b, 1);
  sync_(&b);
  save("stream", "id_reuse.err-EIDINUSE", &b);

  NEW();
  u23(&b, 1);
  in2[0] = 1, in2[1] = 1;
  put_op(&b, DSP_OP_ADD, in2, 2, 1, NULL, 0, NULL, 0);
  read_(&b, 1);
  save("stream", "op_output_reuse.err-EIDINUSE", &b);

  NEW();
  put_upload(&b, 1, DSP_F32, 2, S23, F6, sizeof F6, sizeof F6 - 4);
  read_(&b, 1);
  save("stream", "short_bulk.err-EINVAL", &b);

  NEW();
  int64_t neg[2] = {-1, 3};
  put_upload(&b, 1, DSP_F32, 2, neg, NULL, 0, 0);
  sync_(&b);
  save("stream", "negative_shape.err-ESHAPE", &b);

  NEW();
  int64_t ovf[3] = {(int64_t)1 << 40, (int64_t)1 << 40, 4};
  put_upload(&b, 1, DSP_F32, 3, ovf, NULL, 0, 0);
  sync_(&b);
  save("stream", "overflow_shape.err-EOVERFLOW", &b);

  NEW();
  int64_t big[2] = {1000, 1000};
  put_upload(&b, 1, DSP_F32, 2, big, NULL, 0, 0);
  sync_(&b);
  save("stream", "too_many_elements.err-ELIMIT", &b);

  NEW();
  put_upload(&b, 1, 9, 1, S6, F6, sizeof F6, sizeof F6);
  sync_(&b);
  save("stream", "bad_dtype.err-EDTYPE", &b);

  NEW(); /* the matmul fails, its output is poisoned, reading it says so */
  u23(&b, 1);
  in2[0] = 1, in2[1] = 1;
  put_op(&b, DSP_OP_MATMUL, in2, 2, 2, NULL, 0, NULL, 0);
  sync_(&b);
  read_(&b, 2);
  save("stream", "poisoned_read.err-ESHAPE", &b);

  NEW();
  u23(&b, 1);
  put_track(&b, 1);
  put_track(&b, 1);
  sync_(&b);
  save("stream", "double_track.err-EDOUBLEWRAP", &b);

  NEW();
  u23(&b, 1);
  put_backward(&b, 1, 1, 0);
  save("stream", "backward_untracked.any", &b);

  /* issue 9's shapes. Zero-size dimensions beside huge ones: numel 0,
   * so only a bound on each dim and stride keeps kernels from walking
   * 2^63-1 rows; .any because the server may refuse them (ESHAPE /
   * ELIMIT) or run them, but must finish. */
  static const int64_t ZH[2] = {INT64_MAX, 0}, ZH3[3] = {0, INT64_MAX, 2};
  static const int64_t ZHZ[3] = {0, INT64_MAX, 0};
  NEW();
  put_upload(&b, 1, DSP_F32, 2, ZH, NULL, 0, 0);
  read_(&b, 1);
  sync_(&b);
  save("stream", "zerodim_upload_read.any", &b);

  /* softmax walked the 2^63-1 empty rows of the first forever, and the
   * second overflowed a stride product (UBSan abort) before shapes had a
   * bounded span (issue 9, item 1) */
  NEW();
  put_upload(&b, 1, DSP_F32, 2, ZH, NULL, 0, 0);
  in1[0] = 1;
  put_op(&b, DSP_OP_SOFTMAX, in1, 1, 2, &d1, 1, NULL, 0);
  sync_(&b);
  save("stream", "zerodim_softmax.any", &b);

  NEW();
  put_upload(&b, 1, DSP_F32, 3, ZH3, NULL, 0, 0);
  in1[0] = 1;
  put_op(&b, DSP_OP_SUM, in1, 1, 2, NULL, 0, NULL, 0);
  sync_(&b);
  save("stream", "zerodim_sum_strides.any", &b);

  NEW();
  {
    int64_t z[4] = {DSP_F32, 0, INT64_MAX, 0};
    put_op(&b, DSP_OP_ZEROS, NULL, 0, 1, z, 4, NULL, 0);
    read_(&b, 1);
  }
  save("stream", "zerodim_zeros.any", &b);

  NEW();
  u23(&b, 1);
  {
    int64_t rs[3] = {0, INT64_MAX, 0};
    in1[0] = 1;
    put_op(&b, DSP_OP_BROADCAST_TO, in1, 1, 2, ZHZ, 3, NULL, 0);
    put_op(&b, DSP_OP_RESHAPE, in1, 1, 3, rs, 3, NULL, 0);
  }
  sync_(&b);
  save("stream", "zerodim_shape_attrs.any", &b);

  /* in-place steps interleaved with reads of the parameter they update:
   * each read must see the values as of its place in the stream */
  NEW();
  u23(&b, 1);
  put_track(&b, 1);
  in1[0] = 1;
  put_op(&b, DSP_OP_SUM, in1, 1, 2, NULL, 0, NULL, 0);
  put_backward(&b, 2, 1, 1);
  u23(&b, 3); /* sgd velocity */
  put_upload(&b, 4, DSP_F32, 2, S23, F6, sizeof F6, sizeof F6); /* adam m */
  put_upload(&b, 5, DSP_F32, 2, S23, F6, sizeof F6, sizeof F6); /* adam v */
  {
    uint64_t p1 = 1, v1 = 3, mv[2] = {4, 5};
    double sgd[3] = {0.1, 0.9, 0};
    double adam[4] = {0.01, 0.9, 0.999, 1e-8};
    for (int64_t t = 1; t <= 3; t++) {
      read_(&b, 1);
      step_(&b, DSP_OP_SGD_STEP, 1, &p1, 1, &v1, 1, NULL, 0, sgd, 3);
      read_(&b, 1);
      step_(&b, DSP_OP_ADAM_STEP, 1, &p1, 1, mv, 2, &t, 1, adam, 4);
      read_(&b, 4);
    }
  }
  sync_(&b);
  save("stream", "step_read_interleaved.ok", &b);

  /* retained backward passes, repeated, then Grad out of each container */
  NEW();
  u23(&b, 1);
  put_upload(&b, 2, DSP_F32, 2, S32, F6, sizeof F6, sizeof F6);
  put_track(&b, 1);
  put_track(&b, 2);
  in2[0] = 1, in2[1] = 2;
  put_op(&b, DSP_OP_MATMUL, in2, 2, 3, NULL, 0, NULL, 0);
  in1[0] = 3;
  put_op(&b, DSP_OP_SUM, in1, 1, 4, NULL, 0, NULL, 0);
  for (uint64_t g = 1; g <= 4; g++) put_backward(&b, 4, g, 1);
  for (uint64_t g = 1; g <= 4; g++) {
    grad_(&b, g, 1, 10 + g);
    grad_(&b, g, 2, 20 + g);
  }
  read_(&b, 11);
  read_(&b, 24);
  stats_(&b);
  save("stream", "retained_backward_grads.ok", &b);

  /* protocol errors: the stream is refused */
  fz_buf_free(&b);
  g_rid = 1;
  stats_(&b);
  save("stream", "no_hello.EPROTO", &b);

  NEW();
  hello(&b, DSP_PROTO_MAJOR);
  save("stream", "second_hello.EPROTO", &b);

  fz_buf_free(&b);
  g_rid = 1;
  hello(&b, 2);
  save("stream", "version.EVERSION", &b);

  NEW();
  raw_header(&b, 2, 1, 0);
  fz_buf_put(&b, "\x08\x01", 2);
  save("stream", "flags.EPROTO", &b);

  NEW();
  raw_header(&b, 0, 0, 0);
  save("stream", "empty_msg.EPROTO", &b);

  NEW();
  raw_header(&b, 0xffffffffu, 0, 0);
  save("stream", "huge_msg.ETOOLARGE", &b);

  NEW();
  raw_header(&b, 2, 0, UINT64_MAX);
  save("stream", "huge_bulk.ETOOLARGE", &b);

  NEW();
  raw_header(&b, 5, 0, 0);
  fz_buf_put(&b, "\xff\xff\xff\xff\xff", 5);
  save("stream", "undecodable.EPROTO", &b);

  NEW();
  put_op(&b, 999, NULL, 0, 1, NULL, 0, NULL, 0);
  save("stream", "unknown_op.EPROTO", &b);

  NEW();
  {
    dsp_wreq w;
    Dspwire__Request *r = dsp_wreq_sync(&w);
    r->req_id = 9;
    fz_frame(&b, r, "abcd", 4, 4);
  }
  save("stream", "bulk_on_sync.EPROTO", &b);

  NEW();
  raw_header(&b, 2, 0, 0);
  fz_buf_put(&b, "\x08\x05", 2); /* req_id 5, no body */
  save("stream", "no_body.EPROTO", &b);

  NEW();
  u23(&b, 1);
  b.n -= 7; /* the bulk is cut short */
  save("stream", "truncated_bulk.trunc", &b);

  NEW();
  raw_header(&b, 100, 0, 0);
  save("stream", "truncated_msg.trunc", &b);
  fz_buf_free(&b);
}

/* 1.3 Ops requests (packed records, op_record.h): valid runs, a failing
 * record (deferred, its output poisoned), and each malformation the loop
 * refuses as a protocol error. */
static size_t rec(uint8_t *buf, size_t len, int op, int no_grad,
                  const uint64_t *in, int n_in, uint64_t out,
                  const int64_t *ints, int n_ints, const double *fl,
                  int n_fl) {
  return len + dsp_oprec_put(buf + len, op, no_grad, in, n_in, out, ints,
                             n_ints, fl, n_fl);
}

static void ops_seeds(void) {
  fz_buf b = {0};
  uint8_t r[256];
  size_t n;
  uint64_t i11[2] = {1, 1}, i1[1] = {1};
  double two = 2;

  NEW(); /* a chain of records, attributes, no_grad and a creation op */
  u23(&b, 1);
  n = rec(r, 0, DSP_OP_ADD, 0, i11, 2, 2, NULL, 0, NULL, 0);
  uint64_t i2[1] = {2}, i3[1] = {3}, i4[1] = {4};
  n = rec(r, n, DSP_OP_MUL_SCALAR, 1, i2, 1, 3, NULL, 0, &two, 1);
  n = rec(r, n, DSP_OP_RELU, 0, i3, 1, 4, NULL, 0, NULL, 0);
  int64_t rs[2] = {3, -1};
  n = rec(r, n, DSP_OP_RESHAPE, 0, i4, 1, 5, rs, 2, NULL, 0);
  n = rec(r, n, DSP_OP_SUM, 0, i4, 1, 6, NULL, 0, NULL, 0);
  int64_t zs[3] = {DSP_F32, 2, 3};
  double v = 3.5;
  n = rec(r, n, DSP_OP_FULL, 0, NULL, 0, 7, zs, 3, &v, 1);
  put_ops(&b, r, n);
  uint64_t i57[2] = {5, 7};
  put_op(&b, DSP_OP_MATMUL, i57, 2, 8, NULL, 0, NULL, 0); /* an Op after */
  uint64_t i8[1] = {8};
  n = rec(r, 0, DSP_OP_SUM, 0, i8, 1, 9, NULL, 0, NULL, 0);
  put_ops(&b, r, n);
  read_(&b, 9);
  read_(&b, 6);
  stats_(&b);
  save("stream", "ops_chain.ok", &b);

  NEW(); /* the second record fails alone: the rest run, the sync says so */
  u23(&b, 1);
  uint64_t bad[2] = {1, 99}, i31[2] = {3, 1}, i21[2] = {2, 1};
  n = rec(r, 0, DSP_OP_ADD, 0, i11, 2, 2, NULL, 0, NULL, 0);
  n = rec(r, n, DSP_OP_ADD, 0, bad, 2, 3, NULL, 0, NULL, 0);
  n = rec(r, n, DSP_OP_ADD, 0, i31, 2, 4, NULL, 0, NULL, 0);
  n = rec(r, n, DSP_OP_ADD, 0, i21, 2, 5, NULL, 0, NULL, 0);
  put_ops(&b, r, n);
  sync_(&b);
  read_(&b, 5);
  read_(&b, 4);
  save("stream", "ops_failing_record.err-ENOID", &b);

  NEW(); /* a record whose output id is taken */
  u23(&b, 1);
  n = rec(r, 0, DSP_OP_ADD, 0, i11, 2, 1, NULL, 0, NULL, 0);
  put_ops(&b, r, n);
  sync_(&b);
  save("stream", "ops_output_reuse.err-EIDINUSE", &b);

  NEW(); /* an optimizer op as a record: it must be a Step */
  u23(&b, 1);
  double sgd[3] = {0.1, 0, 0};
  n = rec(r, 0, DSP_OP_SGD_STEP, 0, i1, 1, 2, NULL, 0, sgd, 3);
  put_ops(&b, r, n);
  sync_(&b);
  save("stream", "ops_optim_record.err-EINVAL", &b);

  NEW(); /* a failed shape check inside the records, then a poisoned read */
  u23(&b, 1);
  n = rec(r, 0, DSP_OP_MATMUL, 0, i11, 2, 2, NULL, 0, NULL, 0);
  n = rec(r, n, DSP_OP_RELU, 0, i2, 1, 3, NULL, 0, NULL, 0);
  put_ops(&b, r, n);
  read_(&b, 3);
  save("stream", "ops_poisoned_chain.err-ESHAPE", &b);

  /* (DSP_OPREC_MAX records do not fit the fuzzers' 16 KiB message
   * limit: tests/test_op_records.c checks that bound on a server) */

  /* malformed: the stream is refused at the Ops request */
  NEW();
  put_ops(&b, r, 0);
  save("stream", "ops_empty.EPROTO", &b);

  size_t one = rec(r, 0, DSP_OP_ADD, 0, i11, 2, 2, NULL, 0, NULL, 0);
  uint8_t t[64];
  static const struct {
    const char *name;
    int at, val, cut;
  } mal[] = {
      {"ops_cut_header.EPROTO", 0, 0, 20},
      {"ops_cut_value.EPROTO", 0, 0, 3},
      {"ops_flag.EPROTO", 1, 2, 0},
      {"ops_padding5.EPROTO", 5, 1, 0},
      {"ops_padding7.EPROTO", 7, 0x80, 0},
      {"ops_unknown_code.EPROTO", 0, 0, 0},
      {"ops_code_255.EPROTO", 0, 255, 0},
      {"ops_input_count.EPROTO", 2, DSP_MAX_INPUTS + 1, 0},
      {"ops_ints_count.EPROTO", 3, DSP_MAX_ATTR_INTS + 1, 0},
      {"ops_floats_count.EPROTO", 4, DSP_MAX_ATTR_FLOATS + 1, 0},
  };
  for (size_t k = 0; k < sizeof mal / sizeof mal[0]; k++) {
    NEW();
    u23(&b, 1);
    /* a good record first: the whole message is refused, not a part */
    memcpy(t, r, one);
    memcpy(t + one, r, one);
    t[one + mal[k].at] = (uint8_t)mal[k].val;
    put_ops(&b, t, 2 * one - (size_t)mal[k].cut);
    sync_(&b);
    save("stream", mal[k].name, &b);
  }

  /* single frames (the frame target runs them after a hello) */
  fz_buf_free(&b);
  g_rid = 1;
  n = rec(r, 0, DSP_OP_ADD, 0, i11, 2, 2, NULL, 0, NULL, 0);
  n = rec(r, n, DSP_OP_MUL_SCALAR, 1, i2, 1, 3, NULL, 0, &two, 1);
  put_ops(&b, r, n);
  save("frame", "ops.ok", &b);
  fz_buf_free(&b);
  memcpy(t, r, n);
  t[6] = 1;
  put_ops(&b, t, n);
  save("frame", "ops_padding.EPROTO", &b);
  fz_buf_free(&b);
  put_ops(&b, r, n - 1);
  save("frame", "ops_cut.EPROTO", &b);
  fz_buf_free(&b);
}
#undef NEW

/* 1.2 graphs: y = relu(x + x) on an f32 [2, 3] placeholder, with the
 * sum released inside the graph; `n_slots` as given (a hostile seed asks
 * for more than the bound). */
static void graph_define(fz_buf *b, uint64_t graph, uint32_t n_slots) {
  static uint32_t add_in[2] = {0, 0}, relu_in[1] = {1}, free_in[1] = {1},
                  outs[1] = {2};
  Dspwire__TensorMeta m = DSPWIRE__TENSOR_META__INIT, *mp[1] = {&m};
  m.dtype = DSP_F32;
  m.n_shape = 2;
  m.shape = (int64_t *)S23;
  Dspwire__GraphNode n[3], *np[3];
  for (int i = 0; i < 3; i++) {
    dspwire__graph_node__init(&n[i]);
    np[i] = &n[i];
  }
  n[0].op = DSP_OP_ADD, n[0].n_inputs = 2, n[0].inputs = add_in;
  n[0].output = 1;
  n[1].op = DSP_OP_RELU, n[1].n_inputs = 1, n[1].inputs = relu_in;
  n[1].output = 2;
  n[2].kind = 5, n[2].n_inputs = 1, n[2].inputs = free_in;
  Dspwire__GraphDefine d = DSPWIRE__GRAPH_DEFINE__INIT;
  d.graph = graph;
  d.n_inputs = 1, d.inputs = mp;
  d.n_slots = n_slots;
  d.n_nodes = 3, d.nodes = np;
  d.n_outputs = 1, d.outputs = outs;
  Dspwire__Request r = DSPWIRE__REQUEST__INIT;
  r.body_case = DSPWIRE__REQUEST__BODY_GRAPH_DEFINE;
  r.graph_define = &d;
  put(b, &r);
}

static void graph_replay(fz_buf *b, uint64_t graph) {
  Dspwire__TensorMeta m = DSPWIRE__TENSOR_META__INIT, *mp[1] = {&m};
  m.dtype = DSP_F32;
  m.n_shape = 2;
  m.shape = (int64_t *)S23;
  Dspwire__GraphReplay g = DSPWIRE__GRAPH_REPLAY__INIT;
  g.graph = graph;
  g.n_inputs = 1, g.inputs = mp;
  Dspwire__Request r = DSPWIRE__REQUEST__INIT;
  r.body_case = DSPWIRE__REQUEST__BODY_GRAPH_REPLAY;
  r.graph_replay = &g;
  r.req_id = g_rid++;
  fz_frame(b, &r, F6, sizeof F6, sizeof F6);
}

static void graph_seeds(void) {
  fz_buf b = {0};
  g_rid = 1;
  hello(&b, DSP_PROTO_MAJOR);
  graph_define(&b, 1, 3);
  graph_replay(&b, 1);
  graph_replay(&b, 9);
  save("stream", "graph_define_replay.err-ENOID", &b);
  fz_buf_free(&b);
  g_rid = 1;
  graph_define(&b, 1, 0xFFFFFFFFu);
  save("frame", "graph_define_huge.ok", &b);
  fz_buf_free(&b);
  graph_replay(&b, 1);
  save("frame", "graph_replay_unknown.err-ENOID", &b);
  fz_buf_free(&b);
}

/* Single frames: the frame target's seeds (run after a hello). */
static void frames(void) {
  fz_buf b = {0};
  g_rid = 1;
  u23(&b, 1);
  save("frame", "upload.ok", &b);
  fz_buf_free(&b);
  uint64_t in2[2] = {1, 2};
  double f = 2;
  int64_t ints[2] = {0, 1};
  put_op(&b, DSP_OP_ADD, in2, 2, 3, ints, 2, &f, 1);
  save("frame", "op.ok", &b);
  fz_buf_free(&b);
  read_(&b, 1);
  save("frame", "read_unknown.err-ENOID", &b);
  fz_buf_free(&b);
  uint64_t p[2] = {1, 2}, s[4] = {3, 4, 5, 6};
  double adam[4] = {0.01, 0.9, 0.999, 1e-8};
  step_(&b, DSP_OP_ADAM_STEP, 1, p, 2, s, 4, ints, 1, adam, 4);
  save("frame", "step.ok", &b);
  fz_buf_free(&b);
  free_(&b, p, 2, p, 1);
  save("frame", "free.ok", &b);
  fz_buf_free(&b);
  hello(&b, DSP_PROTO_MAJOR);
  save("frame", "hello_again.EPROTO", &b);
  fz_buf_free(&b);
  grad_(&b, 1, 2, 3);
  save("frame", "grad.ok", &b);
  fz_buf_free(&b);
  put_backward(&b, 1, 2, 1);
  save("frame", "backward.err-ENOID", &b);
  fz_buf_free(&b);
  stats_(&b);
  save("frame", "stats.ok", &b);
  fz_buf_free(&b);
  {
    static const int64_t zh[2] = {INT64_MAX, 0};
    put_upload(&b, 1, DSP_F32, 2, zh, NULL, 0, 0);
    save("frame", "upload_zerodim.any", &b);
    fz_buf_free(&b);
    int64_t z[4] = {DSP_F32, 0, INT64_MAX, 2};
    put_op(&b, DSP_OP_ONES, NULL, 0, 1, z, 4, NULL, 0);
    save("frame", "ones_zerodim.any", &b);
    fz_buf_free(&b);
  }
}

/* Recipes (fz_common.c's grammar) over the seeded session's ids. */
static void recipes(void) {
  static const struct {
    const char *name;
    uint8_t bytes[48];
    size_t n;
  } r[] = {
      /* op matmul(1,2)->13 (k_ops[47] = 70), read 13 */
      {"matmul_read.any", {1, 47, 2, 1, 2, 13, 0, 0, 7, 13}, 10},
      /* grad 1 of tensor 1 -> 13; read 13 */
      {"grad_read.any", {4, 1, 1, 13, 7, 13}, 6},
      /* sgd step: grads 1, param 1, state 10, floats lr */
      {"sgd_step.any", {5, 0, 1, 1, 1, 1, 10, 0, 1, 3}, 10},
      /* adam step: grads 1, param 1, states 11 12, ints {1}, 4 floats */
      {"adam_step.any", {5, 1, 1, 1, 1, 2, 11, 12, 1, 1, 4, 5, 13, 13, 5},
       15},
      /* track 6, conv2d(6,7)->13 (k_ops[55] = 87), sum -> 14, backward */
      {"conv_backward.any",
       {2, 6, 1, 55, 2, 6, 7, 13, 0, 0, 1, 32, 1, 13, 14, 0, 0, 3, 14, 2, 0},
       21},
      /* free 1 and grads 1, then stats */
      {"free_stats.any", {6, 1, 1, 1, 1, 9}, 6},
      /* upload id 13 f32 [2,3] with its 24 bytes, then read */
      {"upload_read.any",
       {0, 13, 0, 2, 2, 3, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
        13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 7, 13},
       33},
      /* raw frame of 2 bytes: req_id 1 with no body */
      {"raw_nobody.any", {10, 2, 0, 8, 1}, 5},
      /* the structured kinds (0xf0..0xf3, fz_common.c), issue 9's shapes */
      /* upload 13 of k_zshapes[0] = [2^63-1, 0] f32, no op, read it */
      {"zero_upload_read.any", {0xf0, 0, 0, 0, 0, 1}, 6},
      /* zeros with shape k_zshapes[2] = [0, 2^63-1, 0] -> 13, read it */
      {"zero_attr_zeros.any", {0xf1, 6, 0, 2, 0, 0, 1}, 7},
      /* 3 rounds of read 1, sgd/adam step on 1, read 1, read its state */
      {"step_reads.any", {0xf2, 2, 0x0d, 0x0f, 0x2d}, 5},
      /* 3 retained passes into containers 2, 3, 4; 3 grads, each read */
      {"retained_backward.any", {0xf3, 2, 4, 3, 1, 0, 2, 1, 3, 0}, 10},
      /* found by the session target before shapes had a bounded span:
       * a stride product overflowed (UBSan abort in dsp__contig_strides) */
      {"found_stride_overflow.any",
       {0xe7, 0x00, 0x10, 0x00, 0x02, 0xdf, 0xff, 0xff, 0x04, 0xf0, 0x00,
        0x2c, 0x00, 0x02, 0x41, 0x36, 0x00, 0x02, 0x41, 0x43, 0x40},
       21},
      /* ... and a worker that walked empty rows forever */
      {"found_empty_rows_hang.any",
       {0xf0, 0x02, 0x00, 0x0d, 0x37, 0x01, 0x07, 0x06, 0x01, 0x7a, 0x02,
        0xf0, 0x15, 0x34, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00},
       20},
      /* 1.3 Ops (kind 0xf4..0xf7, fz_common.c): add(1,1)->13,
       * matmul(1,2)->14 no_grad, add(13,13)->15; read 15 */
      {"ops_records.any",
       {0xf4, 2, 0, 2, 1, 1, 13, 0, 0, 0, 47, 2, 1, 2, 14, 0, 0, 1, 0, 2,
        13, 13, 15, 0, 0, 0, 0, 7, 15},
       29},
      /* a good record, then one with a padding byte set */
      {"ops_malformed.any",
       {0xf5, 1, 0, 2, 1, 1, 13, 0, 0, 0, 0, 2, 1, 1, 14, 0, 0, 0xf1, 0},
       19},
      /* one record cut 4 bytes short */
      {"ops_cut.any", {0xf6, 0, 0, 2, 1, 1, 13, 0, 0, 0, 0xfb}, 11},
      /* add(1,15): no 15, 13 poisoned; add(13,1)->14 poisoned; sync */
      {"ops_failing.any",
       {0xf7, 1, 0, 2, 1, 15, 13, 0, 0, 0, 0, 2, 13, 1, 14, 0, 0, 0, 0, 8},
       20},
  };
  for (size_t i = 0; i < sizeof r / sizeof r[0]; i++) {
    fz_buf b = {0};
    fz_buf_put(&b, r[i].bytes, r[i].n);
    save("session", r[i].name, &b);
    fz_buf_free(&b);
    /* the oom target: the same recipe with one allocation failing */
    static const unsigned at[] = {0, 9, 60, 300};
    for (size_t k = 0; k < sizeof at / sizeof at[0]; k++) {
      uint8_t pre[2] = {(uint8_t)at[k], (uint8_t)(at[k] >> 8)};
      fz_buf_put(&b, pre, 2);
      fz_buf_put(&b, r[i].bytes, r[i].n);
      char name[96];
      snprintf(name, sizeof name, "fail%u-%s", at[k] + 1, r[i].name);
      save("oom", name, &b);
      fz_buf_free(&b);
    }
  }
}

/* 1.6: checkpoints; the fuzzers' sessions have no --checkpoint-dir, so
 * both are refused after their decode (a hostile name included) */
static void ckpt_seeds(void) {
  fz_buf b = {0};
  g_rid = 1;
  hello(&b, DSP_PROTO_MAJOR);
  u23(&b, 1);
  const char *names[1] = {"w"};
  uint64_t ids[1] = {1};
  const char *keys[1] = {"k"}, *vals[1] = {"v"};
  dsp_wreq w;
  put(&b, dsp_wreq_ckpt_save(&w, "../x\0y", 6, names, ids, 1, keys, vals,
                             1));
  save("stream", "ckpt_save_no_dir.err-EUNSUPPORTED", &b);
  fz_buf_free(&b);
  g_rid = 1;
  put(&b, dsp_wreq_ckpt_load(&w, "run/a.safetensors", 17, UINT64_MAX, 0));
  save("frame", "ckpt_load_no_dir.err-EUNSUPPORTED", &b);
  fz_buf_free(&b);
}

int main(int argc, char **argv) {
  g_dir = argc > 1 ? argv[1] : "tests/fuzz_corpus";
  streams();
  frames();
  graph_seeds();
  ops_seeds();
  recipes();
  ckpt_seeds();
  return 0;
}
