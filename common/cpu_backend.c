/* The CPU backend: host memory and the family kernels of common/. */
#include <stdlib.h>
#include <string.h>

#include "dsp_internal.h"

static int cpu_alloc(void *bctx, size_t nbytes, int zero, void **data) {
  (void)bctx;
  *data = zero ? dsp_calloc(1, nbytes) : dsp_malloc(nbytes);
  return *data ? 0 : DISPATCH_ENOMEM;
}

static void cpu_free(void *bctx, void *data) {
  (void)bctx;
  dsp_free(data);
}

static int cpu_copy(void *bctx, void *dst, const void *src, size_t n) {
  (void)bctx;
  if (n) memcpy(dst, src, n);
  return 0;
}

static int cpu_supports(void *bctx, dsp_opcode op, const dsp_meta *in, int n) {
  (void)bctx, (void)in, (void)n;
  return dsp_op_lookup((int)op) != NULL;
}

static int cpu_run(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                   dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                   dsp_tensor *out) {
  (void)bctx;
  switch (dsp_op_lookup((int)op)->family) {
    case DSP_FAM_EW: return dsp__cpu_ew(ctx, op, in, n_in, a, out);
    case DSP_FAM_RED: return dsp__cpu_red(ctx, op, in, n_in, a, out);
    case DSP_FAM_SHAPE: return dsp__cpu_shape(ctx, op, in, n_in, a, out);
    case DSP_FAM_LINALG: return dsp__cpu_linalg(ctx, op, in, n_in, a, out);
    case DSP_FAM_NN: return dsp__cpu_nn(ctx, op, in, n_in, a, out);
    case DSP_FAM_CREATE: return dsp__cpu_create(ctx, op, in, n_in, a, out);
    case DSP_FAM_OPTIM: return dsp__cpu_optim(ctx, op, in, n_in, a, out);
  }
  return dsp_seterr(ctx, DISPATCH_EINTERNAL, "cpu: bad family");
}

static const dsp_backend g_cpu = {
    .name = "cpu",
    .device = "host CPU (OpenBLAS)",
    .bctx = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .copy_in = cpu_copy,
    .copy_out = cpu_copy,
    .supports_op = cpu_supports,
    .run_op = cpu_run,
};

const dsp_backend *dsp_cpu_backend(void) { return &g_cpu; }
