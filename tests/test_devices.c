/* Several devices in one dispatch-server (issue 10 item 3), against the
 * real binary on 127.0.0.1: the hello lists them, a session on cpu:1
 * computes what one on cpu:0 does bit for bit, a move between them keeps
 * the bytes and charges the device it lands on, inputs of two devices are
 * refused by name, device strings name devices the server must have, and
 * a device this build cannot open stops the server at start in one line.
 * Needs DISPATCH_SERVER_BIN (make test sets it). */
#include <criterion/criterion.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "dsp.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;

static void need_bin(void) {
  if (!getenv("DISPATCH_SERVER_BIN") || !*getenv("DISPATCH_SERVER_BIN"))
    cr_assert_fail("DISPATCH_SERVER_BIN is not set: this suite needs dispatch-server (make test sets it); failing rather than skipping");
}

/* Two CPU devices, each with a budget of its own of `mem` bytes. */
static void start_two(const char *mem) {
  need_bin();
  const char *args[] = {"--device", "cpu:0", "--device", "cpu:1",
                        "--device-memory", mem, NULL};
  cr_assert_eq(sp_start(&g_srv, args), 0, "dispatch-server did not start");
}

static void stop(void) {
  if (g_srv.pid) sp_stop(&g_srv);
}

static dispatch_device *open_spec(const char *suffix) {
  char spec[96], msg[512] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d%s", g_srv.port, suffix);
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "open %s: %s (%s)", spec, msg, dispatch_err_name(rc));
  return dev;
}

/* Free memory of device `name` as a separate session's Stats reports it
 * (devices are server-wide). */
static uint64_t device_free(const char *name) {
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "probe"), 0);
  uint64_t id = wire_stats(&c);
  cr_assert(id);
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(&c, &r, NULL, NULL), 0);
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_STATS);
  uint64_t free = UINT64_MAX;
  for (size_t i = 0; i < r->stats->n_devices; i++)
    if (strcmp(r->stats->devices[i]->name, name) == 0)
      free = r->stats->devices[i]->free_memory;
  wire_reply_free(r, NULL);
  wire_close(&c);
  cr_assert_neq(free, UINT64_MAX, "stats list no device %s", name);
  return free;
}

/* A raw hello that names a device; returns the reply (caller frees). */
static Dspwire__Reply *hello_on(wire_conn *c, const char *device) {
  cr_assert_eq(wire_connect(c, g_srv.port), 0);
  dsp_wreq w;
  Dspwire__Request *req =
      dsp_wreq_hello(&w, DSP_PROTO_MAJOR, DSP_PROTO_MINOR, "", "devices");
  w.body.hello.device = (char *)device;
  req->req_id = 1;
  cr_assert_eq(wire_send(c, req, NULL, 0), 0);
  c->next_req_id = 2;
  Dspwire__Reply *r;
  cr_assert_eq(wire_recv(c, &r, NULL, NULL), 0);
  return r;
}

Test(devices, hello_lists_two_cpu_devices, .fini = stop, .timeout = 120) {
  start_two("67108864");
  wire_conn c;
  Dspwire__Reply *r = hello_on(&c, "cpu:1");
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  cr_assert_eq(r->body_case, DSPWIRE__REPLY__BODY_HELLO);
  Dspwire__HelloReply *h = r->hello;
  cr_assert_eq(h->minor, DSP_PROTO_MINOR); /* 1.1 gave the device list */
  cr_assert_eq(h->n_devices, 2);
  cr_assert_str_eq(h->devices[0]->name, "cpu:0");
  cr_assert_str_eq(h->devices[1]->name, "cpu:1");
  for (int i = 0; i < 2; i++) {
    cr_assert_str_eq(h->devices[i]->kind, "cpu");
    cr_assert_eq(h->devices[i]->total_memory, 64u << 20);
    cr_assert_leq(h->devices[i]->free_memory, h->devices[i]->total_memory);
    cr_assert_gt(strlen(h->devices[i]->description), 0);
  }
  cr_assert_str_eq(h->session_device, "cpu:1");
  wire_reply_free(r, NULL);
  wire_close(&c);

  /* the client library lists them too */
  dispatch_device *dev = open_spec("/cpu:1");
  dispatch_device_info info[4] = {DISPATCH_DEVICE_INFO_INIT};
  int n = 0;
  cr_assert_eq(dispatch_device_list(dev, info, 4, &n), 0);
  cr_assert_eq(n, 2);
  cr_assert_str_eq(info[0].name, "cpu:0");
  cr_assert_str_eq(info[1].name, "cpu:1");
  cr_assert_str_eq(info[1].kind, "cpu");
  cr_assert_eq(info[1].total_memory, 64u << 20);
  cr_assert_eq(dispatch_device_list(dev, info, 1, &n), 0);
  cr_assert_eq(n, 2, "the count is the server's, not max");
  dispatch_device_close(dev);
}

