/* In-process checks of single requests on the server's session layer
 * (server/session.c): the message a failing request leaves names the
 * values that were wrong. */
#include <criterion/criterion.h>
#include <string.h>

#include "dsp.h"
#include "sv.h"
#include "wire_req.h"

static Dspwire__Request *unpack(const Dspwire__Request *r) {
  uint8_t buf[1024];
  cr_assert_lt(dspwire__request__get_packed_size(r), sizeof buf);
  size_t n = dspwire__request__pack(r, buf);
  return dspwire__request__unpack(&sv_pb_allocator, n, buf);
}

/* Runs one request on s (an upload takes `bulk`, f32 [n]). */
static void run_req(sv_session *s, Dspwire__Request *r, const float *bulk,
                    int64_t n) {
  sv_job *j = dsp_calloc(1, sizeof *j);
  cr_assert_not_null(j);
  j->sess = s;
  j->req = unpack(r);
  cr_assert_not_null(j->req);
  if (bulk) {
    dsp_meta m = {DSP_F32, 1, {n}};
    cr_assert_eq(dsp_tensor_from_data(s->ctx, &m, bulk, (size_t)n * 4,
                                      &j->upload), 0);
  }
  sv_session_exec(s, j);
  sv_job_free(j);
}

static void upload(sv_session *s, uint64_t id) {
  float v[2] = {1, 2};
  int64_t shape[1] = {2};
  dsp_wreq w;
  run_req(s, dsp_wreq_upload(&w, id, DSP_F32, 1, shape), v, 2);
}

typedef struct fixture {
  sv_config cfg;
  sv_global g;
  sv_session *s;
} fixture;

static void fx_open(fixture *f) {
  sv_config_defaults(&f->cfg);
  memset(&f->g, 0, sizeof f->g);
  f->s = sv_session_new(&f->cfg, &f->g, NULL);
  cr_assert_not_null(f->s);
}

static void fx_close(fixture *f) {
  sv_session_teardown(f->s);
  dsp_free(f->s);
  cr_assert_eq(atomic_load(&f->g.tensors), 0);
}

/* Runs an sgd_step Step over params with states on s (lr 0.1). */
static void run_sgd_step(sv_session *s, uint64_t req_id, uint64_t *params,
                         size_t n_params, uint64_t *states, size_t n_states) {
  double fl[3] = {0.1, 0, 0};
  dsp_wreq w;
  Dspwire__Request *r = dsp_wreq_step(&w, DSP_OP_SGD_STEP, 7, params,
                                       n_params, states, n_states, NULL, 0,
                                       fl, 3);
  r->req_id = req_id;
  run_req(s, r, NULL, 0);
}

/* More parameters than the session has tensors: the message says so (it
 * used to claim the state count was wrong while quoting matching counts). */
Test(server_session, step_with_more_params_than_tensors_names_the_counts) {
  fixture f;
  fx_open(&f);
  upload(f.s, 1);
  upload(f.s, 2);
  uint64_t params[3] = {1, 1, 1}, states[3] = {2, 2, 2};
  run_sgd_step(f.s, 5, params, 3, states, 3);
  cr_assert_eq(f.s->err_code, DISPATCH_EINVAL, "%s", f.s->err_msg);
  cr_assert(strstr(f.s->err_msg, "3 params") &&
                strstr(f.s->err_msg, "only 2 tensors"),
            "message: %s", f.s->err_msg);
  fx_close(&f);
}

/* A wrong state count is still reported with both counts. */
Test(server_session, step_with_wrong_state_count_names_both_counts) {
  fixture f;
  fx_open(&f);
  upload(f.s, 1);
  upload(f.s, 2);
  uint64_t params[1] = {1}, states[2] = {2, 2};
  run_sgd_step(f.s, 6, params, 1, states, 2);
  cr_assert_eq(f.s->err_code, DISPATCH_EINVAL, "%s", f.s->err_msg);
  cr_assert(strstr(f.s->err_msg, "1 params need 1 state ids, got 2"),
            "message: %s", f.s->err_msg);
  fx_close(&f);
}

/* An optimizer op sent as a plain Op would give its in-place parameter a
 * second id (and count its bytes twice): it is refused, naming Step, and
 * nothing is added to the session. */
Test(server_session, optimizer_op_as_plain_op_is_refused) {
  fixture f;
  fx_open(&f);
  upload(f.s, 1);
  upload(f.s, 2);
  upload(f.s, 3);
  long long bytes = atomic_load(&f.s->bytes);
  uint64_t in[3] = {1, 2, 3};
  double fl[3] = {0.1, 0, 0};
  dsp_wreq w;
  Dspwire__Request *r =
      dsp_wreq_op(&w, DSP_OP_SGD_STEP, in, 3, 9, NULL, 0, fl, 3, 0);
  r->req_id = 6;
  run_req(f.s, r, NULL, 0);
  cr_assert_eq(f.s->err_code, DISPATCH_EINVAL, "%s", f.s->err_msg);
  cr_assert(strstr(f.s->err_msg, "Step"), "message: %s", f.s->err_msg);
  cr_assert_eq(atomic_load(&f.s->bytes), bytes);
  cr_assert_eq(f.s->n_live, 3);
  fx_close(&f);
}
