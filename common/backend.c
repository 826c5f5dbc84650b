/* The backend table's accessors: the one place outside the backends and
 * the storage code that reads a struct dsp_backend (common/backend.h), so
 * the op runner, the server and the client ask for what they need (a
 * name, a capability, a kernel) and never look inside the table. */
#include "backend.h"
#include "dsp_internal.h"

unsigned dsp_backend_caps(const dsp_backend *be) { return be ? be->caps : 0; }

const char *dsp_backend_name(const dsp_backend *be) { return be->name; }

const char *dsp_backend_description(const dsp_backend *be) {
  return be->device;
}

const char *dsp_backend_id(const dsp_backend *be) {
  return be->id ? be->id : be->name;
}

void dsp_backend_set_device(dsp_backend *be, const char *id, dsp_budget *mem) {
  be->id = id;
  be->mem = mem;
}

dsp_budget *dsp_backend_device_budget(const dsp_backend *be) {
  return be->mem;
}

int dsp__backend_supports(const dsp_backend *be, dsp_opcode op,
                          const dsp_meta *in, int n_in, const dsp_meta *out) {
  return be->supports_op && be->supports_op(be->bctx, op, in, n_in, out);
}

int dsp__backend_writes_every_element(const dsp_backend *be,
                                      dsp_op_family fam) {
  return (be->writes_every_element >> fam) & 1u;
}

int dsp__backend_run(const dsp_backend *be, dsp_ctx *ctx, dsp_opcode op,
                     dsp_tensor *const *in, int n_in, const dsp_attrs *a,
                     dsp_tensor *out) {
  return be->run_op(be->bctx, ctx, op, in, n_in, a, out);
}