/* One small training-like program: matmul, softmax, a loss and its
 * gradient; every result read back. */
static void program(dispatch_device *dev, float *out, size_t n_out) {
  int64_t sx[2] = {8, 16}, sw[2] = {16, 4};
  float xv[128], wv[64];
  for (int i = 0; i < 128; i++) xv[i] = (float)((i * 37) % 17) / 7.0f - 1.0f;
  for (int i = 0; i < 64; i++) wv[i] = (float)((i * 11) % 13) / 5.0f - 1.2f;
  dispatch_tensor *x, *w, *wt, *y, *s, *loss;
  dispatch_grads *g;
  dispatch_tensor *gw;
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sx, xv,
                                         sizeof xv, &x), 0);
  cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 2, sw, wv,
                                         sizeof wv, &w), 0);
  cr_assert_eq(dispatch_autodiff(w, &wt), 0);
  cr_assert_eq(dispatch_matmul(x, wt, &y), 0);
  cr_assert_eq(dispatch_softmax(y, 1, &s), 0);
  cr_assert_eq(dispatch_sum(s, 0, NULL, 0, &loss), 0);
  cr_assert_eq(dispatch_backward(loss, &g), 0, "%s",
               dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_grad(g, wt, &gw), 0);
  cr_assert_eq(n_out, 32 + 64);
  cr_assert_eq(dispatch_tensor_read(s, out, 32 * sizeof(float)), 0);
  cr_assert_eq(dispatch_tensor_read(gw, out + 32, 64 * sizeof(float)), 0);
  dispatch_grads_free(g);
}

Test(devices, cpu1_computes_bit_identical_results_to_cpu0, .fini = stop,
     .timeout = 120) {
  start_two("67108864");
  float a[96], b[96];
  dispatch_device *d0 = open_spec("/cpu:0");
  dispatch_device *d1 = open_spec("/cpu:1");
  program(d0, a, 96);
  program(d1, b, 96);
  cr_assert_eq(memcmp(a, b, sizeof a), 0, "cpu:1 differs from cpu:0");
  dispatch_device_close(d0);
  dispatch_device_close(d1);
}

/* A peer's tensors live on the peer's device although the session's is
 * cpu:0: ops follow their inputs, and a backward pass seeds and fills
 * its gradients there too (the seed is a creation op). */
Test(devices, a_peer_computes_and_differentiates_on_its_device, .fini = stop,
     .timeout = 120) {
  start_two("67108864");
  float a[96], b[96];
  dispatch_device *d0 = open_spec("/cpu:0"), *d1;
  cr_assert_eq(dispatch_device_open_peer(d0, "cpu:1", &d1), 0);
  uint64_t f1 = device_free("cpu:1");
  program(d0, a, 96);
  program(d1, b, 96);
  cr_assert_eq(memcmp(a, b, sizeof a), 0, "the peer on cpu:1 differs");
  cr_assert_lt(device_free("cpu:1"), f1, "the peer's tensors are on cpu:1");
  dispatch_device_close(d1);
  dispatch_device_close(d0);
}

