/* train_gpt: the character-level GPT of issue 23 (2 layers, d_model 128,
 * 4 heads, context 64, pre-LayerNorm, MLP 512 with exact GELU, learned
 * positional embedding; AdamW lr 3e-3, 100 warmup steps, cosine to 3e-4 at
 * step 2000, weight decay 0.1 on matrices and embeddings, betas 0.9/0.95,
 * batch 32 x 64, clip 1.0) on the fortunes corpus, on any device:
 *
 *   train_gpt --device local --steps 2000
 *   train_gpt --precision bf16     (or f16: mixed precision, issue 24)
 *   train_gpt --device tcp://127.0.0.1:7000
 *   DISPATCH_DEVICE=tcp://127.0.0.1:7000 train_gpt
 *
 * Data, batches, initial weights, validation windows and baselines follow
 * lib/gpt_data.h, as does the PyTorch reference examples/python/gpt_torch.py.
 * Prints the training loss every --log-every steps, the validation loss at
 * step 1000 and at the end beside the add-one bigram and unigram
 * baselines, tokens per second over the training steps, and a sample.
 * Exit status 0, 1 when a call failed or the loss is not finite, 2 for a
 * bad command line. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "lib/gpt_model.h"

typedef struct gpt_opts {
  const char *device; /* NULL: env DISPATCH_DEVICE, else "local" */
  const char *precision; /* f32, bf16 or f16 (gm_set_precision) */
  long steps;
  long log_every;
  long sample;
} gpt_opts;

static double gpt_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void gpt_usage(FILE *f) {
  fprintf(f,
          "usage: train_gpt [options]\n"
          "  --device SPEC   local | tcp://HOST:PORT (default: env "
          "DISPATCH_DEVICE, else local)\n"
          "  --steps N       training steps (default %d)\n"
          "  --precision P   f32 | bf16 | f16: mixed precision (f32 master "
          "weights,\n"
          "                  matmuls and attention in P; f16 with loss "
          "scaling) (default f32)\n"
          "  --log-every N   training loss every N steps, 0: none "
          "(default 100)\n"
          "  --sample N      characters of generated text, 0: none "
          "(default 300)\n"
          "corpus: %s (env GPT_CORPUS_DIR overrides)\n",
          GR_TOTAL, GR_CORPUS_DIR);
}

/* Whole decimal in [lo, hi], or -1. */
static int gpt_parse_long(const char *s, long lo, long hi, long *v) {
  char *end;
  errno = 0;
  long x = strtol(s, &end, 10);
  if (errno || end == s || *end || x < lo || x > hi) return -1;
  *v = x;
  return 0;
}

/* 0 to run, 1 after --help, -1 on a bad command line. */
static int gpt_parse(int argc, char **argv, gpt_opts *o) {
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    long *dst = NULL, lo = 0;
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      gpt_usage(stdout);
      return 1;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "train_gpt: unknown option or missing value: %s\n", a);
      gpt_usage(stderr);
      return -1;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--device")) {
      o->device = v;
      continue;
    }
    if (!strcmp(a, "--precision")) {
      if (strcmp(v, "f32") && strcmp(v, "bf16") && strcmp(v, "f16")) {
        fprintf(stderr, "train_gpt: bad value for --precision: '%s' (f32, "
                        "bf16 or f16)\n", v);
        return -1;
      }
      o->precision = v;
      continue;
    }
    if (!strcmp(a, "--steps")) {
      dst = &o->steps;
      lo = 1;
    } else if (!strcmp(a, "--log-every")) {
      dst = &o->log_every;
    } else if (!strcmp(a, "--sample")) {
      dst = &o->sample;
    } else {
      fprintf(stderr, "train_gpt: unknown option %s\n", a);
      gpt_usage(stderr);
      return -1;
    }
    if (gpt_parse_long(v, lo, 1L << 30, dst) < 0) {
      fprintf(stderr, "train_gpt: bad value for %s: '%s'\n", a, v);
      return -1;
    }
  }
  return 0;
}

static int gpt_print_val(gm_model *m, const gr_corpus *c, long step) {
  double v;
  if (gm_val_loss(m, c, &v) < 0) return -1;
  printf("step %5ld  val loss %.6f\n", step, v);
  fflush(stdout);
  return 0;
}

