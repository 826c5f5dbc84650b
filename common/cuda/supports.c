/* What the CUDA backend's kernels implement: its own op x key dtype table
 * (dsp__op_key_dtype), read off the kernels themselves, not borrowed from
 * the CPU. Every row names the kernel and the dtypes it has a typed path
 * for; a dtype a kernel would only reach through a fallback branch (the
 * binary kernel's uint8 instance, the map kernel's int64 default, a bool
 * arange) is not claimed. The other operands' dtypes are fixed by
 * inference (same dtype, i64 labels and indexes, bool masks). One row per
 * op: a new op in DSP_OP_MAP breaks the build here until it has a row,
 * tests/test_backend_ops.c checks on any host that built this backend that
 * the table claims no pair inference refuses, and on a GPU it runs every
 * pair claimed against the CPU. The half types (H_) have kernels of their
 * own for the elementwise family (the f32 math between an exact read and
 * one rounding), the softmax family, the copies, the cast, the fills and matmul (GemmEx, f32
 * compute); every other op reaches them through the op runner's widening
 * (common/op.c), which the table must not claim. */
#include "dsp_cuda.h"
#include "ops_plan.h"
#include "scalar_math.h"

#define F_ (1u << DSP_F32)
#define D_ (1u << DSP_F64)
#define I_ (1u << DSP_I64)
#define B_ (1u << DSP_BOOL)
#define H_ ((1u << DSP_F16) | (1u << DSP_BF16))
#define FD_ (F_ | D_)
#define FDI_ (F_ | D_ | I_)
#define ALL_ (F_ | D_ | I_ | B_)
#define FLOAT_UNARY_ROW_(OP, f) {DSP_OP_##OP, FD_ | H_},
static const struct cu_row {
  dsp_opcode op;
  unsigned dtypes;
} g_cu_ops[] = {
    /* k_binary<float/double/int64_t> (dsp__sm_bin_*), and its f16/bf16
     * instances computing in f32 (wide/narrow in kernels.cu); integer div
     * checks its divisors first (dsp__cuk_first_bad) */
    {DSP_OP_ADD, FDI_ | H_}, {DSP_OP_SUB, FDI_ | H_}, {DSP_OP_MUL, FDI_ | H_},
    {DSP_OP_DIV, FDI_ | H_}, {DSP_OP_MAXIMUM, FDI_ | H_},
    {DSP_OP_MINIMUM, FDI_ | H_},
    /* k_binary's compare path (dsp__sm_cmp_*): eq/ne for every dtype, the
     * orderings for the numeric ones */
    {DSP_OP_EQ, ALL_ | H_}, {DSP_OP_NE, ALL_ | H_}, {DSP_OP_LT, FDI_ | H_},
    {DSP_OP_LE, FDI_ | H_}, {DSP_OP_GT, FDI_ | H_}, {DSP_OP_GE, FDI_ | H_},
    /* k_where copies elements by size: every dtype */
    {DSP_OP_WHERE, ALL_ | H_},
    /* k_map (dsp__sm_scalar_*): i64 has add/sub/mul/rsub only; the
     * halves run the f32 math */
    {DSP_OP_ADD_SCALAR, FDI_ | H_}, {DSP_OP_SUB_SCALAR, FDI_ | H_},
    {DSP_OP_MUL_SCALAR, FDI_ | H_}, {DSP_OP_DIV_SCALAR, FD_ | H_},
    {DSP_OP_POW_SCALAR, FD_ | H_}, {DSP_OP_RSUB_SCALAR, FDI_ | H_},
    {DSP_OP_RDIV_SCALAR, FD_ | H_},
    /* k_map (dsp__sm_unary_*, dsp__sm_act_bw_*): i64 has neg, abs, sign,
     * relu and relu_backward; every float-only unary op of scalar_math.h
     * is a case of dsp__sm_unary_f32/f64 */
    {DSP_OP_NEG, FDI_ | H_}, {DSP_OP_ABS, FDI_ | H_}, {DSP_OP_SIGN, FDI_ | H_},
    {DSP_OP_RELU, FDI_ | H_},
    DSP_SM_FLOAT_UNARY(FLOAT_UNARY_ROW_)
    {DSP_OP_RELU_BACKWARD, FDI_ | H_}, {DSP_OP_GELU_BACKWARD, FD_ | H_},
    {DSP_OP_SOFTPLUS_BACKWARD, FD_ | H_}, {DSP_OP_GELU_TANH_BACKWARD, FD_ | H_},
    /* k_clamp and k_masked_fill: float, double, int64_t and half
     * instances */
    {DSP_OP_CLAMP, FDI_ | H_}, {DSP_OP_MASKED_FILL, FDI_ | H_},
    /* dsp__cuk_reduce: RSum/RMaxF for f32/f64, RSumI/RMaxI for i64 (min
     * and argmin their mirrored forms); var/std: RVar after a mean pass */
    {DSP_OP_SUM, FDI_}, {DSP_OP_MEAN, FD_}, {DSP_OP_MAX, FDI_},
    {DSP_OP_ARGMAX, FDI_}, {DSP_OP_MIN, FDI_}, {DSP_OP_ARGMIN, FDI_},
    {DSP_OP_VAR, FD_}, {DSP_OP_STD, FD_},
    /* copies and k_gather/k_scatter move elements by size (1, 2, 4 or 8
     * bytes); k_cast has every source x target pair, halves included
     * (common/half.h); k_index_select_bw sums f32/f64/i64 */
    {DSP_OP_RESHAPE, ALL_ | H_}, {DSP_OP_PERMUTE, ALL_ | H_},
    {DSP_OP_TRANSPOSE, ALL_ | H_}, {DSP_OP_SLICE, ALL_ | H_},
    {DSP_OP_CAT, ALL_ | H_}, {DSP_OP_STACK, ALL_ | H_},
    {DSP_OP_BROADCAST_TO, ALL_ | H_}, {DSP_OP_INDEX_SELECT, ALL_ | H_},
    {DSP_OP_CAST, ALL_ | H_}, {DSP_OP_SLICE_BACKWARD, ALL_ | H_},
    {DSP_OP_INDEX_SELECT_BACKWARD, FDI_},
    /* cuBLAS S/Dgemm; GemmEx with f32 compute for f16 and bf16 */
    {DSP_OP_MATMUL, FD_ | H_},
    /* k_softmax, k_cross_entropy, k_mse, im2col + gemm, k_pool,
     * k_dropout: float and double instances; k_softmax also f16/bf16
     * (read exactly, computed in double as for f32, stored as the f32
     * kernel would, rounded once) */
    {DSP_OP_SOFTMAX, FD_ | H_}, {DSP_OP_LOG_SOFTMAX, FD_ | H_},
    {DSP_OP_SOFTMAX_BACKWARD, FD_ | H_}, {DSP_OP_LOG_SOFTMAX_BACKWARD, FD_ | H_},
    {DSP_OP_CROSS_ENTROPY, FD_}, {DSP_OP_CROSS_ENTROPY_BACKWARD, FD_},
    {DSP_OP_MSE, FD_}, {DSP_OP_CONV2D, FD_},
    {DSP_OP_CONV2D_BACKWARD_INPUT, FD_}, {DSP_OP_CONV2D_BACKWARD_WEIGHT, FD_},
    {DSP_OP_MAX_POOL2D, FD_}, {DSP_OP_AVG_POOL2D, FD_},
    {DSP_OP_MAX_POOL2D_BACKWARD, FD_}, {DSP_OP_AVG_POOL2D_BACKWARD, FD_},
    {DSP_OP_DROPOUT, FD_},
    /* issue 23 (cuda/norm.c): k_index_select / the index_select_backward
     * CSR gather for embedding, k_norm_fwd / k_norm_bw / k_norm_cols */
    {DSP_OP_EMBEDDING, FD_}, {DSP_OP_EMBEDDING_BACKWARD, FD_},
    {DSP_OP_LAYER_NORM, FD_}, {DSP_OP_LAYER_NORM_BACKWARD, FD_},
    {DSP_OP_RMS_NORM, FD_}, {DSP_OP_RMS_NORM_BACKWARD, FD_},
    /* k_bn_fwd / k_bn_bw */
    {DSP_OP_BATCH_NORM, FD_}, {DSP_OP_BATCH_NORM_BACKWARD, FD_},
    /* issue 23: k_attn_fwd, k_attn_bwd_q + k_attn_bwd_kv (attn.cu),
     * computing in double for both */
    {DSP_OP_ATTENTION, FD_}, {DSP_OP_ATTENTION_BACKWARD, FD_},
    /* issue 23: loss.cu's k_ce_ex_rows / k_ce_ex_total, float and double */
    {DSP_OP_CROSS_ENTROPY_EX, FD_}, {DSP_OP_CROSS_ENTROPY_EX_BACKWARD, FD_},
    /* k_pool_fwd with the count_include_pad divisor (dsp__cu_pool_div) */
    {DSP_OP_AVG_POOL2D_EX, FD_},
    /* im2col + gemm, then loss.cu's k_bias_add */
    {DSP_OP_CONV2D_BIAS, FD_},
    /* zeroed storage; k_fill for every dtype (a half value rounded once
     * from the double, as the CPU's fill); k_arange_i64/k_arange_f;
     * k_random float and double */
    {DSP_OP_ZEROS, ALL_ | H_}, {DSP_OP_ONES, ALL_ | H_}, {DSP_OP_FULL, ALL_ | H_},
    {DSP_OP_ARANGE, FDI_}, {DSP_OP_UNIFORM, FD_}, {DSP_OP_NORMAL, FD_},
    /* k_sgd, k_adam */
    {DSP_OP_SGD_STEP, FD_}, {DSP_OP_ADAM_STEP, FD_}, {DSP_OP_ADAMW_STEP, FD_},
};
_Static_assert(sizeof g_cu_ops / sizeof g_cu_ops[0] == DSP__OP_COUNT,
               "every op in DSP_OP_MAP needs a row in the CUDA support table "
               "(give it a CUDA kernel or a row of no dtypes)");

int dsp__cuda_has_kernel(dsp_opcode op, dsp_dtype key) {
  if (!dsp_dtype_valid((int)key)) return 0;
  for (size_t i = 0; i < sizeof g_cu_ops / sizeof g_cu_ops[0]; i++)
    if (g_cu_ops[i].op == op) return (g_cu_ops[i].dtypes >> key) & 1u;
  return 0;
}
