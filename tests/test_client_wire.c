/* libdispatch-client's REMOTE encoding against a scripted fake server on
 * 127.0.0.1 (a thread here): ops are pipelined without waiting, frees are
 * batched into one Free, an optimizer step is one Step message, the hello
 * carries the token, and a server that stops answering gives ECONN within
 * the configured bound instead of a hang. */
#include <criterion/criterion.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "dispatch.pb-c.h"
#include "dispatch_client.h"
#include "helpers/fake_peer.h"
#include "helpers/client_check.h"
#include "frame.h"

#define MAX_LOG 4096

typedef struct fake {
  int lfd, cfd, port;
  int silent; /* answer hello, then nothing */
  pthread_t th;
  pthread_mutex_t mu;
  int n;
  int kind[MAX_LOG];     /* body case of each request received */
  size_t count[MAX_LOG]; /* Op: inputs; Step: params; Free: tensors */
  size_t count2[MAX_LOG]; /* Step: states; Free: grads */
  char token[64];
  void *last_upload;
  size_t last_upload_len;
} fake;

/* Records every request; answers the waiting ones like a server whose
 * every request succeeded (Read returns the last upload's bytes). */
static void *fake_main(void *arg) {
  fake *f = arg;
  f->cfd = accept(f->lfd, NULL, NULL);
  if (f->cfd < 0) return NULL;
  for (;;) {
    Dspwire__Request *q;
    void *bulk;
    size_t bulk_len;
    if (fake_recv_request(f->cfd, &q, &bulk, &bulk_len) < 0) break;
    pthread_mutex_lock(&f->mu);
    int i = f->n < MAX_LOG ? f->n++ : MAX_LOG - 1;
    f->kind[i] = q->body_case;
    f->count[i] = f->count2[i] = 0;
    if (q->body_case == DSPWIRE__REQUEST__BODY_OP) f->count[i] = q->op->n_inputs;
    if (q->body_case == DSPWIRE__REQUEST__BODY_STEP) {
      f->count[i] = q->step->n_params;
      f->count2[i] = q->step->n_states;
    }
    if (q->body_case == DSPWIRE__REQUEST__BODY_FREE) {
      f->count[i] = q->free->n_tensors;
      f->count2[i] = q->free->n_grads;
    }
    if (q->body_case == DSPWIRE__REQUEST__BODY_UPLOAD) {
      free(f->last_upload);
      f->last_upload = bulk;
      f->last_upload_len = bulk_len;
      bulk = NULL;
    }
    if (q->body_case == DSPWIRE__REQUEST__BODY_HELLO)
      snprintf(f->token, sizeof f->token, "%s", q->hello->token);
    pthread_mutex_unlock(&f->mu);
    free(bulk);

    Dspwire__Reply r = DSPWIRE__REPLY__INIT;
    r.req_id = q->req_id;
    Dspwire__HelloReply hr = DSPWIRE__HELLO_REPLY__INIT;
    Dspwire__Error e = DSPWIRE__ERROR__INIT;
    Dspwire__ReadReply rr = DSPWIRE__READ_REPLY__INIT;
    Dspwire__TensorMeta tm = DSPWIRE__TENSOR_META__INIT;
    switch (q->body_case) {
      case DSPWIRE__REQUEST__BODY_HELLO:
        if (strcmp(q->hello->token, "sesame") != 0) {
          e.code = DISPATCH_EAUTH;
          e.message = "hello: token rejected by the fake";
          e.failed_req_id = q->req_id;
          r.error = &e;
        } else {
          hr.major = DSP_PROTO_MAJOR;
          r.body_case = DSPWIRE__REPLY__BODY_HELLO;
          r.hello = &hr;
        }
        fake_send_reply(f->cfd, &r, NULL, 0);
        break;
      case DSPWIRE__REQUEST__BODY_READ:
        if (f->silent) break;
        r.body_case = DSPWIRE__REPLY__BODY_READ;
        r.read = &rr;
        rr.meta = &tm;
        fake_send_reply(f->cfd, &r, f->last_upload, f->last_upload_len);
        break;
      case DSPWIRE__REQUEST__BODY_SYNC:
      case DSPWIRE__REQUEST__BODY_BACKWARD:
      case DSPWIRE__REQUEST__BODY_STATS:
        if (!f->silent) fake_send_reply(f->cfd, &r, NULL, 0);
        break;
      default: break;
    }
    dspwire__request__free_unpacked(q, NULL);
  }
  return NULL;
}

static fake *fake_start(int silent) {
  fake *f = calloc(1, sizeof *f);
  f->silent = silent;
  f->cfd = -1;
  pthread_mutex_init(&f->mu, NULL);
  f->lfd = fake_listen(&f->port);
  cr_assert_geq(f->lfd, 0, "cannot listen on 127.0.0.1");
  cr_assert_eq(pthread_create(&f->th, NULL, fake_main, f), 0);
  return f;
}

/* Call after the client closed its device: the thread sees EOF. */
static void fake_stop(fake *f) {
  pthread_join(f->th, NULL);
  if (f->cfd >= 0) close(f->cfd);
  close(f->lfd);
  free(f->last_upload);
  free(f);
}

