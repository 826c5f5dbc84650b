/* The training code of the examples (examples/lib/train_util.c: models,
 * scoped Adam steps, batched argmax evaluation, option parsing) on a small
 * synthetic 10-class dataset, so `make test` exercises it without the
 * 30 MB Fashion-MNIST files.
 *
 * Dataset: 784-pixel images of uniform noise in [0, 0.2) (fixed LCG seed)
 * with a bright band of 40 pixels whose position is the class. Any model
 * that learns reaches (near) 100% on it; a broken gradient or optimizer
 * stays near the 10% of chance.
 *
 * The remote tests need DISPATCH_SERVER_BIN (make test sets it) and are
 * skipped without it. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"

/* The examples' library is not part of the test link: compile it here. */
#include "../examples/lib/idx.c"
#include "../examples/lib/train_util.c"

#define N_TRAIN 512
#define N_TEST 256
#define EPOCHS 3

static float g_img[(N_TRAIN + N_TEST) * TR_IMAGE_SIZE];
static int64_t g_lab[N_TRAIN + N_TEST];
static fmnist_split g_train, g_test;
static sp_server g_srv;

static void make_data(void) {
  uint32_t s = 12345;
  for (size_t i = 0; i < N_TRAIN + N_TEST; i++) {
    int c = (int)((i * 7) % TR_CLASSES);
    g_lab[i] = c;
    float *p = g_img + i * TR_IMAGE_SIZE;
    for (int j = 0; j < TR_IMAGE_SIZE; j++) {
      s = s * 1664525u + 1013904223u;
      p[j] = (float)(s >> 8) / (float)(1u << 24) * 0.2f;
    }
    for (int j = 0; j < 40; j++) p[c * 78 + j] = 1.0f;
  }
  g_train = (fmnist_split){N_TRAIN, g_img, g_lab};
  g_test = (fmnist_split){N_TEST, g_img + N_TRAIN * TR_IMAGE_SIZE,
                          g_lab + N_TRAIN};
}

static void setup_local(void) { make_data(); }

static void setup_remote(void) {
  make_data();
  check_server_start(&g_srv, NULL);
}

