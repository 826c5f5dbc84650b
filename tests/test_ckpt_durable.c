/* The order of a server-side checkpoint save (server/checkpoint.c), in
 * process: the temporary file is fsync-ed before it is renamed over the
 * name, and the directory is fsync-ed after the rename, so a crash leaves
 * the old file or the whole new one. fsync and renameat are interposed
 * here (this binary links the server's archive, so its calls land in
 * these definitions) and record what they were called on. Also: the
 * kinds table runs both checkpoint requests on a worker. */
#include <criterion/criterion.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dsp.h"
#include "sv.h"
#include "wire_req.h"

/* 'F' fsync of a regular file, 'D' fsync of a directory, 'R' a rename */
static char g_log[64];
static int g_n;

static void note(char c) {
  if (g_n < (int)sizeof g_log - 1) g_log[g_n++] = c;
}

int fsync(int fd) {
  int (*real)(int) = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
  struct stat st;
  if (fstat(fd, &st) == 0) note(S_ISDIR(st.st_mode) ? 'D' : 'F');
  return real(fd);
}

int renameat(int a, const char *x, int b, const char *y) {
  int (*real)(int, const char *, int, const char *) =
      (int (*)(int, const char *, int, const char *))dlsym(RTLD_NEXT,
                                                            "renameat");
  note('R');
  return real(a, x, b, y);
}

static Dspwire__Request *unpack(const Dspwire__Request *r) {
  uint8_t buf[1024];
  cr_assert_lt(dspwire__request__get_packed_size(r), sizeof buf);
  size_t n = dspwire__request__pack(r, buf);
  return dspwire__request__unpack(&sv_pb_allocator, n, buf);
}

/* Runs r on s; returns the error code of its reply (0: none). */
static int run_req(sv_session *s, Dspwire__Request *r, dsp_tensor *upload) {
  sv_job *j = dsp_calloc(1, sizeof *j);
  cr_assert_not_null(j);
  j->sess = s;
  j->req = unpack(r);
  cr_assert_not_null(j->req);
  j->upload = upload;
  sv_session_exec(s, j);
  int code = 0;
  if (j->out && j->out_len > DSP_FRAME_HEADER_SIZE) {
    Dspwire__Reply *rep = dspwire__reply__unpack(
        NULL, j->out_len - DSP_FRAME_HEADER_SIZE,
        j->out + DSP_FRAME_HEADER_SIZE);
    cr_assert_not_null(rep);
    if (rep->error) code = rep->error->code;
    dspwire__reply__free_unpacked(rep, NULL);
  }
  sv_job_free(j);
  return code;
}

Test(ckpt_durable, fsync_file_rename_fsync_dir) {
  char dir[] = "/tmp/dsp_ckdur_XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  sv_config cfg;
  sv_global g;
  sv_config_defaults(&cfg);
  memset(&g, 0, sizeof g);
  cfg.checkpoint_fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  cr_assert_geq(cfg.checkpoint_fd, 0);
  sv_session *s = sv_session_new(&cfg, &g, NULL);
  cr_assert_not_null(s);
  float v[3] = {1, 2, 3};
  dsp_meta m = {DSP_F32, 1, {3}};
  dsp_tensor *t;
  cr_assert_eq(dsp_tensor_from_data(s->ctx, &m, v, sizeof v, &t), 0);
  int64_t shape[1] = {3};
  dsp_wreq w;
  cr_assert_eq(run_req(s, dsp_wreq_upload(&w, 1, DSP_F32, 1, shape), t), 0);

  const char *names[1] = {"v"};
  uint64_t ids[1] = {1};
  g_n = 0;
  Dspwire__Request *r =
      dsp_wreq_ckpt_save(&w, "c.st", 4, names, ids, 1, NULL, NULL, 0);
  r->req_id = 2;
  cr_assert_eq(run_req(s, r, NULL), 0);
  g_log[g_n] = '\0';
  cr_assert_str_eq(g_log, "FRD",
                   "file fsync, rename, directory fsync; saw \"%s\"", g_log);
  char path[64];
  snprintf(path, sizeof path, "%s/c.st", dir);
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  /* 8-byte length, the padded header, 12 data bytes */
  cr_assert_eq(st.st_size % 8, 12 % 8);

  sv_session_teardown(s);
  dsp_free(s);
  sv_config_release(&cfg);
  char cmd[96];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  cr_assert_eq(system(cmd), 0);
}

/* A checkpoint may write or read a GiB: its kinds never run on the
 * network thread (no loop flag, no inline cost), always on a worker, and
 * each ends its worker turn. */
Test(ckpt_durable, checkpoint_kinds_run_on_workers) {
  const int bcs[2] = {DSPWIRE__REQUEST__BODY_CKPT_SAVE,
                      DSPWIRE__REQUEST__BODY_CKPT_LOAD};
  for (int i = 0; i < 2; i++) {
    const sv_req_kind *k = sv_req_kind_of((Dspwire__Request__BodyCase)bcs[i]);
    cr_assert_not_null(k->exec, "%s", k->name);
    cr_assert(k->waits, "%s", k->name);
    cr_assert(!k->on_loop, "%s", k->name);
    cr_assert_null(k->inline_cost, "%s", k->name);
    cr_assert(k->own_turn, "%s", k->name);
    cr_assert_null(k->bulk, "%s", k->name);
  }
}
