/* shape family on CUDA: copies, casts, gathers and scatters over index
 * maps (cuda_plan.h), and index_select with its checked indices. */
#include "cuda_be.h"

int dsp__cu_index_check(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                        const dsp_tensor *ix, int dim, int64_t size) {
  int64_t pos, v;
  int e = dsp__cuk_first_bad(b->stream, dsp_tensor_data(ix), ix->numel, 0, size,
                             0, &pos);
  if (e) return dsp__cu_err(ctx, e, op, "index check");
  if (pos < 0) return 0;
  if ((e = dsp__cu_peek_i64(b, (const int64_t *)dsp_tensor_data(ix) + pos, &v)))
    return dsp__cu_err(ctx, e, op, "index read");
  return dsp_seterr(ctx, DISPATCH_EINDEX,
                    "%s: index %lld (position %lld) out of range for dim %d of "
                    "size %lld",
                    opname(op), (long long)v, (long long)pos, dim, (long long)size);
}

/* index_select_backward: the (already checked) indices come to the host,
 * are sorted by destination row (dsp__cu_csr_build) and go back as a CSR,
 * so each output element gathers its rows in increasing k: the CPU's sum
 * order, no atomics, and work proportional to the grad, not to S * L.
 * Host and device scratch are charged to the ctx's budget. Also
 * embedding_backward's scatter (op names the caller in errors). */
int dsp__cu_rows_scatter_add(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                             dsp_tensor *const *in, int64_t outer, int64_t L,
                             int64_t S, int64_t blk, dsp_tensor *out) {
  const size_t hn = (size_t)(L + S + 1 + L) * sizeof(int64_t);
  const size_t dn = (size_t)(S + 1 + L) * sizeof(int64_t);
  int64_t *h = NULL;
  void *d = NULL;
  int rc = dsp__scratch_alloc(ctx, hn,
                              op == DSP_OP_INDEX_SELECT_BACKWARD
                                  ? "index_select_backward: row lists"
                                  : "embedding_backward: row lists",
                              (void **)&h);
  if (rc < 0) return rc;
  int64_t *hix = h, *start = h + L, *ks = start + S + 1;
  cudaError_t e = cudaSuccess;
  if (L > 0 && ((e = cudaMemcpyAsync(hix, dsp_tensor_data(in[1]), (size_t)L * sizeof(int64_t),
                                     cudaMemcpyDeviceToHost, b->stream)) != cudaSuccess ||
                (e = cudaStreamSynchronize(b->stream)) != cudaSuccess)) {
    dsp__scratch_free(ctx, h, hn);
    return dsp__cu_err(ctx, e, op, "index read");
  }
  dsp__cu_csr_build(hix, L, S, start, ks);
  if ((rc = dsp__cu_scratch_get(b, ctx, op, dn, &d)) < 0) {
    dsp__scratch_free(ctx, h, hn);
    return rc;
  }
  /* start and ks are adjacent on the host: one copy; the host buffer is
   * only freed once the copy has landed */
  int ke = 0;
  if ((e = cudaMemcpyAsync(d, start, dn, cudaMemcpyHostToDevice, b->stream)) == cudaSuccess)
    ke = dsp__cuk_index_select_bw(b->stream, (int)in[0]->meta.dtype, outer, L, S, blk,
                                  (const int64_t *)d, (const int64_t *)d + S + 1,
                                  dsp_tensor_data(in[0]), dsp_tensor_data(out));
  cudaError_t se = cudaStreamSynchronize(b->stream);
  dsp__cu_scratch_put(b, ctx, dn, d);
  dsp__scratch_free(ctx, h, hn);
  if (e != cudaSuccess) return dsp__cu_err(ctx, e, op, "cudaMemcpyAsync");
  if (ke) return dsp__cu_err(ctx, ke, op, "kernel launch");
  return se == cudaSuccess ? 0 : dsp__cu_err(ctx, se, op, "cudaStreamSynchronize");
}

