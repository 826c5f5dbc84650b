/* Private to the backends (common/cpu/, common/cuda/) and the storage
 * code (tensor, stage, pin, alloc, cache, the op runner's backend calls in
 * common/backend.c): the backend table itself. Everything else, the server
 * and the client included, holds a `const dsp_backend *` and asks through
 * the functions of common/dsp.h (dsp_backend_caps, dsp_backend_name, ...). */
#ifndef DSP_BACKEND_H
#define DSP_BACKEND_H

#include "dsp.h"

/* A backend is a table of functions plus a context pointer. The CPU backend
 * is the first implementation; a CUDA one plugs into the same table. */
struct dsp_backend {
  const char *name;
  const char *device; /* human description, e.g. "cpu x86_64 (openblas)" */
  void *bctx;
  /* One device of a server: its name ("cpu:1", "cuda:0"; NULL: name) in
   * messages, and its own memory budget (NULL: none), charged for every
   * storage made on it beside the creating ctx's budget, so each device
   * is accounted apart from the others. Storages charge it without a
   * reference: it must live as long as the backend. */
  const char *id;
  dsp_budget *mem;
  /* storage; data pointers are opaque to callers other than the backend */
  /* zero != 0: the bytes must read as zero; else their content is
   * unspecified (the caller overwrites every byte, e.g. an upload) */
  int (*alloc)(void *bctx, size_t nbytes, int zero, void **data);
  void (*free)(void *bctx, void *data);
  int (*copy_in)(void *bctx, void *dst, const void *src, size_t n);
  int (*copy_out)(void *bctx, void *dst, const void *src, size_t n);
  /* Staging: how bytes cross between the network layer and storage
   * without an extra copy (dsp_tensor_stage_in, dsp_tensor_pin). Only the
   * backend touches `data`.
   * stage_in: nbytes of host memory (*host) the caller fills with every
   *   byte of data; commit_in then moves them into data. The CPU hands out
   *   data itself and commits nothing; a GPU backend hands out pinned host
   *   memory and commits with a DMA.
   * stage_out: nbytes of host memory holding data's bytes as they are at
   *   the call. The CPU hands out data itself (DSP_CAP_HOST_MEMORY: a reader keeps
   *   those bytes still with a pin, common/pin.c); a GPU backend copies to
   *   pinned host memory.
   * stage_release ends either staging (committed or not) with the *token
   *   it gave; a NULL token is a no-op. */
  int (*stage_in)(void *bctx, void *data, size_t nbytes, void **host,
                  void **token);
  int (*commit_in)(void *bctx, void *data, const void *host, size_t nbytes,
                   void *token);
  int (*stage_out)(void *bctx, const void *data, size_t nbytes,
                   const void **host, void **token);
  void (*stage_release)(void *bctx, void *token);
  /* Optional overlap of staging with the socket (NULL: none; the CPU has
   * no copy to overlap).
   * commit_part: starts moving staged bytes [off, off+n) into data and
   *   returns without waiting; with last set (the final part, n may be 0)
   *   it also waits until every part is in data. When set, dsp_stage
   *   uses it instead of commit_in.
   * stage_out_wait: stage_out may return once the first part of the
   *   copy has landed, the rest still in flight; this blocks until the
   *   part holding byte off has landed and returns the end of the landed
   *   prefix (> off), or 0 when the copy failed (the bytes are then
   *   unspecified). */
  int (*commit_part)(void *bctx, void *data, const void *host, size_t off,
                     size_t n, int last, void *token);
  size_t (*stage_out_wait)(void *bctx, void *token, size_t off);
  unsigned caps; /* DSP_CAP_* (common/dsp.h) */
  /* Bit (1u << family) set: every kernel of that op family writes every
   * element of its result (or fails, and the result goes), so dsp_op
   * leaves the result's storage unzeroed. */
  unsigned writes_every_element;
  /* 1 if the backend has a kernel for op on these inputs and this output
   * (the meta dsp_op_infer computed: for a creation op, with no inputs,
   * it carries the dtype); 0 makes dsp_op fail with DISPATCH_EUNSUPPORTED
   * naming the op, the dtypes and the backend before anything is
   * allocated. Truthful per op x dtype: the conformance suite
   * (tests/test_backend_ops.c) runs every pair it claims and checks that
   * every pair it refuses is refused. */
  int (*supports_op)(void *bctx, dsp_opcode op, const dsp_meta *in, int n_in,
                     const dsp_meta *out);
  /* runs the kernel into the already allocated `out`, whose meta is the
   * one dsp_op_infer computed; kernels may still fail on values (an index
   * out of range) and then return an error with the detail set in ctx. An
   * op x dtype it has no kernel for is DISPATCH_EUNSUPPORTED, never a
   * success that leaves `out` as allocated. */
  int (*run_op)(void *bctx, dsp_ctx *ctx, dsp_opcode op,
                dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                dsp_tensor *out);
};

#endif