Test(devices, move_keeps_bytes_and_charges_the_device_it_lands_on,
     .fini = stop, .timeout = 120) {
  start_two("16777216"); /* 16 MiB per device */
  dispatch_device *d0 = open_spec("/cpu:0"), *d1;
  cr_assert_eq(dispatch_device_open_peer(d0, "cpu:1", &d1), 0, "%s",
               dispatch_device_errmsg(d0));
  cr_assert_str_eq(dispatch_device_spec(d1) +
                       strlen(dispatch_device_spec(d1)) - 6,
                   "/cpu:1");
  uint64_t f0 = device_free("cpu:0"), f1 = device_free("cpu:1");
  enum { N = 1 << 20 }; /* 4 MiB of f32 */
  float *v = malloc(N * sizeof *v), *back = malloc(N * sizeof *v);
  for (int i = 0; i < N; i++) v[i] = (float)i * 0.25f - 7.0f;
  int64_t shape[1] = {N};
  dispatch_tensor *t0, *t1;
  cr_assert_eq(dispatch_tensor_from_data(d0, DISPATCH_F32, 1, shape, v,
                                         N * sizeof *v, &t0), 0);
  cr_assert_eq(dispatch_device_sync(d0), 0);
  cr_assert_geq(f0 - device_free("cpu:0"), N * sizeof *v,
                "the upload is charged to cpu:0");
  cr_assert_eq(device_free("cpu:1"), f1, "nothing on cpu:1 yet");

  cr_assert_eq(dispatch_to_device(t0, d1, &t1), 0, "%s",
               dispatch_device_errmsg(d1));
  cr_assert_eq(dispatch_device_sync(d1), 0, "%s", dispatch_device_errmsg(d1));
  uint64_t used1 = f1 - device_free("cpu:1");
  cr_assert_geq(used1, N * sizeof *v, "the copy is charged to cpu:1");
  cr_assert_lt(used1, N * sizeof *v + 4096);
  cr_assert_eq(dispatch_tensor_read(t1, back, N * sizeof *v), 0);
  cr_assert_eq(memcmp(v, back, N * sizeof *v), 0, "the move changed bytes");

  /* freeing the source gives cpu:0 its memory back; cpu:1 keeps the copy */
  dispatch_tensor_free(t0);
  cr_assert_eq(dispatch_device_sync(d0), 0);
  cr_assert_eq(device_free("cpu:0"), f0);
  cr_assert_eq(f1 - device_free("cpu:1"), used1);

  /* each device has its own budget: cpu:1 holds 4 MiB of its 16, so three
   * more copies of 4 MiB fit and the next is refused naming cpu:1, while
   * cpu:0 still takes a fresh 4 MiB upload */
  dispatch_tensor *c[4];
  for (int i = 0; i < 2; i++)
    cr_assert_eq(dispatch_to_device(t1, d1, &c[i]), 0);
  cr_assert_eq(dispatch_device_sync(d1), 0, "%s", dispatch_device_errmsg(d1));
  cr_assert_eq(dispatch_to_device(t1, d1, &c[2]), 0);
  cr_assert_eq(dispatch_device_sync(d1), DISPATCH_EQUOTA);
  const char *m = dispatch_device_errmsg(d1);
  cr_assert(strstr(m, "device cpu:1") && strstr(m, "--device-memory"), "%s",
            m);
  dispatch_tensor *u;
  cr_assert_eq(dispatch_tensor_from_data(d0, DISPATCH_F32, 1, shape, v,
                                         N * sizeof *v, &u), 0);
  cr_assert_eq(dispatch_device_sync(d0), 0, "%s", dispatch_device_errmsg(d0));
  dispatch_device_close(d1);
  dispatch_device_close(d0);
  free(v);
  free(back);
}

