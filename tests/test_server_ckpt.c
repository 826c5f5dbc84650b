/* Checkpoints the server writes and reads itself (dispatch-server
 * --checkpoint-dir, dispatch_save_on_server / dispatch_load_on_server,
 * protocol 1.6) against a real server on 127.0.0.1: tensors and Adam state
 * round trip bit for bit; a file the server wrote is read by a LOCAL
 * dispatch_load from the directory and a file dispatch_save wrote into it
 * is read by the server; every name that would leave the directory (.., an
 * absolute path, a symbolic link as the file or on the way, empty, a
 * control byte, NUL through the raw protocol, a huge name) is refused with
 * DISPATCH_EINVAL and creates nothing; a load past --max-session-bytes is
 * DISPATCH_EQUOTA and leaves nothing held; a missing or corrupt file leaves
 * no tensor; a server without the option refuses clearly. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dispatch_client.h"
#include "helpers/client_check.h"
#include "helpers/server_proc.h"
#include "helpers/wire.h"

static sp_server g_srv;
static char g_root[256], g_dir[300], g_out[300];

/* g_root holds the checkpoint directory g_dir and a directory outside it,
 * g_out, that nothing may ever write to. */
static void setup(void) {
  snprintf(g_root, sizeof g_root, "/tmp/dsp_srvckpt_XXXXXX");
  cr_assert_not_null(mkdtemp(g_root));
  snprintf(g_dir, sizeof g_dir, "%s/ckpt", g_root);
  snprintf(g_out, sizeof g_out, "%s/outside", g_root);
  cr_assert_eq(mkdir(g_dir, 0755), 0);
  cr_assert_eq(mkdir(g_out, 0755), 0);
}

static void teardown(void) {
  if (g_srv.pid) sp_stop(&g_srv);
  if (g_root[0]) {
    char cmd[300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    cr_assert_eq(system(cmd), 0);
  }
}

TestSuite(server_ckpt, .init = setup, .fini = teardown, .timeout = 120);

static void start(int with_dir, const char *max_session) {
  const char *args[8];
  int n = 0;
  if (with_dir) {
    args[n++] = "--checkpoint-dir";
    args[n++] = g_dir;
  }
  if (max_session) {
    args[n++] = "--max-session-bytes";
    args[n++] = max_session;
  }
  args[n] = NULL;
  check_server_start(&g_srv, args);
}

static void in_dir(char *out, size_t len, const char *dir, const char *name) {
  snprintf(out, len, "%s/%s", dir, name);
}

/* Names in dir (not . and ..), or -1 when it cannot be read. */
static int count_entries(const char *dir, const char *prefix) {
  DIR *d = opendir(dir);
  if (!d) return -1;
  int n = 0;
  for (struct dirent *e; (e = readdir(d)) != NULL;)
    if (strcmp(e->d_name, ".") && strcmp(e->d_name, "..") &&
        (!prefix || strncmp(e->d_name, prefix, strlen(prefix)) == 0))
      n++;
  closedir(d);
  return n;
}

static uint64_t live_tensors(dispatch_device *dev) {
  dispatch_stats st = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st));
  return st.tensors;
}

#define N_T 5
static const char *const t_names[N_T] = {"w", "ids", "mask", "scalar",
                                         "empty"};

/* Every dtype, a scalar and a zero-size tensor; t[0] is f32 [64, 33]. */
static void make_tensors(dispatch_device *dev, dispatch_tensor **t) {
  int64_t s0[2] = {64, 33}, s1[1] = {4}, s2[1] = {5}, s4[2] = {3, 0};
  OK(dev, dispatch_normal(dev, DISPATCH_F32, 2, s0, 0, 1, 7, &t[0]));
  int64_t iv[4] = {-1, INT64_MAX, INT64_MIN, 42};
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_I64, 1, s1, iv, sizeof iv,
                                    &t[1]));
  uint8_t bv[5] = {1, 0, 1, 1, 0};
  OK(dev, dispatch_tensor_from_data(dev, DISPATCH_BOOL, 1, s2, bv, sizeof bv,
                                    &t[2]));
  double sv = -0.0;
  OK(dev,
     dispatch_tensor_from_data(dev, DISPATCH_F64, 0, NULL, &sv, 8, &t[3]));
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 2, s4, &t[4]));
}

