/* The NCCL path of the group all-reduce (server/group.c, dispatch-nccl.so)
 * as far as a host without a GPU can check it: the path every rank
 * chooses from the members' places (NCCL only when all of them hold CUDA
 * tensors and loaded NCCL); the plugin loader refusing a missing plugin
 * and a stale one with one line; the real plugin, when built, loading
 * (NCCL's version read), exporting its entry point only, while the server
 * links no NCCL; a 2-rank group whose servers have NCCL loaded
 * (--device all) reducing CPU tensors on the host path bit for bit, and
 * refusing f16 (only NCCL reduces it) on every member with one message;
 * and the same in a mixed group whose rank 0 declares CUDA tensors
 * (stand-in plugins), its worker staging them through host memory. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dispatch_client.h"
#include "dispatch_errors.h"
#include "group.h"
#include "group_nccl.h"
#include "helpers/group_proc.h"
#include "helpers/client_check.h"

#ifndef DSP_NCCL_BUILT
#define DSP_NCCL_BUILT 0
#endif

static void run(const char *cmd, char *out, size_t len) {
  FILE *p = popen(cmd, "r");
  cr_assert_not_null(p, "%s", cmd);
  size_t got = fread(out, 1, len - 1, p);
  out[got] = '\0';
  pclose(p);
}

Test(nccl, nccl_only_when_every_member_holds_cuda_tensors_and_nccl) {
  const sv_gplace cuda = {SV_GK_CUDA, 0, 1}, cuda1 = {SV_GK_CUDA, 1, 1};
  const sv_gplace cpu = {SV_GK_HOST, -1, 1}, no_nccl = {SV_GK_CUDA, 0, 0};
  sv_gplace p[3] = {cuda, cuda1, cuda};
  cr_assert_eq(sv_group_nccl_path(p, 3), 1, "all on CUDA with NCCL");
  cr_assert_eq(sv_group_nccl_path(p, 1), 1, "one rank on CUDA");
  for (int r = 0; r < 3; r++) {
    sv_gplace q[3] = {cuda, cuda1, cuda};
    q[r] = cpu;
    cr_assert_eq(sv_group_nccl_path(q, 3), 0, "rank %d on the CPU", r);
    q[r] = no_nccl;
    cr_assert_eq(sv_group_nccl_path(q, 3), 0, "rank %d without NCCL", r);
  }
  cr_assert_eq(sv_group_nccl_path(p, 0), 0, "no members");
}

Test(nccl, a_missing_plugin_is_refused_with_where_it_was_looked_for) {
  setenv("DISPATCH_NCCL_PLUGIN", "/nonexistent/dispatch-nccl.so", 1);
  const sv_nccl_api *api = (const sv_nccl_api *)1;
  const char *path = "x";
  char why[1024] = "";
  cr_assert_eq(sv_nccl_load(&api, &path, why, sizeof why),
               DISPATCH_EUNSUPPORTED);
  cr_assert_null(api);
  cr_assert_str_empty(path);
  cr_assert(strstr(why, "cannot load the NCCL plugin dispatch-nccl.so"), "%s",
            why);
  cr_assert(strstr(why, "/nonexistent/dispatch-nccl.so"), "%s", why);
  cr_assert(strstr(why, "DISPATCH_NCCL_PLUGIN names another"), "%s", why);
  cr_assert_null(strchr(why, '\n'), "one line: %s", why);
}

Test(nccl, a_stale_plugin_is_refused) {
  char fake[4096];
  beside_server("tests/fake-nccl-plugin.so", fake, sizeof fake);
  setenv("DISPATCH_NCCL_PLUGIN", fake, 1);
  const sv_nccl_api *api;
  const char *path;
  char why[1024] = "";
  cr_assert_eq(sv_nccl_load(&api, &path, why, sizeof why),
               DISPATCH_EUNSUPPORTED, "%s", why);
  cr_assert_null(api);
  cr_assert(strstr(why, "is not a dispatch NCCL plugin of ABI 1"), "%s", why);
  cr_assert(strstr(why, fake), "%s", why);
  cr_assert(strstr(why, "make build/dispatch-nccl.so"), "%s", why);
}

Test(nccl, the_built_plugin_loads_and_exports_its_entry_only) {
  char out[8192];
  /* the server never links NCCL or the CUDA runtime */
  char cmd[4200];
  snprintf(cmd, sizeof cmd, "readelf -d '%s' 2>&1 | grep NEEDED", check_server_bin());
  run(cmd, out, sizeof out);
  cr_assert(strstr(out, "libc.so"), "readelf: %s", out);
  cr_assert_null(strstr(out, "libnccl"), "%s", out);
  cr_assert_null(strstr(out, "libcudart"), "%s", out);
  if (!DSP_NCCL_BUILT) {
    cr_log_info("dispatch-nccl.so not built here (no nccl.h or CUDA=0)");
    return;
  }
  char plugin[4096];
  beside_server("dispatch-nccl.so", plugin, sizeof plugin);
  snprintf(cmd, sizeof cmd, "nm -D --defined-only '%s' | awk '{print $3}'",
           plugin);
  run(cmd, out, sizeof out);
  cr_assert_str_eq(out, "dispatch_nccl_engine_v1\n", "exports: %s", out);
  setenv("DISPATCH_NCCL_PLUGIN", plugin, 1);
  const sv_nccl_api *api;
  const char *path;
  char why[1024] = "";
  cr_assert_eq(sv_nccl_load(&api, &path, why, sizeof why), 0, "%s", why);
  cr_assert_str_eq(path, plugin);
  cr_assert_eq(api->abi, SV_NCCL_ABI);
  /* no GPU needed to ask the library its version */
  cr_assert_eq(strncmp(api->describe(), "NCCL 2.", 7), 0, "%s",
               api->describe());
}

