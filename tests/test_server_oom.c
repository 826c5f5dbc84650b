/* In-process check of the server's session layer (server/session.c,
 * idmap.c, encode.c) under allocation failure: a whole forward, backward,
 * grad, step, read, stats and free sequence is run with the N-th
 * allocation failing, for every N; each run must end with nothing leaked,
 * the server-wide counters back at zero, and failures reported as error
 * codes (never a crash). */
#include <criterion/criterion.h>
#include <string.h>

#include "dsp.h"
#include "helpers/failalloc.h"
#include "sv.h"

static Dispatch__Request *unpack(const Dispatch__Request *r) {
  uint8_t buf[512];
  size_t n = dispatch__request__pack(r, buf);
  return dispatch__request__unpack(&sv_pb_allocator, n, buf);
}

/* Runs one request; returns the error code in its reply (0 when it has no
 * reply or succeeded, 1 when a reply could not even be allocated). */
static int run_req(sv_session *s, dsp_ctx *io, Dispatch__Request *r,
                   const float *bulk, int64_t n) {
  sv_job *j = dsp_calloc(1, sizeof *j);
  if (!j) return DISPATCH_ENOMEM;
  j->sess = s;
  j->req = unpack(r);
  if (!j->req) {
    dsp_free(j);
    return DISPATCH_ENOMEM;
  }
  if (bulk) {
    dsp_meta m = {DSP_F32, 1, {n}};
    if (dsp_tensor_from_data(io, &m, bulk, (size_t)n * 4, &j->upload) < 0) {
      j->pre_err = DISPATCH_ENOMEM;
    }
  }
  sv_session_exec(s, j);
  int code = 0;
  int waits = r->body_case == DISPATCH__REQUEST__BODY_READ ||
              r->body_case == DISPATCH__REQUEST__BODY_SYNC ||
              r->body_case == DISPATCH__REQUEST__BODY_STATS ||
              r->body_case == DISPATCH__REQUEST__BODY_BACKWARD;
  if (waits && !j->out) code = 1;
  sv_job_free(j);
  return code;
}

static void scenario(sv_session *s, dsp_ctx *io) {
  float a[4] = {1, -2, 3, 4}, b[4] = {0.5f, 0.25f, -1, 2};
  Dispatch__Request r = DISPATCH__REQUEST__INIT;
  Dispatch__Upload up = DISPATCH__UPLOAD__INIT;
  Dispatch__TensorMeta m = DISPATCH__TENSOR_META__INIT;
  int64_t shape[1] = {4};
  m.dtype = DSP_F32;
  m.n_shape = 1;
  m.shape = shape;
  up.meta = &m;
  r.body_case = DISPATCH__REQUEST__BODY_UPLOAD;
  r.upload = &up;
  up.id = 1;
  run_req(s, io, &r, a, 4);
  up.id = 2;
  run_req(s, io, &r, b, 4);
  up.id = 5;
  run_req(s, io, &r, b, 4); /* velocity */

  Dispatch__Track tr = DISPATCH__TRACK__INIT;
  tr.id = 1;
  r.body_case = DISPATCH__REQUEST__BODY_TRACK;
  r.track = &tr;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Op op = DISPATCH__OP__INIT;
  uint64_t in2[2] = {1, 2}, in1[1] = {3};
  op.op = DSP_OP_MUL;
  op.n_inputs = 2;
  op.inputs = in2;
  op.output = 3;
  r.body_case = DISPATCH__REQUEST__BODY_OP;
  r.op = &op;
  run_req(s, io, &r, NULL, 0);
  op.op = DSP_OP_SUM;
  op.n_inputs = 1;
  op.inputs = in1;
  op.output = 4;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Backward bw = DISPATCH__BACKWARD__INIT;
  bw.loss = 4;
  bw.grads = 10;
  r.body_case = DISPATCH__REQUEST__BODY_BACKWARD;
  r.backward = &bw;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Grad gr = DISPATCH__GRAD__INIT;
  gr.grads = 10;
  gr.tensor = 1;
  gr.output = 11;
  r.body_case = DISPATCH__REQUEST__BODY_GRAD;
  r.grad = &gr;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Step st = DISPATCH__STEP__INIT;
  uint64_t params[1] = {1}, states[1] = {5};
  double fl[3] = {0.1, 0.9, 0};
  st.op = DSP_OP_SGD_STEP;
  st.grads = 10;
  st.n_params = 1;
  st.params = params;
  st.n_states = 1;
  st.states = states;
  st.n_floats = 3;
  st.floats = fl;
  r.body_case = DISPATCH__REQUEST__BODY_STEP;
  r.step = &st;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Read rd = DISPATCH__READ__INIT;
  rd.id = 11;
  r.body_case = DISPATCH__REQUEST__BODY_READ;
  r.read = &rd;
  run_req(s, io, &r, NULL, 0);
  Dispatch__Stats ss = DISPATCH__STATS__INIT;
  r.body_case = DISPATCH__REQUEST__BODY_STATS;
  r.stats = &ss;
  run_req(s, io, &r, NULL, 0);

  Dispatch__Free fr = DISPATCH__FREE__INIT;
  uint64_t ft[2] = {3, 4}, fg[1] = {10};
  fr.n_tensors = 2;
  fr.tensors = ft;
  fr.n_grads = 1;
  fr.grads = fg;
  r.body_case = DISPATCH__REQUEST__BODY_FREE;
  r.free = &fr;
  run_req(s, io, &r, NULL, 0);
}

Test(server_oom, every_allocation_failure_is_clean) {
  sv_config cfg;
  sv_config_defaults(&cfg);
  int clean_runs = 0;
  for (long n = 1; n < 5000 && clean_runs == 0; n++) {
    sv_global g;
    memset(&g, 0, sizeof g);
    failalloc_install(n);
    dsp_ctx *io = dsp_ctx_new();
    sv_session *s = io ? sv_session_new(&cfg, &g, NULL) : NULL;
    if (s) {
      scenario(s, io);
      if (failalloc_failed() == 0) {
        clean_runs++;
        cr_assert_eq(s->n_errors, 0, "%s", s->err_msg);
        cr_assert_eq(s->n_live, 4); /* 1, 2, 5, 11 */
      }
      sv_session_teardown(s);
      dsp_free(s);
    }
    dsp_ctx_free(io);
    cr_assert_eq(failalloc_live(), 0, "leak with allocation %ld failing", n);
    cr_assert_eq(atomic_load(&g.tensors), 0);
    cr_assert_eq(atomic_load(&g.bytes), 0);
    failalloc_remove();
  }
  cr_assert_eq(clean_runs, 1, "never ran without a failure");
}
