/* The one request encoder (common/wire_req.h) that the client library,
 * the raw-protocol test helper and the fuzzers share: each builder's frame
 * says what was asked for, and a stream built from every builder is
 * served by a real dispatch-server on 127.0.0.1 with the results an
 * in-process computation gives. */
#include <criterion/criterion.h>
#include <string.h>

#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

/* Frames req (announcing bulk_len) and decodes it again; the caller frees
 * the result with dspwire__request__free_unpacked. */
static Dspwire__Request *round_trip(const Dspwire__Request *req,
                                     uint64_t bulk_len) {
  uint8_t buf[1024];
  size_t n = dsp_req_frame_size(req);
  cr_assert_leq(n, sizeof buf);
  cr_assert_eq(dsp_req_frame_encode(req, bulk_len, buf), n);
  dsp_frame_header h;
  cr_assert_eq(dsp_frame_header_decode(buf, UINT32_MAX, UINT64_MAX, &h), 0);
  cr_assert_eq(h.msg_len, n - DSP_FRAME_HEADER_SIZE);
  cr_assert_eq(h.bulk_len, bulk_len);
  Dspwire__Request *r =
      dspwire__request__unpack(NULL, h.msg_len, buf + DSP_FRAME_HEADER_SIZE);
  cr_assert_not_null(r);
  cr_assert_eq(r->req_id, req->req_id);
  cr_assert_eq(r->body_case, req->body_case);
  return r;
}

Test(wire_req, every_builder_frames_what_it_was_given) {
  dsp_wreq w;
  int64_t shape[3] = {INT64_MAX, 0, 2};
  uint64_t in[2] = {5, UINT64_MAX}, st[2] = {8, 9};
  int64_t ints[2] = {-1, 7};
  double fl[2] = {0.5, -2};

  Dspwire__Request *q = dsp_wreq_hello(&w, 1, 2, "tok", "name");
  q->req_id = 11;
  Dspwire__Request *r = round_trip(q, 0);
  cr_assert_eq(r->hello->major, 1);
  cr_assert_eq(r->hello->minor, 2);
  cr_assert_str_eq(r->hello->token, "tok");
  cr_assert_str_eq(r->hello->client_name, "name");
  dspwire__request__free_unpacked(r, NULL);

  q = dsp_wreq_upload(&w, 3, DSP_I64, 3, shape);
  r = round_trip(q, 48);
  cr_assert_eq(r->upload->id, 3);
  cr_assert_eq(r->upload->meta->dtype, DSP_I64);
  cr_assert_eq(r->upload->meta->n_shape, 3);
  cr_assert_arr_eq(r->upload->meta->shape, shape, sizeof shape);
  dspwire__request__free_unpacked(r, NULL);

  r = round_trip(dsp_wreq_op(&w, DSP_OP_SLICE, in, 2, 4, ints, 2, fl, 2, 1),
                 0);
  cr_assert_eq(r->op->op, DSP_OP_SLICE);
  cr_assert_eq(r->op->n_inputs, 2);
  cr_assert_arr_eq(r->op->inputs, in, sizeof in);
  cr_assert_eq(r->op->output, 4);
  cr_assert_arr_eq(r->op->ints, ints, sizeof ints);
  cr_assert_arr_eq(r->op->floats, fl, sizeof fl);
  cr_assert(r->op->no_grad);
  dspwire__request__free_unpacked(r, NULL);

  r = round_trip(dsp_wreq_step(&w, DSP_OP_ADAM_STEP, 6, in, 1, st, 2, ints,
                               1, fl, 2),
                 0);
  cr_assert_eq(r->step->op, DSP_OP_ADAM_STEP);
  cr_assert_eq(r->step->grads, 6);
  cr_assert_eq(r->step->n_params, 1);
  cr_assert_eq(r->step->params[0], 5);
  cr_assert_arr_eq(r->step->states, st, sizeof st);
  cr_assert_eq(r->step->n_ints, 1);
  cr_assert_eq(r->step->n_floats, 2);
  dspwire__request__free_unpacked(r, NULL);

  r = round_trip(dsp_wreq_free(&w, in, 2, st, 1), 0);
  cr_assert_arr_eq(r->free->tensors, in, sizeof in);
  cr_assert_eq(r->free->n_grads, 1);
  cr_assert_eq(r->free->grads[0], 8);
  dspwire__request__free_unpacked(r, NULL);

  r = round_trip(dsp_wreq_backward(&w, 2, 3, 1), 0);
  cr_assert(r->backward->loss == 2 && r->backward->grads == 3 &&
            r->backward->retain);
  dspwire__request__free_unpacked(r, NULL);
  r = round_trip(dsp_wreq_grad(&w, 3, 1, 12), 0);
  cr_assert(r->grad->grads == 3 && r->grad->tensor == 1 &&
            r->grad->output == 12);
  dspwire__request__free_unpacked(r, NULL);
  r = round_trip(dsp_wreq_track(&w, 42), 0);
  cr_assert_eq(r->track->id, 42);
  dspwire__request__free_unpacked(r, NULL);
  r = round_trip(dsp_wreq_read(&w, 43), 0);
  cr_assert_eq(r->read->id, 43);
  dspwire__request__free_unpacked(r, NULL);
  Dspwire__Request *(*const bare[3])(dsp_wreq *) = {
      dsp_wreq_sync, dsp_wreq_stats, dsp_wreq_bye};
  for (int i = 0; i < 3; i++)
    dspwire__request__free_unpacked(round_trip(bare[i](&w), 0), NULL);
}

