/* Autocast: the mixed-precision policy of a device (dispatch_autocast),
 * applied by the op runner to every op's inputs before the op runs, on
 * LOCAL and REMOTE devices alike. The casts are ordinary CAST ops: a
 * tracked input gives a tracked cast, so the backward carries each
 * gradient back to its f32 master in f32 (CAST's own gradient rule).
 *
 * The classes follow torch.autocast's lists: the matrix products run in
 * half, what sums many terms or takes exp / log runs in f32, and an
 * elementwise op of several inputs of different float dtypes computes in
 * the widest of them (torch's type promotion), as dispatch's kernels take
 * one dtype. Every other op runs in its inputs' dtype. */
#include "client_internal.h"

typedef enum ac_class { AC_KEEP, AC_HALF, AC_F32, AC_PROMOTE } ac_class;

typedef struct ac_row {
  dsp_opcode op;
  ac_class cls;
} ac_row;

/* The ops that are not AC_KEEP, except the elementwise and joining ops
 * of several inputs, which promote (class_of). */
static const ac_row g_rows[] = {
    {DSP_OP_MATMUL, AC_HALF},        {DSP_OP_CONV2D, AC_HALF},
    {DSP_OP_CONV2D_BIAS, AC_HALF},   {DSP_OP_ATTENTION, AC_HALF},
    {DSP_OP_SUM, AC_F32},            {DSP_OP_MEAN, AC_F32},
    {DSP_OP_VAR, AC_F32},            {DSP_OP_STD, AC_F32},
    {DSP_OP_SOFTMAX, AC_F32},        {DSP_OP_LOG_SOFTMAX, AC_F32},
    {DSP_OP_CROSS_ENTROPY, AC_F32},  {DSP_OP_CROSS_ENTROPY_EX, AC_F32},
    {DSP_OP_MSE, AC_F32},            {DSP_OP_LAYER_NORM, AC_F32},
    {DSP_OP_RMS_NORM, AC_F32},       {DSP_OP_BATCH_NORM, AC_F32},
    {DSP_OP_EXP, AC_F32},            {DSP_OP_LOG, AC_F32},
    {DSP_OP_POW_SCALAR, AC_F32},     {DSP_OP_SOFTPLUS, AC_F32},
};

static ac_class class_of(dsp_opcode op) {
  for (size_t i = 0; i < sizeof g_rows / sizeof g_rows[0]; i++)
    if (g_rows[i].op == op) return g_rows[i].cls;
  const dsp_op_info *info = dsp_op_lookup((int)op);
  if (info && (info->family == DSP_FAM_EW || op == DSP_OP_CAT ||
               op == DSP_OP_STACK) &&
      info->n_inputs != 1)
    return AC_PROMOTE;
  return AC_KEEP;
}

static int is_float(dsp_dtype dt) {
  return dt == DSP_F32 || dt == DSP_F64 || dt == DSP_F16 || dt == DSP_BF16;
}

/* Rank of a float dtype in torch's promotion (f16 and bf16 together give
 * f32: neither holds the other). */
static int width(dsp_dtype dt) {
  return dt == DSP_F64 ? 3 : dt == DSP_F32 ? 2 : 1;
}

/* The dtype input dt becomes under class cls, given the op's widest
 * float input; dt itself when it stays. */
static dsp_dtype target(ac_class cls, dsp_dtype half, dsp_dtype dt,
                        dsp_dtype widest) {
  if (!is_float(dt)) return dt;
  switch (cls) {
    case AC_HALF: return dt == DSP_F64 ? dt : half; /* f64 stays, as torch */
    case AC_F32: return dt == DSP_F16 || dt == DSP_BF16 ? DSP_F32 : dt;
    case AC_PROMOTE: return widest;
    default: return dt;
  }
}

int dispatch__autocast_inputs(dispatch_device *dev, dsp_opcode op,
                              dispatch_tensor *const *in, int n_in,
                              dispatch_tensor **cin, dispatch_tensor **casts) {
  ac_class cls = class_of(op);
  if (cls == AC_KEEP) return 0;
  /* promotion: the widest float dtype among the inputs; f16 with bf16
   * meets in f32 */
  dsp_dtype widest = DSP_NDTYPES;
  for (int i = 0; i < n_in && cls == AC_PROMOTE; i++) {
    dsp_dtype dt = in[i]->meta.dtype;
    if (!is_float(dt)) continue;
    if (widest == DSP_NDTYPES)
      widest = dt;
    else if (width(dt) > width(widest))
      widest = dt;
    else if (dt != widest && width(dt) == width(widest))
      widest = DSP_F32;
  }
  for (int i = 0; i < n_in; i++) {
    dsp_dtype dt = in[i]->meta.dtype;
    dsp_dtype to = target(cls, (dsp_dtype)dev->autocast, dt, widest);
    if (to == dt) continue;
    dsp_attrs a = dsp_attrs_none();
    a.ints[a.n_ints++] = to;
    int rc = dispatch__run(dev, DSP_OP_CAST, &in[i], 1, &a, 0, &casts[i]);
    if (rc < 0) return rc;
    cin[i] = dispatch_inner(casts[i]);
  }
  return 0;
}

int dispatch_autocast(dispatch_device *dev, dispatch_dtype dtype,
                      dispatch_dtype *prev) {
  if (!dev) return DISPATCH_EINVAL;
  DISPATCH__GUARD(dev, "autocast");
  if (dtype != DISPATCH_F32 && dtype != DISPATCH_F16 && dtype != DISPATCH_BF16)
    return dispatch__ret(dev, dsp_seterr(dev->ctx, DISPATCH_EINVAL,
                                         "autocast: dtype %d is not f16, "
                                         "bf16 or f32 (off)",
                                         (int)dtype));
  if (prev) *prev = (dispatch_dtype)dev->autocast;
  dev->autocast = (int)dtype;
  return 0;
}
