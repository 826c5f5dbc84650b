/* One backend queue per session on a device kind that has session views
 * (issue 10 item 4: one CUDA stream per session).
 *
 * The CUDA backend gives each session a view of its device (its own
 * stream and cuBLAS handle); the server picks it through the device's
 * session_open / session_close hooks (server/devices.c). No GPU here, so
 * a test double kind "view" stands in: each view is a CPU backend
 * instance of its own, named like the device and sharing its memory
 * budget, and the hooks count opens and closes. Through the server's own
 * request path (sv_stream_exec) every way a tensor lands on the device --
 * the device the hello picked, an upload naming it, a creation op naming
 * it, a move to it -- must land on the session's view, never on the
 * device's shared backend; a view is opened on first use only (at the
 * hello at the earliest); two sessions get two views; ops between the
 * tensors of one session work; teardown gives each view back once. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend.h"
#include "dsp.h"
#include "dsp_internal.h"
#include "frame.h"
#include "sv.h"
#include "wire_req.h"

static int g_opened, g_closed;

static int view_open(dsp_backend *be, dsp_backend **out, char *why,
                     size_t len) {
  dsp_backend *v = dsp_cpu_backend_new(be->id);
  if (!v) {
    snprintf(why, len, "out of memory");
    return DISPATCH_ENOMEM;
  }
  v->mem = be->mem;
  g_opened++;
  *out = v;
  return 0;
}
/* the CUDA views outlive their session (a pin may still free on them);
 * the double keeps them to the end of the test for the same reason */
static dsp_backend *g_returned[8];
static void view_close(dsp_backend *v) {
  cr_assert_lt(g_closed, 8);
  g_returned[g_closed++] = v;
}

static sv_config g_cfg;
static sv_global g;

/* devices: cpu:0 (shared, the default) and view:1 (session views) */
static void setup(void) {
  sv_config_defaults(&g_cfg);
  g_cfg.log_level = SV_LOG_ERROR;
  sv_log_level = SV_LOG_ERROR;
  memset(&g, 0, sizeof g);
  g.devices = calloc(SV_MAX_DEVICES, sizeof *g.devices);
  cr_assert_not_null(g.devices);
  const char *names[2] = {"cpu:0", "view:1"};
  for (int i = 0; i < 2; i++) {
    sv_device *d = &g.devices[i];
    snprintf(d->name, sizeof d->name, "%s", names[i]);
    d->kind = i ? "view" : "cpu";
    d->be = dsp_cpu_backend_new(d->name);
    d->mem = dsp_budget_new(UINT64_MAX, NULL, d->name, "--device-memory");
    cr_assert(d->be && d->mem);
    d->be->mem = d->mem;
    d->total = UINT64_MAX;
    if (i) {
      d->session_open = view_open;
      d->session_close = view_close;
    }
  }
  g.n_devices = 2;
  g_opened = g_closed = 0;
}

static void teardown(void) {
  for (int i = 0; i < g_closed; i++) dsp_cpu_backend_free(g_returned[i]);
  for (int i = 0; i < g.n_devices; i++) {
    dsp_cpu_backend_free(g.devices[i].be);
    dsp_budget_unref(g.devices[i].mem);
  }
  free(g.devices);
}

TestSuite(session_views, .init = setup, .fini = teardown);

typedef struct stream {
  uint8_t *p;
  size_t n, cap;
  uint64_t rid;
} stream;

static void frame(stream *s, Dspwire__Request *req, const void *bulk,
                  size_t bulk_len) {
  req->req_id = ++s->rid;
  size_t need = s->n + dsp_req_frame_size(req) + bulk_len;
  if (need > s->cap) {
    s->cap = need * 2;
    s->p = realloc(s->p, s->cap);
    cr_assert_not_null(s->p);
  }
  s->n += dsp_req_frame_encode(req, bulk_len, s->p + s->n);
  if (bulk_len) memcpy(s->p + s->n, bulk, bulk_len);
  s->n += bulk_len;
}

static dsp_tensor *lookup(sv_session *s, uint64_t id) {
  sv_entry *e = sv_idmap_get(&s->tensors, id);
  return e ? e->t : NULL;
}

/* Runs, in s: upload 1 to view:1, zeros 2 on view:1, upload 3 on the
 * default cpu:0, move 3 -> 4 on view:1, add 1 + 2 -> 5. */
