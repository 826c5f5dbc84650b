/* The character-level GPT of issue 23 through dispatch's public client
 * API (the recipe and its data: gpt_data.h): token and learned position
 * embeddings, GR_N_LAYER pre-LayerNorm blocks (causal attention of
 * GR_N_HEAD heads through dispatch_attention, then an MLP with exact
 * GELU), a final LayerNorm and an untied output layer; AdamW with
 * per-parameter weight decay, clipping by global norm, and the cosine
 * schedule of dispatch_lr_cosine. Nothing here knows whether the device
 * is local or a server, so train_gpt and bench/gpt.c step the same model
 * on both.
 *
 * Every step, evaluation batch and sampled character runs in its own
 * scope (dispatch_scope_begin/end); the parameters are AUTODIFF leaves
 * updated in place by the optimizer. Evaluation and sampling run the
 * forward on the plain inner tensors (no tape).
 *
 * Errors: every function returns 0 or a negative DISPATCH_E* code and has
 * already printed "<what> failed: <code name>: <device detail>" on
 * stderr. */
#ifndef EXAMPLES_GPT_MODEL_H
#define EXAMPLES_GPT_MODEL_H

#include "dispatch_client.h"
#include "gpt_data.h"

typedef struct gm_model {
  dispatch_device *dev;
  int nvocab;
  gr_param_spec spec[GR_NPARAMS];
  dispatch_tensor *p[GR_NPARAMS]; /* AUTODIFF leaves, spec order */
  dispatch_optim *opt;
  int64_t nweights;
  int scaled; /* the loss is scaled (f16: dispatch_optim_set_loss_scale) */
} gm_model;

/* The training precision: "f32" (the default), or "bf16" / "f16" mixed
 * precision: dispatch_autocast on the model's device (matmuls and
 * attention in half, f32 master weights and optimizer state), and for
 * f16 dynamic loss scaling inside the step (torch's GradScaler defaults:
 * 65536, growth 2 after 2000 clean steps, backoff 0.5). Call after
 * gm_init; it applies to training, validation and sampling alike. 0, or
 * DISPATCH_EINVAL for another name (printed), or the library's error. */
int gm_set_precision(gm_model *m, const char *precision);

/* Parameters from GR_INIT_SEED on dev, and the AdamW optimizer. */
int gm_init(dispatch_device *dev, int nvocab, gm_model *m);
void gm_free(gm_model *m);

/* One training step (0-based index step: its lr) on the windows x, y
 * [GR_BATCH, GR_CTX]; *loss is the batch's mean cross-entropy. */
int gm_step(gm_model *m, int64_t step, const int64_t *x, const int64_t *y,
            float *loss);

/* The validation loss of gpt_data.h on the current weights. */
int gm_val_loss(gm_model *m, const gr_corpus *c, double *loss);

/* n sampled bytes after "\n" (the rule of gpt_data.h) into out[0..n-1]. */
int gm_sample(gm_model *m, const gr_corpus *c, int n, char *out);

#endif
