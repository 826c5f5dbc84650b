/* The character-level GPT recipe of issue 23, the one statement of its
 * rules: examples/train_gpt.c follows this code, and
 * examples/python/gpt_data.py is a line-by-line copy that the dispatch
 * Python twin (train_gpt.py) and the PyTorch reference (gpt_torch.py)
 * follow, so all three see the same bytes, batches and initial weights.
 *
 * Corpus: the regular files (symlinks skipped) of /usr/share/games/fortunes
 *   (Debian fortunes + fortunes-min; $GPT_CORPUS_DIR overrides) whose name
 *   ends neither in ".dat" nor ".u8", sorted by name (strcmp), concatenated.
 * Vocabulary: the sorted set of bytes present; a byte's token is its rank.
 * Split: the last n / 10 bytes (integer division) are the validation split,
 *   the first n_train = n - n / 10 the training split.
 * Random numbers: splitmix64 (gr_next), one stream per use: BATCH_SEED for
 *   the training windows, INIT_SEED for the weights, SAMPLE_SEED for the
 *   generated sample.
 * Training windows: per step BATCH draws o = gr_next() % (n_train - CTX);
 *   window train[o .. o+CTX-1] predicts train[o+1 .. o+CTX].
 * Validation: VAL_WINDOWS fixed windows of the validation split starting at
 *   i * ((n_val - CTX - 1) / (VAL_WINDOWS - 1)), i = 0..VAL_WINDOWS-1; the
 *   validation loss is the mean cross-entropy over all their VAL_WINDOWS x
 *   CTX predictions, evaluated BATCH windows at a time.
 * Baselines: add-one bigram P(b|a) = (c(a,b) + 1) / (c(a) + V) and unigram
 *   P(b) = (c(b) + 1) / (n_train + V), counted on the training split (c(a)
 *   = sum over b of c(a,b)), averaged over the same validation predictions.
 * Initial weights, in gr_param_spec order: matrices and embeddings
 *   INIT_STD * normal (GPT-2's 0.02), biases zeros, LayerNorm weights ones.
 *   A normal takes two draws a, b: u1 = ((a >> 11) + 1) / 2^53 (in (0, 1]),
 *   u2 = (b >> 11) / 2^53, z = sqrt(-2 ln u1) cos(2 pi u2), then float.
 *   Matrices are [in, out] (y = x W + b); the output layer is untied.
 * Optimiser: AdamW lr 3e-3, betas 0.9 / 0.95, eps 1e-8, weight decay 0.1
 *   on the 2-D parameters only, clip at global norm 1.0, and the lr of step
 *   s (0-based) dispatch_lr_cosine(s, 100, 2000, 3e-3, 3e-4).
 * Sample: from the context "\n", SAMPLE chars, each picked by inverse CDF
 *   of one uniform (gr_next() >> 11) / 2^53 over the softmax (double) of
 *   the last position's logits, the context cropped to the last CTX. */
#ifndef EXAMPLES_GPT_DATA_H
#define EXAMPLES_GPT_DATA_H

#include <stddef.h>
#include <stdint.h>

#define GR_CTX 64
#define GR_BATCH 32
#define GR_D_MODEL 128
#define GR_N_HEAD 4
#define GR_N_LAYER 2
#define GR_D_MLP 512
#define GR_BATCH_SEED 1337u
#define GR_INIT_SEED 42u
#define GR_SAMPLE_SEED 7u
#define GR_INIT_STD 0.02
#define GR_VAL_WINDOWS 512
#define GR_LR_MAX 3e-3
#define GR_LR_MIN 3e-4
#define GR_WARMUP 100
#define GR_TOTAL 2000
#define GR_BETA1 0.9
#define GR_BETA2 0.95
#define GR_ADAM_EPS 1e-8
#define GR_WEIGHT_DECAY 0.1
#define GR_CLIP 1.0
#define GR_LN_EPS 1e-5
#define GR_CORPUS_DIR "/usr/share/games/fortunes"

/* 2 embeddings + 16 per layer + 4 at the end */
#define GR_NPARAMS (2 + 16 * GR_N_LAYER + 4)

typedef struct gr_corpus {
  uint8_t *tok;   /* n tokens */
  size_t n;
  size_t n_train; /* tok[0..n_train-1] train, the rest validation */
  uint8_t vocab[256];
  int nvocab;     /* V */
} gr_corpus;

enum gr_init { GR_NORMAL, GR_ZEROS, GR_ONES };

typedef struct gr_param_spec {
  char name[32];
  int ndim;
  int64_t shape[2];
  enum gr_init init;
} gr_param_spec;

/* Reads the corpus of folder (NULL: $GPT_CORPUS_DIR, else GR_CORPUS_DIR).
 * 0, or -1 with a message in err. */
int gr_corpus_load(const char *folder, gr_corpus *c, char *err, size_t len);
void gr_corpus_free(gr_corpus *c);

uint64_t gr_next(uint64_t *state);
double gr_uniform(uint64_t *state); /* [0, 1), 53 bits */

/* The GR_BATCH window starts of the next training step. */
void gr_batch_offsets(uint64_t *state, const gr_corpus *c, size_t *off);
/* x, y [nwin, GR_CTX] i64 of the windows tok[base + off[i] ...]. */
void gr_windows(const gr_corpus *c, size_t base, const size_t *off, int nwin,
                int64_t *x, int64_t *y);
/* The GR_VAL_WINDOWS validation starts, relative to n_train. */
void gr_val_offsets(const gr_corpus *c, size_t *off);

/* The GR_NPARAMS parameters in their fixed order for vocabulary size V. */
void gr_param_specs(int nvocab, gr_param_spec *spec);
/* Fills n floats of one parameter; GR_NORMAL draws from *state. */
void gr_param_fill(const gr_param_spec *s, uint64_t *state, float *out);

/* The add-one bigram and unigram losses (nats/char). 0, or -1 out of
 * memory. */
int gr_baselines(const gr_corpus *c, double *bigram, double *unigram);

/* Inverse-CDF pick over probs[0..n-1] with one gr_uniform draw. */
int gr_sample_pick(uint64_t *state, const double *probs, int n);

#endif