int dsp__cu_run_shape(cu_be *b, dsp_ctx *ctx, dsp_opcode op,
                      dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                      dsp_tensor *out) {
  const dsp_tensor *x = in[0];
  const int es = (int)dsp_dtype_size(x->meta.dtype);
  const dsp_meta *big;
  dsp__cu_index ix;
  int64_t base;
  int e = 0, rc, dim, perm[DSP_MAX_DIMS];
  switch (op) {
    case DSP_OP_RESHAPE:
      e = cudaMemcpyAsync(dsp_tensor_data(out), dsp_tensor_data(x),
                          dsp_tensor_nbytes(out), cudaMemcpyDeviceToDevice, b->stream);
      return e ? dsp__cu_err(ctx, e, op, "cudaMemcpyAsync") : 0;
    case DSP_OP_CAST:
      if (x->meta.dtype == out->meta.dtype)
        e = cudaMemcpyAsync(dsp_tensor_data(out), dsp_tensor_data(x),
                            dsp_tensor_nbytes(out), cudaMemcpyDeviceToDevice,
                            b->stream);
      else
        e = dsp__cuk_cast(b->stream, (int)x->meta.dtype, (int)out->meta.dtype,
                          out->numel, dsp_tensor_data(x), dsp_tensor_data(out));
      return e ? dsp__cu_err(ctx, e, op, "cast") : 0;
    case DSP_OP_BROADCAST_TO: {
      const dsp_meta *ms[1] = {&x->meta};
      dsp__cu_plan_bcast(&ix, &out->meta, ms, 1);
      e = dsp__cuk_gather(b->stream, es, out->numel, &ix, 0, dsp_tensor_data(x),
                          dsp_tensor_data(out));
      return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_PERMUTE:
    case DSP_OP_TRANSPOSE: {
      if ((rc = dsp__perm_params(ctx, op, a, x->meta.ndim, perm)) < 0) return rc;
      dsp__cu_plan_perm(&ix, &x->meta, perm, &out->meta);
      e = dsp__cuk_gather(b->stream, es, out->numel, &ix, 0, dsp_tensor_data(x),
                          dsp_tensor_data(out));
      return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_SLICE:
    case DSP_OP_SLICE_BACKWARD: {
      /* big: the un-sliced tensor (x for slice, out for the backward) */
      const int bw = op == DSP_OP_SLICE_BACKWARD;
      big = bw ? &out->meta : &x->meta;
      const dsp_meta *small = bw ? &x->meta : &out->meta;
      int64_t s0, len;
      if ((rc = dsp__slice_params(ctx, op, big, a->ints, &dim, &s0, &len)) < 0)
        return rc;
      dsp__cu_plan_slice(&ix, big, small, dim, s0, a->ints[3], &base);
      int64_t cnt = bw ? x->numel : out->numel;
      if (bw)
        e = dsp__cuk_scatter(b->stream, es, cnt, &ix, base,
                             dsp_tensor_data(x), dsp_tensor_data(out));
      else
        e = dsp__cuk_gather(b->stream, es, cnt, &ix, base,
                            dsp_tensor_data(x), dsp_tensor_data(out));
      return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_CAT:
    case DSP_OP_STACK: {
      const int stack = op == DSP_OP_STACK;
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim + stack,
                             &dim)) < 0)
        return rc;
      int64_t pos = 0;
      for (int i = 0; i < n_in && !e; i++) {
        const dsp_meta *mi = &in[i]->meta;
        dsp__cu_plan_cat(&ix, &out->meta, mi, dim, stack, pos, &base);
        e = dsp__cuk_scatter(b->stream, es, in[i]->numel, &ix, base,
                             dsp_tensor_data(in[i]), dsp_tensor_data(out));
        pos += stack ? 1 : mi->shape[dim];
      }
      return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
    }
    case DSP_OP_INDEX_SELECT:
    case DSP_OP_INDEX_SELECT_BACKWARD: {
      const int bw = op == DSP_OP_INDEX_SELECT_BACKWARD;
      if ((rc = dsp_norm_dim(ctx, opname(op), a->ints[0], x->meta.ndim, &dim)) < 0)
        return rc;
      const int64_t S = bw ? a->ints[1] : x->meta.shape[dim], L = in[1]->numel;
      if ((rc = dsp__cu_index_check(b, ctx, op, in[1], dim, S)) < 0) return rc;
      if (out->numel == 0) return 0;
      const int64_t outer = dsp__cu_prod(x->meta.shape, 0, dim);
      const int64_t blk = dsp__cu_prod(x->meta.shape, dim + 1, x->meta.ndim);
      if (bw) return dsp__cu_rows_scatter_add(b, ctx, op, in, outer, L, S, blk, out);
      e = dsp__cuk_index_select(b->stream, es, outer, L, S, blk,
                                dsp_tensor_data(in[1]), dsp_tensor_data(x),
                                dsp_tensor_data(out));
      return e ? dsp__cu_err(ctx, e, op, "kernel launch") : 0;
    }
    default:
      return dsp__cu_no_kernel(b, ctx, op);
  }
}