static gp_group g_grp;
static void stop(void) {
  if (g_grp.pid) gp_stop(&g_grp);
}

/* A 2-rank group of `--device all` servers, opened; *grp set. */
static void open_pair(dispatch_group **grp) {
  const char *extra[] = {"--mpi-timeout", "5", "--device", "all", NULL};
  cr_assert_eq(gp_start(&g_grp, 2, extra), 0, "mpirun did not start 2 ranks");
  const char *specs[2] = {g_grp.specs[0], g_grp.specs[1]};
  char err[256] = "";
  cr_assert_eq(dispatch_group_open(specs, 2, NULL, grp, err, sizeof err), 0,
               "%s", err);
}

enum { N0 = 7, N1 = 300 };

/* Two f32 tensors per member in one request, summed then averaged: every
 * member ends with the local loop's bits (two members: exact). Then an f16
 * all-reduce, refused on both members with the same message, which names
 * `who` (the first member off the NCCL path); the group goes on. */
static void reduce_and_refuse_half(dispatch_group *grp, const char *who) {
  static float v[2][N0 + N1];
  uint16_t h[N0] = {0};
  int64_t s0[1] = {N0}, s1[1] = {N1};
  dispatch_tensor *t[4], *half[2];
  for (int r = 0; r < 2; r++) {
    for (int i = 0; i < N0 + N1; i++)
      v[r][i] = 0.1f * (float)(i + 1) * (float)(r + 3) - 7.0f;
    dispatch_device *dev = dispatch_group_device(grp, r);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s0, v[r],
                                           N0 * sizeof(float), &t[2 * r]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F32, 1, s1, v[r] + N0,
                                           N1 * sizeof(float), &t[2 * r + 1]), 0);
    cr_assert_eq(dispatch_tensor_from_data(dev, DISPATCH_F16, 1, s0, h,
                                           sizeof h, &half[r]), 0);
  }
  const int reds[2] = {DISPATCH_REDUCE_SUM, DISPATCH_REDUCE_MEAN};
  float want[N0 + N1];
  for (int i = 0; i < N0 + N1; i++) want[i] = v[0][i] + v[1][i];
  for (int k = 0; k < 2; k++) {
    cr_assert_eq(dispatch_group_allreduce(grp, t, 2, reds[k]), 0, "%s",
                 dispatch_device_errmsg(dispatch_group_device(grp, 0)));
    /* the mean reduces the sums again: (s + s) / 2 = s exactly */
    for (int r = 0; r < 2; r++) {
      float got[N0 + N1];
      cr_assert_eq(dispatch_tensor_read(t[2 * r], got, N0 * sizeof(float)), 0,
                   "rank %d: %s", r,
                   dispatch_device_errmsg(dispatch_group_device(grp, r)));
      cr_assert_eq(dispatch_tensor_read(t[2 * r + 1], got + N0,
                                        N1 * sizeof(float)), 0);
      cr_assert_eq(memcmp(got, want, sizeof got), 0, "rank %d, %s differs", r,
                   k ? "mean" : "sum");
    }
  }
  /* refused on every member alike, after the headers (all-reduces are
   * pipelined: the error comes back at the next sync) */
  cr_assert_eq(dispatch_group_allreduce(grp, half, 1, DISPATCH_REDUCE_SUM), 0);
  char msg[2][512];
  for (int r = 0; r < 2; r++) {
    dispatch_device *dev = dispatch_group_device(grp, r);
    int rc = dispatch_device_sync(dev);
    snprintf(msg[r], sizeof msg[r], "%s", dispatch_device_errmsg(dev));
    cr_assert_eq(rc, DISPATCH_EDTYPE, "rank %d: %d %s", r, rc, msg[r]);
    cr_assert(strstr(msg[r], "f16 tensors are reduced only through NCCL"),
              "rank %d: %s", r, msg[r]);
    cr_assert(strstr(msg[r], who), "rank %d: %s (want %s)", r, msg[r], who);
    dispatch_device_clear_error(dev);
  }
  cr_assert_str_eq(msg[0], msg[1], "the members' messages differ");
  cr_assert_eq(dispatch_group_allreduce(grp, t, 2, DISPATCH_REDUCE_SUM), 0);
  cr_assert_eq(dispatch_device_sync(dispatch_group_device(grp, 1)), 0,
               "the group after the refusal: %s",
               dispatch_device_errmsg(dispatch_group_device(grp, 1)));
  for (int i = 0; i < 4; i++) dispatch_tensor_free(t[i]);
  for (int r = 0; r < 2; r++) dispatch_tensor_free(half[r]);
}