Test(devices, inputs_on_two_devices_are_refused_naming_both, .fini = stop,
     .timeout = 120) {
  start_two("67108864");
  /* through the client: refused before anything is sent */
  dispatch_device *d0 = open_spec("/cpu:0"), *d1;
  cr_assert_eq(dispatch_device_open_peer(d0, "cpu:1", &d1), 0);
  int64_t shape[1] = {4};
  dispatch_tensor *a, *b, *c;
  cr_assert_eq(dispatch_ones(d0, DISPATCH_F32, 1, shape, &a), 0);
  cr_assert_eq(dispatch_ones(d1, DISPATCH_F32, 1, shape, &b), 0);
  cr_assert_eq(dispatch_add(a, b, &c), DISPATCH_EDEVICE);
  const char *m = dispatch_device_errmsg(d0);
  cr_assert(strstr(m, "/cpu:0") && strstr(m, "/cpu:1"), "%s", m);
  dispatch_device_close(d1);
  dispatch_device_close(d0);

  /* through the wire: the server refuses, naming both devices */
  wire_conn w;
  Dspwire__Reply *r = hello_on(&w, "cpu:0");
  cr_assert_null(r->error);
  wire_reply_free(r, NULL);
  float v[4] = {1, 2, 3, 4};
  int64_t s4[1] = {4};
  cr_assert(wire_upload(&w, 10, DSP_F32, 1, s4, v, sizeof v));
  dsp_wreq q;
  Dspwire__Request *req = dsp_wreq_to_device(&q, 10, 11, "cpu:1");
  req->req_id = w.next_req_id++;
  cr_assert_eq(wire_send(&w, req, NULL, 0), 0);
  uint64_t in[2] = {10, 11};
  cr_assert(wire_op(&w, DSP_OP_ADD, in, 2, 12, NULL, 0, NULL, 0));
  char msg[640];
  uint64_t failed = 0;
  cr_assert_eq(wire_sync_check(&w, msg, sizeof msg, &failed),
               DISPATCH_EDEVICE, "%s", msg);
  cr_assert(strstr(msg, "add: input 0 is on device cpu:0, input 1 on device "
                        "cpu:1"),
            "%s", msg);
  /* the session goes on: the moved tensor reads back whole */
  void *data;
  size_t nb;
  cr_assert_eq(wire_read_tensor(&w, 11, &data, &nb, NULL, NULL), 0);
  cr_assert_eq(nb, sizeof v);
  cr_assert_eq(memcmp(data, v, sizeof v), 0);
  free(data);
  wire_close(&w);
}