/* One Adam step on w (loss = sum(w * w)) so m, v and t hold something. */
static dispatch_optim *adam_stepped(dispatch_device *dev, dispatch_tensor *w) {
  dispatch_tensor *p, *sq, *loss;
  OK(dev, dispatch_autodiff(w, &p));
  dispatch_optim *opt;
  OK(dev, dispatch_adam_new(&p, 1, 0.01, 0.9, 0.999, 1e-8, &opt));
  OK(dev, dispatch_mul(p, p, &sq));
  OK(dev, dispatch_sum(sq, 0, NULL, 0, &loss));
  dispatch_grads *g;
  OK(dev, dispatch_backward(loss, &g));
  OK(dev, dispatch_optim_step(opt, g));
  dispatch_grads_free(g);
  dispatch_tensor_free(loss);
  dispatch_tensor_free(sq);
  dispatch_tensor_free(p); /* the optimizer keeps its own reference */
  return opt;
}

/* The server writes tensors and Adam state into a subdirectory; the server
 * reads them back, a LOCAL dispatch_load reads the same file from the
 * directory, and both are bit-identical to what was saved; the Adam state
 * loads into a new optimizer; no temporary file is left. */
Test(server_ckpt, round_trip_tensors_and_adam) {
  start(1, NULL);
  char sub[400];
  in_dir(sub, sizeof sub, g_dir, "run1");
  cr_assert_eq(mkdir(sub, 0755), 0);
  dispatch_device *dev = check_open(&g_srv, 1);
  dispatch_tensor *t[N_T];
  make_tensors(dev, t);
  dispatch_optim *opt = adam_stepped(dev, t[0]);
  OK(dev, dispatch_save_on_server(dev, "run1/step1.safetensors", t_names, t,
                                  N_T, opt));
  /* and again over the same name: the rename replaces it */
  OK(dev, dispatch_save_on_server(dev, "run1/step1.safetensors", t_names, t,
                                  N_T, opt));
  cr_assert_eq(count_entries(sub, NULL), 1, "only the checkpoint in run1/");

  uint64_t before = live_tensors(dev);
  dispatch_checkpoint *ck;
  OK(dev, dispatch_load_on_server(dev, "run1/step1.safetensors", &ck));
  /* 5 tensors, m and v of one parameter, the step count */
  cr_assert_eq(dispatch_checkpoint_count(ck), N_T + 3);
  cr_assert_eq(live_tensors(dev), before + N_T + 3);
  for (int i = 0; i < N_T; i++)
    check_same(t[i], dispatch_checkpoint_get(ck, t_names[i]), t_names[i]);
  cr_assert_str_eq(dispatch_checkpoint_meta(ck, "dispatch.optim"), "adam");
  cr_assert_str_eq(dispatch_checkpoint_meta(ck, "format"), "dispatch");
  int64_t step = 0;
  OK(dev, dispatch_tensor_read(dispatch_checkpoint_get(ck, "optim.step"),
                               &step, sizeof step));
  cr_assert_eq(step, 1);

  /* the same file, read here without the server */
  char path[500];
  in_dir(path, sizeof path, sub, "step1.safetensors");
  dispatch_device *loc = check_open(NULL, 0);
  dispatch_checkpoint *lck;
  OK(loc, dispatch_load(loc, path, &lck));
  cr_assert_eq(dispatch_checkpoint_count(lck), N_T + 3);
  for (int i = 0; i < dispatch_checkpoint_count(ck); i++) {
    const char *nm = dispatch_checkpoint_name(ck, i);
    cr_assert_str_eq(nm, dispatch_checkpoint_name(lck, i), "data order");
    check_same(dispatch_checkpoint_tensor(ck, i),
                dispatch_checkpoint_get(lck, nm), nm);
  }

  /* Adam state into a new optimizer over a parameter of the same shape */
  dispatch_tensor *w2, *p2;
  int64_t ws[2] = {64, 33};
  OK(dev, dispatch_zeros(dev, DISPATCH_F32, 2, ws, &w2));
  OK(dev, dispatch_autodiff(w2, &p2));
  dispatch_optim *opt2;
  OK(dev, dispatch_adam_new(&p2, 1, 0.01, 0.9, 0.999, 1e-8, &opt2));
  OK(dev, dispatch_optim_load(opt2, ck));

  dispatch_checkpoint_free(lck);
  dispatch_checkpoint_free(ck);
  /* w2, and opt2's m and v: the checkpoint's, kept by the optimizer */
  uint64_t now = live_tensors(dev);
  cr_assert_eq(now, before + 3, "%llu live, %llu before",
               (unsigned long long)now, (unsigned long long)before);
  dispatch_optim_free(opt2);
  dispatch_optim_free(opt);
  dispatch_tensor_free(p2);
  dispatch_tensor_free(w2);
  for (int i = 0; i < N_T; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(loc);
  dispatch_device_close(dev);
}

/* A file dispatch_save wrote (here, straight into the directory, as a
 * copy would put it) is one the server loads, bit for bit. */
Test(server_ckpt, client_file_loaded_by_server) {
  start(1, NULL);
  dispatch_device *loc = check_open(NULL, 0);
  dispatch_tensor *t[N_T];
  make_tensors(loc, t);
  char path[500];
  in_dir(path, sizeof path, g_dir, "from_client.safetensors");
  OK(loc, dispatch_save(loc, path, t_names, t, N_T, NULL));
  dispatch_device *dev = check_open(&g_srv, 1);
  dispatch_checkpoint *ck;
  OK(dev, dispatch_load_on_server(dev, "from_client.safetensors", &ck));
  cr_assert_eq(dispatch_checkpoint_count(ck), N_T);
  for (int i = 0; i < N_T; i++)
    check_same(t[i], dispatch_checkpoint_get(ck, t_names[i]), t_names[i]);
  dispatch_checkpoint_free(ck);
  for (int i = 0; i < N_T; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
  dispatch_device_close(loc);
}

/* Every escape is refused with DISPATCH_EINVAL, for a save and a load,
 * and nothing appears outside the directory (or inside it); the session
 * goes on. The file the links point at is a valid checkpoint, so a load
 * that followed one would succeed. */
Test(server_ckpt, path_escapes_refused) {
  start(1, NULL);
  dispatch_device *loc = check_open(NULL, 0);
  dispatch_tensor *t[N_T];
  make_tensors(loc, t);
  char victim[500], link[500], linkdir[500];
  in_dir(victim, sizeof victim, g_out, "victim.safetensors");
  OK(loc, dispatch_save(loc, victim, t_names, t, N_T, NULL));
  in_dir(link, sizeof link, g_dir, "link.safetensors");
  cr_assert_eq(symlink(victim, link), 0);
  in_dir(linkdir, sizeof linkdir, g_dir, "linkdir");
  cr_assert_eq(symlink(g_out, linkdir), 0);
  struct stat vs0;
  cr_assert_eq(stat(victim, &vs0), 0);

  static char huge[3000], longc[300];
  memset(huge, 'a', sizeof huge - 1);
  memset(longc, 'b', sizeof longc - 1); /* one component past NAME_MAX */
  const char *bad[] = {"../x.safetensors",
                       "/etc/passwd",
                       "a/../../x",
                       "../outside/victim.safetensors",
                       "./x",
                       "x/",
                       "a//b",
                       "",
                       "bad\nname",
                       "tab\tname",
                       "link.safetensors",
                       "linkdir/victim.safetensors",
                       "linkdir/new.safetensors",
                       longc,
                       huge};
  dispatch_device *dev = check_open(&g_srv, 1);
  dispatch_tensor *r[N_T];
  make_tensors(dev, r);
  uint64_t live = live_tensors(dev);
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    int rc = dispatch_save_on_server(dev, bad[i], t_names, r, N_T, NULL);
    cr_assert_eq(rc, DISPATCH_EINVAL, "save \"%.40s\": %s: %s", bad[i],
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    dispatch_checkpoint *ck = NULL;
    rc = dispatch_load_on_server(dev, bad[i], &ck);
    cr_assert_eq(rc, DISPATCH_EINVAL, "load \"%.40s\": %s: %s", bad[i],
                 dispatch_err_name(rc), dispatch_device_errmsg(dev));
    cr_assert_null(ck);
    cr_assert_eq(live_tensors(dev), live, "\"%.40s\" left tensors", bad[i]);
  }
  /* the message says what was wrong */
  cr_assert_eq(dispatch_save_on_server(dev, "/etc/passwd", t_names, r, N_T,
                                       NULL),
               DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "an absolute name"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_eq(dispatch_save_on_server(dev, "linkdir/x", t_names, r, N_T,
                                       NULL),
               DISPATCH_EINVAL);
  cr_assert(strstr(dispatch_device_errmsg(dev), "symbolic link"), "%s",
            dispatch_device_errmsg(dev));
  /* outside: only the victim, unchanged; inside: only the two links */
  cr_assert_eq(count_entries(g_out, NULL), 1);
  struct stat vs1;
  cr_assert_eq(stat(victim, &vs1), 0);
  cr_assert_eq(vs1.st_size, vs0.st_size);
  cr_assert_eq(vs1.st_mtim.tv_sec, vs0.st_mtim.tv_sec);
  cr_assert_eq(vs1.st_mtim.tv_nsec, vs0.st_mtim.tv_nsec);
  cr_assert_eq(count_entries(g_dir, NULL), 2);
  struct stat ls;
  cr_assert_eq(lstat(link, &ls), 0);
  cr_assert(S_ISLNK(ls.st_mode), "the link itself was not replaced");
  /* a good name still works on the same session */
  OK(dev, dispatch_save_on_server(dev, "ok.safetensors", t_names, r, N_T,
                                  NULL));
  for (int i = 0; i < N_T; i++) {
    dispatch_tensor_free(r[i]);
    dispatch_tensor_free(t[i]);
  }
  dispatch_device_close(dev);
  dispatch_device_close(loc);
}

/* A NUL inside the name can only come through the raw protocol: the
 * server sees the whole name and refuses it, for a save and a load. */
Test(server_ckpt, nul_in_name_refused) {
  start(1, NULL);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "nul"), 0);
  static const char name[] = "ok\0/../../x";
  for (int load = 0; load < 2; load++) {
    dsp_wreq w;
    Dspwire__Request *req =
        load ? dsp_wreq_ckpt_load(&w, name, sizeof name - 1, 1, 0)
             : dsp_wreq_ckpt_save(&w, name, sizeof name - 1, NULL, NULL, 0,
                                  NULL, NULL, 0);
    req->req_id = 10 + (uint64_t)load;
    cr_assert_eq(wire_send(&c, req, NULL, 0), 0);
    Dspwire__Reply *rep;
    void *bulk;
    size_t bl;
    cr_assert_eq(wire_recv(&c, &rep, &bulk, &bl), 0);
    cr_assert_not_null(rep->error, "no error for a NUL in the name");
    cr_assert_eq(rep->error->code, DISPATCH_EINVAL, "%s",
                 rep->error->message);
    cr_assert(strstr(rep->error->message, "control byte 0x00"), "%s",
              rep->error->message);
    wire_reply_free(rep, bulk);
  }
  cr_assert_eq(count_entries(g_dir, NULL), 0);
  wire_close(&c);
}

/* A load whose tensors pass --max-session-bytes is DISPATCH_EQUOTA: no
 * tensor is made and the session's held bytes come back to what they
 * were; a small load then works. */
Test(server_ckpt, quota_refuses_load) {
  start(1, "1M");
  dispatch_device *loc = check_open(NULL, 0);
  int64_t big[1] = {400000}; /* 1.6 MB of f32 */
  dispatch_tensor *bt[2];
  OK(loc, dispatch_zeros(loc, DISPATCH_F32, 1, big, &bt[0]));
  int64_t sm[1] = {8};
  OK(loc, dispatch_ones(loc, DISPATCH_F32, 1, sm, &bt[1]));
  const char *names[2] = {"small", "big"};
  char path[500];
  in_dir(path, sizeof path, g_dir, "big.safetensors");
  /* data order: small first, so one tensor is made before the refusal */
  dispatch_tensor *order[2] = {bt[1], bt[0]};
  OK(loc, dispatch_save(loc, path, names, order, 2, NULL));
  in_dir(path, sizeof path, g_dir, "small.safetensors");
  OK(loc, dispatch_save(loc, path, names, order, 1, NULL));

  dispatch_device *dev = check_open(&g_srv, 1);
  dispatch_stats st0 = DISPATCH_STATS_INIT, st1 = DISPATCH_STATS_INIT;
  OK(dev, dispatch_device_stats(dev, &st0));
  dispatch_checkpoint *ck = NULL;
  int rc = dispatch_load_on_server(dev, "big.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EQUOTA, "%s: %s", dispatch_err_name(rc),
               dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "--max-session-bytes"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_null(ck);
  OK(dev, dispatch_device_stats(dev, &st1));
  cr_assert_eq(st1.tensors, st0.tensors);
  cr_assert_eq(st1.held_bytes, st0.held_bytes, "held %llu, was %llu",
               (unsigned long long)st1.held_bytes,
               (unsigned long long)st0.held_bytes);
  OK(dev, dispatch_load_on_server(dev, "small.safetensors", &ck));
  check_same(bt[1], dispatch_checkpoint_get(ck, "small"), "small");
  dispatch_checkpoint_free(ck);
  dispatch_tensor_free(bt[0]);
  dispatch_tensor_free(bt[1]);
  dispatch_device_close(dev);
  dispatch_device_close(loc);
}

/* A missing file is DISPATCH_EIO, a corrupt one the code dispatch_load
 * gives; neither makes a tensor, and a truncated file is never written by
 * a save (the directory holds the old file or the new one). */
Test(server_ckpt, missing_and_corrupt_files) {
  start(1, NULL);
  dispatch_device *dev = check_open(&g_srv, 1);
  uint64_t live = live_tensors(dev);
  dispatch_checkpoint *ck = NULL;
  int rc = dispatch_load_on_server(dev, "nothing.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EIO, "%s", dispatch_device_errmsg(dev));
  cr_assert_null(ck);
  rc = dispatch_load_on_server(dev, "nodir/x.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EIO, "%s", dispatch_device_errmsg(dev));

  dispatch_tensor *t[N_T];
  make_tensors(dev, t);
  OK(dev, dispatch_save_on_server(dev, "good.safetensors", t_names, t, N_T,
                                  NULL));
  char good[500], bad[500];
  in_dir(good, sizeof good, g_dir, "good.safetensors");
  in_dir(bad, sizeof bad, g_dir, "cut.safetensors");
  struct stat st;
  cr_assert_eq(stat(good, &st), 0);
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "head -c %lld '%s' > '%s'",
           (long long)st.st_size - 3, good, bad);
  cr_assert_eq(system(cmd), 0);
  live = live_tensors(dev);
  rc = dispatch_load_on_server(dev, "cut.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EINVAL, "%s", dispatch_device_errmsg(dev));
  cr_assert(strstr(dispatch_device_errmsg(dev), "truncated"), "%s",
            dispatch_device_errmsg(dev));
  cr_assert_eq(live_tensors(dev), live);
  /* a directory of that name is no file to write over */
  char d[500];
  in_dir(d, sizeof d, g_dir, "adir");
  cr_assert_eq(mkdir(d, 0755), 0);
  rc = dispatch_save_on_server(dev, "adir", t_names, t, N_T, NULL);
  cr_assert_eq(rc, DISPATCH_EINVAL, "%s", dispatch_device_errmsg(dev));
  /* a bad tensor name is refused before any file is made */
  const char *dup[2] = {"same", "same"};
  rc = dispatch_save_on_server(dev, "dup.safetensors", dup, t, 2, NULL);
  cr_assert_eq(rc, DISPATCH_EINVAL, "%s", dispatch_device_errmsg(dev));
  cr_assert_eq(count_entries(g_dir, ".dispatch-tmp"), 0);
  cr_assert_eq(count_entries(g_dir, NULL), 3, "good, cut, adir");
  for (int i = 0; i < N_T; i++) dispatch_tensor_free(t[i]);
  dispatch_device_close(dev);
}

/* Without --checkpoint-dir the client refuses before sending (the hello
 * said so), a raw request is refused by the server, and a LOCAL device
 * is told to use dispatch_save. */
Test(server_ckpt, disabled_and_local_refused) {
  start(0, NULL);
  dispatch_device *dev = check_open(&g_srv, 1);
  dispatch_tensor *t[N_T];
  make_tensors(dev, t);
  int rc = dispatch_save_on_server(dev, "x.safetensors", t_names, t, N_T,
                                   NULL);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED);
  cr_assert(strstr(dispatch_device_errmsg(dev), "--checkpoint-dir"), "%s",
            dispatch_device_errmsg(dev));
  dispatch_checkpoint *ck = NULL;
  rc = dispatch_load_on_server(dev, "x.safetensors", &ck);
  cr_assert_eq(rc, DISPATCH_EUNSUPPORTED);
  cr_assert_null(ck);

  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "raw"), 0);
  dsp_wreq w;
  Dspwire__Request *req = dsp_wreq_ckpt_load(&w, "x", 1, 1, 0);
  req->req_id = 5;
  cr_assert_eq(wire_send(&c, req, NULL, 0), 0);
  Dspwire__Reply *rep;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(&c, &rep, &bulk, &bl), 0);
  cr_assert_not_null(rep->error);
  cr_assert_eq(rep->error->code, DISPATCH_EUNSUPPORTED, "%s",
               rep->error->message);
  cr_assert(strstr(rep->error->message, "--checkpoint-dir"), "%s",
            rep->error->message);
  wire_reply_free(rep, bulk);
  wire_close(&c);

  dispatch_device *loc = check_open(NULL, 0);
  dispatch_tensor *lt[N_T];
  make_tensors(loc, lt);
  rc = dispatch_save_on_server(loc, "x", t_names, lt, N_T, NULL);
  cr_assert_eq(rc, DISPATCH_ENOTREMOTE, "%s", dispatch_device_errmsg(loc));
  for (int i = 0; i < N_T; i++) {
    dispatch_tensor_free(t[i]);
    dispatch_tensor_free(lt[i]);
  }
  dispatch_device_close(loc);
  dispatch_device_close(dev);
}