static sp_server g_srv;

static void start_server(void) {
  const char *args[] = {"--log-level", "warn", "--threads", "2", NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "server did not start");
}
static void stop_server(void) {
  if (g_srv.pid > 0) cr_assert_eq(sp_stop(&g_srv), 0, "server exit status");
}

/* Every builder in one session: x = [1, 2, 3] tracked, loss = sum(x * x),
 * a retained backward (dloss/dx = 2x), its gradient read back, an sgd
 * step (lr 0.5, no momentum: x - 0.5 * 2x = 0), the parameter read back,
 * frees, stats, bye. */
TestSuite(wire_req_server, .init = start_server, .fini = stop_server);

Test(wire_req_server, every_builder_is_served) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "wire_req"), 0);
  float x[3] = {1, 2, 3}, zero[3] = {0};
  int64_t s3[1] = {3};
  cr_assert_neq(wire_upload(&c, 1, DSP_F32, 1, s3, x, sizeof x), 0);
  cr_assert_neq(wire_upload(&c, 2, DSP_F32, 1, s3, zero, sizeof zero), 0);
  cr_assert_neq(wire_track(&c, 1), 0);
  uint64_t xx[2] = {1, 1}, p = 3;
  cr_assert_neq(wire_op(&c, DSP_OP_MUL, xx, 2, 3, NULL, 0, NULL, 0), 0);
  cr_assert_neq(wire_op(&c, DSP_OP_SUM, &p, 1, 4, NULL, 0, NULL, 0), 0);
  uint64_t bid = wire_backward(&c, 4, 7, 1); /* waits: has a reply */
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->req_id, bid);
  cr_assert_null(r->error, "backward: %s", r->error->message);
  wire_reply_free(r, NULL);
  cr_assert_neq(wire_grad(&c, 7, 1, 5), 0);
  char msg[256];
  cr_assert_eq(wire_sync_check(&c, msg, sizeof msg, NULL), 0, "%s", msg);

  void *data;
  size_t nb;
  cr_assert_eq(wire_read_tensor(&c, 5, &data, &nb, NULL, NULL), 0);
  float g[3] = {2, 4, 6};
  cr_assert_eq(nb, sizeof g);
  cr_assert_arr_eq(data, g, sizeof g);
  free(data);

  uint64_t param = 1, vel = 2;
  double sgd[3] = {0.5, 0, 0};
  cr_assert_neq(wire_step(&c, DSP_OP_SGD_STEP, 7, &param, 1, &vel, 1, NULL,
                          0, sgd, 3),
                0);
  cr_assert_eq(wire_read_tensor(&c, 1, &data, &nb, NULL, NULL), 0);
  cr_assert_eq(nb, sizeof zero);
  cr_assert_arr_eq(data, zero, sizeof zero);
  free(data);

  uint64_t gone[3] = {3, 4, 5}, grads = 7;
  cr_assert_neq(wire_free(&c, gone, 3, &grads, 1), 0);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 2); /* x and its velocity */
  cr_assert_eq(st.grads, 0);
  cr_assert_neq(wire_bye(&c), 0);
  cr_assert_eq(wire_wait_closed(&c), 1);
  wire_close(&c);
}