static dispatch_device *open_fake(fake *f, const char *token) {
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", f->port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.token = token;
  dispatch_device *dev = NULL;
  int rc = dispatch_device_open(spec, &o, &dev, msg, sizeof msg);
  cr_assert_eq(rc, 0, "%s", msg);
  return dev;
}

static int count_kind(fake *f, int kind) {
  int n = 0;
  pthread_mutex_lock(&f->mu);
  for (int i = 0; i < f->n; i++) n += f->kind[i] == kind;
  pthread_mutex_unlock(&f->mu);
  return n;
}


Test(client_wire, ops_are_pipelined_and_frees_batched) {
  fake *f = fake_start(0);
  dispatch_device *dev = open_fake(f, "sesame");
  int64_t sh[1] = {8};
  float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  dispatch_tensor *x, *t;
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_F32, 1, sh, v, sizeof v, &x));
  OK(dev, dispatch_scope_begin(dev));
  t = x;
  for (int i = 0; i < 10; i++) OK(dev, dispatch_mul_scalar(t, 2.0, &t));
  /* a shape error needs no round trip and sends nothing */
  int64_t bad[2] = {3, 3};
  dispatch_tensor *r = NULL;
  cr_assert_eq(dispatch_reshape(t, 2, bad, &r), DISPATCH_ESHAPE);
  OK(dev, dispatch_scope_end(dev));
  /* nothing waited yet: only the hello reached the server */
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_OP), 0);
  OK(dev, dispatch_device_sync(dev));
  pthread_mutex_lock(&f->mu);
  int n = f->n;
  int want[] = {DSPWIRE__REQUEST__BODY_HELLO, DSPWIRE__REQUEST__BODY_UPLOAD};
  cr_assert_eq(n, 2 + 10 + 1 + 1, "got %d frames", n);
  for (int i = 0; i < 2; i++) cr_assert_eq(f->kind[i], want[i]);
  for (int i = 2; i < 12; i++) cr_assert_eq(f->kind[i], DSPWIRE__REQUEST__BODY_OP);
  cr_assert_eq(f->kind[12], DSPWIRE__REQUEST__BODY_FREE);
  cr_assert_eq(f->count[12], 10, "one Free carries the scope's 10 ids");
  cr_assert_eq(f->kind[13], DSPWIRE__REQUEST__BODY_SYNC);
  pthread_mutex_unlock(&f->mu);
  /* a read is one round trip and its bytes land in the buffer */
  float back[8];
  OK(dev, dispatch_tensor_read(x, back, sizeof back));
  cr_assert_eq(memcmp(back, v, sizeof v), 0);
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_READ), 1);
  dispatch_device_close(dev);
  fake_stop(f);
}

Test(client_wire, an_optimizer_step_is_one_step_message) {
  fake *f = fake_start(0);
  dispatch_device *dev = open_fake(f, "sesame");
  int64_t sh[2] = {2, 2};
  dispatch_tensor *p[3], *ap[3], *loss = NULL, *t;
  for (int i = 0; i < 3; i++) {
    OK(dev, dispatch_ones(dev, DISPATCH_F32, 2, sh, &p[i]));
    OK(dev, dispatch_autodiff(p[i], &ap[i]));
  }
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_TRACK), 0);
  dispatch_optim *opt;
  OK(dev, dispatch_adam_new(ap, 3, 0.01, 0.9, 0.999, 1e-8, &opt));
  OK(dev, dispatch_add(ap[0], ap[1], &t));
  OK(dev, dispatch_add(t, ap[2], &t));
  OK(dev, dispatch_sum(t, 0, NULL, 0, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_TRACK), 3);
  OK(dev, dispatch_optim_step(opt, g));
  OK(dev, dispatch_optim_step(opt, g));
  dispatch_grads_free(g);
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_STEP), 2);
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_BACKWARD), 1);
  pthread_mutex_lock(&f->mu);
  int seen = 0;
  for (int i = 0; i < f->n; i++)
    if (f->kind[i] == DSPWIRE__REQUEST__BODY_STEP) {
      cr_assert_eq(f->count[i], 3);
      cr_assert_eq(f->count2[i], 6);
      seen++;
    } else if (f->kind[i] == DSPWIRE__REQUEST__BODY_FREE) {
      cr_assert_eq(f->count2[i], 1, "the gradient container is freed");
    }
  cr_assert_eq(seen, 2);
  pthread_mutex_unlock(&f->mu);
  dispatch_optim_free(opt);
  dispatch_device_close(dev);
  fake_stop(f);
}