/* The training loop; train_s gets the time of the steps alone. */
static int gpt_train(gm_model *m, const gr_corpus *c, const gpt_opts *o,
                     double *train_s) {
  uint64_t rng = GR_BATCH_SEED;
  size_t off[GR_BATCH];
  int64_t xb[GR_BATCH * GR_CTX], yb[GR_BATCH * GR_CTX];
  *train_s = 0;
  for (long s = 0; s < o->steps; s++) {
    float loss;
    gr_batch_offsets(&rng, c, off);
    gr_windows(c, 0, off, GR_BATCH, xb, yb);
    double t0 = gpt_now();
    if (gm_step(m, s, xb, yb, &loss) < 0) {
      fprintf(stderr, "train_gpt: training stopped at step %ld\n", s + 1);
      return -1;
    }
    *train_s += gpt_now() - t0;
    if (!isfinite(loss)) {
      fprintf(stderr, "train_gpt: step %ld: loss is %f, diverged\n", s + 1,
              (double)loss);
      return -1;
    }
    if (o->log_every > 0 && (s + 1) % o->log_every == 0) {
      printf("step %5ld  loss %.6f  lr %.2e\n", s + 1, (double)loss,
             dispatch_lr_cosine(s, GR_WARMUP, GR_TOTAL, GR_LR_MAX, GR_LR_MIN));
      fflush(stdout);
    }
    if (s + 1 == GR_TOTAL / 2 && s + 1 < o->steps &&
        gpt_print_val(m, c, s + 1) < 0)
      return -1;
  }
  return 0;
}

/* After training: validation, baselines, speed, sample. */
static int gpt_report(gm_model *m, const gr_corpus *c, const gpt_opts *o,
                      double train_s) {
  double big, uni;
  if (gpt_print_val(m, c, o->steps) < 0) return -1;
  if (gr_baselines(c, &big, &uni) < 0) {
    fprintf(stderr, "train_gpt: out of memory for the baselines\n");
    return -1;
  }
  printf("baselines on the same val windows: bigram %.4f  unigram %.4f\n",
         big, uni);
  if (m->scaled) {
    double scale;
    int64_t skipped;
    if (dispatch_optim_loss_scale(m->opt, &scale, &skipped) < 0) return -1;
    printf("grad scaler: scale %g, %lld steps skipped\n", scale,
           (long long)skipped);
  }
  printf("tokens/s %.0f (%.1f ms/step over %ld steps)\n",
         (double)o->steps * GR_BATCH * GR_CTX / train_s,
         1000.0 * train_s / (double)o->steps, o->steps);
  if (o->sample > 0) {
    char *text = malloc((size_t)o->sample + 1);
    if (!text || gm_sample(m, c, (int)o->sample, text) < 0) {
      free(text);
      return -1;
    }
    text[o->sample] = '\0';
    printf("sample:\n%s\n", text);
    free(text);
  }
  fflush(stdout);
  return 0;
}

int main(int argc, char **argv) {
  gpt_opts o = {NULL, "f32", GR_TOTAL, 100, 300};
  int pr = gpt_parse(argc, argv, &o);
  if (pr != 0) return pr > 0 ? 0 : 2;

  gr_corpus c;
  char err[512] = "";
  if (gr_corpus_load(NULL, &c, err, sizeof err) < 0) {
    fprintf(stderr, "train_gpt: cannot load the corpus: %s\n", err);
    return 1;
  }
  dispatch_device *dev = NULL;
  gm_model m = {0};
  int status = 1;
  int rc = dispatch_device_open(o.device, NULL, &dev, err, sizeof err);
  if (rc < 0) {
    fprintf(stderr, "train_gpt: cannot open device '%s': %s: %s\n",
            o.device ? o.device : "(default)", dispatch_err_name(rc), err);
    goto out;
  }
  if (gm_init(dev, c.nvocab, &m) < 0) goto out;
  if (gm_set_precision(&m, o.precision) < 0) goto out;
  printf("train_gpt: device %s, %lld parameters, corpus %zu bytes (vocab "
         "%d, train %zu, val %zu), %ld steps of %d x %d, precision %s\n",
         dispatch_device_spec(dev), (long long)m.nweights, c.n, c.nvocab,
         c.n_train, c.n - c.n_train, o.steps, GR_BATCH, GR_CTX,
         o.precision);
  fflush(stdout);
  double train_s;
  if (gpt_train(&m, &c, &o, &train_s) < 0) goto out;
  if (gpt_report(&m, &c, &o, train_s) < 0) goto out;
  status = 0;
out:
  gm_free(&m);
  dispatch_device_close(dev);
  gr_corpus_free(&c);
  return status;
}