static void teardown_remote(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_dev(int remote) {
  return check_open(&g_srv, remote);
}

static void quiet_opts(tr_opts *o, int epochs) {
  tr_opts_default(o, epochs);
  o->batch = 32;
  o->eval_batch = 100; /* 256 = 2 full batches and a partial one */
  o->lr = 3e-3;
  o->quiet = 1;
}

static uint64_t live_tensors(dispatch_device *dev) {
  dispatch_stats st = DISPATCH_STATS_INIT;
  int rc = dispatch_device_stats(dev, &st);
  cr_assert_eq(rc, 0, "stats: %s", dispatch_device_errmsg(dev));
  return st.tensors;
}

/* Trains the small MLP on dev; checks it learns and that the steps leave
 * no tensor behind (the optimizer state is freed by tr_fit, so the device
 * holds exactly what it held after building the model). */
static void fit_mlp(dispatch_device *dev, tr_epoch *res) {
  tr_model m;
  tr_opts o;
  quiet_opts(&o, EPOCHS);
  cr_assert_eq(tr_mlp_init(dev, 32, o.seed, &m), 0);
  cr_assert_eq(m.nparams, 4);
  cr_assert_eq(m.nweights, 784 * 32 + 32 + 32 * 10 + 10);
  uint64_t base = live_tensors(dev);
  int rc = tr_fit(&m, &g_train, N_TRAIN, &g_test, &o, res);
  cr_assert_eq(rc, 0, "fit: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert_eq(live_tensors(dev), base, "steps leaked tensors");
  for (int e = 0; e < EPOCHS; e++)
    cr_assert(isfinite(res[e].mean_loss) && res[e].mean_loss > 0,
              "epoch %d loss %f", e, res[e].mean_loss);
  cr_assert_lt(res[EPOCHS - 1].mean_loss, res[0].mean_loss / 2,
               "loss %f -> %f did not halve", res[0].mean_loss,
               res[EPOCHS - 1].mean_loss);
  cr_assert_geq(res[EPOCHS - 1].accuracy, 95.0, "accuracy %.2f%%",
                res[EPOCHS - 1].accuracy);
  double acc;
  cr_assert_eq(tr_evaluate(&m, &g_test, 1000, &acc), 0);
  cr_assert_eq(acc, res[EPOCHS - 1].accuracy,
               "eval batch size changed the accuracy: %f vs %f", acc,
               res[EPOCHS - 1].accuracy);
  tr_model_free(&m);
}

Test(examples, mlp_local_learns_without_leaks, .init = setup_local) {
  dispatch_device *dev = open_dev(0);
  tr_epoch res[EPOCHS];
  fit_mlp(dev, res);
  cr_assert_eq(live_tensors(dev), 0, "model free left tensors");
  dispatch_device_close(dev);
}

Test(examples, mlp_same_seed_same_losses, .init = setup_local) {
  dispatch_device *dev = open_dev(0);
  tr_epoch a[EPOCHS], b[EPOCHS];
  fit_mlp(dev, a);
  fit_mlp(dev, b);
  for (int e = 0; e < EPOCHS; e++) {
    cr_assert_eq(a[e].mean_loss, b[e].mean_loss, "epoch %d: %.9g vs %.9g", e,
                 a[e].mean_loss, b[e].mean_loss);
    cr_assert_eq(a[e].accuracy, b[e].accuracy);
  }
  dispatch_device_close(dev);
}

Test(examples, mlp_remote_matches_local, .init = setup_remote,
     .fini = teardown_remote) {
  dispatch_device *loc = open_dev(0), *rem = open_dev(1);
  tr_epoch a[EPOCHS], b[EPOCHS];
  fit_mlp(loc, a);
  fit_mlp(rem, b);
  /* the server runs the same CPU backend on the same bits */
  for (int e = 0; e < EPOCHS; e++) {
    cr_assert_float_eq(a[e].mean_loss, b[e].mean_loss,
                       1e-5 * fabs(a[e].mean_loss), "epoch %d: %.9g vs %.9g",
                       e, a[e].mean_loss, b[e].mean_loss);
    cr_assert_eq(a[e].accuracy, b[e].accuracy);
  }
  cr_assert_eq(live_tensors(rem), 0, "server still holds tensors");
  dispatch_device_close(rem);
  dispatch_device_close(loc);
}

Test(examples, cnn_local_learns_without_leaks, .init = setup_local) {
  dispatch_device *dev = open_dev(0);
  tr_model m;
  tr_opts o;
  tr_epoch res[2];
  quiet_opts(&o, 2);
  cr_assert_eq(tr_cnn_init(dev, 4, 8, o.seed, &m), 0);
  cr_assert_eq(m.nparams, 6);
  cr_assert_eq(m.nweights, 4 * 9 + 4 + 8 * 4 * 9 + 8 + 8 * 49 * 10 + 10);
  uint64_t base = live_tensors(dev);
  int rc = tr_fit(&m, &g_train, N_TRAIN, &g_test, &o, res);
  cr_assert_eq(rc, 0, "fit: %s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert_eq(live_tensors(dev), base, "steps leaked tensors");
  cr_assert_lt(res[1].mean_loss, res[0].mean_loss, "loss %f -> %f",
               res[0].mean_loss, res[1].mean_loss);
  cr_assert_geq(res[1].accuracy, 90.0, "accuracy %.2f%%", res[1].accuracy);
  tr_model_free(&m);
  dispatch_device_close(dev);
}

/* A forward whose matmul has mismatched shapes ([B,784] @ [32,10]). */
static int bad_forward(tr_model *m, dispatch_tensor *x, int train,
                       dispatch_tensor **logits) {
  return dispatch_matmul(x, tr_p(m, 2, train), logits);
}

/* A failing step reports the op's error and still closes its scope. */
static void failing_fit(int remote) {
  dispatch_device *dev = open_dev(remote);
  tr_model m;
  tr_opts o;
  tr_epoch res[1];
  quiet_opts(&o, 1);
  cr_assert_eq(tr_mlp_init(dev, 32, o.seed, &m), 0);
  m.forward = bad_forward;
  uint64_t base = live_tensors(dev);
  int rc = tr_fit(&m, &g_train, N_TRAIN, &g_test, &o, res);
  cr_assert_eq(rc, DISPATCH_ESHAPE, "got %s", dispatch_err_name(rc));
  /* the calls after the failed matmul answered with its error, so the
   * last message is still the matmul's; the step reported and cleared it */
  cr_assert_str_eq(dispatch_device_errmsg(dev),
                   "matmul: inner dims 784 and 32 differ");
  cr_assert_eq(dispatch_device_error(dev, NULL), 0);
  cr_assert_eq(live_tensors(dev), base, "failed step leaked tensors");
  /* the device is still usable afterwards */
  m.forward = tr_mlp_forward;
  double acc;
  cr_assert_eq(tr_evaluate(&m, &g_test, 100, &acc), 0);
  cr_assert(acc >= 0 && acc <= 100);
  tr_model_free(&m);
  dispatch_device_close(dev);
}

Test(examples, failing_step_local, .init = setup_local) { failing_fit(0); }

Test(examples, failing_step_remote, .init = setup_remote,
     .fini = teardown_remote) {
  failing_fit(1);
}

Test(examples, fit_rejects_bad_sizes, .init = setup_local) {
  dispatch_device *dev = open_dev(0);
  tr_model m;
  tr_opts o;
  quiet_opts(&o, 1);
  cr_assert_eq(tr_mlp_init(dev, 8, o.seed, &m), 0);
  cr_assert_eq(tr_fit(&m, &g_train, N_TRAIN + 1, &g_test, &o, NULL),
               DISPATCH_EINVAL);
  cr_assert_eq(tr_fit(&m, &g_train, 0, &g_test, &o, NULL), DISPATCH_EINVAL);
  tr_model_free(&m);
  dispatch_device_close(dev);
}

Test(examples, shuffle_is_a_fixed_permutation) {
  uint32_t a[1000], b[1000];
  int seen[1000] = {0};
  tr_shuffle(a, 1000, 7);
  tr_shuffle(b, 1000, 7);
  cr_assert_eq(memcmp(a, b, sizeof a), 0, "same seed, different order");
  int moved = 0;
  for (int i = 0; i < 1000; i++) {
    cr_assert_lt(a[i], 1000u);
    seen[a[i]]++;
    moved += a[i] != (uint32_t)i;
  }
  for (int i = 0; i < 1000; i++) cr_assert_eq(seen[i], 1, "index %d", i);
  cr_assert_gt(moved, 900);
  tr_shuffle(b, 1000, 8);
  cr_assert_neq(memcmp(a, b, sizeof a), 0, "seed ignored");
}

Test(examples, parse_args) {
  tr_opts o;
  tr_opts_default(&o, 3);
  char *ok[] = {"p",      "--device", "tcp://127.0.0.1:1", "--epochs",
                "5",      "--limit",  "1000",              "--lr",
                "0.01",   "--batch",  "64",                "--min-acc",
                "85",     "--data",   "/nowhere"};
  cr_assert_eq(tr_parse_args(15, ok, "p", &o), 0);
  cr_assert_str_eq(o.device, "tcp://127.0.0.1:1");
  cr_assert_str_eq(o.data, "/nowhere");
  cr_assert_eq(o.epochs, 5);
  cr_assert_eq(o.limit, 1000);
  cr_assert_eq(o.batch, 64);
  cr_assert_float_eq(o.lr, 0.01, 1e-12);
  cr_assert_float_eq(o.min_acc, 85, 1e-12);

  const char *bad[][2] = {{"--epochs", "0"},   {"--epochs", "3x"},
                          {"--limit", "-1"},   {"--lr", "0"},
                          {"--lr", "nan"},     {"--batch", ""},
                          {"--bogus", "1"},    {"--seed", "-5"}};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char *argv[] = {"p", (char *)bad[i][0], (char *)bad[i][1]};
    tr_opts_default(&o, 3);
    cr_assert_eq(tr_parse_args(3, argv, "p", &o), -1, "%s '%s' accepted",
                 bad[i][0], bad[i][1]);
  }
  char *missing[] = {"p", "--epochs"};
  cr_assert_eq(tr_parse_args(2, missing, "p", &o), -1);
}

/* ------------------------------------------------------------------ */
/* the README's first program                                          */

/* Compiled into this suite with its main renamed, so it runs here (under
 * the sanitizers too) and its output can be checked. */
#define main first_program_main
#include "../examples/first_program.c"
#undef main

/* Runs the first program on device spec; returns its exit status and its
 * stdout and stderr together in out. */
static int run_first_program(const char *spec, char *out, size_t len) {
  cr_assert_eq(setenv("DISPATCH_DEVICE", spec, 1), 0);
  fflush(stdout);
  fflush(stderr);
  FILE *tmp = tmpfile();
  cr_assert_not_null(tmp);
  int o = dup(1), e = dup(2);
  cr_assert(o >= 0 && e >= 0);
  dup2(fileno(tmp), 1);
  dup2(fileno(tmp), 2);
  int status = first_program_main();
  fflush(stdout);
  fflush(stderr);
  dup2(o, 1);
  dup2(e, 2);
  close(o);
  close(e);
  rewind(tmp);
  size_t n = fread(out, 1, len - 1, tmp);
  out[n] = '\0';
  fclose(tmp);
  return status;
}

/* x [[1,2,3],[4,5,6]], w1 and w2 ones: h = relu(x @ w1) has rows of 6 and
 * 15, so d(sum(h @ w2))/dw2 = 6 + 15 for each of its 4 entries. */
#define FIRST_PROGRAM_OUT "dloss/dw2 = 21 21 21 21\n"

Test(examples, first_program_local) {
  char out[1024];
  int st = run_first_program("local", out, sizeof out);
  cr_assert_eq(st, 0, "exit %d: %s", st, out);
  cr_assert_str_eq(out, FIRST_PROGRAM_OUT);
}

Test(examples, first_program_remote, .init = setup_remote,
     .fini = teardown_remote) {
  char spec[64], out[1024];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  int st = run_first_program(spec, out, sizeof out);
  cr_assert_eq(st, 0, "exit %d: %s", st, out);
  cr_assert_str_eq(out, FIRST_PROGRAM_OUT);
}

/* A session limit that a few tensors pass: a call fails on the server,
 * every later call answers with that error, and the one check at the end
 * prints the server's message (not "input 0 is NULL"). */
Test(examples, first_program_reports_the_servers_first_error,
     .fini = teardown_remote) {
  const char *args[] = {"--max-session-bytes", "600", "--log-level", "error",
                        NULL};
  check_server_start(&g_srv, args);
  char spec[64], out[1024];
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  int st = run_first_program(spec, out, sizeof out);
  cr_assert_eq(st, 1, "exit %d: %s", st, out);
  cr_assert(strncmp(out, "error: server: request ", 23) == 0, "%s", out);
  cr_assert(strstr(out, "DISPATCH_EQUOTA") && strstr(out,
            "--max-session-bytes"), "%s", out);
  cr_assert_null(strstr(out, "is NULL"), "%s", out);
  cr_assert_null(strstr(out, "dloss"), "%s", out);
}

/* ------------------------------------------------------------------ */
/* examples/train_gpt.c: the character-level GPT (issue 23)            */

#include "../examples/lib/gpt_data.c"
#include "../examples/lib/gpt_model.c"
#define main train_gpt_main
#include "../examples/train_gpt.c"
#undef main

/* The first values of the recipe's streams, as examples/python/gpt_data.py
 * (the Python copy) computes them: both copies must keep agreeing, or the
 * PyTorch reference no longer starts from the C program's weights. */
Test(examples, gpt_recipe_streams_match_the_python_copy) {
  static const float want[4] = {0.008294395171105862f, -0.017837723717093468f,
                                0.03459186106920242f, 0.01091240905225277f};
  gr_param_spec spec[GR_NPARAMS], four;
  uint64_t s = GR_INIT_SEED;
  float w[4];
  gr_param_specs(114, spec);
  cr_assert_str_eq(spec[0].name, "wte");
  cr_assert_str_eq(spec[GR_NPARAMS - 2].name, "wout");
  cr_assert_eq(spec[GR_NPARAMS - 2].shape[1], 114);
  four = spec[0];
  four.shape[0] = 1;
  four.shape[1] = 4;
  gr_param_fill(&four, &s, w);
  for (int i = 0; i < 4; i++)
    cr_assert_eq(w[i], want[i], "init %d: %.9g, python %.9g", i, w[i],
                 want[i]);
  s = GR_BATCH_SEED;
  cr_assert_eq(gr_next(&s), 0xb6a8a9b313caa00bull);
  cr_assert_eq(gr_next(&s), 0xcb7f284b67d605c9ull);
  s = GR_SAMPLE_SEED;
  cr_assert_eq(gr_uniform(&s), 0.3898297483912715);
}

/* Runs train_gpt for a few steps on spec in precision (f32, bf16, f16);
 * its stdout and stderr together into out, the exit status returned. */
static int run_train_gpt(const char *spec, const char *precision, char *out,
                         size_t len) {
  char *argv[] = {"train_gpt", "--device", (char *)spec, "--steps", "3",
                  "--log-every", "1", "--sample", "8", "--precision",
                  (char *)precision, NULL};
  fflush(stdout);
  fflush(stderr);
  FILE *tmp = tmpfile();
  cr_assert_not_null(tmp);
  int o = dup(1), e = dup(2);
  cr_assert(o >= 0 && e >= 0);
  dup2(fileno(tmp), 1);
  dup2(fileno(tmp), 2);
  int status = train_gpt_main(11, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(o, 1);
  dup2(e, 2);
  close(o);
  close(e);
  rewind(tmp);
  size_t n = fread(out, 1, len - 1, tmp);
  out[n] = '\0';
  fclose(tmp);
  return status;
}

/* The lines that must not depend on the device: the losses and the
 * sample (the device line and tokens/s do). Checks each loss is finite. */
static void gpt_losses(const char *out, char *keep, size_t len, int *nloss) {
  const char *p = out;
  size_t k = 0;
  *nloss = 0;
  keep[0] = '\0';
  while (*p) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) + 1 : strlen(p);
    const char *l = strstr(p, "loss ");
    if (!strncmp(p, "train_gpt: device", 17) || !strncmp(p, "tokens/s", 8)) {
      p += n;
      continue;
    }
    if (l && l < p + n) {
      double v = strtod(l + 5, NULL);
      cr_assert(isfinite(v) && v > 0 && v < 10, "loss %f in: %.*s", v,
                (int)n, p);
      (*nloss)++;
    }
    cr_assert_lt(k + n, len);
    memcpy(keep + k, p, n);
    k += n;
    keep[k] = '\0';
    p += n;
  }
}

static int have_corpus(void) {
  gr_corpus c;
  char err[256];
  if (gr_corpus_load(NULL, &c, err, sizeof err) < 0) return 0;
  gr_corpus_free(&c);
  return 1;
}

/* A few steps LOCAL and REMOTE in precision: the same losses, digit for
 * digit (the server runs the same CPU kernels on the same bits), all
 * finite; the losses are returned in keep. */
static void gpt_local_remote(const char *precision, char *keep, size_t len) {
  static char loc[16384], rem[16384], kr[16384];
  char spec[64];
  int nl, nr;
  int st = run_train_gpt("local", precision, loc, sizeof loc);
  cr_assert_eq(st, 0, "local %s exit %d: %s", precision, st, loc);
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", g_srv.port);
  st = run_train_gpt(spec, precision, rem, sizeof rem);
  cr_assert_eq(st, 0, "remote %s exit %d: %s", precision, st, rem);
  gpt_losses(loc, keep, len, &nl);
  gpt_losses(rem, kr, sizeof kr, &nr);
  cr_assert_eq(nl, 4, "3 step losses and 1 val loss expected: %s", loc);
  cr_assert_str_eq(keep, kr, "%s local:\n%s\nremote:\n%s", precision, loc,
                   rem);
}

Test(examples, gpt_remote_prints_the_local_losses, .init = setup_remote,
     .fini = teardown_remote, .timeout = 300) {
  static char k[16384];
  if (!have_corpus()) cr_skip_test("no fortunes corpus (make deps)");
  gpt_local_remote("f32", k, sizeof k);
}

/* Mixed precision (issue 24): bf16 and f16 (with loss scaling) agree
 * LOCAL with REMOTE too, and differ from the f32 run (the half matmuls
 * round), but only in the low digits over 3 steps. */
Test(examples, gpt_mixed_precision_remote_prints_the_local_losses,
     .init = setup_remote, .fini = teardown_remote, .timeout = 300) {
  static char k32[16384], kh[16384];
  if (!have_corpus()) cr_skip_test("no fortunes corpus (make deps)");
  gpt_local_remote("f32", k32, sizeof k32);
  const char *half[2] = {"bf16", "f16"};
  for (int i = 0; i < 2; i++) {
    gpt_local_remote(half[i], kh, sizeof kh);
    cr_assert_str_neq(kh, k32, "%s printed the f32 losses", half[i]);
    double a = strtod(strstr(k32, "loss ") + 5, NULL);
    double b = strtod(strstr(kh, "loss ") + 5, NULL);
    cr_assert_lt(fabs(a - b), 0.01, "%s step 1 loss %f vs f32 %f", half[i],
                 b, a);
  }
}
