/* ckpt_tool: the C side of the Python checkpoint tests
 * (python/tests/test_checkpoint.py), so that a file written by the Python
 * package is read by a C program and the other way, on LOCAL and REMOTE.
 *
 *   ckpt_tool write SPEC PATH N   trains the tiny model below N Adam steps
 *                                 from its fixed start, saves w, b and the
 *                                 optimizer's state to PATH
 *   ckpt_tool resume SPEC PATH N  loads PATH (w, b, Adam state), trains N
 *                                 more steps
 *   ckpt_tool dump SPEC PATH      loads PATH and prints every entry
 *
 * write and resume print one line "loss K HEX" per step and then
 * "w ..." and "b ..." lines as dump prints entries: NAME DTYPE SHAPE HEX,
 * SHAPE as 2x3 ("-" for a scalar), HEX the tensor's raw little-endian
 * bytes, so the Python test compares bit for bit. dump also prints
 * "meta dispatch.optim VALUE" when the file holds optimizer state.
 *
 * The model: x [2, 4] fixed, w [4, 3] and b [3] tracked, loss =
 * sum((x @ w + b) * (x @ w + b)), Adam lr 0.01 (betas 0.9, 0.999, eps
 * 1e-8). The Python test builds the same from the same numbers with the
 * same ops, so both give the same bits on the same kind of device.
 * Exits 1 with the library's message on any error. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"

static dispatch_device *g_dev;

static void check(int rc, const char *what) {
  if (rc < 0) {
    fprintf(stderr, "ckpt_tool: %s: %s: %s\n", what, dispatch_err_name(rc),
            g_dev ? dispatch_device_errmsg(g_dev) : "");
    exit(1);
  }
}

static const char *dtype_name(dispatch_dtype d) {
  switch (d) {
    case DISPATCH_F32: return "F32";
    case DISPATCH_F64: return "F64";
    case DISPATCH_I64: return "I64";
    case DISPATCH_BOOL: return "BOOL";
    default: return "?";
  }
}

/* NAME DTYPE SHAPE HEX */
static void print_tensor(const char *name, dispatch_tensor *t) {
  size_t n = dispatch_tensor_nbytes(t);
  unsigned char *buf = malloc(n ? n : 1);
  if (!buf) check(DISPATCH_ENOMEM, "malloc");
  check(dispatch_tensor_read(t, buf, n), name);
  printf("%s %s ", name, dtype_name(dispatch_tensor_dtype(t)));
  int nd = dispatch_tensor_ndim(t);
  const int64_t *shape = dispatch_tensor_shape(t);
  if (nd == 0) printf("-");
  for (int i = 0; i < nd; i++)
    printf("%s%lld", i ? "x" : "", (long long)shape[i]);
  printf(" ");
  for (size_t i = 0; i < n; i++) printf("%02x", buf[i]);
  printf("\n");
  free(buf);
}

static dispatch_tensor *from_floats(const float *v, int nd,
                                    const int64_t *shape, size_t n) {
  dispatch_tensor *t;
  check(dispatch_tensor_from_data(g_dev, DISPATCH_F32, nd, shape, v,
                                  n * sizeof *v, &t), "upload");
  return t;
}

/* n Adam steps of the model; prints each loss */
static void train(dispatch_tensor *w, dispatch_tensor *b,
                  dispatch_optim *opt, int n) {
  float xv[8];
  for (int i = 0; i < 8; i++) xv[i] = (float)(i % 5) * 0.5f - 1.0f;
  const int64_t xs[2] = {2, 4};
  dispatch_tensor *x = from_floats(xv, 2, xs, 8);
  for (int k = 0; k < n; k++) {
    dispatch_tensor *xw, *y, *sq, *loss;
    dispatch_grads *g;
    check(dispatch_matmul(x, w, &xw), "matmul");
    check(dispatch_add(xw, b, &y), "add");
    check(dispatch_mul(y, y, &sq), "mul");
    check(dispatch_sum(sq, 0, NULL, 0, &loss), "sum");
    check(dispatch_backward(loss, &g), "backward");
    check(dispatch_optim_step(opt, g), "step");
    float l;
    check(dispatch_tensor_read(loss, &l, sizeof l), "read loss");
    unsigned char *p = (unsigned char *)&l;
    printf("loss %d %02x%02x%02x%02x\n", k, p[0], p[1], p[2], p[3]);
    dispatch_grads_free(g);
    dispatch_tensor_free(loss);
    dispatch_tensor_free(sq);
    dispatch_tensor_free(y);
    dispatch_tensor_free(xw);
  }
  dispatch_tensor_free(x);
}