/* The server refuses to start on a directory it cannot open. */
Test(server_ckpt, bad_directory_refused_at_start) {
  char missing[400], out[2048];
  in_dir(missing, sizeof missing, g_root, "no-such-dir");
  check_server_bin();
  const char *args[] = {"--checkpoint-dir", missing, NULL};
  int st = sp_run_capture(args, out, sizeof out);
  cr_assert_neq(st, 0, "started: %s", out);
  cr_assert(strstr(out, "--checkpoint-dir"), "%s", out);
}

/* Raw requests a hostile client may send: each is refused with its code,
 * no file is left, no tensor is made, and the session goes on. */
static int raw_code(wire_conn *c, Dspwire__Request *req) {
  req->req_id = c->next_req_id++;
  cr_assert_eq(wire_send(c, req, NULL, 0), 0);
  Dspwire__Reply *rep;
  void *bulk;
  size_t bl;
  cr_assert_eq(wire_recv(c, &rep, &bulk, &bl), 0);
  int code = rep->error ? rep->error->code : 0;
  wire_reply_free(rep, bulk);
  return code;
}

Test(server_ckpt, hostile_requests_refused) {
  start(1, NULL);
  wire_conn c;
  cr_assert_eq(wire_connect(&c, g_srv.port), 0);
  cr_assert_eq(wire_hello(&c, "hostile"), 0);
  c.next_req_id = 100;
  float v[2] = {1, 2};
  int64_t s1[1] = {2};
  wire_upload(&c, 1, DISPATCH_F32, 1, s1, v, sizeof v);
  dsp_wreq w;
  const char *two[2] = {"a", "b"}, *one[1] = {"a"};
  const char *fmt[1] = {"format"}, *val[1] = {"x"};
  uint64_t id1[1] = {1}, id9[1] = {9};
  /* two names, one id */
  Dspwire__Request *r =
      dsp_wreq_ckpt_save(&w, "f", 1, two, id1, 1, NULL, NULL, 0);
  w.body.ckpt_save.n_names = 2;
  cr_assert_eq(raw_code(&c, r), DISPATCH_EINVAL);
  /* an id the session does not have */
  r = dsp_wreq_ckpt_save(&w, "f", 1, one, id9, 1, NULL, NULL, 0);
  cr_assert_eq(raw_code(&c, r), DISPATCH_ENOID);
  /* the server's own metadata key; keys without values */
  r = dsp_wreq_ckpt_save(&w, "f", 1, one, id1, 1, fmt, val, 1);
  cr_assert_eq(raw_code(&c, r), DISPATCH_EINVAL);
  r = dsp_wreq_ckpt_save(&w, "f", 1, one, id1, 1, val, val, 1);
  w.body.ckpt_save.n_meta_values = 0;
  cr_assert_eq(raw_code(&c, r), DISPATCH_EINVAL);
  cr_assert_eq(count_entries(g_dir, NULL), 0, "nothing written");
  /* a good save; then loads onto an id in use and past 2^64 */
  r = dsp_wreq_ckpt_save(&w, "f", 1, one, id1, 1, NULL, NULL, 0);
  cr_assert_eq(raw_code(&c, r), 0);
  r = dsp_wreq_ckpt_load(&w, "f", 1, 1, 0);
  cr_assert_eq(raw_code(&c, r), DISPATCH_EIDINUSE);
  r = dsp_wreq_ckpt_load(&w, "f", 1, UINT64_MAX, 0);
  cr_assert_eq(raw_code(&c, r), 0, "one tensor fits at 2^64 - 1");
  /* a file of more tensors than the ids the request set aside */
  uint64_t id11[2] = {1, 1};
  r = dsp_wreq_ckpt_save(&w, "g", 1, two, id11, 2, NULL, NULL, 0);
  cr_assert_eq(raw_code(&c, r), 0);
  r = dsp_wreq_ckpt_load(&w, "g", 1, 50, 1);
  cr_assert_eq(raw_code(&c, r), DISPATCH_EINVAL);
  r = dsp_wreq_ckpt_load(&w, "g", 1, 50, 2);
  cr_assert_eq(raw_code(&c, r), 0);
  Dspwire__StatsReply st;
  cr_assert_eq(wire_get_stats(&c, &st), 0);
  cr_assert_eq(st.tensors, 4);
  wire_close(&c);
}