Test(client_wire, hello_carries_the_token) {
  fake *f = fake_start(0);
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", f->port);
  dispatch_options o;
  dispatch_options_init(&o);
  o.token = "wrong";
  dispatch_device *dev = NULL;
  cr_assert_eq(dispatch_device_open(spec, &o, &dev, msg, sizeof msg),
               DISPATCH_EAUTH);
  cr_assert_null(dev);
  cr_assert(strstr(msg, "token rejected by the fake") != NULL, "%s", msg);
  fake_stop(f);

  f = fake_start(0);
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", f->port);
  setenv("DISPATCH_TOKEN", "sesame", 1);
  int rc = dispatch_device_open(spec, NULL, &dev, msg, sizeof msg);
  unsetenv("DISPATCH_TOKEN");
  cr_assert_eq(rc, 0, "%s", msg);
  cr_assert_str_eq(f->token, "sesame");
  dispatch_device_close(dev);
  fake_stop(f);
}

Test(client_wire, a_silent_server_gives_econn_within_the_bound) {
  fake *f = fake_start(1);
  dispatch_device *dev = open_fake(f, "sesame");
  OK(dev, dispatch_device_set_timeout(dev, 200));
  int64_t sh[1] = {2};
  dispatch_tensor *x, *y = NULL;
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 1, sh, &x));
  cr_assert_eq(dispatch_device_sync(dev), DISPATCH_ECONN);
  cr_assert(strstr(dispatch_device_errmsg(dev), "no reply within 200 ms"),
            "%s", dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_exp(x, &y), DISPATCH_ECONN);
  cr_assert_null(y);
  float v[2];
  cr_assert_eq(dispatch_tensor_read(x, v, sizeof v), DISPATCH_ECONN);
  dispatch_device_close(dev); /* the socket closes: the fake sees EOF */
  fake_stop(f);
}

Test(client_wire, connection_refused_is_econn) {
  fake *f = fake_start(0);
  int port = f->port;
  /* take the listener away: connect the fake to itself so it exits */
  dispatch_device *dev = open_fake(f, "sesame");
  dispatch_device_close(dev);
  fake_stop(f);
  char spec[64], msg[256] = "";
  snprintf(spec, sizeof spec, "tcp://127.0.0.1:%d", port);
  cr_assert_eq(dispatch_device_open(spec, NULL, &dev, msg, sizeof msg),
               DISPATCH_ECONN);
  cr_assert(strstr(msg, "cannot connect") != NULL, "%s", msg);
}

/* A server older than protocol 1.6 (the fake answers hello with minor 0)
 * would take a checkpoint request for one without a body and close the
 * connection: the library refuses it with DISPATCH_EUNSUPPORTED, naming
 * the version, and sends nothing; the session goes on. */
Test(client_wire, checkpoints_on_an_old_server_are_refused_unsent) {
  fake *f = fake_start(0);
  dispatch_device *dev = open_fake(f, "sesame");
  int64_t sh[1] = {4};
  dispatch_tensor *x;
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 1, sh, &x));
  const char *names[1] = {"x"};
  int rc = dispatch_save_on_server(dev, "a.safetensors", names, &x, 1, NULL);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s", dispatch_err_name(rc));
  cr_assert(strstr(dispatch_device_errmsg(dev), "protocol 1.6"), "%s",
            dispatch_device_errmsg(dev));
  dispatch_checkpoint *ck = NULL;
  rc = dispatch_load_on_server(dev, "a.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED, "%s", dispatch_err_name(rc));
  cr_assert_null(ck);
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_CKPT_SAVE) +
                   count_kind(f, DSPWIRE__REQUEST__BODY_CKPT_LOAD),
               0);
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  fake_stop(f);
}

/* A server older than protocol 1.7 holds no f16 or bf16 tensor: an upload
 * of one, or an op whose result would be one, is refused at the call with
 * DISPATCH_EDTYPE naming the dtype and both versions, and nothing is sent;
 * f32 keeps working on the same device. */
Test(client_wire, half_dtypes_on_an_old_server_are_refused_unsent) {
  fake *f = fake_start(0);
  dispatch_device *dev = open_fake(f, "sesame");
  int64_t sh[1] = {2};
  uint16_t bits[2] = {0x3c00, 0xc000};
  dispatch_tensor *h = NULL, *x, *c = NULL;
  int rc = dispatch_tensor_from_data(dev, DISPATCH_F16, 1, sh, bits,
                                     sizeof bits, &h);
  cr_assert_eq(rc, DISPATCH_EDTYPE, "%s", dispatch_err_name(rc));
  cr_assert_null(h);
  const char *m = dispatch_device_errmsg(dev);
  cr_assert(strstr(m, "f16 needs protocol 1.7") && strstr(m, "speaks 1.0"),
            "%s", m);
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 1, sh, &x));
  rc = dispatch_cast(x, DISPATCH_BF16, &c);
  cr_assert_eq(rc, DISPATCH_EDTYPE, "%s", dispatch_err_name(rc));
  cr_assert_null(c);
  cr_assert(strstr(dispatch_device_errmsg(dev), "bf16 needs protocol 1.7"),
            "%s", dispatch_device_errmsg(dev));
  OK(dev, dispatch_device_sync(dev));
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_UPLOAD), 0);
  cr_assert_eq(count_kind(f, DSPWIRE__REQUEST__BODY_OP), 1); /* the zeros */
  dispatch_tensor_free(x);
  dispatch_device_close(dev);
  fake_stop(f);
}