static void run_everything(sv_session *s, dsp_ctx *io) {
  stream st = {0};
  dsp_wreq w;
  float x[6] = {1, 2, 3, 4, 5, 6};
  int64_t sh[1] = {6};
  Dspwire__Request *r = dsp_wreq_upload(&w, 1, DSP_F32, 1, sh);
  r->upload->device = "view:1";
  frame(&st, r, x, sizeof x);
  int64_t zi[2] = {DSP_F32, 6};
  r = dsp_wreq_op(&w, DSP_OP_ZEROS, NULL, 0, 2, zi, 2, NULL, 0, 1);
  r->op->device = "view:1";
  frame(&st, r, NULL, 0);
  frame(&st, dsp_wreq_upload(&w, 3, DSP_F32, 1, sh), x, sizeof x);
  frame(&st, dsp_wreq_to_device(&w, 3, 4, "view:1"), NULL, 0);
  uint64_t in[2] = {1, 2};
  frame(&st, dsp_wreq_op(&w, DSP_OP_ADD, in, 2, 5, NULL, 0, NULL, 0, 1),
        NULL, 0);
  int hello = 1;
  sv_stream_stats stats;
  cr_assert_eq(sv_stream_exec(s, io, &hello, st.p, st.n, &stats), 0);
  cr_assert_eq(stats.executed, 5);
  cr_assert_eq(s->err_code, 0, "%s", s->err_msg);
  free(st.p);
}

Test(session_views, each_session_runs_a_device_on_its_own_view) {
  dsp_ctx *io = dsp_ctx_new(dsp_cpu_backend());
  sv_session *s1 = sv_session_new(&g_cfg, &g, NULL);
  sv_session *s2 = sv_session_new(&g_cfg, &g, NULL);
  cr_assert(io && s1 && s2);
  /* the default device has no views: both sessions share its backend */
  cr_assert_eq(s1->device, g.devices[0].be);
  cr_assert_eq(g_opened, 0, "a view is opened on first use only");
  run_everything(s1, io);
  run_everything(s2, io);
  cr_assert_eq(g_opened, 2, "one view per session, reused within it");
  const dsp_backend *v1 = lookup(s1, 1)->storage->backend;
  const dsp_backend *v2 = lookup(s2, 1)->storage->backend;
  cr_assert_neq(v1, g.devices[1].be, "an upload lands on the session's view");
  cr_assert_neq(v1, v2, "two sessions, two views (two streams)");
  for (uint64_t id = 2; id <= 5; id++) {
    if (id == 3) {
      cr_assert_eq(lookup(s1, 3)->storage->backend, g.devices[0].be);
      continue;
    }
    cr_assert_eq(lookup(s1, id)->storage->backend, v1, "s1 tensor %llu",
                 (unsigned long long)id);
    cr_assert_eq(lookup(s2, id)->storage->backend, v2, "s2 tensor %llu",
                 (unsigned long long)id);
  }
  /* a view names its device and is charged to the device's budget */
  cr_assert_str_eq(dsp_backend_id(v1), "view:1");
  cr_assert_geq(dsp_budget_used(g.devices[1].mem), 4 * 6 * sizeof(float));
  float sum[6];
  cr_assert_eq(dsp_tensor_read(s1->ctx, lookup(s1, 5), sum, sizeof sum), 0);
  for (int i = 0; i < 6; i++) cr_assert_eq(sum[i], (float)(i + 1));

  sv_session_teardown(s1);
  cr_assert_eq(g_closed, 1, "teardown gives the session's view back");
  cr_assert_eq(g_returned[0], v1);
  sv_session_teardown(s2);
  cr_assert_eq(g_closed, 2);
  cr_assert_eq(dsp_budget_used(g.devices[1].mem), 0,
               "every byte on the device freed with its sessions");
  dsp_free(s1);
  dsp_free(s2);
  dsp_ctx_free(io);
}

/* A session whose device has views gets its view at its hello
 * (sv_session_use_device, what hello.c calls), not before: a connection
 * that never authenticates opens nothing on the device. From then on its
 * uploads land on the view. */
Test(session_views, the_hello_gives_a_session_its_view) {
  sv_device tmp = g.devices[0];
  g.devices[0] = g.devices[1];
  g.devices[1] = tmp;
  dsp_ctx *io = dsp_ctx_new(dsp_cpu_backend());
  sv_session *s = sv_session_new(&g_cfg, &g, NULL);
  cr_assert(io && s);
  cr_assert_eq(g_opened, 0, "nothing opened before the hello");
  char why[320];
  cr_assert_eq(sv_session_use_device(s, &g.devices[0], why, sizeof why), 0,
               "%s", why);
  cr_assert_eq(g_opened, 1);
  cr_assert_neq(s->device, g.devices[0].be);
  cr_assert_str_eq(dsp_backend_id(s->device), "view:1");
  cr_assert_eq(dsp_ctx_backend(s->ctx), s->device);
  stream st = {0};
  dsp_wreq w;
  float x[3] = {1, 2, 3};
  int64_t sh[1] = {3};
  frame(&st, dsp_wreq_upload(&w, 1, DSP_F32, 1, sh), x, sizeof x);
  int hello = 1;
  sv_stream_stats stats;
  cr_assert_eq(sv_stream_exec(s, io, &hello, st.p, st.n, &stats), 0);
  cr_assert_eq(lookup(s, 1)->storage->backend, s->device);
  free(st.p);
  sv_session_teardown(s);
  cr_assert_eq(g_closed, 1);
  dsp_free(s);
  dsp_ctx_free(io);
}