static dispatch_optim *adam(dispatch_tensor *w, dispatch_tensor *b) {
  dispatch_tensor *p[2] = {w, b};
  dispatch_optim *opt;
  check(dispatch_adam_new(p, 2, 0.01, 0.9, 0.999, 1e-8, &opt), "adam");
  return opt;
}

static dispatch_tensor *track(dispatch_tensor *t) {
  dispatch_tensor *a;
  check(dispatch_autodiff(t, &a), "autodiff");
  return a;
}

static int cmd_write(const char *path, int n) {
  float wv[12], bv[3];
  for (int i = 0; i < 12; i++) wv[i] = (float)(i % 7) * 0.25f - 0.5f;
  for (int i = 0; i < 3; i++) bv[i] = 0.1f * (float)i;
  const int64_t ws[2] = {4, 3}, bs[1] = {3};
  dispatch_tensor *w0 = from_floats(wv, 2, ws, 12);
  dispatch_tensor *b0 = from_floats(bv, 1, bs, 3);
  dispatch_tensor *w = track(w0), *b = track(b0);
  dispatch_optim *opt = adam(w, b);
  train(w, b, opt, n);
  const char *names[2] = {"w", "b"};
  dispatch_tensor *ts[2] = {w, b};
  check(dispatch_save(g_dev, path, names, ts, 2, opt), "save");
  print_tensor("w", w);
  print_tensor("b", b);
  dispatch_optim_free(opt);
  dispatch_tensor_free(w);
  dispatch_tensor_free(b);
  dispatch_tensor_free(w0);
  dispatch_tensor_free(b0);
  return 0;
}

static dispatch_checkpoint *load(const char *path) {
  dispatch_checkpoint *ck;
  check(dispatch_load(g_dev, path, &ck), "load");
  return ck;
}

static dispatch_tensor *get(dispatch_checkpoint *ck, const char *name) {
  dispatch_tensor *t = dispatch_checkpoint_get(ck, name);
  if (!t) {
    fprintf(stderr, "ckpt_tool: no tensor %s in the file\n", name);
    exit(1);
  }
  return t;
}

static int cmd_resume(const char *path, int n) {
  dispatch_checkpoint *ck = load(path);
  dispatch_tensor *w = track(get(ck, "w")), *b = track(get(ck, "b"));
  dispatch_optim *opt = adam(w, b);
  check(dispatch_optim_load(opt, ck), "optim_load");
  train(w, b, opt, n);
  print_tensor("w", w);
  print_tensor("b", b);
  dispatch_optim_free(opt);
  dispatch_tensor_free(w);
  dispatch_tensor_free(b);
  dispatch_checkpoint_free(ck);
  return 0;
}

static int cmd_dump(const char *path) {
  dispatch_checkpoint *ck = load(path);
  for (int i = 0; i < dispatch_checkpoint_count(ck); i++)
    print_tensor(dispatch_checkpoint_name(ck, i),
                 dispatch_checkpoint_tensor(ck, i));
  const char *m = dispatch_checkpoint_meta(ck, "dispatch.optim");
  if (m) printf("meta dispatch.optim %s\n", m);
  dispatch_checkpoint_free(ck);
  return 0;
}

int main(int argc, char **argv) {
  if (argc < 4 || (strcmp(argv[1], "dump") != 0 && argc < 5)) {
    fprintf(stderr, "usage: ckpt_tool write|resume SPEC PATH N | "
                    "ckpt_tool dump SPEC PATH\n");
    return 2;
  }
  char msg[256] = "";
  int rc = dispatch_device_open(argv[2], NULL, &g_dev, msg, sizeof msg);
  if (rc < 0) {
    fprintf(stderr, "ckpt_tool: open %s: %s\n", argv[2], msg);
    return 1;
  }
  int n = argc > 4 ? atoi(argv[4]) : 0;
  if (strcmp(argv[1], "write") == 0)
    rc = cmd_write(argv[3], n);
  else if (strcmp(argv[1], "resume") == 0)
    rc = cmd_resume(argv[3], n);
  else if (strcmp(argv[1], "dump") == 0)
    rc = cmd_dump(argv[3]);
  else
    rc = 2;
  check(dispatch_device_sync(g_dev), "sync");
  dispatch_device_close(g_dev);
  return rc;
}