/* --device all: cpu:0 first, then every GPU (none here); the group thread
 * loads the CUDA plugin and dispatch-nccl.so, and the CPU tensors still
 * take the host path */
Test(nccl, cpu_tensors_take_the_host_path_with_nccl_loaded, .fini = stop,
     .timeout = 120) {
  unsetenv("DISPATCH_NCCL_PLUGIN");
  dispatch_group *grp;
  open_pair(&grp);
  reduce_and_refuse_half(grp, "rank 0 holds them on the CPU");
  dispatch_group_close(grp);
}

/* A mixed group: rank 0's tensors declared CUDA tensors (a stand-in CUDA
 * plugin; their bytes are CPU storage) with NCCL loaded (a stand-in that
 * never starts), rank 1 on the CPU: the host path, rank 0's worker
 * staging its tensors when the group thread asks and writing the sums
 * back, exactly as a GPU member of a mixed group would. */
Test(nccl, a_mixed_group_stages_the_cuda_member_through_the_host,
     .fini = stop, .timeout = 120) {
  char cu[4096], nc[4096];
  beside_server("tests/fake-cuda-place.so", cu, sizeof cu);
  beside_server("tests/fake-nccl-host.so", nc, sizeof nc);
  setenv("DISPATCH_CUDA_PLUGIN", cu, 1);
  setenv("DISPATCH_NCCL_PLUGIN", nc, 1);
  dispatch_group *grp;
  open_pair(&grp);
  reduce_and_refuse_half(grp, "rank 1 holds them on the CPU");
  dispatch_group_close(grp);
}