Test(devices, device_strings_name_devices_the_server_has, .fini = stop,
     .timeout = 120) {
  start_two("67108864");
  char spec[96], msg[512];
  dispatch_device *dev = NULL;
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d/cpu:7", g_srv.port);
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  cr_assert_eq(rc, DISPATCH_EDEVICE, "%s: %s", dispatch_err_name(rc), msg);
  cr_assert_null(dev);
  cr_assert(strstr(msg, "unknown device \"cpu:7\"") &&
                strstr(msg, "cpu:0, cpu:1"),
            "%s", msg);
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d/cpu:1/x", g_srv.port);
  cr_assert_eq(dispatch_device_open(spec, NULL, &dev, msg, sizeof msg),
               DISPATCH_EINVAL);
  cr_assert(strstr(msg, "HOST:PORT/DEVICE"), "%s", msg);
  /* local:cuda:0 without its plugin: what is missing and where it was
   * looked for (tests/test_cuda_plugin.c checks the rest) */
  setenv("DISPATCH_CUDA_PLUGIN", "/nonexistent/dispatch-cuda.so", 1);
  cr_assert_eq(dispatch_device_open("local:cuda:0", NULL, &dev, msg,
                                    sizeof msg),
               DISPATCH_EUNSUPPORTED);
  unsetenv("DISPATCH_CUDA_PLUGIN");
  cr_assert(strstr(msg, "CUDA plugin not found"), "%s", msg);
  cr_assert_eq(dispatch_device_open("local:tpu", NULL, &dev, msg, sizeof msg),
               DISPATCH_EINVAL);
  cr_assert_eq(dispatch_device_open("local:cpu", NULL, &dev, msg, sizeof msg),
               0, "%s", msg);
  dispatch_device_close(dev);

  /* DISPATCH_DEVICE carries the same form; a bare kind is its first
   * device */
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d/cpu", g_srv.port);
  setenv("DISPATCH_DEVICE", spec, 1);
  rc = dispatch_device_open(NULL, NULL, &dev, msg, sizeof msg);
  unsetenv("DISPATCH_DEVICE");
  cr_assert_eq(rc, 0, "%s", msg);
  dispatch_device *peer = NULL;
  cr_assert_eq(dispatch_device_open_peer(dev, "cpu:9", &peer),
               DISPATCH_EDEVICE);
  cr_assert_null(peer);
  cr_assert(strstr(dispatch_device_errmsg(dev), "cpu:0, cpu:1"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_device_sync(dev), 0, "the session goes on");
  dispatch_device_close(dev);
}

Test(devices, a_device_that_cannot_open_stops_the_server_in_one_line,
     .timeout = 120) {
  need_bin();
  char out[2048];
  const char *a1[] = {"--listen", "127.0.0.1:0", "--device", "cpu",
                      "--device", "cuda:0", NULL};
  int st = sp_run_capture(a1, out, sizeof out);
  cr_assert_neq(st, 0, "%s", out);
  cr_assert_null(strstr(out, "listening"), "%s", out);
  cr_assert(strstr(out, "cuda:0"), "%s", out);
  char *nl = strchr(out, '\n');
  cr_assert(nl && nl[1] == '\0', "one line, got: %s", out);
  const char *a2[] = {"--listen", "127.0.0.1:0", "--device", "tpu:0", NULL};
  st = sp_run_capture(a2, out, sizeof out);
  cr_assert_neq(st, 0, "%s", out);
  cr_assert(strstr(out, "--device tpu:0: expected"), "%s", out);
  const char *a3[] = {"--listen", "127.0.0.1:0", "--device", "cpu:1",
                      "--device", "cpu:1", NULL};
  st = sp_run_capture(a3, out, sizeof out);
  cr_assert_neq(st, 0, "%s", out);
  cr_assert(strstr(out, "given twice"), "%s", out);
}

/* --device all: cpu:0, then cuda:0..N-1 for every GPU the CUDA plugin
 * reports (none without the plugin, dispatch-cuda.so beside the server
 * when make built it, and none on a host without a usable GPU); when it
 * found no GPU, --device cuda:0 stops the server at start with the
 * one-line reason. */
static void check_all(const char *bin, int *n_cuda) {
  char *old = strdup(getenv("DISPATCH_SERVER_BIN"));
  setenv("DISPATCH_SERVER_BIN", bin, 1);
  const char *args[] = {"--device", "all", NULL};
  int rc = sp_start(&g_srv, args);
  setenv("DISPATCH_SERVER_BIN", old, 1);
  free(old);
  cr_assert_eq(rc, 0, "%s --device all did not start", bin);
  wire_conn c;
  Dspwire__Reply *r = hello_on(&c, "");
  cr_assert_null(r->error, "%s", r->error ? r->error->message : "");
  Dspwire__HelloReply *h = r->hello;
  cr_assert_geq(h->n_devices, 1);
  cr_assert_str_eq(h->devices[0]->name, "cpu:0");
  for (size_t i = 1; i < h->n_devices; i++) {
    char want[32];
    snprintf(want, sizeof want, "cuda:%zu", i - 1);
    cr_assert_str_eq(h->devices[i]->name, want);
    cr_assert_str_eq(h->devices[i]->kind, "cuda");
  }
  *n_cuda = (int)h->n_devices - 1;
  wire_reply_free(r, NULL);
  wire_close(&c);
  sp_stop(&g_srv);
  g_srv.pid = 0;
}

Test(devices, all_opens_cpu0_and_every_gpu_the_host_has, .fini = stop,
     .timeout = 120) {
  need_bin();
  int n_cuda = -1;
  /* without the plugin: cpu:0 alone */
  setenv("DISPATCH_CUDA_PLUGIN", "/nonexistent/dispatch-cuda.so", 1);
  check_all(getenv("DISPATCH_SERVER_BIN"), &n_cuda);
  unsetenv("DISPATCH_CUDA_PLUGIN");
  cr_assert_eq(n_cuda, 0, "no CUDA device without the plugin");
  check_all(getenv("DISPATCH_SERVER_BIN"), &n_cuda);
  printf("devices/all: --device all opened cpu:0 and %d CUDA device(s)\n",
         n_cuda);
  if (n_cuda > 0) return;
  char out[2048];
  const char *a[] = {"--listen", "127.0.0.1:0", "--device", "cuda:0", NULL};
  int st = sp_run_capture(a, out, sizeof out);
  cr_assert_neq(st, 0, "%s", out);
  cr_assert(strstr(out, "--device cuda:0: "), "%s", out);
  char *nl = strchr(out, '\n');
  cr_assert(nl && nl[1] == '\0', "one line, got: %s", out);
}
