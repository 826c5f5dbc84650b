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
#include "wire_req.h"

static Dspwire__Request *unpack(const Dspwire__Request *r) {
  uint8_t buf[512];
  size_t n = dspwire__request__pack(r, buf);
  return dspwire__request__unpack(&sv_pb_allocator, n, buf);
}

/* Runs one request; returns the error code in its reply (0 when it has no
 * reply or succeeded, 1 when a reply could not even be allocated). */
static int run_req(sv_session *s, dsp_ctx *io, Dspwire__Request *r,
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
  int waits = r->body_case == DSPWIRE__REQUEST__BODY_READ ||
              r->body_case == DSPWIRE__REQUEST__BODY_SYNC ||
              r->body_case == DSPWIRE__REQUEST__BODY_STATS ||
              r->body_case == DSPWIRE__REQUEST__BODY_BACKWARD;
  if (waits && !j->out) code = 1;
  sv_job_free(j);
  return code;
}

static void scenario(sv_session *s, dsp_ctx *io) {
  float a[4] = {1, -2, 3, 4}, b[4] = {0.5f, 0.25f, -1, 2};
  int64_t shape[1] = {4};
  dsp_wreq w;
  run_req(s, io, dsp_wreq_upload(&w, 1, DSP_F32, 1, shape), a, 4);
  run_req(s, io, dsp_wreq_upload(&w, 2, DSP_F32, 1, shape), b, 4);
  /* 5: sgd velocity */
  run_req(s, io, dsp_wreq_upload(&w, 5, DSP_F32, 1, shape), b, 4);
  run_req(s, io, dsp_wreq_track(&w, 1), NULL, 0);

  uint64_t in2[2] = {1, 2}, in1[1] = {3};
  run_req(s, io, dsp_wreq_op(&w, DSP_OP_MUL, in2, 2, 3, NULL, 0, NULL, 0, 0),
          NULL, 0);
  run_req(s, io, dsp_wreq_op(&w, DSP_OP_SUM, in1, 1, 4, NULL, 0, NULL, 0, 0),
          NULL, 0);
  run_req(s, io, dsp_wreq_backward(&w, 4, 10, 0), NULL, 0);
  run_req(s, io, dsp_wreq_grad(&w, 10, 1, 11), NULL, 0);

  uint64_t params[1] = {1}, states[1] = {5};
  double fl[3] = {0.1, 0.9, 0};
  run_req(s, io,
          dsp_wreq_step(&w, DSP_OP_SGD_STEP, 10, params, 1, states, 1, NULL,
                        0, fl, 3),
          NULL, 0);
  run_req(s, io, dsp_wreq_read(&w, 11), NULL, 0);
  run_req(s, io, dsp_wreq_stats(&w), NULL, 0);

  uint64_t ft[2] = {3, 4}, fg[1] = {10};
  run_req(s, io, dsp_wreq_free(&w, ft, 2, fg, 1), NULL, 0);
}

Test(server_oom, every_allocation_failure_is_clean) {
  sv_config cfg;
  sv_config_defaults(&cfg);
  int clean_runs = 0;
  for (long n = 1; n < 5000 && clean_runs == 0; n++) {
    sv_global g;
    memset(&g, 0, sizeof g);
    failalloc_install(n);
    dsp_ctx *io = dsp_ctx_new(dsp_cpu_backend());
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
